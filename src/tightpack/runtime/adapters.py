"""Adapters from a THD batch to what model code consumes: Megatron-Core's ``PackedSeqParams``.

`to_packed_seq_params` follows Megatron-Bridge's ``get_packed_seq_params`` (contract section 1) for
both key schemas, and fixes its legacy trimming: the boundaries are cut at the first ``-1`` through
``cu_seqlens_argmin`` (a CPU tensor) or, for CPU tensors, by a host-side search, never by an
``argmin`` over a device tensor (a host sync, and an empty slice when there is no ``-1``).
Without megatron-core installed, a tightpack dataclass with the same fields is returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError

__all__ = ["PackedSeqParams", "physical_boundaries", "to_packed_seq_params"]


@dataclasses.dataclass
class PackedSeqParams:
    """Megatron-Core's ``PackedSeqParams`` fields (qkv_format "thd"), for use without megatron-core."""

    qkv_format: str = "thd"
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    total_tokens: int | None = None


def _megatron_class():
    try:
        from megatron.core.packed_seq_params import PackedSeqParams as MegatronPackedSeqParams
    except ImportError:
        return None
    return MegatronPackedSeqParams


def _row(boundaries: torch.Tensor, name: str) -> torch.Tensor:
    """Boundaries of one packed row as a 1-D int32 tensor (``[1, K]`` is squeezed)."""
    row = boundaries.squeeze()
    if row.dim() != 1:
        raise TightpackError(
            f"{name} has shape {tuple(boundaries.shape)}: THD attention takes one packed row "
            "(micro-batch size 1); split the batch into micro-batches first"
        )
    return row if row.dtype == torch.int32 else row.to(torch.int32)


def _scalar(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must contain exactly one value, got shape {tuple(value.shape)}")
        return int(value.item())
    return int(value)


def _trim(boundaries: torch.Tensor, argmin: Any, name: str) -> torch.Tensor:
    """Legacy boundaries without their ``-1`` padding."""
    row = _row(boundaries, name)
    if argmin is not None:
        return row[: _scalar(argmin, f"{name}_argmin")]
    if row.device.type != "cpu":
        raise TightpackError(
            f"{name} is on {row.device} without {name}_argmin: finding its -1 padding would need a host "
            f"sync; pass {name}_argmin (a CPU tensor) or keep the boundaries on the CPU"
        )
    negative = torch.nonzero(row < 0)
    return row[: int(negative[0, 0])] if len(negative) else row


def physical_boundaries(batch: Mapping[str, Any]) -> torch.Tensor:
    """Physical (aligned) boundaries of one packed row, 1-D int32, in either key schema.

    ``cu_seqlens_q_padded`` when present, else ``cu_seqlens_q``; legacy ``cu_seqlens`` without its
    ``-1`` padding.

    >>> physical_boundaries({"cu_seqlens_q": torch.tensor([0, 3, 5]),
    ...                      "cu_seqlens_q_padded": torch.tensor([0, 4, 8])}).tolist()
    [0, 4, 8]
    """
    if batch.get("cu_seqlens_q_padded") is not None:
        return _row(batch["cu_seqlens_q_padded"], "cu_seqlens_q_padded")
    if batch.get("cu_seqlens_q") is not None:
        return _row(batch["cu_seqlens_q"], "cu_seqlens_q")
    if batch.get("cu_seqlens") is not None:
        return _trim(batch["cu_seqlens"], batch.get("cu_seqlens_argmin"), "cu_seqlens")
    raise TightpackError("the batch has no packed boundaries: expected cu_seqlens_q or legacy cu_seqlens")


def to_packed_seq_params(batch: Mapping[str, Any], *, megatron: bool | None = None):
    """``PackedSeqParams(qkv_format="thd")`` for one packed row of a THD batch.

    Current keys: ``cu_seqlens_q`` (``cu_seqlens_kv`` defaults to it), ``max_seqlen_q`` (and
    ``_kv``), optional ``cu_seqlens_q/kv_padded`` and ``total_tokens``. Legacy keys: ``cu_seqlens``
    (physical, ``-1`` padded), ``cu_seqlens_argmin``, ``max_seqlen`` and, when aligned,
    ``cu_seqlens_unpadded`` (logical) with its argmin. Padded boundaries are set only when they
    differ from the logical ones (equal CPU tensors are dropped, keeping Transformer Engine on its
    faster kernel).

    Args:
        batch: the batch of one micro-batch (a single packed row).
        megatron: True to require megatron-core's class, False for tightpack's; None: megatron-core's
            when installed.

    >>> batch = {"cu_seqlens": torch.tensor([[0, 4, 6, 8, -1, -1]]), "max_seqlen": torch.tensor([[4]])}
    >>> params = to_packed_seq_params(batch, megatron=False)
    >>> params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded, params.max_seqlen_q
    ([0, 4, 6, 8], None, 4)
    """
    if "cu_seqlens_q" in batch and batch["cu_seqlens_q"] is not None:
        q = _row(batch["cu_seqlens_q"], "cu_seqlens_q")
        kv = q if batch.get("cu_seqlens_kv") is None else _row(batch["cu_seqlens_kv"], "cu_seqlens_kv")
        q_padded = batch.get("cu_seqlens_q_padded")
        q_padded = None if q_padded is None else _row(q_padded, "cu_seqlens_q_padded")
        kv_padded = batch.get("cu_seqlens_kv_padded")
        kv_padded = q_padded if kv_padded is None else _row(kv_padded, "cu_seqlens_kv_padded")
        max_q = _scalar(batch["max_seqlen_q"], "max_seqlen_q")
        max_kv = (
            max_q if batch.get("max_seqlen_kv") is None else _scalar(batch["max_seqlen_kv"], "max_seqlen_kv")
        )
    elif "cu_seqlens" in batch and batch["cu_seqlens"] is not None:
        physical = _trim(batch["cu_seqlens"], batch.get("cu_seqlens_argmin"), "cu_seqlens")
        logical = batch.get("cu_seqlens_unpadded")
        if logical is not None:
            logical = _trim(logical, batch.get("cu_seqlens_unpadded_argmin"), "cu_seqlens_unpadded")
        q = kv = physical if logical is None else logical
        q_padded = kv_padded = None if logical is None else physical
        max_q = max_kv = _scalar(batch["max_seqlen"], "max_seqlen")
    else:
        raise TightpackError("the batch has no packed boundaries: expected cu_seqlens_q or legacy cu_seqlens")
    if q_padded is not None and q_padded.device.type == "cpu" and torch.equal(q_padded, q):
        q_padded = kv_padded = None

    values = {
        "qkv_format": "thd",
        "cu_seqlens_q": q,
        "cu_seqlens_kv": kv,
        "cu_seqlens_q_padded": q_padded,
        "cu_seqlens_kv_padded": kv_padded,
        "max_seqlen_q": max_q,
        "max_seqlen_kv": max_kv,
        "total_tokens": batch.get("total_tokens"),
        "cp_partition_mode": batch.get("cp_partition_mode", "zigzag"),
    }
    target = _megatron_class() if megatron is not False else None
    if megatron and target is None:
        raise TightpackError(
            "megatron=True but megatron-core is not installed: pip install 'tightpack[megatron]'"
        )
    target = target or PackedSeqParams
    fields = {field.name for field in dataclasses.fields(target)}
    return target(**{key: value for key, value in values.items() if key in fields and value is not None})
