"""The row checks of ``tightpack verify``: rows read as flat columns, checked with vectorized arithmetic.

`parquet_rows` and `npy_rows` yield `Rows` (one row group at a time); `check_rows` runs every row check
on them in report order and adds what they hold to the `Totals` the file-level checks compare against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core import legacy_npy
from tightpack.core.packed_index import REQUIRED_COLUMNS, flat_list_column
from tightpack.verify.report import VerifyReport

_NOT_BINARY = "loss_mask holds values other than 0 and 1"
_NOT_LABEL_ALIGNED = (
    "loss_mask is 1 at the last stored token of the sequence: the mask is not label-aligned "
    "(position t must train on token t+1, so a sequence's last position has no target)"
)


@dataclass
class Rows:
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


def parquet_rows(path: str, report: VerifyReport, totals: Totals) -> Iterator[Rows]:
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
        rows = Rows(name, first_row, ids, ids_offsets, mask, mask_offsets, starts, start_offsets)
        if "sample_index" in extra:
            rows.sample_index = _flat(table.column("sample_index"))[0]
        if "seq_len" in extra:
            rows.seq_len, rows.seq_len_offsets = _flat(table.column("seq_len"))
        yield rows


def npy_rows(path: str, first_row: int) -> Iterator[Rows]:
    rows = legacy_npy.read_legacy_npy(path)

    def flat(key: str) -> tuple[np.ndarray, np.ndarray]:
        parts = [np.asarray(row[key], dtype=np.int64).ravel() for row in rows]
        offsets = np.concatenate(([0], np.cumsum([len(p) for p in parts]))).astype(np.int64)
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), offsets

    batch = Rows(Path(path).name, first_row, *flat("input_ids"), *flat("loss_mask"), *flat("seq_start_id"))
    if rows and all("sample_index" in row for row in rows):
        batch.sample_index = flat("sample_index")[0]
    if rows and all("seq_len" in row for row in rows):
        batch.seq_len, batch.seq_len_offsets = flat("seq_len")
    yield batch


class Totals:
    """What the metadata, manifest, coverage and mixture checks compare against, summed over all rows.

    ``sample_index`` and ``sample_rows`` hold every sequence's source row and pack row, one array per
    batch (batches without ``sample_index`` are counted in ``unindexed``). With ``per_sequence`` (a
    mixture's manifest), ``sequence_tokens`` and ``sequence_supervised`` hold its runtime tokens
    (``seq_len`` where stored) and supervised tokens alongside.
    """

    def __init__(self, *, per_sequence: bool = False) -> None:
        self.rows = self.sequences = self.runtime = self.supervised = 0
        self.unread = self.unindexed = 0
        self.max_sequences = self.max_length = 0
        self.min_load: int | None = None
        self.sample_index: list[np.ndarray] = []
        self.sample_rows: list[np.ndarray] = []
        self.per_sequence = per_sequence
        self.sequence_tokens: list[np.ndarray] = []
        self.sequence_supervised: list[np.ndarray] = []


class _Layout:
    """One batch of rows with the per-row and per-sequence arrays every check reads.

    The structural checks (`_check_structure`) mark rows ``bad``; the per-sequence checks look only at
    sequences of sound rows, whose token span in the flat columns is ``[begin, end)``.
    """

    def __init__(self, batch: Rows, report: VerifyReport) -> None:
        self.batch, self.report = batch, report
        self.row_len = np.diff(batch.ids_offsets)
        self.counts = np.diff(batch.start_offsets)
        self.row_of_seq = np.repeat(np.arange(len(self.row_len)), self.counts)
        self.position = np.arange(len(batch.starts)) - batch.start_offsets[self.row_of_seq]
        self.same_row = self.row_of_seq[1:] == self.row_of_seq[:-1]
        self.bad = np.zeros(len(self.row_len), dtype=bool)

    def flag_rows(self, check: str, selected: np.ndarray, message: Callable[[int], str]) -> None:
        for row in np.flatnonzero(selected):
            self.report.add(check, message(row), file=self.batch.file, row=self.batch.first_row + int(row))

    def flag_sequences(self, check: str, selected: np.ndarray, message: Callable[[int], str]) -> None:
        for seq in np.flatnonzero(selected):
            row = self.batch.first_row + int(self.row_of_seq[seq])
            self.report.add(
                check, message(seq), file=self.batch.file, row=row, sequence=int(self.position[seq])
            )

    def seal(self) -> None:
        """Fix the spans of the sequences of sound rows, once the structural checks have run."""
        starts, row_of_seq = self.batch.starts, self.row_of_seq
        self.sound_seq = ~self.bad[row_of_seq]
        has_next = np.zeros(len(starts), dtype=bool)
        has_next[:-1] = self.same_row
        next_start = self.row_len[row_of_seq].copy()
        next_start[has_next] = starts[1:][self.same_row]
        self.stored = next_start - starts
        self.runtime = self.stored - 1
        # Token positions of each sequence in the flat loss_mask column (clipped for unsound rows).
        mask_offsets = self.batch.mask_offsets[row_of_seq]
        self.end = np.minimum(mask_offsets + next_start, len(self.batch.mask))
        self.begin = np.minimum(mask_offsets + starts, self.end)
        self.valid = self.sound_seq & (self.stored >= 2)
        self.loads = np.bincount(
            row_of_seq[self.valid], weights=self.runtime[self.valid], minlength=len(self.row_len)
        ).astype(np.int64)


def _check_structure(rows: _Layout) -> None:
    """Row shape and ``seq_start_id``: a row failing one is unsound and skipped by the later checks."""
    batch, row_len, counts = rows.batch, rows.row_len, rows.counts

    def unsound_rows(selected: np.ndarray, message: Callable[[int], str]) -> None:
        rows.flag_rows("row", selected, message)
        rows.bad[selected] = True

    def unsound_sequences(selected: np.ndarray, message: Callable[[int], str]) -> None:
        rows.flag_sequences("row", selected, message)
        rows.bad[rows.row_of_seq[selected]] = True

    mask_len = np.diff(batch.mask_offsets)
    unsound_rows(
        mask_len != row_len, lambda r: f"loss_mask length ({mask_len[r]}) != input_ids length ({row_len[r]})"
    )
    unsound_rows(counts == 0, lambda r: "seq_start_id must start with 0 (it is empty)")
    first = np.zeros(len(row_len), dtype=np.int64)
    first[counts > 0] = batch.starts[batch.start_offsets[:-1][counts > 0]]
    unsound_rows(first != 0, lambda r: f"seq_start_id must start with 0, got {first[r]}")
    position, row_of_seq = rows.position, rows.row_of_seq
    unsound_sequences(
        batch.starts >= row_len[row_of_seq],
        lambda s: f"seq_start_id[{position[s]}]={batch.starts[s]} >= len(input_ids)={row_len[row_of_seq[s]]}",
    )
    decreasing = np.zeros(len(batch.starts), dtype=bool)
    decreasing[1:] = rows.same_row & (np.diff(batch.starts) < 0)
    unsound_sequences(decreasing, lambda s: f"seq_start_id is not non-decreasing at index {position[s]}")


def _check_empty_sequences(rows: _Layout) -> None:
    stored = rows.stored
    rows.flag_sequences(
        "row",
        rows.sound_seq & (stored < 2),
        lambda s: f"empty sequence ({stored[s]} stored tokens; a sequence stores its tokens + 1)",
    )


def _check_mask_values(rows: _Layout) -> None:
    batch = rows.batch
    values_bad = ~np.isin(batch.mask, (0, 1))
    if values_bad.any():
        where = np.searchsorted(batch.mask_offsets, np.flatnonzero(values_bad), side="right") - 1
        rows.flag_rows("mask", np.isin(np.arange(len(rows.row_len)), where), lambda r: _NOT_BINARY)


def _check_label_alignment(rows: _Layout) -> None:
    """A sequence's last stored position has no target, so a label-aligned mask is 0 there."""
    supervised_last = np.zeros(len(rows.end), dtype=bool)
    supervised_last[rows.valid] = rows.batch.mask[rows.end[rows.valid] - 1] != 0
    rows.flag_sequences("mask", supervised_last, lambda s: _NOT_LABEL_ALIGNED)


def _check_alignment(rows: _Layout, multiple: int) -> None:
    runtime = rows.runtime
    if multiple > 1:
        rows.flag_sequences(
            "alignment",
            rows.valid & (runtime % multiple != 0),
            lambda s: f"runtime length {runtime[s]} is not a multiple of the alignment multiple {multiple}",
        )


def _check_cp_segments(rows: _Layout, cp: int) -> None:
    runtime = rows.runtime
    if cp > 1:
        rows.flag_sequences(
            "cp",
            rows.valid & (runtime % (2 * cp) != 0),
            lambda s: (
                f"runtime length {runtime[s]} is not divisible by 2 * cp = {2 * cp}: context-parallel "
                f"slicing needs every segment aligned (pack with pad_seq_to_mult a multiple of {2 * cp})"
            ),
        )


def _check_seq_len(rows: _Layout) -> None:
    """``seq_len`` (when stored): one real length per sequence, and no loss on the alignment padding."""
    batch, runtime = rows.batch, rows.runtime
    if batch.seq_len is None:
        return
    if not np.array_equal(np.diff(batch.seq_len_offsets), rows.counts):
        rows.report.add(
            "row", "seq_len does not hold one length per sequence", file=batch.file, row=batch.first_row
        )
        return
    real = batch.seq_len
    rows.flag_sequences(
        "row",
        rows.valid & ((real < 1) | (real > runtime)),
        lambda s: f"seq_len {real[s]} is outside [1, runtime length {runtime[s]}]",
    )
    # The alignment padding of a sequence, positions [begin + seq_len, end), trains on nothing.
    tail = rows.valid & (real >= 1) & (real < runtime)
    cumulative = np.concatenate(([0], np.cumsum(batch.mask != 0)))
    supervised_tail = cumulative[rows.end] - cumulative[np.minimum(rows.begin + real, rows.end)]
    rows.flag_sequences(
        "mask",
        tail & (supervised_tail > 0),
        lambda s: (
            f"loss_mask supervises {supervised_tail[s]} alignment padding tokens after seq_len {real[s]}"
        ),
    )


def _check_width(rows: _Layout, pack_size: int | None, cp: int, pad_to_max_length: bool) -> None:
    """Each row's runtime tokens fit the pack size; with CP and a fixed width, so does the trailing pad."""
    loads = rows.loads
    if not pack_size:
        return
    rows.flag_rows(
        "width",
        ~rows.bad & (loads > pack_size),
        lambda r: f"the row holds {loads[r]} runtime tokens, above the pack size {pack_size}",
    )
    if cp > 1 and pad_to_max_length:
        trailing = pack_size - loads
        rows.flag_rows(
            "cp",
            ~rows.bad & (trailing > 0) & (trailing % (2 * cp) != 0),
            lambda r: (
                f"the trailing width segment ({trailing[r]} tokens up to the pack size {pack_size}) "
                f"is not divisible by 2 * cp = {2 * cp}"
            ),
        )


def _add_totals(rows: _Layout, totals: Totals) -> None:
    batch, sound, valid = rows.batch, ~rows.bad, rows.valid
    totals.rows += len(rows.row_len)
    totals.sequences += int(rows.counts[sound].sum())
    totals.runtime += int(rows.loads[sound].sum())
    totals.supervised += int((batch.mask != 0).sum())
    if sound.any():
        totals.max_sequences = max(totals.max_sequences, int(rows.counts[sound].max()))
        low = int(rows.loads[sound].min())
        totals.min_load = low if totals.min_load is None else min(totals.min_load, low)
    if valid.any():
        totals.max_length = max(totals.max_length, int(rows.runtime[valid].max()))
    if batch.sample_index is None or len(batch.sample_index) != len(batch.starts):
        totals.unindexed += len(batch.starts)
        return
    totals.sample_index.append(batch.sample_index)
    totals.sample_rows.append(batch.first_row + rows.row_of_seq)
    if totals.per_sequence:
        tokens = rows.runtime  # without seq_len, the aligned length: all the rows say of it
        if batch.seq_len is not None and np.array_equal(np.diff(batch.seq_len_offsets), rows.counts):
            tokens = batch.seq_len
        totals.sequence_tokens.append(tokens)
        supervised = np.concatenate(([0], np.cumsum(batch.mask != 0)))
        totals.sequence_supervised.append(supervised[rows.end] - supervised[rows.begin])


def check_rows(batch: Rows, settings: dict[str, Any], report: VerifyReport, totals: Totals) -> None:
    """Every check of one batch of rows, in report order, then its contribution to the totals."""
    rows = _Layout(batch, report)
    _check_structure(rows)
    rows.seal()
    cp = settings.get("cp") or 1
    _check_empty_sequences(rows)
    _check_mask_values(rows)
    _check_label_alignment(rows)
    _check_alignment(rows, settings.get("multiple") or 1)
    _check_cp_segments(rows, cp)
    _check_seq_len(rows)
    _check_width(rows, settings.get("pack_size"), cp, bool(settings.get("pad_to_max_length")))
    _add_totals(rows, totals)
