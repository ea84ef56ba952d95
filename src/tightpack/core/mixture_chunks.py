"""A mixture's stream packed in chunks (`pack_chunks`), the second step of
`tightpack.core.mixture_plan.plan_mixture`: each chunk holds the mixture as every stretch of the
stream does, and is packed apart; no pack holds a sample twice, unless the sample has more copies
in its chunk than half the packs the chunk's tokens fill.
"""

from __future__ import annotations

import numpy as np

from tightpack.core.planner import PackPlan, first_fit_apart
from tightpack.core.preference_units import concatenated_ranges

__all__ = ["pack_chunks"]

SMALL_SHARE = 4
"""`pack_chunks` places a sample of at most ``1 / SMALL_SHARE`` of the pack in stream order, after the
larger ones (longest first): gaps fill as well, and the packs the small samples make alone hold the
sources in the stream's proportions instead of the shortest source alone."""

SORTED_SAVES = 0.002
"""`pack_chunks` packs a chunk first fit decreasing, small samples sorted too, only when that saves
more than one pack and more than this share of its packs (0.2%)."""

DEFAULT_CHUNK_PACKS = 1024
"""Packs' worth of stream tokens `pack_chunks` packs together; a chunk ends
a pack or so below full, so larger chunks fill better and smaller ones follow the stream closer."""


def pack_chunks(
    samples: np.ndarray, lengths: np.ndarray, pack_size: int, chunk_tokens: int, seed: int = 0
) -> PackPlan:
    """Packs of a stream cut into chunks of ``chunk_tokens`` tokens, each chunk packed apart (first
    fit, the large samples longest first, the small ones after them in stream order, copies of a
    sample in different packs) and its packs shuffled (seeded). A chunk ends a pack or so below
    full: its packs under half full (not already carried once) are packed again with the next chunk.

    Args:
        samples: int ``[num_entries]``: the sample of each entry, in stream order; copies of a sample in
            one chunk go to different packs of it, as far as the chunk's packs allow
            (`_copy_keys`).
        lengths: int ``[num_entries]``: each entry's tokens in the pack.
        pack_size: tokens per pack.
        chunk_tokens: the stream's tokens per chunk (at least one).
        seed: seeds the shuffle of each chunk's packs.

    Returns the packs, chunk after chunk, over stream positions.

    >>> plan = pack_chunks(np.array([0, 1, 2, 3]), np.array([3, 6, 4, 7]), 10, chunk_tokens=9)
    >>> sorted(sorted(pack.tolist()) for pack in plan)
    [[0, 1], [2], [3]]
    >>> [pack.tolist() for pack in pack_chunks(np.array([5, 5, 6]), np.array([3, 3, 6]), 10, 100)]
    [[2, 0], [1]]
    >>> [pack.tolist() for pack in pack_chunks(np.array([5, 5]), np.array([1, 1]), 10, 100)]  # one pack
    [[0, 1]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    samples = np.asarray(samples, dtype=np.int64)
    chunk = (np.cumsum(lengths) - lengths) // max(int(chunk_tokens), 1)
    bounds = np.searchsorted(chunk, np.arange(int(chunk.max(initial=-1)) + 2))  # chunks follow the stream
    rng = np.random.default_rng([seed, len(samples)])
    orders, sizes = [], []
    carried = np.zeros(0, dtype=np.int64)  # the previous chunk's packs under half full, unpacked
    last = len(bounds) - 2
    for index, (first, stop) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
        entries = np.concatenate([carried, np.arange(first, stop, dtype=np.int64)])
        if not len(entries):
            continue
        part_lengths = lengths[entries]
        keys = _copy_keys(samples[entries], part_lengths, pack_size)
        part, plan = _pack_chunk(part_lengths, keys, pack_size)
        placed = entries[part[plan.order]]  # stream places, pack by pack
        keep = np.ones(len(plan), dtype=bool)
        if index < last:  # a chunk ends a pack or so below full: those packs join the next chunk
            loads = np.add.reduceat(lengths[placed], plan.offsets[:-1])
            fresh = np.minimum.reduceat(placed >= first, plan.offsets[:-1]).astype(bool)  # not carried twice
            keep = ~((2 * loads < pack_size) & fresh)
        carried = placed[concatenated_ranges(plan.offsets[:-1][~keep], plan.pack_sizes[~keep])]
        kept_offsets, kept_sizes = plan.offsets[:-1][keep], plan.pack_sizes[keep]
        shuffled = rng.permutation(len(kept_sizes))
        orders.append(placed[concatenated_ranges(kept_offsets[shuffled], kept_sizes[shuffled])])
        sizes.append(kept_sizes[shuffled])
    order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
    size = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    return PackPlan(order=order, offsets=np.concatenate([[0], np.cumsum(size)]).astype(np.int64))


def _copy_keys(samples: np.ndarray, lengths: np.ndarray, pack_size: int) -> np.ndarray:
    """Each entry's key for `first_fit_apart` among the entries packed together (the place of the
    first copy its key groups): the same for copies of one sample, which then go to different packs;
    -1 for an entry whose sample has no other copy there (most of them). A sample with more copies than
    half the packs the entries' tokens fill (a few short rows repeated thousands of times) cannot keep
    them all apart without packs of little else: its copies are dealt round into as few groups as leave
    each group no more copies than that, and only the copies of one group are kept apart (half, not
    all, of the packs: a group as large as the packs leaves its last copies no pack with room but new
    ones).

    >>> _copy_keys(np.array([7, 7, 8, 8, 8, 8, 9]), np.full(7, 5), 6)  # 6 packs' tokens: 3 copies a group
    array([ 0,  0,  2,  3,  2,  3, -1])
    """
    keys = np.full(len(samples), -1, dtype=np.int64)
    if not len(samples):
        return keys
    copies = stable_order(samples)  # each sample's copies together, in stream order
    sorted_samples = samples[copies]
    starts = np.concatenate([[True], sorted_samples[1:] != sorted_samples[:-1]])  # each sample's first
    run = np.cumsum(starts) - 1
    counts = np.bincount(run)
    shared = counts[run] > 1
    if not shared.any():
        return keys
    half = max(-(-int(lengths.sum()) // pack_size) // 2, 1)  # half the packs the tokens fill
    run_start = np.flatnonzero(starts)
    rank = np.arange(len(samples)) - run_start[run]  # which copy of its sample, in stream order
    first_of_group = copies[run_start[run] + rank % -(-counts[run] // half)]  # its group's first copy
    keys[copies[shared]] = first_of_group[shared]
    return keys


def _pack_chunk(lengths: np.ndarray, keys: np.ndarray, pack_size: int) -> tuple[np.ndarray, PackPlan]:
    """A chunk's packs: first fit with the samples over ``1 / SMALL_SHARE`` of the pack longest first
    and the small ones after them in stream order (packs the small ones make alone then hold every
    source's small samples, not the shortest source's), unless first fit decreasing over all needs
    fewer packs, by more than one and `SORTED_SAVES` of them; copies (one key) in different packs.
    Returns the chunk's entries in the order the plan numbers them, and the plan."""
    small = lengths * SMALL_SHARE <= pack_size
    # the large ones longest first, then the small ones in stream order
    mixed = stable_order(np.where(small, pack_size + 1, pack_size - lengths))
    plan = first_fit_apart(lengths[mixed], keys[mixed], pack_size)
    # no packing needs fewer packs than its tokens fill, nor than it has samples over half a pack
    floor = max(-(-int(lengths.sum()) // pack_size), int(np.count_nonzero(2 * lengths > pack_size)))
    if small.any() and floor < min(len(plan) - 1, len(plan) * (1 - SORTED_SAVES)):
        decreasing = stable_order(pack_size - lengths)
        tighter = first_fit_apart(lengths[decreasing], keys[decreasing], pack_size)
        if len(tighter) < min(len(plan) - 1, len(plan) * (1 - SORTED_SAVES)):
            mixed, plan = decreasing, tighter
    if 4 * np.count_nonzero(keys >= 0) >= len(keys) and floor < len(plan):
        # many copies to keep apart (a quarter of the chunk or more): sorted by length they fill packs
        # among themselves and leave the copies packs of their own; in stream order a copy sits beside
        # what the stream puts near it
        in_order = first_fit_apart(lengths, keys, pack_size)
        if len(in_order) < len(plan):
            return np.arange(len(lengths)), in_order
    return mixed, plan


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")``, by numpy's radix sort where the keys fit 16 bits (lengths
    within a pack, chunk numbers, sample numbers of a small dataset): several times faster than the
    merge sort it takes for wider integers.

    >>> stable_order(np.array([3, 1, 3, 0])).tolist(), stable_order(np.array([70_000, 1, 70_000])).tolist()
    ([3, 1, 0, 2], [1, 0, 2])
    """
    if len(keys) and 0 <= keys.min() and keys.max() <= np.iinfo(np.uint16).max:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    return np.argsort(keys, kind="stable")
