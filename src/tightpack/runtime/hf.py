"""Hugging Face transformers on packed rows: a forward pass that is safe, and its guards.

transformers (5.x) finds the sequences of a packed row from ``position_ids`` (a new sequence wherever
they do not increase by one) and builds a block-diagonal causal mask for eager, sdpa and flex
attention, but ONLY when no 2-D ``attention_mask`` is passed and no cache is used. ``use_cache``
defaults to True even in training, and then attention silently crosses sequences (losses off by up to
0.2, no error). `packed_forward` always passes ``use_cache=False`` and refuses a 2-D mask.
Flash-attention kernels read ``cu_seq_lens_q/k`` and ``max_length_q/k`` instead (the names of
transformers' flattening collator); the others accept and ignore them. State-space and convolution
layers of hybrid models read ``seq_idx``; without their kernels transformers raises on it, which is
the point of passing it (`tightpack.runtime.hf_kwargs`).

Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) take ``position_ids`` of shape ``[4, B, L]``: row 0
the text position restarting at every sequence, from which transformers finds the sequences, and
rows 1-3 the multimodal positions. With the usual ``[3, B, L]`` no packed mask is built and attention
crosses sequences. `packed_forward` builds the four rows from a batch of
`tightpack.runtime.vlm.pack_vlm_samples` and passes the visual tensors; it does not pass the
``cu_seq_lens`` keywords to them, which would also reach the vision tower's attention.

Guards, in order: `check_packable` refuses what is known not to work (the attention implementation,
model families in `tightpack.runtime.equivalence.architectures`, Qwen-VL without its positions);
then, on the first packed row a model sees, `packed_forward` runs the equivalence probe
(`tightpack.runtime.equivalence`), which asks the model itself whether a packed row is computed as
its sequences alone; `check_packing` runs it on demand.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.logs import logger
from tightpack.runtime import thd
from tightpack.runtime.equivalence.architectures import check_architecture
from tightpack.runtime.equivalence.hf import ProbeReport, ProbeSkipped, check_packing, probe_enabled
from tightpack.runtime.hf_kwargs import hf_packed_kwargs, model_kwargs
from tightpack.runtime.transformers_releases import (
    RELEASE_FLOORS,
    check_family_release,
    check_release,
    installed_release,
    parse_release,
)

__all__ = ["check_packable", "check_packing", "hf_packed_kwargs", "packed_forward"]

# attention implementations that keep packed sequences apart when given positions and no 2-D mask
# (on a recent enough transformers: `tightpack.runtime.transformers_releases`): eager, sdpa and flex
# build a block-diagonal mask from the positions, the flash kernels take the boundaries from the
# positions (or from ``cu_seq_lens``)
PACKED_ATTENTION = tuple(RELEASE_FLOORS)
# Qwen-VL model types -> the first transformers release that reads row 0 of [4, B, L] positions
_QWEN_VL_SINCE = {"qwen2_vl": (4, 54), "qwen2_5_vl": (4, 54), "qwen3_vl": (4, 57), "qwen3_vl_moe": (4, 57)}
# models whose first packed row went through the probe (keyed weakly: a deleted model is forgotten)
_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, ProbeReport | None] = weakref.WeakKeyDictionary()


def check_packable(
    model: torch.nn.Module, vlm: bool = False, *, transformers_release: str | None = None
) -> None:
    """Refuse a model that would attend across packed sequences: an attention implementation outside
    `PACKED_ATTENTION` or that the transformers release (``transformers_release``, default the
    installed one) cannot pack (`tightpack.runtime.transformers_releases.check_release`), a family
    the installed transformers cannot pack (`tightpack.runtime.equivalence.architectures`), a
    Qwen-VL model without multimodal positions (``vlm=False``), multimodal positions for another
    model or on a transformers release that cannot pack it (``vlm=True``).

    Raises:
        TightpackError: naming the problem and the fix.
    """
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    attention = getattr(text_config, "_attn_implementation", None)
    release = transformers_release or installed_release("transformers")
    if attention is not None:
        check_release(attention, release)
    check_architecture(model)
    model_type = getattr(config, "model_type", None)
    check_family_release(getattr(text_config, "model_type", model_type), release)
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
    if release is not None and parse_release(release)[:2] < _QWEN_VL_SINCE[model_type]:
        since = ".".join(map(str, _QWEN_VL_SINCE[model_type]))
        raise TightpackError(
            f"transformers {release} does not find packed sequences in {model_type}'s "
            f"positions, so attention would cross them; upgrade to transformers>={since}"
        )


def packed_forward(
    model: torch.nn.Module, batch: Mapping[str, Any], *, probe: bool | None = None, **kwargs: Any
):
    """Forward a transformers causal LM (or a Qwen-VL model) on one packed row without attention
    crossing sequences.

    A batch with ``mrope_position_ids`` (from `tightpack.runtime.vlm.pack_vlm_samples`) goes to a
    Qwen-VL model with `hf_packed_vlm_kwargs`; other batches go with `hf_packed_kwargs`
    (`tightpack.runtime.hf_kwargs.model_kwargs`).

    ``probe``: None (default) runs the equivalence probe on the first packed row each model sees
    (unless ``TIGHTPACK_PROBE=0``), True on this call, False never. The probe costs five small forward
    passes without gradients (a few hundred tokens).

    Raises:
        TightpackError: for ``use_cache=True`` or a 2-D ``attention_mask`` (with either, transformers
            attends across the packed sequences without any error), an attention implementation
            outside `PACKED_ATTENTION`, a model family that cannot be packed, a Qwen-VL model without
            multimodal positions (or positions for another model), or a transformers release that
            cannot pack that Qwen-VL model.
        PackingLeakError: the probe found that the model computes the packed row otherwise than its
            sequences alone.
    """
    if kwargs.pop("use_cache", False):
        raise TightpackError("use_cache=True on a packed row makes attention cross sequences; drop it")
    if not thd.is_packed(batch):
        hint = (
            "; this one holds a model's keyword arguments (cu_seq_lens_q, as PackingCollator gives them): "
            "run model(**batch), and check it with check_packing(model, batch)"
        )
        raise TightpackError(
            "packed_forward takes a THD batch (cu_seqlens_q: PackedCollate, TextSFTCollator with "
            "enable_in_batch_packing=True, OnlinePacker)" + (hint if "cu_seq_lens_q" in batch else "")
        )
    for where, mask in (
        ("argument", kwargs.get("attention_mask")),
        ("batch key", batch.get("attention_mask")),
    ):
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            raise TightpackError(
                f"a 2-D attention_mask ({where}) on a packed row makes transformers ignore the sequence "
                "boundaries; pass none (position_ids carry the boundaries) or a 4-D block-diagonal mask"
            )
    check_packable(model, batch.get("mrope_position_ids") is not None)
    if probe or (probe is None and model not in _PROBED and probe_enabled()):
        _PROBED[model] = _probe_call(model, batch, kwargs)
    return model(**model_kwargs(model, batch), use_cache=False, **kwargs)


def _probe_call(
    model: torch.nn.Module, batch: Mapping[str, Any], kwargs: dict[str, Any]
) -> ProbeReport | None:
    """The probe of `packed_forward`'s call; None (with a warning) where it cannot be built."""
    extra = {key: value for key, value in kwargs.items() if key != "labels"}
    tensors = sorted(key for key, value in extra.items() if isinstance(value, torch.Tensor))
    try:
        if tensors:
            raise ProbeSkipped(f"the call passes {', '.join(tensors)}, which the probe cannot rebuild")
        return check_packing(
            model,
            batch,
            model_kwargs=lambda model, probe: {**model_kwargs(model, probe), **extra},
            hint="run one packed row through packed_forward(model, batch, probe=True) to check again",
        )
    except ProbeSkipped as skipped:
        logger().warning("packing check skipped for %s: %s", type(model).__name__, skipped)
        return None
