"""The cost of every stored pack of a packed dataset, from its flat index, without a loop over packs.

A packed dataset stores, per pack, its tokens and the starts of its sequences (``seq_start_id``,
relative to the pack); flattened, as `tightpack.core.packed_index.PackedIndex` holds them, they are
CSR arrays: ``row_offsets`` ``[rows + 1]`` over the tokens and ``seq_offsets`` ``[rows + 1]`` over
``seq_start_id``. This module turns those into runtime sequence lengths and pack costs with
`tightpack.core.cost_model.CostModel`. The cost model itself lives in `tightpack.core.cost_model`;
dealing packs by cost in `tightpack.core.balance`; the `PackedDataset`-level wrapper (mapping,
legacy ``.npy``) in `tightpack.runtime.balanced_sampler`. Numpy only.

Runtime length: a stored sequence of ``n`` tokens gives ``n - 1`` inputs (its last token is only a
label, see `tightpack.runtime.collate`), so ``s = stored - 1`` with ``stored = next start - start``
(the row's end for its last sequence).
"""

from __future__ import annotations

import os

import numpy as np

from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError


def row_runtime_lengths(
    row_offsets: np.ndarray, seq_start_id: np.ndarray, seq_offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Runtime length and pack of every stored sequence: (int64 ``[seqs]``, int64 ``[seqs]``).

    Args:
        row_offsets: int ``[rows + 1]``; pack ``i`` holds tokens ``[row_offsets[i], row_offsets[i+1])``.
        seq_start_id: int ``[seqs]``, every pack's sequence starts (relative to the pack), back to back.
        seq_offsets: int ``[rows + 1]``; pack ``i``'s starts are
            ``seq_start_id[seq_offsets[i]:seq_offsets[i+1]]``.

    Raises:
        TightpackError: offsets of different row counts, offsets that do not start at 0, decrease or
            do not end at the array's length, or a sequence of fewer than one stored token (starts not
            increasing, or a start at or past the pack's end), naming the first bad pack.

    Two packs of 10 and 6 tokens, starts ``[0, 4]`` and ``[0]``: stored 4, 6 and 6, runtime 3, 5, 5:

    >>> lengths, packs = row_runtime_lengths(np.array([0, 10, 16]), np.array([0, 4, 0]), np.array([0, 2, 3]))
    >>> lengths.tolist(), packs.tolist()
    ([3, 5, 5], [0, 0, 1])
    """
    row_offsets = _offsets(row_offsets, "row_offsets", None)
    seq_start_id = np.asarray(seq_start_id)
    if seq_start_id.ndim != 1 or (seq_start_id.size and not np.issubdtype(seq_start_id.dtype, np.integer)):
        raise TightpackError(
            f"seq_start_id must be a 1-D integer array, got shape {seq_start_id.shape} "
            f"dtype {seq_start_id.dtype}"
        )
    seq_offsets = _offsets(seq_offsets, "seq_offsets", len(seq_start_id))
    if len(seq_offsets) != len(row_offsets):
        raise TightpackError(
            f"row_offsets ({len(row_offsets) - 1} rows) and seq_offsets ({len(seq_offsets) - 1} rows) "
            "describe different numbers of packs; pass the arrays of one index"
        )
    rows = len(row_offsets) - 1
    counts = np.diff(seq_offsets)
    packs = np.repeat(np.arange(rows, dtype=np.int64), counts)
    starts = seq_start_id.astype(np.int64, copy=False)
    # The end of each sequence is the next start, except for a pack's last sequence, which ends
    # where the pack does.
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    filled = counts > 0
    ends[seq_offsets[1:][filled] - 1] = np.diff(row_offsets)[filled]
    stored = ends - starts
    if stored.size and (stored < 1).any():
        bad = int(np.flatnonzero(stored < 1)[0])
        raise TightpackError(
            f"pack {packs[bad]} has a sequence of {stored[bad]} stored tokens (start {starts[bad]}); "
            "seq_start_id must increase and stay inside the pack; rebuild the packed dataset"
        )
    return stored - 1, packs


def row_pack_costs(
    row_offsets: np.ndarray,
    seq_start_id: np.ndarray,
    seq_offsets: np.ndarray,
    model: CostModel | str | os.PathLike,
) -> np.ndarray:
    """Cost of every stored pack, float64 ``[rows]``: ``linear * sum(s) + quadratic * sum(s**2) +
    per_sequence * len(s)`` over its runtime lengths ``s`` (see `row_runtime_lengths`); a pack without
    sequences costs 0.

    Args:
        model: a `CostModel`, a preset name or a saved model's path (`CostModel.resolve`).

    >>> model = CostModel(linear=1.0, quadratic=1.0, per_sequence=10.0, unit="seconds")
    >>> row_pack_costs(np.array([0, 10, 16]), np.array([0, 4, 0]), np.array([0, 2, 3]), model).tolist()
    [62.0, 40.0]
    """
    model = CostModel.resolve(model)
    lengths, packs = row_runtime_lengths(row_offsets, seq_start_id, seq_offsets)
    rows = len(np.asarray(row_offsets)) - 1
    return np.bincount(packs, weights=model.sequence_costs(lengths), minlength=rows).astype(
        np.float64, copy=False
    )


def _offsets(offsets, name: str, total: int | None) -> np.ndarray:
    """``offsets`` as int64 ``[rows + 1]``, checked: starts at 0, never decreases, ends at ``total``."""
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or len(offsets) == 0 or not np.issubdtype(offsets.dtype, np.integer):
        raise TightpackError(
            f"{name} must be a non-empty 1-D integer array [rows + 1], got shape {offsets.shape} "
            f"dtype {offsets.dtype}"
        )
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0 or (np.diff(offsets) < 0).any() or (total is not None and offsets[-1] != total):
        expected = "" if total is None else f" and end at {total}"
        raise TightpackError(
            f"{name} must start at 0, never decrease{expected}; got {offsets[0]}..{offsets[-1]}"
        )
    return offsets
