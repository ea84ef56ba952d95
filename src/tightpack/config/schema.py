"""The configuration's sections: dataclasses laid out like Megatron-Bridge's ``ConfigContainer``.

`RunConfig` is the whole file (Megatron-Bridge's ``ConfigContainer``). It has one ``*Section`` class per
section: `TrainSection` (``train``; Megatron-Bridge's ``TrainingConfig``), `ModelSection`, `DDPSection`,
`ValidationSection`, `DistSection`, `CommOverlapSection`, `DistTrainSection`; and one class per dataset kind
(`DATASET_TYPES`), named as Megatron-Bridge names them, since ``dataset.type`` gives that name. The names
differ from Megatron-Bridge's on purpose: a tightpack class models only the fields the packing rules read.
The old names (``TrainingConfig`` for the whole, ``TrainConfig``, ``ModelConfig``... for the sections) still
import, with a DeprecationWarning, for one release.

Construction checks only the ranges of the fields marked ``minimum``: reading a file (types, unknown keys,
the dataset kind) is `tightpack.config.loading`'s, and the packing rules live in `tightpack.config.rules`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from tightpack.errors import TightpackError

DataloaderType = Literal["single", "cyclic", "batch", "external"]
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
CudaGraphScope = Literal[
    "full_iteration", "full_iteration_inference", "full", "attn", "mlp", "moe", "moe_router",
    "moe_preprocess", "mamba",
]  # fmt: skip

_POSITIVE = {"minimum": 1}


def check_minimum(value: object, minimum: int | None, where: str) -> None:
    if minimum is not None and isinstance(value, int) and value < minimum:
        raise TightpackError(f"{where} must be at least {minimum}, got {value}")


class _Section:
    """Base of the configuration dataclasses: range checks of the fields marked ``minimum``."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):  # type: ignore[arg-type]
            check_minimum(
                getattr(self, item.name), item.metadata.get("minimum"), f"{type(self).__name__}.{item.name}"
            )


@dataclass(kw_only=True)
class TrainSection(_Section):
    """``train`` (Megatron-Bridge's ``TrainingConfig``): batch sizes and run length.

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
class ModelSection(_Section):
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
class DDPSection(_Section):
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
class ValidationSection(_Section):
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
class DistSection(_Section):
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
class CommOverlapSection(_Section):
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
class DistTrainSection(_Section):
    """``dist_train``: Qwen3-VL DistTrain (incompatible with native Energon packing, R10.6)."""

    use_dist_train: bool = False


@dataclass(kw_only=True)
class PackedSequenceSpecs(_Section):
    """``dataset.offline_packing_specs`` (docs/contract.md §2.1), with the reference's defaults.

    Attributes:
        packed_sequence_size: pack capacity P in runtime tokens (must be > 0 when packing, R19).
        max_single_sequence_length: per-sequence cap while preparing (None: ``dataset.seq_length``).
        tokenizer_model_name, num_tokenizer_workers: preparation settings (not checked).
        packed_train_data_path, packed_val_data_path, packed_metadata_path: explicit artefacts.
        packed_train_data_blend: ``[[source, ...], [weight, ...]]``: training packs blended at run time from
            several packed Parquet sources, each weight a share of packs (Megatron-Bridge PR #5289; not
            with ``packed_train_data_path``; rules X7 and D11).
        pad_cu_seqlens: static-shape boundary arrays (CUDA graphs; needs ``pad_to_max_length``).
        pad_seq_to_mult: per-sequence alignment multiple m (None: 1).
    """

    packed_sequence_size: int = -1
    max_single_sequence_length: int | None = None
    tokenizer_model_name: str | None = None
    num_tokenizer_workers: int = -1
    packed_train_data_path: str | None = None
    packed_train_data_blend: list[list[str | float]] | None = None
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
    """``type: GPTSFTDatasetConfig``: SFT with optional offline packing (docs/contract.md §2.2).

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
class CollatePackingDataset(_DatasetBase):
    """The collate-time packing fields shared by DirectHF, MockVLM and Energon (docs/contract.md §3.6)."""

    enable_in_batch_packing: bool = False
    defer_in_batch_packing_to_step: bool = False
    pad_to_max_length: bool = False
    pad_to_multiple_of: int = 128
    in_batch_packing_pad_to_multiple_of: int = 1


@dataclass(kw_only=True)
class DirectHFSFTDatasetConfig(CollatePackingDataset):
    """``type: DirectHFSFTDatasetConfig``: Hugging Face conversations, collate-time packing."""

    type: ClassVar[str] = "DirectHFSFTDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig"
    dataloader_type: DataloaderType = "cyclic"


@dataclass(kw_only=True)
class MockVLMSFTDatasetConfig(CollatePackingDataset):
    """``type: MockVLMSFTDatasetConfig``: synthetic VLM data, collate-time packing."""

    type: ClassVar[str] = "MockVLMSFTDatasetConfig"
    target: ClassVar[str] = "megatron.bridge.data.builders.mock_vlm_sft.MockVLMSFTDatasetConfig"


@dataclass(kw_only=True)
class EnergonDatasetConfig(CollatePackingDataset):
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
# The kinds with the collate-time packing fields; R12 writes their ``pad_to_max_length``.
COLLATE_TYPE_NAMES = (DirectHFSFTDatasetConfig.type, EnergonDatasetConfig.type, MockVLMSFTDatasetConfig.type)
# The fine-tuning kinds (R18, T4): every kind but pretraining data and custom providers.
FINETUNING_TYPES = (
    GPTSFTDatasetConfig,
    DirectHFSFTDatasetConfig,
    EnergonDatasetConfig,
    MockVLMSFTDatasetConfig,
)


@dataclass(kw_only=True)
class RunConfig(_Section):
    """The whole configuration (Megatron-Bridge's ``ConfigContainer``); build it with `load_config`.

    Attributes:
        train, model, dataset: required sections.
        ddp, validation, dist, dist_train: optional sections (defaults as above).
        comm_overlap: optional; None when absent.
        not_checked: the dotted paths of the keys `load_config` accepted without reading them (rules 2,
            3 and 5 of `tightpack.config.loading`), in file order; empty when built in Python.
    """

    not_checked: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    train: TrainSection
    model: ModelSection
    dataset: DatasetConfig
    ddp: DDPSection = field(default_factory=DDPSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    dist: DistSection = field(default_factory=DistSection)
    comm_overlap: CommOverlapSection | None = None
    dist_train: DistTrainSection = field(default_factory=DistTrainSection)


# The names of tightpack 0.x, which Megatron-Bridge uses for other classes (its TrainingConfig is the
# ``train`` section): importable for one release, with a warning.
RENAMED = {
    "TrainingConfig": "RunConfig",
    "TrainConfig": "TrainSection",
    "ModelConfig": "ModelSection",
    "DDPConfig": "DDPSection",
    "ValidationConfig": "ValidationSection",
    "DistConfig": "DistSection",
    "CommOverlapConfig": "CommOverlapSection",
    "DistTrainConfig": "DistTrainSection",
}


def renamed(module: str, name: str) -> type:
    """The class an old name of `RENAMED` stands for, with a DeprecationWarning naming the new one.

    Raises:
        AttributeError: ``name`` is no old name.
    """
    new = RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} is deprecated: use {module}.{new}", DeprecationWarning, stacklevel=3)
    return globals()[new]


def __getattr__(name: str) -> type:
    return renamed(__name__, name)
