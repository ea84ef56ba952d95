"""best_subset and fill_groups against brute force."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.subset_fill import best_subset, fill_groups

lengths_and_capacity = st.tuples(st.lists(st.integers(0, 40), max_size=10), st.integers(0, 80))


def subset_sums(lengths: list[int], capacity: int) -> list[tuple[int, frozenset[int]]]:
    indices = range(len(lengths))
    return [
        (sum(lengths[i] for i in subset), frozenset(subset))
        for size in range(len(lengths) + 1)
        for subset in combinations(indices, size)
        if sum(lengths[i] for i in subset) <= capacity
    ]


@settings(max_examples=3 * settings.default.max_examples, deadline=None)
@given(lengths_and_capacity, st.data())
def test_best_subset_is_the_fullest_and_holds_first_when_it_can(case, data):
    lengths, capacity = case
    first = data.draw(st.none() | st.integers(0, len(lengths) - 1)) if lengths else None
    chosen = best_subset(lengths, capacity, first=first)
    sums = subset_sums(lengths, capacity)
    best = max(total for total, _ in sums)
    assert chosen == sorted(set(chosen)) and sum(lengths[i] for i in chosen) == best
    if first is not None and any(total == best and first in subset for total, subset in sums):
        assert first in chosen


@settings(max_examples=3 * settings.default.max_examples, deadline=None)
@given(lengths_and_capacity)
def test_fill_groups_places_every_index_once_within_capacity(case):
    lengths, capacity = case
    groups = fill_groups(lengths, capacity)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert group == sorted(group) and group
        assert sum(lengths[i] for i in group) <= capacity or len(group) == 1


def test_fill_groups_is_never_worse_than_the_lower_bound_by_much_on_small_items():
    lengths = [5, 4, 4, 3, 7, 2, 6, 1, 8, 3]
    groups = fill_groups(lengths, 12)
    assert len(groups) == -(-sum(lengths) // 12)  # 43 tokens: 4 packs, the least possible
