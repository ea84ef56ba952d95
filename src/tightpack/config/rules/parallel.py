"""Rules of context and sequence parallelism, and of the loss they need (docs/contract.md §6, §7).

CP splits every sequence into 2*CP chunks, so ``model.seq_length`` (R17; T3 for the evaluation CP) and every
segment of an offline pack, the trailing width segment included (T1, T2), divide by the CP/SP multiple k. CP
ranks hold different numbers of supervised tokens, so fine-tuning with CP needs the per-token loss and summed
gradients (R18, T4, X2, §7).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from tightpack.config.derive import (
    DerivedValues,
    dataset_kwargs,
    fixed_width_key,
    has_fixed_width,
    is_offline,
    packing_specs,
)
from tightpack.config.rules.base import Issue, RuleGroup, error, multiple_origin, round_options, warning
from tightpack.config.schema import FINETUNING_TYPES, RunConfig

# GPTSFTDataset's width rounding; the reference's builder does not pass it, so this default applies (§2.9).
_DEFAULT_PAD_SEQ_LENGTH_TO_MULT = 16

rules = RuleGroup()


@rules.add("R17", "error", section="§5, §6", summary="CP > 1: `model.seq_length` divisible by `2*CP`")
def _cp_seq_length(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """CP splits every sequence into 2*CP chunks."""
    model = config.model
    cp = model.context_parallel_size
    if cp > 1 and model.seq_length % (2 * cp):
        yield error(
            "Sequence length must be divisible by 2 * context parallel size if context parallel is used "
            f"(model.seq_length={model.seq_length}, 2*CP={2 * cp}).",
            f"Set model.seq_length (and dataset.seq_length) to a multiple of {2 * cp}: "
            f"{round_options(model.seq_length, 2 * cp)}.",
        )


@rules.add(
    "R18",
    "error",
    section="§5, §7",
    summary="CP > 1 with a fine-tuning dataset: per-token loss, no averaging in the collective",
)
def _cp_finetuning_loss(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """CP ranks hold different numbers of supervised tokens: per-token loss, summed gradients."""
    cp = config.model.context_parallel_size
    if cp > 1 and isinstance(config.dataset, FINETUNING_TYPES):
        if not config.model.calculate_per_token_loss:
            yield error(
                f"When finetuning with CP>1, calculate_per_token_loss must be True (CP={cp}).",
                "Set model.calculate_per_token_loss: true.",
            )
        if config.ddp.average_in_collective:
            yield error(
                f"When finetuning with CP>1, average_in_collective must be False (CP={cp}).",
                "Set ddp.average_in_collective: false.",
            )


@rules.add(
    "X2",
    "error",
    section="§5, §7",
    summary="(MCore DDP) no averaging in the collective with per-token loss",
)
def _per_token_loss_no_average(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """MCore DDP: per-token loss sums gradients; averaging in the collective would divide twice."""
    if config.model.calculate_per_token_loss and config.ddp.average_in_collective:
        yield error(
            "Cannot average in collective when calculating per-token loss! "
            "(model.calculate_per_token_loss=True, ddp.average_in_collective=True)",
            "Set ddp.average_in_collective: false.",
        )


@rules.add(
    "T1",
    "error",
    section="§6, §10.2",
    summary=(
        "the offline pack width is a multiple of k, so that the trailing width segment is too (pack size,"
        " and the width rounding without a fixed width)"
    ),
)
def _offline_trailing_width(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """The offline batch width W becomes the last boundary: W - sum(segments) is a segment too (§6, §10.2).

    Every other segment is a multiple of ``pad_seq_to_mult`` (T2), so the trailing one is CP-sliceable and
    SP-splittable only when W itself is a multiple of k. W is P with a fixed width; otherwise
    ``min(P, ceil(longest row, pad_seq_length_to_mult))`` (default 16), or a power of two with
    ``ceil_to_power_2``.
    """
    dataset, multiple, specs = config.dataset, derived.alignment_multiple, packing_specs(config.dataset)
    if specs is None or not is_offline(dataset) or multiple == 1 or specs.packed_sequence_size <= 0:
        return
    size = specs.packed_sequence_size
    origin = multiple_origin(config, derived)
    if size % multiple:
        yield error(
            f"packed_sequence_size ({size}) is not a multiple of {multiple} ({origin}): the pack width W is "
            f"the last boundary, so the trailing width segment W - sum(lengths) is not divisible by 2*CP "
            "(context-parallel slicing) or CP*TP (sequence parallelism) whenever the width reaches P.",
            f"Set dataset.offline_packing_specs.packed_sequence_size to a multiple of {multiple}: "
            f"{round_options(size, multiple)} (with the sequence lengths to match).",
        )
    if has_fixed_width(dataset):
        return
    kwargs = dataset_kwargs(dataset)
    if kwargs.get("ceil_to_power_2") is True:
        if multiple & (multiple - 1):
            yield error(
                "With ceil_to_power_2 the offline batch width is a power of two, which is never a multiple "
                f"of {multiple} ({origin}).",
                f"Set {fixed_width_key(dataset)}: true (the safe setup), or drop ceil_to_power_2.",
            )
        return
    rounding = kwargs.get("pad_seq_length_to_mult", _DEFAULT_PAD_SEQ_LENGTH_TO_MULT)
    if isinstance(rounding, int) and not isinstance(rounding, bool) and rounding > 0 and rounding % multiple:
        yield error(
            f"Without a fixed width the offline batch width is rounded up to pad_seq_length_to_mult="
            f"{rounding}, which is not a multiple of {multiple} ({origin}), so the trailing width segment "
            "can break context-parallel slicing or the sequence-parallel split.",
            f"Set {fixed_width_key(dataset)}: true with packed_sequence_size a multiple of {multiple} "
            f"(the safe setup), or dataset.dataset_kwargs.pad_seq_length_to_mult: "
            f"{math.lcm(rounding, multiple)}.",
        )


@rules.add(
    "T2",
    "error",
    "warning",
    section="§6",
    summary="offline `pad_seq_to_mult` a multiple of k (E with CP; W for SP alone)",
)
def _offline_alignment_multiple(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Offline packing does not derive ``pad_seq_to_mult``: check it against k (§6)."""
    specs, multiple = packing_specs(config.dataset), derived.alignment_multiple
    if specs is None or not is_offline(config.dataset) or multiple == 1:
        return
    mult = specs.pad_seq_to_mult or 1
    if mult <= 0 or mult % multiple == 0:
        return  # X4 reports a non-positive multiple
    origin = multiple_origin(config, derived)
    fix = (
        f"Set dataset.offline_packing_specs.pad_seq_to_mult: {math.lcm(mult, multiple)} "
        "(lcm of the current value and k), and re-pack into a fresh output folder."
    )
    cp_used = config.model.context_parallel_size > 1 or derived.eval_context_parallel_size > 1
    if cp_used:
        yield error(
            f"offline_packing_specs.pad_seq_to_mult ({mult}) is not a multiple of {multiple} ({origin}): "
            "context-parallel slicing needs every packed segment divisible by 2*CP (a device assert in "
            "Transformer Engine).",
            fix,
        )
    else:
        yield warning(
            f"offline_packing_specs.pad_seq_to_mult ({mult}) is not a multiple of the sequence-parallel "
            f"multiple {multiple} ({origin}); the reference's recipes align packed segments to it.",
            fix,
        )


@rules.add("T3", "error", section="§5, §6", summary="R17 for the evaluation CP")
def _eval_cp_seq_length(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """R17 for the evaluation CP, which the reference does not check."""
    model, eval_cp = config.model, derived.eval_context_parallel_size
    if eval_cp > 1 and eval_cp != model.context_parallel_size and model.seq_length % (2 * eval_cp):
        yield error(
            "Sequence length must be divisible by 2 * the evaluation context parallel size "
            f"(model.seq_length={model.seq_length}, 2*eval CP={2 * eval_cp}).",
            f"Set model.seq_length (and dataset.seq_length) to a multiple of {2 * eval_cp}: "
            f"{round_options(model.seq_length, 2 * eval_cp)}, or change dist.eval_context_parallel_size.",
        )


@rules.add("T4", "warning", section="§5, §7", summary="R18's per-token loss for the evaluation CP")
def _eval_cp_per_token_loss(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """R18's loss rule for the evaluation CP (R18 reports it when training CP>1 too)."""
    model, eval_cp = config.model, derived.eval_context_parallel_size
    if (
        eval_cp > 1
        and model.context_parallel_size == 1
        and isinstance(config.dataset, FINETUNING_TYPES)
        and not model.calculate_per_token_loss
    ):
        yield warning(
            f"Evaluating fine-tuning data with CP={eval_cp} without calculate_per_token_loss: CP ranks hold "
            "different numbers of supervised tokens, so averaging per-rank means biases the validation loss.",
            "Set model.calculate_per_token_loss: true (and ddp.average_in_collective: false).",
        )
