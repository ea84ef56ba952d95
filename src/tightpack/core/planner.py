"""Bin-packing planners: sample lengths in, a `PackPlan` (CSR arrays of sample indices) out.

The planner sees lengths only; filling packs with tokens happens later (`tightpack.core.packed_parquet`).
Lengths are runtime lengths (stored tokens - 1), already aligned to the alignment multiple
(`tightpack.core.alignment`); the pack size is the capacity in the same unit.

Algorithms (`ALGORITHMS`):

- ``bfd`` (default, `tightpack.core.best_fit`): best-fit decreasing computed on the histogram of
  lengths. Identical items are placed a whole bin class at a time, so beyond the O(N) histogram its
  cost depends on the number of distinct lengths, not on the number of samples; then one pass of the
  C kernel over the samples writes each at its place in the packs, without sorting them. It opens
  exactly as many packs as per-item best-fit decreasing.
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

import math
from collections.abc import Callable, Sequence

import numpy as np

from tightpack.core import _firstfit
from tightpack.core.best_fit import best_fit_decreasing, key_range_is_small
from tightpack.core.pack_plan import PackPlan
from tightpack.errors import TightpackError

__all__ = ["ALGORITHMS", "PackPlan", "plan_packs"]

MAX_PACK_SIZE = 2**31 - 1
"""Largest pack size ``plan_packs`` accepts: pack boundaries (``cu_seqlens``) are int32 downstream."""


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
            "truncate or drop long samples before planning (as PackConfig.long_samples does)"
        )
    return ALGORITHMS[algorithm](lengths, pack_size, seed, high)


def _stable_order(keys: np.ndarray, high: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Stable sort of int64 ``keys`` in ``[0, high]``: the sorted positions, and the offsets of each key.

    A counting sort (the C kernel's ``group_by_bin``) when the key range is small next to the number
    of keys; its offsets (``high + 2`` entries, key ``k`` at ``order[offsets[k]:offsets[k + 1]]``) are
    returned too. Otherwise numpy's stable argsort, and ``None`` for the offsets: memory then depends
    on the number of keys only, not on their range (a pack size of 10**9 must not cost gigabytes).
    """
    if not key_range_is_small(high, len(keys)):
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


def first_fit_apart(lengths: np.ndarray, keys: np.ndarray, pack_size: int) -> PackPlan:
    """First fit in input order in which items of one key (copies of one sample) never share a pack:
    an item of a key goes to the first pack with room after the pack of the key's previous item (for
    copies of one length, that is the first pack with room that holds no copy). Items of key -1 are
    placed as `first_fit_bins` places them, so with no key the plan is plain first fit's.

    Args:
        lengths: int ``[n]``: item lengths in ``0..pack_size`` (unchecked).
        keys: int ``[n]``: -1, or the item's key in ``0..n-1``.
        pack_size: tokens per pack.

    >>> [pack.tolist() for pack in first_fit_apart(np.array([3, 3, 4]), np.array([1, 1, -1]), 10)]
    [[0, 2], [1]]
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if not len(keys) or keys.max() < 0:  # nothing to keep apart: plain first fit, with its bin bound
        return _first_fit_in_order(lengths, pack_size)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    bins = np.empty(len(lengths), dtype=np.int64)
    return _plan_from_bins(bins, _firstfit.first_fit_apart(lengths, keys, pack_size, bins), None)


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


# Each algorithm takes (lengths, pack_size, seed, longest), ``longest`` being ``lengths.max()``.
ALGORITHMS: dict[str, Callable[[np.ndarray, int, int, int], PackPlan]] = {
    "bfd": best_fit_decreasing,
    "ffd": _first_fit_decreasing,
    "first_fit": _first_fit,
    "first_fit_shuffle": _first_fit_shuffle,
}
