"""Best-fit decreasing on the histogram of lengths: the ``bfd`` planner (`tightpack.core.planner`).

Identical items are placed a whole bin class at a time, so beyond the O(N) histogram the cost
depends on the number of distinct lengths, not on the number of samples; then one pass of the C
kernel (``expand_groups``) over the samples writes each at its place in the packs, without sorting
them. Samples of negative length are not packed (``plan_packs(..., skip_negative=True)``): the
kernel skips them, so the plan numbers the others by their place among all, with no compacted copy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from tightpack.core import _firstfit
from tightpack.core.pack_plan import PackPlan

# A counting sort needs an offsets array of (largest key + 2) int64 entries, bfd's histogram one of
# (longest + 1). Either is used only while that array stays within the size of the sample index
# arrays (plus this slack for small inputs); beyond it a comparison sort (numpy's) keeps memory
# O(number of samples), whatever the pack size.
COUNTING_SORT_SLACK = 2**16
_COUNT_BLOCK = 1 << 20
"""Lengths counted at a time by the histogram."""


def key_range_is_small(high: int, n: int) -> bool:
    """Whether an array over keys ``[0, high]`` stays within O(``n``) memory (`COUNTING_SORT_SLACK`)."""
    return high < n + COUNTING_SORT_SLACK


def best_fit_decreasing(lengths: np.ndarray, pack_size: int, seed: int, longest: int) -> PackPlan:
    """Best-fit decreasing on the histogram of lengths.

    Best fit places an item in the open bin with the smallest remaining capacity that still holds
    it. For ``c`` identical items of length ``s`` that bin keeps being the best fit until fewer than
    ``s`` tokens remain, so a bin with ``r`` tokens left takes ``r // s`` of them at once, and all the
    bins with the same remaining capacity (a "class") behave alike. The loop therefore runs over
    (length, class) pairs, never over samples. Bins of a class are tracked as groups that share a
    composition; a composition is a node ``(parent, length, count)`` of a tree rooted at the empty bin.
    """
    groups = _bfd_groups(lengths, pack_size, longest)
    return _expand_groups(groups)


@dataclass(frozen=True)
class _Groups:
    """bfd's packs as groups of identical bins over a composition tree, before expansion to samples.

    Node ``k`` (int64 arrays, one entry per node; node 0 is the empty bin) adds ``node_count[k]``
    samples of key ``node_key[k]`` (the index of a distinct length, ascending) to the composition of
    node ``parent[k] < k``; ``node_bins[k] > 0`` bins hold the composition of node ``k``. Sample ``i``
    has key ``table[values[i]]``, one of ``n_keys``; a negative ``values[i]`` is not packed.
    """

    node_bins: np.ndarray
    parent: np.ndarray
    node_key: np.ndarray
    node_count: np.ndarray
    table: np.ndarray
    values: np.ndarray
    n_keys: int
    samples: int  # the samples packed (those of non-negative value)


def _bfd_groups(lengths: np.ndarray, pack_size: int, longest: int) -> _Groups:
    """The (length, class) loop of `_best_fit_decreasing`: its groups, not yet expanded to samples."""
    distinct, counts, values, table = _group_by_length(lengths, longest)
    parent, node_key, node_count = [-1], [0], [0]  # node 0: the empty bin
    classes: dict[int, list[list[int]]] = {}  # remaining capacity -> groups [node, bins]
    class_bins: dict[int, int] = {}  # remaining capacity -> number of bins
    open_classes: list[int] = []  # sorted remaining capacities with at least one bin

    def add_bins(base: int, key: int, count: int, bins: int, remaining: int) -> None:
        """Open ``bins`` bins holding the composition of node ``base`` plus ``count`` items of ``key``."""
        parent.append(base)
        node_key.append(key)
        node_count.append(count)
        if remaining not in classes:
            classes[remaining], class_bins[remaining] = [], 0
            bisect.insort(open_classes, remaining)
        classes[remaining].append([len(parent) - 1, bins])
        class_bins[remaining] += bins

    def take_bins(remaining: int, bins: int) -> list[list[int]]:
        """Remove ``bins`` bins of a class, oldest groups first; returns the groups taken."""
        groups, taken = classes[remaining], []
        class_bins[remaining] -= bins
        while bins:
            node, count = groups[0]
            used = min(count, bins)
            taken.append([node, used])
            bins -= used
            if used == count:
                groups.pop(0)
            else:
                groups[0][1] = count - used
        if not groups:
            del classes[remaining], class_bins[remaining]
            open_classes.pop(bisect.bisect_left(open_classes, remaining))
        return taken

    distinct_lengths, distinct_counts = distinct.tolist(), counts.tolist()
    zeros = distinct_counts[0] if distinct_lengths[0] == 0 else 0
    for key in range(len(distinct_lengths) - 1, -1, -1):
        length, left = distinct_lengths[key], distinct_counts[key]
        if length == 0:
            break
        while left:
            position = bisect.bisect_left(open_classes, length)
            if position == len(open_classes):  # no open bin holds it: open bins filled with as many as fit
                per_bin = pack_size // length
                full, rest = divmod(left, per_bin)
                if full:
                    add_bins(0, key, per_bin, full, pack_size - per_bin * length)
                if rest:
                    add_bins(0, key, rest, 1, pack_size - rest * length)
                break
            remaining = open_classes[position]
            per_bin = remaining // length
            available = class_bins[remaining]
            full = min(available, left // per_bin)
            for node, count in take_bins(remaining, full) if full else ():
                add_bins(node, key, per_bin, count, remaining - per_bin * length)
            left -= full * per_bin
            if left and full < available:  # the last few items share one more bin of this class
                ((node, _),) = take_bins(remaining, 1)
                add_bins(node, key, left, 1, remaining - left * length)
                left = 0

    if zeros:  # zero-length items fit best in the fullest bin
        if open_classes:
            remaining = open_classes[0]
            ((node, _),) = take_bins(remaining, 1)
        else:
            node, remaining = 0, pack_size
        add_bins(node, 0, zeros, 1, remaining)

    # Every group starts at a new node (add_bins makes one), so a node marks at most one group.
    node_bins = np.zeros(len(parent), dtype=np.int64)
    groups = np.array([group for class_groups in classes.values() for group in class_groups], dtype=np.int64)
    node_bins[groups[:, 0]] = groups[:, 1]
    return _Groups(
        node_bins=node_bins,
        parent=np.array(parent, dtype=np.int64),
        node_key=np.array(node_key, dtype=np.int64),
        node_count=np.array(node_count, dtype=np.int64),
        table=table,
        values=values,
        n_keys=len(distinct_lengths),
        samples=int(counts.sum()),
    )


def _group_by_length(
    lengths: np.ndarray, longest: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The distinct lengths (ascending), their counts, and each sample's key as ``table[values]``.

    A sample's key is the index of its length in the distinct lengths. Memory is O(samples + distinct
    lengths), never O(pack size): while the length range is small next to the number of samples, the
    histogram over ``range(longest + 1)`` doubles as the table and ``values`` are the lengths
    themselves; beyond it ``np.unique`` (a sort) gives every sample's key. ``longest`` is
    ``lengths.max()``.
    """
    if key_range_is_small(longest, len(lengths)):
        histogram = np.zeros(longest + 1, dtype=np.int64)
        for first in range(0, len(lengths), _COUNT_BLOCK):  # negative lengths (not packed) are left out
            block = lengths[first : first + _COUNT_BLOCK]
            histogram += np.bincount(block[block >= 0], minlength=longest + 1)
        distinct = np.flatnonzero(histogram)
        counts = histogram[distinct]
        histogram[distinct] = np.arange(len(distinct))  # absent lengths keep 0: no sample looks them up
        return distinct, counts, lengths, histogram
    packed = lengths >= 0
    distinct, keys, counts = np.unique(lengths[packed], return_inverse=True, return_counts=True)
    values = np.full(len(lengths), -1, dtype=np.int64)
    values[packed] = keys
    return distinct, counts, values, np.arange(len(distinct), dtype=np.int64)


def _expand_groups(groups: _Groups) -> PackPlan:
    """Turn bfd's groups into a plan over concrete sample indices (the C kernel ``expand_groups``).

    Groups come in node order, each as ``node_bins`` consecutive packs; a pack lists its composition
    from the root down, each node's ``node_count`` samples together. The samples of one length go, in
    input order, to that length's nodes group by group, each taking ``node_bins * node_count`` of them
    (``node_count`` per bin, bin by bin). The kernel lays out the packs, then writes every sample
    straight to its position in one pass over the samples: O(samples + packs + nodes), no sort.

    Lengths ``[4, 3, 4, 3, 3]`` in packs of 7: node 1 is (root, one 4), node 2 is (node 1, one 3) in two
    bins, node 3 is (root, one 3) in one bin; keys index the distinct lengths ``[3, 4]``.

    >>> groups = _Groups(
    ...     node_bins=np.array([0, 0, 2, 1]), parent=np.array([-1, 0, 1, 0]),
    ...     node_key=np.array([0, 1, 0, 0]), node_count=np.array([0, 1, 1, 1]),
    ...     table=np.array([0, 0, 0, 0, 1]), values=np.array([4, 3, 4, 3, 3]), n_keys=2, samples=5)
    >>> plan = _expand_groups(groups)
    >>> [pack.tolist() for pack in plan]
    [[0, 1], [2, 3], [4]]
    """
    order = np.empty(groups.samples, dtype=np.int64)
    offsets = np.empty(int(groups.node_bins.sum()) + 1, dtype=np.int64)
    _firstfit.expand_groups(
        groups.node_bins,
        groups.parent,
        groups.node_key,
        groups.node_count,
        groups.table,
        groups.values,
        groups.values.itemsize,
        groups.n_keys,
        order,
        offsets,
    )
    return PackPlan(order=order, offsets=offsets)
