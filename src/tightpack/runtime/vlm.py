"""Packed-row helpers for vision-language models (contract section 4.5).

- `moe_padding_mask`: which tokens of a packed row are alignment padding, from the logical and
  physical boundaries, for MoE router statistics (aux loss, z-loss, expert bias).
- `unpack_for_position_ids` / `repack_position_ids`: multimodal rotary positions (3 axes, as Qwen-VL)
  are computed per sequence; these move a packed row's tokens into one padded row per sequence and
  the positions computed there back into the packed layout, alignment gaps at 0.
"""

from __future__ import annotations

import torch

__all__ = ["moe_padding_mask", "repack_position_ids", "unpack_for_position_ids"]


def _boundaries(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logical, physical = cu_seqlens.reshape(-1).long(), cu_seqlens_padded.reshape(-1).long()
    if (
        (cu_seqlens.dim() > 1
        and cu_seqlens.shape[0] != 1)
        or logical.shape != physical.shape
        or len(logical) < 2
    ):
        raise ValueError("Packed MoE padding requires matching 1D query cu_seqlens metadata.")
    return logical, physical


def moe_padding_mask(
    cu_seqlens_q: torch.Tensor, cu_seqlens_q_padded: torch.Tensor | None, total_tokens: int
) -> torch.Tensor | None:
    """Boolean ``[1, T]``, True on alignment padding and past the last physical boundary; None when
    the row has no padding.

    >>> moe_padding_mask(torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8]), 8).tolist()
    [[False, False, False, True, False, False, True, True]]
    """
    if cu_seqlens_q_padded is None:
        return None
    logical, physical = _boundaries(cu_seqlens_q, cu_seqlens_q_padded)
    lengths, spans = logical.diff(), physical.diff()
    if (
        bool((lengths <= 0).any())
        or bool((spans < lengths).any())
        or int(logical[0]) != 0
        or int(physical[0]) != 0
        or int(physical[-1]) > total_tokens
    ):
        raise ValueError("Packed MoE padding found invalid logical or physical query boundaries.")
    if torch.equal(lengths, spans) and int(physical[-1]) == total_tokens:
        return None
    offsets = torch.arange(total_tokens, device=physical.device)
    segment = torch.searchsorted(physical[1:], offsets, right=True).clamp(max=len(lengths) - 1)
    real = (offsets - physical[segment]) < lengths[segment]
    real &= offsets < physical[-1]
    return (~real)[None]


def unpack_for_position_ids(
    tensor: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_q_padded: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed ``[1, T]`` row as one right-padded row per sequence.

    Returns ``rows [N, longest]``, ``mask [N, longest]`` (True on real tokens), the physical start of
    every sequence ``[N]`` and its real length ``[N]``.

    >>> rows, mask, starts, lengths = unpack_for_position_ids(
    ...     torch.tensor([[5, 6, 7, 0, 8, 9, 0, 0]]), torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8]))
    >>> rows.tolist(), starts.tolist(), lengths.tolist()
    ([[5, 6, 7], [8, 9, 0]], [0, 4], [3, 2])
    """
    if tensor.dim() != 2 or tensor.shape[0] != 1:
        raise ValueError(f"expects a packed row [1, T], got shape {tuple(tensor.shape)}")
    padded = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
    logical, physical = _boundaries(cu_seqlens_q, padded)
    lengths, starts = logical.diff(), physical[:-1]
    if bool((lengths <= 0).any()):
        raise ValueError(f"sequence lengths must be positive, got {lengths.tolist()}")
    if int(physical[-1]) > tensor.shape[1] or bool((physical.diff() < lengths).any()):
        raise ValueError(
            f"boundaries {physical.tolist()} do not fit a packed row of {tensor.shape[1]} tokens "
            "(or a segment is shorter than its sequence)"
        )
    longest = int(lengths.max())
    columns = torch.arange(longest, device=tensor.device)
    mask = columns[None] < lengths[:, None]
    index = (starts[:, None] + columns[None]).clamp(max=tensor.shape[1] - 1)
    rows = torch.where(mask, tensor[0][index], torch.zeros((), dtype=tensor.dtype, device=tensor.device))
    return rows, mask, starts, lengths


def repack_position_ids(
    positions: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, total_length: int
) -> torch.Tensor:
    """Per-sequence positions ``[axes, N, longest]`` back into the packed layout ``[axes, 1, T]``;
    tokens outside every sequence (alignment gaps, width padding) get position 0.

    >>> positions = torch.tensor([[[0, 1, 2], [0, 1, 0]]])
    >>> repack_position_ids(positions, torch.tensor([0, 4]), torch.tensor([3, 2]), 8).tolist()
    [[[0, 1, 2, 0, 0, 1, 0, 0]]]
    """
    if positions.dim() != 3 or positions.shape[1] != len(lengths) or len(starts) != len(lengths):
        raise ValueError(
            f"positions {tuple(positions.shape)} must be [axes, N, longest] for N = {len(lengths)} sequences"
        )
    if bool((lengths <= 0).any()) or int(lengths.max()) > positions.shape[2]:
        raise ValueError(
            f"sequence lengths {lengths.tolist()} must be positive and fit {positions.shape[2]} columns"
        )
    if int((starts + lengths).max()) > total_length:
        raise ValueError(f"sequences end past the packed row of {total_length} tokens")
    out = torch.zeros((positions.shape[0], 1, total_length), dtype=positions.dtype, device=positions.device)
    columns = torch.arange(positions.shape[2], device=positions.device)
    mask = columns[None] < lengths[:, None]
    target = (starts[:, None] + columns[None])[mask]
    out[:, 0, target] = positions[:, mask]
    return out
