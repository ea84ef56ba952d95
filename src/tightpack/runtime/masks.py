"""Attention masks for one packed row, for backends without variable-length kernels.

Every mask is block-diagonal causal over the row's physical segments
(`tightpack.runtime.thd.physical_boundaries`, either layout or key schema): a token attends to the
earlier tokens of its own segment only.
Alignment padding stays inside its segment, after the real tokens, so it never changes them.
A shared-prefix preference row (``branch_ids``, `tightpack.runtime.preference_batch`) narrows this
further: within a segment, a token of a branch attends to the shared prompt and to its own branch,
never to a sibling branch.

- `sdpa_mask`: boolean ``[1, 1, T, T]``, True where attention is allowed (``torch.nn.functional
  .scaled_dot_product_attention`` and transformers' sdpa path).
- `additive_mask`: float ``[1, 1, T, T]``, 0 where allowed and the dtype's minimum elsewhere (eager
  attention adds it to the scores; a boolean mask there would be wrong).
- `flex_block_mask`: a FlexAttention ``BlockMask`` built from the document ids, never as a dense matrix.
- `flash_varlen_attention`: ``flash_attn_varlen_func`` with the row's boundaries (CUDA, optional).

Dense masks cost T*T memory; use them for short rows or tests, and varlen kernels or Flex otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import thd

__all__ = ["additive_mask", "document_ids", "flash_varlen_attention", "flex_block_mask", "sdpa_mask"]


def document_ids(batch: Mapping[str, Any]) -> torch.Tensor:
    """Segment index of every token of the row, int64 ``[T]``.

    >>> document_ids({"cu_seqlens_q": torch.tensor([[0, 2, 5]], dtype=torch.int32)}).tolist()
    [0, 0, 1, 1, 1]
    """
    thd.check_thd_batch(batch)
    bounds = thd.physical_boundaries(batch).long()
    return torch.repeat_interleave(torch.arange(len(bounds) - 1, device=bounds.device), bounds.diff())


def _branches(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The branch of every token ``[T]`` (-1: shared prompt) of a shared-prefix row, else None."""
    branches = batch.get("branch_ids")
    return None if branches is None else branches.reshape(-1).long()


def _window(batch: Mapping[str, Any], sliding_window: int | None) -> torch.Tensor | None:
    """The positions of the row ``[T]`` when a sliding window applies (distances are position distances)."""
    if sliding_window is None:
        return None
    if sliding_window < 1:
        raise TightpackError(f"sliding_window must be >= 1, got {sliding_window}")
    return batch["position_ids"].reshape(-1).long()


def sdpa_mask(batch: Mapping[str, Any], sliding_window: int | None = None) -> torch.Tensor:
    """Boolean block-diagonal causal mask ``[1, 1, T, T]``, True = may attend; with ``branch_ids``, a
    branch's tokens see the shared prompt and their own branch only; with ``sliding_window`` ``w``, a
    token sees the last ``w`` positions only (transformers' rule: ``position(q) - position(k) < w``).

    >>> sdpa_mask({"cu_seqlens_q": torch.tensor([[0, 2, 3]], dtype=torch.int32)})[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    >>> from tightpack.core.preference_units import PreferenceUnits
    >>> from tightpack.runtime.preference_batch import build_preference_row
    >>> shared = build_preference_row(PreferenceUnits.from_lists([[5, 6]], [[7], [8]], [2]), "shared-prefix")
    >>> shared["branch_ids"].tolist(), sdpa_mask(shared)[0, 0, 3:].int().tolist()  # branch 1's tokens
    ([[-1, 0, 0, 1, 1]], [[1, 0, 0, 1, 0], [1, 0, 0, 1, 1]])
    """
    documents = document_ids(batch)
    allowed = documents[:, None] == documents[None, :]
    branches = _branches(batch)
    if branches is not None:
        allowed &= (branches[None, :] == -1) | (branches[None, :] == branches[:, None])
    positions = _window(batch, sliding_window)
    if positions is not None:
        allowed &= (positions[:, None] - positions[None, :]) < sliding_window
    return torch.tril(allowed)[None, None]


def additive_mask(
    batch: Mapping[str, Any], dtype: torch.dtype = torch.float32, sliding_window: int | None = None
) -> torch.Tensor:
    """Float block-diagonal causal mask ``[1, 1, T, T]``: 0 where allowed, ``finfo(dtype).min`` elsewhere
    (`sdpa_mask`'s rule)."""
    allowed = sdpa_mask(batch, sliding_window)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def flex_block_mask(
    batch: Mapping[str, Any], device: str | torch.device = "cpu", sliding_window: int | None = None
):
    """A FlexAttention ``BlockMask`` for the row (`sdpa_mask`'s rule: document, causal, the
    shared-prefix branches, the sliding window), built without a dense matrix."""
    from torch.nn.attention.flex_attention import create_block_mask

    documents = document_ids(batch).to(device)
    total = len(documents)
    branches = _branches(batch)

    def document_causal(batch_index, head, query, key):
        return (documents[query] == documents[key]) & (key <= query)

    mask_mod = document_causal
    if branches is not None:
        branches = branches.to(device)

        def mask_mod(batch_index, head, query, key):
            own = (branches[key] == -1) | (branches[key] == branches[query])
            return document_causal(batch_index, head, query, key) & own

    positions = _window(batch, sliding_window)
    if positions is not None:
        positions = positions.to(device)
        unwindowed = mask_mod

        def mask_mod(batch_index, head, query, key):
            near = positions[query] - positions[key] < sliding_window
            return unwindowed(batch_index, head, query, key) & near

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)


def flash_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Mapping[str, Any], **kwargs
):
    """``flash_attn_varlen_func`` over the row's segments; ``q``, ``k``, ``v`` are ``[T, heads, dim]``.

    Raises:
        ThdBatchError: a shared-prefix preference row, which its boundaries cannot express.
        TightpackError: when flash-attn is not installed.
    """
    thd.check_thd_batch(batch)
    thd.check_block_diagonal(batch, "flash_varlen_attention")
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as error:
        raise TightpackError(
            "flash_varlen_attention needs the flash-attn package (CUDA): pip install flash-attn"
        ) from error
    bounds = thd.physical_boundaries(batch).to(device=q.device)
    longest = int(bounds.diff().max())
    return flash_attn_varlen_func(q, k, v, bounds, bounds, longest, longest, causal=True, **kwargs)
