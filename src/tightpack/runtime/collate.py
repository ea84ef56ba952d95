"""Offline collate: packed rows -> one THD training batch, as Megatron-Bridge's packed collate
(docs/contract.md §2.10).

A row is ``{input_ids, loss_mask, seq_start_id}`` as stored (one pack; the mask label-aligned), with an
optional ``seq_len`` (real runtime length of every sequence, written by tightpack) and an optional
``padding_row`` (true on the padding rows `tightpack.runtime.dataset.PackedDataset` returns for
negative indices). Per stored sequence ``ids[s:e]`` the batch gets inputs ``ids[s:e-1]`` and labels
``ids[s+1:e]``; positions restart at 0 per sequence. The batch width is the pack size with
``pad_to_max_length``, else the longest row rounded up to ``pad_seq_length_to_mult`` (at most the pack
size); the width padding becomes a trailing pseudo-sequence in the boundaries, because rope and
attention kernels expect no unaccounted padding.

With an alignment multiple ``m > 1`` the boundaries come twice: physical (``cu_seqlens_q_padded``,
where segments start in the tensor) and logical (``cu_seqlens_q``, where real tokens end). Logical
lengths come from ``seq_len`` when the row has it, else from stripping trailing EOS tokens of each
input slice, as the reference does (see `PackedCollate` for where the two differ).

The arithmetic is numpy per row (no Python loop per token or per sequence); tensors are built once at
the end. Beyond the reference, the batch carries ``total_tokens`` (the width) and ``seq_idx`` (the
physical segment of every token, ``[B, W]`` int32: where Mamba/SSM layers reset their state).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.ranges import in_ranges
from tightpack.errors import TightpackError
from tightpack.runtime import thd
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.pack_rows import read_pack_row
from tightpack.runtime.pack_settings import resolve_pack_settings

__all__ = ["PackedCollate", "PackingMetadata", "split_microbatches"]


@dataclass(frozen=True)
class PackingMetadata:
    """The metadata values the static-shape collate needs (``pad_cu_seqlens``), over all entries of a
    metadata JSON list: max of ``max_samples_per_bin`` and ``dataset_max_seqlen``, min of
    ``min_packed_seqlen``."""

    max_samples_per_bin: int
    dataset_max_seqlen: int
    min_packed_seqlen: int

    @classmethod
    def from_entries(cls, entries: Sequence[Mapping[str, int]]) -> PackingMetadata:
        if not entries:
            raise TightpackError("the packing metadata list is empty; pad_cu_seqlens needs its values")
        return cls(
            max_samples_per_bin=max(int(e["max_samples_per_bin"]) for e in entries),
            dataset_max_seqlen=max(int(e["dataset_max_seqlen"]) for e in entries),
            min_packed_seqlen=min(int(e["min_packed_seqlen"]) for e in entries),
        )


@dataclass(frozen=True, kw_only=True)
class _Row:
    inputs: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    physical: np.ndarray  # boundaries over the row's runtime tokens, [0, ..., L]
    logical: np.ndarray | None  # only with alignment


@dataclass(frozen=True, kw_only=True)
class PackedCollate:
    """Collate packed rows into a THD batch.

    Two deliberate differences from the reference collate (docs/contract.md §2.10 and §10.1):

    - Padding rows add no loss, in any mode. A row with ``padding_row`` true gets an all-zero loss
      mask, also with ``answer_only_loss=False``, where the reference rebuilds the mask from the tokens
      (input != EOS) and so gives the real tokens of a padding row (the sampler's ``-1``) a loss,
      breaking its own rule that padding rows add nothing to the loss. With ``answer_only_loss=True``
      nothing changes: the dataset already zeroed the stored mask.
    - Logical lengths (aligned packs, ``m > 1``) come from the ``seq_len`` column when the row has it,
      where the reference strips the trailing EOS tokens of each input slice. The two differ for a
      sample whose content ends with the EOS id: content ``[10, 11, EOS]`` plus the EOS every sample
      ends with, aligned to 4 (stored ``[10, 11, EOS, EOS, EOS]``), gives inputs ``[10, 11, EOS, EOS]``
      and the stored loss mask ``[1, 1, 1, 0]`` (the third input learns the final EOS). ``seq_len``
      says 3: ``cu_seqlens_q = [0, 3]``, padding mask ``[F, F, F, T]``. Stripping says 2: ``[0, 2]``
      and ``[F, F, T, T]``, a supervised token marked as alignment padding. Rows without ``seq_len``
      (Megatron-Bridge's files) get the reference's rule; without alignment there are no logical
      boundaries and the two agree.

    Attributes:
        pack_size: P, the widest batch.
        eos_id: fills the width padding of tokens and labels; marks alignment padding.
        pad_to_max_length: width = P for every batch.
        pad_seq_length_to_mult: width multiple otherwise (the reference's default is 16).
        pad_seq_to_mult: per-sequence alignment multiple m of the packed data.
        answer_only_loss: loss from the stored mask; else on every input token that is not EOS
            (padding rows have no loss either way).
        metadata: needed for ``pad_cu_seqlens`` (static shapes, CUDA graphs).
        pad_cu_seqlens: every boundary array gets ``max_samples_per_bin + 2`` entries.
        legacy_keys: the boundary keys of packs made before Megatron-Bridge #5344 (``cu_seqlens``
            right-padded with -1, ``cu_seqlens_argmin``, ``max_seqlen``, and ``cu_seqlens_unpadded``
            with its argmin when aligned) instead of ``cu_seqlens_q/kv[_padded]`` and ``max_seqlen_q/kv``.
        vocab_size: every id (``eos_id``, the rows' ``input_ids``) must lie below it; None: unchecked.
        sources: where each value came from, for messages (`from_dataset` fills it).

    Every row is checked first (`tightpack.runtime.pack_rows.read_pack_row`): a malformed row, or
    one whose segments do not fit ``pad_seq_to_mult``, is a `PackRowError` naming the row and the key.
    `from_dataset` takes the pack size, pad id and multiple from the packs' manifest.

    >>> collate = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1)
    >>> rows = [{"input_ids": [1, 3, 4, 2, 5, 6, 7, 2], "loss_mask": [0] * 8, "seq_start_id": [0, 4]},
    ...         {"input_ids": [1, 3, 4, 5, 6, 7, 8, 2], "loss_mask": [0] * 8, "seq_start_id": [0]}]
    >>> batch = collate(rows)
    >>> batch["cu_seqlens_q"].tolist(), batch["max_seqlen_q"].tolist()
    ([[0, 3, 6, 7], [0, 7, 7, 7]], [[3], [7]])
    """

    pack_size: int
    eos_id: int
    pad_to_max_length: bool = False
    pad_seq_length_to_mult: int = 16
    pad_seq_to_mult: int = 1
    answer_only_loss: bool = True
    pad_cu_seqlens: bool = False
    metadata: PackingMetadata | None = None
    legacy_keys: bool = False
    vocab_size: int | None = None
    sources: Mapping[str, str] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dataset(
        cls,
        dataset: PackedDataset | str | os.PathLike,
        *,
        pack_size: int | None = None,
        eos_id: int | None = None,
        pad_seq_to_mult: int | None = None,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        caller: str = "PackedCollate",
        **options: Any,
    ) -> PackedCollate:
        """The collate for ``dataset``'s packs: pack size, pad id and alignment multiple from what the
        packs record (`PackedDataset.settings`), unless given.

        Args:
            dataset: a `PackedDataset`, or the path it would read.
            pack_size: as the field; a given value must agree with the packs' or be larger (wider
                batches).
            eos_id: as the field; a given value must agree with the packs'.
            pad_seq_to_mult: as the field; a given value must agree with the packs'.
            tokenizer: a `TokenizerSpec`, tokenizer folder or transformers tokenizer: the EOS id when
                the packs record none (it must agree with theirs), and the vocabulary the ids must lie in.
            vocab_size: ids must lie below it (e.g. the model's ``config.vocab_size``).
            caller: who passed the arguments, as the messages name it.
            options: the other fields (``pad_to_max_length``, ``metadata``, ...).

        Raises:
            TightpackError: a value that disagrees with the packs or lies outside the vocabulary, naming
                both values and where each came from; a value the packs do not record and not given.

        Example (packs made with a Llama tokenizer, ``eos_id`` 2, multiple 4)::

            collate = PackedCollate.from_dataset(PackedDataset("packed"), pad_to_max_length=True)
            collate.eos_id, collate.pad_seq_to_mult  # 2, 4
            PackedCollate.from_dataset("packed", eos_id=50256)  # TightpackError: eos_id 50256 (...
        """
        packs = dataset if isinstance(dataset, PackedDataset) else PackedDataset(dataset)
        resolved = resolve_pack_settings(
            packs.settings,
            pack_size=pack_size,
            eos_id=eos_id,
            pad_seq_to_mult=pad_seq_to_mult,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            caller=caller,
        )
        return cls(
            pack_size=resolved.pack_size,
            eos_id=resolved.eos_id,
            pad_seq_to_mult=resolved.pad_seq_to_mult,
            vocab_size=resolved.vocab_size,
            sources=resolved.sources,
            **options,
        )

    def __post_init__(self) -> None:
        if self.pad_cu_seqlens and self.metadata is None:
            raise TightpackError("pad_cu_seqlens needs the packing metadata (metadata.json)")
        if self.pad_cu_seqlens and not self.pad_to_max_length:
            raise TightpackError("'pad_to_max_length=True' is required when pad_cu_seqlens is enabled")
        for name in ("pack_size", "pad_seq_length_to_mult", "pad_seq_to_mult"):
            if getattr(self, name) < 1:
                raise TightpackError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.eos_id < 0 or (self.vocab_size is not None and self.eos_id >= self.vocab_size):
            sources = self.sources or {}
            raise TightpackError(
                f"eos_id {self.eos_id} ({sources.get('eos_id', 'PackedCollate argument')}) lies outside "
                + (
                    f"the vocabulary of {self.vocab_size} tokens "
                    f"({sources.get('vocab_size', 'PackedCollate argument vocab_size')})"
                    if self.vocab_size is not None
                    else "ids >= 0"
                )
            )

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = self._collate(rows)
        thd.check_thd_batch(batch)
        return batch

    def _collate(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise TightpackError("cannot collate an empty batch")
        split = [self._split(row, position) for position, row in enumerate(rows)]
        longest = max(len(row.inputs) for row in split)
        if self.pad_to_max_length:
            width = self.pack_size
        else:
            width = min(self.pack_size, int(ceil_to_multiple(longest, self.pad_seq_length_to_mult)))
        if longest > width:
            raise TightpackError(
                f"a packed row holds {longest} runtime tokens, more than the pack size {width}"
            )
        aligned = self.pad_seq_to_mult > 1
        tokens = np.full((len(rows), width), self.eos_id, dtype=np.int64)
        labels = np.full((len(rows), width), self.eos_id, dtype=np.int64)
        loss_mask = np.zeros((len(rows), width), dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64)
        padding = np.ones((len(rows), width), dtype=bool)
        seq_idx = np.zeros((len(rows), width), dtype=np.int32)
        physical, logical = [], []
        for r, row in enumerate(split):
            n = len(row.inputs)
            tokens[r, :n], labels[r, :n], loss_mask[r, :n], positions[r, :n] = (
                row.inputs, row.labels, row.loss_mask, row.positions,
            )  # fmt: skip
            bounds = row.physical if row.physical[-1] == width else np.append(row.physical, width)
            physical.append(bounds)
            seq_idx[r] = np.repeat(np.arange(len(bounds) - 1, dtype=np.int32), np.diff(bounds))
            if aligned:
                real = (
                    row.logical
                    if len(bounds) == len(row.logical)
                    else np.append(row.logical, row.logical[-1])
                )
                logical.append(real)
                padding[r] = ~in_ranges(bounds[:-1], bounds[:-1] + np.diff(real), width)
            else:
                padding[r, :n] = False

        batch: dict[str, Any] = {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(positions),
            "padding_mask": torch.from_numpy(padding),
            "seq_idx": torch.from_numpy(seq_idx),
            "total_tokens": width,
            "token_count": [len(row.inputs) for row in split],
            "attention_mask": None,
        }
        if self.pad_cu_seqlens:  # static shapes; logical and physical boundaries keep the same length
            slots = self.metadata.max_samples_per_bin + 2
            physical = [_extend(b, max(slots, len(b)), fill=width) for b in physical]
            logical = [_extend(b, max(slots, len(b))) for b in logical]
        if self.legacy_keys:
            return {**batch, **_legacy_boundaries(physical, logical, aligned)}
        count = max(len(b) for b in physical + logical)
        cu = torch.from_numpy(np.stack([_extend(b, count) for b in physical]).astype(np.int32))
        if self.pad_cu_seqlens:
            fill = max(self.metadata.dataset_max_seqlen, width - self.metadata.min_packed_seqlen)
            max_seqlen = torch.full((len(rows),), fill, dtype=torch.int32)
        else:
            max_seqlen = torch.tensor([[int(np.diff(b).max())] for b in physical], dtype=torch.int32)
        if aligned:
            cu_logical = torch.from_numpy(np.stack([_extend(b, count) for b in logical]).astype(np.int32))
            batch.update(cu_seqlens_q=cu_logical, cu_seqlens_kv=cu_logical)
            batch.update(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
        else:
            batch.update(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        batch.update(max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return batch

    def _split(self, row: Mapping[str, Any], position: int) -> _Row:
        """Inputs, labels, mask, positions and boundaries of one stored row (checked first)."""
        sources = self.sources or {}
        padding_row = bool(row.get("padding_row", False)) if isinstance(row, Mapping) else False
        stored_row = read_pack_row(
            row,
            position,
            multiple=self.pad_seq_to_mult,
            multiple_source=sources.get("pad_seq_to_mult", "PackedCollate argument"),
            vocab_size=self.vocab_size,
            vocab_source=sources.get("vocab_size", "PackedCollate argument vocab_size"),
            need_loss_mask=self.answer_only_loss and not padding_row,
        )
        ids, starts, stored = stored_row.ids, stored_row.starts, stored_row.stored
        last = starts + stored - 1  # the last stored token of each sequence: a label, never an input
        is_input = np.ones(len(ids), dtype=bool)
        is_input[last] = False
        is_label = np.ones(len(ids), dtype=bool)
        is_label[starts] = False
        inputs = ids[is_input]
        if padding_row:  # the sampler's -1 rows: real tokens, never any loss
            loss_mask = np.zeros(len(inputs), dtype=np.int64)
        elif self.answer_only_loss:
            loss_mask = stored_row.loss_mask[is_input]
        else:
            loss_mask = (inputs != self.eos_id).astype(np.int64)
        runtime = stored - 1
        physical = np.concatenate(([0], np.cumsum(runtime)))
        positions = np.arange(len(inputs)) - np.repeat(physical[:-1], runtime)
        logical = None
        if self.pad_seq_to_mult > 1:
            if stored_row.seq_len is not None:
                real = stored_row.seq_len
            else:  # the reference's rule: 1 + index of the last non-EOS input of each sequence
                real = _strip_trailing(inputs, physical, self.eos_id)
            logical = np.concatenate(([0], np.cumsum(real)))
        return _Row(
            inputs=inputs, labels=ids[is_label], loss_mask=loss_mask, positions=positions,
            physical=physical, logical=logical,
        )  # fmt: skip


def _legacy_boundaries(physical: list[np.ndarray], logical: list[np.ndarray], aligned: bool) -> dict:
    """The legacy keys: boundaries right-padded with -1 (at least one -1 column) and the index of the
    first -1 per row, so that consumers can trim without a device sync."""

    def padded(bounds: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        columns = max(len(b) for b in bounds) + 1
        table = np.stack([_extend(b, columns, fill=-1) for b in bounds]).astype(np.int32)
        argmin = np.array([[len(b)] for b in bounds], dtype=np.int64)
        return torch.from_numpy(table), torch.from_numpy(argmin)

    cu_seqlens, argmin = padded(physical)
    keys = {
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_argmin": argmin,
        "max_seqlen": torch.tensor([[int(np.diff(b).max())] for b in physical], dtype=torch.int32),
    }
    if aligned:
        keys["cu_seqlens_unpadded"], keys["cu_seqlens_unpadded_argmin"] = padded(logical)
    return keys


def _strip_trailing(inputs: np.ndarray, bounds: np.ndarray, eos_id: int) -> np.ndarray:
    """Per segment ``[bounds[i], bounds[i+1])``: 1 + the offset of its last non-EOS token (0 if none)."""
    # One 0 past the end, so that a trailing empty segment (start == len(inputs)) is a valid start and
    # the segment before it still reduces over all of its inputs.
    kept = np.append(np.where(inputs != eos_id, np.arange(1, len(inputs) + 1), 0), 0)
    segment_ends = np.maximum.reduceat(kept, bounds[:-1])
    empty = bounds[1:] == bounds[:-1]
    return np.where(empty, 0, np.maximum(segment_ends - bounds[:-1], 0))


def _extend(bounds: np.ndarray, length: int, fill: int | None = None) -> np.ndarray:
    """Boundaries right-padded to ``length`` with ``fill`` (default: the last value: empty sequences)."""
    extra = length - len(bounds)
    return np.concatenate((bounds, np.full(extra, bounds[-1] if fill is None else fill, dtype=bounds.dtype)))


def split_microbatches(batch: Mapping[str, Any], num_microbatches: int) -> list[dict[str, Any]]:
    """Split a collated ``[B, W]`` batch into ``num_microbatches`` along dim 0 (docs/contract.md §2.11).

    With ``dataloader_type="batch"`` one collate call receives a data-parallel rank's whole share of a
    global batch; each micro-batch (one packed row with offline packing) then goes to the model on its
    own. Tensors and per-row lists are split; other values (``total_tokens``, None) are shared.

    Raises:
        ValueError: when the batch size is not divisible by ``num_microbatches``.
    """
    rows = batch["tokens"].shape[0]
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"Batch size {rows} is not divisible by num_microbatches {num_microbatches}")
    size = rows // num_microbatches
    parts: list[dict[str, Any]] = [{} for _ in range(num_microbatches)]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            pieces = torch.tensor_split(value, num_microbatches, dim=0)
        elif isinstance(value, list) and len(value) == rows:
            pieces = [value[i * size : (i + 1) * size] for i in range(num_microbatches)]
        else:
            pieces = [value] * num_microbatches
        for part, piece in zip(parts, pieces, strict=True):
            part[key] = piece
    for part in parts:
        thd.check_thd_batch(part)
    return parts
