"""Adapters from a THD batch to what model code consumes: Megatron-Core's ``PackedSeqParams``.

`to_packed_seq_params` follows Megatron-Bridge's ``get_packed_seq_params`` (docs/contract.md §1) for
both key schemas, reading the batch through the accessors of `tightpack.runtime.thd`. Those fix the
reference's legacy trimming: the boundaries are cut at the first ``-1`` through ``cu_seqlens_argmin``
(a CPU tensor) or, for CPU tensors, by a host-side search, never by an ``argmin`` over a device tensor
(a host sync, and an empty slice when there is no ``-1``). Without megatron-core installed, a
tightpack dataclass with the same fields is returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import thd
from tightpack.runtime.thd import physical_boundaries

__all__ = ["physical_boundaries", "to_packed_seq_params"]


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


def to_packed_seq_params(batch: Mapping[str, Any], *, megatron: bool | None = None):
    """``PackedSeqParams(qkv_format="thd")`` for one packed row of a THD batch (either key schema).

    The logical boundaries become ``cu_seqlens_q/kv``, the padded ones ``cu_seqlens_q/kv_padded``, but
    only when they differ (equal CPU tensors are dropped, keeping Transformer Engine on its faster
    kernel); ``max_seqlen_q/kv`` become python ints. The batch may be one context-parallel rank's
    shard (`slice_for_cp_rank`): its boundaries are global, as Transformer Engine expects.

    Args:
        batch: the batch of one micro-batch (a single packed row).
        megatron: True to require megatron-core's class, False for tightpack's; None: megatron-core's
            when installed.

    >>> batch = {"cu_seqlens": torch.tensor([[0, 4, 6, 8, -1, -1]], dtype=torch.int32),
    ...          "max_seqlen": torch.tensor([[4]], dtype=torch.int32)}
    >>> params = to_packed_seq_params(batch, megatron=False)
    >>> params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded, params.max_seqlen_q
    ([0, 4, 6, 8], None, 4)
    """
    thd.check_thd_batch(batch, cp_size=None)
    thd.check_block_diagonal(batch, "PackedSeqParams (Megatron-Core's THD attention)")
    q, kv = thd.logical_boundaries(batch), thd.logical_boundaries(batch, side="kv")
    q_padded, kv_padded = thd.padded_boundaries(batch), thd.padded_boundaries(batch, side="kv")
    if q_padded is not None and q_padded.device.type == "cpu" and torch.equal(q_padded, q):
        q_padded = kv_padded = None

    values = {
        "qkv_format": "thd",
        "cu_seqlens_q": q,
        "cu_seqlens_kv": kv,
        "cu_seqlens_q_padded": q_padded,
        "cu_seqlens_kv_padded": kv_padded,
        "max_seqlen_q": thd.max_seqlen(batch),
        "max_seqlen_kv": thd.max_seqlen(batch, side="kv"),
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
