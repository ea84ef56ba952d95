"""Text SFT collators with collate-time packing (docs/contract.md §3.4).

`TextSFTCollator` takes raw rows (prompt-completion or chat, as ``tightpack pack`` reads them), turns
each into tokens and a loss mask with the same formatter and tokenizer as the offline path (EOS
appended), shifts them into labels, and returns either one packed ``[1, T]`` THD row
(``enable_in_batch_packing``; `tightpack.runtime.in_batch.build_thd_from_rows`) or a right-padded
``[B, S]`` batch.

Rows over ``max_length`` follow the offline path's long-sample rules (``long_samples``, see
`tightpack.runtime.collate_truncation`): the prompt is trimmed, the oldest rounds dropped, then the
answer cut; a sample with no supervised token is left out, and the counts are in
``long_sample_counts`` (running totals) and ``last_batch_counts``.

Label shift: ``labels = ids[1:] + [ignore]``, ``mask = mask[1:] + [0]``, and labels whose mask is 0
become ``ignore_index``. Packed batches carry ``tokens`` (the same tensor as ``input_ids``),
``token_count`` (real tokens per row) and a ``padding_mask`` when the alignment multiple is above 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from tightpack.core.alignment import ceil_to_multiple
from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.tokenize import Encoder
from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer
from tightpack.runtime import thd
from tightpack.runtime.collate_truncation import LongSampleCounts, LongSampleRules
from tightpack.runtime.in_batch import build_thd_from_rows
from tightpack.runtime.online_config import LongSamples

__all__ = ["TextSFTCollator"]

LossMode = Literal["assistant", "last_turn", "full"]
_LOSS_ON = {"assistant": "assistant", "last_turn": "last-turn", "full": "all"}


def shift_labels(
    ids: np.ndarray, mask: np.ndarray, ignore_index: int = -100
) -> tuple[np.ndarray, np.ndarray]:
    """Labels and label-aligned loss mask of one sample (token ``t`` is trained to predict ``t+1``).

    >>> labels, mask = shift_labels(np.array([11, 12, 21, 22]), np.array([0, 0, 1, 1]))
    >>> labels.tolist(), mask.tolist()
    ([-100, 21, 22, -100], [0.0, 1.0, 1.0, 0.0])
    """
    mask = np.append(np.asarray(mask)[1:], 0).astype(np.float32)
    labels = np.append(np.asarray(ids)[1:], ignore_index).astype(np.int64)
    labels[mask == 0] = ignore_index
    return labels, mask


def check_in_batch_loader(
    *, enable_in_batch_packing: bool, dataloader_type: str, micro_batch_size: int
) -> None:
    """The dataloader rule of in-batch packing: ``single`` or ``cyclic`` loaders, micro-batches above 1.

    With ``batch`` loaders one collate call receives a rank's whole global batch, and packing it into
    one row breaks the split into micro-batches (docs/contract.md §3.7).
    """
    if not enable_in_batch_packing:
        return
    if dataloader_type == "batch":
        raise TightpackError(
            "in-batch packing needs dataloader_type 'single' or 'cyclic': with 'batch' one collate call gets "
            "the whole global batch, which cannot be split into micro-batches once packed into one row"
        )
    if micro_batch_size < 2:
        raise TightpackError(
            f"in-batch packing packs the rows of a micro-batch; micro_batch_size is {micro_batch_size}, "
            "set it above 1 (or use offline packing)"
        )


class TextSFTCollator:
    """Collate raw SFT rows into a packed THD row or a padded batch.

    Args:
        tokenizer: a `TokenizerSpec`, a tokenizer path, or None for the built-in GPT-2.
        format: how rows become text (default: auto-detected chat or prompt-completion).
        loss_mode: chat loss on ``assistant`` turns, the ``last_turn``, or ``full`` (every token).
        max_length: tokens a sample may take in the batch (its EOS included, an input here): a longer
            sample is cut or left out by ``long_samples``. ``max_length = L + 1`` keeps what
            ``tightpack pack --max-seq-length L`` keeps (offline packs hold no final EOS as input).
        long_samples: a sample over ``max_length``: ``truncate`` (default) cuts it as
            ``tightpack pack`` does (``format.truncation_method`` and ``chat_truncation``), ``drop``
            leaves it out, ``error`` raises. Samples left with no supervised token are left out;
            a batch left with none raises `TightpackError`.
        enable_in_batch_packing: pack the micro-batch into one ``[1, T]`` row.
        in_batch_packing_pad_to_multiple_of: per-row alignment multiple when packing.
        pad_to_max_length: when not packing, pad every row to ``max_length``.
        pad_to_multiple_of: when not packing, pad the width to a multiple of this.
        pad_token_id: the id of padding tokens (default: the tokenizer's EOS).
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec | str | None = None,
        *,
        format: FormatConfig | None = None,
        loss_mode: LossMode = "assistant",
        max_length: int | None = None,
        long_samples: LongSamples = "truncate",
        enable_in_batch_packing: bool = False,
        in_batch_packing_pad_to_multiple_of: int = 1,
        pad_to_max_length: bool = False,
        pad_to_multiple_of: int = 1,
        ignore_index: int = -100,
        pad_token_id: int | None = None,
    ) -> None:
        if loss_mode not in _LOSS_ON:
            raise TightpackError(f"loss_mode must be one of {', '.join(_LOSS_ON)}; got {loss_mode!r}")
        if pad_to_max_length and max_length is None and not enable_in_batch_packing:
            raise TightpackError("pad_to_max_length needs max_length")
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
        config = dataclasses.replace(format or FormatConfig(), loss_on=_LOSS_ON[loss_mode])
        self.encoder = Encoder(spec, config)
        self.long_samples = LongSampleRules(
            max_length, long_samples, config.truncation_method, owner=type(self).__name__, stored_extra=0
        )
        self.pad_token_id = spec.eos_id if pad_token_id is None else pad_token_id
        self.max_length = max_length
        self.enable_in_batch_packing = enable_in_batch_packing
        self.packing_multiple = in_batch_packing_pad_to_multiple_of
        self.pad_to_max_length = pad_to_max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.ignore_index = ignore_index

    def encode(self, examples: Sequence[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(token ids, unshifted loss mask) of every example fed, EOS appended, fitted to ``max_length``.

        Samples left out (too long under ``long_samples="drop"``, or without a supervised token) are
        not in the list; ``last_batch_counts`` says how many and why.
        """
        result = self.encoder.encode_rows(list(examples), source="batch")
        if result.bad_rows:
            bad = result.bad_rows[0]
            raise TightpackError(f"{bad.location}: {bad.reason}")
        return self.long_samples.fit(result)[1]

    @property
    def long_sample_counts(self) -> LongSampleCounts:
        """Running totals of the batches collated so far (in this process: with DataLoader workers,
        each worker holds its own)."""
        return self.long_samples.totals

    @property
    def last_batch_counts(self) -> LongSampleCounts:
        """The counts of the last batch collated."""
        return self.long_samples.last

    def __call__(self, examples: Sequence[Any]) -> dict[str, Any]:
        return self.collate_tokenized(self.encode(examples))

    def collate_tokenized(self, samples: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        """The batch of already tokenized samples: ``(ids, unshifted mask)`` each, taken as they are
        (``max_length`` and ``long_samples`` apply to rows, in `encode`)."""
        rows = []
        for ids, mask in samples:
            labels, loss_mask = shift_labels(ids, mask, self.ignore_index)
            rows.append(
                {
                    "input_ids": torch.as_tensor(np.asarray(ids, dtype=np.int64)),
                    "labels": torch.from_numpy(labels),
                    "loss_mask": torch.from_numpy(loss_mask),
                    "position_ids": torch.arange(len(ids)),
                }
            )
        if self.enable_in_batch_packing:
            batch = build_thd_from_rows(
                rows,
                sequence_length=self.max_length,
                pad_token_id=self.pad_token_id,
                ignore_index=self.ignore_index,
                pad_to_multiple_of=self.packing_multiple,
                emit_padding_mask=self.packing_multiple > 1,
            )
            batch["tokens"] = batch["input_ids"]
            batch["token_count"] = [len(row["input_ids"]) for row in rows]
            thd.check_thd_batch(batch)
            return batch
        return self._padded(rows)

    def _padded(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        longest = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_max_length:
            width = self.max_length
        else:
            width = ceil_to_multiple(longest, self.pad_to_multiple_of)
            width = min(width, self.max_length) if self.max_length else width
        pads = {
            "input_ids": self.pad_token_id,
            "labels": self.ignore_index,
            "loss_mask": 0,
            "position_ids": 0,
        }
        batch: dict[str, Any] = {}
        for key, pad in pads.items():
            first = rows[0][key]
            out = torch.full((len(rows), width), pad, dtype=first.dtype)
            for i, row in enumerate(rows):
                out[i, : len(row[key])] = row[key]
            batch[key] = out
        lengths = torch.tensor([len(row["input_ids"]) for row in rows])
        batch["attention_mask"] = (torch.arange(width)[None] < lengths[:, None]).long()
        batch["tokens"] = batch["input_ids"]
        batch["token_count"] = lengths.tolist()
        return batch
