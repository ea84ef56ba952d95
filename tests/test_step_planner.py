"""`plan_step`: one step's sequences dealt to data-parallel ranks in micro-batches.

Every guarantee of the planner's docstring against random steps (hypothesis) and, on small cases,
against brute force: every sequence once, every micro-batch within the budget, the same number of
micro-batches on every rank (empty ones only where a rank has fewer sequences), groups whole on one
rank, the same plan for the same inputs, and the slowest rank within the bounds stated (relative to
the mean, and to the best dealing found by enumerating them all).
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core import step_planner
from tightpack.core.cost_model import CostModel
from tightpack.core.step_planner import plan_step
from tightpack.errors import TightpackError

from .conftest import examples

COST_MODELS = [
    None,
    CostModel(linear=1.0, quadratic=0.01),
    CostModel(linear=0.0, quadratic=1.0, per_sequence=3.0),
]


def rank_of(plan, count: int) -> np.ndarray:
    owner = np.full(count, -1)
    for rank in range(plan.ranks):
        for batch in plan.rank_batches(rank):
            owner[batch] = rank
    return owner


def item_costs(lengths, model, groups=None) -> np.ndarray:
    costs = np.asarray(lengths, np.float64) if model is None else model.sequence_costs(lengths)
    if groups is None:
        return costs
    return np.bincount(np.unique(groups, return_inverse=True)[1], weights=costs)


@st.composite
def steps(draw):
    count = draw(st.integers(1, 80))
    lengths = draw(st.lists(st.integers(1, 300), min_size=count, max_size=count))
    ranks = draw(st.integers(1, 40))
    grouped = draw(st.booleans())
    groups = draw(st.lists(st.integers(0, 12), min_size=count, max_size=count)) if grouped else None
    budgeted = draw(st.booleans())
    size = draw(st.integers(1, 600)) if budgeted else draw(st.integers(1, 6))
    model = draw(st.sampled_from(COST_MODELS))
    multiple = draw(st.sampled_from([1, 1, 8]))
    all_ranks_at_once = draw(
        st.booleans()
    )  # the micro-batches' two ways: all ranks in rounds, or rank by rank
    return lengths, ranks, groups, budgeted, size, model, multiple, all_ranks_at_once


@settings(max_examples=examples(150), deadline=None)
@given(steps())
def test_every_guarantee_holds_on_random_steps(step):
    lengths, ranks, groups, budgeted, size, model, multiple, all_ranks_at_once = step
    budget = dict(max_tokens=size, allow_oversize=True) if budgeted else dict(micro_batches=size)
    saved = step_planner._ROUNDS_UP_TO
    step_planner._ROUNDS_UP_TO = 10**9 if all_ranks_at_once else 0
    try:
        plan, again = (
            plan_step(lengths, ranks, groups=groups, cost_model=model, pad_to_multiple_of=multiple, **budget)
            for _ in range(2)
        )
    finally:
        step_planner._ROUNDS_UP_TO = saved
    aligned = -(-np.asarray(lengths) // multiple) * multiple
    assert sorted(plan.order.tolist()) == list(range(len(lengths)))  # every sequence exactly once
    assert len(plan.offsets) == ranks * plan.micro_batches + 1  # the same count on every rank
    sizes = np.diff(plan.offsets).reshape(ranks, plan.micro_batches)
    for rank in range(ranks):
        for index, batch in enumerate(plan.rank_batches(rank)):
            if budgeted and len(batch) > 1:
                assert aligned[batch].sum() <= size  # within the budget (alone when over it)
            assert plan.tokens[rank, index] == aligned[batch].sum()
        if (sizes[rank] == 0).any():  # empty only where the rank holds fewer sequences than the count
            assert (sizes[rank] <= 1).all()
    assert plan.empty_micro_batches == int((sizes == 0).sum())
    if not budgeted:
        assert plan.micro_batches == size
    owner = rank_of(plan, len(lengths))
    if groups is not None:
        for group in set(groups):
            assert len(set(owner[np.asarray(groups) == group])) == 1  # a group whole on one rank
    costs = item_costs(aligned, model, groups)
    loads = plan.rank_cost
    assert loads.max() <= loads.mean() + (1 - 1 / ranks) * costs.max() + 1e-6 * max(costs.max(), 1)
    assert loads.max() <= lpt_reference(costs, ranks).max() * (1 + 1e-12)  # the swaps never lose to LPT
    assert np.array_equal(again.order, plan.order) and np.array_equal(again.offsets, plan.offsets)


@pytest.mark.parametrize(
    "lengths, ranks, model",
    [
        ([28, 64, 59, 65, 61, 75, 45], 3, None),  # the swaps once kept an item they had moved away
        ([2902, 4080, 4637, 4040, 3900, 1858, 3788], 3, "llama-8b"),
    ],
)
def test_the_swaps_after_the_dealing_never_lose_to_lpt(lengths, ranks, model):
    plan = plan_step(lengths, ranks, max_tokens=10**7, cost_model=model)
    costs = item_costs(lengths, None if model is None else CostModel.resolve(model))
    assert plan.rank_cost.max() <= lpt_reference(costs, ranks).max()
    assert plan.rank_cost.max() <= (4 / 3 - 1 / (3 * ranks)) * best_dealing(costs, ranks)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=9), st.integers(2, 4))
def test_a_few_items_a_rank_are_never_dealt_worse_than_lpt(lengths, ranks):
    """Where ranks hold two to six items the swaps have the most to do (and once did it wrong)."""
    plan = plan_step(lengths, ranks, micro_batches=1)
    costs = np.asarray(lengths, np.float64)
    assert plan.rank_cost.max() <= lpt_reference(costs, ranks).max()
    assert np.isclose(plan.rank_cost.sum(), costs.sum())


def lpt_reference(costs: np.ndarray, ranks: int) -> np.ndarray:
    """Heaviest first, each to the least loaded rank, one by one with a heap."""
    heap = [(0.0, rank) for rank in range(ranks)]
    loads = np.zeros(ranks)
    for cost in sorted(costs.tolist(), reverse=True):
        load, rank = heapq.heappop(heap)
        loads[rank] = load + cost
        heapq.heappush(heap, (load + cost, rank))
    return np.sort(loads)


@pytest.mark.parametrize("ranks", [3, 17, 64, 256])
def test_the_dealing_in_rounds_is_the_dealing_one_by_one(ranks, monkeypatch):
    """Above 16 ranks the items are dealt in rounds: the loads are those of LPT dealt item by item (the
    swaps after it turned off); with the swaps, the slowest rank is never slower than LPT's."""
    rng = np.random.default_rng(ranks)
    model = CostModel(linear=1.0, quadratic=1e-3)
    for _ in range(10):
        lengths = (rng.pareto(1.2, rng.integers(1, 4000)) * 300 + 1).astype(np.int64)
        refined = plan_step(lengths, ranks, micro_batches=1, cost_model=model).rank_cost.max()
        assert refined <= lpt_reference(model.sequence_costs(lengths), ranks).max() * (1 + 1e-12)
    monkeypatch.setattr(step_planner, "_REFINE_ROUNDS", 0)
    for _ in range(20):
        lengths = (rng.pareto(1.2, rng.integers(1, 4000)) * 300 + 1).astype(np.int64)
        plan = plan_step(lengths, ranks, micro_batches=1, cost_model=CostModel(linear=1.0, quadratic=1e-3))
        expected = lpt_reference(CostModel(linear=1.0, quadratic=1e-3).sequence_costs(lengths), ranks)
        np.testing.assert_allclose(np.sort(plan.rank_cost), expected, rtol=1e-12)


def best_dealing(costs: np.ndarray, ranks: int) -> float:
    """The least possible slowest rank, every dealing tried."""
    best = np.inf
    for owners in itertools.product(range(ranks), repeat=len(costs)):
        best = min(best, np.bincount(owners, weights=costs, minlength=ranks).max())
    return best


def fewest_bins(lengths: list[int], budget: int) -> int:
    """The fewest micro-batches ``lengths`` fit in under ``budget``, every partition tried."""
    for count in range(1, len(lengths) + 1):
        for owners in itertools.product(range(count), repeat=len(lengths)):
            if np.bincount(owners, weights=lengths, minlength=count).max() <= budget:
                return count
    return len(lengths)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=7), st.integers(2, 3), st.integers(60, 120))
def test_against_brute_force_on_small_steps(lengths, ranks, budget):
    plan = plan_step(lengths, ranks, max_tokens=budget)
    optimum = best_dealing(np.asarray(lengths, np.float64), ranks)
    assert plan.rank_cost.max() <= (4 / 3 - 1 / (3 * ranks)) * optimum + 1e-9  # LPT's ratio (Graham 1969)
    owner = rank_of(plan, len(lengths))
    # first fit decreasing: at most 11/9 OPT + 6/9 micro-batches for a rank (Dosa 2007); every rank then
    # takes the count of the rank that needs the most
    bounds = [
        11 / 9 * fewest_bins(mine, budget) + 6 / 9
        for rank in range(ranks)
        if (mine := [lengths[i] for i in np.flatnonzero(owner == rank)])
    ]
    assert plan.micro_batches <= max(bounds)


def test_a_worked_step():
    """Six rollouts, two ranks, 8 tokens a micro-batch: LPT gives {7, 3, 1} and {5, 4, 2}, 11 each; first
    fit decreasing cuts each rank in two micro-batches."""
    plan = plan_step([7, 1, 3, 2, 5, 4], 2, max_tokens=8, supervised=[5, 0, 3, 2, 5, 4])
    assert [[batch.tolist() for batch in plan.rank_batches(rank)] for rank in range(2)] == [
        [[0, 1], [2]],
        [[3, 4], [5]],
    ]
    assert plan.tokens.tolist() == [[8, 3], [7, 4]] and plan.supervised.tolist() == [[5, 3], [7, 4]]
    assert plan.sequences.tolist() == [[2, 1], [2, 1]] and plan.trained.tolist() == [[1, 1], [2, 1]]
    assert plan.rank_cost.tolist() == [11.0, 11.0] and plan.straggler_overhead == 0.0
    denominators = plan.loss_denominators
    assert (denominators.tokens, denominators.sequences) == (19, 5)


def test_a_rank_with_fewer_sequences_than_the_count_splits_then_pads():
    """One sequence costs as much as the rest together: its rank holds it alone. The other rank needs
    three micro-batches, so the first has one and two empty micro-batches, said as such."""
    plan = plan_step([30, 10, 10, 10], 2, max_tokens=10, allow_oversize=True)
    assert plan.micro_batches == 3 and plan.empty_micro_batches == 2
    assert plan.sequences.tolist() in ([[1, 0, 0], [1, 1, 1]], [[1, 1, 1], [1, 0, 0]])
    split = plan_step([6, 1, 1, 1, 6, 2], 2, max_tokens=10)  # {6, 2, 1}: one micro-batch needs a second
    assert split.empty_micro_batches == 0 and (split.sequences > 0).all()


def test_the_seed_renames_ranks_only():
    lengths = np.random.default_rng(3).integers(1, 500, 200)
    base = plan_step(lengths, 8, max_tokens=1024, cost_model="llama-8b")
    renamed = plan_step(lengths, 8, max_tokens=1024, cost_model="llama-8b", seed=7)
    assert sorted(base.rank_cost.tolist()) == sorted(renamed.rank_cost.tolist())
    assert base.micro_batches == renamed.micro_batches
    assert not np.array_equal(base.rank_cost, renamed.rank_cost)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: plan_step([5, 40, 7], 2, max_tokens=32),
            r"^sequence 1 has 40 tokens, over max_tokens=32 \(1 such",
        ),
        (lambda: plan_step([5, 4], 2), r"give the micro-batches' token budget \(max_tokens\) or"),
        (lambda: plan_step([5, 4], 2, max_tokens=8, micro_batches=2), r"one of the two"),
        (lambda: plan_step([5, 0], 2, max_tokens=8), r"^lengths must be >= 1; sequence 1 has 0"),
        (lambda: plan_step([[5, 4]], 2, max_tokens=8), r"^lengths must be one value per sequence"),
        (lambda: plan_step([5.5, 4], 2, max_tokens=8), r"^lengths must be integers, got dtype float64"),
        (
            lambda: plan_step([5, 4], 0, max_tokens=8),
            r"^data_parallel_size must be a positive integer, got 0",
        ),
        (lambda: plan_step([5, 4], 2, max_tokens=8, supervised=[6, 1]), r"sequence 0 has 6 of 5"),
        (lambda: plan_step([5, 4], 2, max_tokens=8, groups=[0]), r"^groups must be \[2\], got shape \(1,\)"),
        (
            lambda: plan_step([9, 4], 2, max_tokens=8, pad_to_multiple_of=8),
            r"sequence 0 has 9 tokens \(16 aligned to pad_to_multiple_of=8\)",
        ),
        (lambda: plan_step([9, 4], 2, max_tokens=16, seed=-1), r"seed must be a non-negative integer"),
        (lambda: plan_step([9, 4], 2, max_tokens=16, seed=1.5), r"seed must be a non-negative integer"),
        (
            lambda: plan_step(np.array([2**63, 4], np.uint64), 2, max_tokens=16),
            r"lengths must fit int64; sequence 0 has 9223372036854775808",
        ),
    ],
)
def test_bad_input_is_an_error_naming_it(call, message):
    with pytest.raises(TightpackError, match=message):
        call()


def test_an_empty_step_is_a_plan_of_empty_micro_batches():
    plan = plan_step(np.zeros(0, np.int64), 4, max_tokens=16)
    assert plan.micro_batches == 1 and plan.empty_micro_batches == 4 and len(plan.order) == 0
