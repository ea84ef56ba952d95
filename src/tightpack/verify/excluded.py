"""The ``excluded`` check of ``tightpack verify``: the manifest's excluded rows, against the packs and counts.

A run lists in its manifest the source rows it did not pack as they were, by reason
(`tightpack.offline.accounting.account_samples`, `tightpack.offline.mixture.count_mixture`,
`tightpack.offline.preference.account_units`), and counts them. From the ``sample_index`` the row
checks read anyway (each packed sequence's source row), and from the manifest alone:

- ``excluded.dropped_long``, ``no_supervised``, ``no_supervised_after_truncation`` and
  ``mixture_left_out``, the rows of ``excluded.dropped_reasons`` (preference runs) and ``bad_rows``
  hold no row the packs hold: a run never packs those;
- every row of ``excluded.truncated`` is packed (a truncated sample is kept), unless the mixture left
  it out (``excluded.mixture_left_out``); not checked when rows could not be read or carry no
  ``sample_index``;
- every count that is the length of a list equals it: ``counts.truncated``, ``dropped_long``,
  ``no_supervised``, ``no_supervised_after_truncation`` and ``mixture_left_out`` that of the list of
  the same name, ``counts.truncated_<reason>`` that of ``excluded.truncated_by_reason.<reason>``,
  ``counts.bad_rows`` that of ``bad_rows``, and ``counts.no_supervised_in_source`` is
  ``no_supervised`` less ``no_supervised_after_truncation``;
- lists that exclude each other share no row: a row is truncated, dropped as too long, left without a
  supervised token, or bad, one at most, and the mixture leaves out only kept rows (it may leave out a
  truncated one); ``no_supervised_after_truncation`` is part of ``no_supervised``;
  ``truncated_by_reason`` splits ``truncated`` (each row under one reason); the rows of
  ``dropped_reasons`` are those of ``dropped_long`` and ``no_supervised``;
- every list names source rows: integers below ``counts.samples_in``, each once.

Each fault names the list, its first rows and what is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tightpack.verify.report import VerifyReport
from tightpack.verify.rows import Totals

_CHANGED = "(the manifest or the packs changed after packing)"
_FEW = 5
"""Rows named per fault."""

_ROW_LISTS = (
    "truncated",
    "dropped_long",
    "no_supervised",
    "no_supervised_after_truncation",
    "mixture_left_out",
)
"""The lists of ``excluded`` that hold source rows (``truncated_by_reason`` and ``dropped_reasons`` apart);
each has a count of the same name, its length."""

_NEVER_PACKED = {
    "excluded.dropped_long": "a row dropped as longer than the cap",
    "excluded.no_supervised": "a row left without a supervised token",
    "excluded.no_supervised_after_truncation": "a row left without a supervised token by truncation",
    "excluded.mixture_left_out": "a row the mixture's subsample left out",
    "excluded.dropped_reasons": "a dropped unit's row",
    "bad_rows": "a bad row (one that could not be read or tokenized)",
}
"""The lists whose rows a run never packs, and what such a row is."""

_EXCLUSIVE = (
    ("excluded.truncated", "excluded.dropped_long"),
    ("excluded.truncated", "excluded.no_supervised"),
    ("excluded.dropped_long", "excluded.no_supervised"),
    ("excluded.mixture_left_out", "excluded.dropped_long"),
    ("excluded.mixture_left_out", "excluded.no_supervised"),
    ("bad_rows", "excluded.truncated"),
    ("bad_rows", "excluded.dropped_long"),
    ("bad_rows", "excluded.no_supervised"),
    ("bad_rows", "excluded.mixture_left_out"),
)
"""Pairs of lists that share no row: a row is truncated, dropped as too long, left without a supervised
token or bad, one at most; the mixture leaves out kept rows only (a truncated one among them)."""


def listed_rows(value: Any) -> np.ndarray | None:
    """int64 rows of a manifest list of integers, or None when ``value`` is not one."""
    if not isinstance(value, list):
        return None
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        rows = np.asarray(value)
    except (TypeError, ValueError, OverflowError):  # ragged, or nested
        return None
    if rows.ndim != 1 or rows.dtype.kind not in "iu":  # floats, strings, booleans, None, objects
        return None
    return rows.astype(np.int64)


def check_excluded(manifest: dict, totals: Totals, report: VerifyReport) -> None:
    """The manifest's ``excluded`` lists and ``bad_rows`` against the packs' ``sample_index``
    (``totals``), against its counts and against each other."""
    counts = _section(manifest, "counts")
    lists = _read_lists(manifest, counts.get("samples_in"), report)
    packed, first_at = _packed(totals)
    complete = not totals.unread and not totals.unindexed
    for name, what in _NEVER_PACKED.items():
        if name in lists:
            _never_packed(report, name, what, lists[name], packed, first_at)
    truncated = lists.get("excluded.truncated")
    if truncated is not None and complete:
        left_out = lists.get("excluded.mixture_left_out")
        kept = packed if left_out is None else np.union1d(packed, left_out)
        unpacked = np.setdiff1d(truncated, kept, assume_unique=True)
        if len(unpacked):
            unless = (
                " unless the mixture left it out (excluded.mixture_left_out)" if "mixture" in manifest else ""
            )
            report.add(
                "excluded",
                f"excluded.truncated lists {_rows(unpacked)} that the packs do not hold: a truncated "
                f"sample is kept, so packed{unless} {_CHANGED}",
            )
    _check_counts(report, manifest, counts, lists)
    for first, second in _EXCLUSIVE:
        if first in lists and second in lists:
            both = np.intersect1d(lists[first], lists[second], assume_unique=True)
            if len(both):
                report.add(
                    "excluded",
                    f"{first} and {second} both list {_rows(both)}: a run puts a row in one of them at "
                    f"most {_CHANGED}",
                )
    _within(report, lists, "excluded.no_supervised_after_truncation", ("excluded.no_supervised",))
    _check_split(report, manifest, lists)


def _read_lists(manifest: dict, samples_in: Any, report: VerifyReport) -> dict[str, np.ndarray]:
    """Every list of source rows the manifest holds, by name (``excluded.<name>``,
    ``excluded.truncated_by_reason.<reason>``, ``excluded.dropped_reasons``, ``bad_rows``), sorted;
    one that is not a list of source rows, each once, is reported and left out."""
    excluded = _section(manifest, "excluded")
    given: dict[str, Any] = {f"excluded.{name}": excluded[name] for name in _ROW_LISTS if name in excluded}
    by_reason = excluded.get("truncated_by_reason")
    if isinstance(by_reason, dict):
        given |= {f"excluded.truncated_by_reason.{reason}": rows for reason, rows in by_reason.items()}
    elif by_reason is not None:
        given["excluded.truncated_by_reason"] = None  # reported below as not a list
    reasons = excluded.get("dropped_reasons")
    if reasons is not None:
        given["excluded.dropped_reasons"] = _keys_as_rows(reasons)
    bad_rows = manifest.get("bad_rows")
    if bad_rows is not None:
        given["bad_rows"] = (
            [entry.get("sample_index") if isinstance(entry, dict) else None for entry in bad_rows]
            if isinstance(bad_rows, list)
            else None
        )
    source = samples_in if isinstance(samples_in, int) and not isinstance(samples_in, bool) else None
    lists = {}
    for name, value in given.items():
        rows = listed_rows(value)
        if rows is None:
            what = "rows (sample_index of each)" if name == "bad_rows" else "source rows (integers)"
            report.add("excluded", f"{name} is not a list of {what} {_CHANGED}")
            continue
        outside = rows[(rows < 0) | (rows >= source)] if source is not None else rows[rows < 0]
        if len(outside):
            bounds = f" 0..{source - 1}" if source is not None else ""
            report.add(
                "excluded", f"{name} lists {_rows(outside)} outside the source rows{bounds} {_CHANGED}"
            )
            continue
        rows = np.sort(rows)
        again = np.unique(rows[1:][rows[1:] == rows[:-1]])
        if len(again):
            report.add("excluded", f"{name} lists {_rows(again)} more than once {_CHANGED}")
            continue
        lists[name] = rows
    return lists


def _keys_as_rows(reasons: Any) -> list[int] | None:
    """The source rows of ``excluded.dropped_reasons`` (a mapping of row, as text, to reason)."""
    if not isinstance(reasons, dict):
        return None
    try:
        return np.asarray(list(reasons), dtype=str).astype(np.int64).tolist()
    except (ValueError, OverflowError):
        return None


def _packed(totals: Totals) -> tuple[np.ndarray, np.ndarray]:
    """The distinct source rows the packs hold, sorted, and the pack row of each one's first sequence."""
    if not totals.sample_index:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    rows, first = np.unique(np.concatenate(totals.sample_index), return_index=True)
    return rows, np.concatenate(totals.sample_rows)[first]


def _never_packed(
    report: VerifyReport,
    name: str,
    what: str,
    rows: np.ndarray,
    packed: np.ndarray,
    first_at: np.ndarray,
) -> None:
    held = np.intersect1d(rows, packed, assume_unique=True)
    if not len(held):
        return
    pack_row = int(first_at[np.searchsorted(packed, held[0])])
    report.add(
        "excluded",
        f"{name} lists {_rows(held)} that the packs hold (source row {held[0]} in pack row {pack_row}): "
        f"{what} is never packed {_CHANGED}",
        row=pack_row,
    )


def _check_counts(report: VerifyReport, manifest: dict, counts: dict, lists: dict[str, np.ndarray]) -> None:
    """Every count defined as the length of a list (or two) against it."""
    pairs = [(f"counts.{name}", counts.get(name), f"excluded.{name}") for name in _ROW_LISTS]
    by_reason = _section(manifest, "excluded").get("truncated_by_reason")
    if isinstance(by_reason, dict):
        pairs += [
            (
                f"counts.truncated_{reason}",
                counts.get(f"truncated_{reason}"),
                f"excluded.truncated_by_reason.{reason}",
            )
            for reason in by_reason
        ]
    pairs.append(("counts.bad_rows", counts.get("bad_rows"), "bad_rows"))
    for count, said, name in pairs:
        if said is None and name in lists and len(lists[name]) and name != "bad_rows":
            report.add(
                "excluded",
                f"{count} is missing, {name} lists {_many(len(lists[name]))}: a run writes the count beside "
                f"the list {_CHANGED}",
            )
        elif said is not None and name in lists and not _equal(said, len(lists[name])):
            report.add(
                "excluded",
                f"{count} is {said!r}, {name} lists {_many(len(lists[name]))}: the count is the list's "
                f"length {_CHANGED}",
            )
    said = counts.get("no_supervised_in_source")
    both = ("excluded.no_supervised", "excluded.no_supervised_after_truncation")
    if said is not None and all(name in lists for name in both):
        rows = len(lists[both[0]]) - len(lists[both[1]])
        if not _equal(said, rows):
            report.add(
                "excluded",
                f"counts.no_supervised_in_source is {said!r}, {both[0]} less {both[1]} is {_many(rows)}: "
                f"the count is that difference {_CHANGED}",
            )


def _within(report: VerifyReport, lists: dict[str, np.ndarray], part: str, wholes: tuple[str, ...]) -> bool:
    """The rows of ``part`` are all in one of ``wholes`` (reported if not); False when they are not."""
    if part not in lists or not all(name in lists for name in wholes):
        return True
    whole = np.unique(np.concatenate([lists[name] for name in wholes]))
    outside = np.setdiff1d(lists[part], whole)
    if len(outside):
        report.add(
            "excluded",
            f"{part} lists {_rows(outside)} missing from {' and '.join(wholes)}: every row of it is in "
            f"{' or '.join(wholes)} {_CHANGED}",
        )
    return not len(outside)


def _check_split(report: VerifyReport, manifest: dict, lists: dict[str, np.ndarray]) -> None:
    """``truncated_by_reason`` splits ``truncated`` (each row under one reason), and the rows of
    ``dropped_reasons`` are those of ``dropped_long`` and ``no_supervised``."""
    by_reason = _section(manifest, "excluded").get("truncated_by_reason")
    names = (
        [f"excluded.truncated_by_reason.{reason}" for reason in by_reason]
        if isinstance(by_reason, dict)
        else []
    )
    if names and "excluded.truncated" in lists and all(name in lists for name in names):
        under = np.sort(np.concatenate([lists[name] for name in names]))
        twice = np.unique(under[1:][under[1:] == under[:-1]])
        if len(twice):
            report.add(
                "excluded",
                f"excluded.truncated_by_reason lists {_rows(twice)} under two reasons: a truncated row "
                f"has one {_CHANGED}",
            )
        unexplained = np.setdiff1d(lists["excluded.truncated"], under)
        if len(unexplained):
            report.add(
                "excluded",
                f"excluded.truncated lists {_rows(unexplained)} that excluded.truncated_by_reason does "
                f"not: every truncated row is listed under its reason {_CHANGED}",
            )
        for name in names:
            _within(report, lists, name, ("excluded.truncated",))
    dropped = ("excluded.dropped_long", "excluded.no_supervised")
    if _within(report, lists, "excluded.dropped_reasons", dropped) and "excluded.dropped_reasons" in lists:
        for name in dropped:
            _within(report, lists, name, ("excluded.dropped_reasons",))


def _section(manifest: dict, key: str) -> dict:
    """``manifest[key]``, or an empty one where it is missing or not a mapping."""
    section = manifest.get(key)
    return section if isinstance(section, dict) else {}


def _equal(said: Any, rows: int) -> bool:
    return isinstance(said, int) and not isinstance(said, bool) and said == rows


def _rows(rows: np.ndarray) -> str:
    """``1 row (7)`` or ``12 rows (3, 5, 8, 13, 21, ...)``: how many, and the first few."""
    shown = ", ".join(str(int(row)) for row in rows[:_FEW]) + (", ..." if len(rows) > _FEW else "")
    return f"{_many(len(rows))} ({shown})"


def _many(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"
