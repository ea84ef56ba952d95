"""Bin-packing planners: sample lengths in, a `PackPlan` (CSR arrays of sample indices) out.

The planner sees lengths only; filling packs with tokens happens later (`tightpack.core.packed_parquet`).
Lengths are runtime lengths (stored tokens - 1), already aligned to the alignment multiple
(`tightpack.core.alignment`); the pack size is the capacity in the same unit.

Algorithms (`ALGORITHMS`):

- ``bfd`` (default): best-fit decreasing computed on the histogram of lengths. Identical items are
  placed a whole bin class at a time, so beyond the O(N) histogram its cost depends on the number of
  distinct lengths, not on the number of samples; then one pass of the C kernel over the samples
  writes each at its place in the packs, without sorting them. It opens exactly as many packs as
  per-item best-fit decreasing.
- ``ffd``: first-fit decreasing with a stable sort (equal lengths keep input order), as Megatron-Bridge.
- ``first_fit``: leftmost-bin first fit in input order, identical to the linear-scan definition.
- ``first_fit_shuffle``: a seeded permutation, then first fit (Megatron-Bridge's default algorithm).

Randomness only ever comes from ``np.random.default_rng(seed)``; the global RNG is never touched.

Memory is O(number of samples + distinct lengths + packs) for every algorithm, never O(pack size): an
array over the range of lengths (a counting sort's offsets, bfd's histogram) is used only when that
range is small next to the number of samples, so a pack size of 10**9 on a few rows plans in
kilobytes. Pack sizes are capped at `MAX_PACK_SIZE`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tightpack.core import _firstfit
from tightpack.errors import TightpackError

__all__ = ["ALGORITHMS", "MAX_PACK_SIZE", "PackPlan", "plan_packs"]

MAX_PACK_SIZE = 2**31 - 1
"""Largest pack size ``plan_packs`` accepts: pack boundaries (``cu_seqlens``) are int32 downstream."""

# A counting sort needs an offsets array of (largest key + 2) int64 entries, bfd's histogram one of
# (longest + 1). Either is used only while that array stays within the size of the sample index
# arrays (plus this slack for small inputs); beyond it a comparison sort (numpy's) keeps memory
# O(number of samples), whatever the pack size.
_COUNTING_SORT_SLACK = 2**16


_COUNT_BLOCK = 1 << 20
"""Lengths counted at a time by the bfd planner's histogram."""
_LOAD_PACKS = 1 << 12
"""Packs summed at a time by `PackPlan.pack_loads`."""


@dataclass(frozen=True)
class PackPlan:
    """Which samples go into which pack, as CSR arrays.

    ``order`` (int64, one entry per sample) lists sample indices pack by pack; ``offsets`` (int64,
    ``len(plan) + 1`` entries) delimits the packs: pack ``i`` is ``order[offsets[i]:offsets[i + 1]]``.

    >>> plan = PackPlan(order=np.array([2, 0, 1]), offsets=np.array([0, 1, 3]))
    >>> len(plan), plan[1].tolist()
    (2, [0, 1])
    """

    order: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, pack: int) -> np.ndarray:
        n = len(self)
        if not -n <= pack < n:
            raise IndexError(f"pack index {pack} is out of range for a plan of {n} packs")
        pack %= n
        return self.order[self.offsets[pack] : self.offsets[pack + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def pack_sizes(self) -> np.ndarray:
        """Number of samples in each pack, int64 ``[len(plan)]``."""
        return np.diff(self.offsets)

    def pack_of_sample(self) -> np.ndarray:
        """Pack index of every sample, int64 ``[num_samples]``."""
        packs = np.empty(len(self.order), dtype=np.int64)
        packs[self.order] = np.repeat(np.arange(len(self), dtype=np.int64), self.pack_sizes)
        return packs

    def pack_loads(self, lengths: np.ndarray, power: int = 1) -> np.ndarray:
        """Sum of ``lengths ** power`` in each pack, int64 ``[len(plan)]``.

        Summed a block of packs at a time: the temporaries stay bounded whatever the plan's size.

        >>> plan = PackPlan(order=np.array([2, 0, 1]), offsets=np.array([0, 1, 1, 3]))
        >>> plan.pack_loads(np.array([3, 4, 5]), power=2).tolist()
        [25, 0, 25]
        """
        lengths = np.asarray(lengths)
        loads = np.empty(len(self), dtype=np.int64)
        for first in range(0, len(self), _LOAD_PACKS):
            offsets = self.offsets[first : min(first + _LOAD_PACKS, len(self)) + 1]
            values = lengths[self.order[offsets[0] : offsets[-1]]].astype(np.int64, copy=False) ** power
            cumulative = np.concatenate(([0], np.cumsum(values)))
            loads[first : first + len(offsets) - 1] = (
                cumulative[offsets[1:] - offsets[0]] - cumulative[offsets[:-1] - offsets[0]]
            )
        return loads


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    pack_size: int,
    *,
    algorithm: str = "bfd",
    seed: int = 0,
    skip_negative: bool = False,
) -> PackPlan:
    """Group samples into packs of at most ``pack_size`` tokens.

    Args:
        lengths: non-negative sample lengths, ``[num_samples]``, each ``<= pack_size``. int32 lengths
            are planned as they are by ``bfd`` (the others take an int64 copy).
        pack_size: capacity of one pack, in the same unit as ``lengths``.
        algorithm: one of ``ALGORITHMS`` (``bfd``, ``ffd``, ``first_fit``, ``first_fit_shuffle``).
        seed: seed of the shuffle of ``first_fit_shuffle``; the other algorithms are deterministic.
        skip_negative: ``bfd`` only: a negative length marks a sample that is not packed, and the
            plan lists the others by their index in ``lengths`` (no compacted copy is made).

    Returns:
        A `PackPlan` in which every sample appears exactly once (with ``skip_negative``: every sample
        of non-negative length).

    Raises:
        TightpackError: on an unknown algorithm, a pack size below 1 or above `MAX_PACK_SIZE`, a
            negative length or a length above the pack size.

    >>> plan = plan_packs([5, 3, 2, 7, 4], 10, algorithm="ffd")
    >>> [plan[i].tolist() for i in range(len(plan))]
    [[3, 1], [0, 4], [2]]
    """
    if algorithm not in ALGORITHMS:
        raise TightpackError(f"unknown packing algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    if not isinstance(pack_size, (int, np.integer)) or pack_size < 1:
        raise TightpackError(f"pack_size must be a positive integer, got {pack_size!r}")
    pack_size = int(pack_size)
    if pack_size > MAX_PACK_SIZE:
        raise TightpackError(
            f"pack_size {pack_size} exceeds MAX_PACK_SIZE {MAX_PACK_SIZE} (2**31 - 1): pack boundaries "
            "(cu_seqlens) are int32; use a smaller pack size"
        )
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise TightpackError(f"lengths must be one-dimensional, got shape {lengths.shape}")
    if len(lengths) and not np.issubdtype(lengths.dtype, np.integer):
        raise TightpackError(f"lengths must be integers, got dtype {lengths.dtype}")
    if skip_negative and algorithm != "bfd":
        raise TightpackError(f"skip_negative is for the bfd planner, not {algorithm!r}")
    wide = algorithm != "bfd" or lengths.dtype != np.int32
    lengths = np.ascontiguousarray(lengths, dtype=np.int64 if wide else np.int32)
    if len(lengths) == 0:
        return PackPlan(order=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64))
    low, high = int(lengths.min()), int(lengths.max())
    if low < 0 and not skip_negative:
        raise TightpackError(f"lengths must be non-negative; sample {int(lengths.argmin())} has length {low}")
    if high < 0:
        return PackPlan(order=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64))
    if high > pack_size:
        raise TightpackError(
            f"sample {int(lengths.argmax())} has length {high} > pack_size {pack_size}; "
            "truncate or drop long samples before planning (see --long-samples)"
        )
    return ALGORITHMS[algorithm](lengths, pack_size, seed, high)


def _key_range_is_small(high: int, n: int) -> bool:
    """Whether an array over keys ``[0, high]`` stays within O(``n``) memory (`_COUNTING_SORT_SLACK`)."""
    return high < n + _COUNTING_SORT_SLACK


def _stable_order(keys: np.ndarray, high: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Stable sort of int64 ``keys`` in ``[0, high]``: the sorted positions, and the offsets of each key.

    A counting sort (the C kernel's ``group_by_bin``) when the key range is small next to the number
    of keys; its offsets (``high + 2`` entries, key ``k`` at ``order[offsets[k]:offsets[k + 1]]``) are
    returned too. Otherwise numpy's stable argsort, and ``None`` for the offsets: memory then depends
    on the number of keys only, not on their range (a pack size of 10**9 must not cost gigabytes).
    """
    if not _key_range_is_small(high, len(keys)):
        return np.argsort(keys, kind="stable"), None
    order = np.empty(len(keys), dtype=np.int64)
    offsets = np.empty(high + 2, dtype=np.int64)
    _firstfit.group_by_bin(keys, order, offsets)
    return order, offsets


def _plan_from_bins(bins: np.ndarray, n_bins: int, items: np.ndarray | None) -> PackPlan:
    """CSR plan from the bin of each processed item; ``items`` maps processed positions to samples."""
    order = np.empty(len(bins), dtype=np.int64)
    offsets = np.empty(n_bins + 1, dtype=np.int64)
    _firstfit.group_by_bin(bins, order, offsets)
    return PackPlan(order=order if items is None else items[order], offsets=offsets)


def first_fit_bins(lengths: np.ndarray, pack_size: int) -> tuple[np.ndarray, int]:
    """Leftmost-bin first fit in input order: the bin of each item, int64 ``[n]``, and the bin count.

    Bins are numbered in the order they open. Lengths must be in ``0..pack_size`` (unchecked).

    >>> bins, count = first_fit_bins(np.array([6, 5, 4, 3]), 10)
    >>> bins.tolist(), count
    ([0, 1, 0, 1], 2)
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    # First fit never leaves two bins at most half full, so 2 * ceil(total / pack_size) + 1 bounds
    # the number of bins and sizes the segment tree.
    max_bins = min(len(lengths), 2 * math.ceil(int(lengths.sum()) / pack_size) + 2)
    bins = np.empty(len(lengths), dtype=np.int64)
    return bins, _firstfit.first_fit(lengths, pack_size, bins, max_bins)


def _first_fit_in_order(lengths: np.ndarray, pack_size: int, items: np.ndarray | None = None) -> PackPlan:
    return _plan_from_bins(*first_fit_bins(lengths, pack_size), items)


def _first_fit(lengths: np.ndarray, pack_size: int, seed: int, longest: int) -> PackPlan:
    return _first_fit_in_order(lengths, pack_size)


def _first_fit_decreasing(lengths: np.ndarray, pack_size: int, seed: int, longest: int) -> PackPlan:
    items, _ = _stable_order(longest - lengths, longest)  # descending, equal lengths in input order
    return _first_fit_in_order(lengths[items], pack_size, items)


def _first_fit_shuffle(lengths: np.ndarray, pack_size: int, seed: int, longest: int) -> PackPlan:
    items = np.random.default_rng(seed).permutation(len(lengths))
    return _first_fit_in_order(lengths[items], pack_size, items)


def _best_fit_decreasing(lengths: np.ndarray, pack_size: int, seed: int, longest: int) -> PackPlan:
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
    if _key_range_is_small(longest, len(lengths)):
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


# Each algorithm takes (lengths, pack_size, seed, longest), ``longest`` being ``lengths.max()``.
ALGORITHMS: dict[str, Callable[[np.ndarray, int, int, int], PackPlan]] = {
    "bfd": _best_fit_decreasing,
    "ffd": _first_fit_decreasing,
    "first_fit": _first_fit,
    "first_fit_shuffle": _first_fit_shuffle,
}
