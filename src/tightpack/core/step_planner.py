"""One training step's sequences into balanced micro-batches for every data-parallel rank (`plan_step`).

In RL post-training (GRPO, PPO, RLOO) the batch of a step is generated on the fly, and in global-batch
SFT packing it is drawn from a pool: either way the step's sequences must be dealt to ``DP`` ranks and
cut into micro-batches under a token budget, every step, in milliseconds. A data-parallel step lasts as
long as its slowest rank, and ranks that run different numbers of micro-batches hang collectives.
`plan_step` returns a `StepPlan` that every rank computes alike from the all-gathered lengths:

1. **Ranks by cost.** Every sequence (or every group that must stay on one rank) costs what the cost
   model says (`tightpack.core.cost_model.CostModel`: ``linear * s + quadratic * s**2 + per_sequence``;
   tokens when none is given). Costs are additive over THD micro-batches, so a rank's time is the sum of
   its sequences' costs whatever its micro-batches. Items are dealt heaviest first, each to the least
   loaded rank (LPT, Graham 1969). Bound, for any inputs: the slowest rank costs at most
   ``mean + (1 - 1/DP) * c_max`` (``c_max`` the costliest item), and at most ``(4/3 - 1/(3 DP))`` times
   the best any dealing could do.
2. **Micro-batches by tokens.** Each rank's sequences, longest first, go to the first of its
   micro-batches with room under ``max_tokens`` (first-fit decreasing: at most ``11/9 OPT + 6/9``
   micro-batches per rank, Dósa 2007), or, with a fixed ``micro_batches`` count, each to the rank's
   lightest micro-batch. Every rank then gets the same count, the most any rank needs: a rank with
   fewer splits its fullest micro-batches (a sequence moved into one of its own), and only a rank with
   fewer sequences than the count gets empty micro-batches, which the plan counts.

Deterministic: ties go to the lower index, and ``seed`` permutes which rank is called which (rank 0 is
not always the one with the costliest sequence). After the dealing, up to 64 moves or swaps of one item
between the most and the least loaded rank lower the slowest rank where they can (never above LPT's).
Vectorized: the dealing in rounds of many items at once (the loads dealing one by one gives), the
micro-batches all ranks at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.cost_model import CostModel
from tightpack.core.planner import plan_packs
from tightpack.errors import TightpackError

__all__ = ["LossDenominators", "StepPlan", "plan_step"]


@dataclass(frozen=True)
class LossDenominators:
    """What normalizes a step's loss over the whole global batch (`StepPlan.loss_denominators`).

    Attributes:
        tokens: supervised tokens of the step, every rank's (``token-mean`` divides by it).
        sequences: sequences of the step with at least one supervised token (the sequence means divide
            by it; a sequence with none has no mean and counts nowhere).
    """

    tokens: int
    sequences: int


@dataclass(frozen=True)
class StepPlan:
    """A step's sequences dealt to ranks and cut into micro-batches (`plan_step`).

    ``order`` lists the sequence indices micro-batch by micro-batch, rank-major (rank 0's micro-batches
    0, 1, ..., then rank 1's); micro-batch ``k`` of rank ``r`` is
    ``order[offsets[r * micro_batches + k] : offsets[r * micro_batches + k + 1]]``. The totals are
    ``[ranks, micro_batches]``: ``tokens`` (aligned), ``supervised``, ``sequences`` and ``cost``.

    ``trained`` counts the sequences with at least one supervised token.

    Attributes:
        ranks: the data-parallel size.
        micro_batches: micro-batches per rank, the same for every rank.
        empty_micro_batches: how many of all ``ranks * micro_batches`` hold no sequence (a rank with
            fewer sequences than ``micro_batches``).
        max_tokens: the budget the plan was made under, or None (a fixed count).
    """

    ranks: int
    micro_batches: int
    order: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    supervised: np.ndarray
    sequences: np.ndarray
    trained: np.ndarray
    cost: np.ndarray
    empty_micro_batches: int
    max_tokens: int | None

    @property
    def loss_denominators(self) -> LossDenominators:
        """The step's denominators of every loss mode (`tightpack.runtime.step_loss`): the same on every
        rank, since every rank computes the whole plan."""
        return LossDenominators(tokens=int(self.supervised.sum()), sequences=int(self.trained.sum()))

    def micro_batch(self, rank: int, index: int) -> np.ndarray:
        """The sequence indices of micro-batch ``index`` of ``rank``, int64."""
        if not (0 <= rank < self.ranks and 0 <= index < self.micro_batches):
            raise IndexError(
                f"micro-batch {index} of rank {rank} is out of range ({self.ranks} ranks of "
                f"{self.micro_batches} micro-batches)"
            )
        slot = rank * self.micro_batches + index
        return self.order[self.offsets[slot] : self.offsets[slot + 1]]

    def rank_batches(self, rank: int) -> list[np.ndarray]:
        """Every micro-batch of ``rank``, in order."""
        return [self.micro_batch(rank, index) for index in range(self.micro_batches)]

    @property
    def rank_cost(self) -> np.ndarray:
        """The cost of every rank, float64 ``[ranks]``: what its step takes."""
        return self.cost.sum(axis=1)

    @property
    def straggler_overhead(self) -> float:
        """``max / mean - 1`` of the ranks' costs: the share of the step lost waiting for the slowest."""
        costs = self.rank_cost
        mean = costs.mean()
        return float(costs.max() / mean - 1.0) if mean > 0 else 0.0


def _integers(values, name: str, count: int | None = None, least: int = 0) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (count is not None and len(array) != count):
        shape = f"[{count}]" if count is not None else "one value per sequence, [N]"
        raise TightpackError(f"{name} must be {shape}, got shape {array.shape}")
    if len(array) and not np.issubdtype(array.dtype, np.integer):
        raise TightpackError(f"{name} must be integers, got dtype {array.dtype}")
    if len(array) and array.dtype.kind == "u" and array.max() > np.iinfo(np.int64).max:
        raise TightpackError(f"{name} must fit int64; sequence {int(array.argmax())} has {array.max()}")
    array = array.astype(np.int64)
    low = np.flatnonzero(array < least)
    if len(low):
        raise TightpackError(
            f"{name} must be >= {least}; sequence {low[0]} has {array[low[0]]} ({len(low)} such in all)"
        )
    return array


def _check_size(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TightpackError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


_HEAP_RANKS = 16
"""Up to this many ranks the items are dealt one by one (a heap); above, in rounds."""

_ROUNDS_UP_TO = 100
"""Up to this many sequences per rank (on average), micro-batches are made for all ranks at once, a
round per place in the ranks' lists; with more, rank by rank by the planner's first fit decreasing."""


def _deal(costs: np.ndarray, ranks: int) -> np.ndarray:
    """The rank of every item: heaviest first, each to the least loaded rank (LPT; ties: lower rank).

    Dealt in rounds: with the ranks by load ``l_1 <= l_2 <= ...`` and the next items ``x_1 >= x_2 >= ...``,
    the first ``k`` items go to the ``k`` lightest ranks, heaviest to lightest, for the largest ``k`` with
    ``l_k - l_1 <= x_k``: rank ``j`` is then the least loaded when item ``j`` comes, since every rank
    served before it now carries at least ``l_1 + x_k >= l_k``, which is what dealing one by one does.
    A round is one sort of the loads; few ranks make short rounds, so there a heap deals one by one.
    """
    order = np.argsort(-costs, kind="stable")
    ordered = costs[order]
    if ranks <= _HEAP_RANKS:
        heap = [(0.0, rank) for rank in range(ranks)]
        owners = [0] * len(order)
        replace = heapq.heapreplace
        for position, cost in enumerate(ordered.tolist()):
            load, rank = heap[0]
            replace(heap, (load + cost, rank))
            owners[position] = rank
        owner = np.empty(len(costs), dtype=np.int64)
        owner[order] = owners
        return owner
    owner = np.empty(len(costs), dtype=np.int64)
    loads = np.zeros(ranks, dtype=np.float64)
    first = 0
    while first < len(order):
        lightest = np.argsort(loads, kind="stable")[: min(ranks, len(order) - first)]
        levels = loads[lightest]
        served = levels - levels[0] <= ordered[first : first + len(lightest)]
        k = len(lightest) if served.all() else int(served.argmin())
        owner[order[first : first + k]] = lightest[:k]
        loads[lightest[:k]] += ordered[first : first + k]
        first += k
    return owner


_REFINE_ROUNDS = 64
"""Swaps tried between the most and the least loaded rank after the dealing (`_refine`)."""


def _refine(costs: np.ndarray, owner: np.ndarray, ranks: int) -> None:
    """Lower the most loaded rank by moving one of its items to the least loaded rank, or swapping it
    for a lighter one of that rank: the move or swap that brings the two closest, while one brings the
    pair below the old maximum (so no rank ever rises above it). ``owner`` is updated in place."""
    loads = np.bincount(owner, weights=costs, minlength=ranks)
    dealt_to = owner.copy()
    by_rank = np.argsort(_small(owner), kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=ranks))])
    moved_in: dict[int, set[int]] = {}

    def members(rank: int) -> np.ndarray:  # the items it holds now: those dealt to it and still there,
        dealt = by_rank[
            starts[rank] : starts[rank + 1]
        ]  # and those moved in from other ranks and still there
        arrived = np.fromiter(moved_in.get(rank, ()), dtype=np.int64)
        arrived = np.sort(arrived[(owner[arrived] == rank) & (dealt_to[arrived] != rank)])
        return np.concatenate([dealt[owner[dealt] == rank], arrived])

    for _ in range(_REFINE_ROUNDS):
        high, low = int(loads.argmax()), int(loads.argmin())
        gap = loads[high] - loads[low]
        if gap <= 0:
            return
        mine, theirs = members(high), members(low)
        order = np.argsort(costs[theirs], kind="stable")
        given = np.concatenate([[0.0], costs[theirs][order]])  # 0: a move, nothing comes back
        taken = costs[mine]
        at = np.searchsorted(given, taken - gap / 2)
        best_gain, best = 0.0, None
        for candidate in (np.minimum(at, len(given) - 1), np.maximum(at - 1, 0)):
            shift = taken - given[candidate]  # what the high rank loses and the low rank gains
            gain = np.where((shift > 0) & (shift < gap), np.minimum(shift, gap - shift), 0.0)
            pick = int(gain.argmax())
            if gain[pick] > best_gain:
                best_gain, best = float(gain[pick]), (pick, int(candidate[pick]))
        if best is None or best_gain <= 1e-12 * loads[high]:
            return
        pick, back = best
        owner[mine[pick]] = low
        moved_in.setdefault(low, set()).add(int(mine[pick]))
        if back:
            owner[theirs[order[back - 1]]] = high
            moved_in.setdefault(high, set()).add(int(theirs[order[back - 1]]))
        shift = taken[pick] - given[back]
        loads[high] -= shift
        loads[low] += shift


def _small(values: np.ndarray) -> np.ndarray:
    """Non-negative integers in the narrowest type numpy sorts stably by radix (16 bits) when they fit."""
    return values.astype(np.int16) if values.max(initial=0) < np.iinfo(np.int16).max else values


def _by_rank_longest_first(rank_of: np.ndarray, tokens: np.ndarray, ranks: int) -> np.ndarray:
    """The sequences by rank, then longest first, then by index: one sort of a key that holds all three
    (unique, so any sort gives this order) when it fits 63 bits, else a sort per key."""
    count, span = len(tokens), int(tokens.max(initial=0)) + 1
    if ranks * span * max(count, 1) < 2**62:
        key = (rank_of * span + (span - 1 - tokens)) * count + np.arange(count)
        return np.argsort(key)
    longest_first = np.argsort(-tokens, kind="stable")
    return longest_first[np.argsort(rank_of[longest_first], kind="stable")]


def _micro_batches(
    rank_of: np.ndarray, tokens: np.ndarray, ranks: int, max_tokens: int | None, count: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The micro-batch of every sequence within its rank, and each rank's number of micro-batches.

    With a ``count``, each rank's sequences are dealt to its ``count`` micro-batches by tokens as ranks
    are by cost (`_deal`). With ``max_tokens``, first fit decreasing: a sequence goes to the first of
    its rank's micro-batches with room, else to a new one; one over the budget gets a micro-batch of
    its own. Ranks holding many sequences each: the planner's first fit decreasing per rank (a C loop);
    few each: all ranks at once, one round per place in the ranks' longest-first lists.
    """
    order = _by_rank_longest_first(rank_of, tokens, ranks)
    starts = np.concatenate([[0], np.cumsum(np.bincount(rank_of, minlength=ranks))])
    by_rank = order
    batch_of = np.empty(len(tokens), dtype=np.int64)
    if count is not None:
        for rank in range(ranks):
            members = by_rank[starts[rank] : starts[rank + 1]]
            batch_of[members] = _deal(tokens[members].astype(np.float64), count)
        return batch_of, np.full(ranks, count, dtype=np.int64)
    if len(tokens) > _ROUNDS_UP_TO * ranks:
        opened = np.zeros(ranks, dtype=np.int64)
        for rank in range(ranks):
            members = by_rank[starts[rank] : starts[rank + 1]]
            alone = tokens[members] > max_tokens
            plan = plan_packs(tokens[members[~alone]], max_tokens, algorithm="ffd")
            batch_of[members[~alone]] = plan.pack_of_sample()
            batch_of[members[alone]] = len(plan) + np.arange(int(alone.sum()))
            opened[rank] = len(plan) + int(alone.sum())
        return batch_of, opened
    position = np.arange(len(order)) - starts[rank_of[order]]
    loads = np.zeros((ranks, 4), dtype=np.int64)  # widened as ranks open micro-batches
    columns = np.arange(loads.shape[1])
    opened = np.zeros(ranks, dtype=np.int64)
    full = np.iinfo(np.int64).max // 4  # the load of a micro-batch holding a sequence over the budget
    by_round = order[np.argsort(_small(position), kind="stable")]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(position))])
    for round_ in range(len(bounds) - 1):
        items = by_round[bounds[round_] : bounds[round_ + 1]]
        rows, size = rank_of[items], tokens[items]
        current = loads[rows]
        room = (current + size[:, None] <= max_tokens) & (columns < opened[rows][:, None])
        fits = room.any(axis=1)
        chosen = np.where(fits, room.argmax(axis=1), opened[rows])
        opened[rows[~fits]] += 1
        if opened.max() > loads.shape[1]:
            loads = np.concatenate([loads, np.zeros_like(loads)], axis=1)
            columns = np.arange(loads.shape[1])
        placed = np.take_along_axis(current, np.minimum(chosen, current.shape[1] - 1)[:, None], 1)[:, 0]
        placed = np.where(chosen < current.shape[1], placed, 0)
        loads[rows, chosen] = np.where(size > max_tokens, full, placed + size)
        batch_of[items] = chosen
    return batch_of, opened


def _even_out(rank_of: np.ndarray, batch_of: np.ndarray, opened: np.ndarray, target: int) -> None:
    """Give every rank ``target`` micro-batches: a rank with fewer moves the last sequence (the highest
    index) of its micro-batch with the most sequences into a new one, while one holds two or more; the
    rest stay empty. All short ranks at once, one move each per pass. ``batch_of`` is updated in place."""
    if not len(rank_of) or (opened >= target).all():
        return
    ranks, width = len(opened), target
    sequence = np.arange(len(rank_of))
    while True:
        slot = rank_of * width + batch_of
        counts = np.bincount(slot, minlength=ranks * width).reshape(ranks, width)
        fullest = counts.argmax(axis=1)
        short = np.flatnonzero((opened < target) & (counts[np.arange(ranks), fullest] >= 2))
        if not len(short):
            return
        last = np.full(ranks * width, -1, dtype=np.int64)
        np.maximum.at(last, slot, sequence)
        moved = last[short * width + fullest[short]]
        batch_of[moved] = opened[short]
        opened[short] += 1


def check_budget(lengths: np.ndarray, multiple: int, max_tokens: int, names: Sequence | None = None) -> None:
    """Raise naming the first sequence whose aligned length is above ``max_tokens`` (``names[i]``, a
    sample's key, or its place ``i``), its tokens, how many such there are, and the way out."""
    aligned = lengths if multiple == 1 else ceil_to_multiple(lengths, multiple)
    too_long = np.flatnonzero(aligned > max_tokens)
    if len(too_long):
        first = too_long[0]
        name = f"sequence {first}" if names is None else f"sample {names[first]!r}"
        size = f"{lengths[first]} tokens" + (
            f" ({aligned[first]} aligned to pad_to_multiple_of={multiple})" if multiple > 1 else ""
        )
        raise TightpackError(
            f"{name} has {size}, over max_tokens={max_tokens} ({len(too_long)} such in this step); raise "
            "max_tokens or pass allow_oversize=True to give such a sequence a micro-batch of its own",
            parameters=("max_tokens", "allow_oversize"),
        )


def plan_step(
    lengths: Sequence[int] | np.ndarray,
    data_parallel_size: int,
    *,
    max_tokens: int | None = None,
    micro_batches: int | None = None,
    supervised: Sequence[int] | np.ndarray | None = None,
    groups: Sequence[int] | np.ndarray | None = None,
    cost_model: CostModel | str | None = None,
    pad_to_multiple_of: int = 1,
    allow_oversize: bool = False,
    seed: int = 0,
) -> StepPlan:
    """Deal one step's sequences to ``data_parallel_size`` ranks in micro-batches.

    Ranks by cost: items (sequences, or groups kept on one rank) heaviest first, each to the least
    loaded rank (LPT), then moves and swaps between the most and the least loaded rank; the slowest rank
    costs at most ``mean + (1 - 1/DP) * c_max`` and at most ``(4/3 - 1/(3 DP))`` times the best dealing.
    Micro-batches by tokens: each rank's sequences first fit decreasing under ``max_tokens`` (or into
    ``micro_batches`` of them); every rank gets the same count, an empty micro-batch only where a rank
    holds fewer sequences than the count. Deterministic: every rank computes the same plan.

    Args:
        lengths: tokens of every sequence of the step, int ``[N]``, each at least 1 (all ranks' sequences,
            all-gathered: every rank computes the same plan and takes its share).
        data_parallel_size: the ranks ``DP``.
        max_tokens: the token budget of a micro-batch (aligned tokens). Give it or ``micro_batches``.
        micro_batches: a fixed number of micro-batches per rank instead of a budget.
        supervised: supervised tokens of every sequence, int ``[N]`` (the totals; the loss denominators of
            `tightpack.runtime.step_loss`); None counts every token.
        groups: a group id per sequence, int ``[N]``: the sequences of a group stay on one rank (a GRPO
            group, the branches of a preference pair), possibly in several of its micro-batches.
        cost_model: a `CostModel` or a preset name (``llama-8b``, ...); None costs a sequence its tokens.
        pad_to_multiple_of: every sequence is aligned to this multiple (tensor or context parallelism):
            its aligned length is what the budget and the cost count.
        allow_oversize: a sequence above ``max_tokens`` gets a micro-batch of its own instead of an error.
        seed: permutes which rank is called which.

    Returns:
        The `StepPlan`.

    Raises:
        TightpackError: bad lengths or sizes, both or neither of ``max_tokens`` and ``micro_batches``, a
            sequence above ``max_tokens`` (naming it) without ``allow_oversize``.

    Six rollouts over two ranks, at most 8 tokens per micro-batch:

    >>> plan = plan_step([7, 1, 3, 2, 5, 4], 2, max_tokens=8)
    >>> plan.micro_batches, [[batch.tolist() for batch in plan.rank_batches(r)] for r in range(2)]
    (2, [[[0, 1], [2]], [[3, 4], [5]]])
    >>> plan.rank_cost.tolist(), plan.empty_micro_batches
    ([11.0, 11.0], 0)
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise TightpackError(f"seed must be a non-negative integer, got {seed!r}")
    ranks = _check_size(data_parallel_size, "data_parallel_size")
    multiple = _check_size(pad_to_multiple_of, "pad_to_multiple_of")
    lengths = _integers(lengths, "lengths", least=1)
    count = len(lengths)
    if (max_tokens is None) == (micro_batches is None):
        raise TightpackError(
            "give the micro-batches' token budget (max_tokens) or their number per rank (micro_batches), "
            "one of the two"
        )
    if max_tokens is not None:
        max_tokens = _check_size(max_tokens, "max_tokens")
    if micro_batches is not None:
        micro_batches = _check_size(micro_batches, "micro_batches")
    aligned = lengths if multiple == 1 else ceil_to_multiple(lengths, multiple)
    supervised = lengths.copy() if supervised is None else _integers(supervised, "supervised", count)
    over = np.flatnonzero(lengths < supervised)
    if len(over):
        raise TightpackError(
            f"supervised tokens exceed the sequence's tokens: sequence {over[0]} has {supervised[over[0]]} "
            f"of {lengths[over[0]]}"
        )
    if max_tokens is not None and not allow_oversize:
        check_budget(lengths, multiple, max_tokens)
    model = None if cost_model is None else CostModel.resolve(cost_model)
    costs = aligned.astype(np.float64) if model is None else model.sequence_costs(aligned)
    if groups is None:
        item_of, item_costs = np.arange(count), costs
    else:
        _, item_of = np.unique(
            _integers(groups, "groups", count, least=np.iinfo(np.int64).min), return_inverse=True
        )
        item_costs = np.bincount(item_of, weights=costs) if count else np.zeros(0)
    owner = _deal(item_costs, ranks) if count else np.zeros(0, np.int64)
    if count:
        _refine(item_costs, owner, ranks)
    rank_of = owner[item_of]
    if seed:
        rank_of = np.random.default_rng(seed).permutation(ranks)[rank_of]
    if count:
        batch_of, opened = _micro_batches(rank_of, aligned, ranks, max_tokens, micro_batches)
    else:
        batch_of, opened = np.zeros(0, np.int64), np.zeros(ranks, np.int64)
    per_rank = max(int(opened.max(initial=0)), 1) if micro_batches is None else micro_batches
    _even_out(rank_of, batch_of, opened, per_rank)
    slot = rank_of * per_rank + batch_of
    order = np.argsort(_small(slot), kind="stable") if count else np.zeros(0, np.int64)
    slots = ranks * per_rank
    sizes = np.bincount(slot, minlength=slots)

    def total(values, dtype) -> np.ndarray:
        return np.bincount(slot, weights=values, minlength=slots).astype(dtype).reshape(ranks, per_rank)

    return StepPlan(
        ranks=ranks,
        micro_batches=per_rank,
        order=order.astype(np.int64),
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        tokens=total(aligned, np.int64),
        supervised=total(supervised, np.int64),
        sequences=sizes.reshape(ranks, per_rank).astype(np.int64),
        trained=total((supervised > 0).astype(np.int64), np.int64),
        cost=total(costs, np.float64),
        empty_micro_batches=int((sizes == 0).sum()),
        max_tokens=max_tokens,
    )
