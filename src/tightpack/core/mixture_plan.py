"""Packs of a mixture whose shares hold in every window a training run reads, not only overall.

A run reads packs in order, a global batch at a time: a mixture whose shares are right over the
whole output but drift along it (all of one source first) trains on a different mixture at every
step. `plan_mixture` packs the samples `tightpack.core.mixture.resolve_mixture` chose in three
steps:

1. **Interleave** (`interleave`): the samples in one stream in which every source's measure keeps
   pace with its share: a sample's place is its source's running measure up to it, divided by the
   source's target share (a weighted fair queue). Within a source the samples come in a seeded
   shuffled order, one repetition after the other.
2. **Pack in chunks** (`tightpack.core.mixture_chunks.pack_chunks`): the stream is cut into
   chunks of about ``chunk_packs`` packs' tokens (at most a pass of the most repeated source, and a
   later copy of a sample already in the chunk moves to the next chunk, so no chunk and no pack
   holds a sample twice); each chunk is packed apart, first fit with the large samples longest first
   and the small ones after them in stream order (first fit decreasing over all where that saves
   more), and its packs are shuffled. A chunk holds the mixture, as every stretch of the stream
   does, and fills about as a packing of the whole would.
3. **Order the packs** (`order_packs`): from a pool of the next ``lookahead`` packs, take the one
   that keeps smallest the running deviation from the targets plus that of the window it closes.

What is guaranteed is what is measured: `window_deviation` counts, over every window of ``window``
consecutive packs, each source's share against its target, exactly; the plan carries the worst
window, and ``tolerance`` turns a worst window past it into an error (`MixtureWindowError`) instead
of an output. The whole output's shares are `resolve_mixture`'s, to half a sample per source.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tightpack.core import _firstfit
from tightpack.core.mixture import MixtureSelection
from tightpack.core.mixture_chunks import DEFAULT_CHUNK_PACKS, pack_chunks
from tightpack.core.planner import PackPlan
from tightpack.core.preference_units import concatenated_ranges
from tightpack.errors import TightpackError

__all__ = [
    "MixturePlan",
    "MixtureWindowError",
    "WindowDeviation",
    "interleave",
    "order_packs",
    "plan_mixture",
    "window_deviation",
]

DEFAULT_WINDOW = 64
"""Packs per window whose shares `plan_mixture` reports by default (a global batch of 64 packs)."""

DEFAULT_LOOKAHEAD = 64
"""Packs `order_packs` chooses among at each step."""


class MixtureWindowError(TightpackError):
    """A window of the plan strays from the targets by more than the asked tolerance."""


@dataclass(frozen=True)
class WindowDeviation:
    """How far the shares of the worst window of ``window`` consecutive packs stray from the targets.

    Attributes:
        window: packs per window (the whole plan when it has fewer).
        points: the largest ``|share - target|`` of any source in any window, in percentage points.
        source: the source of that deviation.
        first_pack: the first pack of that window.
        per_source: float64 ``[num_sources]``: each source's worst deviation over the windows, points.
    """

    window: int
    points: float
    source: int
    first_pack: int
    per_source: np.ndarray

    def to_dict(self) -> dict:
        return {
            "window_packs": self.window,
            "worst_points": self.points,
            "worst_source": self.source,
            "worst_first_pack": self.first_pack,
            "worst_points_per_source": self.per_source.tolist(),
        }


@dataclass(frozen=True)
class MixturePlan:
    """The packs of a mixture, in the order a run reads them (`plan_mixture`).

    Attributes:
        plan: the packs over sample indices; a repeated sample is listed once per repetition.
        source: int64 ``[len(plan.order)]``: the source of each of the plan's entries.
        composition: float64 ``[len(plan), num_sources]``: each pack's measure from each source.
        targets: float64 ``[num_sources]``: the target shares.
        windows: the worst window of the plan (`window_deviation`).
    """

    plan: PackPlan
    source: np.ndarray
    composition: np.ndarray
    targets: np.ndarray
    windows: WindowDeviation

    @property
    def shares(self) -> np.ndarray:
        """Each source's share of the whole plan's measure."""
        totals = self.composition.sum(axis=0)
        return totals / max(float(totals.sum()), 1e-300)


def plan_mixture(
    selection: MixtureSelection,
    lengths: np.ndarray,
    measure: np.ndarray,
    pack_size: int,
    *,
    window: int = DEFAULT_WINDOW,
    lookahead: int = DEFAULT_LOOKAHEAD,
    chunk_packs: int = DEFAULT_CHUNK_PACKS,
    tolerance: float | None = None,
    max_packs: int | None = None,
    seed: int = 0,
    names: list[str] | None = None,
) -> MixturePlan:
    """Pack the samples of ``selection`` so that every window of ``window`` packs holds the mixture.

    Args:
        selection: the chosen samples (`tightpack.core.mixture.resolve_mixture`).
        lengths: int ``[num_samples]``: every sample's length in the pack (aligned), indexed as
            ``selection.samples`` are.
        measure: ``[num_samples]``: what each sample counts for (`sample_measure`).
        pack_size: tokens per pack.
        window: packs per window whose shares are measured (a global batch).
        lookahead: packs `order_packs` chooses among.
        chunk_packs: packs' worth of the stream packed together (`pack_chunks`).
        tolerance: percentage points: a window further than this from a target is an error.
        max_packs: keep this many packs (a target pack count): the latest packs whose samples all
            have their source's most copies are dropped (whole passes first hold), else the last.
        seed: seeds the interleave and the shuffle of each chunk's packs.
        names: the sources' names, for messages.

    Raises:
        MixtureWindowError: with ``tolerance``, when the worst window strays further; the message names
            the window, the source, and what would help.

    >>> from tightpack.core.mixture import resolve_mixture
    >>> lengths, supervised = np.full(40, 4), np.full(40, 2)
    >>> source = np.repeat([0, 1], 20)
    >>> chosen = resolve_mixture(lengths, supervised, source, [1, 1], by="tokens")
    >>> mixed = plan_mixture(chosen, lengths, lengths, 8, window=2)
    >>> len(mixed.plan), mixed.shares.tolist(), mixed.windows.points
    (20, [0.5, 0.5], 0.0)
    """
    targets = selection.targets
    sources = len(targets)
    entry_measure = np.asarray(measure, dtype=np.float64)[selection.samples]
    stream = interleave(entry_measure, selection.source, selection.repetition, targets, seed)
    stream_samples = selection.samples[stream]
    stream_lengths = np.asarray(lengths)[stream_samples]
    most_repeated = float(selection.repetitions.max(initial=1.0))
    chunk_tokens = min(chunk_packs * pack_size, int(stream_lengths.sum() / most_repeated))
    packed = pack_chunks(stream_samples, stream_lengths, pack_size, chunk_tokens, seed)
    entries = stream[packed.order]  # entries, pack by pack
    packs = len(packed)
    pack_of = np.repeat(np.arange(packs), packed.pack_sizes)
    composition = np.bincount(
        pack_of * sources + selection.source[entries], entry_measure[entries], minlength=packs * sources
    ).reshape(packs, sources)
    order = order_packs(composition, targets, lookahead, window)
    if max_packs is not None and max_packs < packs:
        order = _cut(order, packed.offsets, selection.samples[entries], selection.source[entries], max_packs)
    sizes = packed.pack_sizes[order]
    entries = entries[concatenated_ranges(packed.offsets[order], sizes)]
    composition = composition[order]
    plan = PackPlan(
        order=selection.samples[entries], offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    )
    mixed = MixturePlan(
        plan, selection.source[entries], composition, targets, window_deviation(composition, targets, window)
    )
    if tolerance is not None and mixed.windows.points > tolerance:
        raise _window_error(mixed, targets, tolerance, names)
    return mixed


def _cut(
    order: np.ndarray, offsets: np.ndarray, samples: np.ndarray, source: np.ndarray, keep: int
) -> np.ndarray:
    """``order`` less packs, ``keep`` left: the latest packs each of whose samples has its source's most
    copies (dropping one copy of those keeps every sample within one copy of the others: whole passes
    first), and the last packs where too few are such. ``samples``/``source``: per entry, pack by
    pack as ``offsets`` delimit them in the planned (not yet ordered) numbering.

    >>> offsets = np.array([0, 2, 3, 4])  # packs: samples [0, 1], [0] (its second copy), [2]
    >>> _cut(np.array([1, 0, 2]), offsets, np.array([0, 1, 0, 2]), np.zeros(4, dtype=np.int64), 2).tolist()
    [0, 2]
    """
    copies = np.bincount(samples)
    most = np.zeros(int(source.max(initial=0)) + 1, dtype=np.int64)
    np.maximum.at(most, source, copies[samples])
    dropped: list[int] = []
    for position in range(len(order) - 1, -1, -1):  # from the end: a handful of packs in practice
        if len(dropped) == len(order) - keep:
            break
        members = slice(offsets[order[position]], offsets[order[position] + 1])
        mine, theirs = samples[members], source[members]
        if np.all(copies[mine] == most[theirs]) and len(np.unique(mine)) == len(mine):
            dropped.append(position)
            np.subtract.at(copies, mine, 1)
            for s in np.unique(theirs).tolist():  # a source's most copies may fall with them
                most[s] = int(copies[samples[source == s]].max(initial=0))
    kept = np.ones(len(order), dtype=bool)
    kept[dropped] = False
    if kept.sum() > keep:  # too few packs of top copies only: the last packs go
        kept[np.flatnonzero(kept)[keep:]] = False
    return order[kept]


def _window_error(plan: MixturePlan, targets, tolerance: float, names) -> MixtureWindowError:
    """The error of a worst window past ``tolerance``: which packs, which source, how far."""
    windows = plan.windows
    name = names[windows.source] if names else f"source {windows.source}"
    share = plan.composition[windows.first_pack : windows.first_pack + windows.window]
    achieved = share[:, windows.source].sum() / share.sum()
    return MixtureWindowError(
        f"packs {windows.first_pack}-{windows.first_pack + windows.window - 1} hold {achieved:.1%} of "
        f"{name} against a target of {targets[windows.source]:.1%}, {windows.points:.2f} points off "
        f"(tolerance {tolerance:g}): a larger window, a larger pack size or less unequal samples "
        "per source bring windows closer"
    )


def window_deviation(composition: np.ndarray, targets: np.ndarray, window: int) -> WindowDeviation:
    """The worst share deviation over every window of ``window`` consecutive packs.

    Args:
        composition: ``[num_packs, num_sources]``: each pack's measure from each source.
        targets: ``[num_sources]``: the target shares (summing to 1).
        window: packs per window; a plan with fewer packs is one window.

    A window with nothing of the measure (possible with supervised tokens) has no shares and is
    skipped.

    >>> composition = np.array([[3, 1], [1, 3], [2, 2]])
    >>> d = window_deviation(composition, np.array([0.5, 0.5]), 1)
    >>> d.points, d.first_pack
    (25.0, 0)
    >>> window_deviation(composition, np.array([0.5, 0.5]), 2).points  # packs 1-2: 3 of 8 is 37.5%
    12.5
    >>> window_deviation(composition, np.array([0.5, 0.5]), 3).points
    0.0
    """
    if window < 1:
        raise TightpackError(f"window must be at least 1 pack, got {window}", parameters=("window",))
    composition = np.asarray(composition, dtype=np.float64)
    packs, sources = composition.shape
    window = min(window, packs)
    if packs == 0:
        return WindowDeviation(0, 0.0, 0, 0, np.zeros(sources))
    running = np.vstack([np.zeros(sources), np.cumsum(composition, axis=0)])
    sums = running[window:] - running[:-window]  # [windows, sources]
    totals = sums.sum(axis=1, keepdims=True)
    counted = totals[:, 0] > 0
    off = np.zeros_like(sums)
    off[counted] = 100 * np.abs(sums[counted] / totals[counted] - targets)
    first, source = np.unravel_index(int(np.argmax(off)), off.shape)
    return WindowDeviation(window, float(off[first, source]), int(source), int(first), off.max(axis=0))


def interleave(
    measure: np.ndarray, source: np.ndarray, repetition: np.ndarray, targets: np.ndarray, seed: int = 0
) -> np.ndarray:
    """The order of entries in one stream where every source keeps pace with its target share.

    Args:
        measure: ``[num_entries]``: what each entry counts for (`tightpack.core.mixture.sample_measure`).
        source: ``[num_entries]``: each entry's source.
        repetition: ``[num_entries]``: which repetition of its sample an entry is (0 for the first);
            entries grouped by source, then repetition, as `resolve_mixture` lists them.
        targets: ``[num_sources]``: the target shares.
        seed: seeds the shuffle of each repetition.

    Within a source the repetitions come one after the other, each shuffled. An entry's place in
    the stream is the middle of its span, ``(its source's measure before it + half its own) /
    target``, ties to the lower source: after any prefix of the stream, every source's measure is
    within one entry of its share of the prefix's total (a weighted fair queue; the middle, not the
    end, so a large entry is not preceded by a stretch without its source).

    >>> measure, source = np.ones(6), np.array([0, 0, 0, 0, 1, 1])
    >>> order = interleave(measure, source, np.zeros(6), np.array([2, 1]) / 3)
    >>> source[order].tolist()
    [0, 0, 1, 0, 0, 1]
    """
    measure = np.asarray(measure, dtype=np.float64)
    source = np.asarray(source, dtype=np.int64)
    repetition = np.asarray(repetition, dtype=np.int64)
    count = len(source)
    block_starts = np.flatnonzero(
        np.concatenate([[True], (source[1:] != source[:-1]) | (repetition[1:] != repetition[:-1])])
    )
    if count and (np.any(np.diff(source) < 0) or np.any(np.diff(repetition)[np.diff(source) == 0] < 0)):
        raise TightpackError("interleave: entries must be grouped by source, then repetition")  # caller bug
    bounds = np.append(block_starts, count)
    within = np.arange(count)
    generators = [np.random.default_rng(seq) for seq in np.random.SeedSequence(seed).spawn(len(targets))]
    for first, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        within[first:stop] = first + generators[int(source[first])].permutation(stop - first)
    place = np.empty(count)
    starts = np.searchsorted(source, np.arange(len(targets) + 1))
    for s in range(len(targets)):
        part = within[starts[s] : starts[s + 1]]
        place[starts[s] : starts[s + 1]] = np.cumsum(measure[part]) / targets[s]
    return within[np.argsort(place, kind="stable")]  # ties: the lower source, listed first


def order_packs(
    composition: np.ndarray, targets: np.ndarray, lookahead: int = DEFAULT_LOOKAHEAD, window: int = 0
) -> np.ndarray:
    """An order of the packs whose running shares, and with ``window`` those of its last ``window``
    packs, stay close to the targets.

    A pool holds the next ``lookahead`` packs in their planned order; each step takes the pack of the
    pool that leaves smallest the largest running deviation ``|sum(measure_s) - target_s *
    sum(measure)|`` over the packs so far, plus, with ``window > 1``, the same over the window that
    pack closes (it and the ``window - 1`` packs before it); the earliest on a tie. The next pack then
    joins the pool. The running term keeps every source's pace over the whole order (no source is
    left for the end); the window term picks, among packs that keep it, the one its window needs.
    ``lookahead=1`` keeps the order. Returns int64 ``[num_packs]``.

    >>> order_packs(np.array([[4, 0], [4, 0], [0, 4], [0, 4]]), np.array([0.5, 0.5]), 4).tolist()
    [0, 2, 1, 3]
    """
    composition = np.asarray(composition, dtype=np.float64)
    if lookahead < 1:
        raise TightpackError(f"lookahead must be at least 1, got {lookahead}", parameters=("lookahead",))
    if window < 0:
        raise TightpackError(f"window must not be negative, got {window}", parameters=("window",))
    deviation = np.ascontiguousarray(composition - np.outer(composition.sum(axis=1), targets))
    order = np.empty(len(composition), dtype=np.int64)
    _firstfit.order_by_deviation(deviation, composition.shape[1], int(lookahead), int(window), order)
    return order
