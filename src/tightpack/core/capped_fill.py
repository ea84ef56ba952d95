"""Fills under two limits: a token capacity and a cost cap (the online packer's ``max_pack_cost``).

A pack's cost is the sum of its members' costs (`tightpack.core.cost_model.CostModel.sequence_costs`
of their runtime lengths), added with `math.fsum`: exactly rounded, so whether a set of members fits
the cap never depends on the order they were added in (`pack_cost`, `fits_cost`). Two fills live here:

- `capped_subset`: the top-up of a pack, many tokens under both limits. The fullest fill under both
  is a two-constraint knapsack; this is exact when the fullest token fill already fits the cap and a
  repair-and-refill heuristic otherwise.
- `first_fit_decreasing_capped`: first-fit decreasing where a candidate fits a group when both its
  tokens and its cost do.

The token-only versions are `tightpack.core.subset_fill.best_subset` and
`tightpack.core.planner.plan_packs` (``ffd``). Numpy only; `tightpack.runtime.online_select` applies them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tightpack.core.subset_fill import best_subset

_SLACK = 8 * float(np.finfo(np.float64).eps)
"""Relative margin within which a float sum is too close to the cap to decide without `math.fsum`."""


def pack_cost(costs: Sequence[float] | np.ndarray) -> float:
    """The cost of a pack from its members' costs: their exactly rounded sum.

    >>> pack_cost([0.1] * 10)
    1.0
    """
    return math.fsum(float(cost) for cost in costs)


def fits_cost(
    member_costs: Sequence[float], extra_costs: Sequence[float] | np.ndarray, cost_cap: float
) -> np.ndarray:
    """For each of ``extra_costs``: does it join ``member_costs`` with a `pack_cost` within ``cost_cap``?

    Costs are finite and non-negative; returns bool ``[len(extra_costs)]``. A vectorized float sum decides
    every case not within a few ulps of the cap; those few are summed exactly.

    >>> fits_cost([0.1] * 9, [0.1, 0.2], 1.0).tolist()
    [True, False]
    """
    extra = np.asarray(extra_costs, dtype=np.float64)
    members = [float(cost) for cost in member_costs]
    approximate = math.fsum(members) + extra
    margin = _SLACK * np.maximum(approximate, cost_cap)
    fits = approximate <= cost_cap - margin
    for close in np.flatnonzero(np.abs(approximate - cost_cap) <= margin).tolist():
        fits[close] = math.fsum([*members, float(extra[close])]) <= cost_cap
    return fits


def _cost_per_token(cost: float, length: int) -> float:
    """Cost over tokens; a zero-length candidate with a cost is the costliest per token."""
    if length > 0:
        return cost / length
    return math.inf if cost > 0 else 0.0


def capped_subset(
    lengths: Sequence[int],
    costs: Sequence[float] | np.ndarray,
    capacity: int,
    cost_cap: float,
    *,
    held_costs: Sequence[float] = (),
    first: int | None = None,
) -> list[int]:
    """A subset with many tokens, at most ``capacity``, and cost at most ``cost_cap`` with ``held_costs``.

    ``held_costs`` are the costs of members already in the pack (their tokens are already out of
    ``capacity``). Candidates that do not fit alone, by tokens or by cost, are never chosen. Order the
    candidates by preference, as for `best_subset`; ``first`` is the one to hold when that costs no fill.

    Fill, repair, refill: take the fullest token subset (`best_subset`, exact); if it breaks the cost
    cap, drop its members with the most cost per token first (ties: the later in preference order)
    until it fits, and fill what room is left the same way, from the candidates never dropped. So the
    result is exact (the fullest, with `best_subset`'s tie-breaks) whenever the fullest token subset
    fits the cap, and a heuristic otherwise: the fullest fill under both limits is a two-constraint
    knapsack. Each round drops or takes at least one candidate, so there are at most
    ``len(lengths)`` rounds. The indices come back in increasing order.

    >>> capped_subset([5, 4, 3], [25, 16, 9], 12, 50)  # 5 + 4 + 3 costs 50: the fullest fits
    [0, 1, 2]
    >>> capped_subset([5, 4, 3], [25, 16, 9], 12, 40)  # drop 5 (5 per token), then 4 + 3 costs 25
    [1, 2]
    """
    token_lengths = np.asarray(lengths, dtype=np.int64)
    sample_costs = np.asarray(costs, dtype=np.float64)
    held = [float(cost) for cost in held_costs]
    chosen: list[int] = []
    open_ = np.ones(len(token_lengths), dtype=bool)  # neither taken nor dropped yet
    while True:
        member_costs = held + sample_costs[chosen].tolist()
        room = capacity - int(token_lengths[chosen].sum())
        fitting = open_ & (token_lengths <= room) & fits_cost(member_costs, sample_costs, cost_cap)
        pool = np.flatnonzero(fitting).tolist()
        if not pool:
            break
        anchor = pool.index(first) if first in pool else None
        picked = [pool[j] for j in best_subset(token_lengths[pool].tolist(), room, first=anchor)]
        if not picked:  # only zero-length candidates are left: they add no tokens
            break
        open_[picked] = False
        worst_first = sorted(
            picked,
            key=lambda i: (_cost_per_token(float(sample_costs[i]), int(token_lengths[i])), i),
            reverse=True,
        )
        dropped = 0
        while pack_cost(member_costs + sample_costs[picked].tolist()) > cost_cap:
            picked.remove(worst_first[dropped])
            dropped += 1
        chosen += picked
        if not dropped:  # the fullest fill of the room fits the cap: nothing left fits the room
            break
    return sorted(chosen)


def first_fit_decreasing_capped(
    lengths: Sequence[int], costs: Sequence[float] | np.ndarray, capacity: int, cost_cap: float
) -> list[list[int]]:
    """First-fit decreasing: every index into packs of at most ``capacity`` tokens and ``cost_cap`` cost.

    Candidates go longest first (equal lengths in input order) into the first group where both their
    tokens and their cost fit, or open a new group. A candidate whose cost alone exceeds ``cost_cap``
    opens a group that nothing joins. Groups come in the order they were opened, members in the
    order they were placed (as `tightpack.core.planner.plan_packs` lists ``ffd`` packs).

    >>> first_fit_decreasing_capped([5, 4, 3, 2], [25, 16, 9, 4], 9, 30)
    [[0, 3], [1, 2]]
    >>> first_fit_decreasing_capped([5, 4, 3, 2], [25, 16, 9, 4], 9, 20)
    [[0], [1, 3], [2]]
    """
    token_lengths = np.asarray(lengths, dtype=np.int64)
    sample_costs = np.asarray(costs, dtype=np.float64)
    order = np.argsort(-token_lengths, kind="stable").tolist()
    groups: list[list[int]] = []
    loads = np.zeros(len(order), dtype=np.int64)  # tokens of each group opened so far
    spent = np.zeros(len(order), dtype=np.float64)  # pack_cost of each group opened so far
    for i in order:
        cost = float(sample_costs[i])
        opened = len(groups)
        # a float pre-test over every group; the exact test only where it passes
        maybe = (loads[:opened] + token_lengths[i] <= capacity) & (
            spent[:opened] + cost <= cost_cap * (1 + _SLACK)
        )
        target = next(
            (
                g
                for g in np.flatnonzero(maybe).tolist()
                if fits_cost(sample_costs[groups[g]], [cost], cost_cap)[0]
            ),
            opened,
        )
        if target == opened:
            groups.append([])
        groups[target].append(i)
        loads[target] += token_lengths[i]
        spent[target] = pack_cost(sample_costs[groups[target]])
    return groups
