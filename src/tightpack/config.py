"""A training configuration and its packing validation: every rule of contract §5, and the ones it misses.

`load_config` reads a configuration laid out like Megatron-Bridge's ``ConfigContainer``: sections ``train``,
``model``, ``ddp``, ``dataset``, ``validation``, ``dist``, ``comm_overlap`` and ``dist_train`` with
Megatron-Bridge's field names, from a YAML file or a dict. Misspelt or misplaced keys (below) and wrong
types are user errors (`TightpackError`) naming the path. `validate` checks the configuration and returns a
`ValidationReport` with *every* violation (the reference stops at the first), each with a rule id, a
severity, the reason and the fix, plus the values the reference derives (and would write into the
configuration).

Keys tightpack does not read. A real Megatron-Bridge file (a recipe override, or the configuration it
serializes) holds hundreds of settings no packing rule uses. `load_config` accepts them without reading
them and the report names them once (``ValidationReport.not_checked``: "not checked by tightpack: ...").
Typos of the fields tightpack reads are still errors. The rule, for each key:

1. A field tightpack models is read and type-checked (the section classes below).
2. At the top level, Megatron-Bridge's other ``ConfigContainer`` sections (``optimizer``, ``scheduler``,
   ``logger``, ``checkpoint``, ``tokenizer``, ... : `_MB_SECTIONS`) are accepted whole; any other name is
   an error, naming the closest section (a closed list of about 25 names, so a stray one is a wrong file or
   a misplaced section).
3. Inside a section, a field that Megatron-Bridge's class has and tightpack does not model
   (``train.eval_iters``, ``dist.use_megatron_fsdp``, ``model.hidden_size``: `_MB_FIELDS`, the dataclass
   fields, inherited ones included, of Megatron-Bridge 067f987 with its Megatron-LM 2a75ac1) is accepted.
   So is any key of a ``model`` whose ``_target_`` names a model provider: a serialized file lists every
   field of its provider class, model-family fields included.
4. Another key is an error when it looks like a field tightpack checks: a field of its section with a
   difflib ratio of at least 0.8 (``seq_lenght``; the message names the closest), a field tightpack reads
   in another section (``train.seq_length``), or a field of another dataset kind (``pad_to_max_length`` on
   GPT SFT). A ``DatasetProvider`` is the user's own class, so only closeness counts there.
5. Any other key is accepted too. Field lists lag Megatron-Core releases, and the packing report should
   not fail on a field that is newer than the lists; Megatron-Bridge rejects a key its class lacks anyway.

The dataset kind is ``dataset.type``, one of the reference's class names (`DATASET_TYPES`), or the class
that ``dataset._target_`` names: Megatron-Bridge's serialized configurations name every section's class
with a dotted ``_target_`` path (``megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig``), and
`load_config` accepts those keys on every section where they name the class it expects. Without either
(Megatron-Bridge's override files have none: the recipe supplies the class), the kind is inferred from the
dataset's fields when exactly one kind has them all (the fields tightpack models and, by rule 3, those
Megatron-Bridge's class has; keys accepted by rule 5 do not count); the report says so
(``derived.dataset_type_source``), and fields that fit several kinds or none are a user error. A
``DatasetProvider`` is a custom provider: it has the generic packing fields and none of the kinds' rules.
This module never touches the filesystem beyond reading the YAML file: explicit packed paths are not
checked for existence (the reference does that when it builds ``PackedSequenceSpecs``).

Rule ids and outcomes (E error, W warning, D derived value; §n = contract section):

======== === =================================================================================
R1, R2   E   ``train.num_epochs`` only with GPTSFTDatasetConfig and ``dataloader_type="batch"``
R3       E   offline and in-batch packing are mutually exclusive
R4       E   ``enable_offline_packing`` <=> ``offline_packing_specs``
R5       E   ``pad_cu_seqlens`` needs a fixed width (``pad_to_max_length``)
R6       E   offline packing with a training CUDA graph needs a fixed width
R7       E   a CUDA graph capturing attention needs ``pad_cu_seqlens``
R8.1-9   E   the dataset's own ``validate()`` (§3.6, §4.1): positive multiples, Energon path, test
             split, builder-owned ``dataset_kwargs``, ``packing_buffer_size`` > 0, native packing
             exclusive with in-batch/deferred packing, dataset MBS 1, Qwen-VL task encoder
R9       E   Energon dataset MBS == ``train.micro_batch_size``
R10.1-7  E   native Energon packing: MBS 1, per-token loss, no collective averaging, no MTP, no
             CUDA graphs, no DistTrain, no pipeline parallelism (in the reference's order)
R11      W+D native Energon packing turns EP overlap and delayed wgrad off (``forced_off``)
R12      D   ``pad_to_max_length`` := own value OR PP>1 OR EP>1 (DirectHF, Energon, MockVLM)
R13      E   collate datasets: ``seq_length`` divisible by the CP/SP multiple k
R14      D   in-batch / native packing: ``in_batch_packing_pad_to_multiple_of`` := k; otherwise
             ``pad_to_multiple_of`` := lcm(own, k)
R15      E   Energon dataset MBS == eval MBS when validating
R16      E   eval GBS divisible by eval MBS * eval DP (eval DP uses the eval CP)
R17      E   CP>1: ``model.seq_length`` divisible by 2*CP
R18      E   CP>1 with a fine-tuning dataset: per-token loss, no averaging in the collective
R19      E   ``packed_sequence_size`` > 0
R20      E   offline packing needs MBS 1 (the fix gives the equivalent MBS-1 configuration)
R21      E   in-batch packing needs MBS > 1
R22      E   ``model.seq_length`` == ``dataset.seq_length``
X1       E   (sampler, MCore) integral DP; GBS divisible by MBS*DP, at least one micro-batch
X2       E   (MCore DDP) no averaging in the collective with per-token loss
X3       E   (gpt_step, packed_seq_utils) packed THD micro-batches hold one row: eval MBS 1
             with offline packing (the training side is R20)
X4       E/W (PackedSequenceSpecs, §2.1) positive ``pad_seq_to_mult`` and cap, cap <= pack
             size; a ``.npy`` path is deprecated (W)
X5       E   (GPTSFTDatasetConfig, §2.2) ``hf_rewrite`` with explicit packed paths;
             ``max_num_samples`` in ``dataset_kwargs``
X6       E   (gpt_step, §2.11) offline packs (padding mask) + MoE + router-scoped TE CUDA graph
T1       E   added (§6, §10.2): the offline pack width is a multiple of k, so that the trailing
             width segment is too (pack size, and the width rounding without a fixed width)
T2       E/W added: offline ``pad_seq_to_mult`` a multiple of k (E with CP; W for SP alone)
T3       E   added: R17 for the evaluation CP
T4       W   added: R18's per-token loss for the evaluation CP
T5       E   added (§3.7, §10.13): in-batch packing with ``dataloader_type="batch"`` needs one
             micro-batch per step
T6       W   added (§3.5, §10.14): Energon collate-time packing at a fixed width fails when the
             MBS rows exceed ``seq_length``
T7       W   added (§9): ``packed_sequence_size`` == ``dataset.seq_length``
======== === =================================================================================
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, Union, get_args, get_origin, get_type_hints

from tightpack.core.alignment import alignment_multiple, ceil_to_multiple
from tightpack.errors import TightpackError

__all__ = [
    "DATASET_TYPES",
    "RULES",
    "CommOverlapConfig",
    "DDPConfig",
    "DatasetConfig",
    "DatasetProvider",
    "DerivedValues",
    "DirectHFSFTDatasetConfig",
    "DistConfig",
    "DistTrainConfig",
    "EnergonDatasetConfig",
    "Finding",
    "GPTDatasetConfig",
    "GPTSFTDatasetConfig",
    "MockVLMSFTDatasetConfig",
    "ModelConfig",
    "PackedSequenceSpecs",
    "TrainConfig",
    "TrainingConfig",
    "ValidationConfig",
    "ValidationReport",
    "load_config",
    "validate",
]

DataloaderType = Literal["single", "cyclic", "batch", "external"]
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
CudaGraphScope = Literal[
    "full_iteration", "full_iteration_inference", "full", "attn", "mlp", "moe", "moe_router",
    "moe_preprocess", "mamba",
]  # fmt: skip
Severity = Literal["error", "warning"]
PackingMode = Literal["none", "offline", "in_batch", "deferred", "native_energon"]

_POSITIVE = {"minimum": 1}
QWEN_VL_TASK_ENCODER = "QwenVLEnergonTaskEncoderConfig"
# Arguments the Energon builder passes itself (§4.1); dataset_kwargs may not override them.
ENERGON_BUILDER_OWNED = (
    "batch_size", "max_samples_per_sequence", "packing_buffer_size", "shuffle_buffer_size", "split_part",
    "task_encoder", "worker_config",
)  # fmt: skip
_OVERLAP_FLAGS = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")
_ROUTER_SCOPES = ("moe", "moe_router", "moe_preprocess")
# GPTSFTDataset's width rounding; the reference's builder does not pass it, so this default applies (§2.9).
_DEFAULT_PAD_SEQ_LENGTH_TO_MULT = 16


def _check_minimum(value: object, minimum: int | None, where: str) -> None:
    if minimum is not None and isinstance(value, int) and value < minimum:
        raise TightpackError(f"{where} must be at least {minimum}, got {value}")


class _Section:
    """Base of the configuration dataclasses: range checks of the fields marked ``minimum``."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_minimum(
                getattr(self, item.name), item.metadata.get("minimum"), f"{type(self).__name__}.{item.name}"
            )


# --------------------------------------------------------------------------------------------------
# Configuration sections
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainConfig(_Section):
    """``train``: batch sizes and run length.

    Attributes:
        micro_batch_size: rows per micro-batch and data-parallel rank (one pack with offline packing).
        global_batch_size: rows per optimizer step over all data-parallel ranks.
        num_epochs: finite epochs (GPT SFT with the ``batch`` loader only, R1/R2).
        train_iters: run length in steps (not checked).
    """

    micro_batch_size: int = field(metadata=_POSITIVE)
    global_batch_size: int = field(metadata=_POSITIVE)
    num_epochs: int | None = field(default=None, metadata=_POSITIVE)
    train_iters: int | None = field(default=None, metadata=_POSITIVE)


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """``model``: parallel layout, sequence length, loss mode and execution modes.

    Attributes:
        tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size,
            expert_model_parallel_size: TP, CP, PP, EP.
        sequence_parallel: sequence parallelism over the TP ranks.
        seq_length: the model's sequence length.
        calculate_per_token_loss: normalise by the global token count (required with CP fine-tuning).
        mtp_num_layers: multi-token-prediction layers (None or 0: none).
        cuda_graph_impl, vision_cuda_graph_impl: ``none``, ``local``, ``transformer_engine`` or
            ``full_iteration`` (the newer MCore spelling of a full-iteration graph).
        cuda_graph_scope: captured modules; with ``transformer_engine`` None or [] means the whole layer;
            ``local`` with ``full_iteration`` is a full-iteration graph.
        overlap_moe_expert_parallel_comm, delay_wgrad_compute: MoE EP overlap and delayed weight grads.
        num_moe_experts: experts per MoE layer (None: dense model).
    """

    tensor_model_parallel_size: int = field(default=1, metadata=_POSITIVE)
    context_parallel_size: int = field(default=1, metadata=_POSITIVE)
    pipeline_model_parallel_size: int = field(default=1, metadata=_POSITIVE)
    expert_model_parallel_size: int = field(default=1, metadata=_POSITIVE)
    sequence_parallel: bool = False
    seq_length: int = field(metadata=_POSITIVE)
    calculate_per_token_loss: bool = False
    mtp_num_layers: int | None = None
    cuda_graph_impl: CudaGraphImpl | None = "none"
    cuda_graph_scope: list[CudaGraphScope] | None = None
    vision_cuda_graph_impl: CudaGraphImpl | None = "none"
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    num_moe_experts: int | None = None


@dataclass(kw_only=True)
class DDPConfig(_Section):
    """``ddp``: Megatron-Core distributed data parallel.

    Attributes:
        average_in_collective: average gradients inside the all-reduce (must be False with per-token loss).
        check_for_nan_in_grad, grad_reduce_in_fp32, overlap_grad_reduce, overlap_param_gather,
            use_distributed_optimizer: accepted, not checked.
    """

    average_in_collective: bool = False
    check_for_nan_in_grad: bool = False
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False


@dataclass(kw_only=True)
class ValidationConfig(_Section):
    """``validation``: evaluation batch sizes (None: the training values).

    Attributes:
        eval_micro_batch_size, eval_global_batch_size: evaluation MBS and GBS.
        eval_iters, eval_interval: accepted, not checked.
    """

    eval_micro_batch_size: int | None = field(default=None, metadata=_POSITIVE)
    eval_global_batch_size: int | None = field(default=None, metadata=_POSITIVE)
    eval_iters: int | None = None
    eval_interval: int | None = None


@dataclass(kw_only=True)
class DistConfig(_Section):
    """``dist``: the process layout.

    Attributes:
        world_size: GPUs in the job (not a Megatron-Bridge field: it reads the launcher's environment);
            the data-parallel size is ``world_size / (TP * PP * CP)``.
        eval_context_parallel_size: CP during evaluation (Megatron-Bridge ``dist.eval_context_parallel_size``;
            None: the training CP).
    """

    world_size: int = field(default=1, metadata=_POSITIVE)
    eval_context_parallel_size: int | None = field(default=None, metadata=_POSITIVE)


@dataclass(kw_only=True)
class CommOverlapConfig(_Section):
    """``comm_overlap``: communication overlap (None values: left to Megatron-Bridge's defaults).

    Attributes:
        tp_comm_overlap: accepted, not checked.
        overlap_moe_expert_parallel_comm, delay_wgrad_compute: copies of the model's flags (R11).
        user_comm_overlap_cfg: free-form overlap settings; its copies of the two flags count for R11.
    """

    tp_comm_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool | None = None
    delay_wgrad_compute: bool | None = None
    user_comm_overlap_cfg: dict[str, Any] | None = None


@dataclass(kw_only=True)
class DistTrainConfig(_Section):
    """``dist_train``: Qwen3-VL DistTrain (incompatible with native Energon packing, R10.6)."""

    use_dist_train: bool = False


@dataclass(kw_only=True)
class PackedSequenceSpecs(_Section):
    """``dataset.offline_packing_specs`` (contract §2.1), with the reference's defaults.

    Attributes:
        packed_sequence_size: pack capacity P in runtime tokens (must be > 0 when packing, R19).
        max_single_sequence_length: per-sequence cap while preparing (None: ``dataset.seq_length``).
        tokenizer_model_name, num_tokenizer_workers: preparation settings (not checked).
        packed_train_data_path, packed_val_data_path, packed_metadata_path: explicit artefacts.
        pad_cu_seqlens: static-shape boundary arrays (CUDA graphs; needs ``pad_to_max_length``).
        pad_seq_to_mult: per-sequence alignment multiple m (None: 1).
    """

    packed_sequence_size: int = -1
    max_single_sequence_length: int | None = None
    tokenizer_model_name: str | None = None
    num_tokenizer_workers: int = -1
    packed_train_data_path: str | None = None
    packed_val_data_path: str | None = None
    packed_metadata_path: str | None = None
    pad_cu_seqlens: bool = False
    pad_seq_to_mult: int | None = 1


@dataclass(kw_only=True)
class _DatasetBase(_Section):
    """Fields every dataset kind has (Megatron-Bridge ``DataloaderConfig`` plus the splits).

    Attributes:
        type: the kind (Megatron-Bridge's class name); ``target`` is that class's dotted path.
        type_source: how `load_config` chose the kind: ``"dataset.type"``, ``"dataset._target_"`` or
            ``"inferred from its fields: ..."`` (the fields that decided it); None when built in Python.
    """

    type: ClassVar[str]
    target: ClassVar[str]
    type_source: str | None = field(default=None, init=False, compare=False, repr=False)
    seq_length: int = field(metadata=_POSITIVE)
    dataloader_type: DataloaderType = "single"
    do_validation: bool = True
    do_test: bool = True
    num_workers: int = 2
    data_sharding: bool = True
    pin_memory: bool = True
    drop_last: bool = True
    persistent_workers: bool = True
    trust_remote_code: bool | None = None
    dataloader_save: str | None = None
    dataloader_load: str | None = None


@dataclass(kw_only=True)
class GPTDatasetConfig(_DatasetBase):
    """``type: GPTDatasetConfig``: pretraining data (no packing; only R22 applies)."""

    type: ClassVar[str] = "GPTDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.training.config.GPTDatasetConfig"
    random_seed: int = 1234
    split: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass(kw_only=True)
class GPTSFTDatasetConfig(_DatasetBase):
    """``type: GPTSFTDatasetConfig``: SFT with optional offline packing (contract §2.2).

    Its fixed-width flag lives in ``dataset_kwargs["pad_to_max_length"]``, not in a field.
    """

    type: ClassVar[str] = "GPTSFTDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig"
    dataloader_type: DataloaderType = "batch"
    dataset_root: str | None = None
    hf_dataset: str | dict[str, Any] | None = None
    hf_rewrite: bool = False
    seed: int = 1234
    memmap_workers: int = 1
    max_train_samples: int | None = None
    preprocessing: dict[str, Any] | None = None
    enable_offline_packing: bool = False
    offline_packing_specs: PackedSequenceSpecs | None = None
    dataset_kwargs: dict[str, Any] | None = None


@dataclass(kw_only=True)
class _CollatePackingDataset(_DatasetBase):
    """The collate-time packing fields shared by DirectHF, MockVLM and Energon (contract §3.6)."""

    enable_in_batch_packing: bool = False
    defer_in_batch_packing_to_step: bool = False
    pad_to_max_length: bool = False
    pad_to_multiple_of: int = 128
    in_batch_packing_pad_to_multiple_of: int = 1


@dataclass(kw_only=True)
class DirectHFSFTDatasetConfig(_CollatePackingDataset):
    """``type: DirectHFSFTDatasetConfig``: Hugging Face conversations, collate-time packing."""

    type: ClassVar[str] = "DirectHFSFTDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig"
    dataloader_type: DataloaderType = "cyclic"


@dataclass(kw_only=True)
class MockVLMSFTDatasetConfig(_CollatePackingDataset):
    """``type: MockVLMSFTDatasetConfig``: synthetic VLM data, collate-time packing."""

    type: ClassVar[str] = "MockVLMSFTDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.data.builders.mock_vlm_sft.MockVLMSFTDatasetConfig"


@dataclass(kw_only=True)
class EnergonDatasetConfig(_CollatePackingDataset):
    """``type: EnergonDatasetConfig`` (§4.1): native packing is on iff ``packing_buffer_size`` is set.

    ``task_encoder`` names the task-encoder config class (native packing needs
    ``QwenVLEnergonTaskEncoderConfig``).
    """

    type: ClassVar[str] = "EnergonDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.data.builders.energon.EnergonDatasetConfig"
    path: str
    micro_batch_size: int = field(metadata=_POSITIVE)
    task_encoder: str | None = None
    dataloader_type: DataloaderType = "external"
    do_test: bool = False
    num_val_workers: int | None = None
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int | None = None
    packing_buffer_size: int | None = None
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class DatasetProvider(_DatasetBase):
    """``type: DatasetProvider``: a custom provider, with the generic packing flags only."""

    type: ClassVar[str] = "DatasetProvider"
    target: ClassVar[str] = "megatron.bridge.data.base.DatasetProvider"
    enable_offline_packing: bool = False
    offline_packing_specs: PackedSequenceSpecs | None = None
    enable_in_batch_packing: bool = False
    dataset_kwargs: dict[str, Any] | None = None


DatasetConfig = (
    GPTDatasetConfig
    | GPTSFTDatasetConfig
    | DirectHFSFTDatasetConfig
    | EnergonDatasetConfig
    | MockVLMSFTDatasetConfig
    | DatasetProvider
)
DATASET_TYPES: dict[str, type] = {cls.type: cls for cls in get_args(DatasetConfig)}
# Other class names a ``_target_`` gives the kinds: GPT SFT's deprecated name, and the pretraining subclasses,
# which the reference's checks (isinstance) treat as their parent.
_DATASET_ALIASES = {
    "FinetuningDatasetConfig": GPTSFTDatasetConfig.type,
    "MockGPTDatasetConfig": GPTDatasetConfig.type,
    "GPTFIMDatasetConfig": GPTDatasetConfig.type,
}
_COLLATE_TYPES = (DirectHFSFTDatasetConfig.type, EnergonDatasetConfig.type, MockVLMSFTDatasetConfig.type)
_FINETUNING = (GPTSFTDatasetConfig, DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig)


@dataclass(kw_only=True)
class TrainingConfig(_Section):
    """The whole configuration (Megatron-Bridge ``ConfigContainer``); build it with `load_config`.

    Attributes:
        train, model, dataset: required sections.
        ddp, validation, dist, dist_train: optional sections (defaults as above).
        comm_overlap: optional; None when absent.
        not_checked: the dotted paths of the keys `load_config` accepted without reading them (rules 2,
            3 and 5 of the module docstring), in file order; empty when built in Python.
    """

    not_checked: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    train: TrainConfig
    model: ModelConfig
    dataset: DatasetConfig
    ddp: DDPConfig = field(default_factory=DDPConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    comm_overlap: CommOverlapConfig | None = None
    dist_train: DistTrainConfig = field(default_factory=DistTrainConfig)


# The Megatron-Bridge class of each section, as the ``_target_`` of a serialized configuration names it.
_SECTION_TARGETS: dict[type, str] = {
    TrainingConfig: "ConfigContainer",
    TrainConfig: "TrainingConfig",
    DDPConfig: "DistributedDataParallelConfig",
    ValidationConfig: "ValidationConfig",
    DistConfig: "DistributedInitConfig",
    CommOverlapConfig: "CommOverlapConfig",
    DistTrainConfig: "DistTrainConfig",
    PackedSequenceSpecs: "PackedSequenceSpecs",
}
# ``model`` is one of many classes: GPTModelProvider and its per-family subclasses (Llama31ModelProvider,
# ...), MegatronMIMOProvider, the builder configs GPTModelConfig and HybridModelConfig.
_MODEL_TARGET_SUFFIXES = ("Provider", "ModelConfig")
_TARGET = "_target_"


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Megatron-Bridge's ConfigContainer sections that tightpack does not model (rule 2), and per modelled section
# the fields of its Megatron-Bridge class that tightpack does not model (rule 3): the dataclass fields,
# inherited ones included, of Megatron-Bridge 067f987 with the Megatron-LM it pins (2a75ac1). ``model``:
# GPTModelProvider with Megatron-Core's TransformerConfig, MLATransformerConfig and ModelParallelConfig, the
# other ConfigContainer model classes (HybridModelProvider, T5ModelProvider, MegatronMIMOProvider,
# GPTModelConfig, HybridModelConfig), and the Qwen-VL providers' vision CUDA-graph scope and DistTrain.
# GPTDatasetConfig includes its MockGPT and FIM subclasses; the other kinds have no field tightpack lacks.
_MB_SECTIONS = _names(
    """
    checkpoint env_vars ft inprocess_restart logger mixed_precision nvrx_straggler optimizer
    optimizer_config_override_provider peft profiling rerun_state_machine rng scheduler straggler
    tensor_inspect tokenizer
    """
)
_MB_FIELDS: dict[type, frozenset[str]] = {
    TrainConfig: _names(
        """
        check_optimizer_step_success check_weight_hash_across_dp_replicas_interval
        decrease_batch_size_if_needed empty_unused_memory_level eval_interval eval_iters
        exit_duration_in_mins exit_interval exit_signal exit_signal_handler
        exit_signal_handler_for_dataloader exit_signal_handler_for_training gpu_sniff_test_interval
        iterations_to_skip manual_gc manual_gc_eval manual_gc_interval rampup_batch_size
        skip_sync_grad_norm_across_mp skip_train step_batch_size_schedule train_samples
        train_sync_interval
        """
    ),
    ModelConfig: _names(
        """
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split activation_func
        activation_func_clamp_value activation_func_fp8_input_store activation_offload_fraction
        add_bias_linear add_qkv_bias apply_query_key_layer_scaling
        apply_residual_connection_post_layernorm apply_rope_fusion attention_backend attention_dropout
        attention_output_gate attention_softmax_in_fp32 autocast_dtype barrier_with_L1_time
        batch_invariant_mode batch_p2p_comm batch_p2p_sync beta_fast beta_slow bf16
        bias_activation_fusion bias_dropout_fusion cache_mla_latents clone_scatter_output_in_embedding
        config_logger_dir cp_comm_type cpu_offloading cpu_offloading_activations
        cpu_offloading_double_buffering cpu_offloading_num_layers
        cpu_offloading_retain_pinned_cpu_buffers cpu_offloading_weights cross_entropy_fusion_impl
        cross_entropy_loss_fusion cuda_graph_modules cuda_graph_retain_backward_graph
        cuda_graph_use_single_mempool cuda_graph_warmup_steps deallocate_pipeline_outputs
        defer_embedding_wgrad_compute delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks
        dense_grouped_gemm deterministic_mode disable_bf16_reduced_precision_matmul
        disable_parameter_transpose_cache dist_train distribute_saved_activations dsa_indexer_head_dim
        dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 dsa_indexer_loss_coeff dsa_indexer_n_heads
        dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu
        dsa_indexer_skip_topk_offset dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss
        dsa_kernel_backend embedding_init_method embedding_init_method_std enable_autocast
        enable_cuda_graph encoder_num_layers encoder_pipeline_model_parallel_size
        ep_overlap_early_attn_memory_release experimental_attention_variant
        experimental_attention_variant_loss_scale_func expert_gtp_weight_remat_size
        expert_tensor_parallel_num_weight_shards expert_tensor_parallel_size external_cuda_graph
        extra_checkpoint_metadata ffn_hidden_size finalize_model_grads_func
        fine_grained_activation_offloading fine_grained_offloading_max_inflight_offloads
        first_last_layers_bf16 flash_attention_version flash_decode fp16 fp16_lm_cross_entropy
        fp32_residual_connection fp4 fp4_param fp4_quantizer_factory fp4_recipe fp8
        fp8_amax_compute_algo fp8_amax_history_len fp8_dot_product_attention fp8_interval fp8_margin
        fp8_multi_head_attention fp8_output_proj fp8_param fp8_quantizer_factory fp8_recipe fp8_wgrad
        freeze_language_model freeze_modality_encoders freeze_modality_projections
        fused_residual_rmsnorm fused_single_qkv_rope gated_linear_unit gdp_num_householder
        glu_linear_offset grad_scale_func grad_sync_func gradient_accumulation_fusion
        gtp_remat_opt_in_modules gtp_weight_remat_size hetereogenous_dist_checkpoint
        heterogeneous_block_specs hf_model_id hf_model_revision hidden_dropout hidden_size
        hierarchical_context_parallel_sizes high_priority_a2a_comm_stream hybrid_attention_ratio
        hybrid_context_parallel hybrid_layer_pattern hybrid_mlp_ratio hybrid_override_pattern
        hybrid_stack_spec inference_cuda_graph_scope inference_disable_triton_nvls_kernels
        inference_fuse_tp_communication inference_grouped_gemm_backend
        inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type
        inference_rng_tracker inference_sampling_seed init_method init_method_std
        init_model_with_meta_device is_hybrid_model keep_mtp_spec_in_bf16 kitchen_attention_backend
        kv_channels kv_lora_rank language_model_spec layernorm_epsilon layernorm_zero_centered_gamma
        linear_attention_freq linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads
        linear_num_value_heads linear_value_head_dim log_max_attention_logit logit_dtype
        make_vocab_size_divisible_by mamba_chunk_size mamba_head_dim mamba_num_groups mamba_num_heads
        mamba_state_dim mamba_training_ssm_states_dtype masked_softmax_fusion max_position_embeddings
        max_seqlen_per_dp_cp_rank megatron_mimo_parallelism_config memory_efficient_layer_norm
        microbatch_group_size_per_vp_stage min_offloaded_tensor_size mla_down_proj_fusion
        mlp_chunks_for_prefill mlp_chunks_for_training modality_submodules_spec module_output_ndim
        moe_apply_probs_on_input moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep
        moe_enable_routing_replay moe_expert_capacity_factor moe_expert_rank_capacity_factor
        moe_ffn_hidden_size moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_grad_scale_func
        moe_grouped_gemm moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
        moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs
        moe_input_jitter_eps moe_latent_size moe_layer_freq moe_layer_recompute
        moe_mlp_glu_interleave_size moe_ncclep_zero_copy moe_pad_expert_input_to_capacity
        moe_pad_experts_for_cuda_graph_inference moe_paged_stash moe_paged_stash_buffer_size_factor_cpu
        moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_page_size moe_per_layer_logging
        moe_permute_fusion moe_permute_fusion_into_hybridep moe_router_bias_update_rate moe_router_dtype
        moe_router_enable_expert_bias moe_router_force_biased moe_router_force_load_balancing
        moe_router_fusion moe_router_group_topk moe_router_load_balancing_type moe_router_num_groups
        moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_router_pre_softmax
        moe_router_quantile_balancing_ema moe_router_score_function moe_router_topk
        moe_router_topk_limited_devices moe_router_topk_scaling_factor moe_shared_expert_gate
        moe_shared_expert_glu_interleave_size moe_shared_expert_intermediate_size
        moe_shared_expert_overlap moe_single_grouped_bias moe_single_grouped_weight
        moe_token_dispatcher_type moe_token_drop_policy moe_token_dropping moe_z_loss_coeff
        mrope_section mscale mscale_all_dim mtp_detach_heads mtp_enabled mtp_grad_scale_func
        mtp_hybrid_override_pattern mtp_loss_scaling_factor mtp_standalone mtp_use_repeated_layer
        multi_latent_attention mup_attn_scale_power mup_base_head_dim mup_base_hidden_size
        mup_embedding_mult mup_output_mult mup_width_mult nccl_all_reduce_for_prefill no_rope_freq
        no_sync_func normalization num_attention_heads num_layers num_layers_at_end_in_bf16
        num_layers_at_start_in_bf16 num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
        num_microbatches_with_partial_activation_checkpoints num_query_groups offload_modules
        original_max_position_embeddings output_layer_init_method
        overlap_dispatch_backward_with_experts_wgrad overlap_p2p_comm overlap_p2p_comm_warmup_flush
        parallel_output param_sync_func params_dtype perform_initialization persist_layer_norm
        pipeline_dtype pipeline_model_parallel_comm_backend pipeline_model_parallel_layout
        position_embedding_type post_wrap_hooks pre_wrap_hooks q_lora_rank qk_clip qk_clip_alpha
        qk_clip_threshold qk_head_dim qk_l2_norm qk_layernorm qk_pos_emb_head_dim quant_recipe
        recompute_granularity recompute_method recompute_modules recompute_num_layers
        relative_attention_max_distance relative_attention_num_buckets restore_modelopt_state
        rope_scaling rope_scaling_factor rope_type rotary_base rotary_interleaved rotary_percent
        rotary_scaling_factor scatter_embedding_sequence_parallel seq_len_interpolation_factor
        seq_length_dec share_embeddings_and_output_weights should_pad_vocab softmax_scale softmax_type
        special_token_ids standard_provider symmetric_ar_type tensor_parallel_num_weight_shards
        test_mode timers topology tp_comm_atomic_ag tp_comm_atomic_rs tp_comm_bootstrap_backend
        tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_cfg
        tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv tp_comm_overlap_rs
        tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs tp_only_amax_red transformer
        transformer_impl transformer_layer_spec use_arbitrary_attention_mask use_cpu_initialization
        use_fused_weighted_squared_relu use_grouped_gemm_for_dense_mlp
        use_grouped_gemm_for_shared_expert use_inference_optimized_layers use_kitchen
        use_kitchen_attention use_mamba_mem_eff_path use_mup use_ring_exchange_p2p
        use_te_activation_func use_te_rng_tracker use_transformer_engine_full_layer_spec
        use_transformer_engine_op_fuser v_head_dim variable_seq_lengths
        virtual_pipeline_model_parallel_size vision_cuda_graph_scope vocab_size wgrad_deferral_limit
        window_attn_skip_freq window_size yarn_beta_fast yarn_beta_slow
        yarn_correction_range_round_to_int yarn_mscale yarn_mscale_all_dim
        yarn_original_max_position_embeddings yarn_rotary_scaling_factor
        """
    ),
    DDPConfig: _names(
        """
        align_param_gather bucket_size check_for_large_grads data_parallel_sharding_strategy
        delay_wgrad_compute disable_symmetric_registration fp4_param_gather fp8_param_gather
        fsdp_all_gather_in_start_param_sync fsdp_db_use_persist_buf_on_alloc_fail fsdp_double_buffer
        fsdp_manual_registration gradient_reduce_div_fusion keep_fp8_transpose_cache
        megatron_fsdp_cuda_graph_mode megatron_fsdp_enable_fine_grained_param_gather
        megatron_fsdp_grad_comm_dtype megatron_fsdp_main_grads_dtype megatron_fsdp_main_params_dtype
        megatron_fsdp_max_pool_double_buffer megatron_fsdp_use_decoupled_grad megatron_fsdp_version
        nccl_ub num_buckets num_distributed_optimizer_instances outer_dp_sharding_strategy
        pad_buckets_for_high_nccl_busbw param_name_patterns_for_fp32_local_accumulation
        reduce_scatter_with_fp32_accumulation reuse_grad_buf_for_mxfp8_param_ag
        suggested_communication_unit_size use_custom_fsdp use_megatron_fsdp
        """
    ),
    ValidationConfig: _names(
        """
        full_validation multiple_validation_sets skip_train start_eval_at_iter test_mode
        validation_set_names
        """
    ),
    DistConfig: _names(
        """
        align_grad_reduce disable_jit_fuser distributed_backend distributed_timeout_minutes
        distributed_timeout_seconds_after_init enable_megatron_core_experimental
        external_gpu_device_mapping flight_recorder_dump_on_timeout flight_recorder_dump_path
        flight_recorder_extra_dump_on_exec flight_recorder_include_only_active
        flight_recorder_include_stack_trace flight_recorder_trace_buffer_size
        high_priority_stream_groups lazy_mpu_init local_rank nccl_communicator_config_path
        sharp_enabled_group use_decentralized_pg use_gloo_process_groups use_megatron_fsdp use_sharp
        use_torch_fsdp2 use_tp_pp_dp_mapping
        """
    ),
    CommOverlapConfig: _names(
        """
        align_param_gather batch_p2p_comm bucket_size data_parallel_size defer_embedding_wgrad_compute
        overlap_grad_reduce overlap_p2p_comm overlap_param_gather
        overlap_param_gather_with_optimizer_step tp_comm_bootstrap_backend tp_comm_overlap_cfg
        wgrad_deferral_limit
        """
    ),
    GPTDatasetConfig: _names(
        """
        add_extra_token_to_sequence allow_ambiguous_pad_tokens blend blend_per_split
        context_parallel_size create_attention_mask data_parallel_size data_path defer_npy_index_mmap
        drop_last_partial_validation_sequence fast_cache_load fim_extra_tokens fim_fragment_rate
        fim_no_prefix fim_rate fim_split_sample fim_spm_rate full_validation hybrid_context_parallel
        inter_document_masking mid_level_dataset_surplus mmap_bin_files multiple_validation_sets
        num_dataset_builder_threads object_storage_cache_path path_to_cache per_dataset_sequences_path
        sequence_length sequence_parallel_size sequences_per_dataset tokenizer
        """
    ),
    GPTSFTDatasetConfig: _names(
        """
        hf_output_root hf_test_dataset hf_validation_dataset hf_validation_proportion
        """
    ),
    DirectHFSFTDatasetConfig: _names(
        """
        blend_seed hf_processor_kwargs hf_processor_path preprocessing
        skip_getting_attention_mask_from_dataset source source_weights test_source validation_source
        """
    ),
    MockVLMSFTDatasetConfig: _names(
        """
        hf_processor_path image_size num_base_examples num_images prompt random_seed
        skip_getting_attention_mask_from_dataset
        """
    ),
}
# Rule 4: an unread key this close (difflib ratio) to a field of its section is a typo of that field.
_CLOSE_RATIO = 0.8


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> TrainingConfig:
    """Build a `TrainingConfig` from a YAML file path or a dict of sections.

    ``_target_`` keys (Megatron-Bridge's serialized class paths) are accepted on every section that they
    name the right class for; on ``dataset`` the class picks the kind. A dataset with neither ``type`` nor
    ``_target_`` gets the one kind that has all its fields. Keys tightpack does not read are accepted by the
    rules of the module docstring and listed in ``config.not_checked``.

    Raises:
        TightpackError: the file cannot be read or parsed, a key looks like a misspelt or misplaced field
            tightpack checks or is no ConfigContainer section (the message names its path and the closest
            valid name), a required key is missing, a value has the wrong type, a
            ``_target_`` names another class, or the dataset kind is unknown, contradictory (``type`` vs
            ``_target_``) or ambiguous (fields that several kinds have: set ``type``).

    >>> config = load_config({"train": {"micro_batch_size": 1, "global_batch_size": 8},
    ...                       "model": {"seq_length": 4096},
    ...                       "dataset": {"type": "GPTSFTDatasetConfig", "seq_length": 4096}})
    >>> config.dataset.dataloader_type, config.model.context_parallel_size
    ('batch', 1)
    >>> inferred = load_config({"train": {"micro_batch_size": 1, "global_batch_size": 8},
    ...                         "model": {"seq_length": 4096},
    ...                         "dataset": {"seq_length": 4096, "dataset_root": "/data/squad"}})
    >>> inferred.dataset.type, inferred.dataset.type_source
    ('GPTSFTDatasetConfig', 'inferred from its fields: dataset_root')
    >>> recipe = load_config({"train": {"micro_batch_size": 1, "global_batch_size": 8, "eval_iters": 10},
    ...                       "model": {"seq_length": 4096, "hidden_size": 4096},
    ...                       "dataset": {"seq_length": 4096, "dataset_root": "/data/squad"},
    ...                       "optimizer": {"lr": 1e-5}})
    >>> recipe.not_checked
    ('train.eval_iters', 'model.hidden_size', 'optimizer')
    >>> load_config({"train": {"micro_batch_sise": 1}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tightpack.errors.TightpackError: unknown key 'micro_batch_sise' ...; did you mean train.micro_batch_size?
    """
    if isinstance(source, Mapping):
        return _build_config(source)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise TightpackError(f"cannot read config {path}: {reason}") from None
    try:
        import yaml
    except ImportError:  # pragma: no cover - transformers depends on PyYAML
        raise TightpackError("reading YAML configs needs PyYAML: pip install pyyaml") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise TightpackError(f"cannot parse config {path} as YAML: {problem}{where}") from None
    if not isinstance(data, Mapping):
        raise TightpackError(
            f"config {path} must be a mapping of sections (train, model, dataset, ...), got {_kind(data)}"
        )
    return _build_config(data)


def _build_config(data: Mapping[str, Any]) -> TrainingConfig:
    skipped: list[str] = []
    config = _build(TrainingConfig, data, "", skipped)
    config.not_checked = tuple(skipped)
    return config


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _build(cls: type, data: object, prefix: str, skipped: list[str]) -> Any:
    """An instance of ``cls`` from ``data``; the keys it accepts unread are appended to ``skipped``."""
    if not isinstance(data, Mapping):
        raise TightpackError(f"{prefix or 'the config'} must be a mapping, got {_kind(data)}")
    any_key = False
    if _TARGET in data:
        _check_section_target(cls, data[_TARGET], prefix)
        any_key = cls is ModelConfig  # a serialized provider: every field of its class (rule 3)
        data = {key: value for key, value in data.items() if key != _TARGET}
    fields = {item.name: item for item in dataclasses.fields(cls) if item.init}
    for key in data:
        if not isinstance(key, str):
            raise TightpackError(f"{prefix or 'the config'} has a non-string key {key!r}")
        message = None if key in fields or any_key else _unknown_key_message(cls, key, prefix)
        if message is not None:
            raise TightpackError(message)
    hints = get_type_hints(cls)
    values = {}
    for key, value in data.items():  # in file order, so that ``skipped`` is too
        path = _join(prefix, key)
        if key not in fields:
            skipped.append(path)
            continue
        values[key] = _convert(value, hints[key], path, skipped)
        _check_minimum(values[key], fields[key].metadata.get("minimum"), path)
    for name, item in fields.items():
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        if required and name not in values:
            raise TightpackError(f"missing required key {_join(prefix, name)}")
    return cls(**values)


def _target_class(value: object, path: str) -> str:
    """The class a ``_target_`` names: the last component of its dotted path."""
    name = value.rsplit(".", 1)[-1] if isinstance(value, str) else ""
    if not name.isidentifier():
        raise TightpackError(
            f"{path} must be a dotted class path (e.g. {GPTSFTDatasetConfig.target}), got {_kind(value)}"
        )
    return name


def _check_section_target(cls: type, value: object, prefix: str) -> None:
    """A section's ``_target_`` must name the Megatron-Bridge class the section is; then it is dropped."""
    path = _join(prefix, _TARGET)
    name = _target_class(value, path)
    if cls is ModelConfig:
        dataset_class = name in DATASET_TYPES or name in _DATASET_ALIASES
        if name.endswith(_MODEL_TARGET_SUFFIXES) and not dataset_class:
            return
        expected = "a model provider (a class named *Provider or *ModelConfig, e.g. GPTModelProvider)"
    else:
        if name == _SECTION_TARGETS[cls]:
            return
        expected = f"Megatron-Bridge's {_SECTION_TARGETS[cls]}"
    raise TightpackError(
        f"{path} {value!r} names {name}, but {prefix or 'the top level'} holds {expected}; move the keys to "
        f"their section or remove {path}"
    )


def _build_dataset(data: object, path: str, skipped: list[str]) -> Any:
    if not isinstance(data, Mapping):
        raise TightpackError(f"{path} must be a mapping, got {_kind(data)}")
    for key in data:
        if not isinstance(key, str):
            raise TightpackError(f"{path} has a non-string key {key!r}")
    fields = {key: value for key, value in data.items() if key not in ("type", _TARGET)}
    kind, source = _dataset_kind(data, list(fields), path)
    try:
        dataset = _build(DATASET_TYPES[kind], fields, path, skipped)
    except TightpackError as error:
        if source.startswith("inferred"):
            how = source.replace("inferred", f"inferred as {kind}", 1)
            raise TightpackError(
                f"{error} ({path} type {how}; set {path}.type if you meant another)"
            ) from None
        raise
    dataset.type_source = source
    return dataset


def _dataset_kind(data: Mapping[str, Any], keys: list[str], path: str) -> tuple[str, str]:
    """The dataset kind from ``type``, ``_target_`` or the fields, and how it was chosen (``type_source``)."""
    declared = data.get("type")
    if "type" in data and (not isinstance(declared, str) or declared not in DATASET_TYPES):
        names = ", ".join(DATASET_TYPES)
        close = difflib.get_close_matches(str(declared), DATASET_TYPES, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TightpackError(f"unknown {path}.type {declared!r}; {hint}(one of {names})")
    if _TARGET in data:
        value = data[_TARGET]
        name = _target_class(value, _join(path, _TARGET))
        target = _DATASET_ALIASES.get(name, name)
        if target not in DATASET_TYPES:
            if declared == DatasetProvider.type:
                return declared, f"{path}.type"  # a custom provider names its own class
            raise TightpackError(_unknown_dataset_target_message(value, name, path))
        if "type" in data and declared != target:
            raise TightpackError(
                f"{path}.type {declared!r} and {path}._target_ {value!r} name different dataset types "
                f"({declared}, {target}); keep the one you mean and remove the other"
            )
        return target, f"{path}.type" if "type" in data else f"{path}._target_"
    if "type" in data:
        return declared, f"{path}.type"
    kind, deciding = _infer_dataset_kind(keys, path)
    return kind, f"inferred from its fields: {', '.join(deciding)}"


def _unknown_dataset_target_message(value: object, name: str, path: str) -> str:
    head = (
        f"unknown {path}._target_ {value!r}: its class {name} is none of {', '.join(DATASET_TYPES)} "
        f"(or {', '.join(_DATASET_ALIASES)})"
    )
    config_name = f"{name}Config"  # the dataset class instead of its configuration
    if config_name in DATASET_TYPES or config_name in _DATASET_ALIASES:
        return f"{head}; did you mean {config_name}?"
    return f"{head}; for a custom provider set {path}.type: {DatasetProvider.type}"


@cache
def _dataset_fields() -> dict[str, frozenset[str]]:
    """Each dataset kind -> the keys tightpack models for it."""
    return {
        name: frozenset(item.name for item in dataclasses.fields(cls) if item.init)
        for name, cls in DATASET_TYPES.items()
    }


@cache
def _dataset_known_fields() -> dict[str, frozenset[str]]:
    """Each dataset kind -> the keys its Megatron-Bridge class takes: tightpack's and `_MB_FIELDS`."""
    return {
        name: names | _MB_FIELDS.get(DATASET_TYPES[name], frozenset())
        for name, names in _dataset_fields().items()
    }


def _infer_dataset_kind(keys: list[str], path: str) -> tuple[str, tuple[str, ...]]:
    """The one dataset kind that has every key, and the keys that decide it.

    A key that no kind has does not count when rule 5 of the module docstring accepts it (`_build` then
    lists it as not checked); it is an error when it looks like a field tightpack checks (rule 4). The
    deciding keys are those no other kind has; when every key is shared (the combination decides), those
    that not every kind has.

    >>> _infer_dataset_kind(["seq_length", "dataset_root", "enable_offline_packing"], "dataset")
    ('GPTSFTDatasetConfig', ('dataset_root',))
    >>> _infer_dataset_kind(["seq_length", "enable_in_batch_packing", "offline_packing_specs"], "dataset")
    ('DatasetProvider', ('enable_in_batch_packing', 'offline_packing_specs'))
    >>> _infer_dataset_kind(["seq_length", "data_path", "cache_tag"], "dataset")  # Megatron-Bridge's field
    ('GPTDatasetConfig', ('data_path',))
    """
    kinds = _dataset_known_fields()
    known = frozenset().union(*kinds.values())
    hints = {key: _dataset_key_hint(key, path) for key in keys if key not in known}
    suspects = {key: hint for key, hint in hints.items() if hint is not None}
    if suspects:
        raise TightpackError(_unknown_dataset_keys_message(suspects, path))
    keys = [key for key in keys if key in known]
    owners = {key: [name for name, names in kinds.items() if key in names] for key in keys}
    distinctive = [key for key in keys if len(owners[key]) < len(kinds)]
    fits = [name for name, names in kinds.items() if names.issuperset(keys)]
    if len(fits) == 1:
        unique = tuple(key for key in keys if owners[key] == fits)
        return fits[0], unique or tuple(distinctive)
    if fits:
        example = DATASET_TYPES[fits[0]]
        raise TightpackError(
            f"{path} has no type and its fields ({', '.join(keys) or 'none'}) fit {len(fits)} dataset types: "
            f"{', '.join(fits)}; set {path}.type to the one you mean (e.g. type: {example.type}) or "
            f"{path}._target_ to its class path (e.g. _target_: {example.target})"
        )
    described = [
        f"{key} {'' if index else 'is a field '}of {', '.join(owners[key])}"
        + (" only" if len(owners[key]) == 1 else "")
        for index, key in enumerate(distinctive)
    ]
    raise TightpackError(
        f"{path} has no type and its fields fit no dataset type: {', '.join(described)}; set {path}.type and "
        "remove the fields it does not have"
    )


def _dataset_key_hint(key: str, path: str) -> str | None:
    """Rule 4 for a key no dataset kind has: the field tightpack checks that it likely means, else None."""
    elsewhere = [found for found in _field_paths().get(key, ()) if found.rsplit(".", 1)[0] != path]
    if elsewhere:
        return " or ".join(elsewhere)
    names = sorted(frozenset().union(*_dataset_fields().values()))
    close = difflib.get_close_matches(key, names, n=1, cutoff=_CLOSE_RATIO)
    return _join(path, close[0]) if close else None


def _unknown_dataset_keys_message(suspects: Mapping[str, str], path: str) -> str:
    """Keys of a dataset without a type that no kind has (key -> the field it likely means)."""
    several = len(suspects) > 1
    guesses = [f"{hint} (for {key})" if several else hint for key, hint in suspects.items()]
    return (
        f"unknown key{'s' if several else ''} {', '.join(map(repr, suspects))} in {path} "
        f"({', '.join(_join(path, key) for key in suspects)}); no dataset type has "
        f"{'them' if several else 'it'}; did you mean {', '.join(guesses)}?"
    )


@cache
def _field_paths() -> dict[str, tuple[str, ...]]:
    """Every known field name -> the dotted paths where it is valid (dataset fields of all kinds)."""
    paths: dict[str, list[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for item in dataclasses.fields(cls):
            if not item.init:
                continue
            path = _join(prefix, item.name)
            paths.setdefault(item.name, [])
            if path not in paths[item.name]:
                paths[item.name].append(path)
            for member in (hints[item.name], *get_args(hints[item.name])):
                if dataclasses.is_dataclass(member):
                    walk(member, path)

    walk(TrainingConfig, "")
    return {name: tuple(found) for name, found in paths.items()}


def _unknown_key_message(cls: type, key: str, prefix: str) -> str | None:
    """The error for a key that ``cls`` does not model, or None when it is accepted unread.

    Rules 2 to 5 of the module docstring: a Megatron-Bridge section or field is accepted; a key like a field
    tightpack checks (misplaced, of another dataset kind, or within `_CLOSE_RATIO`) is an error; a stray
    top-level name is an error; any other key is accepted.
    """
    valid = [item.name for item in dataclasses.fields(cls) if item.init]
    kind = getattr(cls, "type", None)
    where = prefix or "the top level"
    head = f"unknown key {key!r} in {where}{f' ({kind})' if kind else ''} ({_join(prefix, key)})"
    top = cls is TrainingConfig
    if key in (_MB_SECTIONS if top else _MB_FIELDS.get(cls, ())):
        return None
    custom = cls is DatasetProvider  # the user's own class: only closeness counts
    owners = [name for name, names in _dataset_fields().items() if key in names] if kind else []
    if owners and not custom:
        hint = f"; it is a field of {', '.join(owners)}, not of {kind}"
        if key == "pad_to_max_length" and "dataset_kwargs" in valid:
            hint += f"; {kind} takes it as {prefix}.dataset_kwargs.pad_to_max_length"
        return head + hint
    elsewhere = [path for path in _field_paths().get(key, ()) if path.rsplit(".", 1)[0] != prefix]
    if elsewhere and not custom:
        return f"{head}; did you mean {' or '.join(elsewhere)}?"
    if top:
        sections = sorted(_MB_SECTIONS)
        close = difflib.get_close_matches(key, [*valid, *sections], n=1, cutoff=0.5)
        if close:
            return f"{head}; did you mean {close[0]}?"
        return (
            f"{head}; valid keys: {', '.join(valid)}, and Megatron-Bridge's other sections, which tightpack "
            f"does not check: {', '.join(sections)}"
        )
    close = difflib.get_close_matches(key, valid, n=1, cutoff=_CLOSE_RATIO)
    return f"{head}; did you mean {_join(prefix, close[0])}?" if close else None


def _describe(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if annotation in names:
        return names[annotation]
    if origin is list:
        return f"a list of {_describe(args[0])}"
    return "a mapping"


def _matches(value: object, annotation: Any) -> bool:
    """Whether ``value`` has the right kind for ``annotation`` (the union member to convert with)."""
    origin = get_origin(annotation)
    if annotation is Any:
        return True
    if origin is Literal:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list)
    if origin is dict or dataclasses.is_dataclass(annotation):
        return isinstance(value, Mapping)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is type(None):
        return value is None
    return isinstance(value, annotation)


def _convert(value: object, annotation: Any, path: str, skipped: list[str]) -> Any:
    if annotation == DatasetConfig:
        return _build_dataset(value, path, skipped)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        for member in args:
            if _matches(value, member):
                return _convert(value, member, path, skipped)
        raise TightpackError(f"{path} must be {_describe(annotation)}, got {_kind(value)}")
    if not _matches(value, annotation):
        raise TightpackError(f"{path} must be {_describe(annotation)}, got {_kind(value)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(arg) for arg in args], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TightpackError(f"{path} must be {_describe(annotation)}, got {value!r}{hint}")
        return value
    if origin is list:
        return [_convert(item, args[0], f"{path}[{index}]", skipped) for index, item in enumerate(value)]  # type: ignore[arg-type]
    if origin is dict:
        for key in value:  # type: ignore[union-attr]
            if not isinstance(key, str):
                raise TightpackError(f"{path} keys must be strings, got {key!r}")
        return {key: _convert(item, args[1], _join(path, key), skipped) for key, item in value.items()}  # type: ignore[union-attr]
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, path, skipped)  # type: ignore[arg-type]
    return float(value) if annotation is float else value  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Derived values (R11, R12, R14, the batch arithmetic)
# --------------------------------------------------------------------------------------------------


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
        if self.dataset_type in _COLLATE_TYPES:
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


def _offline(dataset: object) -> bool:
    return bool(getattr(dataset, "enable_offline_packing", False)) and _specs(dataset) is not None


def _specs(dataset: object) -> PackedSequenceSpecs | None:
    return getattr(dataset, "offline_packing_specs", None)


def _native(dataset: object) -> bool:
    return isinstance(dataset, EnergonDatasetConfig) and dataset.packing_buffer_size is not None


def _in_batch(dataset: object) -> bool:
    return bool(getattr(dataset, "enable_in_batch_packing", False))


def _deferred(dataset: object) -> bool:
    return bool(getattr(dataset, "defer_in_batch_packing_to_step", False))


def _kwargs(dataset: object) -> Mapping[str, Any]:
    return getattr(dataset, "dataset_kwargs", None) or {}


def _fixed_width(dataset: object) -> bool:
    """R5's test: the dataset's own flag, or ``dataset_kwargs["pad_to_max_length"]``, is True."""
    return (
        getattr(dataset, "pad_to_max_length", False) is True
        or _kwargs(dataset).get("pad_to_max_length") is True
    )


def _fixed_width_key(dataset: object) -> str:
    return (
        "dataset.pad_to_max_length"
        if hasattr(dataset, "pad_to_max_length")
        else "dataset.dataset_kwargs.pad_to_max_length"
    )


def _packing_mode(dataset: object) -> PackingMode:
    if _native(dataset):
        return "native_energon"
    if _offline(dataset):
        return "offline"
    if _in_batch(dataset):
        return "deferred" if _deferred(dataset) else "in_batch"
    return "none"


def _divide(numerator: int, denominator: int) -> int | None:
    return numerator // denominator if numerator % denominator == 0 else None


def _overlap_copies(config: TrainingConfig) -> list[tuple[str, object]]:
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


def _derive(config: TrainingConfig) -> DerivedValues:
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
    collate = isinstance(dataset, _CollatePackingDataset)
    if collate:
        pad_to_max_length: bool | None = (
            dataset.pad_to_max_length or pp > 1 or model.expert_model_parallel_size > 1
        )
    elif hasattr(dataset, "dataset_kwargs"):
        pad_to_max_length = _fixed_width(dataset)
    else:
        pad_to_max_length = None
    marked = _in_batch(dataset) or _native(dataset)
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
        forced_off=tuple(path for path, _ in _overlap_copies(config)) if _native(dataset) else (),
    )


# --------------------------------------------------------------------------------------------------
# Findings and the report
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One violated rule.

    Attributes:
        rule: rule id, e.g. ``"R20"`` (the table in this module's docstring).
        severity: ``"error"`` (the run would fail or compute the wrong thing) or ``"warning"``.
        reason: what is wrong, with the values.
        fix: what to set.
    """

    rule: str
    severity: Severity
    reason: str
    fix: str


@dataclass(frozen=True)
class ValidationReport:
    """Every finding of `validate`, in rule order, the derived values and the keys no rule read.

    Attributes:
        findings: the violations, errors and warnings, in rule order.
        derived: what the reference derives (None: not computed).
        not_checked: the dotted paths `load_config` accepted without reading (``TrainingConfig.not_checked``).

    >>> report = ValidationReport(findings=(Finding("R21", "error", "MBS is 1", "set MBS 2"),), derived=None)
    >>> report.ok, [finding.rule for finding in report.errors], report.warnings
    (False, ['R21'], ())
    """

    findings: tuple[Finding, ...]
    derived: DerivedValues | None
    not_checked: tuple[str, ...] = ()

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == "warning")

    @property
    def ok(self) -> bool:
        """False when there is any error (warnings do not count)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``ok``, ``errors``, ``warnings``, ``derived``, ``overrides`` and ``not_checked``."""
        derived = self.derived
        return {
            "ok": self.ok,
            "errors": [dataclasses.asdict(finding) for finding in self.errors],
            "warnings": [dataclasses.asdict(finding) for finding in self.warnings],
            "derived": dataclasses.asdict(derived) if derived else None,
            "overrides": derived.overrides() if derived else {},
            "not_checked": list(self.not_checked),
        }

    def format(self) -> str:
        """Human-readable text: errors, warnings (rule, reason, fix), derived values, keys not checked."""
        lines: list[str] = []
        for title, findings in (("errors", self.errors), ("warnings", self.warnings)):
            lines.append(f"{title} ({len(findings)}):" if findings else f"{title}: none")
            for finding in findings:
                lines.append(f"  {finding.rule:<6} {finding.reason}")
                lines.append(f"  {'':<6} fix: {finding.fix}")
        if self.derived is not None:
            lines.append("derived values:")
            lines += [f"  {name:<42} {value}" for name, value in _derived_rows(self.derived)]
        if self.not_checked:
            lines.append(_not_checked_line(self.not_checked))
        counts = f"{_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"
        lines.append(f"result: {'ok' if self.ok else 'invalid'} ({counts})")
        return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


_NOT_CHECKED_SHOWN = 3  # a section with more unread keys is summarized as "N keys of SECTION"


def _not_checked_line(paths: Iterable[str]) -> str:
    """The keys no rule read, in one line: whole sections first, then each section's keys or their count.

    >>> model = ["model.hidden_size", "model.num_layers", "model.ffn_hidden_size", "model.vocab_size"]
    >>> _not_checked_line(["train.eval_iters", *model, "optimizer", "scheduler"])
    'not checked by tightpack: optimizer, scheduler, train.eval_iters, 4 keys of model (7 keys)'
    """
    groups: dict[str, list[str]] = {"": []}  # the top level's whole sections first
    for path in paths:
        groups.setdefault(path.rpartition(".")[0], []).append(path)
    shown: list[str] = []
    for section, keys in groups.items():
        many = section and len(keys) > _NOT_CHECKED_SHOWN
        shown += [f"{len(keys)} keys of {section}"] if many else keys
    total = sum(len(keys) for keys in groups.values())
    return f"not checked by tightpack: {', '.join(shown)} ({_plural(total, 'key')})"


def _dataset_type_shown(derived: DerivedValues) -> str:
    """``GPTSFTDatasetConfig (inferred from its fields: dataset_root)``: the kind, and why unless declared."""
    source = derived.dataset_type_source
    if source is None or source.endswith(".type"):
        return derived.dataset_type
    return f"{derived.dataset_type} ({source if source.startswith('inferred') else f'from {source}'})"


def _derived_rows(derived: DerivedValues) -> list[tuple[str, object]]:
    def shown(value: object) -> object:
        return "n/a" if value is None else value

    rows: list[tuple[str, object]] = [
        ("dataset type", _dataset_type_shown(derived)),
        ("packing", derived.packing),
        ("alignment multiple k (R13)", derived.alignment_multiple),
        ("data-parallel size", shown(derived.data_parallel_size)),
        ("micro-batches per step", shown(derived.micro_batches_per_step)),
        ("eval context-parallel size", derived.eval_context_parallel_size),
        ("eval data-parallel size", shown(derived.eval_data_parallel_size)),
        ("eval micro-batches per step", shown(derived.eval_micro_batches_per_step)),
        ("pad_to_max_length (R12)", shown(derived.pad_to_max_length)),
        ("in_batch_packing_pad_to_multiple_of (R14)", shown(derived.in_batch_packing_pad_to_multiple_of)),
        ("pad_to_multiple_of (R14)", shown(derived.pad_to_multiple_of)),
        ("model._enable_in_batch_packing (R14)", derived.enable_in_batch_packing),
        ("model.variable_seq_lengths (R14)", derived.variable_seq_lengths),
    ]
    rows += [(f"{path} (R11)", False) for path in derived.forced_off]
    return rows


# --------------------------------------------------------------------------------------------------
# Rules: small functions registered in order; each yields its issues
# --------------------------------------------------------------------------------------------------


class _Issue(NamedTuple):
    severity: Severity
    reason: str
    fix: str


def _error(reason: str, fix: str) -> _Issue:
    return _Issue("error", reason, fix)


def _warning(reason: str, fix: str) -> _Issue:
    return _Issue("warning", reason, fix)


Rule = Callable[[TrainingConfig, DerivedValues], Iterable[_Issue]]
_REGISTRY: list[tuple[str, Rule]] = []


def _rule(rule_id: str) -> Callable[[Rule], Rule]:
    def register(function: Rule) -> Rule:
        _REGISTRY.append((rule_id, function))
        return function

    return register


def _round_options(value: int, multiple: int) -> str:
    """``'4096 or 4100'``: the nearest multiples below (when positive) and above."""
    below, above = value // multiple * multiple, int(ceil_to_multiple(value, multiple))
    return f"{below} or {above}" if 0 < below != above else str(above)


def _multiple_origin(config: TrainingConfig, derived: DerivedValues) -> str:
    model = config.model
    return (
        f"k = {derived.alignment_multiple} from TP={model.tensor_model_parallel_size}, "
        f"CP={model.context_parallel_size}, eval CP={derived.eval_context_parallel_size}, "
        f"SP={model.sequence_parallel}"
    )


def _full_iteration_graph(model: ModelConfig) -> bool:
    scope = model.cuda_graph_scope or ()
    return model.cuda_graph_impl == "full_iteration" or (
        model.cuda_graph_impl == "local" and "full_iteration" in scope
    )


def _te_graph(model: ModelConfig) -> bool:
    return model.cuda_graph_impl == "transformer_engine"


def _graph_text(model: ModelConfig) -> str:
    return (
        f"model.cuda_graph_impl={model.cuda_graph_impl!r}, model.cuda_graph_scope={model.cuda_graph_scope!r}"
    )


@_rule("R1")
def _num_epochs_dataset(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """``train.num_epochs`` needs a finite GPT SFT dataset."""
    if config.train.num_epochs is not None and not isinstance(config.dataset, GPTSFTDatasetConfig):
        yield _error(
            f"num_epochs is only supported for finite GPTSFTDatasetConfig datasets; train.num_epochs="
            f"{config.train.num_epochs} with a {config.dataset.type}.",
            "Remove train.num_epochs and set the run length with train.train_iters.",
        )


@_rule("R2")
def _num_epochs_loader(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """``train.num_epochs`` needs the ``batch`` loader."""
    if config.train.num_epochs is not None and config.dataset.dataloader_type != "batch":
        yield _error(
            f'num_epochs is currently supported only with dataloader_type="batch"; dataset.dataloader_type='
            f"{config.dataset.dataloader_type!r}.",
            "Set dataset.dataloader_type: batch, or remove train.num_epochs.",
        )


@_rule("R3")
def _offline_xor_in_batch(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Offline and in-batch packing are mutually exclusive."""
    dataset = config.dataset
    if getattr(dataset, "enable_offline_packing", False) and _in_batch(dataset):
        yield _error(
            "enable_offline_packing and enable_in_batch_packing are mutually exclusive (both are True).",
            "Keep one packing owner: dataset.enable_in_batch_packing: false for offline packs, or "
            "dataset.enable_offline_packing: false and no offline_packing_specs for in-batch packing.",
        )


@_rule("R4")
def _offline_needs_specs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """``enable_offline_packing`` and ``offline_packing_specs`` come together."""
    dataset = config.dataset
    enabled = bool(getattr(dataset, "enable_offline_packing", False))
    if enabled and _specs(dataset) is None:
        yield _error(
            "offline_packing_specs must be set when enable_offline_packing=True.",
            f"Add dataset.offline_packing_specs with packed_sequence_size (usually the sequence length, "
            f"{dataset.seq_length}), or set dataset.enable_offline_packing: false.",
        )
    if not enabled and _specs(dataset) is not None:
        yield _error(
            "enable_offline_packing must be True when offline_packing_specs is set.",
            "Set dataset.enable_offline_packing: true, or remove dataset.offline_packing_specs.",
        )


@_rule("R5")
def _pad_cu_seqlens_fixed_width(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Static boundary shapes need a static token width."""
    specs = _specs(config.dataset)
    if specs is not None and specs.pad_cu_seqlens and not _fixed_width(config.dataset):
        yield _error(
            "offline_packing_specs.pad_cu_seqlens=True requires dataset pad_to_max_length=True.",
            f"Set {_fixed_width_key(config.dataset)}: true, or offline_packing_specs.pad_cu_seqlens: false.",
        )


@_rule("R6")
def _cuda_graph_fixed_width(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Any training CUDA graph over offline packs needs a fixed width (an MLP-only TE graph too)."""
    model = config.model
    training_graph = _full_iteration_graph(model) or _te_graph(model)
    if _specs(config.dataset) is not None and training_graph and not _fixed_width(config.dataset):
        yield _error(
            "Offline packing with CUDA graphs requires dataset pad_to_max_length=True "
            f"({_graph_text(model)}).",
            f"Set {_fixed_width_key(config.dataset)}: true, or model.cuda_graph_impl: none.",
        )


@_rule("R7")
def _attention_graph_pad_cu_seqlens(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """A graph that captures attention needs static boundary arrays."""
    model, specs = config.model, _specs(config.dataset)
    scope = model.cuda_graph_scope or []
    captures_attention = _full_iteration_graph(model) or (_te_graph(model) and (not scope or "attn" in scope))
    if specs is not None and captures_attention and not specs.pad_cu_seqlens:
        yield _error(
            "Packed attention CUDA graphs require offline_packing_specs.pad_cu_seqlens=True. Enable it for "
            f"full-iteration, whole-layer, or attention-scoped capture ({_graph_text(model)}).",
            "Set dataset.offline_packing_specs.pad_cu_seqlens: true (with a packing metadata file and a "
            "fixed width), or capture MLP only: model.cuda_graph_scope: [mlp].",
        )


@_rule("R8.1")
def _positive_collate_multiples(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """The collate padding multiples are positive (§3.6)."""
    dataset = config.dataset
    if isinstance(dataset, _CollatePackingDataset):
        for name, default in (("pad_to_multiple_of", 128), ("in_batch_packing_pad_to_multiple_of", 1)):
            value = getattr(dataset, name)
            if value <= 0:
                yield _error(
                    f"{name} must be greater than 0 (dataset.{name}={value}).",
                    f"Set dataset.{name} to a positive integer (default {default}).",
                )


@_rule("R8.2")
def _energon_path(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """An Energon dataset names its path (§4.1)."""
    dataset = config.dataset
    if isinstance(dataset, EnergonDatasetConfig) and not dataset.path.strip():
        yield _error(
            "EnergonDatasetConfig.path must be a non-empty path.", "Set dataset.path to the Energon dataset."
        )


@_rule("R8.3")
def _energon_test_split(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Energon has no distinct test split (§4.1)."""
    dataset = config.dataset
    if isinstance(dataset, EnergonDatasetConfig) and dataset.do_test:
        yield _error(
            "EnergonDatasetConfig does not support a distinct test split (dataset.do_test=True).",
            "Set dataset.do_test: false.",
        )


@_rule("R8.4")
def _energon_builder_owned_kwargs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """``dataset_kwargs`` may not override what the Energon builder passes itself (§4.1)."""
    dataset = config.dataset
    if isinstance(dataset, EnergonDatasetConfig):
        owned = [key for key in ENERGON_BUILDER_OWNED if key in dataset.dataset_kwargs]
        if owned:
            yield _error(
                f"dataset_kwargs cannot override builder-owned arguments: {', '.join(owned)}.",
                f"Remove {', '.join(owned)} from dataset.dataset_kwargs; set packing_buffer_size, "
                "shuffle_buffer_size, max_samples_per_sequence and task_encoder as dataset fields "
                "(the batch size is dataset.micro_batch_size).",
            )


@_rule("R8.5")
def _packing_buffer_positive(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """A set ``packing_buffer_size`` is positive (§4.1)."""
    dataset = config.dataset
    if _native(dataset) and dataset.packing_buffer_size <= 0:
        yield _error(
            f"packing_buffer_size must be greater than 0 when set (got {dataset.packing_buffer_size}).",
            "Set dataset.packing_buffer_size to a positive candidate count (8-16 for high-resolution or "
            "video data; 1 is the correctness baseline), or remove it to turn native packing off.",
        )


@_rule("R8.6")
def _native_xor_in_batch(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Native packing and collate-time packing are mutually exclusive (§4.1)."""
    if _native(config.dataset) and _in_batch(config.dataset):
        yield _error(
            "packing_buffer_size and enable_in_batch_packing=True are mutually exclusive; select exactly one "
            "packing owner.",
            "Set dataset.enable_in_batch_packing: false (native packing), or remove "
            "dataset.packing_buffer_size.",
        )


@_rule("R8.7")
def _native_not_deferred(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Native packing cannot be deferred to the step (§4.1)."""
    if _native(config.dataset) and _deferred(config.dataset):
        yield _error(
            "packing_buffer_size is incompatible with defer_in_batch_packing_to_step=True; use the canonical "
            "vlm_step path.",
            "Set dataset.defer_in_batch_packing_to_step: false.",
        )


@_rule("R8.8")
def _native_dataset_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Native packing yields one pack per physical batch (§4.1)."""
    dataset = config.dataset
    if _native(dataset) and dataset.micro_batch_size != 1:
        yield _error(
            f"Energon native sequence packing requires micro_batch_size=1 (dataset.micro_batch_size="
            f"{dataset.micro_batch_size}).",
            "Set dataset.micro_batch_size: 1 (and train.micro_batch_size: 1); each micro-batch is one pack.",
        )


@_rule("R8.9")
def _native_task_encoder(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Native packing supports the Qwen-VL task encoder only (§4.1)."""
    dataset = config.dataset
    if _native(dataset) and dataset.task_encoder != QWEN_VL_TASK_ENCODER:
        yield _error(
            f"Energon native sequence packing currently supports only {QWEN_VL_TASK_ENCODER} "
            f"(dataset.task_encoder={dataset.task_encoder!r}).",
            f"Set dataset.task_encoder: {QWEN_VL_TASK_ENCODER}, or remove dataset.packing_buffer_size.",
        )


@_rule("R9")
def _energon_train_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """The Energon loader's batch size is the training micro-batch size."""
    dataset, mbs = config.dataset, config.train.micro_batch_size
    if isinstance(dataset, EnergonDatasetConfig) and dataset.micro_batch_size != mbs:
        yield _error(
            f"EnergonDatasetConfig.micro_batch_size must match train.micro_batch_size "
            f"({dataset.micro_batch_size} != {mbs}).",
            f"Set dataset.micro_batch_size: {mbs} (or train.micro_batch_size: {dataset.micro_batch_size}).",
        )


_NATIVE = "Energon native sequence packing"


@_rule("R10.1")
def _native_train_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    if _native(config.dataset) and config.train.micro_batch_size != 1:
        yield _error(
            f"{_NATIVE} requires train.micro_batch_size=1 (got {config.train.micro_batch_size}).",
            "Set train.micro_batch_size: 1 and dataset.micro_batch_size: 1; each micro-batch is one pack "
            "of up to seq_length tokens.",
        )


@_rule("R10.2")
def _native_per_token_loss(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    if _native(config.dataset) and not config.model.calculate_per_token_loss:
        yield _error(
            f"{_NATIVE} requires model.calculate_per_token_loss=True.",
            "Set model.calculate_per_token_loss: true (packs hold different numbers of supervised tokens).",
        )


@_rule("R10.3")
def _native_no_collective_average(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    if _native(config.dataset) and config.ddp.average_in_collective:
        yield _error(
            f"{_NATIVE} requires ddp.average_in_collective=False.", "Set ddp.average_in_collective: false."
        )


@_rule("R10.4")
def _native_no_mtp(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    layers = config.model.mtp_num_layers
    if _native(config.dataset) and layers is not None and layers > 0:
        yield _error(
            f"{_NATIVE} does not support MTP (model.mtp_num_layers={layers}).",
            "Set model.mtp_num_layers: 0, or turn native packing off.",
        )


@_rule("R10.5")
def _native_no_cuda_graphs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    model = config.model
    graphs = {
        name: value
        for name in ("cuda_graph_impl", "vision_cuda_graph_impl")
        if (value := getattr(model, name)) not in (None, "none")
    }
    if _native(config.dataset) and graphs:
        yield _error(
            f"{_NATIVE} does not support CUDA graphs ("
            + ", ".join(f"model.{name}={value!r}" for name, value in graphs.items())
            + ").",
            " and ".join(f"Set model.{name}: none" for name in graphs) + ".",
        )


@_rule("R10.6")
def _native_no_dist_train(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    if _native(config.dataset) and config.dist_train.use_dist_train:
        yield _error(
            f"{_NATIVE} does not support Qwen3-VL DistTrain.", "Set dist_train.use_dist_train: false."
        )


@_rule("R10.7")
def _native_no_pipeline(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    pp = config.model.pipeline_model_parallel_size
    if _native(config.dataset) and pp > 1:
        yield _error(
            f"{_NATIVE} does not yet support pipeline parallelism (model.pipeline_model_parallel_size={pp}).",
            "Set model.pipeline_model_parallel_size: 1, or use collate-time in-batch packing.",
        )


@_rule("R11")
def _native_moe_overlap(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Native packing turns EP overlap and delayed wgrad off (the overlap schedule drops packed metadata)."""
    requested = [path for path, value in _overlap_copies(config) if value]
    if _native(config.dataset) and requested:
        yield _warning(
            "Disabling MoE expert-parallel communication overlap and delayed weight-gradient compute for "
            f"{_NATIVE}: requested by {', '.join(requested)}.",
            f"Nothing to do: they are set to False ({', '.join(derived.forced_off)}); set the requested "
            "ones to false to silence this warning.",
        )


@_rule("R13")
def _collate_seq_length_multiple(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Collate datasets pad to k, so their sequence length must be a multiple of it."""
    dataset, multiple = config.dataset, derived.alignment_multiple
    if isinstance(dataset, _CollatePackingDataset) and dataset.seq_length % multiple:
        yield _error(
            f"{dataset.type}.seq_length must be divisible by the CP/SP collate padding multiple "
            f"({multiple}); seq_length={dataset.seq_length}, {_multiple_origin(config, derived)}.",
            f"Set dataset.seq_length and model.seq_length to a multiple of {multiple}: "
            f"{_round_options(dataset.seq_length, multiple)}.",
        )


@_rule("R15")
def _energon_eval_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """The Energon validation loader uses the dataset's batch size too."""
    dataset, eval_mbs = config.dataset, derived.eval_micro_batch_size
    if (
        isinstance(dataset, EnergonDatasetConfig)
        and dataset.do_validation
        and dataset.micro_batch_size != eval_mbs
    ):
        yield _error(
            f"EnergonDatasetConfig.micro_batch_size must match validation.eval_micro_batch_size "
            f"({dataset.micro_batch_size} != {eval_mbs}).",
            f"Set validation.eval_micro_batch_size: {dataset.micro_batch_size}, or "
            "dataset.do_validation: false.",
        )


@_rule("R16")
def _eval_batch_divisible(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Evaluation GBS is divisible by eval MBS times the eval DP (which uses the eval CP)."""
    model, train = config.model, config.train
    eval_cp, eval_mbs, eval_gbs = (
        derived.eval_context_parallel_size,
        derived.eval_micro_batch_size,
        derived.eval_global_batch_size,
    )
    if (eval_cp, eval_mbs, eval_gbs) == (
        model.context_parallel_size,
        train.micro_batch_size,
        train.global_batch_size,
    ):
        return  # the same arithmetic as training: X1 reports it
    parallel = model.tensor_model_parallel_size * model.pipeline_model_parallel_size * eval_cp
    if derived.eval_data_parallel_size is None:
        yield _error(
            f"dist.world_size ({config.dist.world_size}) is not divisible by TP*PP*eval CP ({parallel}), "
            "so the evaluation data-parallel size is not an integer.",
            f"Set dist.eval_context_parallel_size so that TP*PP*eval CP divides {config.dist.world_size}.",
        )
    elif derived.eval_micro_batches_per_step is None:
        step = eval_mbs * derived.eval_data_parallel_size
        yield _error(
            f"validation.eval_global_batch_size ({eval_gbs}) is not divisible by eval micro batch size "
            f"({eval_mbs}) times eval data parallel size ({derived.eval_data_parallel_size}).",
            f"Set validation.eval_global_batch_size to a multiple of {step}: "
            f"{_round_options(eval_gbs, step)}.",
        )


@_rule("R17")
def _cp_seq_length(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """CP splits every sequence into 2*CP chunks."""
    model = config.model
    cp = model.context_parallel_size
    if cp > 1 and model.seq_length % (2 * cp):
        yield _error(
            "Sequence length must be divisible by 2 * context parallel size if context parallel is used "
            f"(model.seq_length={model.seq_length}, 2*CP={2 * cp}).",
            f"Set model.seq_length (and dataset.seq_length) to a multiple of {2 * cp}: "
            f"{_round_options(model.seq_length, 2 * cp)}.",
        )


@_rule("R18")
def _cp_finetuning_loss(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """CP ranks hold different numbers of supervised tokens: per-token loss, summed gradients."""
    cp = config.model.context_parallel_size
    if cp > 1 and isinstance(config.dataset, _FINETUNING):
        if not config.model.calculate_per_token_loss:
            yield _error(
                f"When finetuning with CP>1, calculate_per_token_loss must be True (CP={cp}).",
                "Set model.calculate_per_token_loss: true.",
            )
        if config.ddp.average_in_collective:
            yield _error(
                f"When finetuning with CP>1, average_in_collective must be False (CP={cp}).",
                "Set ddp.average_in_collective: false.",
            )


@_rule("R19")
def _pack_size_positive(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    specs = _specs(config.dataset)
    if specs is not None and specs.packed_sequence_size <= 0:
        yield _error(
            "offline_packing_specs.packed_sequence_size must be greater than 0 "
            f"(got {specs.packed_sequence_size}).",
            "Set dataset.offline_packing_specs.packed_sequence_size to the sequence length "
            f"({config.dataset.seq_length}).",
        )


@_rule("R20")
def _offline_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Offline packs are already M sequences wide: MBS 1 and packs M times longer are equivalent."""
    mbs, gbs = config.train.micro_batch_size, config.train.global_batch_size
    specs = _specs(config.dataset)
    if specs is None or not _offline(config.dataset) or mbs == 1:
        return
    size = specs.packed_sequence_size
    if gbs % mbs == 0:
        batch = f"train.global_batch_size: {gbs // mbs} (now {gbs})"
    else:
        batch = f"train.global_batch_size to about {gbs / mbs:g} (now {gbs}; GBS/MBS is not an integer)"
    yield _error(
        "Micro batch size should be 1 when training with packed sequence, but your micro batch size is "
        f"{mbs}. Each offline pack already holds several sequences.",
        f"Use the equivalent configuration: train.micro_batch_size: 1 (now {mbs}), {batch}, and "
        f"dataset.offline_packing_specs.packed_sequence_size: {size * mbs} (now {size}), with "
        f"model.seq_length and dataset.seq_length {size * mbs}.",
    )


@_rule("R21")
def _in_batch_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    if _in_batch(config.dataset) and config.train.micro_batch_size == 1:
        yield _error(
            "micro_batch_size should be greater than 1 when using enable_in_batch_packing=True. "
            "In-batch packing concatenates multiple sequences within a microbatch, so at least 2 "
            "sequences are required per micro-batch.",
            "Set train.micro_batch_size to 2 or more (and the global batch size to a multiple of MBS*DP).",
        )


@_rule("R22")
def _seq_length_match(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    model, dataset = config.model, config.dataset
    if not isinstance(dataset, DatasetProvider) and model.seq_length != dataset.seq_length:
        yield _error(
            "Please ensure sequence length configuration in model config and dataset config match "
            f"(model.seq_length={model.seq_length}, dataset.seq_length={dataset.seq_length}).",
            f"Set model.seq_length and dataset.seq_length to the same value (e.g. {dataset.seq_length}).",
        )


@_rule("X1")
def _global_batch_divisible(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """The sampler and MCore's micro-batch calculator: integral DP, GBS divisible by MBS*DP."""
    model, train = config.model, config.train
    tp, pp, cp = (
        model.tensor_model_parallel_size,
        model.pipeline_model_parallel_size,
        model.context_parallel_size,
    )
    world, dp = config.dist.world_size, derived.data_parallel_size
    if dp is None:
        yield _error(
            f"dist.world_size ({world}) is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}, "
            "so the data-parallel size is not an integer.",
            f"Use a world size that is a multiple of {tp * pp * cp}, or change the parallel sizes.",
        )
    elif derived.micro_batches_per_step is None:
        step = train.micro_batch_size * dp
        short = (
            " (and must hold at least one micro-batch per DP rank)" if train.global_batch_size < step else ""
        )
        yield _error(
            f"global batch size ({train.global_batch_size}) is not divisible by micro batch size "
            f"({train.micro_batch_size}) times data parallel size ({dp}){short}.",
            f"Set train.global_batch_size to a multiple of {step}: "
            f"{_round_options(train.global_batch_size, step)}.",
        )


@_rule("X2")
def _per_token_loss_no_average(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """MCore DDP: per-token loss sums gradients; averaging in the collective would divide twice."""
    if config.model.calculate_per_token_loss and config.ddp.average_in_collective:
        yield _error(
            "Cannot average in collective when calculating per-token loss! "
            "(model.calculate_per_token_loss=True, ddp.average_in_collective=True)",
            "Set ddp.average_in_collective: false.",
        )


@_rule("X3")
def _offline_eval_mbs(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """A packed THD micro-batch is one physical row; the training side is R20."""
    eval_mbs = config.validation.eval_micro_batch_size
    dataset = config.dataset
    if not (_offline(dataset) and dataset.do_validation and eval_mbs is not None and eval_mbs > 1):
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
    yield _error(reason + ".", "Set validation.eval_micro_batch_size: 1.")


@_rule("X4")
def _packed_specs_values(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """``PackedSequenceSpecs.__post_init__`` (§2.1): positive multiple and cap; the cap fits the pack."""
    specs = _specs(config.dataset)
    if specs is None:
        return
    if specs.pad_seq_to_mult is not None and specs.pad_seq_to_mult <= 0:
        yield _error(
            f"pad_seq_to_mult must be a positive integer when provided (got {specs.pad_seq_to_mult}).",
            f"Set dataset.offline_packing_specs.pad_seq_to_mult: {derived.alignment_multiple} "
            "(the CP/SP multiple k).",
        )
    cap, size = specs.max_single_sequence_length, specs.packed_sequence_size
    if cap is not None and cap <= 0:
        yield _error(
            f"max_single_sequence_length must be positive (got {cap}).",
            "Remove dataset.offline_packing_specs.max_single_sequence_length (it falls back to "
            "dataset.seq_length).",
        )
    elif cap is not None and size > 0 and cap > size:
        yield _error(
            f"max_single_sequence_length ({cap}) cannot exceed packed_sequence_size ({size}).",
            f"Set dataset.offline_packing_specs.max_single_sequence_length to at most {size}.",
        )
    for name in ("packed_train_data_path", "packed_val_data_path"):
        path = getattr(specs, name)
        if path is not None and path.lower().endswith(".npy"):
            yield _warning(
                ".npy packed sequence format is deprecated; use packed parquet "
                f"(offline_packing_specs.{name}={path!r}).",
                "Re-pack to packed Parquet (tightpack pack writes it) and point the path at the .parquet "
                "file, folder or glob.",
            )


@_rule("X5")
def _gpt_sft_dataset_values(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """``GPTSFTDatasetConfig.validate()`` (§2.2), the packing-related checks R4/R19 do not cover."""
    dataset = config.dataset
    if not isinstance(dataset, GPTSFTDatasetConfig):
        return
    specs = dataset.offline_packing_specs
    explicit = specs is not None and (specs.packed_train_data_path or specs.packed_val_data_path)
    if dataset.hf_rewrite and explicit:
        yield _error(
            "hf_rewrite cannot safely replace explicit packed data paths; use builder-managed packed paths.",
            "Set dataset.hf_rewrite: false, or remove offline_packing_specs.packed_train_data_path and "
            "packed_val_data_path.",
        )
    if "max_num_samples" in _kwargs(dataset):
        yield _error(
            "Set max_train_samples directly on GPTSFTDatasetConfig, not max_num_samples in dataset_kwargs.",
            f"Move dataset.dataset_kwargs.max_num_samples ({_kwargs(dataset)['max_num_samples']!r}) to "
            "dataset.max_train_samples.",
        )


@_rule("X6")
def _moe_router_graph(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Offline packs always carry a padding mask, which router-scoped TE graphs cannot take (§2.11)."""
    model = config.model
    scope = model.cuda_graph_scope or []
    router = not scope or any(name in scope for name in _ROUTER_SCOPES)
    if _offline(config.dataset) and (model.num_moe_experts or 0) > 0 and _te_graph(model) and router:
        yield _error(
            "Packed MoE padding masks do not support router-scoped Transformer Engine CUDA graphs "
            f"(model.num_moe_experts={model.num_moe_experts}, {_graph_text(model)}).",
            "Set model.cuda_graph_scope to modules without the router (e.g. [attn] or [attn, mlp]), or "
            "model.cuda_graph_impl: none.",
        )


@_rule("T1")
def _offline_trailing_width(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """The offline batch width W becomes the last boundary: W - sum(segments) is a segment too (§6, §10.2).

    Every other segment is a multiple of ``pad_seq_to_mult`` (T2), so the trailing one is CP-sliceable and
    SP-splittable only when W itself is a multiple of k. W is P with a fixed width; otherwise
    ``min(P, ceil(longest row, pad_seq_length_to_mult))`` (default 16), or a power of two with
    ``ceil_to_power_2``.
    """
    dataset, multiple, specs = config.dataset, derived.alignment_multiple, _specs(config.dataset)
    if specs is None or not _offline(dataset) or multiple == 1 or specs.packed_sequence_size <= 0:
        return
    size = specs.packed_sequence_size
    origin = _multiple_origin(config, derived)
    if size % multiple:
        yield _error(
            f"packed_sequence_size ({size}) is not a multiple of {multiple} ({origin}): the pack width W is "
            f"the last boundary, so the trailing width segment W - sum(lengths) is not divisible by 2*CP "
            "(context-parallel slicing) or CP*TP (sequence parallelism) whenever the width reaches P.",
            f"Set dataset.offline_packing_specs.packed_sequence_size to a multiple of {multiple}: "
            f"{_round_options(size, multiple)} (with the sequence lengths to match).",
        )
    if _fixed_width(dataset):
        return
    kwargs = _kwargs(dataset)
    if kwargs.get("ceil_to_power_2") is True:
        if multiple & (multiple - 1):
            yield _error(
                "With ceil_to_power_2 the offline batch width is a power of two, which is never a multiple "
                f"of {multiple} ({origin}).",
                f"Set {_fixed_width_key(dataset)}: true (the safe setup), or drop ceil_to_power_2.",
            )
        return
    rounding = kwargs.get("pad_seq_length_to_mult", _DEFAULT_PAD_SEQ_LENGTH_TO_MULT)
    if isinstance(rounding, int) and not isinstance(rounding, bool) and rounding > 0 and rounding % multiple:
        yield _error(
            f"Without a fixed width the offline batch width is rounded up to pad_seq_length_to_mult="
            f"{rounding}, which is not a multiple of {multiple} ({origin}), so the trailing width segment "
            "can break context-parallel slicing or the sequence-parallel split.",
            f"Set {_fixed_width_key(dataset)}: true with packed_sequence_size a multiple of {multiple} "
            f"(the safe setup), or dataset.dataset_kwargs.pad_seq_length_to_mult: "
            f"{math.lcm(rounding, multiple)}.",
        )


@_rule("T2")
def _offline_alignment_multiple(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Offline packing does not derive ``pad_seq_to_mult``: check it against k (§6)."""
    specs, multiple = _specs(config.dataset), derived.alignment_multiple
    if specs is None or not _offline(config.dataset) or multiple == 1:
        return
    mult = specs.pad_seq_to_mult or 1
    if mult <= 0 or mult % multiple == 0:
        return  # X4 reports a non-positive multiple
    origin = _multiple_origin(config, derived)
    fix = (
        f"Set dataset.offline_packing_specs.pad_seq_to_mult: {math.lcm(mult, multiple)} "
        "(lcm of the current value and k), and re-pack into a fresh output folder."
    )
    cp_used = config.model.context_parallel_size > 1 or derived.eval_context_parallel_size > 1
    if cp_used:
        yield _error(
            f"offline_packing_specs.pad_seq_to_mult ({mult}) is not a multiple of {multiple} ({origin}): "
            "context-parallel slicing needs every packed segment divisible by 2*CP (a device assert in "
            "Transformer Engine).",
            fix,
        )
    else:
        yield _warning(
            f"offline_packing_specs.pad_seq_to_mult ({mult}) is not a multiple of the sequence-parallel "
            f"multiple {multiple} ({origin}); the reference's recipes align packed segments to it.",
            fix,
        )


@_rule("T3")
def _eval_cp_seq_length(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """R17 for the evaluation CP, which the reference does not check."""
    model, eval_cp = config.model, derived.eval_context_parallel_size
    if eval_cp > 1 and eval_cp != model.context_parallel_size and model.seq_length % (2 * eval_cp):
        yield _error(
            "Sequence length must be divisible by 2 * the evaluation context parallel size "
            f"(model.seq_length={model.seq_length}, 2*eval CP={2 * eval_cp}).",
            f"Set model.seq_length (and dataset.seq_length) to a multiple of {2 * eval_cp}: "
            f"{_round_options(model.seq_length, 2 * eval_cp)}, or change dist.eval_context_parallel_size.",
        )


@_rule("T4")
def _eval_cp_per_token_loss(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """R18's loss rule for the evaluation CP (R18 reports it when training CP>1 too)."""
    model, eval_cp = config.model, derived.eval_context_parallel_size
    if (
        eval_cp > 1
        and model.context_parallel_size == 1
        and isinstance(config.dataset, _FINETUNING)
        and not model.calculate_per_token_loss
    ):
        yield _warning(
            f"Evaluating fine-tuning data with CP={eval_cp} without calculate_per_token_loss: CP ranks hold "
            "different numbers of supervised tokens, so averaging per-rank means biases the validation loss.",
            "Set model.calculate_per_token_loss: true (and ddp.average_in_collective: false).",
        )


@_rule("T5")
def _in_batch_batch_loader(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """The ``batch`` loader collates a DP rank's global batch at once, then splits it (§3.7)."""
    dataset, steps = config.dataset, derived.micro_batches_per_step
    collate_time = _in_batch(dataset) and not _deferred(dataset)
    if collate_time and dataset.dataloader_type == "batch" and steps is not None and steps != 1:
        yield _error(
            'In-batch packing with dataloader_type="batch" packs the global batch of a DP rank into one '
            f"row, which cannot be split into {steps} micro-batches ('Batch size 1 is not divisible by "
            "num_microbatches').",
            "Set dataset.dataloader_type: cyclic (or single), or make GBS = MBS*DP (one micro-batch per "
            "step).",
        )


@_rule("T6")
def _energon_collate_fixed_width(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """Collate-time Qwen-VL packing at a fixed width raises when the MBS rows exceed seq_length (§3.5)."""
    dataset = config.dataset
    collate_time = _in_batch(dataset) and not _deferred(dataset) and not _native(dataset)
    if isinstance(dataset, EnergonDatasetConfig) and collate_time and derived.pad_to_max_length:
        forced = "" if dataset.pad_to_max_length else " (forced by PP>1 or EP>1, R12)"
        yield _warning(
            f"Collate-time packing at a fixed width{forced} puts {config.train.micro_batch_size} rows into "
            f"one row of seq_length={dataset.seq_length}; a micro-batch whose rows exceed it raises at run "
            "time.",
            "Use native packing (dataset.packing_buffer_size, which never overfills a pack), or keep "
            "MBS x the longest sample within seq_length.",
        )


@_rule("T7")
def _pack_size_matches_seq_length(config: TrainingConfig, derived: DerivedValues) -> Iterator[_Issue]:
    """§9: keep model.seq_length == dataset.seq_length == packed_sequence_size."""
    dataset, specs = config.dataset, _specs(config.dataset)
    if specs is None or not _offline(dataset) or specs.packed_sequence_size <= 0:
        return
    if specs.packed_sequence_size != dataset.seq_length:
        yield _warning(
            f"offline_packing_specs.packed_sequence_size ({specs.packed_sequence_size}) differs from "
            f"dataset.seq_length ({dataset.seq_length}); packs are collated up to the pack size.",
            "Keep model.seq_length == dataset.seq_length == packed_sequence_size "
            f"(e.g. all {dataset.seq_length}).",
        )


RULES: tuple[tuple[str, Rule], ...] = tuple(_REGISTRY)
"""Every rule as (id, function), in the order `validate` runs them."""


def validate(config: TrainingConfig) -> ValidationReport:
    """Check every rule and return all findings (never just the first) with the derived values.

    The configuration is not modified; ``report.derived.overrides()`` lists what the reference would write.

    >>> config = load_config({
    ...     "train": {"micro_batch_size": 4, "global_batch_size": 32},
    ...     "model": {"seq_length": 2048},
    ...     "dataset": {"type": "GPTSFTDatasetConfig", "seq_length": 2048, "dataset_root": "squad",
    ...                 "enable_offline_packing": True, "dataset_kwargs": {"pad_to_max_length": True},
    ...                 "offline_packing_specs": {"packed_sequence_size": 2048}}})
    >>> report = validate(config)
    >>> report.ok, [finding.rule for finding in report.findings]
    (False, ['R20'])
    >>> print(report.errors[0].fix)  # doctest: +NORMALIZE_WHITESPACE
    Use the equivalent configuration: train.micro_batch_size: 1 (now 4), train.global_batch_size: 8 (now 32),
    and dataset.offline_packing_specs.packed_sequence_size: 8192 (now 2048), with model.seq_length and
    dataset.seq_length 8192.
    >>> report.derived.packing, report.derived.micro_batches_per_step
    ('offline', 8)
    """
    derived = _derive(config)
    findings = [
        Finding(rule_id, issue.severity, issue.reason, issue.fix)
        for rule_id, rule in RULES
        for issue in rule(config, derived)
    ]
    return ValidationReport(findings=tuple(findings), derived=derived, not_checked=config.not_checked)
