"""Bin-packing planners: sample lengths in, a `PackPlan` (CSR arrays of sample indices) out.

The planner sees lengths only; filling packs with tokens happens later (`tightpack.core.packed_parquet`).
Lengths are runtime lengths (stored tokens - 1), already aligned to the alignment multiple
(`tightpack.core.alignment`); the pack size is the capacity in the same unit.

Algorithms (`ALGORITHMS`):

- ``bfd`` (default): best-fit decreasing computed on the histogram of lengths. Identical items are
  placed a whole bin class at a time, so beyond O(N) counting and sorting its cost depends on the
  number of distinct lengths, not on the number of samples. It opens exactly as many packs as per-item
  best-fit decreasing.
- ``ffd``: first-fit decreasing with a stable sort (equal lengths keep input order), as Megatron-Bridge.
- ``first_fit``: leftmost-bin first fit in input order, identical to the linear-scan definition.
- ``first_fit_shuffle``: a seeded permutation, then first fit (Megatron-Bridge's default algorithm).

Randomness only ever comes from ``np.random.default_rng(seed)``; the global RNG is never touched.

Memory is O(number of samples + distinct lengths + packs) for every algorithm, never O(pack size): a
counting sort is used only when the length range is small next to the number of samples, so a pack
size of 10**9 on a few rows plans in kilobytes. Pack sizes are capped at `MAX_PACK_SIZE`.
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

# A counting sort needs an offsets array of (largest key + 2) int64 entries. It is used only while
# that array stays within the size of the sample index arrays (plus this slack for small inputs);
# beyond it numpy's stable sort keeps memory O(number of samples), whatever the pack size.
_COUNTING_SORT_SLACK = 2**16


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

    def pack_loads(self, lengths: np.ndarray) -> np.ndarray:
        """Sum of ``lengths`` in each pack, int64 ``[len(plan)]``."""
        cumulative = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.int64)[self.order])))
        return cumulative[self.offsets[1:]] - cumulative[self.offsets[:-1]]


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    pack_size: int,
    *,
    algorithm: str = "bfd",
    seed: int = 0,
) -> PackPlan:
    """Group samples into packs of at most ``pack_size`` tokens.

    Args:
        lengths: non-negative sample lengths, ``[num_samples]``, each ``<= pack_size``.
        pack_size: capacity of one pack, in the same unit as ``lengths``.
        algorithm: one of ``ALGORITHMS`` (``bfd``, ``ffd``, ``first_fit``, ``first_fit_shuffle``).
        seed: seed of the shuffle of ``first_fit_shuffle``; the other algorithms are deterministic.

    Returns:
        A `PackPlan` in which every sample appears exactly once.

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
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return PackPlan(order=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64))
    low, high = int(lengths.min()), int(lengths.max())
    if low < 0:
        raise TightpackError(f"lengths must be non-negative; sample {int(lengths.argmin())} has length {low}")
    if high > pack_size:
        raise TightpackError(
            f"sample {int(lengths.argmax())} has length {high} > pack_size {pack_size}; "
            "truncate or drop long samples before planning (see --long-samples)"
        )
    return ALGORITHMS[algorithm](lengths, pack_size, seed, high)


def _stable_order(keys: np.ndarray, high: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Stable sort of int64 ``keys`` in ``[0, high]``: the sorted positions, and the offsets of each key.

    A counting sort (the C kernel's ``group_by_bin``) when the key range is small next to the number
    of keys; its offsets (``high + 2`` entries, key ``k`` at ``order[offsets[k]:offsets[k + 1]]``) are
    returned too. Otherwise numpy's stable argsort, and ``None`` for the offsets: memory then depends
    on the number of keys only, not on their range (a pack size of 10**9 must not cost gigabytes).
    """
    if high >= len(keys) + _COUNTING_SORT_SLACK:
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


def _first_fit_in_order(lengths: np.ndarray, pack_size: int, items: np.ndarray | None = None) -> PackPlan:
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    # First fit never leaves two bins at most half full, so 2 * ceil(total / pack_size) + 1 bounds
    # the number of bins and sizes the segment tree.
    max_bins = min(len(lengths), 2 * math.ceil(int(lengths.sum()) / pack_size) + 2)
    bins = np.empty(len(lengths), dtype=np.int64)
    n_bins = _firstfit.first_fit(lengths, pack_size, bins, max_bins)
    return _plan_from_bins(bins, n_bins, items)


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
    sample_rank, distinct, counts = _group_by_length(lengths, longest)
    parent, node_length, node_count = [-1], [0], [0]  # node 0: the empty bin
    classes: dict[int, list[list[int]]] = {}  # remaining capacity -> groups [node, bins]
    class_bins: dict[int, int] = {}  # remaining capacity -> number of bins
    open_classes: list[int] = []  # sorted remaining capacities with at least one bin

    def new_node(base: int, length: int, count: int) -> int:
        parent.append(base)
        node_length.append(length)
        node_count.append(count)
        return len(parent) - 1

    def add_bins(node: int, bins: int, remaining: int) -> None:
        if remaining not in classes:
            classes[remaining], class_bins[remaining] = [], 0
            bisect.insort(open_classes, remaining)
        classes[remaining].append([node, bins])
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

    zeros = int(counts[0]) if distinct[0] == 0 else 0
    for length, left in zip(distinct[::-1].tolist(), counts[::-1].tolist(), strict=True):
        if length == 0:
            break
        while left:
            position = bisect.bisect_left(open_classes, length)
            if position == len(open_classes):  # no open bin holds it: open bins filled with as many as fit
                per_bin = pack_size // length
                full, rest = divmod(left, per_bin)
                if full:
                    add_bins(new_node(0, length, per_bin), full, pack_size - per_bin * length)
                if rest:
                    add_bins(new_node(0, length, rest), 1, pack_size - rest * length)
                break
            remaining = open_classes[position]
            per_bin = remaining // length
            available = class_bins[remaining]
            full = min(available, left // per_bin)
            for node, count in take_bins(remaining, full) if full else ():
                add_bins(new_node(node, length, per_bin), count, remaining - per_bin * length)
            left -= full * per_bin
            if left and full < available:  # the last few items share one more bin of this class
                ((node, _),) = take_bins(remaining, 1)
                add_bins(new_node(node, length, left), 1, remaining - left * length)
                left = 0

    if zeros:  # zero-length items fit best in the fullest bin
        if open_classes:
            remaining = open_classes[0]
            ((node, _),) = take_bins(remaining, 1)
        else:
            node, remaining = 0, pack_size
        add_bins(new_node(node, 0, zeros), 1, remaining)

    groups = sorted(group for class_groups in classes.values() for group in class_groups)
    return _expand_compositions(groups, parent, node_length, node_count, sample_rank)


def _group_by_length(lengths: np.ndarray, longest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample indices stably sorted by length, the distinct lengths (ascending) and their counts.

    Memory is O(samples + distinct lengths): the histogram is taken over the distinct lengths, never
    over ``range(pack_size + 1)``. ``longest`` is ``lengths.max()``.
    """
    rank, offsets = _stable_order(lengths, longest)
    if offsets is not None:
        histogram = np.diff(offsets)
        distinct = np.flatnonzero(histogram)
        return rank, distinct, histogram[distinct]
    ordered = lengths[rank]
    starts = np.flatnonzero(np.diff(ordered, prepend=-1))
    return rank, ordered[starts], np.diff(starts, append=len(ordered))


def _expand_compositions(
    groups: list[list[int]],
    parent: list[int],
    node_length: list[int],
    node_count: list[int],
    sample_rank: np.ndarray,
) -> PackPlan:
    """Turn (composition, number of bins) groups into a plan over concrete sample indices.

    An "entry" is one (length, count) step of a group's composition. Each entry takes a contiguous
    run of ``bins * count`` samples of its length from ``sample_rank``, ``count`` per bin.
    """
    entry_group, entry_length, entry_count = [], [], []
    for group, (node, _) in enumerate(groups):
        chain = []
        while node:
            chain.append(node)
            node = parent[node]
        for node in reversed(chain):
            entry_group.append(group)
            entry_length.append(node_length[node])
            entry_count.append(node_count[node])
    group_bins = np.array([bins for _, bins in groups], dtype=np.int64)
    entry_group = np.array(entry_group, dtype=np.int64)
    entry_length = np.array(entry_length, dtype=np.int64)
    entry_count = np.array(entry_count, dtype=np.int64)
    group_entries = np.bincount(entry_group, minlength=len(groups))
    group_first_entry = np.cumsum(group_entries) - group_entries

    # Entries sorted by length consume the samples sorted by length: exclusive sums are run starts.
    entry_total = group_bins[entry_group] * entry_count
    by_length = np.argsort(entry_length, kind="stable")
    entry_start = np.empty_like(entry_total)
    entry_start[by_length] = np.cumsum(entry_total[by_length]) - entry_total[by_length]

    # One "piece" per (group, bin, entry), laid out group by group, bin by bin, entry by entry.
    pieces_per_group = group_bins * group_entries
    piece_group = np.repeat(np.arange(len(groups)), pieces_per_group)
    local = np.arange(len(piece_group)) - np.repeat(
        np.cumsum(pieces_per_group) - pieces_per_group, pieces_per_group
    )
    piece_bin, piece_slot = np.divmod(local, group_entries[piece_group])
    piece_entry = group_first_entry[piece_group] + piece_slot
    piece_count = entry_count[piece_entry]
    piece_start = entry_start[piece_entry] + piece_bin * entry_count[piece_entry]
    piece_offset = np.cumsum(piece_count) - piece_count
    source = np.repeat(piece_start - piece_offset, piece_count) + np.arange(int(piece_count.sum()))
    order = sample_rank[source]

    pack_sizes = np.repeat(
        np.bincount(entry_group, weights=entry_count, minlength=len(groups)).astype(np.int64), group_bins
    )
    offsets = np.zeros(len(pack_sizes) + 1, dtype=np.int64)
    np.cumsum(pack_sizes, out=offsets[1:])
    return PackPlan(order=order, offsets=offsets)


# Each algorithm takes (lengths, pack_size, seed, longest), ``longest`` being ``lengths.max()``.
ALGORITHMS: dict[str, Callable[[np.ndarray, int, int, int], PackPlan]] = {
    "bfd": _best_fit_decreasing,
    "ffd": _first_fit_decreasing,
    "first_fit": _first_fit,
    "first_fit_shuffle": _first_fit_shuffle,
}
