"""bfd's expansion (`best_fit._expand_groups`, C kernel ``expand_groups``) against a slow reference.

The reference is the definition the numpy expansion implemented before the kernel, in plain Python:
samples are stably sorted by key (their length); every group contributes one entry per node of its
chain (root to leaf); entries sorted stably by key take consecutive runs of the sorted samples
(``bins * count`` each); then each group lays out its bins one after another, each bin its entries
root to leaf, ``count`` samples per entry. The kernel, which places each sample directly instead of
sorting, must reproduce it exactly: the packs, their order and the order of samples inside them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core import _firstfit
from tightpack.core.best_fit import _bfd_groups, _expand_groups, _Groups
from tightpack.core.planner import PackPlan, plan_packs

PROPERTY_SETTINGS = settings(max_examples=2 * settings.default.max_examples, deadline=None)


def reference_expand(groups: _Groups) -> tuple[list[int], list[int]]:
    """(order, offsets) of the plan that ``groups`` describe, by the definition (quadratic at worst)."""
    parent, key = groups.parent.tolist(), groups.node_key.tolist()
    count, bins = groups.node_count.tolist(), groups.node_bins.tolist()
    sample_key = [int(groups.table[value]) for value in groups.values]
    sample_rank = sorted(range(len(sample_key)), key=lambda sample: sample_key[sample])  # stable
    key_counts = [0] * groups.n_keys
    for k in sample_key:
        key_counts[k] += 1
    key_starts = [0]
    for k_count in key_counts:
        key_starts.append(key_starts[-1] + k_count)
    group_nodes = [node for node in range(len(parent)) if bins[node] > 0]
    chains = []  # each group's nodes, root to leaf
    for last in group_nodes:
        chain = []
        node = last
        while node != 0:
            chain.append(node)
            node = parent[node]
        chains.append(chain[::-1])
    entries = [(group, node) for group, chain in enumerate(chains) for node in chain]
    start = {}
    taken = [0] * (len(key_starts) - 1)
    for group, node in sorted(entries, key=lambda entry: key[entry[1]]):  # stable
        start[group, node] = key_starts[key[node]] + taken[key[node]]
        taken[key[node]] += bins[group_nodes[group]] * count[node]
    order, offsets = [], [0]
    for group, last in enumerate(group_nodes):
        for b in range(bins[last]):
            for node in chains[group]:
                first = start[group, node] + b * count[node]
                order.extend(sample_rank[first : first + count[node]])
            offsets.append(len(order))
    assert sorted(order) == sorted(sample_rank), "the groups must use every sample exactly once"
    return order, offsets


def as_arrays(order: list[int], offsets: list[int]) -> PackPlan:
    return PackPlan(order=np.array(order, dtype=np.int64), offsets=np.array(offsets, dtype=np.int64))


def assert_same_plan(plan: PackPlan, expected: PackPlan) -> None:
    assert plan.order.dtype == np.int64 and plan.offsets.dtype == np.int64
    assert plan.order.tolist() == expected.order.tolist()
    assert plan.offsets.tolist() == expected.offsets.tolist()


def bfd_groups(lengths: list[int] | np.ndarray, pack_size: int) -> _Groups:
    lengths = np.asarray(lengths, dtype=np.int64)
    return _bfd_groups(lengths, pack_size, int(lengths.max()))


@st.composite
def packing_problems(draw: st.DrawFn) -> tuple[list[int], int]:
    """(lengths, pack_size): 1 to 300 lengths in [0, pack_size], pack_size in 1..200.

    Half of the examples draw from a small pool, so that many samples share a length (bfd's groups
    then hold many bins) and zeros are common.
    """
    pack_size = draw(st.integers(1, 200))
    length = st.integers(0, pack_size)
    if draw(st.booleans()):
        length = st.sampled_from(draw(st.lists(length, min_size=1, max_size=5)))
    return draw(st.lists(length, min_size=1, max_size=300)), pack_size


@st.composite
def group_trees(draw: st.DrawFn) -> _Groups:
    """Arbitrary groups, not only those bfd makes: any tree, keys repeated along a chain, empty packs,
    samples in any order, any table from values to keys."""
    n_keys = draw(st.integers(1, 5))
    parent, key, count, bins = [-1], [0], [0], [0]
    for node in range(1, draw(st.integers(1, 25))):
        parent.append(draw(st.integers(0, node - 1)))
        key.append(draw(st.integers(0, n_keys - 1)))
        count.append(draw(st.integers(0, 3)))
        bins.append(draw(st.integers(0, 3)))
    used = [0] * n_keys  # samples of each key that the groups consume
    for last in range(1, len(parent)):
        node = last
        while node != 0:
            used[key[node]] += bins[last] * count[node]
            node = parent[node]
    sample_keys = draw(st.permutations([k for k in range(n_keys) for _ in range(used[k])]))
    table = draw(st.permutations(range(n_keys)))  # value v has key table[v]
    value_of_key = {k: v for v, k in enumerate(table)}
    return _Groups(
        node_bins=np.array(bins, dtype=np.int64),
        parent=np.array(parent, dtype=np.int64),
        node_key=np.array(key, dtype=np.int64),
        node_count=np.array(count, dtype=np.int64),
        table=np.array(table, dtype=np.int64),
        values=np.array([value_of_key[k] for k in sample_keys], dtype=np.int64),
        n_keys=n_keys,
        samples=len(sample_keys),
    )


# --- the kernel against the reference ---------------------------------------------------------------


@PROPERTY_SETTINGS
@given(problem=packing_problems())
def test_expansion_of_bfd_groups_matches_reference(problem: tuple[list[int], int]) -> None:
    lengths, pack_size = problem
    groups = bfd_groups(lengths, pack_size)
    expected = as_arrays(*reference_expand(groups))
    assert_same_plan(_expand_groups(groups), expected)
    assert_same_plan(plan_packs(lengths, pack_size, algorithm="bfd"), expected)
    # Lengths far beyond the number of samples take the sorting path (np.unique keys, no histogram).
    scale = 10**6
    scaled = bfd_groups(np.asarray(lengths, dtype=np.int64) * scale, pack_size * scale)
    assert max(lengths) == 0 or scaled.table.tolist() == list(range(scaled.n_keys))
    assert_same_plan(_expand_groups(scaled), as_arrays(*reference_expand(scaled)))
    assert_same_plan(_expand_groups(scaled), expected)


@PROPERTY_SETTINGS
@given(groups=group_trees())
def test_expansion_of_arbitrary_groups_matches_reference(groups: _Groups) -> None:
    assert_same_plan(_expand_groups(groups), as_arrays(*reference_expand(groups)))


@PROPERTY_SETTINGS
@given(problem=packing_problems(), data=st.data())
def test_samples_marked_negative_are_left_out_as_if_removed(problem, data) -> None:
    """``skip_negative``: the plan of the marked lengths (int32 or int64, kept as they are) is the plan
    of the other samples alone, numbered by their place among all: no compacted copy changes it."""
    lengths, pack_size = problem
    marked = np.array(lengths, dtype=data.draw(st.sampled_from([np.int32, np.int64])))
    dropped = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    marked[np.array(dropped, dtype=bool)] = -1
    kept = np.flatnonzero(marked >= 0)
    for scale in (1, 10**6):  # the histogram, and the sorting path of far longer lengths
        scaled = np.where(marked >= 0, marked.astype(np.int64) * scale, -1)
        plan = plan_packs(scaled, pack_size * scale, skip_negative=True)
        alone = plan_packs(scaled[kept], pack_size * scale)
        assert plan.order.tolist() == kept[alone.order].tolist()
        assert plan.offsets.tolist() == alone.offsets.tolist()
        if scale == 1:  # the drawn dtype (int32: the kernel's narrow values) plans as int64 does
            assert_same_plan(plan_packs(marked, pack_size, skip_negative=True), plan)


def test_large_random_lengths_match_reference() -> None:
    # Every length 1..512 frequent, about two samples a pack, hundreds of groups: the uniform case
    # that the per-group numpy expansion was slow on, small enough for the reference.
    lengths = np.random.default_rng(5).integers(1, 513, size=20_000)
    groups = bfd_groups(lengths, 512)
    assert (groups.node_bins > 0).sum() > 400
    assert_same_plan(plan_packs(lengths, 512, algorithm="bfd"), as_arrays(*reference_expand(groups)))


@pytest.mark.parametrize(
    ("lengths", "pack_size", "packs"),
    [
        ([7], 10, [[0]]),  # one sample
        ([10], 10, [[0]]),  # one sample, as long as the pack
        ([0], 10, [[0]]),  # one empty sample
        ([3] * 7, 10, [[0, 1, 2], [3, 4, 5], [6]]),  # all the same length, in input order
        ([10] * 4, 10, [[0], [1], [2], [3]]),  # every length equal to the pack size
        ([0] * 5, 1, [[0, 1, 2, 3, 4]]),  # all zeros share one pack
        # zeros join one full bin (taken from its group of three, so packed last)
        ([1, 0, 1, 1, 0], 1, [[0], [2], [3, 1, 4]]),
    ],
)
def test_edge_cases_match_reference_and_hand_plans(
    lengths: list[int], pack_size: int, packs: list[list[int]]
) -> None:
    groups = bfd_groups(lengths, pack_size)
    expected = as_arrays(*reference_expand(groups))
    plan = plan_packs(lengths, pack_size, algorithm="bfd")
    assert_same_plan(plan, expected)
    assert [pack.tolist() for pack in plan] == packs


def test_empty_lengths_plan_is_empty() -> None:
    plan = plan_packs([], 10, algorithm="bfd")
    assert plan.order.tolist() == [] and plan.offsets.tolist() == [0]
    assert plan.order.dtype == np.int64 and plan.offsets.dtype == np.int64


# --- today's outputs, recorded ----------------------------------------------------------------------


def hashed_lengths(n: int, pack_size: int, kind: str) -> np.ndarray:
    """Deterministic lengths in 0..pack_size from integer hashing alone (no RNG, no floating point).

    ``uniform``: about uniform over 1..pack_size; ``long_tail``: the product of two such draws over
    pack_size (median about pack_size / 5); ``few_with_zeros``: multiples of pack_size / 8 from 0 to
    pack_size (zeros and full-pack samples included).
    """
    index, shift, size = np.arange(n, dtype=np.uint64), np.uint64(40), np.uint64(pack_size)
    first = ((index * np.uint64(0x9E3779B97F4A7C15)) >> shift) % size
    second = (((index + np.uint64(7)) * np.uint64(0xC2B2AE3D27D4EB4F)) >> shift) % size
    first, second = first.astype(np.int64), second.astype(np.int64)
    if kind == "uniform":
        return first + 1
    if kind == "long_tail":
        return first * second // pack_size + 1
    return first % 9 * (pack_size // 8)


def plan_digest(plan: PackPlan) -> str:
    data = plan.order.astype("<i8").tobytes() + plan.offsets.astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


RECORDED_DIGESTS = {
    ("uniform", "bfd"): "8dc57fe77c7c064f",
    ("uniform", "ffd"): "4c2ff8419c4f3068",
    ("uniform", "first_fit"): "3721ce7371c4cd16",
    ("long_tail", "bfd"): "3fce7ae65792328b",
    ("long_tail", "ffd"): "b667f35c2850a69b",
    ("long_tail", "first_fit"): "e071514d033ce586",
    ("few_with_zeros", "bfd"): "b6d27a3a35a692b3",
    ("few_with_zeros", "ffd"): "37feeaa4ad2cd35f",
    ("few_with_zeros", "first_fit"): "1979e3cd449679be",
}


@pytest.mark.parametrize(("kind", "algorithm"), sorted(RECORDED_DIGESTS))
def test_plans_match_the_plans_recorded_before_the_c_expansion(kind: str, algorithm: str) -> None:
    # Digests of the plans of commit e1cac73 (bfd expanded with numpy): the kernel changed no plan.
    # first_fit_shuffle is first_fit on a seeded permutation, compared with it in test_planner.py.
    plan = plan_packs(hashed_lengths(50_000, 1024, kind), 1024, algorithm=algorithm)
    assert plan_digest(plan) == RECORDED_DIGESTS[kind, algorithm]


# --- inputs the kernel refuses ----------------------------------------------------------------------


def kernel_arguments(groups: _Groups, **replace: np.ndarray | int) -> tuple[np.ndarray | int, ...]:
    fields = {
        "node_bins": groups.node_bins,
        "parent": groups.parent,
        "node_key": groups.node_key,
        "node_count": groups.node_count,
        "table": groups.table,
        "values": groups.values,
        "value_size": groups.values.itemsize,
        "n_keys": groups.n_keys,
    }
    fields.update(replace)
    n_packs = int(fields["node_bins"].sum())
    order = np.empty(groups.samples, dtype=np.int64)
    return (*fields.values(), order, np.empty(n_packs + 1, dtype=np.int64))


INCONSISTENT = "the groups do not hold exactly the samples of each key"


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        ({"parent": np.array([-1, 0, 2, 0])}, INCONSISTENT),  # a parent after its child
        ({"node_key": np.array([0, 1, 0, 2])}, INCONSISTENT),  # a node key out of range
        ({"node_bins": np.array([0, 0, 3, 1])}, INCONSISTENT),  # more places than samples
        ({"node_bins": np.array([0, 0, 1, 1])}, INCONSISTENT),  # fewer places than samples
        ({"node_bins": np.array([1, 0, 2, 1])}, INCONSISTENT),  # the empty bin as a group
        ({"values": np.array([4, 3, 4, 3, 4])}, INCONSISTENT),  # more 4s and fewer 3s than placed
        ({"values": np.array([4, 3, 5, 3, 3])}, INCONSISTENT),  # a value beyond the table
        ({"values": np.array([4, -1, 4, 3, 3])}, INCONSISTENT),  # a sample not packed: one place empty
        ({"values": np.array([4, 3, 4, 3, 3], dtype=np.int32)}, "expects int64 buffers"),  # size says 8
        ({"value_size": 2}, "expects int64 buffers"),
        ({"table": np.array([0, 0, 0, 0, 2])}, INCONSISTENT),  # a table key out of range
        ({"n_keys": 1}, INCONSISTENT),
        ({"parent": np.array([-1, 0, 1])}, "expects int64 buffers"),
        ({"node_bins": np.array([0, 0, 2, 1], dtype=np.int32)}, "expects int64 buffers"),
        ({"n_keys": -1}, "expects int64 buffers"),
    ],
)
def test_kernel_rejects_inconsistent_groups(replace: dict[str, np.ndarray | int], message: str) -> None:
    groups = bfd_groups([4, 3, 4, 3, 3], 7)  # the doctest of `_expand_groups`
    assert groups.node_bins.tolist() == [0, 0, 2, 1]
    assert groups.table.tolist() == [0, 0, 0, 0, 1] and groups.values.tolist() == [4, 3, 4, 3, 3]
    _firstfit.expand_groups(*kernel_arguments(groups))  # consistent as they are
    with pytest.raises(ValueError, match=message):
        _firstfit.expand_groups(*kernel_arguments(groups, **replace))
