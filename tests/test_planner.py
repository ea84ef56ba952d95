"""Tests of `tightpack.core.planner`: every algorithm against a slow reference, plus invariants.

References (docs/contract.md §2.5):

- ``first_fit``: the O(N x bins) linear scan; ``ffd`` is that scan on the stable-descending order and
  ``first_fit_shuffle`` is that scan on ``np.random.default_rng(seed).permutation(n)``.
- ``bfd``: per-item best-fit decreasing. Ties among bins of equal remaining capacity are free, so
  only the number of packs and the multiset of pack loads are compared, not the memberships.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.planner import ALGORITHMS, MAX_PACK_SIZE, PackPlan, first_fit_apart, plan_packs
from tightpack.errors import TightpackError

ALGORITHM_NAMES = sorted(ALGORITHMS)
PROPERTY_SETTINGS = settings(max_examples=2 * settings.default.max_examples, deadline=None)


# --- slow references -------------------------------------------------------------------------------


def linear_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Positions of ``lengths``, packed by the leftmost open bin with remaining capacity >= length.

    A zero-length item joins the first bin with remaining >= 0 (a new bin only when none is open).
    """
    remaining: list[int] = []
    bins: list[list[int]] = []
    for position, length in enumerate(lengths):
        for b, left in enumerate(remaining):
            if left >= length:
                remaining[b] -= length
                bins[b].append(position)
                break
        else:
            remaining.append(capacity - length)
            bins.append([position])
    return bins


def linear_first_fit_apart(lengths: list[int], keys: list[int], capacity: int) -> list[list[int]]:
    """`linear_first_fit` that passes over a bin holding an item of the same key (-1: none)."""
    remaining: list[int] = []
    held: list[set[int]] = []
    bins: list[list[int]] = []
    for position, (length, key) in enumerate(zip(lengths, keys, strict=True)):
        for b, left in enumerate(remaining):
            if left >= length and (key < 0 or key not in held[b]):
                break
        else:
            b = len(remaining)
            remaining.append(capacity)
            held.append(set())
            bins.append([])
        remaining[b] -= length
        held[b].add(key)
        bins[b].append(position)
    return bins


def stable_descending(lengths: list[int]) -> list[int]:
    """Sample indices by decreasing length, equal lengths in input order."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def first_fit_on(order: list[int] | np.ndarray, lengths: list[int], capacity: int) -> list[list[int]]:
    """Linear-scan first fit over ``order``, returned as sample indices."""
    order = [int(i) for i in order]
    bins = linear_first_fit([lengths[i] for i in order], capacity)
    return [[order[p] for p in b] for b in bins]


def per_item_bfd_loads(lengths: list[int], capacity: int) -> list[int]:
    """Pack loads of per-item best-fit decreasing: each item, longest first, goes to the open bin
    with the smallest remaining capacity that holds it, else to a new bin."""
    remaining: list[int] = []
    for i in stable_descending(lengths):
        length = lengths[i]
        fitting = [b for b, left in enumerate(remaining) if left >= length]
        if fitting:
            best = min(fitting, key=lambda b: remaining[b])
            remaining[best] -= length
        else:
            remaining.append(capacity - length)
    return [capacity - left for left in remaining]


# --- helpers ----------------------------------------------------------------------------------------


def as_lists(plan: PackPlan) -> list[list[int]]:
    return [pack.tolist() for pack in plan]


def check_invariants(plan: PackPlan, lengths: np.ndarray | list[int], pack_size: int) -> None:
    """Every sample exactly once, no pack over ``pack_size``, no empty pack, consistent CSR arrays."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assert plan.order.dtype == np.int64 and plan.offsets.dtype == np.int64
    assert plan.offsets[0] == 0 and plan.offsets[-1] == len(lengths)
    assert np.array_equal(np.sort(plan.order), np.arange(len(lengths)))
    assert (plan.pack_sizes > 0).all()
    assert (plan.pack_loads(lengths) <= pack_size).all()


@st.composite
def packing_problems(draw: st.DrawFn) -> tuple[list[int], int]:
    """(lengths, pack_size): up to 200 lengths in [0, pack_size], pack_size in 1..64.

    Lengths are drawn from a small per-example pool half of the time, so that repeated lengths (the
    histogram classes of ``bfd``) and zeros are common.
    """
    pack_size = draw(st.integers(1, 64))
    length = st.integers(0, pack_size)
    if draw(st.booleans()):
        length = st.sampled_from(draw(st.lists(length, min_size=1, max_size=4)))
    return draw(st.lists(length, max_size=200)), pack_size


# --- properties -------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
@PROPERTY_SETTINGS
@given(problem=packing_problems(), seed=st.integers(0, 2**32 - 1))
def test_invariants_hold_for_every_algorithm(
    algorithm: str, problem: tuple[list[int], int], seed: int
) -> None:
    lengths, pack_size = problem
    check_invariants(plan_packs(lengths, pack_size, algorithm=algorithm, seed=seed), lengths, pack_size)


@PROPERTY_SETTINGS
@given(problem=packing_problems())
def test_first_fit_matches_linear_scan(problem: tuple[list[int], int]) -> None:
    lengths, pack_size = problem
    plan = plan_packs(lengths, pack_size, algorithm="first_fit")
    assert as_lists(plan) == linear_first_fit(lengths, pack_size)


@PROPERTY_SETTINGS
@given(problem=packing_problems())
def test_ffd_matches_linear_scan_on_stable_descending_order(problem: tuple[list[int], int]) -> None:
    lengths, pack_size = problem
    plan = plan_packs(lengths, pack_size, algorithm="ffd")
    assert as_lists(plan) == first_fit_on(stable_descending(lengths), lengths, pack_size)


@PROPERTY_SETTINGS
@given(problem=packing_problems())
def test_bfd_matches_per_item_bfd_in_packs_and_loads(problem: tuple[list[int], int]) -> None:
    lengths, pack_size = problem
    plan = plan_packs(lengths, pack_size, algorithm="bfd")
    expected = per_item_bfd_loads(lengths, pack_size)
    assert len(plan) == len(expected)
    assert sorted(plan.pack_loads(np.asarray(lengths)).tolist()) == sorted(expected)


@PROPERTY_SETTINGS
@given(problem=packing_problems(), seed=st.integers(0, 2**63 - 1))
def test_first_fit_shuffle_is_first_fit_on_seeded_permutation(
    problem: tuple[list[int], int], seed: int
) -> None:
    lengths, pack_size = problem
    plan = plan_packs(lengths, pack_size, algorithm="first_fit_shuffle", seed=seed)
    permutation = np.random.default_rng(seed).permutation(len(lengths))
    assert as_lists(plan) == first_fit_on(permutation, lengths, pack_size)
    again = plan_packs(lengths, pack_size, algorithm="first_fit_shuffle", seed=seed)
    assert as_lists(again) == as_lists(plan)


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
@PROPERTY_SETTINGS
@given(problem=packing_problems(), seed=st.integers(0, 2**32 - 1))
def test_scaling_lengths_and_pack_size_changes_no_plan(
    algorithm: str, problem: tuple[list[int], int], seed: int
) -> None:
    # Scaled lengths span far more values than there are samples, so the planner groups them with a
    # comparison sort instead of the counting sort of the unscaled ones: both must agree exactly.
    lengths, pack_size = problem
    scale = MAX_PACK_SIZE // 64
    plan = plan_packs(lengths, pack_size, algorithm=algorithm, seed=seed)
    scaled = plan_packs(
        np.asarray(lengths, dtype=np.int64) * scale, pack_size * scale, algorithm=algorithm, seed=seed
    )
    assert as_lists(scaled) == as_lists(plan)


# --- determinism and seeds --------------------------------------------------------------------------


def test_first_fit_shuffle_seeds_can_differ() -> None:
    lengths = np.random.default_rng(1).integers(1, 100, size=300)
    plans = {
        tuple(map(tuple, as_lists(plan_packs(lengths, 128, algorithm="first_fit_shuffle", seed=s))))
        for s in range(4)
    }
    assert len(plans) > 1


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_ambient_numpy_seed_changes_nothing(algorithm: str) -> None:
    lengths = np.random.default_rng(2).integers(0, 129, size=500)
    plans = []
    for ambient in (0, 12345):
        np.random.seed(ambient)  # noqa: NPY002 - the point is to disturb the legacy global RNG
        plan = plan_packs(lengths, 128, algorithm=algorithm, seed=7)
        plans.append((plan.order.tolist(), plan.offsets.tolist()))
    assert plans[0] == plans[1]


# --- hand cases from the contract -------------------------------------------------------------------


def test_contract_oversize_example_is_rejected() -> None:
    # Contract §2.5 packs [1111, 8192, 4096, 1000] at capacity 2048 with the oversize items alone;
    # the planner instead requires long samples to be truncated or dropped first.
    with pytest.raises(TightpackError, match=r"sample 1 has length 8192 > pack_size 2048"):
        plan_packs([1111, 8192, 4096, 1000], 2048, algorithm="ffd")


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_oversize_sample_is_rejected_by_every_algorithm(algorithm: str) -> None:
    with pytest.raises(TightpackError, match=r"sample 2 has length 11 > pack_size 10; truncate or drop"):
        plan_packs([3, 10, 11, 0], 10, algorithm=algorithm)


def test_contract_object_example_ffd() -> None:
    # a=5, b=3, c=2, d=7, e=4 at capacity 10 -> [[d, b], [a, e], [c]]
    plan = plan_packs([5, 3, 2, 7, 4], 10, algorithm="ffd")
    assert as_lists(plan) == [[3, 1], [0, 4], [2]]


def test_ffd_keeps_input_order_for_equal_lengths() -> None:
    plan = plan_packs([4, 6, 4, 6, 4], 10, algorithm="ffd")
    # Descending stable order: 1, 3 (the 6s), then 0, 2, 4 (the 4s).
    assert as_lists(plan) == [[1, 0], [3, 2], [4]]


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_ten_thousand_random_lengths_stay_within_capacity(algorithm: str) -> None:
    lengths = np.random.default_rng(42).integers(1, 2049, size=10_000)
    plan = plan_packs(lengths, 2048, algorithm=algorithm)
    check_invariants(plan, lengths, 2048)
    assert plan.pack_loads(lengths).max() <= 2048


# --- edge cases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
@pytest.mark.parametrize("empty", [[], np.zeros(0, dtype=np.int64)])
def test_empty_input_gives_empty_plan(algorithm: str, empty: list[int] | np.ndarray) -> None:
    plan = plan_packs(empty, 16, algorithm=algorithm)
    assert len(plan) == 0
    assert plan.offsets.tolist() == [0]
    assert plan.order.tolist() == []
    assert list(plan) == []


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_all_zero_lengths_share_one_pack(algorithm: str) -> None:
    plan = plan_packs([0, 0, 0, 0], 8, algorithm=algorithm)
    assert len(plan) == 1
    assert sorted(plan[0].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_zero_lengths_mixed_in_are_placed(algorithm: str) -> None:
    lengths = [0, 8, 0, 5, 3, 0, 8]
    plan = plan_packs(lengths, 8, algorithm=algorithm)
    check_invariants(plan, lengths, 8)
    assert len(plan) == 3
    assert sorted(plan.pack_loads(np.asarray(lengths)).tolist()) == [8, 8, 8]


def test_zero_lengths_in_first_fit_join_the_first_bin() -> None:
    # Bin 0 is full (remaining 0) and still takes the zeros: remaining >= 0 is enough.
    assert as_lists(plan_packs([8, 0, 5, 0], 8, algorithm="first_fit")) == [[0, 1, 3], [2]]


def test_zero_lengths_in_bfd_join_the_fullest_bin() -> None:
    lengths = [5, 0, 8, 2, 0]
    plan = plan_packs(lengths, 8, algorithm="bfd")
    zero_packs = {int(plan.pack_of_sample()[i]) for i in (1, 4)}
    assert len(zero_packs) == 1
    assert plan.pack_loads(np.asarray(lengths))[zero_packs.pop()] == 8


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_exact_fit_fills_every_pack(algorithm: str) -> None:
    lengths = [6, 4, 3, 7, 5, 5, 10]
    plan = plan_packs(lengths, 10, algorithm=algorithm, seed=3)
    check_invariants(plan, lengths, 10)
    if algorithm != "first_fit_shuffle":  # a bad shuffle may open one pack more
        assert plan.pack_loads(np.asarray(lengths)).tolist() == [10] * 4


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_single_item_equal_to_pack_size(algorithm: str) -> None:
    plan = plan_packs([16], 16, algorithm=algorithm)
    assert as_lists(plan) == [[0]]


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_pack_size_one(algorithm: str) -> None:
    lengths = [1, 0, 1, 1, 0]
    plan = plan_packs(lengths, 1, algorithm=algorithm)
    check_invariants(plan, lengths, 1)
    assert len(plan) == 3


@pytest.mark.parametrize("pack_size", [MAX_PACK_SIZE + 1, 10**10])
def test_pack_size_above_the_int32_limit_is_rejected(pack_size: int) -> None:
    assert MAX_PACK_SIZE == 2**31 - 1
    with pytest.raises(
        TightpackError, match=rf"pack_size {pack_size} exceeds MAX_PACK_SIZE 2147483647 \(2\*\*31 - 1\)"
    ):
        plan_packs([5, 7, 3], pack_size)


def test_unknown_algorithm_lists_the_names() -> None:
    names = r"\['bfd', 'ffd', 'first_fit', 'first_fit_shuffle'\]"
    with pytest.raises(TightpackError, match=rf"unknown packing algorithm 'best_fit'; choose one of {names}"):
        plan_packs([1, 2], 4, algorithm="best_fit")


@pytest.mark.parametrize("pack_size", [0, -3])
def test_pack_size_below_one_is_rejected(pack_size: int) -> None:
    with pytest.raises(TightpackError, match=rf"pack_size must be a positive integer, got {pack_size}"):
        plan_packs([1], pack_size)


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_negative_length_is_rejected(algorithm: str) -> None:
    with pytest.raises(TightpackError, match=r"non-negative; sample 1 has length -2"):
        plan_packs([3, -2, 1], 8, algorithm=algorithm)


@pytest.mark.parametrize("shape", [(2, 3), (0, 3), ()])
def test_non_one_dimensional_lengths_are_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(TightpackError, match=r"lengths must be one-dimensional, got shape"):
        plan_packs(np.ones(shape, dtype=np.int64), 8)


@pytest.mark.parametrize(
    ("lengths", "pack_size", "message"),
    [
        ([2.7, 3.9], 4, "lengths must be integers, got dtype float64"),
        ([1, 1], 1.9, "pack_size must be a positive integer, got 1.9"),
    ],
)
def test_non_integer_inputs_are_rejected(lengths, pack_size, message) -> None:
    with pytest.raises(TightpackError, match=message):
        plan_packs(lengths, pack_size)


def test_input_lengths_are_not_mutated() -> None:
    lengths = np.array([5, 3, 2, 7, 4])
    for algorithm in ALGORITHM_NAMES:
        plan_packs(lengths, 10, algorithm=algorithm)
    assert lengths.tolist() == [5, 3, 2, 7, 4]


# --- PackPlan API -----------------------------------------------------------------------------------


def test_pack_plan_api() -> None:
    plan = PackPlan(order=np.array([2, 0, 1, 4, 3]), offsets=np.array([0, 1, 3, 5]))
    lengths = np.array([1, 2, 5, 4, 3])
    assert len(plan) == 3
    assert plan[0].tolist() == [2]
    assert plan[1].tolist() == [0, 1]
    assert plan[-1].tolist() == [4, 3]
    assert plan[-3].tolist() == [2]
    assert [pack.tolist() for pack in plan] == [[2], [0, 1], [4, 3]]
    assert plan.pack_sizes.tolist() == [1, 2, 2]
    assert plan.pack_of_sample().tolist() == [1, 1, 0, 2, 2]
    assert plan.pack_loads(lengths).tolist() == [5, 3, 7]


@pytest.mark.parametrize("index", [3, 4, -4])
def test_pack_plan_index_out_of_range(index: int) -> None:
    plan = PackPlan(order=np.array([2, 0, 1, 4, 3]), offsets=np.array([0, 1, 3, 5]))
    with pytest.raises(IndexError, match=rf"pack index {index} is out of range for a plan of 3 packs"):
        plan[index]


def test_empty_plan_has_no_packs_to_index() -> None:
    plan = plan_packs([], 4)
    with pytest.raises(IndexError, match=r"pack index 0 is out of range for a plan of 0 packs"):
        plan[0]
    assert plan.pack_sizes.tolist() == []
    assert plan.pack_of_sample().tolist() == []
    assert plan.pack_loads(np.zeros(0, dtype=np.int64)).tolist() == []


# --- memory: O(samples + distinct lengths + packs), never O(pack size) ----------------------------

PEAK_BUDGET = 50 * 2**20  # bytes; before issue 11 a pack size of 10**9 cost 16 GB in bfd


def traced_peak(run) -> tuple[PackPlan, int]:
    """``run()`` and the peak of the memory traced meanwhile (numpy buffers are traced too)."""
    tracemalloc.start()
    try:
        result = run()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
@pytest.mark.parametrize("pack_size", [10**9, MAX_PACK_SIZE])
def test_huge_pack_size_on_tiny_rows_plans_in_small_memory(algorithm: str, pack_size: int) -> None:
    lengths = np.array([5, 7, 3] * 17)
    plan, peak = traced_peak(lambda: plan_packs(lengths, pack_size, algorithm=algorithm, seed=4))
    assert peak < PEAK_BUDGET
    # A pack of exactly the summed length holds them all too: the same plan as the huge pack.
    assert as_lists(plan) == as_lists(plan_packs(lengths, int(lengths.sum()), algorithm=algorithm, seed=4))


@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_huge_lengths_plan_in_small_memory_like_their_small_equivalent(algorithm: str) -> None:
    lengths = np.random.default_rng(11).integers(0, 11, size=3_000)
    plan, peak = traced_peak(lambda: plan_packs(lengths * 10**8, 10**9, algorithm=algorithm, seed=4))
    assert peak < PEAK_BUDGET
    small = plan_packs(lengths, 10, algorithm=algorithm, seed=4)
    assert np.array_equal(plan.order, small.order) and np.array_equal(plan.offsets, small.offsets)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
def test_huge_pack_size_keeps_resident_memory_small() -> None:
    # tracemalloc does not see the C kernel's own buffers; the peak resident size does.
    script = """
import resource
import numpy as np
from tightpack.core.planner import ALGORITHMS, MAX_PACK_SIZE, plan_packs
lengths = np.array([5, 7, 3] * 17)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for algorithm in ALGORITHMS:
    for pack_size in (10**9, MAX_PACK_SIZE):
        plan_packs(lengths, pack_size, algorithm=algorithm)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) * 1024 < PEAK_BUDGET


# --- larger seeded check ----------------------------------------------------------------------------


def test_large_lognormal_bfd_never_worse_than_ffd() -> None:
    pack_size = 8192
    rng = np.random.default_rng(20240601)
    lengths = np.minimum(rng.lognormal(mean=6.0, sigma=1.3, size=200_000).astype(np.int64), pack_size)
    lower_bound = math.ceil(int(lengths.sum()) / pack_size)
    plans = {name: plan_packs(lengths, pack_size, algorithm=name) for name in ALGORITHM_NAMES}
    for plan in plans.values():
        check_invariants(plan, lengths, pack_size)
        assert len(plan) >= lower_bound
    assert len(plans["bfd"]) <= len(plans["ffd"])


@PROPERTY_SETTINGS
@given(
    st.integers(1, 40),
    st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 40)), min_size=1, max_size=120),
    st.lists(st.integers(0, 40), min_size=7, max_size=7),
)
def test_first_fit_apart_is_first_fit_passing_over_packs_holding_a_copy(capacity, items, key_lengths):
    """Copies (one key, one length, as the copies of a sample) never share a pack, and each goes to
    the leftmost pack with room that holds none; items of key -1 go where plain first fit puts them."""
    keys = [key if key < len(items) else -1 for key, _ in items]  # keys in 0..n-1
    lengths = [
        min(key_lengths[key] if key >= 0 else length, capacity)
        for key, (_, length) in zip(keys, items, strict=True)
    ]
    plan = first_fit_apart(np.array(lengths), np.array(keys), capacity)
    assert [pack.tolist() for pack in plan] == linear_first_fit_apart(lengths, keys, capacity)
    unkeyed = first_fit_apart(np.array(lengths), np.full(len(keys), -1), capacity)
    assert [pack.tolist() for pack in unkeyed] == linear_first_fit(lengths, capacity)


def test_first_fit_apart_refuses_keys_out_of_range():
    with pytest.raises(ValueError, match=r"keys must be -1 or in 0\.\.n-1"):
        first_fit_apart(np.array([1, 2]), np.array([0, 2]), 10)
