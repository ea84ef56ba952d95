"""Preference, KTO and group rows for Hugging Face ``Trainer``: a data collator and what a loss reads.

`PreferencePackingCollator` is the preference counterpart of
`tightpack.runtime.hf_trainer.PackingCollator`: each micro-batch of raw rows becomes one packed
preference row (`tightpack.runtime.preference_collate.PreferenceCollator`: the shared prompt trimmed
first, units whole), given as the keyword arguments a transformers causal LM takes, plus the branch
keys a preference loss needs (`preference_trainer_inputs`):

- ``input_ids`` ``[1, T]`` and ``position_ids``: restarting at every branch (``pairs``), or counting
  the prompt and continuing it in every branch (``shared-prefix``);
- ``pairs``: ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``, as `PackingCollator` gives
  them: transformers builds the block-diagonal mask from the positions (eager, sdpa, flex) or takes
  the boundaries (flash-attention);
- ``shared-prefix``: ``attention_mask``, the mask the model's attention implementation takes (an
  additive ``[1, 1, T, T]`` mask in the model's dtype for sdpa and eager, a ``BlockMask`` for flex
  attention, ``{layer type: mask}`` when its layers differ; `tightpack.runtime.preference_hf`), so
  the collator is given the model;
- ``labels`` in transformers' convention (the model shifts them) and ``shift_labels`` (the targets
  aligned), -100 off the branches' supervised tokens; ``use_cache=False``;
- the branch keys of `tightpack.runtime.preference_batch`: ``branch_unit``, ``branch_index``,
  ``branch_group_size``, ``branch_prompt_length``, ``branch_ids`` (shared-prefix), ``branch_label``,
  ``branch_reward``, ``branch_advantage`` when the rows have them, ``preference_layout``.

A model does not take the branch keys: a ``compute_loss`` splits the inputs first
(`split_preference_inputs`), runs the model on the first part and gives its logits and the second
part to `tightpack.runtime.preference_logps.sequence_logps` (per-branch sums of target
log-probabilities, then ``chosen_rejected`` or ``grouped`` to pair them). `PackingCallback` probes
the model on the first packed forward in both layouts and logs the collator's counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits
from tightpack.errors import TightpackError, check_choice
from tightpack.prepare.preference_rows import PreferenceKind
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.runtime.hf_trainer import trainer_inputs
from tightpack.runtime.preference_batch import PER_BRANCH_KEYS, build_preference_row
from tightpack.runtime.preference_collate import PreferenceCollator
from tightpack.runtime.preference_hf import config_attention_masks
from tightpack.runtime.thd import BRANCH_KEYS

__all__ = ["PreferencePackingCollator", "preference_trainer_inputs", "split_preference_inputs"]

BRANCH_INPUTS = (*BRANCH_KEYS, "branch_ids", *PER_BRANCH_KEYS.values(), "preference_layout")
"""The keys of `preference_trainer_inputs` that are for the loss, not the model."""
_TARGETS = ("labels", "shift_labels")


def _weights_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _shared_prefix_inputs(batch: Mapping[str, Any], attention_mask: Any, ignore_index: int) -> dict[str, Any]:
    supervised = batch["loss_mask"] > 0
    shift_labels = torch.where(supervised, batch["labels"].long(), ignore_index)
    labels = torch.full_like(shift_labels, ignore_index)
    labels[:, 1:] = shift_labels[:, :-1]
    return {
        "input_ids": batch["input_ids"].long(),
        "position_ids": batch["position_ids"].long(),
        "attention_mask": attention_mask,
        "labels": labels,
        "shift_labels": shift_labels,
        "use_cache": False,
    }


def _inputs(batch: Mapping[str, Any], config: Any, dtype: torch.dtype, ignore_index: int) -> dict[str, Any]:
    """`preference_trainer_inputs` for a model of ``config`` and weights of ``dtype``."""
    if batch.get("branch_ids") is None:
        inputs = trainer_inputs(batch, ignore_index)
    else:
        mask = config_attention_masks(config, batch, dtype=dtype)
        inputs = _shared_prefix_inputs(batch, mask, ignore_index)
    return inputs | {key: batch[key] for key in BRANCH_INPUTS if batch.get(key) is not None}


def preference_trainer_inputs(
    batch: Mapping[str, Any], model: torch.nn.Module | None = None, *, ignore_index: int = -100
) -> dict[str, Any]:
    """The model inputs and branch keys (the module docstring) of one packed preference row ``batch``
    (`tightpack.runtime.preference_batch.build_preference_row`); a shared-prefix row needs ``model``,
    whose attention implementation, sliding windows and dtype decide its mask.

    >>> row = build_preference_row(PreferenceUnits.from_lists([[1, 2]], [[3, 4], [5]], [2]), "pairs")
    >>> inputs = preference_trainer_inputs(row)
    >>> inputs["position_ids"].tolist(), inputs["shift_labels"].tolist(), inputs["branch_index"].tolist()
    ([[0, 1, 2, 3, 0, 1, 2]], [[-100, 3, 4, -100, -100, 5, -100]], [0, 1])

    Raises:
        TightpackError: a shared-prefix row without ``model``, or for a model whose attention cannot take
            its mask.
    """
    if model is None:
        if batch.get("branch_ids") is not None:
            raise TightpackError(
                "a shared-prefix row needs the attention mask of the model's attention implementation: "
                "pass model= (or build the row with layout='pairs')"
            )
        return _inputs(batch, None, torch.float32, ignore_index)
    return _inputs(batch, model.config, _weights_dtype(model), ignore_index)


def split_preference_inputs(inputs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_inputs, branches)`` of `preference_trainer_inputs` (as ``compute_loss`` receives them):
    what the model takes, and what `tightpack.runtime.preference_logps.sequence_logps`,
    ``chosen_rejected`` and ``grouped`` read (the branch keys, ``labels``: the aligned targets, and the
    boundaries of a ``pairs`` row). The targets stay out of ``model_inputs``: with them a causal LM
    would compute a language-model loss of its own. A ``BlockMask`` (flex attention, which ``Trainer``
    does not move) is moved to the device of ``input_ids``.

    >>> row = build_preference_row(PreferenceUnits.from_lists([[1, 2]], [[3, 4], [5]], [2]), "pairs")
    >>> model_inputs, branches = split_preference_inputs(preference_trainer_inputs(row))
    >>> sorted(model_inputs)[:5]
    ['cu_seq_lens_k', 'cu_seq_lens_q', 'input_ids', 'max_length_k', 'max_length_q']
    >>> sorted(branches)[:3]
    ['branch_group_size', 'branch_index', 'branch_prompt_length']
    >>> from tightpack.runtime.preference_logps import sequence_logps
    >>> sequence_logps(torch.zeros(1, 7, 8), branches).tokens.tolist()  # supervised targets per branch
    [2, 1]

    Raises:
        TightpackError: ``inputs`` without the branch keys or ``shift_labels``.
    """
    missing = [key for key in (*BRANCH_KEYS, "shift_labels") if key not in inputs]
    if missing:
        raise TightpackError(
            f"split_preference_inputs takes the inputs of PreferencePackingCollator (or "
            f"preference_trainer_inputs); these lack {', '.join(missing)}"
        )
    model_inputs = {key: value for key, value in inputs.items() if key not in (*BRANCH_INPUTS, *_TARGETS)}
    branches = {key: inputs[key] for key in BRANCH_INPUTS if key in inputs}
    branches["labels"] = inputs["shift_labels"]
    if "branch_ids" not in branches:  # pairs: a branch is a sequence
        branches["cu_seqlens_q"] = inputs["cu_seq_lens_q"].to(torch.int32)
    device = model_inputs["input_ids"].device
    mask = model_inputs.get("attention_mask")
    if isinstance(mask, Mapping):
        model_inputs["attention_mask"] = {kind: _on(value, device) for kind, value in mask.items()}
    elif mask is not None:
        model_inputs["attention_mask"] = _on(mask, device)
    return model_inputs, branches


def _on(mask: Any, device: torch.device) -> Any:
    """A tensor or ``BlockMask`` on ``device`` (a ``BlockMask`` has ``.to`` and a ``kv_num_blocks``)."""
    if isinstance(mask, torch.Tensor):
        return mask.to(device)
    blocks = getattr(mask, "kv_num_blocks", None)
    return mask.to(device) if isinstance(blocks, torch.Tensor) and blocks.device != device else mask


class PreferencePackingCollator:
    """``data_collator`` for ``transformers.Trainer``: each micro-batch of raw preference, KTO or group
    rows becomes one packed preference row, as model inputs plus branch keys (the module docstring).

    A feature that is itself a list of rows is a whole micro-batch (a dataset of micro-batches, e.g.
    planned by `tightpack.runtime.samplers.TokenBudgetBatchSampler` over
    `PreferenceCollator.unit_sizes`, with ``per_device_train_batch_size=1``).

    Args:
        tokenizer: a `TokenizerSpec`, a tokenizer path, or None for the built-in GPT-2.
        kind: ``preference`` (prompt / chosen / rejected), ``kto`` or ``groups``.
        layout: ``pairs`` or ``shared-prefix``.
        model: the model trained; needed for ``shared-prefix`` (its mask: attention implementation,
            sliding windows, dtype). Only its config and dtype are kept.
        max_length: tokens one unit may take in the row, as `PreferenceCollator`.
        pad_to_multiple_of: alignment of every sequence, as `PreferenceCollator`.
        skip_bad_rows: leave out (and count) a row that cannot become a unit, as `PreferenceCollator`.
        template_vars: extra variables of the chat template.
        ignore_index: the label of tokens that are not targets.

    ``rows`` is the `PreferenceCollator` underneath (its ``counts``, ``last_batch_counts``,
    ``last_bad_rows``, ``last_dropped``), ``last_row`` the preference row it built last (what
    `PackingCallback` probes a shared-prefix model with).

    Raises:
        TightpackError: ``shared-prefix`` without ``model``, or for a model whose attention
            implementation or layers cannot take its mask (flash-attention: use ``pairs``).

    >>> collate = PreferencePackingCollator(kind="preference", layout="pairs")
    >>> inputs = collate([{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}])
    >>> inputs["input_ids"].shape, inputs["branch_unit"].tolist(), collate.logged_counts()["units"]
    (torch.Size([1, 12]), [0, 0], 1)
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec | str | None = None,
        *,
        kind: PreferenceKind = "preference",
        layout: Layout = "pairs",
        model: torch.nn.Module | None = None,
        max_length: int | None = None,
        pad_to_multiple_of: int = 1,
        skip_bad_rows: bool = False,
        template_vars: dict[str, Any] | None = None,
        ignore_index: int = -100,
    ) -> None:
        check_choice("layout", layout, LAYOUTS)
        self.rows = PreferenceCollator(
            tokenizer, kind=kind, layout=layout, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
            skip_bad_rows=skip_bad_rows, template_vars=template_vars, ignore_index=ignore_index,
        )  # fmt: skip
        self.ignore_index = ignore_index
        self.last_row: dict[str, Any] | None = None
        self._config, self._dtype = None, torch.float32
        if layout == "shared-prefix":
            if model is None:
                raise TightpackError(
                    "layout='shared-prefix' needs model=: its rows carry the attention mask of the model's "
                    "attention implementation (sdpa, eager or flex_attention); pass the model, or use "
                    "layout='pairs'"
                )
            self._config, self._dtype = model.config, _weights_dtype(model)
            probe = build_preference_row(PreferenceUnits.from_lists([[0]], [[0], [0]], [2]), layout)
            config_attention_masks(self._config, probe, dtype=self._dtype)  # refuses what cannot take it

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        if len(features) == 1 and isinstance(features[0], (list, tuple)):
            features = features[0]
        if not features:
            raise TightpackError("PreferencePackingCollator received an empty micro-batch")
        row = self.rows(list(features))
        self.last_row = row
        return _inputs(row, self._config, self._dtype, self.ignore_index)

    def logged_counts(self) -> dict[str, int]:
        """The running counts (`PreferenceCollator`'s) that `PackingCallback` logs; empty before the
        first micro-batch."""
        counts = self.rows.counts
        return dict(counts) if counts["units"] or counts["bad_rows"] else {}
