"""``tightpack verify`` on packed preference Parquet (`tightpack.core.preference_parquet`).

Checks, one row group at a time, vectorized over its rows:

- ``row``: ``loss_mask`` as long as ``input_ids`` and 0 or 1; ``sequence_start`` starting at 0,
  increasing, inside the row; every sequence's real length at least 1 and within its segment; every
  branch's prompt and tokens inside the row.
- ``width``: a row fits the pack size.
- ``alignment``: every THD sequence's segment is a multiple of the alignment multiple (and of
  ``2 * cp`` with ``cp`` > 1).
- ``units``: every unit is whole: its branches numbered 0, 1, ... in order, as many as its kind has
  (2 for ``preference``, 1 for ``kto``, 2 or more for ``groups``), a source row per unit, and one THD
  sequence per branch (``pairs``) or per unit (``shared-prefix``). A pair split across two rows
  fails here.
- ``layout``: the units read back from a row, laid out again, give the row back byte for byte
  (`tightpack.core.preference_parquet.packs_table`): every branch of a unit has the same prompt,
  positions and starts are consistent, nothing was edited.

The file-level checks (manifest, metadata, coverage) are the SFT ones of `tightpack.verify.folder`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tightpack.core.preference_parquet import PreferenceFiles, PreferenceRows, packs_table
from tightpack.verify.report import VerifyReport
from tightpack.verify.rows import Totals

COLUMNS = (
    "input_ids",
    "loss_mask",
    "sequence_start",
    "sequence_length",
    "sample_index",
    "branch_index",
    "branch_prompt_length",
    "branch_start",
    "branch_length",
)
GROUP_SIZES = {"preference": (2, 2), "kto": (1, 1), "groups": (2, None)}
"""Branches a unit of each kind has: (fewest, most; None: no most)."""


def _row_of(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


class _Group:
    """One row group's rows, the faults found in them, and which rows are still sound."""

    def __init__(self, rows: PreferenceRows, report: VerifyReport, file: str, first_row: int) -> None:
        self.rows, self.report, self.file, self.first_row = rows, report, file, first_row
        self.bad = np.zeros(len(rows), dtype=bool)

    def report_rows(self, check: str, selected: np.ndarray, message) -> None:
        """Report every row of ``selected`` (bool per row) as ``message(row)``; a row whose shape is sound
        but breaks a setting (pack size, alignment) still counts in the totals."""
        for row in np.flatnonzero(selected):
            self.report.add(check, message(int(row)), file=self.file, row=self.first_row + int(row))

    def flag(self, check: str, selected: np.ndarray, message) -> None:
        """`report_rows`, and the rows are unsound now: the later checks and the totals leave them out."""
        self.report_rows(check, selected, message)
        self.bad |= selected


def _any(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row: any of its ``values`` (bool, flat over the rows' entries of one column)."""
    out = np.zeros(len(offsets) - 1, dtype=bool)
    np.logical_or.at(out, _row_of(offsets), values)
    return out


def _check_rows(group: _Group, described: PreferenceFiles, settings: dict[str, Any]) -> None:
    rows = group.rows
    values, offsets = rows.values, rows.offsets
    width = np.diff(offsets["input_ids"])
    group.flag(
        "row",
        np.diff(offsets["loss_mask"]) != width,
        lambda r: f"loss_mask holds {np.diff(offsets['loss_mask'])[r]} values for {width[r]} tokens",
    )
    group.flag("row", _any(offsets["loss_mask"], (values["loss_mask"] != 0) & (values["loss_mask"] != 1)),
               lambda r: "loss_mask holds values other than 0 and 1")  # fmt: skip
    starts, lengths = values["sequence_start"].astype(np.int64), values["sequence_length"].astype(np.int64)
    sequences = np.diff(offsets["sequence_start"])
    group.flag(
        "row",
        (sequences == 0) | (np.diff(offsets["sequence_length"]) != sequences),
        lambda r: "sequence_start and sequence_length must list the same sequences, at least one",
    )
    row_of_sequence = _row_of(offsets["sequence_start"])
    first = np.zeros(len(starts), dtype=bool)
    first[offsets["sequence_start"][:-1][sequences > 0]] = True
    nxt = np.append(starts[1:], 0)
    last = np.append(row_of_sequence[1:] != row_of_sequence[:-1], True)
    ends = np.where(last, width[row_of_sequence], nxt)
    segment = ends - starts
    broken = (first & (starts != 0)) | (segment < 1) | (lengths < 1) | (lengths > segment)
    group.flag(
        "row",
        _any(offsets["sequence_start"], broken) & ~group.bad,
        lambda r: (
            "sequence_start must start at 0 and increase inside the row, each sequence with 1 to "
            "its segment's tokens (sequence_length)"
        ),
    )
    branch_rows = _row_of(offsets["branch_start"])
    branch_start = values["branch_start"].astype(np.int64)
    prompt = values["branch_prompt_length"].astype(np.int64)
    outside = (prompt < 1) | (branch_start - prompt < 0) | (values["branch_length"] < 1)
    outside |= branch_start + values["branch_length"] > width[branch_rows]
    group.flag(
        "row",
        _any(offsets["branch_start"], outside) & ~group.bad,
        lambda r: (
            "a branch's prompt or tokens (branch_start, branch_prompt_length, branch_length) lie "
            "outside the row"
        ),
    )
    pack_size = settings.get("pack_size")
    if pack_size:
        group.report_rows("width", width > pack_size, lambda r: f"the row holds {width[r]} tokens, over the "
                          f"pack size {pack_size}")  # fmt: skip
    multiple = settings.get("multiple") or described.multiple
    cp = settings.get("cp") or 1
    divisor = int(np.lcm(multiple, 2 * cp)) if cp > 1 else multiple
    group.report_rows(
        "alignment",
        _any(offsets["sequence_start"], segment % divisor != 0) & ~group.bad,
        lambda r: (
            f"a sequence's segment is not a multiple of {divisor} (the alignment multiple "
            f"{multiple}" + (f" and 2 * cp = {2 * cp}" if cp > 1 else "") + ")"
        ),
    )


def _check_units(group: _Group, described: PreferenceFiles) -> None:
    rows = group.rows
    values, offsets = rows.values, rows.offsets
    index = values["branch_index"].astype(np.int64)
    branches = np.diff(offsets["branch_index"])
    row_of_branch = _row_of(offsets["branch_index"])
    row_first = np.zeros(len(index), dtype=bool)
    row_first[offsets["branch_index"][:-1][branches > 0]] = True
    previous = np.append(-1, index[:-1])
    out_of_order = (row_first & (index != 0)) | (~row_first & (index != 0) & (index != previous + 1))
    unit_first = index == 0
    unit_of_branch = np.cumsum(unit_first) - 1
    size = np.bincount(unit_of_branch[unit_first.cumsum() > 0], minlength=int(unit_first.sum()))
    low, high = GROUP_SIZES.get(described.kind, (1, None))
    wrong_size = (size < low) | ((size > high) if high is not None else False)
    units = np.bincount(row_of_branch[unit_first], minlength=len(rows))
    sequences = np.diff(offsets["sequence_start"])
    expected = branches if described.layout == "pairs" else units
    group.flag(
        "units",
        (_any(offsets["branch_index"], out_of_order) | (branches == 0)) & ~group.bad,
        lambda r: (
            "branch_index must number each unit's branches 0, 1, ... in order, starting the row "
            "with 0: a unit is split or its branches are out of order"
        ),
    )
    unit_rows = row_of_branch[unit_first]
    odd = np.zeros(len(rows), dtype=bool)
    np.logical_or.at(odd, unit_rows, wrong_size)
    group.flag(
        "units",
        odd & ~group.bad,
        lambda r: (
            f"a unit of this row has a number of branches a {described.kind} unit cannot have "
            f"({low}" + (f" to {high}" if high != low else "") + (" or more" if high is None else "") + "): "
            "a pair or group is split, or its rows are not of this kind"
        ),
    )
    group.flag(
        "units",
        ((np.diff(offsets["sample_index"]) != units) | (sequences != expected)) & ~group.bad,
        lambda r: (
            f"the row lists {np.diff(offsets['sample_index'])[r]} source rows and {sequences[r]} "
            f"sequences for {units[r]} units of {branches[r]} branches in the {described.layout} layout"
        ),
    )


_LAID_OUT = ("input_ids", "loss_mask", "sequence_start", "sequence_length", "branch_start")


def _first_difference(stored: PreferenceRows, again: PreferenceRows, row: int) -> str | None:
    for name in _LAID_OUT:
        a = stored.values[name][stored.offsets[name][row] : stored.offsets[name][row + 1]]
        b = again.values[name][again.offsets[name][0] : again.offsets[name][1]]
        if len(a) != len(b) or not np.array_equal(a, b):
            return name
    return None


def _check_layout(group: _Group, described: PreferenceFiles) -> None:
    rows = group.rows
    if not group.bad.any():  # the usual case: the whole group laid out again at once
        again = PreferenceRows.from_table(
            packs_table(rows.units(0, len(rows)), rows.offsets["sample_index"], described)
        )
        if all(
            np.array_equal(rows.offsets[name], again.offsets[name])
            and np.array_equal(rows.values[name], again.values[name])
            for name in _LAID_OUT
        ):
            return
    for row in np.flatnonzero(~group.bad):  # find the rows that differ, one by one
        units = rows.units(int(row))
        again = PreferenceRows.from_table(packs_table(units, np.array([0, len(units)]), described))
        differs = _first_difference(rows, again, int(row))
        if differs is not None:  # reported; the row's shape is sound, so it still counts in the totals
            group.report.add(
                "layout",
                f"the row's units do not lay out again as stored ({differs} differs): a branch's prompt "
                "differs from its unit's first branch, or the row was edited",
                file=group.file,
                row=group.first_row + int(row),
            )


def _add_totals(group: _Group, totals: Totals) -> None:
    rows, sound = group.rows, ~group.bad
    offsets = rows.offsets
    width = np.diff(offsets["input_ids"])
    sequences = np.diff(offsets["sequence_start"])
    totals.rows += len(rows)
    totals.sequences += int(sequences[sound].sum())
    totals.runtime += int(width[sound].sum())
    totals.supervised += int((rows.values["loss_mask"] != 0).sum())
    if sound.any():
        totals.max_sequences = max(totals.max_sequences, int(sequences[sound].max()))
        low = int(width[sound].min())
        totals.min_load = low if totals.min_load is None else min(totals.min_load, low)
        starts = rows.values["sequence_start"].astype(np.int64)
        row_of_sequence = _row_of(offsets["sequence_start"])
        last = np.append(row_of_sequence[1:] != row_of_sequence[:-1], True)
        ends = np.where(last, width[row_of_sequence], np.append(starts[1:], 0))
        longest = (ends - starts)[sound[row_of_sequence]]
        totals.max_length = max(totals.max_length, int(longest.max()))
    totals.sample_index.append(rows.values["sample_index"].astype(np.int64))
    totals.sample_rows.append(group.first_row + _row_of(offsets["sample_index"]))


def check_preference_files(
    files: list[str], described: PreferenceFiles, settings: dict[str, Any], report: VerifyReport
) -> Totals:
    """Every row check of packed preference shards; the totals the file-level checks compare with."""
    totals = Totals()
    for file in files:
        name = Path(file).name
        parquet = pq.ParquetFile(file)
        missing = [column for column in COLUMNS if column not in parquet.schema_arrow.names]
        if missing:
            report.add("read", f"missing columns: {', '.join(missing)}", file=name)
            continue
        for number in range(parquet.num_row_groups):
            first_row = totals.rows + totals.unread
            try:
                rows = PreferenceRows.from_table(parquet.read_row_group(number))
            except (OSError, pa.ArrowException) as error:
                count = parquet.metadata.row_group(number).num_rows
                report.add("read", f"cannot decode row group {number}: {error}", file=name, row=first_row)
                totals.unread += count
                continue
            group = _Group(rows, report, name, first_row)
            _check_rows(group, described, settings)
            _check_units(group, described)
            _check_layout(group, described)
            _add_totals(group, totals)
    return totals


def check_preference_manifest(manifest: dict, totals: Totals, report: VerifyReport) -> None:
    """The manifest's pack, unit, token and supervised counts against the rows."""
    stats, counts = manifest.get("stats", {}), manifest.get("counts", {})
    units = sum(len(part) for part in totals.sample_index)
    for said, actual, what in (
        (stats.get("packs"), totals.rows, "packs"),
        (counts.get("packed"), units, "packed units"),
        (stats.get("tokens"), totals.runtime, "tokens in the layout"),
        (counts.get("supervised_packed"), totals.supervised, "supervised tokens"),
    ):
        if said is not None and said != actual:
            report.add("manifest", f"the manifest counts {said} {what}, the rows hold {actual}")
