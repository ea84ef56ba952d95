"""Dealing the packs of one global batch to data-parallel ranks by cost (issue 13).

In a data-parallel step every rank waits for the slowest, so the step lasts as long as the most loaded
rank. `deal_balanced` deals the ``GBS`` packs of a global batch to ``DP`` ranks, exactly ``GBS / DP``
each, so that the most loaded rank is light; `deal_in_order` is today's dealing (rank ``d`` takes
positions ``d, d + DP, ...``, as `tightpack.runtime.samplers.PackedBatchSampler` does for ``batch``),
kept as the baseline with the same output shape; `straggler_overhead` measures the time lost waiting.

Costs are whatever the caller estimates per pack (e.g. ``a * tokens + b * sum(seqlen**2)``); this
module only deals them. Numpy only: the runtime layer applies the dealing to its samplers.
"""

from __future__ import annotations

import numpy as np

from tightpack.errors import TightpackError

_REGROUP_STREAM = 1
"""Third word of the regrouping generator's seed: ``(seed, epoch)`` alone seeds the samplers' shuffle."""


def _check(costs: np.ndarray, ranks: int) -> np.ndarray:
    """The costs as float64 ``[GBS]``, after every check on ``costs`` and ``ranks``."""
    _check_ranks(ranks)
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1:
        raise TightpackError(
            f"costs must be one global batch, shape [GBS], got shape {costs.shape}; "
            "deal each global batch separately"
        )
    if costs.size % ranks:
        raise TightpackError(
            f"the global batch of {costs.size} packs is not divisible by ranks ({ranks}); "
            "use a global batch size that is a multiple of the data-parallel size"
        )
    return _check_values(costs)


def _check_ranks(ranks: int) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise TightpackError(f"ranks must be a positive integer (the data-parallel size), got {ranks!r}")


def _check_values(costs: np.ndarray) -> np.ndarray:
    bad = np.flatnonzero(~np.isfinite(costs) | (costs < 0))
    if bad.size:
        raise TightpackError(
            f"costs must be finite and >= 0; pack {bad[0]} has cost {costs[bad[0]]} ({bad.size} bad in all)"
        )
    return costs


def _stable_argsort(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")``, faster when no two values are equal.

    The default introsort may order ties differently across CPUs (numpy dispatches it to SIMD
    kernels), so it is used only when its result is unique: no two sorted neighbours are equal.
    """
    order = np.argsort(values)
    ordered = values[order]
    if (ordered[1:] == ordered[:-1]).any():
        order = np.argsort(values, kind="stable")
    return order


def _heaviest_first(costs: np.ndarray) -> np.ndarray:
    """Positions by decreasing cost, ties by position."""
    # A stable argsort is ~4x slower than introsort at GBS 2,048 (numpy 2.4), hence `_stable_argsort`.
    return _stable_argsort(-costs)


def deal_in_order(costs: np.ndarray, ranks: int) -> np.ndarray:
    """Today's dealing, ignoring costs: rank ``d`` takes positions ``d, d + DP, ...``.

    Returns int64 ``[ranks, GBS // ranks]``, rows sorted by index (as `deal_balanced`).

    >>> deal_in_order(np.array([5.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 2).tolist()
    [[0, 2, 4], [1, 3, 5]]
    """
    costs = _check(costs, ranks)
    return np.arange(costs.size, dtype=np.int64).reshape(-1, ranks).T.copy()


def deal_balanced(costs: np.ndarray, ranks: int) -> np.ndarray:
    """Deal packs to ``ranks`` ranks, ``GBS // ranks`` each, keeping the most loaded rank light.

    Equal-count LPT (longest processing time first, dealt in rounds): sort the packs by cost,
    heaviest first (ties by index); round ``r`` deals packs ``r * DP .. (r + 1) * DP - 1`` of that
    order, the heaviest to the currently lightest rank, the next to the next lightest, and so on
    (ties in load by the order of the previous round, rank index in round 0). One argsort of ``DP``
    loads per round, ``GBS / DP`` rounds, so the time grows with ``GBS / DP``.

    Bound: after every round the spread (most minus least loaded rank) is at most the widest cost
    range of one round. (Ranks sorted by load ``l_1 <= ... <= l_P`` receive ``x_1 >= ... >= x_P``; for
    ``i < j``, ``(l_i + x_i) - (l_j + x_j) <= x_i - x_j``, and for ``i > j`` it is at most the previous
    spread.) Since the mean is at least ``max - (1 - 1/DP) * spread``::

        max load <= mean load + (1 - 1/DP) * max_r (range of round r) <= mean + (1 - 1/DP) * (c_max - c_min)

    Deterministic; the input is not modified.

    Args:
        costs: float ``[GBS]``, the cost of each pack; finite and ``>= 0``.
        ranks: the data-parallel size ``DP``; must divide ``GBS``.

    Returns:
        int64 ``[ranks, GBS // ranks]``: row ``d`` holds the positions (into ``costs``) of rank ``d``'s
        packs, sorted by position, so a rank keeps the sampler's (shuffled) order among its packs.

    Raises:
        TightpackError: ``ranks < 1``, ``GBS`` not a multiple of ``ranks``, ``costs`` not 1-D, or a
            negative or non-finite cost.

    Six packs over two ranks, three each. In order, rank 0 gets 5 + 3 + 1 = 9 while rank 1 gets 7;
    balanced, round 0 gives 5 and 4, round 1 gives the lighter rank 1 a 3 (7) and rank 0 a 3 (8),
    round 2 gives the lighter rank 1 the 1 (8) and rank 0 the 0 (8):

    >>> costs = np.array([5.0, 4.0, 3.0, 3.0, 1.0, 0.0])
    >>> deal_in_order(costs, 2).tolist(), costs[deal_in_order(costs, 2)].sum(axis=1).tolist()
    ([[0, 2, 4], [1, 3, 5]], [9.0, 7.0])
    >>> deal_balanced(costs, 2).tolist(), costs[deal_balanced(costs, 2)].sum(axis=1).tolist()
    ([[0, 3, 5], [1, 2, 4]], [8.0, 8.0])
    """
    costs = _check(costs, ranks)
    per_rank = costs.size // ranks
    order = _heaviest_first(costs)
    if ranks == 1:
        return np.sort(order).astype(np.int64).reshape(1, -1)
    rounds = order.reshape(per_rank, ranks)
    round_costs = costs[rounds]
    # The loads are kept in the order of the previous round (``holders[j]`` is the rank at slot j), so
    # a round is one argsort of ``ranks`` loads and two gathers; packs are scattered once at the end.
    holders = np.arange(ranks)
    loads = np.zeros(ranks, dtype=np.float64)
    owners = np.empty((per_rank, ranks), dtype=np.int64)
    for r in range(per_rank):
        lightest_first = _stable_argsort(loads)
        holders = holders[lightest_first]
        loads = loads[lightest_first] + round_costs[r]
        owners[r] = holders
    dealt = np.empty((ranks, per_rank), dtype=np.int64)
    dealt[owners, np.arange(per_rank)[:, None]] = rounds
    dealt.sort(axis=1)
    return dealt


def regroup_generator(seed: int, epoch: int) -> np.random.Generator:
    """The generator `balanced_steps` deals tiers with, for a sampler's ``(seed, epoch)``.

    Independent of the samplers' shuffle (``np.random.default_rng((seed, epoch))``), so regrouping
    never changes which packs an epoch holds.
    """
    return np.random.default_rng((seed, epoch, _REGROUP_STREAM))


def balanced_steps(
    costs: np.ndarray,
    ranks: int,
    per_rank: int,
    rng: np.random.Generator,
    *,
    heaviest_first: np.ndarray | None = None,
) -> np.ndarray:
    """Group items into steps by cost, then deal each step to ranks: every rank of a step equally loaded.

    Dealing one given global batch (`deal_balanced`) cannot help when a rank gets few packs: with
    ``per_rank`` 1 the step lasts as long as its heaviest pack. This chooses which packs share a step
    too. Sort the items heaviest first (ties by position) and cut the order into ``per_rank`` strata of
    ``steps * ranks`` items; each stratum into ``steps`` *tiers* of ``ranks`` consecutive items (near
    equal costs). Every step takes one tier of every stratum (tiers dealt to steps by a permutation of
    ``rng`` per stratum), and gets them with equal-count LPT: round ``r`` deals stratum ``r``'s tier,
    its heaviest item to the rank that is lightest so far. A step is thus a stratified sample of the
    cost distribution (one tier from each stratum), not a draw of similar packs, except with
    ``per_rank`` 1 where a step is one tier. Within a tier the costs differ by one gap of the sorted
    order, so with the bound of `deal_balanced` every rank of a step is within
    ``(1 - 1/DP) * max_r (range of its tier r)`` of the step's mean.

    Vectorized over steps: one sort of all costs, then ``per_rank`` rounds of one argsort of the
    ``[steps, ranks]`` loads.

    Args:
        costs: float ``[steps * ranks * per_rank]``, finite and ``>= 0``; positions usually follow a
            seeded permutation, so ties are broken at random.
        ranks: the data-parallel size ``DP``.
        per_rank: items per rank per step (``GBS / DP`` packs, or micro-batches per step).
        rng: the generator dealing tiers to steps.
        heaviest_first: the positions ordered by decreasing cost, when the caller has them (a sampler
            sorts its packs once, not every epoch); checked in O(n). None sorts (ties by position).

    Returns:
        int64 ``[steps, ranks, per_rank]``: the positions (into ``costs``) of each rank's items per step,
        sorted by position within a rank.

    Eight packs, two ranks, two each: two steps. The strata are {9, 8, 5, 5} and {2, 1, 1, 0}, their
    tiers (9, 8), (5, 5), (2, 1), (1, 0); each step gets a tier of each stratum, each rank one pack of
    each tier, the heavier tier's lighter pack with the lighter tier's heavier one:

    >>> costs = np.array([9.0, 1.0, 5.0, 2.0, 8.0, 0.0, 5.0, 1.0])
    >>> steps = balanced_steps(costs, ranks=2, per_rank=2, rng=np.random.default_rng(0))
    >>> costs[steps].sum(axis=2).tolist()
    [[10.0, 10.0], [6.0, 5.0]]
    """
    costs = _check(costs, ranks)
    if isinstance(per_rank, bool) or not isinstance(per_rank, (int, np.integer)) or per_rank < 1:
        raise TightpackError(
            f"per_rank must be a positive integer (items per rank per step), got {per_rank!r}"
        )
    if costs.size % (ranks * per_rank):
        raise TightpackError(
            f"{costs.size} items do not make whole steps of {ranks} ranks x {per_rank} items; "
            "pass only the items of whole steps"
        )
    steps = costs.size // (ranks * per_rank)
    if heaviest_first is None:
        heaviest_first = _heaviest_first(costs)
    else:
        heaviest_first = np.asarray(heaviest_first)
        ordered = costs[heaviest_first] if heaviest_first.shape == costs.shape else None
        if (
            ordered is None
            or (np.bincount(heaviest_first, minlength=costs.size) != 1).any()
            or (ordered[1:] > ordered[:-1]).any()
        ):
            raise TightpackError(
                "heaviest_first must hold every position of costs once, by decreasing cost; leave it None "
                "to sort here"
            )
    tiers = heaviest_first.reshape(per_rank, steps, ranks)
    # [steps, per_rank, ranks]: step s takes tier order_r[s] of stratum r, a random permutation per stratum
    chosen = np.stack([tiers[r, rng.permutation(steps)] for r in range(per_rank)], axis=1)
    holders = np.broadcast_to(np.arange(ranks), (steps, ranks)).copy()
    loads = np.zeros((steps, ranks), dtype=np.float64)
    owners = np.empty((steps, per_rank, ranks), dtype=np.int64)
    for r in range(per_rank):
        lightest_first = np.argsort(loads, axis=1, kind="stable")
        holders = np.take_along_axis(holders, lightest_first, axis=1)
        loads = np.take_along_axis(loads, lightest_first, axis=1) + costs[chosen[:, r]]
        owners[:, r] = holders
    dealt = np.empty((steps, ranks, per_rank), dtype=np.int64)
    step_index = np.arange(steps)[:, None, None]
    dealt[step_index, owners, np.arange(per_rank)[None, :, None]] = chosen
    dealt.sort(axis=2)
    return dealt


def straggler_overhead(rank_costs: np.ndarray) -> float:
    """Time lost waiting for the slowest rank: ``sum_steps max / sum_steps mean - 1``.

    The metric of torchtitan's load-balancing proposal: 0.0 when every step is perfectly balanced,
    0.5 when steps last 1.5x what a perfect balance would give.

    Args:
        rank_costs: ``[steps, ranks]``, the cost of each rank at each step (a ``[ranks]`` array is one
            step). Finite and ``>= 0``.

    Returns:
        The overhead, ``>= 0``; 0.0 for no steps, no ranks, or all costs zero (nothing to wait for).

    >>> straggler_overhead(np.array([[2.0, 2.0], [4.0, 0.0]]))  # (2 + 4) / (2 + 2) - 1
    0.5
    """
    rank_costs = np.asarray(rank_costs, dtype=np.float64)
    if rank_costs.ndim == 1:
        rank_costs = rank_costs[None, :]
    if rank_costs.ndim != 2:
        raise TightpackError(f"rank_costs must be [steps, ranks], got shape {rank_costs.shape}")
    if rank_costs.size == 0:
        return 0.0
    if not np.isfinite(rank_costs).all() or (rank_costs < 0).any():
        raise TightpackError("rank_costs must be finite and >= 0")
    total_mean = rank_costs.mean(axis=1).sum()
    if total_mean == 0:
        return 0.0
    return float(rank_costs.max(axis=1).sum() / total_mean - 1.0)


def epoch_rank_costs(
    pack_costs: np.ndarray,
    ranks: int,
    global_batch_size: int,
    *,
    balanced: bool,
    seed: int = 0,
    epoch: int = 0,
) -> np.ndarray:
    """Each rank's cost at each step of one epoch, as the offline samplers deal the packs.

    The epoch holds the packs of ``np.random.default_rng((seed, epoch)).permutation``, its last
    ``total % GBS`` dropped, as ``PackedBatchSampler(dataloader_type="batch")`` and
    ``BalancedPackedBatchSampler`` draw them. In order (``balanced=False``), rank ``d`` takes positions
    ``d, d + DP, ...`` of each global batch; balanced, `balanced_steps` groups and deals them as
    ``BalancedPackedBatchSampler(regroup=True)`` does. Numpy only, all ranks at once: what-if tools
    (``tightpack plan``) simulate a run without its data loader.

    Args:
        pack_costs: float ``[packs]``, finite and ``>= 0``.
        ranks: the data-parallel size ``DP``; must divide ``global_batch_size``.
        global_batch_size: packs per optimizer step, all ranks together.
        balanced: deal by cost, or in order.

    Returns:
        float64 ``[steps, ranks]``; no rows when the packs do not fill one global batch.

    >>> costs = np.array([8.0, 1.0, 7.0, 1.0])
    >>> epoch_rank_costs(costs, 2, 4, balanced=True).tolist()
    [[9.0, 8.0]]
    """
    gbs = global_batch_size
    if isinstance(gbs, bool) or not isinstance(gbs, (int, np.integer)) or gbs < 1:
        raise TightpackError(f"global_batch_size must be a positive integer, got {gbs!r}")
    _check_ranks(ranks)
    costs = np.asarray(pack_costs, dtype=np.float64)
    if costs.ndim != 1:
        raise TightpackError(f"pack_costs must be [packs], got shape {costs.shape}")
    _check_values(costs)
    if gbs % ranks:
        raise TightpackError(
            f"global_batch_size ({gbs}) is not divisible by the data-parallel size ({ranks}); every rank "
            "takes global_batch_size / DP packs per step"
        )
    steps, per_rank = len(costs) // gbs, gbs // ranks
    if steps == 0:
        return np.zeros((0, ranks))
    order = np.random.default_rng((seed, epoch)).permutation(len(costs))[: steps * gbs]
    epoch_costs = costs[order]
    if not balanced:  # global batch s is positions [s * GBS, (s + 1) * GBS); rank d every DP-th of it
        return epoch_costs.reshape(steps, per_rank, ranks).sum(axis=1)
    dealt = balanced_steps(epoch_costs, ranks, per_rank, regroup_generator(seed, epoch))
    return epoch_costs[dealt].sum(axis=2)
