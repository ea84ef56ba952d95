"""Exact subset-sum fills: the fullest pack a set of candidates allows.

Reachable sums are kept as the bits of one Python integer per prefix of the candidates, so adding a
candidate of length ``n`` is one shift and one OR over ``capacity + 1`` bits: the work is
``len(lengths) * capacity / 64`` machine words, a few microseconds per candidate at 8k tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def best_subset(lengths: Sequence[int], capacity: int, *, first: int | None = None) -> list[int]:
    """Indices of a subset of ``lengths`` with the largest sum that is at most ``capacity``.

    Among the subsets with that sum, the one returned holds ``first`` (an index) whenever one of
    them does, and otherwise leans on the earliest candidates: order them by preference. Lengths
    above ``capacity`` are never chosen. The indices come back in increasing order.

    >>> best_subset([5, 4, 4, 3], 12)
    [0, 1, 3]
    >>> best_subset([5, 4, 4, 3], 12, first=2)
    [0, 2, 3]
    >>> best_subset([9, 7], 6)
    []
    """
    mask = (1 << (capacity + 1)) - 1
    others = [i for i in range(len(lengths)) if i != first]
    reach = [1]  # reach[j]: bit s set when some subset of others[:j] sums to s
    for i in others:
        reach.append(reach[-1] | ((reach[-1] << int(lengths[i])) & mask))
    reachable = reach[-1]
    anchor = int(lengths[first]) if first is not None else capacity + 1
    if anchor <= capacity:
        reachable |= (reachable << anchor) & mask
    target = reachable.bit_length() - 1
    chosen = []
    if anchor <= capacity and target >= anchor and (reach[-1] >> (target - anchor)) & 1:
        chosen.append(first)
        target -= anchor
    for j in range(
        len(others) - 1, -1, -1
    ):  # keep a candidate only when the earlier ones cannot do without it
        if not (reach[j] >> target) & 1:
            chosen.append(others[j])
            target -= int(lengths[others[j]])
    return sorted(chosen)


def fill_groups(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group every index of ``lengths`` into packs of at most ``capacity``, filling one pack at a time.

    Each pack is the fullest subset of the candidates left (the minimum bin slack heuristic, searched
    exactly): among the fullest, one holding the longest candidate when there is one, and otherwise
    the shortest candidates. So the longest is not always in the first pack: ``[7, 5, 5]`` in 10 packs
    ``[5, 5]`` first. Every index lands in exactly one group (a length above ``capacity`` gets a group
    of its own); a group lists its indices in increasing order.

    >>> fill_groups([5, 4, 4, 3, 7], 12)
    [[0, 4], [1, 2, 3]]
    >>> fill_groups([7, 5, 5], 10)
    [[1, 2], [0]]
    """
    left = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    groups = []
    while left:
        picked = best_subset([lengths[i] for i in left], capacity, first=len(left) - 1)
        group = [left[j] for j in picked] or [left[-1]]
        groups.append(sorted(group))
        taken = set(group)
        left = [i for i in left if i not in taken]
    return groups
