"""A Hugging Face causal LM on one packed preference row: its keyword arguments and its per-branch
log-probabilities.

``pairs`` rows run as any packed row (`tightpack.runtime.hf_kwargs.hf_packed_kwargs`: positions
restarting per sequence, ``cu_seq_lens`` for flash-attention). ``shared-prefix`` rows need a mask
beyond block-diagonal, which transformers takes as a 4-D ``attention_mask``: an additive float mask
for ``eager`` and ``sdpa`` (dense, ``T x T``: for rows of a few thousand tokens), a FlexAttention
``BlockMask`` for ``flex_attention``. Flash-attention's varlen kernels read only boundaries and cannot
express it: a shared-prefix row with them is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import masks, thd
from tightpack.runtime.hf_kwargs import hf_packed_kwargs
from tightpack.runtime.preference_logps import BranchLogps, sequence_logps

__all__ = ["attention_masks", "config_attention_masks", "preference_logps", "preference_model_kwargs"]

_MASKED = ("eager", "sdpa")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def preference_model_kwargs(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``model`` takes for the preference row ``batch`` (``use_cache=False``:
    with a cache transformers would not find the packed sequences).

    Raises:
        TightpackError: a shared-prefix row for an attention implementation that cannot take its mask.
    """
    if batch.get("branch_ids") is None:
        return hf_packed_kwargs(batch) | {"use_cache": False}
    thd.check_thd_batch(batch)
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "attention_mask": attention_masks(model, batch),
        "use_cache": False,
    }


def attention_masks(model: torch.nn.Module, batch: Mapping[str, Any]) -> Any:
    """The ``attention_mask`` ``model`` takes for the row ``batch`` (`tightpack.runtime.masks`'s rule
    over its boundaries, ``branch_ids`` when present, and the model's sliding windows): an additive
    ``[1, 1, T, T]`` mask in the model's dtype for eager and sdpa, a ``BlockMask`` for flex attention,
    or ``{layer type: mask}`` for a model whose layers differ (``config.layer_types``).

    Raises:
        TightpackError: an attention implementation, or a layer type, that cannot take such a mask.
    """
    return config_attention_masks(getattr(model, "config", None), batch, dtype=_dtype(model))


def config_attention_masks(
    config: Any, batch: Mapping[str, Any], *, dtype: torch.dtype = torch.float32
) -> Any:
    """`attention_masks` for a model of ``config`` whose weights are ``dtype``, without the model (what
    a data collator holds), on the device of ``batch["position_ids"]``.

    Raises:
        TightpackError: an attention implementation, or a layer type, that cannot take such a mask.
    """
    text = _text_config(config)
    attention = getattr(text, "_attn_implementation", None) or "eager"
    device = batch["position_ids"].device
    if attention == "flex_attention":

        def make(window: int | None) -> Any:
            return masks.flex_block_mask(batch, device=device, sliding_window=window)

    elif attention in _MASKED:

        def make(window: int | None) -> Any:
            return masks.additive_mask(batch, dtype, sliding_window=window).to(device)

    else:
        raise TightpackError(
            f"a shared-prefix row needs a mask beyond block-diagonal, which attn_implementation "
            f"{attention!r} cannot take (its kernels read only sequence boundaries); load the model with "
            "attn_implementation='sdpa', 'eager' or 'flex_attention', or build the row with layout='pairs'"
        )
    return _layer_masks(text, make)


def _layer_masks(config: Any, make: Callable[[int | None], Any]) -> Any:
    """The mask for every kind of layer the model of ``config`` (its text config) has. A given mask
    replaces the ones transformers builds, sliding windows included, so the window is applied here:
    one mask for a model whose layers are all alike (a Mistral-style window on every layer), else
    ``{layer type: mask}``, which models with ``config.layer_types`` (Gemma 2 and 3, Qwen2 and 3, ...)
    take as given."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds:
        return make(window)
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        raise TightpackError(
            f"a shared-prefix row needs every layer to take its mask, and this model has {', '.join(other)} "
            "layers (chunked attention or state that runs along the row); build the row with layout='pairs'"
        )
    built = {kind: make(window if kind == "sliding_attention" else None) for kind in sorted(kinds)}
    return built if len(built) > 1 else next(iter(built.values()))


def preference_logps(model: torch.nn.Module, batch: Mapping[str, Any], **forward_kwargs: Any) -> BranchLogps:
    """Run ``model`` on the preference row ``batch`` and return every branch's log-probabilities.

    >>> # logps = preference_logps(model, build_preference_row(units, "shared-prefix"))
    >>> # chosen, rejected = chosen_rejected(logps.sums, batch)
    """
    output = model(**preference_model_kwargs(model, batch), **forward_kwargs)
    logits = output.logits if hasattr(output, "logits") else output[0]
    return sequence_logps(logits, batch)
