"""Cost-balanced packs: a plan rewritten so pack costs spread less, as many packs (issue 13).

`tightpack.core.planner` fills packs by tokens only, so two full packs can differ several-fold in
compute: one long sequence costs far more attention work than many short ones of the same total
(`tightpack.core.cost_model`), and best-fit decreasing tends to put sequences of middle length
together. `balance_pack_costs` keeps the number of packs of a plan (hence its token fill) and deals
the sequences again, in two phases:

1. *long* sequences (at least ``pack_size / 16`` tokens), longest first, each to the pack that costs
   least so far among those with room for it: LPT scheduling under a capacity, so the squared
   lengths spread over all packs instead of piling up in some;
2. *short* sequences fill the room left, longest first, first fit (the planner's C kernel: each
   pack enters as one item of its used length plus a constant that keeps two packs from sharing a
   bin, in a capacity grown by the same constant).

Sequences that fit no pack's room (rare: the packs are as many as the plan's) form new packs. When
that would add more than ``extra_packs`` (0.1% by default: the issue's "no more packs than bfd +
0.1%"; none below 1,000 packs), the bar of phase 1 rises (``pack_size / 8``, ``/ 4``, ``/ 2``): fewer
sequences dealt by cost, more left to fill the rooms. If no bar fits the budget with a lower spread
of pack cost (standard deviation) than the input's, the input plan is returned unchanged. A pack whose cost
comes from one long sequence cannot get lighter (sequences are never split): that is the floor any
balancing pays, and what narrows is the spread of the others.
"""

from __future__ import annotations

import heapq

import numpy as np

from tightpack.core.cost_model import CostModel
from tightpack.core.planner import PackPlan, first_fit_bins, plan_packs
from tightpack.errors import TightpackError

_LONG_FRACTIONS = (16, 8, 4, 2)
"""Sequences of at least ``pack_size / f`` tokens are dealt by cost, shorter ones fill, for the first
``f`` whose result fits the budget of packs."""


def balance_pack_costs(
    plan: PackPlan,
    lengths: np.ndarray,
    pack_size: int,
    cost_model: CostModel,
    *,
    extra_packs: float = 0.001,
) -> PackPlan:
    """The samples of ``plan`` dealt again into as many packs, with pack costs closer to their mean.

        Args:
            plan: a plan of ``lengths`` (e.g. from ``plan_packs(lengths, pack_size)``).
            lengths: runtime lengths of the samples, ``[num_samples]``, the unit of ``pack_size``.
            pack_size: capacity of a pack; no pack of the result holds more.
            cost_model: the cost of a pack (`CostModel.pack_costs`).
            extra_packs: the most packs the result may add, as a fraction of ``len(plan)`` (0 allows none).

        Returns:
            ``plan`` itself when the rewrite does not lower the spread (standard deviation) of pack costs
            or needs too many packs; else a `PackPlan` of at most ``len(plan) + floor(extra_packs *
            len(plan))`` packs holding every sample of ``plan`` once.

        Two packs of 10 tokens under a cost of ``s**2``: best fit puts 4 + 4 + 2 together (36) and ten 1s in
        the other (10). Dealt by cost (at this size every sequence counts as long), each pack takes a 4,
    the 2 goes to the first, and each 1 to the cheaper pack with room:

        >>> model = CostModel(linear=0.0, quadratic=1.0, unit="tokens**2")
        >>> lengths = np.array([4, 4, 2] + [1] * 10)
        >>> plan = PackPlan(order=np.arange(13), offsets=np.array([0, 3, 13]))
        >>> model.pack_costs(plan, lengths).tolist()
        [36.0, 10.0]
        >>> balanced = balance_pack_costs(plan, lengths, 10, model)
        >>> model.pack_costs(balanced, lengths).tolist(), balanced.pack_loads(lengths).tolist()
        ([24.0, 22.0], [10, 10])
    """
    if not isinstance(cost_model, CostModel):
        raise TightpackError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    if (
        isinstance(extra_packs, bool)
        or not isinstance(extra_packs, (int, float))
        or not 0 <= extra_packs <= 1
    ):
        raise TightpackError(f"extra_packs must be a fraction in [0, 1], got {extra_packs!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(plan) == 0:
        return plan
    if int(plan.pack_loads(lengths).max()) > pack_size:
        raise TightpackError(f"the plan has a pack above pack_size {pack_size}; plan with that pack size")
    samples = plan.order[np.argsort(-lengths[plan.order], kind="stable")]  # longest first
    spread = cost_model.pack_costs(plan, lengths).std()
    # A lower bar deals more sequences by cost but leaves less to fill the rooms with: from the
    # lowest, the first bar whose packs fit the budget and spread costs less wins.
    for fraction in _LONG_FRACTIONS:
        balanced = _deal(samples, lengths, len(plan), pack_size, cost_model, max(1, pack_size // fraction))
        if len(balanced) <= len(plan) + int(extra_packs * len(plan)):
            if cost_model.pack_costs(balanced, lengths).std() < spread:
                return balanced
    return plan


def _deal(
    samples: np.ndarray, lengths: np.ndarray, packs: int, pack_size: int, cost_model: CostModel, bar: int
) -> PackPlan:
    """``samples`` (longest first) in ``packs`` packs: those of ``bar`` tokens or more by cost, then the
    rest by first fit into the room left; what fits nowhere in new packs after them."""
    long_count = int((lengths[samples] >= bar).sum())
    long_samples, short_samples = samples[:long_count], samples[long_count:]
    long_costs = cost_model.sequence_costs(lengths[long_samples])
    long_pack, used = _deal_long(lengths[long_samples], long_costs, packs, pack_size)
    placed = long_pack >= 0
    # Pack p enters first fit as one item of (pack_size + 1 + used[p]) tokens in bins of 2 * pack_size + 1:
    # no two such items share a bin (each is above half of it), so pack p opens bin p, and a short
    # sequence fits bin p exactly when it fits the room pack_size - used[p].
    items = np.concatenate((pack_size + 1 + used, lengths[short_samples]))
    bins = first_fit_bins(items, 2 * pack_size + 1)[0][packs:]
    in_packs = bins < packs
    pack_of = np.concatenate((long_pack[placed], bins[in_packs]))
    members = np.concatenate((long_samples[placed], short_samples[in_packs]))
    rest = np.concatenate((long_samples[~placed], short_samples[~in_packs]))
    sizes = np.bincount(pack_of, minlength=packs)
    order, sizes = members[np.argsort(pack_of, kind="stable")], sizes[sizes > 0]  # an empty pack is dropped
    if len(rest):
        extra = plan_packs(lengths[rest], pack_size)
        order, sizes = np.concatenate((order, rest[extra.order])), np.concatenate((sizes, extra.pack_sizes))
    return PackPlan(order=order, offsets=np.concatenate(([0], np.cumsum(sizes))))


def _deal_long(
    lengths: np.ndarray, costs: np.ndarray, packs: int, pack_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence (longest first) to the cheapest pack with room for it.

    Returns the pack of each sequence, int64 ``[n]`` (-1 where no pack has room left), and the tokens
    used in each pack, int64 ``[packs]``. The cheapest packs are the least loaded ones, so the scan
    past packs without room stays short.
    """
    used = np.zeros(packs, dtype=np.int64)
    load = np.zeros(packs, dtype=np.float64)
    owner = np.full(len(lengths), -1, dtype=np.int64)
    cheapest = [(0.0, pack) for pack in range(packs)]  # already a heap
    for index, (size, cost) in enumerate(zip(lengths.tolist(), costs.tolist(), strict=True)):
        skipped = []
        while cheapest and used[cheapest[0][1]] + size > pack_size:
            skipped.append(heapq.heappop(cheapest))
        if cheapest:
            pack = cheapest[0][1]
            owner[index], used[pack], load[pack] = pack, used[pack] + size, load[pack] + cost
            heapq.heapreplace(cheapest, (load[pack], pack))
        for entry in skipped:
            heapq.heappush(cheapest, entry)
    return owner, used
