"""Rules of Energon datasets and of native Energon packing (docs/contract.md §4).

The dataset's own ``validate()`` (R8.2-R8.9, §4.1), its batch size against the training and evaluation
micro-batch sizes (R9, R15), what native packing excludes (R10.1-R10.7, §4.4), the overlap flags it turns off
(R11), and collate-time packing at a fixed width (T6, §3.5).
"""

from __future__ import annotations

from collections.abc import Iterator

from tightpack.config.derive import DerivedValues, is_deferred, is_in_batch, is_native, overlap_copies
from tightpack.config.rules.base import Issue, RuleGroup, error, warning
from tightpack.config.schema import EnergonDatasetConfig, RunConfig

QWEN_VL_TASK_ENCODER = "QwenVLEnergonTaskEncoderConfig"
# Arguments the Energon builder passes itself (§4.1); dataset_kwargs may not override them.
ENERGON_BUILDER_OWNED = (
    "batch_size", "max_samples_per_sequence", "packing_buffer_size", "shuffle_buffer_size", "split_part",
    "task_encoder", "worker_config",
)  # fmt: skip
_NATIVE = "Energon native sequence packing"

rules = RuleGroup()


@rules.add("R8.2", "error", section="§5, §4.1", summary="a non-empty Energon `path`")
def _energon_path(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """An Energon dataset names its path (§4.1)."""
    dataset = config.dataset
    if isinstance(dataset, EnergonDatasetConfig) and not dataset.path.strip():
        yield error(
            "EnergonDatasetConfig.path must be a non-empty path.", "Set dataset.path to the Energon dataset."
        )


@rules.add("R8.3", "error", section="§5, §4.1", summary="no Energon test split (`do_test`)")
def _energon_test_split(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Energon has no distinct test split (§4.1)."""
    dataset = config.dataset
    if isinstance(dataset, EnergonDatasetConfig) and dataset.do_test:
        yield error(
            "EnergonDatasetConfig does not support a distinct test split (dataset.do_test=True).",
            "Set dataset.do_test: false.",
        )


@rules.add("R8.4", "error", section="§5, §4.1", summary="no builder-owned arguments in `dataset_kwargs`")
def _energon_builder_owned_kwargs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``dataset_kwargs`` may not override what the Energon builder passes itself (§4.1)."""
    dataset = config.dataset
    if isinstance(dataset, EnergonDatasetConfig):
        owned = [key for key in ENERGON_BUILDER_OWNED if key in dataset.dataset_kwargs]
        if owned:
            yield error(
                f"dataset_kwargs cannot override builder-owned arguments: {', '.join(owned)}.",
                f"Remove {', '.join(owned)} from dataset.dataset_kwargs; set packing_buffer_size, "
                "shuffle_buffer_size, max_samples_per_sequence and task_encoder as dataset fields "
                "(the batch size is dataset.micro_batch_size).",
            )


@rules.add("R8.5", "error", section="§5, §4.1", summary="`packing_buffer_size` > 0 when set")
def _packing_buffer_positive(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """A set ``packing_buffer_size`` is positive (§4.1)."""
    dataset = config.dataset
    if is_native(dataset) and dataset.packing_buffer_size <= 0:
        yield error(
            f"packing_buffer_size must be greater than 0 when set (got {dataset.packing_buffer_size}).",
            "Set dataset.packing_buffer_size to a positive candidate count (8-16 for high-resolution or "
            "video data; 1 is the correctness baseline), or remove it to turn native packing off.",
        )


@rules.add("R8.6", "error", section="§5, §4.1", summary="native packing excludes in-batch packing")
def _native_xor_in_batch(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Native packing and collate-time packing are mutually exclusive (§4.1)."""
    if is_native(config.dataset) and is_in_batch(config.dataset):
        yield error(
            "packing_buffer_size and enable_in_batch_packing=True are mutually exclusive; select exactly one "
            "packing owner.",
            "Set dataset.enable_in_batch_packing: false (native packing), or remove "
            "dataset.packing_buffer_size.",
        )


@rules.add("R8.7", "error", section="§5, §4.1", summary="native packing excludes deferred in-batch packing")
def _native_not_deferred(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Native packing cannot be deferred to the step (§4.1)."""
    if is_native(config.dataset) and is_deferred(config.dataset):
        yield error(
            "packing_buffer_size is incompatible with defer_in_batch_packing_to_step=True; use the canonical "
            "vlm_step path.",
            "Set dataset.defer_in_batch_packing_to_step: false.",
        )


@rules.add("R8.8", "error", section="§5, §4.1", summary="native packing needs dataset MBS 1")
def _native_dataset_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Native packing yields one pack per physical batch (§4.1)."""
    dataset = config.dataset
    if is_native(dataset) and dataset.micro_batch_size != 1:
        yield error(
            f"Energon native sequence packing requires micro_batch_size=1 (dataset.micro_batch_size="
            f"{dataset.micro_batch_size}).",
            "Set dataset.micro_batch_size: 1 (and train.micro_batch_size: 1); each micro-batch is one pack.",
        )


@rules.add("R8.9", "error", section="§5, §4.1", summary="native packing needs the Qwen-VL task encoder")
def _native_task_encoder(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Native packing supports the Qwen-VL task encoder only (§4.1)."""
    dataset = config.dataset
    if is_native(dataset) and dataset.task_encoder != QWEN_VL_TASK_ENCODER:
        yield error(
            f"Energon native sequence packing currently supports only {QWEN_VL_TASK_ENCODER} "
            f"(dataset.task_encoder={dataset.task_encoder!r}).",
            f"Set dataset.task_encoder: {QWEN_VL_TASK_ENCODER}, or remove dataset.packing_buffer_size.",
        )


@rules.add("R9", "error", section="§5", summary="Energon dataset MBS == `train.micro_batch_size`")
def _energon_train_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """The Energon loader's batch size is the training micro-batch size."""
    dataset, mbs = config.dataset, config.train.micro_batch_size
    if isinstance(dataset, EnergonDatasetConfig) and dataset.micro_batch_size != mbs:
        yield error(
            f"EnergonDatasetConfig.micro_batch_size must match train.micro_batch_size "
            f"({dataset.micro_batch_size} != {mbs}).",
            f"Set dataset.micro_batch_size: {mbs} (or train.micro_batch_size: {dataset.micro_batch_size}).",
        )


@rules.add("R10.1", "error", section="§5, §4.4", summary="native Energon packing: `train.micro_batch_size` 1")
def _native_train_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    if is_native(config.dataset) and config.train.micro_batch_size != 1:
        yield error(
            f"{_NATIVE} requires train.micro_batch_size=1 (got {config.train.micro_batch_size}).",
            "Set train.micro_batch_size: 1 and dataset.micro_batch_size: 1; each micro-batch is one pack "
            "of up to seq_length tokens.",
        )


@rules.add("R10.2", "error", section="§5, §4.4", summary="native Energon packing: per-token loss")
def _native_per_token_loss(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    if is_native(config.dataset) and not config.model.calculate_per_token_loss:
        yield error(
            f"{_NATIVE} requires model.calculate_per_token_loss=True.",
            "Set model.calculate_per_token_loss: true (packs hold different numbers of supervised tokens).",
        )


@rules.add(
    "R10.3",
    "error",
    section="§5, §4.4",
    summary="native Energon packing: no averaging in the collective",
)
def _native_no_collective_average(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    if is_native(config.dataset) and config.ddp.average_in_collective:
        yield error(
            f"{_NATIVE} requires ddp.average_in_collective=False.", "Set ddp.average_in_collective: false."
        )


@rules.add("R10.4", "error", section="§5, §4.4", summary="native Energon packing: no MTP")
def _native_no_mtp(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    layers = config.model.mtp_num_layers
    if is_native(config.dataset) and layers is not None and layers > 0:
        yield error(
            f"{_NATIVE} does not support MTP (model.mtp_num_layers={layers}).",
            "Set model.mtp_num_layers: 0, or turn native packing off.",
        )


@rules.add(
    "R10.5",
    "error",
    section="§5, §4.4",
    summary="native Energon packing: no CUDA graphs (language or vision)",
)
def _native_no_cuda_graphs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    model = config.model
    graphs = {
        name: value
        for name in ("cuda_graph_impl", "vision_cuda_graph_impl")
        if (value := getattr(model, name)) not in (None, "none")
    }
    if is_native(config.dataset) and graphs:
        yield error(
            f"{_NATIVE} does not support CUDA graphs ("
            + ", ".join(f"model.{name}={value!r}" for name, value in graphs.items())
            + ").",
            " and ".join(f"Set model.{name}: none" for name in graphs) + ".",
        )


@rules.add("R10.6", "error", section="§5, §4.4", summary="native Energon packing: no Qwen3-VL DistTrain")
def _native_no_dist_train(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    if is_native(config.dataset) and config.dist_train.use_dist_train:
        yield error(
            f"{_NATIVE} does not support Qwen3-VL DistTrain.", "Set dist_train.use_dist_train: false."
        )


@rules.add("R10.7", "error", section="§5, §4.4", summary="native Energon packing: no pipeline parallelism")
def _native_no_pipeline(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    pp = config.model.pipeline_model_parallel_size
    if is_native(config.dataset) and pp > 1:
        yield error(
            f"{_NATIVE} does not yet support pipeline parallelism (model.pipeline_model_parallel_size={pp}).",
            "Set model.pipeline_model_parallel_size: 1, or use collate-time in-batch packing.",
        )


@rules.add(
    "R11",
    "warning",
    section="§5, §4.4",
    summary="native Energon packing turns EP overlap and delayed wgrad off: a warning when one was requested",
)
def _native_moe_overlap(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Native packing turns EP overlap and delayed wgrad off (the overlap schedule drops packed metadata)."""
    requested = [path for path, value in overlap_copies(config) if value]
    if is_native(config.dataset) and requested:
        yield warning(
            "Disabling MoE expert-parallel communication overlap and delayed weight-gradient compute for "
            f"{_NATIVE}: requested by {', '.join(requested)}.",
            f"Nothing to do: they are set to False ({', '.join(derived.forced_off)}); set the requested "
            "ones to false to silence this warning.",
        )


@rules.add("R15", "error", section="§5", summary="Energon dataset MBS == eval MBS when validating")
def _energon_eval_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """The Energon validation loader uses the dataset's batch size too."""
    dataset, eval_mbs = config.dataset, derived.eval_micro_batch_size
    if (
        isinstance(dataset, EnergonDatasetConfig)
        and dataset.do_validation
        and dataset.micro_batch_size != eval_mbs
    ):
        yield error(
            f"EnergonDatasetConfig.micro_batch_size must match validation.eval_micro_batch_size "
            f"({dataset.micro_batch_size} != {eval_mbs}).",
            f"Set validation.eval_micro_batch_size: {dataset.micro_batch_size}, or "
            "dataset.do_validation: false.",
        )


@rules.add(
    "T6",
    "warning",
    section="§3.5, §10.14",
    summary="Energon collate-time packing at a fixed width fails when the MBS rows exceed `seq_length`",
)
def _energon_collate_fixed_width(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Collate-time Qwen-VL packing at a fixed width raises when the MBS rows exceed seq_length (§3.5)."""
    dataset = config.dataset
    collate_time = is_in_batch(dataset) and not is_deferred(dataset) and not is_native(dataset)
    if isinstance(dataset, EnergonDatasetConfig) and collate_time and derived.pad_to_max_length:
        forced = "" if dataset.pad_to_max_length else " (forced by PP>1 or EP>1, R12)"
        yield warning(
            f"Collate-time packing at a fixed width{forced} puts {config.train.micro_batch_size} rows into "
            f"one row of seq_length={dataset.seq_length}; a micro-batch whose rows exceed it raises at run "
            "time.",
            "Use native packing (dataset.packing_buffer_size, which never overfills a pack), or keep "
            "MBS x the longest sample within seq_length.",
        )
