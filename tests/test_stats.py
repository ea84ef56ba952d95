"""Tests of `tightpack.core.stats`: the lower bounds of a plan, against slow references.

References:

- ``definition_l2``: the Martello-Toth L2 bound evaluated literally, with Python sets, for every
  integer threshold ``k`` in ``[0, C // 2]`` (a real ``k`` gives the same sets as an integer one).
- ``optimum``: the exact minimum number of packs, by exhaustive search (tiny instances only).
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.planner import ALGORITHMS, MAX_PACK_SIZE, PackPlan, plan_packs
from tightpack.core.stats import l2_lower_bound, pack_stats

ALGORITHM_NAMES = sorted(ALGORITHMS)
PROPERTY_SETTINGS = settings(max_examples=2 * settings.default.max_examples, deadline=None)


# --- slow references -------------------------------------------------------------------------------


def definition_l2(lengths: list[int], capacity: int) -> int:
    """Martello & Toth (1990), L2, straight from the definition."""
    best = 0
    for k in range(capacity // 2 + 1):
        n1 = [w for w in lengths if w > capacity - k]
        n2 = [w for w in lengths if capacity / 2 < w <= capacity - k]
        n3 = [w for w in lengths if k <= w <= capacity / 2]
        excess = sum(n3) - (len(n2) * capacity - sum(n2))
        best = max(best, len(n1) + len(n2) + max(0, math.ceil(excess / capacity)))
    return best


def optimum(lengths: list[int], capacity: int) -> int:
    """Fewest packs holding ``lengths``: depth-first search over placements, longest item first."""
    items = sorted(lengths, reverse=True)
    best = len(items)

    def place(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(items):
            best = len(loads)
            return
        for b, load in enumerate(loads):
            if load + items[i] <= capacity and load not in loads[:b]:  # equal loads are symmetric
                loads[b] += items[i]
                place(i + 1, loads)
                loads[b] -= items[i]
        place(i + 1, [*loads, items[i]])

    place(0, [])
    return best


def one_pack_per_sample(n: int) -> PackPlan:
    return PackPlan(order=np.arange(n, dtype=np.int64), offsets=np.arange(n + 1, dtype=np.int64))


@st.composite
def packing_problems(draw: st.DrawFn, max_items: int = 200, max_capacity: int = 64) -> tuple[list[int], int]:
    """(lengths, capacity), lengths in [0, capacity], often from a small pool (repeats, halves)."""
    capacity = draw(st.integers(1, max_capacity))
    length = st.integers(0, capacity)
    if draw(st.booleans()):
        length = st.sampled_from(draw(st.lists(length, min_size=1, max_size=4)))
    return draw(st.lists(length, max_size=max_items)), capacity


# --- L2 against its definition and the optimum ------------------------------------------------------


@PROPERTY_SETTINGS
@given(problem=packing_problems())
def test_l2_matches_its_definition(problem: tuple[list[int], int]) -> None:
    lengths, capacity = problem
    assert l2_lower_bound(np.array(lengths, dtype=np.int64), capacity) == definition_l2(lengths, capacity)


@PROPERTY_SETTINGS
@given(problem=packing_problems())
def test_l2_is_never_below_the_volume_bound(problem: tuple[list[int], int]) -> None:
    lengths, capacity = problem
    assert l2_lower_bound(np.array(lengths, dtype=np.int64), capacity) >= math.ceil(sum(lengths) / capacity)


@PROPERTY_SETTINGS
@given(problem=packing_problems(max_items=8, max_capacity=12))
def test_l2_never_exceeds_the_optimum_of_tiny_instances(problem: tuple[list[int], int]) -> None:
    lengths, capacity = problem
    assert l2_lower_bound(np.array(lengths, dtype=np.int64), capacity) <= optimum(lengths, capacity)


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
@PROPERTY_SETTINGS
@given(problem=packing_problems(), seed=st.integers(0, 2**32 - 1))
def test_stats_bounds_are_below_every_planner(
    algorithm: str, problem: tuple[list[int], int], seed: int
) -> None:
    lengths, capacity = problem
    plan = plan_packs(lengths, capacity, algorithm=algorithm, seed=seed)
    stats = pack_stats(plan, np.array(lengths, dtype=np.int64), capacity)
    assert stats.lower_bound <= stats.lower_bound_l2 <= stats.packs
    assert stats.gap == stats.packs - stats.lower_bound_l2 >= 0


# --- hand cases ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "volume", "l2"),
    [
        # The 6s leave 4 each: room 12 >= 3 for the 1s, so L2 = 3 = ceil(21 / 10).
        ([6, 6, 6, 1, 1, 1], 3, 3),
        # No two 6s share a pack: L(0) = |items > 5| = 4 > ceil(24 / 10) = 3.
        ([6, 6, 6, 6], 3, 4),
        # k = 4: N1 = {7} (nothing >= 4 fits next to it), N2 = {6}, N3 = {4, 4, 4} of volume 12,
        # room next to N2 4: 1 + 1 + ceil(8 / 10) = 3 = ceil(25 / 10); k = 0 gives max(2, 3) = 3.
        ([7, 6, 4, 4, 4], 3, 3),
        # k = 3: N1 = {8, 8} (> 7), N3 = {3, 3, 3}: 2 + ceil(9 / 10) = 3 = ceil(25 / 10).
        ([8, 8, 3, 3, 3], 3, 3),
        # k = 3: N1 = {8, 8, 8}, N3 = {3}: 3 + 1 = 4 > ceil(27 / 10) = 3.
        ([8, 8, 8, 3], 3, 4),
        ([], 0, 0),
        ([0, 0], 0, 0),
    ],
)
def test_l2_hand_cases(lengths: list[int], volume: int, l2: int) -> None:
    assert math.ceil(sum(lengths) / 10) == volume
    assert l2_lower_bound(np.array(lengths, dtype=np.int64), 10) == l2
    if lengths:
        assert l2 <= optimum(lengths, 10)


def test_half_pack_samples_raise_the_bound_above_the_volume_bound() -> None:
    # Issue 11: at 4,096 the summary printed the volume bound while more samples exceeded half a
    # pack. 534 samples of 3,000 (> 2,048) need a pack each; a 1,100 fits next to none of them
    # (3,000 + 1,100 > 4,096), so three 1,100s need one pack more: 535, what bfd achieves.
    # Volume bound: ceil((534 * 3,000 + 3 * 1,100) / 4,096) = ceil(1,605,300 / 4,096) = 392.
    lengths = np.array([3000] * 534 + [1100] * 3, dtype=np.int64)
    plan = plan_packs(lengths, 4096)
    stats = pack_stats(plan, lengths, 4096)
    assert (stats.lower_bound, stats.lower_bound_l2, stats.packs, stats.gap) == (392, 535, 535, 0)


def test_l2_is_not_always_the_optimum() -> None:
    # 534 samples of 3,000 and 535 of 1,000 at 4,096: each big sample has room for one 1,000, so the
    # 535th needs a pack of its own (optimum 535), but L2 only counts volume in that room: 534.
    lengths = np.array([3000] * 534 + [1000] * 535, dtype=np.int64)
    stats = pack_stats(plan_packs(lengths, 4096), lengths, 4096)
    assert (stats.lower_bound, stats.lower_bound_l2, stats.packs, stats.gap) == (522, 534, 535, 1)


def test_stats_of_an_empty_plan() -> None:
    stats = pack_stats(plan_packs([], 8), np.zeros(0, dtype=np.int64), 8)
    assert (stats.packs, stats.lower_bound, stats.lower_bound_l2, stats.gap) == (0, 0, 0, 0)
    assert {"lower_bound_l2", "gap"} <= stats.to_dict().keys()


def test_stats_use_the_packed_samples_only() -> None:
    # A plan may cover part of the lengths: the bounds count what it packs, like ``tokens``.
    plan = PackPlan(order=np.array([1, 3], dtype=np.int64), offsets=np.array([0, 1, 2], dtype=np.int64))
    stats = pack_stats(plan, np.array([9, 6, 9, 6], dtype=np.int64), 10)
    assert (stats.tokens, stats.lower_bound, stats.lower_bound_l2, stats.gap) == (12, 2, 2, 0)


# --- memory and scale -------------------------------------------------------------------------------


@pytest.mark.parametrize("pack_size", [10**9, MAX_PACK_SIZE])
def test_l2_memory_does_not_grow_with_the_pack_size(pack_size: int) -> None:
    lengths = np.array([pack_size // 2 + 1] * 5 + [5, 7, 3] * 17, dtype=np.int64)
    tracemalloc.start()
    try:
        bound = l2_lower_bound(lengths, pack_size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20
    assert bound == 5


def test_l2_of_many_samples_matches_one_pack_per_sample_bound() -> None:
    # 100,000 samples, each over half a pack: L2 is their count whatever the volume says.
    lengths = np.random.default_rng(3).integers(2049, 4097, size=100_000)
    stats = pack_stats(one_pack_per_sample(len(lengths)), lengths, 4096)
    assert stats.lower_bound < stats.lower_bound_l2 == stats.packs == 100_000
    assert stats.gap == 0
