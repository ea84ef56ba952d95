"""Packs of a mixture dealt into global batches that each hold the target shares (`deal_batches`),
the last step of `tightpack.core.mixture_plan.plan_mixture`.

A run reads packs a global batch at a time, and a step's gradient is the mixture of its batch. The
packs are cut into batches of ``batch_packs`` consecutive packs (the last one may hold fewer); the
packs of a region of ``region_batches`` batches are dealt among its batches in two steps:

1. **Deal** (greedy): the packs, largest first (a pack's size: the largest of its measures over that
   source's measure in a mean batch), each go to the batch with room where they add least to the
   squared share deviation (each source's measure less its target share of the batch's measure, in
   units of a mean batch's measure of that source), plus ``balance`` times the squared distance of
   the batch's measures from a mean batch's share for its packs so far. A batch that already holds a
   copy of one of the pack's samples is passed over, unless every batch with room does; a pack put
   with a copy that way is then exchanged with a pack of another batch where neither holds a copy,
   and a sample still beside its copy with a sample of the same source, about its length and (where
   one exists) its measure in another batch. A sample with more copies in the region than it has
   batches is not kept apart (some batch must hold two), here or in the exchanges.
2. **Exchange**: while a full batch of the region is further than ``aim`` points from the targets,
   the worst one (or, when no exchange makes it better, the next worst, and so on) gets the first of
   these that makes it better: the best exchanges of one of its samples for one of the samples
   nearest its length in another batch (both packs within the pack size; fill and pack count
   unchanged), up to 32 from one search, best first, each made while it still makes the batch better
   once those before it are made; the best exchange of one of its packs for one of about 1,024 packs
   of the region; the best sample exchange among the 1,024 samples nearest in length (these two
   searches at most twice each per batch of the region). "Best" leaves the larger of the two
   batches' deviations smallest. The other batch must end closer than the one being fixed was when it
   is full (so the worst full batch never gets worse), and no further off than it was when it is the
   partial last one. No exchange brings a copy of a sample into a batch that holds one. Sample
   exchanges that bring the batch less than 1/256 of its way to the aim count as stalled: the pack
   and wide searches follow, and a batch none of them helps waits until another batch's exchange
   changes it. At most ``rounds_per_batch`` rounds (a search and the exchanges it makes) per batch of
   a region; the exchanges stop when no batch above the aim can be made better.
3. **Order**: the full batches of the region are put in the order that keeps the largest running
   deviation of any source (its measure so far less its target share of the measure so far) smallest,
   the earliest on a tie, the partial last batch last: a batch that holds much of a source comes
   among ones that hold little of it, so a source that only some batches can hold is spread over the
   run, not gathered at one end of it. The packs of each batch are put in order the same way (the
   earliest planned on a tie): a stretch of packs that straddles two batches, the end of one and the
   start of the next, then holds the targets nearly as well as a batch does.

The worst full batch is what `tightpack.core.mixture_windows.window_deviation` counts; how close it comes
is data-dependent (a sample whose measure is a large part of a batch's share needs samples dense in
the other sources around it), and nothing here promises a bound: the plan reports the count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tightpack.core import _global_batches
from tightpack.core.planner import PackPlan
from tightpack.core.preference_units import concatenated_ranges
from tightpack.errors import TightpackError

__all__ = ["DEFAULT_AIM", "DealtBatches", "deal_batches"]

DEFAULT_REGION_BATCHES = 256
"""Batches whose packs `deal_batches` deals together: a sample whose measure is a large part of a
batch needs dense samples of the other sources from a large region; the deal's time grows with it."""

DEFAULT_BALANCE = 0.03
"""Weight of a batch's distance from a mean batch's measures in the deal: it keeps batches from
gathering the largest packs together."""

DEFAULT_AIM = 0.5
"""Percentage points: exchanges stop once every full batch of a region is this close to every target."""

DEFAULT_ROUNDS_PER_BATCH = 64
"""At most this many rounds of exchanges (a search and the exchanges it makes) per batch of a region."""


@dataclass(frozen=True)
class DealtBatches:
    """Packs in the order a run reads them, batch after batch (`deal_batches`).

    Attributes:
        plan: the packs over sample indices; samples may have moved between packs (exchanges).
        source: int64 ``[len(plan.order)]``: the source of each entry.
        composition: float64 ``[len(plan), num_sources]``: each pack's measure from each source.
        exchanges: the exchanges made.
    """

    plan: PackPlan
    source: np.ndarray
    composition: np.ndarray
    exchanges: int


def deal_batches(
    plan: PackPlan,
    lengths: np.ndarray,
    measure: np.ndarray,
    source: np.ndarray,
    targets: np.ndarray,
    pack_size: int,
    batch_packs: int,
    *,
    region_batches: int = DEFAULT_REGION_BATCHES,
    balance: float = DEFAULT_BALANCE,
    aim: float = DEFAULT_AIM,
    rounds_per_batch: int = DEFAULT_ROUNDS_PER_BATCH,
) -> DealtBatches:
    """Deal the packs of ``plan`` into global batches of ``batch_packs`` packs that each hold the
    target shares (module docstring).

    Args:
        plan: packs over sample indices, in planned order (no exchange puts a sample into a pack
            that holds a copy of it).
        lengths: int ``[len(plan.order)]``: each entry's tokens in its pack.
        measure: ``[len(plan.order)]``: what each entry counts for.
        source: int ``[len(plan.order)]``: each entry's source.
        targets: ``[num_sources]``: the target shares (summing to 1).
        pack_size: tokens per pack: no exchange fills a pack past it.
        batch_packs: packs per global batch.
        region_batches: batches dealt together.
        balance: weight of the batches' balance in the deal.
        aim: percentage points: exchanges stop once every full batch is this close.
        rounds_per_batch: at most this many rounds of exchanges per batch of a region.

    >>> plan = PackPlan(order=np.arange(4), offsets=np.array([0, 1, 2, 3, 4]))
    >>> dealt = deal_batches(plan, np.ones(4), np.ones(4), np.array([0, 0, 1, 1]), np.array([0.5, 0.5]), 1, 2)
    >>> dealt.composition.tolist()  # each batch of two packs holds one of each source
    [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    """
    if batch_packs < 1:
        raise TightpackError(
            f"a global batch must hold at least 1 pack, got {batch_packs}", parameters=("window",)
        )
    targets = np.ascontiguousarray(targets, dtype=np.float64)
    packs = len(plan)
    offsets = np.ascontiguousarray(plan.offsets, dtype=np.int64)
    samples, slot_sample = _numbered(np.asarray(plan.order, dtype=np.int64))
    slot_length = np.array(lengths, dtype=np.int64)
    slot_source = np.array(source, dtype=np.int64)
    slot_measure = np.array(measure, dtype=np.float64)
    pack_of = np.repeat(np.arange(packs, dtype=np.int64), np.diff(offsets))
    composition = np.bincount(
        pack_of * len(targets) + slot_source, slot_measure, minlength=packs * len(targets)
    ).reshape(packs, len(targets))
    order = np.empty(packs, dtype=np.int64)
    exchanges = _global_batches.deal_batches(
        targets, int(batch_packs), int(region_batches), float(balance), int(rounds_per_batch),
        float(aim) / 100, int(pack_size), offsets, composition, slot_sample, slot_length, slot_source,
        slot_measure, order,
    )  # fmt: skip
    sizes = np.diff(offsets)[order]
    slots = concatenated_ranges(offsets[order], sizes)
    dealt = PackPlan(
        order=samples[slot_sample[slots]], offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    )
    return DealtBatches(dealt, slot_source[slots], composition[order], int(exchanges))


def _numbered(order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(order, return_inverse=True)`` (int64): by a table of the sample numbers when they
    are dense (no sort), else by numpy's sort.

    >>> [part.tolist() for part in _numbered(np.array([5, 2, 5, 9]))]
    [[2, 5, 9], [1, 0, 1, 2]]
    """
    if len(order) and 0 <= order.min() and order.max() < 4 * len(order):
        present = np.zeros(int(order.max()) + 1, dtype=bool)
        present[order] = True
        return np.flatnonzero(present), (np.cumsum(present) - 1)[order]
    samples, inverse = np.unique(order, return_inverse=True)
    return samples, np.ascontiguousarray(inverse, dtype=np.int64)
