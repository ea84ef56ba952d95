"""The checks that read rows: a seeded sample of packs without a manifest, every row with ``--deep`` (D8),
and the token ids of the rows read (D10)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tightpack.errors import TightpackError
from tightpack.reports.summary import sequence_runtime
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.repack import lowered, repack_fix
from tightpack.stale_packs.rules import SAMPLE_ROWS, SPECS
from tightpack.stale_packs.tokenizer import configured_vocabulary

_SAMPLE_SEED = 0


def sample_split(context: CheckContext, split: CheckedSplit, *, report: bool) -> CheckedSplit:
    """Without a manifest: a seeded sample of rows (all with ``deep``), for the metadata check (D6)
    and, when ``report``, checked for alignment to k and for the width (D8); D10 checks its token ids.

    Returns the split with what the rows tell: their count, the rows read and the stats D6 compares.
    """
    sample = _sample_rows(split.files, None if context.deep else SAMPLE_ROWS)
    split = dataclasses.replace(split, rows=sample.rows, rows_read=sample.read)
    if sample.read == 0:
        return split
    if split.pack_size is None:  # no metadata either: the longest row is all the packs tell
        context.notes.append(
            f"{split.name}: no manifest or metadata pack_size; the longest sampled row has "
            f"{int(sample.loads.max())} runtime tokens"
        )
    check_token_ids(context, split, sample)
    split = dataclasses.replace(
        split,
        stats={
            "max_samples_per_bin": int(sample.counts.max()),
            "dataset_max_seqlen": int(sample.runtime.max()) if len(sample.runtime) else 0,
            "min_packed_seqlen": int(sample.loads.min()),
        },
    )
    if not report:
        return split
    k = context.k
    what = f"{sample.read:,} sampled rows of {sample.rows:,}"
    bad = np.flatnonzero(sample.runtime % k != 0) if k > 1 else np.zeros(0, np.int64)
    if len(bad):
        first = bad[0]
        aligned = int(np.gcd.reduce(sample.runtime[sample.runtime > 0])) if len(sample.runtime) else 1
        context.add(
            "D8",
            "error",
            f"{split.name} packs {split.path}: {len(bad):,} segments of {what} are not divisible by "
            f"{k} ({context.origin()}); e.g. {sample.where(first)} has runtime length "
            f"{int(sample.runtime[first])} (the sampled segments share the multiple {aligned}).",
            repack_fix(context, split),
        )
    size = context.configured_p
    if size and size > 0 and (sample.loads > size).any():
        over = np.flatnonzero(sample.loads > size)
        context.add(
            "D8",
            "error",
            f"{split.name} packs {split.path}: {len(over):,} of {what} hold more than "
            f"{SPECS}.packed_sequence_size {size} runtime tokens (up to {int(sample.loads.max())}).",
            repack_fix(context, split),
        )
    return split


def check_token_ids(context: CheckContext, split: CheckedSplit, sample: _Sample) -> None:
    """D10: every id read lies in the configured tokenizer's vocabulary (packs without a manifest,
    whose tokenizer is otherwise unknown)."""
    vocabulary = configured_vocabulary(context)
    if vocabulary is None:
        return
    size, key, value = vocabulary
    outside = np.flatnonzero(sample.max_ids >= size)
    if not len(outside):
        return
    first = int(outside[0])
    what = (
        f"the {sample.rows:,} rows"
        if sample.read == sample.rows
        else f"{sample.read:,} sampled rows of {sample.rows:,}"
    )
    context.add(
        "D10",
        "error",
        f"{split.name} packs {split.path}: {len(outside):,} of {what} hold token ids outside the "
        f"{size:,}-token vocabulary of {key} {value!r} (ids up to {int(sample.max_ids.max()):,}; e.g. "
        f"{sample.row_where(first)} holds {int(sample.max_ids[first]):,}): the packs were tokenized with "
        "another tokenizer, and the embedding lookup fails on them (IndexError; a device-side assert on "
        "a GPU).",
        f"Configure the tokenizer the packs were made with ({key}), or {lowered(repack_fix(context, split))}",
    )


def read_every_row(context: CheckContext, split: CheckedSplit) -> CheckedSplit:
    """``deep``: every row checked by `tightpack.verify.verify_packed` (D8); returns the split with its
    row count."""
    from tightpack.verify import verify_packed

    configured_p = context.configured_p
    # multiple=k checks every segment against 2*CP and CP*TP at once, so cp is not passed (it would
    # report the same segments twice); the trailing width segment is T1's, from the configuration.
    report = verify_packed(
        split.path,
        pack_size=configured_p if configured_p and configured_p > 0 else None,
        multiple=context.k,
    )
    rows = report.checked.get("rows", 0)
    split = dataclasses.replace(split, rows=rows, rows_read=rows)
    by_check: dict[str, list] = {}
    for violation in report.violations:
        by_check.setdefault(violation.check, []).append(violation)
    for check, count in report.counts.items():
        if check in ("manifest", "metadata") or (check == "alignment" and split.misaligned):
            continue  # D9 checks the files (sha256 under deep), D5/D6 the metadata, D3 the multiple
        first = by_check.get(check, [None])[0]
        context.add(
            "D8",
            "error",
            f"{split.name} packs {split.path}: {count:,} faults of the {check!r} check over every row "
            f"(k = {context.k}, pack size {configured_p}); first: {first}",
            repack_fix(context, split),
        )
    return split


@dataclass
class _Sample:
    """Rows read: per segment its runtime length and place (file, row, position); per row its runtime
    tokens and sequence count."""

    rows: int = 0
    read: int = 0
    runtime: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    loads: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    max_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per row read
    places: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)  # per group read
    row_places: list[tuple[str, int, int]] = field(default_factory=list)  # (file, first row, rows) per group

    def row_where(self, row: int) -> str:
        for file, first, count in self.row_places:
            if row < count:
                return f"{Path(file).name} row {first + row}"
            row -= count
        raise IndexError(row)

    def where(self, segment: int) -> str:
        for file, rows, positions in self.places:
            if segment < len(rows):
                return f"{Path(file).name} row {int(rows[segment])} sequence {int(positions[segment])}"
            segment -= len(rows)
        raise IndexError(segment)


def _sample_rows(files: list[str], budget: int | None) -> _Sample:
    """Whole row groups in a fixed random order (seed 0) until ``budget`` rows are read (None: all)."""
    groups = list(_row_groups(files))
    sample = _Sample(rows=sum(rows for _, _, rows, _ in groups))
    rng = np.random.default_rng(_SAMPLE_SEED)
    runtime, loads, counts, max_ids = [], [], [], []
    for index in rng.permutation(len(groups)):
        if budget is not None and sample.read >= budget:
            break
        file, group, _, first_row = groups[index]
        lengths, starts, per_row, row_max = _read_group(file, group)
        if budget is not None:
            keep = min(len(lengths), budget - sample.read)
            lengths, per_row, row_max = lengths[:keep], per_row[:keep], row_max[:keep]
            starts = starts[: int(per_row.sum())]
        offsets = np.concatenate(([0], np.cumsum(per_row))).astype(np.int64)
        row_of_seq = np.repeat(np.arange(len(lengths)), per_row)
        seq_runtime = sequence_runtime(lengths, starts, offsets)
        runtime.append(seq_runtime)
        loads.append(np.bincount(row_of_seq, weights=seq_runtime, minlength=len(lengths)).astype(np.int64))
        counts.append(per_row)
        max_ids.append(row_max)
        sample.places.append((file, first_row + row_of_seq, np.arange(len(starts)) - offsets[row_of_seq]))
        sample.row_places.append((file, first_row, len(lengths)))
        sample.read += len(lengths)
    if sample.read:
        sample.runtime = np.concatenate(runtime).astype(np.int64)
        sample.loads, sample.counts = np.concatenate(loads), np.concatenate(counts).astype(np.int64)
        sample.max_ids = np.concatenate(max_ids)
    return sample


def _row_groups(files: list[str]) -> Iterator[tuple[str, int, int, int]]:
    """(file, row group, rows, its first row in the file) of every row group; a ``.npy`` file is one."""
    for file in files:
        if file.lower().endswith(".npy"):
            from tightpack.core import legacy_npy

            yield file, 0, len(legacy_npy.read_legacy_npy(file)), 0
            continue
        import pyarrow.parquet as pq

        metadata = pq.ParquetFile(file).metadata
        first = 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            yield file, group, rows, first
            first += rows


def _read_group(file: str, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(stored length per row, seq_start_id values flat, sequences per row, largest id per row) of a row
    group (an empty row's largest id is -1)."""
    if file.lower().endswith(".npy"):
        from tightpack.core import legacy_npy

        rows = legacy_npy.read_legacy_npy(file)
        starts = [np.asarray(row["seq_start_id"], dtype=np.int64).ravel() for row in rows]
        ids = [np.asarray(row["input_ids"], dtype=np.int64).ravel() for row in rows]
        return (
            np.array([part.size for part in ids], dtype=np.int64),
            np.concatenate(starts) if starts else np.zeros(0, np.int64),
            np.array([len(part) for part in starts], dtype=np.int64),
            np.array([part.max() if part.size else -1 for part in ids], dtype=np.int64),
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tightpack.core.packed_index import flat_list_column

    try:
        table = pq.ParquetFile(file).read_row_group(group, columns=["input_ids", "seq_start_id"])
    except (OSError, pa.ArrowException) as error:
        raise TightpackError(f"{file}: cannot read row group {group} ({error})") from error
    ids, lengths = flat_list_column(table.column("input_ids"))
    starts, per_row = flat_list_column(table.column("seq_start_id"))
    return lengths.astype(np.int64), starts.astype(np.int64), per_row.astype(np.int64), _row_max(ids, lengths)


def _row_max(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The largest value of each row of a flat list column (-1 for an empty row)."""
    out = np.full(len(lengths), -1, dtype=np.int64)
    filled = lengths > 0
    if filled.any():
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out[filled] = np.maximum.reduceat(values.astype(np.int64, copy=False), offsets[filled])
    return out
