"""Alignment arithmetic, written once: the alignment multiple and the aligned sequence lengths.

With context parallelism (CP) every sequence is split into 2*CP chunks, and with sequence
parallelism (SP) over TP ranks the token dimension is split TP ways; each sequence of a packed row
is therefore padded to a multiple ``m`` of both (docs/contract.md §2.4). Lengths here are runtime
lengths: stored tokens - 1, since labels are the stored tokens shifted by one.
"""

from __future__ import annotations

import math

import numpy as np

from tightpack.errors import TightpackError

__all__ = ["alignment_multiple"]


def alignment_multiple(*, tp: int = 1, cp: int = 1, sp: bool = False) -> int:
    """Per-sequence alignment multiple for a parallel layout.

    ``lcm(2*cp if cp > 1 else 1, cp*tp if sp and tp > 1 else 1)``.

    >>> [alignment_multiple(), alignment_multiple(tp=4, sp=True), alignment_multiple(cp=2),
    ...  alignment_multiple(tp=2, cp=2, sp=True)]
    [1, 4, 4, 4]
    """
    for name, value in (("tp", tp), ("cp", cp)):
        if int(value) < 1:
            raise TightpackError(f"{name} must be a positive integer, got {value}", parameters=(name,))
    context = 2 * cp if cp > 1 else 1
    sequence = cp * tp if sp and tp > 1 else 1
    return math.lcm(context, sequence)


def ceil_to_multiple(values, multiple: int):
    """Round up to a multiple; works on ints and integer arrays.

    >>> ceil_to_multiple(5, 4), ceil_to_multiple(np.array([0, 4, 5]), 4).tolist()
    (8, [0, 4, 8])
    """
    return -(-values // multiple) * multiple


def length_cap(max_length: int, multiple: int) -> int:
    """Largest aligned runtime length allowed: ``floor(max_length / m) * m``.

    Raises:
        TightpackError: when no aligned length fits (``max_length < m``).

    >>> length_cap(4096, 1), length_cap(16, 8), length_cap(17, 8)
    (4096, 16, 16)
    """
    if multiple < 1:
        raise TightpackError(
            f"pad_seq_to_mult must be a positive integer, got {multiple}", parameters=("pad_seq_to_mult",)
        )
    cap = max_length // multiple * multiple
    if cap == 0:
        raise TightpackError(
            f"max_seq_length ({max_length}) must be at least the effective padding multiple ({multiple}); "
            "raise the length or lower pad_seq_to_mult / the parallel sizes",
            parameters=("max_seq_length", "pad_seq_to_mult"),
        )
    return cap


def aligned_lengths(
    runtime_lengths: np.ndarray, multiple: int, cap: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Aligned runtime length of each sample: ``min(cap, ceil(r, m))`` (docs/contract.md §2.4).

    Each stored sequence becomes ``aligned + 1`` tokens: padded when shorter, truncated when longer.
    With ``out`` (which may be ``runtime_lengths`` itself, int32 too) the result is written there a
    block at a time, so that no temporary spans all the samples.

    >>> aligned_lengths(np.array([15, 16, 19, 20]), 8, 16).tolist()
    [16, 16, 16, 16]
    >>> aligned_lengths(np.array([0, 16, 17]), 8, 24).tolist()
    [0, 16, 24]
    """
    if out is None:
        return np.minimum(cap, ceil_to_multiple(np.asarray(runtime_lengths, dtype=np.int64), multiple))
    for first in range(0, len(runtime_lengths), _ALIGN_BLOCK):
        block = slice(first, first + _ALIGN_BLOCK)
        out[block] = aligned_lengths(runtime_lengths[block], multiple, cap)
    return out


_ALIGN_BLOCK = 1 << 20
"""Samples aligned at a time by `aligned_lengths` with ``out``."""
