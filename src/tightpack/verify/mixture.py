"""The ``mixture`` check of ``tightpack verify``: the manifest's mixture figures counted again from the rows.

A mixture run (`tightpack.offline.mixture`) writes per-source statistics into the manifest's
``mixture`` section. Every figure the packs determine is counted again here from what the row checks
read anyway (each sequence's ``sample_index``, pack row, ``seq_len`` and loss mask), by the function
that counted it at pack time (`tightpack.offline.mixture_figures.packed_figures`), and compared:

- per source: ``sequences``, ``samples_packed``, ``tokens``, ``supervised_tokens``, ``share``,
  ``token_share``, ``supervised_share`` and ``worst_window_points``; ``target_share`` against the
  weights; ``repetitions`` exactly where the packs hold every kept sample of the source
  (``samples_packed == samples``), else only as bounded by the packs (at most the measure packed
  over that of the distinct samples packed), and ``samples`` as at least ``samples_packed``;
- ``windows`` and ``window_shares``, from the packs in the order a run reads them; the settings they
  must agree with: ``window_packs`` (the batches counted), ``tolerance_points`` (a number of points,
  no full batch past it), ``max_repetitions`` (no source's ``repetitions`` past it), every source's
  ``samples`` (at most its ``rows``), and the run's settings (``settings.mixture``: the weights and
  every setting the section repeats);
- ``counts.mixture_repeats``: the copies of repeated samples past the first.

A sequence's source is told by its ``sample_index``: the inputs' source rows are consecutive, in input
order, ``rows`` of each (checked against ``counts.samples_in``). What the packs cannot tell is left
to the manifest: ``rows``, ``bad_rows``, ``dropped``, ``truncated_packed``, and the settings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tightpack.core.mixture import check_weights
from tightpack.errors import TightpackError
from tightpack.offline.mixture_figures import packed_figures, repetitions, sample_sources
from tightpack.verify.folder import allowed_copies
from tightpack.verify.report import VerifyReport
from tightpack.verify.rows import Totals

_CHANGED = "(the manifest or the packs changed after packing)"


def check_mixture(manifest: dict, totals: Totals, report: VerifyReport) -> int:
    """Compare the manifest's ``mixture`` figures with the rows' (``totals`` read with
    ``per_sequence``); returns the number of sources counted again (0: no mixture, or not counted)."""
    mixture = manifest.get("mixture")
    settings = manifest["settings"]  # a dict: `read_manifest` refuses a manifest without
    if not mixture:
        if settings.get("mixture"):
            report.add(
                "mixture",
                f"the manifest has no mixture section, but its settings.mixture says a mixture run wrote "
                f"it: its figures (and the copies each sample may have) cannot be checked {_CHANGED}",
            )
        return 0
    if not isinstance(mixture, dict):
        report.add("mixture", f"mixture is {_show(mixture)} in the manifest, not a section {_CHANGED}")
        return 0
    sources = mixture.get("sources") or []
    if not isinstance(sources, list):
        report.add("mixture", f"mixture.sources is {_show(sources)} in the manifest, not a list {_CHANGED}")
        return 0
    for s, source in enumerate(sources):
        if not isinstance(source, dict):
            report.add(
                "mixture",
                f"mixture.sources[{s}] is {_show(source)} in the manifest, not a source {_CHANGED}",
            )
            return 0
    if allowed_copies(manifest) is None:  # the cap the coverage check could not take
        report.add(
            "mixture",
            f"mixture.max_repetitions is {_show(mixture.get('max_repetitions'))} in the manifest, not a "
            f"number of at least 1: how many copies of a sample the packs may hold cannot be checked "
            f"{_CHANGED}",
        )
    names = [f"mixture.sources[{s}] ({source.get('name')})" for s, source in enumerate(sources)]
    rows = [source.get("rows") for source in sources]
    if not sources or not all(isinstance(count, int) and count >= 0 for count in rows):
        report.add(
            "mixture",
            "the mixture's figures were not counted again: every entry of mixture.sources needs its "
            "`rows` (a count), which tells a packed sequence's source from its sample_index "
            f"{_CHANGED}",
        )
        return 0
    samples_in = manifest.get("counts", {}).get("samples_in")
    if samples_in is not None and sum(rows) != samples_in:
        report.add(
            "mixture",
            f"the rows of mixture.sources add up to {sum(rows)}, counts.samples_in is {samples_in}: a "
            f"packed sequence's source cannot be told, so the mixture's figures were not counted again "
            f"{_CHANGED}",
        )
        return 0
    if totals.unread or totals.unindexed:
        missing = (
            f"{totals.unread} rows could not be read"
            if totals.unread
            else f"{totals.unindexed} sequences have no sample_index, which tells a sequence's source"
        )
        report.add("mixture", f"the mixture's figures were not counted again: {missing}")
        return 0
    windows = mixture.get("windows")
    if not isinstance(windows, dict):
        report.add(
            "mixture",
            f"mixture.windows is {_show(windows)} in the manifest, not a table of the global batches: the "
            f"windows cannot be counted again {_CHANGED}",
        )
        return 0
    window = windows.get("window_packs")  # the setting, cut to the packs there are
    if not isinstance(window, int) or window < 0:
        report.add(
            "mixture",
            f"mixture.windows.window_packs is {_show(window)} in the manifest, not a number of packs: the "
            f"windows cannot be counted again {_CHANGED}",
        )
        return 0

    def flat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    index = flat(totals.sample_index)
    bounds = np.cumsum(rows)
    inside = (index >= 0) & (index < bounds[-1])  # a sample_index past the sources is the coverage check's
    index = index[inside]
    try:
        targets = check_weights([source.get("weight") for source in sources], names)
        figures = packed_figures(
            sample_sources(index, [0, *bounds[:-1].tolist()], list(range(len(sources)))),
            index,
            flat(totals.sequence_tokens)[inside],
            flat(totals.sequence_supervised)[inside],
            flat(totals.sample_rows)[inside],
            totals.rows,
            by=mixture.get("mix_by"),
            targets=targets,
            window=max(window, 1),
        )
    except TightpackError as error:  # weights or mix_by that no run writes
        report.add("mixture", f"the mixture's figures were not counted again: {error} {_CHANGED}")
        return 0

    times = repetitions(figures.measure, figures.distinct_measure)
    for s, (said, counted) in enumerate(zip(sources, figures.sources, strict=True)):
        if not (isinstance(said.get("samples"), int) and said["samples"] >= 0):
            report.add(
                "mixture",
                f"{names[s]}: samples is {_show(said.get('samples'))} in the manifest, not a count "
                f"{_CHANGED}",
            )
        for key, value in counted.items():
            _compare(report, f"{names[s]}: {key}", said.get(key), value)
        _compare(
            report,
            f"{names[s]}: target_share",
            said.get("target_share"),
            float(targets[s]),
            "the weights give",
        )
        _check_repetitions(report, names[s], said, counted["samples_packed"], float(times[s]))
    for key, value in figures.windows.items():
        _compare(
            report, f"mixture.windows.{key}", mixture["windows"].get(key), value, "the packs in order give"
        )
    _check_settings(report, mixture, figures.windows, totals.rows)
    _check_recorded_settings(report, mixture, settings.get("mixture"))
    _compare_window_shares(report, mixture.get("window_shares"), figures.window_shares, len(sources))
    repeats = sum(entry["sequences"] - entry["samples_packed"] for entry in figures.sources)
    counts = manifest.get("counts")
    said_repeats = counts.get("mixture_repeats") if isinstance(counts, dict) else None
    _compare(report, "counts.mixture_repeats", said_repeats, repeats)
    return len(sources)


def _check_settings(report: VerifyReport, mixture: dict, windows: dict, packs: int) -> None:
    """The settings the counted batches must agree with: the batch size asked (``window_packs``, cut to
    the packs there are) and the tolerance the run kept (no full batch past it)."""
    asked = mixture.get("window_packs")
    if isinstance(asked, int) and asked > 0 and min(asked, packs) != windows["window_packs"]:
        report.add(
            "mixture",
            f"mixture.window_packs is {asked} in the manifest but its windows count batches of "
            f"{windows['window_packs']} packs over {packs} packs {_CHANGED}",
        )
    tolerance = mixture.get("tolerance_points")
    if tolerance is not None and not (_number(tolerance) and tolerance > 0):
        report.add(
            "mixture",
            f"mixture.tolerance_points is {_show(tolerance)} in the manifest, not a number of points (no "
            f"run writes it) {_CHANGED}",
        )
    elif _number(tolerance) and windows["worst_points"] > tolerance * (1 + 1e-9):
        report.add(
            "mixture",
            f"mixture.tolerance_points is {tolerance:g} in the manifest, but the packs in order hold a "
            f"global batch {windows['worst_points']:.4g} points off, which that run would have refused "
            f"{_CHANGED}",
        )
    cap = mixture.get("max_repetitions")
    for s, source in enumerate(mixture.get("sources") or []):
        times = source.get("repetitions")
        if _number(cap) and _number(times) and times > cap * (1 + 1e-9):
            report.add(
                "mixture",
                f"mixture.sources[{s}] ({source.get('name')}): repetitions is {_show(times)}, past the "
                f"max_repetitions of {_show(cap)} in the manifest {_CHANGED}",
            )
        samples, rows = source.get("samples"), source.get("rows")
        if isinstance(samples, int) and isinstance(rows, int) and samples > rows:
            report.add(
                "mixture",
                f"mixture.sources[{s}] ({source.get('name')}): samples is {samples} in the manifest, more "
                f"than its {rows} rows {_CHANGED}",
            )


_RECORDED = {  # the mixture section's key: the run's setting (the manifest's settings.mixture)
    "mix_by": "mix_by",
    "max_repetitions": "max_repetitions",
    "total_tokens": "total_tokens",
    "total_packs": "total_packs",
    "window_packs": "window_packs",
    "tolerance_points": "tolerance",
}


def _check_recorded_settings(report: VerifyReport, mixture: dict, recorded: Any) -> None:
    """The mixture section against the run's settings (``settings.mixture``), which the run wrote from
    the same configuration: the weights and every setting the section repeats."""
    if not isinstance(recorded, dict):
        report.add(
            "mixture",
            f"settings.mixture is {_show(recorded)} in the "
            f"manifest, where a mixture run records its settings {_CHANGED}",
        )
        return
    differ = [
        f"mixture.{key} is {_show(mixture.get(key))}, "
        f"settings.mixture.{setting} {_show(recorded.get(setting))}"
        for key, setting in _RECORDED.items()
        if mixture.get(key) != recorded.get(setting)
    ]
    weights = [source.get("weight") for source in mixture.get("sources") or []]
    if weights != recorded.get("weights"):
        differ.append(
            f"the weights of mixture.sources are {_show(weights)}, settings.mixture.weights "
            f"{_show(recorded.get('weights'))}"
        )
    if differ:
        report.add(
            "mixture",
            f"the mixture section disagrees with the run's settings in the manifest: {'; '.join(differ)} "
            f"{_CHANGED}",
        )


def _check_repetitions(report: VerifyReport, name: str, said: dict, packed: int, times: float) -> None:
    """``repetitions`` is the measure packed over the measure of the source's kept samples: the packs
    hold that measure when they hold every kept sample; else they bound it (the left-out ones add to
    the measure available)."""
    samples, value = said.get("samples"), said.get("repetitions")
    if isinstance(samples, int) and samples < packed:
        report.add(
            "mixture",
            f"{name}: samples is {samples} in the manifest, fewer than the {packed} distinct samples of it "
            f"the packs hold {_CHANGED}",
        )
    if samples == packed:
        _compare(report, f"{name}: repetitions", value, times, "the packs (every kept sample packed) give")
    elif not _number(value) or value > times * (1 + 1e-9):
        report.add(
            "mixture",
            f"{name}: repetitions is {_show(value)} in the manifest, above the {_show(times)} its packs "
            f"allow (the measure packed over that of its distinct samples packed) {_CHANGED}",
        )


def _compare(report: VerifyReport, field: str, said: Any, actual: Any, basis: str = "the packs give") -> None:
    if not _same(said, actual):
        report.add("mixture", f"{field} is {_show(said)} in the manifest, {basis} {_show(actual)} {_CHANGED}")


def _compare_window_shares(report: VerifyReport, said: Any, actual: list[list[float]], sources: int) -> None:
    """``window_shares``, one list of shares per window: the first window that differs is named."""
    field = "mixture.window_shares"
    try:  # numbers only: numpy would read the text "0.5" as the number
        if not all(_number(share) for row in said for share in row):
            raise TypeError
        manifest = np.asarray(said, dtype=np.float64)
    except (TypeError, ValueError):  # ragged, not lists, or not numbers
        manifest = np.zeros(0)
    counted = np.asarray(actual, dtype=np.float64).reshape(-1, sources)
    if manifest.shape != counted.shape:
        held = f"{len(manifest)} windows of {manifest.shape[1]}" if manifest.ndim == 2 else "no table of"
        report.add(
            "mixture",
            f"{field} holds {held} shares in the manifest, the packs in order give {len(counted)} windows "
            f"of {sources} {_CHANGED}",
        )
        return
    differs = np.flatnonzero(~np.isclose(manifest, counted, rtol=0, atol=1e-9).all(axis=1))
    if len(differs):
        first = int(differs[0])
        _compare(
            report,
            f"{field}[{first}] (the first of {len(differs)} windows that differ)",
            said[first],
            actual[first],
            "the packs in order give",
        )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(said: Any, actual: Any) -> bool:
    if isinstance(actual, list):
        return (
            isinstance(said, list)
            and len(said) == len(actual)
            and all(_same(one, other) for one, other in zip(said, actual, strict=True))
        )
    if not _number(said):
        return False
    if isinstance(actual, int):
        return said == actual
    return math.isclose(said, actual, rel_tol=1e-9, abs_tol=1e-9)


def _show(value: Any) -> str:
    if value is None:
        return "missing"
    if isinstance(value, list):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    if isinstance(value, float):
        return f"{value:.10g}"
    return repr(value) if isinstance(value, str) else str(value)
