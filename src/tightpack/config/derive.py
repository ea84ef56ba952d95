"""The values the reference derives from a configuration, and the packing-path predicates the rules share.

`derive` computes `DerivedValues`: the packing path, the CP/SP multiple k, the batch arithmetic and what
R11, R12 and R14 set; `DerivedValues.overrides` lists what the reference's ``validate()`` writes back into
the configuration. The predicates (`is_offline`, `is_native`, `has_fixed_width`, ...) are the reference's
tests of which packing path a dataset takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tightpack.config.schema import (
    COLLATE_TYPE_NAMES,
    CollatePackingDataset,
    EnergonDatasetConfig,
    PackedSequenceSpecs,
    RunConfig,
)
from tightpack.core.alignment import alignment_multiple

PackingMode = Literal["none", "offline", "in_batch", "deferred", "native_energon"]
_OVERLAP_FLAGS = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")
# The reference's rules that set values instead of reporting a violation, as (id, summary):
# docs/validation-rules.md lists them after the rules (`tightpack.config.rules_table`).
DERIVATIONS: tuple[tuple[str, str], ...] = (
    (
        "R11",
        "native Energon packing sets every copy of the EP-overlap and delayed-wgrad flags to False "
        "(`forced_off`; the rule R11 warns when one was requested)",
    ),
    ("R12", "`pad_to_max_length` := own value OR PP>1 OR EP>1 (DirectHF, Energon, MockVLM)"),
    (
        "R14",
        "in-batch / native packing: `in_batch_packing_pad_to_multiple_of` := k and "
        "`model._enable_in_batch_packing` (with PP>1 also `model.variable_seq_lengths`); otherwise "
        "`pad_to_multiple_of` := lcm(own, k)",
    ),
)


@dataclass(frozen=True, kw_only=True)
class DerivedValues:
    """What the reference computes from a configuration, and what its ``validate()`` writes back.

    Attributes:
        dataset_type: the dataset kind (``dataset.type``).
        dataset_type_source: how the kind was chosen (``dataset.type``, ``dataset._target_`` or
            ``inferred from its fields: ...``; None for a configuration built in Python).
        packing: the packing path in effect: ``offline``, ``in_batch`` (collate time), ``deferred``
            (in-batch packing left to the step), ``native_energon`` or ``none``.
        alignment_multiple: the CP/SP multiple k (R13): lcm over the training and evaluation CP.
        data_parallel_size, micro_batches_per_step: DP = world / (TP*PP*CP) and GBS / (MBS*DP);
            None when not integral (X1 reports it).
        eval_context_parallel_size, eval_micro_batch_size, eval_global_batch_size: the evaluation
            values in effect (defaults: the training ones).
        eval_data_parallel_size, eval_micro_batches_per_step: as above for evaluation (R16).
        pad_to_max_length: the effective fixed-width flag (R12); for GPT SFT and custom providers the
            ``dataset_kwargs`` value; None for pretraining data.
        in_batch_packing_pad_to_multiple_of: R14's value (k) with in-batch or native packing, else None.
        pad_to_multiple_of: R14's non-packed multiple lcm(own, k), else None.
        enable_in_batch_packing: the transformer's ``_enable_in_batch_packing`` mark (R14).
        variable_seq_lengths: set when that mark meets PP > 1 (R14).
        forced_off: R11's copies of the EP-overlap and delayed-wgrad flags that are set to False.
    """

    dataset_type: str
    dataset_type_source: str | None = None
    packing: PackingMode
    alignment_multiple: int
    data_parallel_size: int | None
    micro_batches_per_step: int | None
    eval_context_parallel_size: int
    eval_micro_batch_size: int
    eval_global_batch_size: int
    eval_data_parallel_size: int | None
    eval_micro_batches_per_step: int | None
    pad_to_max_length: bool | None
    in_batch_packing_pad_to_multiple_of: int | None
    pad_to_multiple_of: int | None
    enable_in_batch_packing: bool
    variable_seq_lengths: bool
    forced_off: tuple[str, ...]

    def overrides(self) -> dict[str, Any]:
        """The settings the reference's ``validate()`` writes, as dotted path -> value.

        >>> from tightpack.config import load_config, validate
        >>> config = load_config({
        ...     "train": {"micro_batch_size": 1, "global_batch_size": 8},
        ...     "model": {"seq_length": 4096, "expert_model_parallel_size": 8,
        ...               "calculate_per_token_loss": True},
        ...     "dataset": {"type": "EnergonDatasetConfig", "path": "/data/wds", "seq_length": 4096,
        ...                 "micro_batch_size": 1, "task_encoder": "QwenVLEnergonTaskEncoderConfig",
        ...                 "packing_buffer_size": 16}})
        >>> validate(config).derived.overrides()  # doctest: +NORMALIZE_WHITESPACE
        {'dataset.pad_to_max_length': True, 'dataset.in_batch_packing_pad_to_multiple_of': 1,
         'model._enable_in_batch_packing': True, 'model.overlap_moe_expert_parallel_comm': False,
         'model.delay_wgrad_compute': False}
        """
        values: dict[str, Any] = {}
        if self.dataset_type in COLLATE_TYPE_NAMES:
            values["dataset.pad_to_max_length"] = self.pad_to_max_length
        if self.in_batch_packing_pad_to_multiple_of is not None:
            values["dataset.in_batch_packing_pad_to_multiple_of"] = self.in_batch_packing_pad_to_multiple_of
        if self.pad_to_multiple_of is not None:
            values["dataset.pad_to_multiple_of"] = self.pad_to_multiple_of
        if self.enable_in_batch_packing:
            values["model._enable_in_batch_packing"] = True
        if self.variable_seq_lengths:
            values["model.variable_seq_lengths"] = True
        values.update(dict.fromkeys(self.forced_off, False))
        return values


def is_offline(dataset: object) -> bool:
    return bool(getattr(dataset, "enable_offline_packing", False)) and packing_specs(dataset) is not None


def packing_specs(dataset: object) -> PackedSequenceSpecs | None:
    return getattr(dataset, "offline_packing_specs", None)


def is_native(dataset: object) -> bool:
    return isinstance(dataset, EnergonDatasetConfig) and dataset.packing_buffer_size is not None


def is_in_batch(dataset: object) -> bool:
    return bool(getattr(dataset, "enable_in_batch_packing", False))


def is_deferred(dataset: object) -> bool:
    return bool(getattr(dataset, "defer_in_batch_packing_to_step", False))


def dataset_kwargs(dataset: object) -> Mapping[str, Any]:
    return getattr(dataset, "dataset_kwargs", None) or {}


def has_fixed_width(dataset: object) -> bool:
    """R5's test: the dataset's own flag, or ``dataset_kwargs["pad_to_max_length"]``, is True."""
    return (
        getattr(dataset, "pad_to_max_length", False) is True
        or dataset_kwargs(dataset).get("pad_to_max_length") is True
    )


def fixed_width_key(dataset: object) -> str:
    return (
        "dataset.pad_to_max_length"
        if hasattr(dataset, "pad_to_max_length")
        else "dataset.dataset_kwargs.pad_to_max_length"
    )


def _packing_mode(dataset: object) -> PackingMode:
    if is_native(dataset):
        return "native_energon"
    if is_offline(dataset):
        return "offline"
    if is_in_batch(dataset):
        return "deferred" if is_deferred(dataset) else "in_batch"
    return "none"


def _divide(numerator: int, denominator: int) -> int | None:
    return numerator // denominator if numerator % denominator == 0 else None


def overlap_copies(config: RunConfig) -> list[tuple[str, object]]:
    """Every copy of the EP-overlap / delayed-wgrad flags (R11), as (path, value)."""
    copies: list[tuple[str, object]] = [
        (f"model.{name}", getattr(config.model, name)) for name in _OVERLAP_FLAGS
    ]
    overlap = config.comm_overlap
    if overlap is not None:
        copies += [(f"comm_overlap.{name}", getattr(overlap, name)) for name in _OVERLAP_FLAGS]
        user = overlap.user_comm_overlap_cfg or {}
        copies += [
            (f"comm_overlap.user_comm_overlap_cfg.{name}", user[name])
            for name in _OVERLAP_FLAGS
            if name in user
        ]
    return copies


def derive(config: RunConfig) -> DerivedValues:
    """The values the reference derives from ``config``, which is not modified."""
    model, train, dataset = config.model, config.train, config.dataset
    tp, cp, pp = (
        model.tensor_model_parallel_size,
        model.context_parallel_size,
        model.pipeline_model_parallel_size,
    )
    eval_cp = config.dist.eval_context_parallel_size or cp
    sp = model.sequence_parallel
    multiple = math.lcm(alignment_multiple(tp=tp, cp=cp, sp=sp), alignment_multiple(tp=tp, cp=eval_cp, sp=sp))
    world = config.dist.world_size
    dp = _divide(world, tp * pp * cp)
    eval_dp = _divide(world, tp * pp * eval_cp)
    eval_mbs = config.validation.eval_micro_batch_size or train.micro_batch_size
    eval_gbs = config.validation.eval_global_batch_size or train.global_batch_size
    collate = isinstance(dataset, CollatePackingDataset)
    if collate:
        pad_to_max_length: bool | None = (
            dataset.pad_to_max_length or pp > 1 or model.expert_model_parallel_size > 1
        )
    elif hasattr(dataset, "dataset_kwargs"):
        pad_to_max_length = has_fixed_width(dataset)
    else:
        pad_to_max_length = None
    marked = is_in_batch(dataset) or is_native(dataset)
    in_batch_multiple = (
        multiple if marked and hasattr(dataset, "in_batch_packing_pad_to_multiple_of") else None
    )
    pad_multiple = None
    if collate and not marked and dataset.pad_to_multiple_of > 0:
        pad_multiple = math.lcm(dataset.pad_to_multiple_of, multiple)
    return DerivedValues(
        dataset_type=dataset.type,
        dataset_type_source=dataset.type_source,
        packing=_packing_mode(dataset),
        alignment_multiple=multiple,
        data_parallel_size=dp,
        micro_batches_per_step=_divide(train.global_batch_size, train.micro_batch_size * dp) if dp else None,
        eval_context_parallel_size=eval_cp,
        eval_micro_batch_size=eval_mbs,
        eval_global_batch_size=eval_gbs,
        eval_data_parallel_size=eval_dp,
        eval_micro_batches_per_step=_divide(eval_gbs, eval_mbs * eval_dp) if eval_dp else None,
        pad_to_max_length=pad_to_max_length,
        in_batch_packing_pad_to_multiple_of=in_batch_multiple,
        pad_to_multiple_of=pad_multiple,
        enable_in_batch_packing=marked,
        variable_seq_lengths=marked and pp > 1,
        forced_off=tuple(path for path, _ in overlap_copies(config)) if is_native(dataset) else (),
    )
