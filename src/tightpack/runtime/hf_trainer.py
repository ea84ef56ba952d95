"""Packing for Hugging Face ``Trainer`` (and TRL on top of it): a data collator and its guards.

`PackingCollator` turns either offline packs (`tightpack.runtime.dataset.PackedDataset` rows) or raw
SFT rows (packed at collate time) into what transformers causal LMs take for packed input, one
``[1, T]`` row per micro-batch:

- ``input_ids``, ``position_ids`` restarting at every sequence (transformers builds the block-diagonal
  mask from them for eager, sdpa and flex attention);
- ``labels`` in transformers' convention (the model shifts them): -100 on every token that is not a
  target and on every sequence's first token, so no sequence learns to predict the next one;
- ``shift_labels``, the targets already aligned, which the causal-LM loss takes as they are (then
  ``labels`` is not read) and which ``Trainer`` counts for ``num_items_in_batch``: the loss of a
  gradient-accumulation step is the sum over its supervised tokens divided by their number, as in an
  unpacked run. Offline packs do not hold a sample's final EOS as an input (Megatron-Bridge's
  layout): the target of its last input is that EOS, in ``shift_labels`` only;
- ``cu_seq_lens_q/k`` and ``max_length_q/k`` for flash-attention kernels, ``seq_idx``;
- ``use_cache=False`` (with a cache transformers attends across the packed sequences) and no
  ``attention_mask`` (a 2-D mask makes it ignore the sequence boundaries).

Raw rows over ``max_length`` follow the offline path's long-sample rules (``long_samples``,
`tightpack.runtime.collate_truncation`); the collator counts what it cut or left out
(``long_sample_counts``) and `PackingCallback` adds the totals to the Trainer's logs
(``tightpack/prompt_trimmed``, ...).

`PackingCallback` checks the model when training starts: an attention implementation that would
attend across sequences, a model family that cannot be packed, or a Qwen-VL model (which needs
`tightpack.runtime.hf.packed_forward`'s positions), stops the run with the fix; then the first
training forward runs the equivalence probe on its batch (`tightpack.runtime.equivalence`). The
collator itself stops at the first batch when ``Trainer`` dropped the columns it needs
(``remove_unused_columns=True`` on a ``datasets.Dataset``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from tightpack.errors import TightpackError
from tightpack.logs import logger
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.collate_truncation import LOGGED_COUNTS, LongSampleCounts
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.equivalence import ProbeReport, ProbeSkipped, probe_enabled
from tightpack.runtime.equivalence.hf import packed_row_bounds
from tightpack.runtime.hf import check_packable, check_packing, hf_packed_kwargs
from tightpack.runtime.online_config import LongSamples
from tightpack.runtime.pack_rows import PackRowError
from tightpack.runtime.sft_collate import LossMode, TextSFTCollator

__all__ = ["PackingCallback", "PackingCollator", "trainer_inputs"]

_PACK_COLUMNS = ("input_ids", "loss_mask", "seq_start_id")
_ROW_KEYS = ("messages", "input", "output", "text")
_TOKEN_KEYS = ("input_ids", "position_ids", "labels", "shift_labels")
_ARGUMENT = "PackingCollator argument"
_DEFAULT_MULTIPLE = "PackingCollator's default without packs=, which reads the packs' own"


def trainer_inputs(batch: Mapping[str, Any], ignore_index: int = -100) -> dict[str, Any]:
    """The model inputs of one packed THD row (``[1, T]``, label-aligned ``labels`` and ``loss_mask``).

    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
    ...          "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
    ...          "labels": torch.tensor([[6, 7, 0, 9, 0]]), "loss_mask": torch.tensor([[0, 1, 0, 1, 0]]),
    ...          "cu_seqlens_q": torch.tensor([0, 3, 5], dtype=torch.int32)}
    >>> inputs = trainer_inputs(batch)
    >>> inputs["labels"].tolist(), inputs["shift_labels"].tolist()
    ([[-100, -100, 7, -100, 9]], [[-100, 7, -100, 9, -100]])
    """
    kwargs = hf_packed_kwargs(batch)
    supervised = batch["loss_mask"].reshape(kwargs["input_ids"].shape) > 0
    shift_labels = torch.where(supervised, batch["labels"].reshape(supervised.shape).long(), ignore_index)
    labels = torch.full_like(shift_labels, ignore_index)
    labels[:, 1:] = shift_labels[:, :-1]
    # A sequence's first token is no target: in offline packs the last input of the previous sequence
    # predicts an EOS that is not an input, which only ``shift_labels`` can say (and the loss reads).
    labels[0, kwargs["cu_seq_lens_q"][:-1].long()] = ignore_index
    return kwargs | {
        "input_ids": kwargs["input_ids"].long(),
        "position_ids": kwargs["position_ids"].long(),
        "labels": labels,
        "shift_labels": shift_labels,
        "use_cache": False,
    }


def _concatenate(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``[1, T]`` row of several rows' inputs (boundaries shifted, sequence ids renumbered)."""
    if len(parts) == 1:
        return parts[0]
    out = {key: torch.cat([part[key] for part in parts], dim=1) for key in _TOKEN_KEYS}
    widths = torch.tensor([part["input_ids"].shape[1] for part in parts])
    counts = torch.tensor([len(part["cu_seq_lens_q"]) - 1 for part in parts])
    token_offsets, sequence_offsets = torch.cumsum(widths, 0) - widths, torch.cumsum(counts, 0) - counts
    bounds = torch.cat(
        [torch.zeros(1, dtype=torch.int32)]
        + [part["cu_seq_lens_q"][1:] + offset for part, offset in zip(parts, token_offsets, strict=True)]
    ).to(torch.int32)
    seq_idx = torch.cat(
        [part["seq_idx"] + offset for part, offset in zip(parts, sequence_offsets, strict=True)], 1
    )
    longest = max(part["max_length_q"] for part in parts)
    return out | {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest,
                  "max_length_k": longest, "seq_idx": seq_idx, "use_cache": False}  # fmt: skip


class PackingCollator:
    """``data_collator`` for ``transformers.Trainer``: each micro-batch becomes one packed ``[1, T]`` row.

    Features are offline packs (rows of `tightpack.runtime.dataset.PackedDataset`, or of a
    ``datasets.Dataset`` read from packed Parquet: ``input_ids``, ``loss_mask``, ``seq_start_id``,
    ``seq_len``), or raw SFT rows (chat or prompt-completion, as ``tightpack pack`` reads them),
    tokenized and packed here. A feature that is itself a list of rows is a whole micro-batch (a
    dataset of micro-batches, e.g. from `TokenBudgetBatchSampler`, with ``per_device_train_batch_size=1``).

    Args:
        tokenizer: for raw rows: a `TokenizerSpec` or path (None: the built-in GPT-2). For offline
            packs, when given: the vocabulary their ids must lie in, and their EOS id.
        format: for raw rows, as `TextSFTCollator`.
        loss_mode: for raw rows, as `TextSFTCollator`.
        max_length: for raw rows, as `TextSFTCollator`: a row over ``max_length`` tokens (its EOS
            included) is cut as ``tightpack pack --max-seq-length max_length-1`` cuts it
            (``long_samples="truncate"``), left out (``"drop"``) or refused (``"error"``); a row with no
            supervised token left is left out, and a micro-batch left with none raises `TightpackError`.
            Counts: ``long_sample_counts`` (totals), ``last_batch_counts``.
        long_samples: for raw rows, as `TextSFTCollator` (see ``max_length``).
        pad_to_multiple_of: for raw rows, as `TextSFTCollator`.
        packs: the offline packs the features come from (a `PackedDataset` or its path): their
            manifest gives ``pack_size``, ``pad_seq_to_mult`` and ``eos_id`` (`PackedCollate.from_dataset`),
            and a value given here must agree with it.
        pack_size: for offline packs, as `PackedCollate`.
        pad_seq_to_mult: for offline packs, as `PackedCollate`: the packs' alignment multiple, default
            1 without ``packs``.
        eos_id: for offline packs, as `PackedCollate`: their pad id.
        vocab_size: ids of offline packs must lie below it (e.g. the model's ``config.vocab_size``).

    Raises:
        TightpackError: at construction, a value that disagrees with the packs' manifest or lies outside
            the vocabulary; when collating, a malformed pack row (`PackRowError`, naming the row of the
            micro-batch and the key) or one whose segments do not fit ``pad_seq_to_mult``.
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec | str | None = None,
        *,
        format: FormatConfig | None = None,
        loss_mode: LossMode = "assistant",
        max_length: int | None = None,
        long_samples: LongSamples = "truncate",
        pad_to_multiple_of: int = 1,
        packs: PackedDataset | str | os.PathLike | None = None,
        pack_size: int | None = None,
        pad_seq_to_mult: int | None = None,
        eos_id: int | None = None,
        vocab_size: int | None = None,
        ignore_index: int = -100,
    ) -> None:
        self.ignore_index = ignore_index
        self.rows = TextSFTCollator(
            tokenizer, format=format, loss_mode=loss_mode, max_length=max_length, long_samples=long_samples,
            enable_in_batch_packing=True, in_batch_packing_pad_to_multiple_of=pad_to_multiple_of,
            ignore_index=ignore_index,
        )  # fmt: skip
        self.rows.long_samples.owner = "PackingCollator"
        given = None if tokenizer is None else self.rows.encoder.spec
        if packs is not None:
            self.packs = PackedCollate.from_dataset(
                packs, pack_size=pack_size, eos_id=eos_id, pad_seq_to_mult=pad_seq_to_mult,
                tokenizer=given, vocab_size=vocab_size, caller="PackingCollator", pad_seq_length_to_mult=1,
            )  # fmt: skip
            return
        spec = self.rows.encoder.spec
        vocab_source = "PackingCollator argument vocab_size"
        if vocab_size is None and given is not None:
            vocab_size, vocab_source = given.vocab_size or None, f"the vocabulary of tokenizer {spec.name!r}"
        self.packs = PackedCollate(
            pack_size=pack_size or 1 << 30,
            eos_id=spec.eos_id if eos_id is None else eos_id,
            pad_seq_length_to_mult=1,
            pad_seq_to_mult=1 if pad_seq_to_mult is None else pad_seq_to_mult,
            vocab_size=vocab_size,
            sources={
                "eos_id": f"the EOS id of tokenizer {spec.name!r}" if eos_id is None else _ARGUMENT,
                "pad_seq_to_mult": _DEFAULT_MULTIPLE if pad_seq_to_mult is None else _ARGUMENT,
                "vocab_size": vocab_source,
            },
        )

    @property
    def long_sample_counts(self) -> LongSampleCounts:
        """Running totals of what the raw rows collated so far lost to ``max_length`` and the
        no-supervision rule (`tightpack.runtime.collate_truncation.COUNT_NAMES`); offline packs add
        nothing (``tightpack pack``'s manifest counts theirs)."""
        return self.rows.long_sample_counts

    @property
    def last_batch_counts(self) -> LongSampleCounts:
        """The counts of the last micro-batch of raw rows."""
        return self.rows.last_batch_counts

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        if len(features) == 1 and isinstance(features[0], (list, tuple)):
            features = features[0]
        if not features:
            raise TightpackError("PackingCollator received an empty micro-batch")
        first = features[0]
        if not isinstance(first, Mapping):
            raise TightpackError(f"PackingCollator takes rows (mappings), got {type(first).__name__}")
        if all(key in first for key in _PACK_COLUMNS):
            return _concatenate(
                [self._pack_inputs(feature, position) for position, feature in enumerate(features)]
            )
        if any(key in first for key in _ROW_KEYS):
            return trainer_inputs(self.rows(list(features)), self.ignore_index)
        raise TightpackError(
            f"PackingCollator got rows with the columns {sorted(first)}: packs need "
            f"{', '.join(_PACK_COLUMNS)} and raw rows one of {', '.join(_ROW_KEYS)}. Trainer drops the "
            "columns its model does not take from a datasets.Dataset: set "
            "TrainingArguments(remove_unused_columns=False)"
        )

    def _pack_inputs(self, feature: Mapping[str, Any], position: int) -> dict[str, Any]:
        try:
            batch = self.packs([feature])
        except PackRowError as error:  # collated one by one: name its place in the micro-batch
            raise error.at(position) from None
        return trainer_inputs(batch, self.ignore_index)


class PackingCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that proves packing on the model before it learns anything.

    When training starts it refuses what is known not to work (`tightpack.runtime.hf.check_packable`:
    an attention implementation that crosses sequences, a model family the installed transformers
    cannot pack, a Qwen-VL model, whose packed rows need `tightpack.runtime.hf.packed_forward`'s
    positions). Then the first training forward runs the equivalence probe
    (`tightpack.runtime.equivalence`) on the batch it receives, before that forward and so before the
    first optimizer step: a failure stops the run, a pass logs one line. ``report`` holds the
    `ProbeReport` (None until the probe ran, or when it could not be built from the batch).

    Preference rows (`tightpack.runtime.preference_trainer.PreferencePackingCollator`) are probed too:
    a ``pairs`` row through the forward's own inputs, as any packed row; a ``shared-prefix`` row,
    whose forward carries a 4-D attention mask the probe cannot take apart, through the preference
    row the collator last built (`tightpack.runtime.equivalence.preference.probe_shared_prefix`: a
    branch must not move when its sibling changes), run as training runs it. That row lives in the
    process that collates it: with ``dataloader_num_workers > 0`` the probe is skipped with a warning
    (check a row yourself with `tightpack.runtime.equivalence.check_packing`).

    At every log it adds the collator's running totals of what raw rows lost to ``max_length`` and
    the no-supervision rule (`PackingCollator.long_sample_counts`; `LOGGED_COUNTS`) to the logs and
    to ``state.log_history``, as ``tightpack/prompt_trimmed``, ``tightpack/no_supervised``, ...; for
    preference rows the collator's counts (`PreferencePackingCollator.logged_counts`:
    ``tightpack/units``, ``tightpack/dropped_too_long``, ...). The totals are of the batches
    collated so far (the loader may have collated a few ahead); with ``dataloader_num_workers > 0``
    each worker process counts its own and none reach this process.

    Args:
        probe: run the probe (default True; the environment variable ``TIGHTPACK_PROBE=0`` turns it off
            too).
        collator: whose counts to log; None: the training dataloader's collator, when it has counts.

    Raises:
        TightpackError: at the start of training, for what `check_packable` refuses.
        PackingLeakError: at the first forward, when the probe fails.
    """

    def __init__(self, probe: bool = True, collator: Any = None) -> None:
        self.probe = probe
        self.collator = collator
        self.report: ProbeReport | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._rows: Any = collator  # where the probe finds a shared-prefix row: the training collator

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs) -> None:
        if model is None:
            return
        self._rows = self.collator or getattr(train_dataloader, "collate_fn", None)
        check_packable(model)
        if self.probe and probe_enabled() and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._probe_first_batch, with_kwargs=True)

    def on_log(self, args, state, control, logs=None, train_dataloader=None, **kwargs) -> None:
        added = _logged_counts(self.collator or getattr(train_dataloader, "collate_fn", None))
        if logs is None or not added:
            return
        logs.update(added)
        if state is not None and state.log_history:  # Trainer.log appended its copy before this call
            state.log_history[-1].update(added)

    def _probe_first_batch(self, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        masked = _beyond_block_diagonal(kwargs)
        if not masked and packed_row_bounds(kwargs) is None:  # not packed (yet): wait for a packed row
            return
        self._hook.remove()  # before probing: the probe's own forwards must not come back here
        self._hook = None
        hint = "check a batch again with tightpack.runtime.hf.check_packing(model, batch)"
        try:
            if masked:  # a shared-prefix preference row: probe the row itself, not the forward's mask
                row = _collated(_shared_prefix_row(self._rows), kwargs["input_ids"].device)
                self.report = check_packing(model, row, hint=hint)
            else:
                self.report = check_packing(model, kwargs, hint=hint)
        except ProbeSkipped as skipped:
            logger().warning("packing check skipped for %s: %s", type(model).__name__, skipped)


def _beyond_block_diagonal(kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward's inputs carry a mask of their own (4-D, per layer type, a ``BlockMask``): a
    shared-prefix preference row, whose mask the probe cannot rebuild for its own rows."""
    mask = kwargs.get("attention_mask")
    return mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2)


def _shared_prefix_row(collator: Any) -> Mapping[str, Any]:
    """The shared-prefix preference row ``collator`` (or the one a Trainer wrapper holds) built last.

    Raises:
        ProbeSkipped: none is at hand.
    """
    for _ in range(4):
        row = getattr(collator, "last_row", None)
        if isinstance(row, Mapping) and row.get("branch_ids") is not None:
            return row
        collator = getattr(collator, "data_collator", None)
    raise ProbeSkipped(
        "the forward carries its own attention mask (a shared-prefix preference row?) and no collated "
        "preference row is at hand to probe with (PreferencePackingCollator keeps its last one in the "
        "process that collates: dataloader_num_workers=0); check one yourself with "
        "tightpack.runtime.equivalence.check_packing(model, collator.rows(rows))"
    )


def _collated(row: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in row.items()}


def _logged_counts(collator: Any) -> dict[str, Any]:
    """What `PackingCallback` adds to a log: the collator's totals as ``tightpack/<name>``, or nothing
    before it collated a row."""
    for _ in range(4):
        if collator is None:
            return {}
        if callable(getattr(collator, "logged_counts", None)):  # preference rows
            return {f"tightpack/{name}": value for name, value in collator.logged_counts().items()}
        counts = getattr(collator, "long_sample_counts", None)
        if isinstance(counts, LongSampleCounts):
            return {f"tightpack/{name}": counts[name] for name in LOGGED_COUNTS} if counts["samples"] else {}
        collator = getattr(collator, "data_collator", None)
    return {}
