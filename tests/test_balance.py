"""Dealing packs to data-parallel ranks by cost (`tightpack.core.balance`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.balance import (
    balanced_steps,
    deal_balanced,
    deal_in_order,
    regroup_generator,
    straggler_overhead,
)
from tightpack.errors import TightpackError

from .conftest import examples


@st.composite
def batches(draw) -> tuple[np.ndarray, int]:
    """A global batch of costs and a data-parallel size dividing it; ties and zeros included."""
    ranks = draw(st.integers(1, 12))
    per_rank = draw(st.integers(1, 10))
    cost = st.one_of(st.integers(0, 5).map(float), st.floats(0, 1e6, allow_nan=False, allow_infinity=False))
    costs = draw(st.lists(cost, min_size=ranks * per_rank, max_size=ranks * per_rank))
    return np.array(costs, dtype=np.float64), ranks


def long_tail_costs(rng: np.random.Generator, packs: int, capacity: int = 4096) -> np.ndarray:
    """Pack costs ``tokens + sum(s**2) / 1024``: lognormal lengths ``s``, next-fit into ``capacity``."""
    costs = np.empty(packs)
    for p in range(packs):
        lengths = []
        while True:
            s = int(min(capacity, max(16, rng.lognormal(6.0, 1.2))))
            if sum(lengths) + s > capacity:
                break
            lengths.append(s)
        s = np.array(lengths or [capacity], dtype=np.float64)
        costs[p] = s.sum() + (s**2).sum() / 1024
    return costs


class TestDealBalanced:
    @settings(max_examples=examples(100), deadline=None)
    @given(batches())
    def test_every_pack_once_equal_counts_deterministic(self, batch):
        costs, ranks = batch
        before = costs.copy()
        dealt = deal_balanced(costs, ranks)
        assert dealt.dtype == np.int64 and dealt.shape == (ranks, costs.size // ranks)
        assert sorted(dealt.ravel().tolist()) == list(range(costs.size))
        assert (np.diff(dealt, axis=1) > 0).all()  # rows sorted by position
        np.testing.assert_array_equal(deal_balanced(costs, ranks), dealt)
        np.testing.assert_array_equal(costs, before)  # input untouched

    @settings(max_examples=examples(100), deadline=None)
    @given(batches())
    def test_lpt_bound(self, batch):
        # Proved in the docstring: max <= mean + (1 - 1/DP) * widest round range <= mean + c_max - c_min.
        costs, ranks = batch
        loads = costs[deal_balanced(costs, ranks)].sum(axis=1)
        rounds = np.sort(costs)[::-1].reshape(-1, ranks)
        widest = (rounds[:, 0] - rounds[:, -1]).max()
        slack = 1e-9 * max(1.0, costs.sum())  # float rounding of the sums
        assert loads.max() <= loads.mean() + (1 - 1 / ranks) * widest + slack
        assert loads.max() <= loads.mean() + costs.max() - costs.min() + slack

    @settings(max_examples=examples(100), deadline=None)
    @given(batches())
    def test_matches_slow_reference(self, batch):
        # The same rounds written plainly: each pack in turn (heaviest first) to the lightest rank of
        # those without a pack this round, ties by rank order of the previous round.
        costs, ranks = batch
        order = sorted(range(costs.size), key=lambda i: (-costs[i], i))
        loads, slots, owned = [0.0] * ranks, list(range(ranks)), [[] for _ in range(ranks)]
        for first in range(0, costs.size, ranks):
            slots = sorted(slots, key=lambda rank: loads[rank])  # stable: ties keep the previous order
            for rank, pack in zip(slots, order[first : first + ranks], strict=True):
                owned[rank].append(pack)
                loads[rank] += costs[pack]
        np.testing.assert_array_equal(deal_balanced(costs, ranks), np.sort(np.array(owned), axis=1))

    def test_worked_example(self):
        costs = np.array([5.0, 4.0, 3.0, 3.0, 1.0, 0.0])
        assert deal_balanced(costs, 2).tolist() == [[0, 3, 5], [1, 2, 4]]
        assert deal_balanced(costs, 1).tolist() == [[0, 1, 2, 3, 4, 5]]
        assert deal_balanced(costs, 6).tolist() == [[0], [1], [2], [3], [4], [5]]

    def test_ties_by_index(self):
        # All equal: round r gives packs r*DP .. in rank order of the (stable) previous round.
        assert deal_balanced(np.ones(6), 3).tolist() == [[0, 3], [1, 4], [2, 5]]
        assert deal_balanced(np.zeros(4), 2).tolist() == [[0, 2], [1, 3]]

    def test_long_tail_overhead_drops(self):
        rng = np.random.default_rng(13)
        batches = [long_tail_costs(rng, 256) for _ in range(8)]
        in_order = [c[deal_in_order(c, 32)].sum(axis=1) for c in batches]
        balanced = [c[deal_balanced(c, 32)].sum(axis=1) for c in batches]
        before, after = straggler_overhead(np.array(in_order)), straggler_overhead(np.array(balanced))
        assert before > 0.05
        assert after < before / 10


class TestDealInOrder:
    def test_positions_strided(self):
        assert deal_in_order(np.zeros(6), 2).tolist() == [[0, 2, 4], [1, 3, 5]]
        assert deal_in_order(np.zeros(6), 3).tolist() == [[0, 3], [1, 4], [2, 5]]
        assert deal_in_order(np.zeros(6), 3).dtype == np.int64

    def test_matches_batch_sampler_dealing(self):
        positions = np.arange(12)
        for d, row in enumerate(deal_in_order(np.zeros(12), 4)):
            assert row.tolist() == positions[d::4].tolist()


class TestStragglerOverhead:
    def test_known_arrays(self):
        assert straggler_overhead(np.ones((3, 4))) == 0.0
        assert straggler_overhead(np.array([[2.0, 2.0], [4.0, 0.0]])) == 0.5
        assert straggler_overhead(np.array([3.0, 1.0])) == 0.5  # one step
        assert straggler_overhead(np.array([[4.0, 0.0, 0.0, 0.0]])) == 3.0

    def test_empty_and_zero(self):
        assert straggler_overhead(np.zeros((0, 8))) == 0.0
        assert straggler_overhead(np.zeros((5, 0))) == 0.0
        assert straggler_overhead(np.zeros((2, 3))) == 0.0

    @pytest.mark.parametrize(
        ("rank_costs", "match"),
        [
            (np.zeros((2, 2, 2)), r"\[steps, ranks\], got shape \(2, 2, 2\)"),
            (np.array([[1.0, np.nan]]), "finite and >= 0"),
            (np.array([[1.0, -1.0]]), "finite and >= 0"),
        ],
    )
    def test_errors(self, rank_costs, match):
        with pytest.raises(TightpackError, match=match):
            straggler_overhead(rank_costs)


@pytest.mark.parametrize("deal", [deal_balanced, deal_in_order])
class TestErrors:
    @pytest.mark.parametrize("ranks", [0, -2, 1.5, True])
    def test_ranks(self, deal, ranks):
        with pytest.raises(TightpackError, match=r"ranks must be a positive integer .*got"):
            deal(np.ones(4), ranks)

    def test_not_divisible(self, deal):
        with pytest.raises(TightpackError, match=r"global batch of 10 packs is not divisible by ranks \(4\)"):
            deal(np.ones(10), 4)

    def test_shape(self, deal):
        with pytest.raises(TightpackError, match=r"shape \[GBS\], got shape \(2, 4\)"):
            deal(np.ones((2, 4)), 2)

    @pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
    def test_bad_costs(self, deal, bad):
        costs = np.ones(4)
        costs[2] = bad
        with pytest.raises(TightpackError, match=r"finite and >= 0; pack 2 has cost"):
            deal(costs, 2)


# --- balanced_steps: packs grouped into steps by cost, then dealt ---------------------------------


@st.composite
def epochs(draw) -> tuple[np.ndarray, int, int]:
    """An epoch of costs that makes whole steps of ``ranks x per_rank``; ties and zeros included."""
    ranks, per_rank, steps = draw(st.integers(1, 8)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    size = ranks * per_rank * steps
    cost = st.one_of(st.integers(0, 5).map(float), st.floats(0, 1e6, allow_nan=False, allow_infinity=False))
    return np.array(draw(st.lists(cost, min_size=size, max_size=size))), ranks, per_rank


@settings(max_examples=examples(200), deadline=None)
@given(epochs(), st.integers(0, 2**32 - 1))
def test_balanced_steps_deal_every_pack_once_within_the_bound(epoch, seed):
    costs, ranks, per_rank = epoch
    dealt = balanced_steps(costs, ranks, per_rank, np.random.default_rng(seed))
    steps = len(costs) // (ranks * per_rank)
    assert dealt.shape == (steps, ranks, per_rank) and dealt.dtype == np.int64
    assert sorted(dealt.ravel().tolist()) == list(range(len(costs)))
    assert (np.diff(dealt, axis=2) > 0).all()  # a rank keeps the order of positions
    # Every step holds one tier (ranks consecutive costs of the sorted order) of each stratum.
    ordered = np.sort(costs)[::-1].reshape(per_rank, steps, ranks)
    widest = (ordered[:, :, 0] - ordered[:, :, -1]).max()
    loads = costs[dealt].sum(axis=2)
    for step in range(steps):
        step_costs = np.sort(costs[dealt[step]].ravel())[::-1].reshape(per_rank, ranks)
        assert all(any(np.array_equal(row, tier) for tier in ordered[r]) for r, row in enumerate(step_costs))
    # The LPT bound of deal_balanced, with each round's range at most the widest tier's.
    slack = 1e-9 * max(1.0, costs.sum())
    assert (loads.max(axis=1) <= loads.mean(axis=1) + (1 - 1 / ranks) * widest + slack).all()


def test_balanced_steps_balance_one_pack_per_rank_where_dealing_cannot():
    """With one pack per rank a step lasts as long as its heaviest pack: only grouping packs of similar
    cost into the same step helps, and in-order steps of a long tail lose far more."""
    rng = np.random.default_rng(0)
    costs = 1 + np.minimum(rng.pareto(1.5, 64 * 100), 3)
    in_order = costs.reshape(100, 64)
    grouped = costs[balanced_steps(costs, 64, 1, np.random.default_rng(1))].sum(axis=2)
    assert straggler_overhead(in_order) > 0.5
    assert straggler_overhead(grouped) < 0.01


def test_balanced_steps_are_seeded_and_the_generator_is_the_only_randomness():
    costs = np.random.default_rng(3).random(96)
    first = balanced_steps(costs, 4, 3, regroup_generator(7, 0))
    assert np.array_equal(first, balanced_steps(costs, 4, 3, regroup_generator(7, 0)))
    assert not np.array_equal(first, balanced_steps(costs, 4, 3, regroup_generator(7, 1)))


@pytest.mark.parametrize(
    ("size", "ranks", "per_rank", "match"),
    [
        (10, 4, 1, "not divisible by ranks"),
        (12, 2, 4, "do not make whole steps of 2 ranks x 4 items"),
        (12, 2, 0, "per_rank must be a positive integer"),
        (12, 0, 1, "ranks must be a positive integer"),
    ],
)
def test_balanced_steps_errors(size, ranks, per_rank, match):
    with pytest.raises(TightpackError, match=match):
        balanced_steps(np.ones(size), ranks, per_rank, np.random.default_rng(0))
