"""Hugging Face transformers on packed rows: the keyword arguments, and a forward pass that is safe.

transformers (5.x) finds the sequences of a packed row from ``position_ids`` (a new sequence wherever
they do not increase by one) and builds a block-diagonal causal mask for eager, sdpa and flex
attention, but ONLY when no 2-D ``attention_mask`` is passed and no cache is used. ``use_cache``
defaults to True even in training, and then attention silently crosses sequences (losses off by up to
0.2, no error). `packed_forward` always passes ``use_cache=False`` and refuses a 2-D mask.
Flash-attention kernels read ``cu_seq_lens_q/k`` and ``max_length_q/k`` instead (the names of
transformers' flattening collator); the others accept and ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import thd

__all__ = ["hf_packed_kwargs", "packed_forward"]


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


def packed_forward(model: torch.nn.Module, batch: Mapping[str, Any], **kwargs: Any):
    """Forward a transformers causal LM on one packed row without attention crossing sequences.

    Raises:
        TightpackError: for ``use_cache=True`` or a 2-D ``attention_mask``: with either, transformers
            attends across the packed sequences without any error.
    """
    if kwargs.pop("use_cache", False):
        raise TightpackError("use_cache=True on a packed row makes attention cross sequences; drop it")
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        raise TightpackError(
            "a 2-D attention_mask on a packed row makes transformers ignore the sequence boundaries; "
            "pass none (position_ids carry the boundaries) or a 4-D block-diagonal mask"
        )
    packed = hf_packed_kwargs(batch)
    packed.pop("seq_idx")  # for state-space layers; attention-only models do not take it
    return model(**packed, use_cache=False, **kwargs)
