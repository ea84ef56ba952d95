"""Packed-row helpers for vision-language models (docs/contract.md §4.5).

- `moe_padding_mask`: which tokens of a packed row are alignment padding, from the logical and
  physical boundaries, for MoE router statistics (aux loss, z-loss, expert bias).
- `unpack_for_position_ids` / `repack_position_ids`: multimodal rotary positions (3 axes, as Qwen-VL)
  are computed per sequence; these move a packed row's tokens into one padded row per sequence and
  the positions computed there back into the packed layout, alignment gaps at 0.
- `expand_placeholders`, `pack_vlm_samples`: vision-language samples packed into one THD row, their
  visual tensors concatenated in member order (docs/contract.md §4.3), with the multimodal positions
  of `tightpack.runtime.mrope`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tightpack.runtime import thd
from tightpack.runtime.in_batch import VISUAL_KEYS, _ranks, pack_samples
from tightpack.runtime.mrope import QwenVLRope, qwen_vl_positions

__all__ = ["pack_vlm_samples"]


def _boundaries(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logical, physical = cu_seqlens.reshape(-1).long(), cu_seqlens_padded.reshape(-1).long()
    if (
        (cu_seqlens.dim() > 1 and cu_seqlens.shape[0] != 1)
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


def visual_token_counts(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Language-model tokens of each image or video: ``t * h * w / merge_size**2`` (int64 ``[n]``)."""
    grid_thw = torch.as_tensor(grid_thw).reshape(-1, 3).long()
    return grid_thw.prod(dim=1) // (merge_size * merge_size)


def expand_placeholders(
    ids: torch.Tensor, grid_thw: torch.Tensor, placeholder_id: int, merge_size: int
) -> torch.Tensor:
    """Replace the k-th ``placeholder_id`` token of ``ids`` by as many copies as image k has visual tokens.

    >>> expand_placeholders(torch.tensor([1, 9, 2]), torch.tensor([[1, 4, 6]]), 9, 2).tolist()
    [1, 9, 9, 9, 9, 9, 9, 2]
    """
    counts = visual_token_counts(grid_thw, merge_size)
    where = ids == placeholder_id
    if int(where.sum()) != len(counts):
        raise ValueError(f"{int(where.sum())} placeholder tokens for {len(counts)} images or videos")
    repeats = torch.ones_like(ids)
    repeats[where] = counts
    return torch.repeat_interleave(ids, repeats)


def pack_vlm_samples(
    samples: list[dict[str, Any]],
    rope: QwenVLRope,
    *,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    sequence_length: int | None = None,
    pad_to_max_length: bool = False,
) -> dict[str, Any]:
    """Pack Qwen-VL samples into one THD row (docs/contract.md §4.3).

    Each sample has expanded ``input_ids`` (see `expand_placeholders`), optional ``labels`` and
    ``loss_mask``, and its visual tensors (``pixel_values`` ``[patches, D]``, ``image_grid_thw``
    ``[images, 3]``, the video equivalents, ``second_per_grid_ts`` ``[videos]``). The batch holds the
    packed text keys and boundaries of `build_thd_from_rows`, ``mrope_position_ids`` ``[3, 1, T]``
    (`qwen_vl_positions`, restarting at every sample, alignment gaps at 0), and every visual key
    concatenated along dim 0 in member order. ``second_per_grid_ts`` is 1.0 for the videos of a sample
    that has none, as transformers assumes, so it stays aligned with ``video_grid_thw``.

    >>> rope = QwenVLRope("qwen2_vl", image_token_id=9, rule="spatial_extent")
    >>> image = {"input_ids": torch.tensor([5, 9, 9, 9, 9]), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    >>> batch = pack_vlm_samples([{"input_ids": torch.tensor([3, 4])}, image], rope, pad_to_multiple_of=4)
    >>> batch["mrope_position_ids"][1].tolist()
    [[0, 1, 0, 0, 0, 1, 1, 2, 2, 0, 0, 0]]
    """
    batch = pack_samples(
        samples,
        sequence_length=sequence_length,
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_to_max_length=pad_to_max_length,
    )
    return add_vision(batch, samples, rope)


def add_vision(
    batch: dict[str, Any], visuals: Sequence[Mapping[str, Any]], rope: QwenVLRope
) -> dict[str, Any]:
    """Add the visual tensors of the members (``visuals``, one mapping per sequence, in order) and
    the multimodal positions of a packed THD row, in place; returns ``batch``.

    The positions come from the row's own tokens: each sequence's real tokens (logical lengths, at
    the physical starts), so this serves any builder of THD rows (`pack_samples`, the offline packs'
    `tightpack.runtime.collate.PackedCollate`).
    """
    for key in VISUAL_KEYS:
        present = [visual[key] for visual in visuals if visual.get(key) is not None]
        if present:
            batch[key] = torch.cat([torch.as_tensor(value) for value in present], dim=0)
    seconds = _seconds_per_grid(visuals)
    if seconds is not None:
        batch["second_per_grid_ts"] = torch.as_tensor(
            seconds, dtype=None if torch.is_tensor(seconds) else torch.float32
        )
    tokens = thd.token_tensor(batch).reshape(-1)
    lengths = thd.logical_boundaries(batch).reshape(-1).long().diff()
    starts = thd.physical_boundaries(batch).reshape(-1).long()[:-1]
    if len(lengths) != len(visuals):
        raise ValueError(f"{len(visuals)} visual entries for a row of {len(lengths)} sequences")
    # Empty segments (an aligned row's width padding, static-shape boundaries) hold no tokens to place.
    filled = lengths > 0
    if any(_has_visuals(visual) for visual, keep in zip(visuals, filled.tolist(), strict=True) if not keep):
        raise ValueError("an empty sequence of the packed row has visual tensors")
    lengths, starts = lengths[filled], starts[filled]
    real = torch.repeat_interleave(starts, lengths) + _ranks(lengths)
    positions = qwen_vl_positions(
        tokens[real],
        rope,
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        second_per_grid_ts=seconds,
        lengths=lengths,
    )
    mrope = torch.zeros(3, 1, len(tokens), dtype=torch.long)
    mrope[:, 0, real] = positions
    batch["mrope_position_ids"] = mrope
    thd.check_thd_batch(batch)
    return batch


def _has_visuals(visual: Mapping[str, Any]) -> bool:
    return any(visual.get(key) is not None for key in VISUAL_KEYS)


def _seconds_per_grid(visuals: Sequence[Mapping[str, Any]]) -> torch.Tensor | list[float] | None:
    """The members' ``second_per_grid_ts`` in stream order (1.0 for the videos of a member without),
    in the form transformers scales positions in for each member alone: one float tensor dtype
    (bf16 and f16 too) is kept, Python numbers stay a list; mixed forms become one float32 tensor."""
    given = [visual.get("second_per_grid_ts") for visual in visuals]
    present = [value for value in given if value is not None]
    if not present:
        return None
    videos = [len(_grid_rows(visual.get("video_grid_thw"))) for visual in visuals]
    dtypes = {
        value.dtype if torch.is_tensor(value) and value.is_floating_point() else None for value in present
    }
    if len(dtypes) == 1 and None not in dtypes:
        (dtype,) = dtypes
        return torch.cat(
            [
                torch.ones(count, dtype=dtype) if value is None else value.reshape(-1)
                for value, count in zip(given, videos, strict=True)
            ]
        )
    if not any(torch.is_tensor(value) for value in present):
        return [
            float(second)
            for value, count in zip(given, videos, strict=True)
            for second in (
                [1.0] * count
                if value is None
                else torch.as_tensor(value, dtype=torch.float64).reshape(-1).tolist()
            )
        ]
    return torch.cat(
        [
            torch.ones(count) if value is None else torch.as_tensor(value, dtype=torch.float32).reshape(-1)
            for value, count in zip(given, videos, strict=True)
        ]
    )


def _grid_rows(grid_thw: Any) -> torch.Tensor:
    return torch.zeros(0, 3) if grid_thw is None else torch.as_tensor(grid_thw).reshape(-1, 3)
