"""`validate_thd_batch`: a batch checked against the THD contract, and the debug mode that runs it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

from tightpack.runtime.thd.access import logical_boundaries, padded_boundaries, physical_boundaries
from tightpack.runtime.thd.branches import validate_branches
from tightpack.runtime.thd.contract import (
    CONTRACT,
    CURRENT_KEYS,
    LEGACY_KEYS,
    PADDED_KEYS,
    PER_TOKEN_KEYS,
    ThdBatchError,
    no_boundaries,
)

__all__ = [
    "CHECK_ENV",
    "check_thd_batch",
    "checking",
    "checking_enabled",
    "set_checking",
    "validate_thd_batch",
]


CHECK_ENV = "TIGHTPACK_CHECK_BATCHES"
_checking = os.environ.get(CHECK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def checking_enabled() -> bool:
    """Whether builders and consumers validate the batches they emit and receive."""
    return _checking


def set_checking(enabled: bool) -> bool:
    """Turn the debug mode on or off for the whole process; returns the previous setting."""
    global _checking
    previous, _checking = _checking, bool(enabled)
    return previous


@contextmanager
def checking(enabled: bool = True) -> Iterator[None]:
    """The debug mode on (or off) inside a ``with`` block, restored afterwards."""
    previous = set_checking(enabled)
    try:
        yield
    finally:
        set_checking(previous)


def check_thd_batch(batch: Mapping[str, Any], *, cp_size: int | None = 1) -> None:
    """`validate_thd_batch` in debug mode; otherwise a single flag test."""
    if _checking:
        validate_thd_batch(batch, cp_size=cp_size)


def _fail(message: str) -> NoReturn:
    raise ThdBatchError(message)


def _named(name: str, rows: int, row: int) -> str:
    return name if rows == 1 else f"{name}[{row}]"


def validate_thd_batch(batch: Mapping[str, Any], *, cp_size: int | None = 1) -> None:
    """Check ``batch`` against the THD contract of this module; raise `ThdBatchError` naming the key,
    what it should hold and what it holds.

    Checked, for every key present (a consumer may receive only the keys it needs; the boundaries are
    required): dtypes and shapes of the table; boundaries that start at 0, never decrease and end at
    the row width (the token count, and ``total_tokens``); padded and logical boundaries of the same
    length with no segment shorter than its sequence; ``*_kv`` keys equal to the ``*_q`` ones;
    ``max_seqlen*`` not below the longest physical segment; per-token tensors of the token shape;
    ``attention_mask`` None; with padded boundaries, ``padding_mask`` True exactly on the alignment
    padding (without them it may also mark the offline width padding, and is not checked);
    ``seq_idx`` the physical segment of every token;
    ``token_count`` per row (offline) or per sequence (stream); legacy -1 padding and its argmin.

    Args:
        cp_size: 1 for whole rows. ``k`` for one rank's shard of a ``k``-way context-parallel split
            (`slice_for_cp_rank`: tensors hold ``width / k`` tokens, the boundaries stay global). None
            accepts either, and takes a row narrower than its boundaries for a shard.
    """
    if not isinstance(batch, Mapping):
        _fail(f"a THD batch is a mapping of keys to values, got {type(batch).__name__}")
    current, legacy = batch.get("cu_seqlens_q") is not None, batch.get("cu_seqlens") is not None
    if not (current or legacy):
        if batch.get("cu_seqlens_q_padded") is not None:
            _fail("cu_seqlens_q_padded without cu_seqlens_q: the logical boundaries are required")
        raise no_boundaries()
    stray = [k for k in (LEGACY_KEYS if current else CURRENT_KEYS) if batch.get(k) is not None]
    if stray:
        schema = "current (cu_seqlens_q)" if current else "legacy (cu_seqlens)"
        _fail(f"the batch mixes key schemas: {', '.join(stray)} in a {schema} batch; emit one schema only")
    for key, spec in CONTRACT.items():
        value = batch.get(key)
        if value is None or (
            spec.kind == "max_seqlen" and isinstance(value, int) and not isinstance(value, bool)
        ):
            continue
        if not isinstance(value, torch.Tensor):
            _fail(f"{key} must be a tensor, got {type(value).__name__}")
        if spec.dtype is not None and value.dtype != spec.dtype:
            _fail(f"{key} must be {spec.dtype}, got {value.dtype}")
    if batch.get("attention_mask") is not None:
        _fail(
            "attention_mask must be None in a THD batch (the boundaries carry the sequences), got "
            f"{type(batch['attention_mask']).__name__}"
        )

    first_name = "cu_seqlens_q" if current else "cu_seqlens"
    first = batch[first_name]
    if first.dim() not in (1, 2) or (legacy and first.dim() != 2):
        expected = "[B, K]" if legacy else "[K] (one stream) or [B, K] (offline rows)"
        _fail(f"{first_name} must be {expected}, got shape {tuple(first.shape)}")
    stream = first.dim() == 1
    rows = 1 if stream else first.shape[0]
    for key in ("cu_seqlens_kv", *PADDED_KEYS, "cu_seqlens_unpadded"):
        value = batch.get(key)
        if value is not None and value.shape[:-1] != first.shape[:-1]:
            _fail(
                f"{key} has shape {tuple(value.shape)}, not the layout of {first_name} {tuple(first.shape)}"
            )
    if current:
        _check_current_keys(batch)
    else:
        for key in ("cu_seqlens", "cu_seqlens_unpadded"):
            if batch.get(key) is not None:
                _check_legacy_padding(batch, key, rows)

    tokens_key, reference = _reference_tensor(batch)
    if reference is not None and (reference.dim() != 2 or reference.shape[0] != rows):
        layout = "[1, T] for 1-D boundaries" if stream else f"[{rows}, W] for {rows} rows of boundaries"
        _fail(f"{tokens_key} must be {layout}, got shape {tuple(reference.shape)}")
    width = None if reference is None else reference.shape[1]
    _check_per_token(batch, tokens_key, reference)

    total = batch.get("total_tokens")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
        _fail(f"total_tokens must be a python int (the row width), got {type(total).__name__}")
    padded = padded_boundaries(batch, row=0) is not None
    if current:
        logical_name, physical_name = "cu_seqlens_q", "cu_seqlens_q_padded" if padded else "cu_seqlens_q"
    else:
        logical_name, physical_name = "cu_seqlens_unpadded" if padded else "cu_seqlens", "cu_seqlens"
    shard = 1
    physical_rows, logical_rows = [], []
    for row in range(rows):
        logical_at, physical_at = _named(logical_name, rows, row), _named(physical_name, rows, row)
        logical = logical_boundaries(batch, row=None if stream else row).long()
        physical = physical_boundaries(batch, row=None if stream else row).long()
        _check_monotone(logical_at, logical)
        _check_monotone(physical_at, physical)
        end = int(physical[-1])
        if total is not None and total != end:
            _fail(f"total_tokens is {total} but {physical_at} ends at {end}")
        if width is not None:
            shard = _check_width(physical_at, physical, end, width, tokens_key, cp_size)
        if padded:
            if len(logical) != len(physical):
                _fail(
                    f"{physical_at} has {len(physical)} boundaries but {logical_at} has {len(logical)}: "
                    "padded and unpadded boundaries describe the same sequences"
                )
            short = torch.nonzero(physical.diff() < logical.diff())
            if len(short):
                i = int(short[0, 0])
                _fail(
                    f"segment {i} of {physical_at} spans {int(physical.diff()[i])} tokens, fewer than the "
                    f"{int(logical.diff()[i])} real tokens {logical_at} gives it"
                )
        physical_rows.append(physical)
        logical_rows.append(logical)

    _check_max_seqlen(batch, stream, rows, physical_rows, physical_name, current)
    _check_token_count(batch, stream, rows, physical_rows, logical_rows)
    if reference is not None and shard == 1:
        _check_segments(batch, rows, width, physical_rows, logical_rows, padded)
    if (batch.get("branch_unit") is not None or batch.get("branch_ids") is not None) and shard == 1:
        if not stream:
            _fail("preference keys (branch_unit, branch_ids) are for one packed row: 1-D boundaries, [1, T]")
        validate_branches(batch)


def _check_current_keys(batch: Mapping[str, Any]) -> None:
    """``*_kv`` keys equal their ``*_q`` keys."""
    for kv, q in (("cu_seqlens_kv", "cu_seqlens_q"), ("cu_seqlens_kv_padded", "cu_seqlens_q_padded")):
        if batch.get(kv) is None or batch[kv] is batch.get(q):
            continue
        if batch.get(q) is None:
            _fail(f"{kv} without {q}: the query boundaries are required")
        if batch[kv].shape != batch[q].shape or not torch.equal(batch[kv].cpu(), batch[q].cpu()):
            _fail(
                f"{kv} must equal {q} (packed self-attention shares its boundaries), got "
                f"{batch[kv].tolist()} and {batch[q].tolist()}"
            )


def _reference_tensor(batch: Mapping[str, Any]) -> tuple[str, torch.Tensor | None]:
    """The tensor that defines the row shape: the tokens, else the first per-token tensor present."""
    for key in PER_TOKEN_KEYS:
        if isinstance(batch.get(key), torch.Tensor):
            return key, batch[key]
    return "tokens", None


def _check_per_token(batch: Mapping[str, Any], reference_key: str, reference: torch.Tensor | None) -> None:
    if reference is None:
        return
    for key in PER_TOKEN_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.shape != reference.shape:
            _fail(
                f"{key} has shape {tuple(value.shape)} but {reference_key} has {tuple(reference.shape)}: "
                "every per-token tensor has the token shape"
            )
    mrope = batch.get("mrope_position_ids")
    if isinstance(mrope, torch.Tensor) and (mrope.dim() != 3 or mrope.shape[1:] != reference.shape):
        _fail(
            f"mrope_position_ids has shape {tuple(mrope.shape)}, expected (axes, {reference.shape[0]}, "
            f"{reference.shape[1]})"
        )


def _check_monotone(name: str, bounds: torch.Tensor) -> None:
    if len(bounds) < 2:
        _fail(f"{name} must hold at least [0, width] (2 entries), got {bounds.tolist()}")
    if int(bounds[0]) != 0:
        _fail(f"{name} must start at 0, got {int(bounds[0])} (boundaries {bounds.tolist()})")
    down = torch.nonzero(bounds.diff() < 0)
    if len(down):
        i = int(down[0, 0])
        _fail(
            f"{name} must never decrease: entry {i + 1} is {int(bounds[i + 1])} after {int(bounds[i])} "
            f"(boundaries {bounds.tolist()})"
        )


def _check_width(
    name: str, physical: torch.Tensor, end: int, width: int, tokens_key: str, cp_size: int | None
) -> int:
    """The last physical boundary against the token count; returns the context-parallel size it implies."""
    if end == width and cp_size in (None, 1):
        return 1
    if cp_size is None:  # a shard of some k-way split, when the row divides its boundaries evenly
        shard = end // width if width and end % width == 0 else 0
    else:
        shard = cp_size
    if shard < 1 or end != width * shard:
        expected = "the token count" if cp_size in (None, 1) else f"cp_size {cp_size} x the token count"
        _fail(
            f"{name} ends at {end} but {tokens_key} holds {width} tokens per row: the last boundary must be "
            f"{expected}"
        )
    uneven = torch.nonzero(physical.diff() % (2 * shard))
    if len(uneven):
        i = int(uneven[0, 0])
        _fail(
            f"{tokens_key} holds {width} of {end} tokens, a {shard}-way context-parallel shard, but "
            f"segment {i} of {name} has {int(physical.diff()[i])} tokens, not a multiple of "
            f"2 * cp_size = {2 * shard}"
        )
    return shard


def _check_legacy_padding(batch: Mapping[str, Any], key: str, rows: int) -> None:
    """Legacy boundaries: real entries, then only -1; the argmin (when given) is the first -1."""
    table = batch[key]
    argmin = batch.get(f"{key}_argmin")
    if argmin is not None and tuple(argmin.shape) != (rows, 1):
        _fail(f"{key}_argmin must have shape ({rows}, 1), got {tuple(argmin.shape)}")
    for row, values in enumerate(table.tolist()):
        negative = [i for i, v in enumerate(values) if v < 0]
        count = negative[0] if negative else len(values)
        if any(v != -1 for v in values[count:]):
            _fail(f"{_named(key, rows, row)} must be right-padded with -1 after its boundaries, got {values}")
        if argmin is not None and int(argmin[row, 0]) != count:
            _fail(
                f"{_named(key + '_argmin', rows, row)} is {int(argmin[row, 0])} but the first -1 of "
                f"{_named(key, rows, row)} is at {count} ({values})"
            )


def _check_max_seqlen(
    batch: Mapping[str, Any],
    stream: bool,
    rows: int,
    physical_rows: list[torch.Tensor],
    physical_name: str,
    current: bool,
) -> None:
    longest = [int(p.diff().max()) for p in physical_rows]
    for key in ("max_seqlen_q", "max_seqlen_kv") if current else ("max_seqlen",):
        value = batch.get(key)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if stream:
                shapes = [()]
            else:  # [B] only from the current keys with pad_cu_seqlens
                shapes = [(rows, 1), (rows,)] if current else [(rows, 1)]
            if tuple(value.shape) not in shapes:
                expected = " or ".join(str(list(s)) for s in shapes)
                _fail(f"{key} must have shape {expected} (one value per row), got {list(value.shape)}")
            values = value.reshape(-1).tolist()
        else:
            values = [int(value)] * rows
        for row, (bound, need) in enumerate(zip(values, longest, strict=True)):
            if bound < need:
                _fail(
                    f"{_named(key, rows, row)} is {bound}, less than the longest segment of "
                    f"{_named(physical_name, rows, row)} ({need} tokens)"
                )


def _check_token_count(
    batch: Mapping[str, Any],
    stream: bool,
    rows: int,
    physical_rows: list[torch.Tensor],
    logical_rows: list[torch.Tensor],
) -> None:
    counts = batch.get("token_count")
    if counts is None:
        return
    if not isinstance(counts, list | tuple) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in counts
    ):
        _fail(f"token_count must be a list of ints, got {counts!r}")
    if stream:  # text collators: real tokens of every packed sequence
        lengths = logical_rows[0].diff().tolist()
        if list(counts) != lengths:
            _fail(f"token_count is {list(counts)} but cu_seqlens_q gives the sequences {lengths} tokens")
        return
    if len(counts) != rows:
        _fail(f"token_count has {len(counts)} entries for {rows} rows (one per row)")
    for row, (count, physical) in enumerate(zip(counts, physical_rows, strict=True)):
        if not 0 <= count <= int(physical[-1]):
            _fail(f"token_count[{row}] is {count}, outside [0, {int(physical[-1])}] (the tokens of its row)")


def _check_segments(
    batch: Mapping[str, Any],
    rows: int,
    width: int,
    physical_rows: list[torch.Tensor],
    logical_rows: list[torch.Tensor],
    padded: bool,
) -> None:
    """Token-level keys against the boundaries: ``seq_idx``, and ``padding_mask`` when the batch has padded
    boundaries (as Megatron-Bridge's Qwen3-VL rebuilds the MoE padding mask from them)."""
    padding, seq_idx = batch.get("padding_mask"), batch.get("seq_idx")
    if padding is None and seq_idx is None:
        return
    for row, (physical, logical) in enumerate(zip(physical_rows, logical_rows, strict=True)):
        spans = physical.diff()
        segment = torch.repeat_interleave(torch.arange(len(spans)), spans.cpu())
        if seq_idx is not None:
            expected = segment.to(torch.int32)
            got = seq_idx[row].cpu()
            if not torch.equal(got, expected):
                at = int(torch.nonzero(got != expected)[0, 0])
                _fail(
                    f"{_named('seq_idx', rows, row)} at token {at} is {int(got[at])}, but the physical "
                    f"boundaries put that token in segment {int(expected[at])}"
                )
        if padding is None or not padded:  # it may mark the width padding, which counts as a segment
            continue
        got = padding[row].cpu()
        offset = torch.arange(width) - physical[:-1].cpu()[segment]
        expected = offset >= logical.diff().cpu()[segment]
        if not torch.equal(got, expected):
            at = int(torch.nonzero(got != expected)[0, 0])
            _fail(
                f"{_named('padding_mask', rows, row)} is {bool(got[at])} at token {at}: it must be True "
                "exactly on the alignment padding (each segment's tokens past its logical length)"
            )
