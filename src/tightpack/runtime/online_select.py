"""Which buffered candidates make the next pack of an `OnlinePacker`, under the token and cost limits.

This module owns the selection of both strategies: `ffd_groups` (first-fit decreasing over the
whole buffer) and `best_fill` (forced samples, then the fullest top-up), with the optional cost cap,
and `closed_by_cost`, the test behind ``counts["capped_packs"]``. The packer (reading, emission,
counts, checkpoints) and the argument that ``best_fill`` meets every deadline live in
`tightpack.runtime.online`; the fills themselves in `tightpack.core.subset_fill` (tokens) and
`tightpack.core.capped_fill` (tokens and cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tightpack.core.capped_fill import capped_subset, first_fit_decreasing_capped, fits_cost, pack_cost
from tightpack.core.planner import plan_packs
from tightpack.core.subset_fill import best_subset


@dataclass
class Candidate:
    """A buffered sample and what the selection needs of it."""

    key: Any
    sample: dict[str, Any]
    length: int  # aligned length, tokens
    arrival: int  # step at which it entered the buffer
    tokens: int  # length as read, before truncation and alignment
    nbytes: int  # host memory held by its tensors
    cost: float = 0.0  # cost of its aligned length, in the cost model's unit; 0 without one
    origin: tuple[int, int] | None = None  # weighted sources: (source, index or stream position)


def ffd_groups(buffer: list[Candidate], pack_size: int, cost_cap: float | None) -> list[list[Candidate]]:
    """The whole buffer in first-fit-decreasing groups; with ``cost_cap``, both limits decide a fit."""
    if cost_cap is None:
        plan = plan_packs([c.length for c in buffer], pack_size, algorithm="ffd")
        return [[buffer[i] for i in pack.tolist()] for pack in plan]
    groups = first_fit_decreasing_capped(
        [c.length for c in buffer], [c.cost for c in buffer], pack_size, cost_cap
    )
    return [[buffer[i] for i in group] for group in groups]


def by_deadline(buffer: list[Candidate], step: int, wait_limit: int) -> list[tuple[int, Candidate]]:
    """``(slack, candidate)`` for the buffer in deadline order: the list index is the rank."""
    ordered = sorted(buffer, key=lambda c: (c.arrival, str(c.key)))
    return [(c.arrival + wait_limit - step, c) for c in ordered]


def best_fill(
    buffer: list[Candidate], step: int, wait_limit: int, pack_size: int, cost_cap: float | None
) -> tuple[list[Candidate], int]:
    """The members of the next ``best_fill`` pack, in buffer order, and how many of them were forced.

    Tight samples first, in deadline order, each if it still fits: the first always (it enters the
    empty pack, whatever its cost), a later one when its tokens and its cost fit. Then the top-up.

    Raises:
        RuntimeError: the deadline invariant of `tightpack.runtime.online` is broken (a bug).
    """
    ordered = by_deadline(buffer, step, wait_limit)
    chosen: list[Candidate] = []
    room = pack_size
    for rank, (slack, candidate) in enumerate(ordered):
        # The invariant of the online module docstring, slack >= rank, is what guarantees every
        # deadline; checking it costs one comparison per candidate.
        if slack < rank:
            raise RuntimeError(
                f"online packer invariant broken at step {step}: sample {candidate.key!r} has "
                f"{slack} steps left before its deadline but {rank} samples due no later ahead of it, "
                "so its max_wait can no longer be guaranteed; this is a bug in tightpack, please "
                "report it"
            )
        # Tight (slack == rank): forced if it fits. The first tight one goes into an empty pack, so it
        # always fits; a later one left out is fine: an earlier-ranked one leaves, so its rank drops
        # by at least one as its slack drops by one.
        if slack == rank and candidate.length <= room:
            if cost_cap is None or not chosen or _joins(chosen, candidate, cost_cap):
                chosen.append(candidate)
                room -= candidate.length
    forced = len(chosen)
    taken = {id(c) for c in chosen}
    if cost_cap is None:
        oldest = next((c for _, c in ordered if id(c) not in taken and c.length <= room), None)
        if oldest is not None:
            rest = sorted(
                (c for c in buffer if id(c) not in taken and c.length <= room),
                key=lambda c: (c.length, c.arrival, str(c.key)),
            )
            best = best_subset([c.length for c in rest], room, first=rest.index(oldest))
            taken.update(id(rest[i]) for i in best)
    else:
        taken.update(id(c) for c in _capped_top_up(ordered, chosen, room, cost_cap))
    return [c for c in buffer if id(c) in taken], forced


def _joins(members: list[Candidate], candidate: Candidate, cost_cap: float) -> bool:
    """Whether ``candidate`` joins ``members`` without their pack cost exceeding ``cost_cap``."""
    return bool(fits_cost([c.cost for c in members], [candidate.cost], cost_cap)[0])


def _capped_top_up(
    ordered: list[tuple[int, Candidate]], chosen: list[Candidate], room: int, cost_cap: float
) -> list[Candidate]:
    """The top-up under both limits: `capped_subset` over the candidates not chosen, the same preferences.

    Into an empty pack, a candidate whose cost alone exceeds the cap may go instead, alone: the
    longest such one (the oldest among equals) when it holds more tokens than the capped fill.
    """
    taken = {id(c) for c in chosen}
    held = [c.cost for c in chosen]
    rest = sorted(
        (c for _, c in ordered if id(c) not in taken and c.length <= room),
        key=lambda c: (c.length, c.arrival, str(c.key)),
    )
    if not rest:
        return []
    affordable = fits_cost(held, [c.cost for c in rest], cost_cap).tolist()
    position = {id(c): i for i, c in enumerate(rest)}
    first = next(
        (position[id(c)] for _, c in ordered if id(c) in position and affordable[position[id(c)]]), None
    )
    picked = [
        rest[i]
        for i in capped_subset(
            [c.length for c in rest], [c.cost for c in rest], room, cost_cap, held_costs=held, first=first
        )
    ]
    if not chosen:
        over_cap = [c for c, fits in zip(rest, affordable, strict=True) if not fits]
        alone = max(over_cap, key=lambda c: (c.length, -c.arrival), default=None)
        if alone is not None and alone.length > sum(c.length for c in picked):
            return [alone]
    return picked


def closed_by_cost(group: list[Candidate], waiting: list[Candidate], pack_size: int, cost_cap: float) -> bool:
    """Whether the cost cap closed ``group``: a candidate left ``waiting`` fits its tokens but not its cost.

    ``waiting`` are the candidates that were in the buffer when ``group`` was formed and are left for
    later packs. Without a cost cap none ever fits the tokens left (``best_fill`` tops up exactly,
    first fit tried every earlier group), so such a candidate was kept out by the cap.
    """
    room = pack_size - sum(c.length for c in group)
    fitting = [c.cost for c in waiting if c.length <= room]
    return bool(fitting) and not fits_cost([c.cost for c in group], fitting, cost_cap).all()


def group_cost(group: list[Candidate]) -> float:
    """The pack cost of ``group`` (`tightpack.core.capped_fill.pack_cost`)."""
    return pack_cost([c.cost for c in group])
