"""Collate-time (in-batch) packing: several unpadded rows of a micro-batch become one ``[1, T]`` THD row
(docs/contract.md §3.1 and §3.2).

- `build_thd_from_rows`: unpadded 1-D rows -> one packed row with boundaries. Each row is aligned to a
  multiple ``m`` (its alignment tail gets the pad values and positions continuing ``last+1, ...``);
  with ``pad_to_max_length`` the last segment absorbs the fill up to ``sequence_length``.
  ``cu_seqlens_q/kv`` hold the real lengths; ``cu_seqlens_q/kv_padded`` the physical ones, only when
  some segment was padded; ``max_seqlen_q/kv`` is the longest physical segment (a 0-d CPU tensor).
- `pack_right_padded_batch`: the same from a right-padded ``[B, S]`` batch, written back in place.
- `pad_or_truncate_batch` / `prepare_sequence_batch`: the collator policy when not packing
  (docs/contract.md §3.3).

Errors are ValueErrors checked in the reference's order, with its messages.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from tightpack.core.alignment import ceil_to_multiple
from tightpack.runtime import thd

__all__ = ["build_thd_from_rows", "pack_right_padded_batch", "pack_samples", "pad_or_truncate_batch"]

VISUAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
_STANDARD = ("position_ids", "labels", "loss_mask", "attention_mask", "padding_mask")
_OPTIONAL = ("labels", "loss_mask")


def build_thd_from_rows(
    rows: Sequence[Mapping[str, torch.Tensor]],
    *,
    token_key: str = "input_ids",
    sequence_length: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    pad_to_multiple_of: int = 1,
    pad_to_max_length: bool = False,
    sequence_tensor_pad_values: Mapping[str, Any] | None = None,
    emit_padding_mask: bool = False,
) -> dict[str, Any]:
    """Pack unpadded rows into one THD row ``[1, T]``.

    Args:
        rows: per-example mappings of 1-D tensors: ``token_key`` and ``position_ids``; optionally
            ``labels``, ``loss_mask``, an all-ones ``attention_mask`` and the extra keys of
            ``sequence_tensor_pad_values`` (key -> pad value).
        sequence_length: cap per row; with ``pad_to_max_length`` also the packed width.
        pad_to_multiple_of: per-row alignment multiple m.

    >>> rows = [{"input_ids": torch.tensor([1, 2, 3]), "position_ids": torch.arange(3)},
    ...         {"input_ids": torch.tensor([4, 5]), "position_ids": torch.arange(2)}]
    >>> packed = build_thd_from_rows(rows, pad_to_multiple_of=2)
    >>> packed["input_ids"].tolist(), packed["position_ids"].tolist()
    ([[1, 2, 3, 0, 4, 5]], [[0, 1, 2, 3, 0, 1]])
    >>> packed["cu_seqlens_q"].tolist(), packed["cu_seqlens_q_padded"].tolist(), int(packed["max_seqlen_q"])
    ([0, 3, 5], [0, 4, 6], 4)
    """
    if not rows:
        raise ValueError("Cannot pack an empty sequence row list.")
    if pad_to_multiple_of < 1:
        raise ValueError("pad_to_multiple_of must be >= 1.")
    if sequence_length is not None and sequence_length < 1:
        raise ValueError("sequence_length must be >= 1.")
    if pad_to_max_length and sequence_length is None:
        raise ValueError("sequence_length must be set when pad_to_max_length=True.")
    extras = dict(sequence_tensor_pad_values or {})
    if set(extras) & {token_key, *_STANDARD}:
        raise ValueError("Additional sequence tensor keys must not replace standard sequence tensors.")

    lengths = []
    for row in rows:
        tokens = row.get(token_key)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError(f"'{token_key}' must be a 1D tensor for direct sequence packing.")
        length = len(tokens)
        if length == 0:
            raise ValueError("Cannot pack an empty sequence row.")
        if sequence_length is not None and length > sequence_length:
            raise ValueError(
                f"Packed sequence row length {length} exceeds configured sequence_length {sequence_length}."
            )
        if row.get("position_ids") is None:
            raise ValueError("Direct sequence packing requires a position_ids row.")
        for key in ("position_ids", *_OPTIONAL, *extras):
            value = row.get(key)
            if value is not None and (
                not isinstance(value, torch.Tensor) or value.dim() != 1 or len(value) != length
            ):
                raise ValueError(
                    f"'{key}' must be a 1D tensor matching its token row for direct sequence packing."
                )
        mask = row.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("Direct sequence packing requires unpadded input rows.")
        lengths.append(length)
    present = []
    for key in (*_OPTIONAL, *extras):
        has = [row.get(key) is not None for row in rows]
        if any(has) and not all(has):
            raise ValueError(f"'{key}' must be present for every sequence row or omitted from all rows.")
        if all(has):
            present.append(key)

    padded = [ceil_to_multiple(n, pad_to_multiple_of) for n in lengths]
    if pad_to_max_length:
        if sum(padded) > sequence_length:
            raise ValueError(
                f"Packed sequence length {sum(padded)} exceeds configured sequence_length {sequence_length}."
            )
        padded[-1] += sequence_length - sum(padded)
    first = rows[0][token_key]
    device = first.device
    real = torch.tensor(lengths, device=device)
    physical = torch.tensor(padded, device=device)
    starts = torch.cumsum(physical, 0) - physical
    total = int(physical.sum())
    # Physical offset of every real token, and of every tail token with its distance into the tail.
    real_at = torch.repeat_interleave(starts, real) + _ranks(real)
    tails = physical - real
    tail_at = torch.repeat_interleave(starts + real, tails) + _ranks(tails)

    pad_values = {
        token_key: pad_token_id,
        "position_ids": 0,
        "labels": ignore_index,
        "loss_mask": 0,
        **extras,
    }
    packed: dict[str, Any] = {}
    for key in (token_key, "position_ids", *present):
        values = torch.cat([row[key] for row in rows])
        buffer = torch.full((total,), pad_values[key], dtype=values.dtype, device=device)
        buffer[real_at] = values
        packed[key] = buffer[None]
    last_position = torch.stack([row["position_ids"][-1] for row in rows]).to(packed["position_ids"].dtype)
    packed["position_ids"][0, tail_at] = torch.repeat_interleave(last_position, tails) + 1 + _ranks(tails)
    if emit_padding_mask:
        padding = torch.ones((1, total), dtype=torch.bool, device=device)
        padding[0, real_at] = False
        packed["padding_mask"] = padding

    cu = torch.tensor([0, *torch.cumsum(real, 0).tolist()], dtype=torch.int32, device=device)
    packed.update(attention_mask=None, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    if padded != lengths:
        cu_padded = torch.tensor([0, *torch.cumsum(physical, 0).tolist()], dtype=torch.int32, device=device)
        packed.update(cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)
    longest = torch.tensor(max(padded), dtype=torch.int32)
    packed.update(max_seqlen_q=longest, max_seqlen_kv=longest, total_tokens=total)
    thd.check_thd_batch(packed)
    return packed


def pack_samples(
    samples: Sequence[Mapping[str, Any]],
    *,
    sequence_length: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    pad_to_multiple_of: int = 1,
    pad_to_max_length: bool = False,
) -> dict[str, Any]:
    """Pack prepared samples (1-D ``input_ids``, optional ``labels`` / ``loss_mask``) into one THD row.

    The row and boundaries are `build_thd_from_rows`'s, with positions restarting at every sample
    and a ``padding_mask``; each visual key of `VISUAL_KEYS` that some sample holds is concatenated
    along dim 0 in member order (samples without it add nothing).

    >>> batch = pack_samples([{"input_ids": torch.tensor([7, 8, 9])},
    ...                       {"input_ids": torch.tensor([5]), "pixel_values": torch.ones(2, 3)}])
    >>> batch["input_ids"].tolist(), batch["cu_seqlens_q"].tolist(), tuple(batch["pixel_values"].shape)
    ([[7, 8, 9, 5]], [0, 3, 4], (2, 3))
    """
    rows = []
    for sample in samples:
        row = {"input_ids": sample["input_ids"], "position_ids": torch.arange(len(sample["input_ids"]))}
        row |= {key: sample[key] for key in _OPTIONAL if sample.get(key) is not None}
        rows.append(row)
    batch = build_thd_from_rows(
        rows,
        sequence_length=sequence_length,
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_to_max_length=pad_to_max_length,
        emit_padding_mask=True,
    )
    for key in VISUAL_KEYS:
        present = [sample[key] for sample in samples if sample.get(key) is not None]
        if present:
            batch[key] = torch.cat([torch.as_tensor(value) for value in present], dim=0)
    return batch


def _ranks(counts: torch.Tensor) -> torch.Tensor:
    """``[0..counts[0]), [0..counts[1]), ...`` concatenated."""
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum()), device=counts.device) - torch.repeat_interleave(offsets, counts)


def pack_right_padded_batch(
    batch: MutableMapping[str, Any],
    *,
    token_key: str | None = None,
    sequence_length: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    pad_to_multiple_of: int = 1,
    sequence_tensor_pad_values: Mapping[str, Any] | None = None,
    emit_padding_mask: bool = False,
) -> None:
    """Pack a right-padded ``[B, S]`` batch into one THD row, in place (docs/contract.md §3.2).

    Row lengths come from ``attention_mask`` when present, else from ``tokens != pad_token_id``.
    ``tokens`` and ``input_ids`` stay aliases of one tensor when the batch has both; a stale
    ``padding_mask`` or ``*_padded`` key is removed when this packing does not produce it.
    """
    token_key = token_key or _token_key(batch)
    tokens = batch.get(token_key)
    if not isinstance(tokens, torch.Tensor):
        raise ValueError("Sequence batch must contain a 2D 'input_ids' or 'tokens' tensor.")
    if tokens.dim() != 2:
        raise ValueError("Direct sequence packing expects a 2D token tensor.")
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.shape != tokens.shape:
        raise ValueError("Direct sequence packing expects 2D 'position_ids' matching token shape.")
    extras = dict(sequence_tensor_pad_values or {})
    for key in (*_OPTIONAL, *extras, "attention_mask"):
        value = batch.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape != tokens.shape):
            raise ValueError(
                f"'{key}' must match token shape {tuple(tokens.shape)} for direct sequence packing."
            )
    active = (
        batch["attention_mask"].bool() if batch.get("attention_mask") is not None else tokens != pad_token_id
    )
    lengths = active.sum(dim=1)
    prefix = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
    if not torch.equal(active, prefix):
        raise ValueError("Direct sequence packing requires right-padded input rows.")
    if bool((lengths == 0).any()):
        raise ValueError("Cannot pack a batch containing an empty sequence row.")
    keys = [token_key, "position_ids", *(k for k in (*_OPTIONAL, *extras) if batch.get(k) is not None)]
    rows = [{key: batch[key][i, :n] for key in keys} for i, n in enumerate(lengths.tolist())]
    packed = build_thd_from_rows(
        rows,
        token_key=token_key,
        sequence_length=sequence_length,
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
        pad_to_multiple_of=pad_to_multiple_of,
        sequence_tensor_pad_values=extras,
        emit_padding_mask=emit_padding_mask,
    )
    for stale in ("padding_mask", *thd.PADDED_KEYS):
        if stale not in packed:
            batch.pop(stale, None)
    batch.update(packed)
    for alias in thd.TOKEN_KEYS:
        if alias != token_key and alias in batch:
            batch[alias] = packed[token_key]
    thd.check_thd_batch(batch)


def _token_key(batch: Mapping[str, Any]) -> str:
    return "tokens" if isinstance(batch.get("tokens"), torch.Tensor) else "input_ids"


def pad_or_truncate_batch(
    batch: MutableMapping[str, Any],
    *,
    sequence_length: int | None,
    pad_to_max_length: bool = False,
    pad_to_multiple_of: int = 128,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    sequence_tensor_pad_values: Mapping[str, Any] | None = None,
) -> None:
    """The non-packed policy (docs/contract.md §3.3), in place on a right-padded ``[B, S]`` batch.

    The width becomes ``sequence_length`` with ``pad_to_max_length``, else ``ceil(S, multiple)`` capped
    at ``sequence_length``. Padding: tokens ``pad_token_id``, labels ``ignore_index``, loss mask 0,
    attention mask 0, positions continuing the arange, extras their own pad value.

    Raises:
        ValueError: a ``sequence_length`` below 1, a 4-D attention mask, or a truncation that removes
            every supervised token of a row that had some.
    """
    if sequence_length is None:
        return
    if sequence_length < 1:
        raise ValueError("sequence_length must be >= 1.")
    token_key = _token_key(batch)
    width = batch[token_key].shape[1]
    multiple = max(1, pad_to_multiple_of)
    target = sequence_length if pad_to_max_length else min(sequence_length, ceil_to_multiple(width, multiple))
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise ValueError(
            "pad_or_truncate_batch supports 2-D attention masks only; build 4-D masks after padding"
        )
    pad_values = {token_key: pad_token_id, "labels": ignore_index, "loss_mask": 0, "attention_mask": 0}
    pad_values |= dict(sequence_tensor_pad_values or {})
    keys = [
        k
        for k in {*pad_values, "position_ids", "tokens", "input_ids"}
        if isinstance(batch.get(k), torch.Tensor)
    ]
    if target < width:
        supervised = _supervised(batch, ignore_index)
        if supervised is not None:
            lost = (supervised.any(dim=1) & ~supervised[:, :target].any(dim=1)).nonzero().flatten().tolist()
            if lost:
                raise ValueError(
                    f"Truncating sequence batch from {width} to {target} tokens removed every supervised "
                    f"token from rows {lost}. Increase sequence_length or filter overlength samples."
                )
        for key in keys:
            batch[key] = batch[key][:, :target]
    elif target > width:
        extra = target - width
        for key in keys:
            value = batch[key]
            if key == "position_ids":
                tail = value[:, -1:] + 1 + torch.arange(extra, device=value.device, dtype=value.dtype)
            else:
                tail = torch.full(
                    (value.shape[0], extra), pad_values.get(key, 0), dtype=value.dtype, device=value.device
                )
            batch[key] = torch.cat([value, tail], dim=1)
    if isinstance(batch.get("tokens"), torch.Tensor) and isinstance(batch.get("input_ids"), torch.Tensor):
        batch["input_ids"] = batch["tokens"] = batch[token_key]


def _supervised(batch: Mapping[str, Any], ignore_index: int) -> torch.Tensor | None:
    if isinstance(batch.get("loss_mask"), torch.Tensor):
        return batch["loss_mask"] > 0
    if isinstance(batch.get("labels"), torch.Tensor):
        return batch["labels"] != ignore_index
    return None


def prepare_sequence_batch(
    batch: MutableMapping[str, Any],
    *,
    sequence_length: int | None,
    pad_to_max_length: bool = False,
    pad_to_multiple_of: int = 128,
    enable_in_batch_packing: bool = False,
    in_batch_packing_pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    sequence_tensor_pad_values: Mapping[str, Any] | None = None,
    emit_packed_padding_mask: bool = False,
) -> None:
    """Collator policy (docs/contract.md §3.3): pack the batch in place, or pad/truncate it."""
    if enable_in_batch_packing:
        pack_right_padded_batch(
            batch,
            sequence_length=sequence_length,
            pad_token_id=pad_token_id,
            ignore_index=ignore_index,
            pad_to_multiple_of=in_batch_packing_pad_to_multiple_of,
            sequence_tensor_pad_values=sequence_tensor_pad_values,
            emit_padding_mask=emit_packed_padding_mask,
        )
    else:
        pad_or_truncate_batch(
            batch,
            sequence_length=sequence_length,
            pad_to_max_length=pad_to_max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_token_id=pad_token_id,
            ignore_index=ignore_index,
            sequence_tensor_pad_values=sequence_tensor_pad_values,
        )
