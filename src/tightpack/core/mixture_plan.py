"""Packs of a mixture whose shares hold in every global batch a training run reads, not only overall.

A run reads packs in order, a global batch at a time: a mixture whose shares are right over the
whole output but drift along it (all of one source first) trains on a different mixture at every
step. `plan_mixture` packs the samples `tightpack.core.mixture.resolve_mixture` chose in three
steps:

1. **Interleave** (`interleave`): the samples in one stream in which every source's measure keeps
   pace with its share: a sample's place is its source's running measure up to it, divided by the
   source's target share (a weighted fair queue). Within a source the samples come in a seeded
   shuffled order, one repetition after the other.
2. **Pack in chunks** (`tightpack.core.mixture_chunks.pack_chunks`): the stream is cut into
   chunks of about ``chunk_packs`` packs' tokens (at most a pass of the most repeated source, at
   least `LEAST_CHUNK_PACKS` packs' worth); each chunk is packed apart, first fit with the large
   samples longest first and the small ones after them in stream order (first fit decreasing over
   all, or first fit in stream order where a quarter of the chunk are copies kept apart, where that
   saves more), copies of a sample in different packs (as far as the chunk's packs allow); its
   packs under half full join the next chunk, and its packs are shuffled. A chunk holds the
   mixture, as every stretch of the stream does, and fills about as a packing of the whole would.
3. **Deal into global batches** (`tightpack.core.global_batches.deal_batches`): the packs are dealt
   into batches of ``window`` packs, each batch holding the targets: a greedy deal, then exchanges
   of samples of about equal length (or of packs) between the worst batch and the others.

What is guaranteed is what is measured: `window_deviation` counts, over every global batch of
``window`` consecutive packs from the first (the last, partial batch apart), each source's share
against its target, exactly; the plan carries the worst batch, and ``tolerance`` turns a worst batch
past it into an error (`MixtureWindowError`) instead of an output. The whole output's shares are
`resolve_mixture`'s, to half a sample per source; copies of a sample are kept in different packs
(unless they outnumber half the packs their chunk's tokens fill) and in different global batches where the
deal finds a way (a sample with more copies than a region has batches is not kept apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tightpack.core.global_batches import DEFAULT_AIM, deal_batches
from tightpack.core.mixture import MixtureSelection
from tightpack.core.mixture_chunks import DEFAULT_CHUNK_PACKS, pack_chunks
from tightpack.core.mixture_windows import WindowDeviation, window_deviation
from tightpack.core.planner import PackPlan
from tightpack.core.preference_units import concatenated_ranges
from tightpack.errors import TightpackError

__all__ = [
    "MixturePlan",
    "MixtureWindowError",
    "WindowDeviation",
    "interleave",
    "pack_mixture",
    "plan_mixture",
    "window_deviation",
]

DEFAULT_WINDOW = 64
"""Packs per global batch whose shares `plan_mixture` holds and reports by default."""

LEAST_CHUNK_PACKS = 64
"""`pack_mixture` packs at least this many packs' worth of the stream together (or ``chunk_packs``
where that is fewer), however short a pass of the most repeated source: on 40 random mixtures 64 left
the worst batches summing to 38.9 points where 256 left 40.3, and a source of 5 rows repeated 2,000
times beside 10,000 short rows fills 95.2% of its 64-token packs, not the 85.7% of one chunk a pass."""


class MixtureWindowError(TightpackError):
    """A global batch of the plan strays from the targets by more than the asked tolerance."""


@dataclass(frozen=True)
class MixturePlan:
    """The packs of a mixture, in the order a run reads them (`plan_mixture`).

    Attributes:
        plan: the packs over sample indices; a repeated sample is listed once per repetition.
        source: int64 ``[len(plan.order)]``: the source of each of the plan's entries.
        composition: float64 ``[len(plan), num_sources]``: each pack's measure from each source.
        targets: float64 ``[num_sources]``: the target shares.
        windows: the worst global batch of the plan (`window_deviation`).
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
    chunk_packs: int = DEFAULT_CHUNK_PACKS,
    tolerance: float | None = None,
    aim: float = DEFAULT_AIM,
    max_packs: int | None = None,
    seed: int = 0,
    names: list[str] | None = None,
) -> MixturePlan:
    """Pack the samples of ``selection`` so that every global batch of ``window`` packs holds the
    mixture.

    Args:
        selection: the chosen samples (`tightpack.core.mixture.resolve_mixture`).
        lengths: int ``[num_samples]``: every sample's length in the pack (aligned), indexed as
            ``selection.samples`` are.
        measure: ``[num_samples]``: what each sample counts for (`sample_measure`).
        pack_size: tokens per pack.
        window: packs per global batch, whose shares are held and measured.
        chunk_packs: packs' worth of the stream packed together (`pack_chunks`).
        tolerance: percentage points: a full batch further than this from a target is an error.
        aim: percentage points: the deal's exchanges stop once every full batch is this close (no
            further than ``tolerance`` either).
        max_packs: keep this many packs (a target pack count): the latest packs whose samples all
            have their source's most copies are dropped (whole passes first hold), else the last.
        seed: seeds the interleave and the shuffle of each chunk's packs.
        names: the sources' names, for messages.

    Raises:
        MixtureWindowError: with ``tolerance``, when the worst full batch strays further; the message
            names the batch, the source, and what would help.

    >>> from tightpack.core.mixture import resolve_mixture
    >>> lengths, supervised = np.full(40, 4), np.full(40, 2)
    >>> source = np.repeat([0, 1], 20)
    >>> chosen = resolve_mixture(lengths, supervised, source, [1, 1], by="tokens")
    >>> mixed = plan_mixture(chosen, lengths, lengths, 8, window=2)
    >>> len(mixed.plan), mixed.shares.tolist(), mixed.windows.points
    (20, [0.5, 0.5], 0.0)
    """
    targets = selection.targets
    measure = np.asarray(measure, dtype=np.float64)
    lengths = np.asarray(lengths)
    packed = pack_mixture(selection, lengths, measure, pack_size, chunk_packs=chunk_packs, seed=seed)
    entries = packed.order  # entries of the selection, pack by pack
    kept = np.arange(len(packed))
    if max_packs is not None and max_packs < len(packed):
        kept = _cut(kept, packed.offsets, selection.samples[entries], selection.source[entries], max_packs)
    sizes = packed.pack_sizes[kept]
    entries = entries[concatenated_ranges(packed.offsets[kept], sizes)]
    plan = PackPlan(
        order=selection.samples[entries], offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    )
    if tolerance is not None:
        aim = min(aim, tolerance)
    dealt = deal_batches(
        plan,
        lengths[plan.order],
        measure[plan.order],
        selection.source[entries],
        targets,
        pack_size,
        window,
        aim=aim,
    )
    mixed = MixturePlan(
        dealt.plan,
        dealt.source,
        dealt.composition,
        targets,
        window_deviation(dealt.composition, targets, window),
    )
    if tolerance is not None and mixed.windows.points > tolerance:
        raise _window_error(mixed, targets, tolerance, names)
    return mixed


def pack_mixture(
    selection: MixtureSelection,
    lengths: np.ndarray,
    measure: np.ndarray,
    pack_size: int,
    *,
    chunk_packs: int = DEFAULT_CHUNK_PACKS,
    seed: int = 0,
) -> PackPlan:
    """The first two steps of `plan_mixture`: the selection's entries interleaved and packed in chunks,
    in planned order, before the deal into global batches (which keeps the packs and their count).

    Returns the packs over entries of the selection (indices into ``selection.samples``).

    >>> from tightpack.core.mixture import resolve_mixture
    >>> chosen = resolve_mixture(np.full(6, 4), np.full(6, 2), np.repeat([0, 1], 3), [1, 1], by="tokens")
    >>> len(pack_mixture(chosen, np.full(6, 4), np.full(6, 4.0), 8))
    3
    """
    lengths = np.asarray(lengths)
    entry_measure = np.asarray(measure, dtype=np.float64)[selection.samples]
    stream = interleave(entry_measure, selection.source, selection.repetition, selection.targets, seed)
    stream_samples = selection.samples[stream]
    stream_lengths = lengths[stream_samples]
    # a chunk holds about a pass of the most repeated source (about one copy of each sample), but
    # never fewer than LEAST_CHUNK_PACKS packs' tokens: a few samples repeated many times would make
    # chunks of a few packs, each ending a pack or so below full
    pass_tokens = int(stream_lengths.sum() / float(selection.repetitions.max(initial=1.0)))
    least = min(chunk_packs, LEAST_CHUNK_PACKS) * pack_size
    chunk_tokens = max(least, min(chunk_packs * pack_size, pass_tokens))
    packed = pack_chunks(stream_samples, stream_lengths, pack_size, chunk_tokens, seed)
    return PackPlan(order=stream[packed.order], offsets=packed.offsets)


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
    """The error of a worst global batch past ``tolerance``: which packs, which source, how far."""
    windows = plan.windows
    name = names[windows.source] if names else f"source {windows.source}"
    share = plan.composition[windows.first_pack : windows.first_pack + windows.window]
    achieved = share[:, windows.source].sum() / share.sum()
    return MixtureWindowError(
        f"global batch {windows.first_pack // windows.window} (packs {windows.first_pack}-"
        f"{windows.first_pack + windows.window - 1}) holds {achieved:.1%} of {name} against a target of "
        f"{targets[windows.source]:.1%}, {_beyond(windows.points, tolerance)} points off (tolerance "
        f"{tolerance:g}): a "
        "larger global batch (where the output holds many), a larger pack size, fewer repetitions or less "
        "unequal samples per source bring batches closer"
    )


def _beyond(points: float, tolerance: float) -> str:
    """``points`` (past ``tolerance``) to as many digits as show it past: 13.553 against a tolerance of
    13.55, not 13.55.

    >>> _beyond(13.5525006, 13.55), _beyond(13.5525006, 13.5525), _beyond(2.5, 2.0)
    ('13.553', '13.553', '2.5')
    """
    for digits in range(4, 18):
        shown = f"{points:.{digits}g}"
        if float(shown) > tolerance:
            return shown
    return repr(points)


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
