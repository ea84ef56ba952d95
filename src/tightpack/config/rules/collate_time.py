"""Rules of collate-time (in-batch) packing: the collator packs a micro-batch's rows into one
(docs/contract.md §3).

DirectHF, MockVLM and Energon datasets own it. Their padding multiples are positive (R8.1, §3.6) and their
``seq_length`` is a multiple of the CP/SP multiple k they pad to (R13). A micro-batch holds at least two
sequences (R21), and with the ``batch`` loader, which collates a DP rank's whole global batch at once, a step
holds one micro-batch (T5, §3.7). The rules of Energon's own packing are in `energon`.
"""

from __future__ import annotations

from collections.abc import Iterator

from tightpack.config.derive import DerivedValues, is_deferred, is_in_batch
from tightpack.config.rules.base import Issue, RuleGroup, error, multiple_origin, round_options
from tightpack.config.schema import CollatePackingDataset, RunConfig

rules = RuleGroup()


@rules.add(
    "R8.1",
    "error",
    section="§5, §3.6",
    summary="`pad_to_multiple_of` and `in_batch_packing_pad_to_multiple_of` > 0",
)
def _positive_collate_multiples(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """The collate padding multiples are positive (§3.6)."""
    dataset = config.dataset
    if isinstance(dataset, CollatePackingDataset):
        for name, default in (("pad_to_multiple_of", 128), ("in_batch_packing_pad_to_multiple_of", 1)):
            value = getattr(dataset, name)
            if value <= 0:
                yield error(
                    f"{name} must be greater than 0 (dataset.{name}={value}).",
                    f"Set dataset.{name} to a positive integer (default {default}).",
                )


@rules.add(
    "R13",
    "error",
    section="§5",
    summary="collate datasets: `seq_length` divisible by the CP/SP multiple k",
)
def _collate_seq_length_multiple(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """Collate datasets pad to k, so their sequence length must be a multiple of it."""
    dataset, multiple = config.dataset, derived.alignment_multiple
    if isinstance(dataset, CollatePackingDataset) and dataset.seq_length % multiple:
        yield error(
            f"{dataset.type}.seq_length must be divisible by the CP/SP collate padding multiple "
            f"({multiple}); seq_length={dataset.seq_length}, {multiple_origin(config, derived)}.",
            f"Set dataset.seq_length and model.seq_length to a multiple of {multiple}: "
            f"{round_options(dataset.seq_length, multiple)}.",
        )


@rules.add("R21", "error", section="§5, §3.7", summary="in-batch packing needs MBS > 1")
def _in_batch_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    if is_in_batch(config.dataset) and config.train.micro_batch_size == 1:
        yield error(
            "micro_batch_size should be greater than 1 when using enable_in_batch_packing=True. "
            "In-batch packing concatenates multiple sequences within a microbatch, so at least 2 "
            "sequences are required per micro-batch.",
            "Set train.micro_batch_size to 2 or more (and the global batch size to a multiple of MBS*DP).",
        )


@rules.add(
    "T5",
    "error",
    section="§3.7, §10.13",
    summary='in-batch packing with `dataloader_type="batch"` needs one micro-batch per step',
)
def _in_batch_batch_loader(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
    """The ``batch`` loader collates a DP rank's global batch at once, then splits it (§3.7)."""
    dataset, steps = config.dataset, derived.micro_batches_per_step
    collate_time = is_in_batch(dataset) and not is_deferred(dataset)
    if collate_time and dataset.dataloader_type == "batch" and steps is not None and steps != 1:
        yield error(
            'In-batch packing with dataloader_type="batch" packs the global batch of a DP rank into one '
            f"row, which cannot be split into {steps} micro-batches ('Batch size 1 is not divisible by "
            "num_microbatches').",
            "Set dataset.dataloader_type: cyclic (or single), or make GBS = MBS*DP (one micro-batch per "
            "step).",
        )
