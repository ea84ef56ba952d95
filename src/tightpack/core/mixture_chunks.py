"""A mixture's stream packed in chunks (`pack_chunks`), the second step of
`tightpack.core.mixture_plan.plan_mixture`: each chunk holds the mixture as every stretch of the
stream does, is packed apart, and holds no sample twice.
"""

from __future__ import annotations

import numpy as np

from tightpack.core.planner import PackPlan, plan_packs
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
    fit, the large samples longest first, the small ones after them in stream order) and its packs
    shuffled (seeded).

    Args:
        samples: int ``[num_entries]``: the sample of each entry, in stream order; an entry whose
            sample is already in its chunk (a repetition) moves to the next chunk, so that no chunk,
            and so no pack, holds a sample twice.
        lengths: int ``[num_entries]``: each entry's tokens in the pack.
        pack_size: tokens per pack.
        chunk_tokens: the stream's tokens per chunk (at least one).
        seed: seeds the shuffle of each chunk's packs.

    Returns the packs, chunk after chunk, over stream positions.

    >>> plan = pack_chunks(np.array([0, 1, 2, 3]), np.array([3, 6, 4, 7]), 10, chunk_tokens=9)
    >>> sorted(sorted(pack.tolist()) for pack in plan)
    [[0, 1], [2], [3]]
    >>> [pack.tolist() for pack in pack_chunks(np.array([5, 5]), np.array([1, 1]), 10, 100)]
    [[0], [1]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    samples = np.asarray(samples, dtype=np.int64)
    chunk = _chunks_apart(samples, (np.cumsum(lengths) - lengths) // max(int(chunk_tokens), 1))
    by_chunk = stable_order(chunk)
    bounds = np.searchsorted(chunk[by_chunk], np.arange(int(chunk.max(initial=-1)) + 2))
    rng = np.random.default_rng([seed, len(samples)])
    orders, sizes = [], []
    for first, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        part = by_chunk[first:stop]
        if not len(part):
            continue
        part, plan = _pack_chunk(part, lengths[part], pack_size)
        shuffled = rng.permutation(len(plan))
        part_sizes = plan.pack_sizes[shuffled]
        orders.append(part[plan.order[concatenated_ranges(plan.offsets[shuffled], part_sizes)]])
        sizes.append(part_sizes)
    order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
    size = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    return PackPlan(order=order, offsets=np.concatenate([[0], np.cumsum(size)]).astype(np.int64))


def _chunks_apart(samples: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """The chunks of the entries once every copy of a sample is in a later chunk than the copy before
    it: a copy whose chunk already holds its sample moves to the next chunk (and so on down the copies):
    ``chunk'[k] = max(chunk[k], chunk'[k - 1] + 1)`` along each sample's copies in stream order, a
    running maximum of ``chunk[k] - k`` plus ``k``.

    >>> _chunks_apart(np.array([7, 7, 8, 7]), np.array([0, 0, 0, 1])).tolist()
    [0, 1, 0, 2]
    """
    if not len(samples):
        return chunk
    copies = stable_order(samples)  # each sample's copies together, in stream order
    sorted_samples = samples[copies]
    first = np.flatnonzero(np.concatenate([[True], sorted_samples[1:] != sorted_samples[:-1]]))
    counts = np.diff(np.append(first, len(samples)))
    group = np.repeat(np.arange(len(first)), counts)
    nth = np.arange(len(samples)) - np.repeat(first, counts)  # which copy of its sample (0: the first)
    lowest = int(chunk.min()) - len(samples) - 1
    span = int(chunk.max()) - lowest + 1  # each sample's values above every earlier sample's: one maximum
    running = np.maximum.accumulate(chunk[copies] - nth - lowest + group * span) - group * span + lowest
    moved = np.empty_like(chunk)
    moved[copies] = running + nth
    return moved


def _pack_chunk(entries: np.ndarray, lengths: np.ndarray, pack_size: int) -> tuple[np.ndarray, PackPlan]:
    """A chunk's packs: first fit with the samples over ``1 / SMALL_SHARE`` of the pack longest first
    and the small ones after them in stream order (packs the small ones make alone then hold every
    source's small samples, not the shortest source's), unless first fit decreasing over all needs
    fewer packs, by more than one and `SORTED_SAVES` of them. Returns the entries in the order the
    plan numbers them, and the plan."""
    small = lengths * SMALL_SHARE <= pack_size
    # the large ones longest first, then the small ones in stream order
    mixed = stable_order(np.where(small, pack_size + 1, pack_size - lengths))
    plan = plan_packs(lengths[mixed], pack_size, algorithm="first_fit")
    # no packing needs fewer packs than its tokens fill, nor than it has samples over half a pack
    floor = max(-(-int(lengths.sum()) // pack_size), int(np.count_nonzero(2 * lengths > pack_size)))
    if small.any() and floor < min(len(plan) - 1, len(plan) * (1 - SORTED_SAVES)):
        decreasing = stable_order(pack_size - lengths)
        tighter = plan_packs(lengths[decreasing], pack_size, algorithm="first_fit")
        if len(tighter) < min(len(plan) - 1, len(plan) * (1 - SORTED_SAVES)):
            return entries[decreasing], tighter
    return entries[mixed], plan


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
