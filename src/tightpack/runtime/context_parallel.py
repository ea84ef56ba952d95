"""Context parallelism for THD batches (docs/contract.md §6).

- `thd_partition_indices`: Transformer Engine's per-document zigzag in pure torch. With ``W`` ranks,
  every physical segment is cut into ``2W`` equal chunks and rank ``r`` keeps chunks ``r`` and
  ``2W-1-r`` of each segment, in order, so every rank holds ``T/W`` tokens and the same share of
  each document's causal work.
- `slice_for_cp_rank`: one rank's share of a batch. Packed rows use the per-document zigzag;
  unpacked ``[B, S]`` batches the per-sequence zigzag of Megatron-Core's ``get_batch_on_this_cp_rank``.
  Every sequence-aligned tensor is sliced with the same indices; boundaries stay global, as
  Transformer Engine's context-parallel attention expects.
- `cp_attention`: a reference context-parallel attention for CPU runs: keys and values are gathered
  over the group and the document-causal mask is applied in global positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tightpack.errors import TightpackError
from tightpack.runtime import thd
from tightpack.runtime.in_batch import VISUAL_KEYS, _ranks
from tightpack.runtime.masks import document_ids

__all__ = ["cp_attention", "slice_for_cp_rank", "thd_partition_indices"]

_SEQUENCE_DIM = {"attention_mask": 2, "mrope_position_ids": 2}


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise TightpackError(f"context-parallel rank {cp_rank} is not in [0, cp_size={cp_size})")


def thd_partition_indices(
    boundaries: torch.Tensor, cp_size: int, cp_rank: int, *, total_tokens: int | None = None
) -> torch.Tensor:
    """Row positions held by context-parallel rank ``cp_rank``, int64 ``[T / cp_size]``.

    Args:
        boundaries: physical segment boundaries of one row, 1-D int32 ``[K + 1]``, from 0 to the row
            width; every segment length must be a multiple of ``2 * cp_size``.
        total_tokens: the row width, when known: it must equal the last boundary.

    >>> thd_partition_indices(torch.tensor([0, 8, 16], dtype=torch.int32), 2, 0).tolist()
    [0, 1, 6, 7, 8, 9, 14, 15]
    >>> thd_partition_indices(torch.tensor([0, 8, 16], dtype=torch.int32), 2, 1).tolist()
    [2, 3, 4, 5, 10, 11, 12, 13]
    """
    _check_rank(cp_size, cp_rank)
    if boundaries.dim() != 1 or len(boundaries) < 2:
        raise TightpackError(
            f"boundaries of shape {tuple(boundaries.shape)}: context-parallel slicing takes one packed row "
            "(1-D, at least [0, width]); use micro-batch size 1 with packed sequences"
        )
    if boundaries.dtype != torch.int32:
        raise TightpackError(
            f"boundaries must be int32, as Transformer Engine reads them; got {boundaries.dtype}"
        )
    cu = boundaries.long()
    lengths = cu.diff()
    width = int(cu[-1])
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise TightpackError(f"boundaries must start at 0 and never decrease, got {boundaries.tolist()}")
    if total_tokens is not None and total_tokens != width:
        raise TightpackError(
            f"the row has {total_tokens} tokens but its boundaries end at {width}: the last boundary must be "
            "the row width (pack with pad_to_max_length, or append the width as the last boundary)"
        )
    chunks = 2 * cp_size
    uneven = torch.nonzero(lengths % chunks)
    if len(uneven) or width == 0:
        where = (
            f"segment {int(uneven[0, 0])} has {int(lengths[uneven[0, 0]])} tokens"
            if len(uneven)
            else "the row is empty"
        )
        raise TightpackError(
            f"{where}; with context parallel size {cp_size} every segment must be a non-empty multiple of "
            f"2 * cp_size = {chunks}: pack with pad_to_multiple_of={chunks} (or the CP/SP multiple)"
        )
    if cp_size == 1:
        return torch.arange(width, device=boundaries.device)
    half = lengths // chunks
    starts = cu[:-1]
    run_starts = torch.stack([starts + cp_rank * half, starts + (chunks - 1 - cp_rank) * half], 1).flatten()
    run_lengths = torch.stack([half, half], 1).flatten()
    return torch.repeat_interleave(run_starts, run_lengths) + _ranks(run_lengths)


def slice_for_cp_rank(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """Rank ``cp_rank``'s share of ``batch`` along the sequence, boundaries left global.

    Packed batches (``cu_seqlens_q`` / ``cu_seqlens_q_padded`` or legacy ``cu_seqlens``) must hold one
    physical row whose segments are multiples of ``2 * cp_size``; unpacked ``[B, S]`` batches need
    ``S`` divisible by ``2 * cp_size``. Sliced: every tensor whose sequence dimension (dim 1; dim 2 for
    a 4-D ``attention_mask`` and ``mrope_position_ids``) has the row's width: tokens, labels, loss_mask,
    position_ids, padding_mask, multimodal positions. Boundaries, ``max_seqlen*``, ``total_tokens``,
    visual tensors and other metadata pass through; a packed batch's ``attention_mask`` too.

    >>> cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    >>> batch = {"input_ids": torch.arange(8)[None], "cu_seqlens_q": cu}
    >>> shard = slice_for_cp_rank(batch, 2, 1)
    >>> shard["input_ids"].tolist(), shard["cu_seqlens_q"].tolist()
    ([[1, 2, 5, 6]], [0, 4, 8])
    """
    _check_rank(cp_size, cp_rank)
    thd.check_block_diagonal(batch, "context-parallel slicing (ring attention over cu_seqlens)")
    if cp_size == 1:
        return dict(batch)
    tokens = thd.token_tensor(batch)
    if tokens is None:
        raise TightpackError("the batch has no token tensor to slice: expected 'tokens' or 'input_ids'")
    width = tokens.shape[1]
    packed = thd.is_packed(batch)
    if packed:
        thd.check_thd_batch(batch)
        if tokens.shape[0] != 1:
            raise TightpackError(
                f"packed THD batches hold one row for context-parallel slicing, got {tokens.shape[0]}: use "
                "micro-batch size 1"
            )
        index = thd_partition_indices(thd.physical_boundaries(batch), cp_size, cp_rank, total_tokens=width)
    else:
        if width % (2 * cp_size):
            raise TightpackError(
                f"sequence length {width} is not divisible by 2 * cp_size = {2 * cp_size}: pad the batch "
                f"to a multiple of {2 * cp_size}"
            )
        whole = torch.tensor([0, width], dtype=torch.int32)
        index = thd_partition_indices(whole, cp_size, cp_rank).to(tokens.device)
    skip = {key for key in batch if key.startswith(thd.METADATA_PREFIXES)} | set(VISUAL_KEYS)
    if packed:
        skip.add("attention_mask")
    shard = dict(batch)
    for key, value in batch.items():
        if key in skip or not isinstance(value, torch.Tensor):
            continue
        # A 4-D attention mask [B, 1, S, S] is cut along its query rows; a 2-D one [B, S] along S.
        dim = 1 if key == "attention_mask" and value.dim() == 2 else _SEQUENCE_DIM.get(key, 1)
        if value.dim() <= dim:
            continue
        if value.shape[dim] == width:
            shard[key] = value.index_select(dim, index.to(value.device))
    return shard


class _GatherTokens(torch.autograd.Function):
    """All-gather along a new leading dim; the backward sums every rank's gradient for this shard."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    index: torch.Tensor,
    boundaries: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Document-causal attention for one context-parallel shard (a reference, for CPU tests).

    Args:
        q: this rank's shard of the queries, ``[heads, n, dim]`` with ``n = T / cp_size``.
        k: the keys of the same shard, ``[heads, n, dim]``.
        v: the values of the same shard, ``[heads, n, dim]``.
        index: global row positions of the shard's tokens (`thd_partition_indices`).
        boundaries: the row's physical boundaries (global), 1-D.
        group: the context-parallel group (default: the whole world).

    Returns ``[heads, n, dim]``: each query attends to the earlier positions of its own segment
    across all ranks. Gradients flow back to every rank's keys and values.
    """
    keys = _GatherTokens.apply(k.transpose(0, 1), group)  # [W, n, heads, dim]
    values = _GatherTokens.apply(v.transpose(0, 1), group)
    positions = [torch.empty_like(index) for _ in range(dist.get_world_size(group))]
    dist.all_gather(positions, index.contiguous(), group=group)
    order = torch.cat(positions)
    keys = keys.flatten(0, 1)[order.argsort()].transpose(0, 1)  # [heads, T, dim], global order
    values = values.flatten(0, 1)[order.argsort()].transpose(0, 1)
    documents = document_ids({"cu_seqlens_q": boundaries})
    allowed = (documents[index][:, None] == documents[None, :]) & (
        torch.arange(len(documents), device=documents.device)[None, :] <= index[:, None]
    )
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
