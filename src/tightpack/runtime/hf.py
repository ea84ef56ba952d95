"""Hugging Face transformers on packed rows: the keyword arguments, and a forward pass that is safe.

transformers (5.x) finds the sequences of a packed row from ``position_ids`` (a new sequence wherever
they do not increase by one) and builds a block-diagonal causal mask for eager, sdpa and flex
attention, but ONLY when no 2-D ``attention_mask`` is passed and no cache is used. ``use_cache``
defaults to True even in training, and then attention silently crosses sequences (losses off by up to
0.2, no error). `packed_forward` always passes ``use_cache=False`` and refuses a 2-D mask.
Flash-attention kernels read ``cu_seq_lens_q/k`` and ``max_length_q/k`` instead (the names of
transformers' flattening collator); the others accept and ignore them.

Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) take ``position_ids`` of shape ``[4, B, L]``: row 0
the text position restarting at every sequence, from which transformers finds the sequences, and
rows 1-3 the multimodal positions. With the usual ``[3, B, L]`` no packed mask is built and attention
crosses sequences. `packed_forward` builds the four rows from a batch of
`tightpack.runtime.vlm.pack_vlm_samples` and passes the visual tensors; it does not pass the
``cu_seq_lens`` keywords to them, which would also reach the vision tower's attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import thd
from tightpack.runtime.mrope import transformers_version

__all__ = ["PACKED_ATTENTION", "check_packable", "hf_packed_kwargs", "hf_packed_vlm_kwargs", "packed_forward"]

# attention implementations that keep packed sequences apart when given positions and no 2-D mask:
# eager, sdpa and flex build a block-diagonal mask from the positions, the flash kernels take the
# boundaries from the positions (or from ``cu_seq_lens``)
PACKED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
# Qwen-VL model types -> the first transformers release that reads row 0 of [4, B, L] positions
_QWEN_VL_SINCE = {"qwen2_vl": (4, 54), "qwen2_5_vl": (4, 54), "qwen3_vl": (4, 57), "qwen3_vl_moe": (4, 57)}
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


def check_packable(model: torch.nn.Module, vlm: bool = False) -> None:
    """Refuse a model that would attend across packed sequences: an attention implementation outside
    `PACKED_ATTENTION`, a Qwen-VL model without multimodal positions (``vlm=False``), multimodal
    positions for another model or on a transformers release that cannot pack it (``vlm=True``).

    Raises:
        TightpackError: naming the problem and the fix.
    """
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    attention = getattr(text_config, "_attn_implementation", None)
    if attention is not None and attention not in PACKED_ATTENTION:
        raise TightpackError(
            f"attention implementation {attention!r} does not keep packed sequences apart; load the model "
            f"with attn_implementation= one of {', '.join(PACKED_ATTENTION)}"
        )
    model_type = getattr(config, "model_type", None)
    if not vlm:
        if model_type in _QWEN_VL_SINCE:
            raise TightpackError(
                f"{model_type} needs multimodal positions on a packed row; pack with "
                "tightpack.runtime.vlm.pack_vlm_samples(samples, QwenVLRope.from_config(model.config)) and "
                "run it with tightpack.runtime.hf.packed_forward"
            )
        return
    if model_type not in _QWEN_VL_SINCE:
        raise TightpackError(
            f"the batch holds multimodal positions, which only Qwen-VL models ({', '.join(_QWEN_VL_SINCE)}) "
            f"take; this model is {model_type!r}"
        )
    installed = transformers_version() or (0, 0)
    if installed < _QWEN_VL_SINCE[model_type]:
        since = ".".join(map(str, _QWEN_VL_SINCE[model_type]))
        raise TightpackError(
            f"transformers {'.'.join(map(str, installed))} does not find packed sequences in {model_type}'s "
            f"positions, so attention would cross them; upgrade to transformers>={since}"
        )


def packed_forward(model: torch.nn.Module, batch: Mapping[str, Any], **kwargs: Any):
    """Forward a transformers causal LM (or a Qwen-VL model) on one packed row without attention
    crossing sequences.

    A batch with ``mrope_position_ids`` (from `tightpack.runtime.vlm.pack_vlm_samples`) goes to a
    Qwen-VL model with `hf_packed_vlm_kwargs`; other batches go with `hf_packed_kwargs`.

    Raises:
        TightpackError: for ``use_cache=True`` or a 2-D ``attention_mask`` (with either, transformers
            attends across the packed sequences without any error), an attention implementation
            outside `PACKED_ATTENTION`, a Qwen-VL model without multimodal positions (or positions
            for another model), or a transformers release that cannot pack that Qwen-VL model.
    """
    if kwargs.pop("use_cache", False):
        raise TightpackError("use_cache=True on a packed row makes attention cross sequences; drop it")
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        raise TightpackError(
            "a 2-D attention_mask on a packed row makes transformers ignore the sequence boundaries; "
            "pass none (position_ids carry the boundaries) or a 4-D block-diagonal mask"
        )
    vlm = batch.get("mrope_position_ids") is not None
    check_packable(model, vlm)
    if vlm:
        return model(**hf_packed_vlm_kwargs(batch), use_cache=False, **kwargs)
    packed = hf_packed_kwargs(batch)
    packed.pop("seq_idx")  # for state-space layers; attention-only models do not take it
    return model(**packed, use_cache=False, **kwargs)
