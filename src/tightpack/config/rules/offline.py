"""Rules of offline packing: GPT SFT or a custom provider reads packs prepared ahead of time
(docs/contract.md §2).

One packing owner and valid specs (R3, R4, R19, X4, X5, X7); a fixed width and static boundary arrays for
CUDA graphs (R5, R6, R7, X6, §2.11); one pack per micro-batch (R20, X3); the pack size against the sequence
length (T7, §9). The CP/SP alignment of offline packs is in `parallel` (T1, T2). What a blend's weights give
of the folders it names reads the folders: rule D11 of `tightpack.stale_packs`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from tightpack.config.derive import (
    DerivedValues,
    dataset_kwargs,
    fixed_width_key,
    has_fixed_width,
    is_in_batch,
    is_offline,
    packing_specs,
)
from tightpack.config.rules.base import Issue, RuleGroup, error, warning
from tightpack.config.schema import GPTSFTDatasetConfig, ModelSection, RunConfig

_ROUTER_SCOPES = ("moe", "moe_router", "moe_preprocess")

rules = RuleGroup()


def _full_iteration_graph(model: ModelSection) -> bool:
    scope = model.cuda_graph_scope or ()
    return model.cuda_graph_impl == "full_iteration" or (
        model.cuda_graph_impl == "local" and "full_iteration" in scope
    )


def _te_graph(model: ModelSection) -> bool:
    return model.cuda_graph_impl == "transformer_engine"


def _graph_text(model: ModelSection) -> str:
    return (
        f"model.cuda_graph_impl={model.cuda_graph_impl!r}, model.cuda_graph_scope={model.cuda_graph_scope!r}"
    )


@rules.add("R3", "error", section="§5", summary="offline and in-batch packing are mutually exclusive")
def _offline_xor_in_batch(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Offline and in-batch packing are mutually exclusive."""
    dataset = config.dataset
    if getattr(dataset, "enable_offline_packing", False) and is_in_batch(dataset):
        yield error(
            "enable_offline_packing and enable_in_batch_packing are mutually exclusive (both are True).",
            "Keep one packing owner: dataset.enable_in_batch_packing: false for offline packs, or "
            "dataset.enable_offline_packing: false and no offline_packing_specs for in-batch packing.",
        )


@rules.add("R4", "error", section="§5, §2.2", summary="`enable_offline_packing` <=> `offline_packing_specs`")
def _offline_needs_specs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``enable_offline_packing`` and ``offline_packing_specs`` come together."""
    dataset = config.dataset
    enabled = bool(getattr(dataset, "enable_offline_packing", False))
    if enabled and packing_specs(dataset) is None:
        yield error(
            "offline_packing_specs must be set when enable_offline_packing=True.",
            f"Add dataset.offline_packing_specs with packed_sequence_size (usually the sequence length, "
            f"{dataset.seq_length}), or set dataset.enable_offline_packing: false.",
        )
    if not enabled and packing_specs(dataset) is not None:
        yield error(
            "enable_offline_packing must be True when offline_packing_specs is set.",
            "Set dataset.enable_offline_packing: true, or remove dataset.offline_packing_specs.",
        )


@rules.add("R5", "error", section="§5", summary="`pad_cu_seqlens` needs a fixed width (`pad_to_max_length`)")
def _pad_cu_seqlens_fixed_width(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Static boundary shapes need a static token width."""
    specs = packing_specs(config.dataset)
    if specs is not None and specs.pad_cu_seqlens and not has_fixed_width(config.dataset):
        yield error(
            "offline_packing_specs.pad_cu_seqlens=True requires dataset pad_to_max_length=True.",
            f"Set {fixed_width_key(config.dataset)}: true, or offline_packing_specs.pad_cu_seqlens: false.",
        )


@rules.add(
    "R6",
    "error",
    section="§5",
    summary="offline packing with a training CUDA graph needs a fixed width (an MLP-only TE graph too)",
)
def _cuda_graph_fixed_width(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Any training CUDA graph over offline packs needs a fixed width (an MLP-only TE graph too)."""
    model = config.model
    training_graph = _full_iteration_graph(model) or _te_graph(model)
    if packing_specs(config.dataset) is not None and training_graph and not has_fixed_width(config.dataset):
        yield error(
            "Offline packing with CUDA graphs requires dataset pad_to_max_length=True "
            f"({_graph_text(model)}).",
            f"Set {fixed_width_key(config.dataset)}: true, or model.cuda_graph_impl: none.",
        )


@rules.add(
    "R7",
    "error",
    section="§5",
    summary="a CUDA graph capturing attention over offline packs needs `pad_cu_seqlens`",
)
def _attention_graph_pad_cu_seqlens(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """A graph that captures attention needs static boundary arrays."""
    model, specs = config.model, packing_specs(config.dataset)
    scope = model.cuda_graph_scope or []
    captures_attention = _full_iteration_graph(model) or (_te_graph(model) and (not scope or "attn" in scope))
    if specs is not None and captures_attention and not specs.pad_cu_seqlens:
        yield error(
            "Packed attention CUDA graphs require offline_packing_specs.pad_cu_seqlens=True. Enable it for "
            f"full-iteration, whole-layer, or attention-scoped capture ({_graph_text(model)}).",
            "Set dataset.offline_packing_specs.pad_cu_seqlens: true (with a packing metadata file and a "
            "fixed width), or capture MLP only: model.cuda_graph_scope: [mlp].",
        )


@rules.add("R19", "error", section="§5, §2.2", summary="`packed_sequence_size` > 0")
def _pack_size_positive(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    specs = packing_specs(config.dataset)
    if specs is not None and specs.packed_sequence_size <= 0:
        yield error(
            "offline_packing_specs.packed_sequence_size must be greater than 0 "
            f"(got {specs.packed_sequence_size}).",
            "Set dataset.offline_packing_specs.packed_sequence_size to the sequence length "
            f"({config.dataset.seq_length}).",
        )


@rules.add(
    "R20",
    "error",
    section="§5, §3.7",
    summary="offline packing needs MBS 1 (the fix gives the equivalent MBS-1 configuration)",
)
def _offline_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Offline packs are already M sequences wide: MBS 1 and packs M times longer are equivalent."""
    mbs, gbs = config.train.micro_batch_size, config.train.global_batch_size
    specs = packing_specs(config.dataset)
    if specs is None or not is_offline(config.dataset) or mbs == 1:
        return
    size = specs.packed_sequence_size
    if gbs % mbs == 0:
        batch = f"train.global_batch_size: {gbs // mbs} (now {gbs})"
    else:
        batch = f"train.global_batch_size to about {gbs / mbs:g} (now {gbs}; GBS/MBS is not an integer)"
    yield error(
        "Micro batch size should be 1 when training with packed sequence, but your micro batch size is "
        f"{mbs}. Each offline pack already holds several sequences.",
        f"Use the equivalent configuration: train.micro_batch_size: 1 (now {mbs}), {batch}, and "
        f"dataset.offline_packing_specs.packed_sequence_size: {size * mbs} (now {size}), with "
        f"model.seq_length and dataset.seq_length {size * mbs}.",
    )


@rules.add(
    "X3",
    "error",
    section="§5",
    summary=(
        "(gpt_step, packed_seq_utils) packed THD micro-batches hold one row: eval MBS 1 with offline "
        "packing (the training side is R20)"
    ),
)
def _offline_eval_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """A packed THD micro-batch is one physical row; the training side is R20."""
    eval_mbs = config.validation.eval_micro_batch_size
    dataset = config.dataset
    if not (is_offline(dataset) and dataset.do_validation and eval_mbs is not None and eval_mbs > 1):
        return
    reason = (
        "Packed THD batches need micro-batch size 1: offline validation packs are collated as [MBS, W] "
        f"rows and validation.eval_micro_batch_size={eval_mbs} puts {eval_mbs} rows in one micro-batch, but "
        "the packed metadata (max_seqlen_q) must hold exactly one value"
    )
    if derived.eval_context_parallel_size > 1:
        reason += (
            f"; with eval CP={derived.eval_context_parallel_size}: 'Packed THD batches expect micro-batch "
            "size 1 for context-parallel slicing (THD layout)'"
        )
    yield error(reason + ".", "Set validation.eval_micro_batch_size: 1.")


@rules.add(
    "X4",
    "error",
    "warning",
    section="§2.1",
    summary=(
        "(PackedSequenceSpecs) positive `pad_seq_to_mult` and cap, cap <= pack size; a `.npy` path is "
        "deprecated (W)"
    ),
)
def _packed_specs_values(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``PackedSequenceSpecs.__post_init__`` (§2.1): positive multiple and cap; the cap fits the pack."""
    specs = packing_specs(config.dataset)
    if specs is None:
        return
    if specs.pad_seq_to_mult is not None and specs.pad_seq_to_mult <= 0:
        yield error(
            f"pad_seq_to_mult must be a positive integer when provided (got {specs.pad_seq_to_mult}).",
            f"Set dataset.offline_packing_specs.pad_seq_to_mult: {derived.alignment_multiple} "
            "(the CP/SP multiple k).",
        )
    cap, size = specs.max_single_sequence_length, specs.packed_sequence_size
    if cap is not None and cap <= 0:
        yield error(
            f"max_single_sequence_length must be positive (got {cap}).",
            "Remove dataset.offline_packing_specs.max_single_sequence_length (it falls back to "
            "dataset.seq_length).",
        )
    elif cap is not None and size > 0 and cap > size:
        yield error(
            f"max_single_sequence_length ({cap}) cannot exceed packed_sequence_size ({size}).",
            f"Set dataset.offline_packing_specs.max_single_sequence_length to at most {size}.",
        )
    for name in ("packed_train_data_path", "packed_val_data_path"):
        path = getattr(specs, name)
        if path is not None and path.lower().endswith(".npy"):
            yield warning(
                ".npy packed sequence format is deprecated; use packed parquet "
                f"(offline_packing_specs.{name}={path!r}).",
                "Re-pack to packed Parquet (tightpack pack writes it) and point the path at the .parquet "
                "file, folder or glob.",
            )


@rules.add(
    "X5",
    "error",
    section="§2.2",
    summary=(
        "(GPTSFTDatasetConfig) `hf_rewrite` with explicit packed paths; `max_num_samples` in `dataset_kwargs`"
    ),
)
def _gpt_sft_dataset_values(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``GPTSFTDatasetConfig.validate()`` (§2.2), the packing-related checks R4/R19 do not cover."""
    dataset = config.dataset
    if not isinstance(dataset, GPTSFTDatasetConfig):
        return
    specs = dataset.offline_packing_specs
    explicit = specs is not None and (specs.packed_train_data_path or specs.packed_val_data_path)
    if dataset.hf_rewrite and explicit:
        yield error(
            "hf_rewrite cannot safely replace explicit packed data paths; use builder-managed packed paths.",
            "Set dataset.hf_rewrite: false, or remove offline_packing_specs.packed_train_data_path and "
            "packed_val_data_path.",
        )
    kwargs = dataset_kwargs(dataset)
    if "max_num_samples" in kwargs:
        yield error(
            "Set max_train_samples directly on GPTSFTDatasetConfig, not max_num_samples in dataset_kwargs.",
            f"Move dataset.dataset_kwargs.max_num_samples ({kwargs['max_num_samples']!r}) to "
            "dataset.max_train_samples.",
        )


@rules.add(
    "X6",
    "error",
    section="§2.11",
    summary="(gpt_step) offline packs (padding mask) + MoE + router-scoped TE CUDA graph",
)
def _moe_router_graph(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Offline packs always carry a padding mask, which router-scoped TE graphs cannot take (§2.11)."""
    model = config.model
    scope = model.cuda_graph_scope or []
    router = not scope or any(name in scope for name in _ROUTER_SCOPES)
    if is_offline(config.dataset) and (model.num_moe_experts or 0) > 0 and _te_graph(model) and router:
        yield error(
            "Packed MoE padding masks do not support router-scoped Transformer Engine CUDA graphs "
            f"(model.num_moe_experts={model.num_moe_experts}, {_graph_text(model)}).",
            "Set model.cuda_graph_scope to modules without the router (e.g. [attn] or [attn, mlp]), or "
            "model.cuda_graph_impl: none.",
        )


_BLEND = "dataset.offline_packing_specs.packed_train_data_blend"


@rules.add(
    "X7",
    "error",
    section="§2.1, §2.2",
    summary=(
        "(PackedSequenceSpecs, GPTSFTDatasetConfig; Megatron-Bridge PR #5289) `packed_train_data_blend` is "
        "`[[sources], [weights]]`: two or more sources, one positive weight each, not with "
        "`packed_train_data_path`; without `dataset_root` or `hf_dataset` no validation or test split"
    ),
)
def _packed_blend_shape(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``PackedSequenceSpecs._validate_packed_train_data_blend`` and the blend's source rule of
    ``GPTSFTDatasetConfig.validate()`` (Megatron-Bridge PR #5289, branch ``pull-request/5289``)."""
    dataset, specs = config.dataset, packing_specs(config.dataset)
    blend = specs.packed_train_data_blend if specs is not None else None
    if blend is None:
        return
    example = f"{_BLEND}: [[packed/a, packed/b], [0.5, 0.5]]"
    if specs.packed_train_data_path is not None:
        yield error(
            "Set either packed_train_data_path or packed_train_data_blend, not both.",
            "Remove dataset.offline_packing_specs.packed_train_data_path (add its folder to the blend's "
            f"sources), or remove {_BLEND}.",
        )
    if len(blend) != 2:
        yield error(
            f"packed_train_data_blend must be a (sources, weights) pair; it has {len(blend)} lists.",
            f"Write the sources, then their weights: {example}.",
        )
        return
    sources, weights = blend
    paths = [source for source in sources if isinstance(source, str)]
    numbers = [weight for weight in weights if not isinstance(weight, str)]
    if len(paths) != len(sources) or len(numbers) != len(weights):
        quoted = (
            [weight for weight in weights if isinstance(weight, str)] if len(paths) == len(sources) else []
        )
        yield error(
            f"packed_train_data_blend's weights must be numbers, not strings: {quoted!r}."
            if quoted
            else f"packed_train_data_blend holds sources then weights; got {sources!r} and {weights!r}.",
            f"Write each weight unquoted (0.5, not '0.5'): {example}."
            if quoted
            else f"Write the packed folders' paths first, then one number each: {example}.",
        )
        return
    if len(sources) < 2:
        yield error(
            f"packed_train_data_blend requires at least two sources (got {len(sources)}).",
            "Name one folder with dataset.offline_packing_specs.packed_train_data_path instead, or add the "
            "other sources.",
        )
    if len(sources) != len(weights):
        yield error(
            f"packed_train_data_blend sources and weights must have the same length ({len(sources)} sources, "
            f"{len(weights)} weights).",
            "Give one weight per source (tightpack blend FOLDER=SHARE ... prints them).",
        )
    for index, weight in enumerate(weights):
        if not (math.isfinite(weight) and weight > 0):
            source = sources[index] if index < len(sources) else "the source"
            yield error(
                f"packed_train_data_blend weight {index} must be finite and greater than 0, got {weight!r}.",
                f"Give {source} a positive weight, or leave it out of the blend.",
            )
    standalone = isinstance(dataset, GPTSFTDatasetConfig) and not (dataset.dataset_root or dataset.hf_dataset)
    if standalone and (dataset.do_validation or dataset.do_test):
        yield error(
            "A standalone packed_train_data_blend requires do_validation=False and do_test=False; set "
            "dataset_root or hf_dataset when additional splits are needed.",
            "Set dataset.do_validation: false and dataset.do_test: false, or dataset.dataset_root to the "
            "folder the validation and test splits come from.",
        )


@rules.add("T7", "warning", section="§9", summary="`packed_sequence_size` == `dataset.seq_length`")
def _pack_size_matches_seq_length(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """§9: keep model.seq_length == dataset.seq_length == packed_sequence_size."""
    dataset, specs = config.dataset, packing_specs(config.dataset)
    if specs is None or not is_offline(dataset) or specs.packed_sequence_size <= 0:
        return
    if specs.packed_sequence_size != dataset.seq_length:
        yield warning(
            f"offline_packing_specs.packed_sequence_size ({specs.packed_sequence_size}) differs from "
            f"dataset.seq_length ({dataset.seq_length}); packs are collated up to the pack size.",
            "Keep model.seq_length == dataset.seq_length == packed_sequence_size "
            f"(e.g. all {dataset.seq_length}).",
        )
