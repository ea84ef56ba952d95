"""``tightpack verify``: check that a packed dataset is right, and name every fault with its row.

Works on tightpack output folders, Megatron-Bridge's packed Parquet (files, folders, globs) and legacy
``.npy`` files. Rows are read one row group at a time as flat columns and checked with vectorized
arithmetic, so any size verifies in bounded memory. Checks:

- ``complete``: the folder is not the work folder of an unfinished ``tightpack pack`` run.
- ``read``: every row group decodes (an unreadable one is named and skipped).
- ``row``: the reference's row invariants (contract 2.7): loss_mask as long as input_ids,
  seq_start_id non-empty, starting at 0, within the row, non-decreasing; and no empty sequence.
- ``mask``: loss_mask values are 0 or 1, and label-aligned: the last stored token of a sequence has
  nothing to predict, so its mask is 0; with ``seq_len``, the alignment padding is not supervised.
- ``width``: the runtime tokens of a row fit the pack size.
- ``alignment``: every sequence's runtime length is a multiple of the alignment multiple.
- ``cp``: with ``cp`` > 1, every segment, and the trailing width segment of fixed-width packs, is
  divisible by ``2 * cp`` (contract 6).
- ``metadata``: metadata.json agrees with the rows (max samples per bin, dataset max length, min
  packed length, pack size, packing factor and efficiency).
- ``manifest``: the manifest's files exist with their sha256, sizes and row counts; its counts agree
  with the rows.
- ``coverage``: with ``sample_index``, no source sample is packed twice and, with a manifest, every
  source row is either packed or accounted for (bad, dropped, no supervised token).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core import legacy_npy
from tightpack.core.checksums import file_digest
from tightpack.core.packed_index import REQUIRED_COLUMNS, check_shards, flat_list_column
from tightpack.core.paths import packed_dataset_files
from tightpack.errors import TightpackError
from tightpack.inspect import read_manifest

__all__ = ["VerifyReport", "Violation", "verify_packed"]

MANIFEST_NAME, METADATA_NAME = "manifest.json", "metadata.json"


@dataclass
class Violation:
    """One fault: which check, what is wrong, and where (file, pack row, sequence within the row)."""

    check: str
    message: str
    file: str | None = None
    row: int | None = None
    sequence: int | None = None

    def __str__(self) -> str:
        where = ", ".join(
            f"{name} {value}"
            for name, value in (("file", self.file), ("row", self.row), ("sequence", self.sequence))
            if value is not None
        )
        return f"[{self.check}] {where + ': ' if where else ''}{self.message}"


@dataclass
class VerifyReport:
    """Every fault found (at most ``limit`` listed per check; ``counts`` has the totals) and what was read."""

    path: str
    settings: dict[str, Any]
    checked: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    limit: int = 20

    @property
    def ok(self) -> bool:
        return not self.counts

    def add(self, check: str, message: str, **where: Any) -> None:
        self.counts[check] += 1
        if self.counts[check] <= self.limit:
            self.violations.append(Violation(check, message, **where))

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "settings": self.settings,
            "checked": self.checked,
            "violations": [asdict(v) for v in self.violations],
            "counts": dict(self.counts),
        }


@dataclass
class _Rows:
    """A run of rows as flat columns: values plus per-row offsets (CSR)."""

    file: str
    first_row: int
    ids: np.ndarray
    ids_offsets: np.ndarray
    mask: np.ndarray
    mask_offsets: np.ndarray
    starts: np.ndarray
    start_offsets: np.ndarray
    sample_index: np.ndarray | None = None
    seq_len: np.ndarray | None = None
    seq_len_offsets: np.ndarray | None = None


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, per-row offsets) of a list column."""
    values, lengths = flat_list_column(column)
    return values.astype(np.int64), np.concatenate(([0], np.cumsum(lengths)))


def _parquet_rows(path: str, report: VerifyReport, totals: _Totals) -> Iterator[_Rows]:
    """Row groups of a Parquet shard; one that cannot be decoded is reported, counted and skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    extra = [name for name in ("sample_index", "seq_len") if name in parquet.schema_arrow.names]
    name = Path(path).name
    for group in range(parquet.num_row_groups):
        first_row = totals.rows + totals.unread  # rows before this group, checked or not
        try:
            table = parquet.read_row_group(group, columns=[*REQUIRED_COLUMNS, *extra])
        except (OSError, pa.ArrowException) as error:
            rows = parquet.metadata.row_group(group).num_rows
            report.add(
                "read",
                f"cannot decode row group {group} (rows {first_row}..{first_row + rows - 1}): {error}",
                file=name,
                row=first_row,
            )
            totals.unread += rows
            continue
        ids, ids_offsets = _flat(table.column("input_ids"))
        mask, mask_offsets = _flat(table.column("loss_mask"))
        starts, start_offsets = _flat(table.column("seq_start_id"))
        rows = _Rows(name, first_row, ids, ids_offsets, mask, mask_offsets, starts, start_offsets)
        if "sample_index" in extra:
            rows.sample_index = _flat(table.column("sample_index"))[0]
        if "seq_len" in extra:
            rows.seq_len, rows.seq_len_offsets = _flat(table.column("seq_len"))
        yield rows


def _npy_rows(path: str, first_row: int) -> Iterator[_Rows]:
    rows = legacy_npy.read_legacy_npy(path)

    def flat(key: str) -> tuple[np.ndarray, np.ndarray]:
        parts = [np.asarray(row[key], dtype=np.int64).ravel() for row in rows]
        offsets = np.concatenate(([0], np.cumsum([len(p) for p in parts]))).astype(np.int64)
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), offsets

    batch = _Rows(Path(path).name, first_row, *flat("input_ids"), *flat("loss_mask"), *flat("seq_start_id"))
    if rows and all("sample_index" in row for row in rows):
        batch.sample_index = flat("sample_index")[0]
    if rows and all("seq_len" in row for row in rows):
        batch.seq_len, batch.seq_len_offsets = flat("seq_len")
    yield batch


class _Totals:
    """What the metadata, manifest and coverage checks compare against, summed over all rows."""

    def __init__(self) -> None:
        self.rows = self.sequences = self.runtime = self.supervised = 0
        self.unread = 0
        self.max_sequences = self.max_length = 0
        self.min_load: int | None = None
        self.sample_index: list[np.ndarray] = []
        self.sample_rows: list[np.ndarray] = []


def _check_rows(batch: _Rows, settings: dict[str, Any], report: VerifyReport, totals: _Totals) -> None:
    file = batch.file
    row_len = np.diff(batch.ids_offsets)
    num_rows = len(row_len)
    counts = np.diff(batch.start_offsets)
    row_of_seq = np.repeat(np.arange(num_rows), counts)
    bad = np.zeros(num_rows, dtype=bool)

    position = np.arange(len(batch.starts)) - batch.start_offsets[row_of_seq]
    same_row = row_of_seq[1:] == row_of_seq[:-1]

    def unsound_rows(selected: np.ndarray, message) -> None:
        for row in np.flatnonzero(selected):
            report.add("row", message(row), file=file, row=batch.first_row + int(row))
        bad[selected] = True

    def unsound_sequences(selected: np.ndarray, message) -> None:
        for seq in np.flatnonzero(selected):
            row = batch.first_row + int(row_of_seq[seq])
            report.add("row", message(seq), file=file, row=row, sequence=int(position[seq]))
        bad[row_of_seq[selected]] = True

    mask_len = np.diff(batch.mask_offsets)
    unsound_rows(
        mask_len != row_len, lambda r: f"loss_mask length ({mask_len[r]}) != input_ids length ({row_len[r]})"
    )
    unsound_rows(counts == 0, lambda r: "seq_start_id must start with 0 (it is empty)")
    first = np.zeros(num_rows, dtype=np.int64)
    first[counts > 0] = batch.starts[batch.start_offsets[:-1][counts > 0]]
    unsound_rows(first != 0, lambda r: f"seq_start_id must start with 0, got {first[r]}")
    unsound_sequences(
        batch.starts >= row_len[row_of_seq],
        lambda s: f"seq_start_id[{position[s]}]={batch.starts[s]} >= len(input_ids)={row_len[row_of_seq[s]]}",
    )
    decreasing = np.zeros(len(batch.starts), dtype=bool)
    decreasing[1:] = same_row & (np.diff(batch.starts) < 0)
    unsound_sequences(decreasing, lambda s: f"seq_start_id is not non-decreasing at index {position[s]}")

    # Sequences of structurally sound rows: global [start, end) over the flat token columns.
    good_seq = ~bad[row_of_seq]
    has_next = np.zeros(len(batch.starts), dtype=bool)
    has_next[:-1] = same_row
    next_start = row_len[row_of_seq].copy()
    next_start[has_next] = batch.starts[1:][same_row]
    stored = next_start - batch.starts
    # Token positions of each sequence in the flat loss_mask column (clipped for unsound rows).
    end = np.minimum(batch.mask_offsets[row_of_seq] + next_start, len(batch.mask))
    begin = np.minimum(batch.mask_offsets[row_of_seq] + batch.starts, end)
    runtime = stored - 1

    def each(check: str, selected: np.ndarray, message) -> None:
        for seq in np.flatnonzero(selected & good_seq):
            report.add(
                check,
                message(seq),
                file=file,
                row=batch.first_row + int(row_of_seq[seq]),
                sequence=int(position[seq]),
            )

    each(
        "row",
        stored < 2,
        lambda s: f"empty sequence ({stored[s]} stored tokens; a sequence stores its tokens + 1)",
    )
    valid = good_seq & (stored >= 2)
    values_bad = ~np.isin(batch.mask, (0, 1))
    if values_bad.any():
        where = np.searchsorted(batch.mask_offsets, np.flatnonzero(values_bad), side="right") - 1
        for row in np.unique(where):
            report.add(
                "mask", "loss_mask holds values other than 0 and 1", file=file, row=batch.first_row + int(row)
            )
    mask_ok = np.zeros(len(begin), dtype=bool)
    mask_ok[valid] = batch.mask[end[valid] - 1] == 0
    each(
        "mask",
        valid & ~mask_ok,
        lambda s: (
            "loss_mask is 1 at the last stored token of the sequence: the mask is not label-aligned "
            "(position t must train on token t+1, so a sequence's last position has no target)"
        ),
    )

    multiple = settings.get("multiple") or 1
    if multiple > 1:
        each(
            "alignment",
            valid & (runtime % multiple != 0),
            lambda s: f"runtime length {runtime[s]} is not a multiple of the alignment multiple {multiple}",
        )
    cp = settings.get("cp") or 1
    if cp > 1:
        each(
            "cp",
            valid & (runtime % (2 * cp) != 0),
            lambda s: (
                f"runtime length {runtime[s]} is not divisible by 2 * cp = {2 * cp}: context-parallel "
                f"slicing needs every segment aligned (pack with pad_seq_to_mult a multiple of {2 * cp})"
            ),
        )

    if batch.seq_len is not None:
        if not np.array_equal(np.diff(batch.seq_len_offsets), counts):
            report.add("row", "seq_len does not hold one length per sequence", file=file, row=batch.first_row)
        else:
            real = batch.seq_len
            each(
                "row",
                valid & ((real < 1) | (real > runtime)),
                lambda s: f"seq_len {real[s]} is outside [1, runtime length {runtime[s]}]",
            )
            # The alignment padding of a sequence, positions [begin + seq_len, end), trains on nothing.
            tail = valid & (real >= 1) & (real < runtime)
            cumulative = np.concatenate(([0], np.cumsum(batch.mask != 0)))
            supervised_tail = cumulative[end] - cumulative[np.minimum(begin + real, end)]
            each(
                "mask",
                tail & (supervised_tail > 0),
                lambda s: (
                    f"loss_mask supervises {supervised_tail[s]} alignment padding tokens after "
                    f"seq_len {real[s]}"
                ),
            )

    loads = np.bincount(row_of_seq[valid], weights=runtime[valid], minlength=num_rows).astype(np.int64)
    pack_size = settings.get("pack_size")
    if pack_size:
        for row in np.flatnonzero(~bad & (loads > pack_size)):
            report.add(
                "width",
                f"the row holds {loads[row]} runtime tokens, above the pack size {pack_size}",
                file=file,
                row=batch.first_row + int(row),
            )
        if cp > 1 and settings.get("pad_to_max_length"):
            trailing = pack_size - loads
            for row in np.flatnonzero(~bad & (trailing > 0) & (trailing % (2 * cp) != 0)):
                report.add(
                    "cp",
                    f"the trailing width segment ({trailing[row]} tokens up to the pack size "
                    f"{pack_size}) is not divisible by 2 * cp = {2 * cp}",
                    file=file,
                    row=batch.first_row + int(row),
                )

    sound = ~bad
    totals.rows += num_rows
    totals.sequences += int(counts[sound].sum())
    totals.runtime += int(loads[sound].sum())
    totals.supervised += int((batch.mask != 0).sum())
    if sound.any():
        totals.max_sequences = max(totals.max_sequences, int(counts[sound].max()))
        low = int(loads[sound].min())
        totals.min_load = low if totals.min_load is None else min(totals.min_load, low)
    if valid.any():
        totals.max_length = max(totals.max_length, int(runtime[valid].max()))
    if batch.sample_index is not None and len(batch.sample_index) == len(batch.starts):
        totals.sample_index.append(batch.sample_index)
        totals.sample_rows.append(batch.first_row + row_of_seq)


def _check_metadata(
    entries: list[dict], settings: dict[str, Any], totals: _Totals, report: VerifyReport
) -> None:
    if not entries or totals.rows == 0:
        return
    actual = {
        "max_samples_per_bin": totals.max_sequences,
        "dataset_max_seqlen": totals.max_length,
        "min_packed_seqlen": totals.min_load,
        "packing_factor": round(totals.sequences / totals.rows, 2),
    }
    pack_size = settings.get("pack_size")
    if pack_size:
        actual["pack_size"] = pack_size
        actual["packing_efficiency"] = round(totals.runtime / (totals.rows * pack_size) * 100, 2)
    if len(entries) == 1:
        for key, value in actual.items():
            if key in entries[0] and entries[0][key] != value:
                report.add("metadata", f"{METADATA_NAME} says {key}={entries[0][key]}, the rows give {value}")
        return
    # Several splits in one file: check what the runtime takes from it (maxima and minimum).
    for key, bound, worse in (
        ("max_samples_per_bin", max, lambda said, real: said < real),
        ("dataset_max_seqlen", max, lambda said, real: said < real),
        ("min_packed_seqlen", min, lambda said, real: said > real),
    ):
        said = bound(entry.get(key, 0) for entry in entries)
        if worse(said, actual[key]):
            report.add(
                "metadata",
                f"{METADATA_NAME} gives {key}={said} over its entries, the rows give {actual[key]}",
            )


def _check_manifest(
    folder: Path, manifest: dict, files: list[str], totals: _Totals, report: VerifyReport
) -> None:
    listed = {entry["name"]: entry for entry in manifest.get("files", [])}
    present = {Path(file).name for file in files}
    for name in sorted(present - set(listed)):
        report.add("manifest", "the file is not in the manifest (left over from another run?)", file=name)
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            report.add("manifest", "the manifest lists this file but it is missing", file=name)
            continue
        digest = file_digest(path)
        for key in ("sha256", "bytes"):
            if key in entry and entry[key] != digest[key]:
                report.add(
                    "manifest", f"{key} differs from the manifest: the file changed after packing", file=name
                )
    stats, counts = manifest.get("stats", {}), manifest.get("counts", {})
    for said, actual, what in (
        (stats.get("packs"), totals.rows, "packs"),
        (counts.get("packed"), totals.sequences, "packed sequences"),
        (stats.get("tokens"), totals.runtime, "runtime tokens"),
        (counts.get("supervised_packed"), totals.supervised, "supervised tokens"),
    ):
        if said is not None and said != actual:
            report.add("manifest", f"the manifest counts {said} {what}, the rows hold {actual}")


def _check_coverage(manifest: dict | None, totals: _Totals, report: VerifyReport) -> None:
    if not totals.sample_index:
        return
    indices = np.concatenate(totals.sample_index)
    rows = np.concatenate(totals.sample_rows)
    order = np.argsort(indices, kind="stable")
    repeated = np.flatnonzero(np.diff(indices[order]) == 0) + 1
    for at in repeated:
        first, again = rows[order[at - 1]], rows[order[at]]
        report.add(
            "coverage",
            f"source sample {indices[order[at]]} is packed twice (rows {first} and {again})",
            row=int(again),
        )
    if manifest is None:
        return
    counts, excluded = manifest.get("counts", {}), manifest.get("excluded", {})
    if "samples_in" not in counts:
        return
    accounted = np.zeros(counts["samples_in"], dtype=bool)
    for reason in ("dropped_long", "no_supervised"):
        accounted[np.asarray(excluded.get(reason, []), dtype=np.int64)] = True
    accounted[np.asarray([bad["sample_index"] for bad in manifest.get("bad_rows", [])], dtype=np.int64)] = (
        True
    )
    inside = indices[(indices >= 0) & (indices < len(accounted))]
    outside = indices[(indices < 0) | (indices >= len(accounted))]
    for index in outside[:5]:
        report.add("coverage", f"sample_index {index} is not a source row (the source has {len(accounted)})")
    accounted[inside] = True
    for index in np.flatnonzero(~accounted):
        report.add("coverage", f"source row {index} is neither packed nor accounted for in the manifest")


def verify_packed(
    path: str | Path,
    *,
    pack_size: int | None = None,
    multiple: int | None = None,
    cp: int | None = None,
    metadata: str | Path | None = None,
    limit: int = 20,
) -> VerifyReport:
    """Check a packed dataset (a tightpack folder, Megatron-Bridge Parquet, or legacy ``.npy``).

    Settings not given come from the folder's manifest: pack size, alignment multiple, fixed width.
    ``metadata`` defaults to the folder's ``metadata.json``. At most ``limit`` faults are listed per
    check; ``report.counts`` holds the totals. Unreadable input raises `TightpackError`.

    Example::

        report = verify_packed("packed/", cp=2)
        print(report.ok, report.counts)
    """
    path = Path(path)
    folder = path if path.is_dir() else None
    if folder is not None and (folder / ".pid").is_file():
        report = VerifyReport(str(path), {})
        report.add(
            "complete", "this is the work folder of a `tightpack pack` run that did not finish, not a dataset"
        )
        return report
    manifest, manifest_fault = None, None
    if folder is not None and (folder / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(folder / MANIFEST_NAME)
        except TightpackError as error:
            manifest_fault = str(error)
    saved = (manifest or {}).get("settings", {})
    settings = {
        "pack_size": pack_size or saved.get("packed_sequence_size"),
        "multiple": multiple or saved.get("pad_seq_to_mult"),
        "cp": cp,
        "pad_to_max_length": bool(saved.get("pad_to_max_length", False)),
    }
    entries: list[dict] = []
    metadata_path = Path(metadata) if metadata else (folder / METADATA_NAME if folder else None)
    if metadata_path is not None and metadata_path.is_file():
        try:
            loaded = json.loads(metadata_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TightpackError(f"{metadata_path}: not readable metadata ({error})") from error
        entries = loaded if isinstance(loaded, list) else [loaded]
        if not all(isinstance(entry, dict) for entry in entries):
            raise TightpackError(f"{metadata_path}: metadata must be a JSON list of objects")
        settings["pack_size"] = (
            settings["pack_size"]
            or max((entry.get("pack_size") or 0 for entry in entries), default=0)
            or None
        )
    elif metadata is not None:
        raise TightpackError(f"metadata file not found: {metadata}")

    files = packed_dataset_files(path)
    report = VerifyReport(str(path), settings, limit=limit)
    if manifest_fault is not None:
        report.add("manifest", manifest_fault)
    if not files[0].lower().endswith(".npy"):
        check_shards(files, name=str(path))
    totals = _Totals()
    for file in files:
        if file.lower().endswith(".npy"):
            batches = _npy_rows(file, totals.rows)
        else:
            batches = _parquet_rows(file, report, totals)
        for batch in batches:
            _check_rows(batch, settings, report, totals)
    _check_metadata(entries, settings, totals, report)
    if manifest is not None:
        _check_manifest(folder, manifest, files, totals, report)
    _check_coverage(manifest, totals, report)
    report.checked = {
        "files": len(files),
        "rows": totals.rows,
        "unreadable_rows": totals.unread,
        "sequences": totals.sequences,
        "runtime_tokens": totals.runtime,
        "supervised_tokens": totals.supervised,
    }
    return report
