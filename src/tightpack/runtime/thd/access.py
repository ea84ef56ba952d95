"""Reading one packed row of a THD batch in either key schema: boundaries, ``max_seqlen``, tokens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime.thd.contract import TOKEN_KEYS, Side, ThdBatchError, no_boundaries

__all__ = [
    "is_packed",
    "logical_boundaries",
    "max_seqlen",
    "padded_boundaries",
    "physical_boundaries",
    "token_tensor",
]


def token_tensor(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The token stream: ``tokens`` when it is a tensor, else ``input_ids`` (None when neither)."""
    for key in TOKEN_KEYS:
        if isinstance(batch.get(key), torch.Tensor):
            return batch[key]
    return None


def is_packed(batch: Mapping[str, Any]) -> bool:
    """Whether the batch carries packed boundaries (current ``cu_seqlens_q*`` or legacy ``cu_seqlens``)."""
    return any(batch.get(key) is not None for key in ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens"))


def is_legacy(batch: Mapping[str, Any]) -> bool:
    return batch.get("cu_seqlens_q") is None and batch.get("cu_seqlens") is not None


def _one_row(boundaries: torch.Tensor, name: str, row: int | None) -> torch.Tensor:
    """One row of boundaries, 1-D int32: ``[K]`` as is, ``[1, K]`` squeezed, or row ``row`` of ``[B, K]``."""
    if boundaries.dim() == 1 and row in (None, 0):
        selected = boundaries
    elif boundaries.dim() == 2 and row is None and boundaries.shape[0] == 1:
        selected = boundaries[0]
    elif boundaries.dim() == 2 and row is not None and 0 <= row < boundaries.shape[0]:
        selected = boundaries[row]
    elif boundaries.dim() == 2 and row is None:
        raise TightpackError(
            f"{name} has shape {tuple(boundaries.shape)}: THD attention takes one packed row "
            "(micro-batch size 1); split the batch into micro-batches first (or read one with row=)"
        )
    else:
        raise TightpackError(f"{name} has shape {tuple(boundaries.shape)}: there is no packed row {row}")
    return selected if selected.dtype == torch.int32 else selected.to(torch.int32)


def scalar(value: Any, name: str, row: int | None = None) -> int:
    """A per-row count (``max_seqlen*``, an argmin) as a python int: 0-d, ``[1]``, ``[1, 1]``, or row
    ``row`` of ``[B]`` / ``[B, 1]``."""
    if isinstance(value, torch.Tensor):
        if row is not None and value.dim() > 0 and value.shape[0] > 1:
            value = value[row]
        if value.numel() != 1:
            raise ValueError(f"{name} must contain exactly one value, got shape {tuple(value.shape)}")
        return int(value.item())
    return int(value)


def _trim(batch: Mapping[str, Any], name: str, row: int | None) -> torch.Tensor:
    """Legacy boundaries of one row without their -1 padding: cut at ``{name}_argmin`` when given (no
    host sync), else at the first negative entry of a CPU tensor."""
    bounds = _one_row(batch[name], name, row)
    argmin = batch.get(f"{name}_argmin")
    if argmin is not None:
        return bounds[: scalar(argmin, f"{name}_argmin", row)]
    if bounds.device.type != "cpu":
        raise TightpackError(
            f"{name} is on {bounds.device} without {name}_argmin: finding its -1 padding would need a host "
            f"sync; pass {name}_argmin (a CPU tensor) or keep the boundaries on the CPU"
        )
    negative = torch.nonzero(bounds < 0)
    return bounds[: int(negative[0, 0])] if len(negative) else bounds


def logical_boundaries(batch: Mapping[str, Any], *, side: Side = "q", row: int | None = None) -> torch.Tensor:
    """Logical boundaries of one packed row, 1-D int32: ``cu_seqlens_q`` (``cu_seqlens_kv`` for
    ``side="kv"``, defaulting to q); legacy ``cu_seqlens_unpadded``, else ``cu_seqlens``, trimmed.

    Args:
        row: which row of ``[B, K]`` boundaries; None requires a single row (``[K]`` or ``[1, K]``).

    >>> logical_boundaries({"cu_seqlens_q": torch.tensor([[0, 3, 6, 7], [0, 7, 7, 7]])}, row=1).tolist()
    [0, 7, 7, 7]
    """
    if batch.get("cu_seqlens_q") is not None:
        key = "cu_seqlens_kv" if side == "kv" and batch.get("cu_seqlens_kv") is not None else "cu_seqlens_q"
        return _one_row(batch[key], key, row)
    if batch.get("cu_seqlens") is not None:
        name = "cu_seqlens_unpadded" if batch.get("cu_seqlens_unpadded") is not None else "cu_seqlens"
        return _trim(batch, name, row)
    raise no_boundaries()


def padded_boundaries(
    batch: Mapping[str, Any], *, side: Side = "q", row: int | None = None
) -> torch.Tensor | None:
    """Physical boundaries of one packed row when the batch carries them apart from the logical ones
    (``cu_seqlens_q_padded``, ``_kv_padded`` defaulting to it; legacy ``cu_seqlens`` next to
    ``cu_seqlens_unpadded``), else None. They may still be equal to the logical ones.
    """
    if batch.get("cu_seqlens_q") is not None:
        kv = side == "kv" and batch.get("cu_seqlens_kv_padded") is not None
        key = "cu_seqlens_kv_padded" if kv else "cu_seqlens_q_padded"
        return None if batch.get(key) is None else _one_row(batch[key], key, row)
    if batch.get("cu_seqlens") is not None:
        return None if batch.get("cu_seqlens_unpadded") is None else _trim(batch, "cu_seqlens", row)
    if batch.get("cu_seqlens_q_padded") is not None:
        raise ThdBatchError("cu_seqlens_q_padded without cu_seqlens_q: the logical boundaries are required")
    raise no_boundaries()


def physical_boundaries(
    batch: Mapping[str, Any], *, side: Side = "q", row: int | None = None
) -> torch.Tensor:
    """Physical boundaries of one packed row, 1-D int32, in either key schema: where the segments lie in
    the tensor (alignment padding included). `padded_boundaries` when present, else the logical ones.

    >>> physical_boundaries({"cu_seqlens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
    ...                      "cu_seqlens_q_padded": torch.tensor([0, 4, 8], dtype=torch.int32)}).tolist()
    [0, 4, 8]
    """
    padded = padded_boundaries(batch, side=side, row=row)
    return logical_boundaries(batch, side=side, row=row) if padded is None else padded


def max_seqlen(batch: Mapping[str, Any], *, side: Side = "q", row: int | None = None) -> int | None:
    """The longest segment bound of one packed row as a python int: ``max_seqlen_q`` (``_kv`` for
    ``side="kv"``, defaulting to q) or legacy ``max_seqlen``; None when the batch has none.

    It is an upper bound for the attention kernels, not always the longest segment: with
    ``pad_cu_seqlens`` it is a fill value stable across batches.

    Raises:
        ValueError: for several values and no ``row`` ("max_seqlen_q must contain exactly one value").
    """
    if is_legacy(batch):
        key = "max_seqlen"
    else:
        key = "max_seqlen_kv" if side == "kv" and batch.get("max_seqlen_kv") is not None else "max_seqlen_q"
    value = batch.get(key)
    return None if value is None else scalar(value, key, row)
