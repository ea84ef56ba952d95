"""Rules every dataset kind shares: run length and loader, the batch arithmetic, the sequence length.

``train.num_epochs`` needs a finite GPT SFT dataset and the ``batch`` loader (R1, R2; docs/contract.md
§3.7). The data-parallel size and the micro-batches per step are integers, for training (X1: the sampler
and Megatron-Core's micro-batch calculator) and for evaluation (R16). The model and the dataset agree on the
sequence length (R22).
"""

from __future__ import annotations

from collections.abc import Iterator

from tightpack.config.derive import DerivedValues
from tightpack.config.rules.base import Issue, RuleGroup, error, round_options
from tightpack.config.schema import DatasetProvider, GPTSFTDatasetConfig, RunConfig

rules = RuleGroup()


@rules.add(
    "R1",
    "error",
    section="§5, §3.7",
    summary="`train.num_epochs` only with a GPTSFTDatasetConfig dataset",
)
def _num_epochs_dataset(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``train.num_epochs`` needs a finite GPT SFT dataset."""
    if config.train.num_epochs is not None and not isinstance(config.dataset, GPTSFTDatasetConfig):
        yield error(
            f"num_epochs is only supported for finite GPTSFTDatasetConfig datasets; train.num_epochs="
            f"{config.train.num_epochs} with a {config.dataset.type}.",
            "Remove train.num_epochs and set the run length with train.train_iters.",
        )


@rules.add(
    "R2",
    "error",
    section="§5, §3.7",
    summary='`train.num_epochs` only with `dataloader_type="batch"`',
)
def _num_epochs_loader(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """``train.num_epochs`` needs the ``batch`` loader."""
    if config.train.num_epochs is not None and config.dataset.dataloader_type != "batch":
        yield error(
            f'num_epochs is currently supported only with dataloader_type="batch"; dataset.dataloader_type='
            f"{config.dataset.dataloader_type!r}.",
            "Set dataset.dataloader_type: batch, or remove train.num_epochs.",
        )


@rules.add(
    "R16",
    "error",
    section="§5",
    summary="eval GBS divisible by `eval MBS * eval DP` (eval DP uses the eval CP)",
)
def _eval_batch_divisible(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
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
        yield error(
            f"dist.world_size ({config.dist.world_size}) is not divisible by TP*PP*eval CP ({parallel}), "
            "so the evaluation data-parallel size is not an integer.",
            f"Set dist.eval_context_parallel_size so that TP*PP*eval CP divides {config.dist.world_size}.",
        )
    elif derived.eval_micro_batches_per_step is None:
        step = eval_mbs * derived.eval_data_parallel_size
        yield error(
            f"validation.eval_global_batch_size ({eval_gbs}) is not divisible by eval micro batch size "
            f"({eval_mbs}) times eval data parallel size ({derived.eval_data_parallel_size}).",
            f"Set validation.eval_global_batch_size to a multiple of {step}: "
            f"{round_options(eval_gbs, step)}.",
        )


@rules.add("R22", "error", section="§5", summary="`model.seq_length` == `dataset.seq_length`")
def _seq_length_match(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    model, dataset = config.model, config.dataset
    if not isinstance(dataset, DatasetProvider) and model.seq_length != dataset.seq_length:
        yield error(
            "Please ensure sequence length configuration in model config and dataset config match "
            f"(model.seq_length={model.seq_length}, dataset.seq_length={dataset.seq_length}).",
            f"Set model.seq_length and dataset.seq_length to the same value (e.g. {dataset.seq_length}).",
        )


@rules.add(
    "X1",
    "error",
    section="§5, §3.7",
    summary="(sampler, MCore) integral DP; GBS divisible by `MBS * DP`, at least one micro-batch",
)
def _global_batch_divisible(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """The sampler and MCore's micro-batch calculator: integral DP, GBS divisible by MBS*DP."""
    model, train = config.model, config.train
    tp, pp, cp = (
        model.tensor_model_parallel_size,
        model.pipeline_model_parallel_size,
        model.context_parallel_size,
    )
    world, dp = config.dist.world_size, derived.data_parallel_size
    if dp is None:
        yield error(
            f"dist.world_size ({world}) is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}, "
            "so the data-parallel size is not an integer.",
            f"Use a world size that is a multiple of {tp * pp * cp}, or change the parallel sizes.",
        )
    elif derived.micro_batches_per_step is None:
        step = train.micro_batch_size * dp
        short = (
            " (and must hold at least one micro-batch per DP rank)" if train.global_batch_size < step else ""
        )
        yield error(
            f"global batch size ({train.global_batch_size}) is not divisible by micro batch size "
            f"({train.micro_batch_size}) times data parallel size ({dp}){short}.",
            f"Set train.global_batch_size to a multiple of {step}: "
            f"{round_options(train.global_batch_size, step)}.",
        )
