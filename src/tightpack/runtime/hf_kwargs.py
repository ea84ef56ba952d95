"""The keyword arguments a Hugging Face model takes for one packed row of a THD batch.

`hf_packed_kwargs` gives a causal LM its ``input_ids``, ``position_ids`` restarting per sequence,
the flash-attention ``cu_seq_lens_q/k`` and ``max_length_q/k``, and ``seq_idx`` (the segment of
every token, which transformers' state-space and convolution layers read to keep sequences apart).
`hf_packed_vlm_kwargs` gives a Qwen-VL model its ``[4, 1, T]`` positions and visual tensors.
`model_kwargs` is what `tightpack.runtime.hf.packed_forward` passes: one of them, cut to what the
model's ``forward`` accepts. The forward itself and its guards live in `tightpack.runtime.hf`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import thd

__all__ = ["hf_packed_kwargs"]

_VISUAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def hf_packed_kwargs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Model keyword arguments for one packed row of a THD batch (either layout or key schema).

    Sequences are the physical segments (`tightpack.runtime.thd.physical_boundaries`): alignment
    padding belongs to the sequence it follows and, being causal, never changes that sequence's outputs.

    >>> import torch
    >>> batch = {"tokens": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.tensor([[0, 1, 0, 1]]),
    ...          "cu_seqlens_q": torch.tensor([[0, 2, 4]], dtype=torch.int32)}
    >>> kwargs = hf_packed_kwargs(batch)
    >>> kwargs["cu_seq_lens_q"].tolist(), kwargs["max_length_q"], kwargs["seq_idx"].tolist()
    ([0, 2, 4], 2, [[0, 0, 1, 1]])
    """
    thd.check_thd_batch(batch)
    thd.check_block_diagonal(batch, "hf_packed_kwargs (transformers' packed positions and cu_seq_lens)")
    tokens = thd.token_tensor(batch)
    if tokens is None or tokens.dim() != 2 or tokens.shape[0] != 1:
        shape = None if tokens is None else tuple(tokens.shape)
        raise TightpackError(f"expects one packed row ([1, T] tokens), got shape {shape}")
    bounds = thd.physical_boundaries(batch)
    lengths = bounds.diff()
    max_length = int(lengths.max())
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths.long())[None]
    return {
        "input_ids": tokens,
        "position_ids": batch["position_ids"],
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": max_length,
        "max_length_k": max_length,
        "seq_idx": seq_idx,
    }


def hf_packed_vlm_kwargs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen-VL keyword arguments for one packed row of `tightpack.runtime.vlm.pack_vlm_samples`.

    ``position_ids`` is ``[4, 1, T]``: the text positions, then ``mrope_position_ids``. The visual
    tensors the batch holds come along; ``second_per_grid_ts`` does not, as its only use is the
    positions, which are given.
    """
    thd.check_thd_batch(batch)
    mrope = batch.get("mrope_position_ids")
    if not isinstance(mrope, torch.Tensor):
        raise TightpackError(
            "a packed Qwen-VL batch needs mrope_position_ids; build it with "
            "tightpack.runtime.vlm.pack_vlm_samples(samples, QwenVLRope.from_config(model.config))"
        )
    tokens = thd.token_tensor(batch)
    text = batch["position_ids"].to(mrope.dtype)
    kwargs = {"input_ids": tokens, "position_ids": torch.cat([text[None], mrope], dim=0)}
    return kwargs | {key: batch[key] for key in _VISUAL_INPUTS if batch.get(key) is not None}


def _accepts(model: torch.nn.Module, key: str) -> bool:
    """Whether ``model.forward`` takes ``key`` (by name or through ``**kwargs``)."""
    parameters = inspect.signature(model.forward).parameters
    return key in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def model_kwargs(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """What `tightpack.runtime.hf.packed_forward` passes ``model`` for ``batch``: `hf_packed_vlm_kwargs`
    for a batch with ``mrope_position_ids``, else `hf_packed_kwargs`, without the boundary keys its
    ``forward`` does not take (a forward with ``**kwargs`` takes them all, so a layer that can refuse
    a packed row does)."""
    if batch.get("mrope_position_ids") is not None:
        return hf_packed_vlm_kwargs(batch)
    return {key: value for key, value in hf_packed_kwargs(batch).items() if _accepts(model, key)}
