"""Choosing the pack size: every candidate planned on one tokenization (``tightpack plan``).

The reference's guidance is to benchmark pack lengths at equal token slots per optimizer step (2K with
a global batch of 32, 4K with 16 and 8K with 8 all hold 65,536 tokens) and keep the largest that fits.
`compare_pack_sizes` does that without a GPU: it tokenizes the inputs once (or reuses the cached token
store; again for a smaller size only when a field is long enough to be cut before tokenizing at that
size's text budget, as ``pack`` at that size would cut it), then runs, for each pack size, the same
accounting and planner as ``tightpack pack``
(`tightpack.offline.accounting.account_samples`, `tightpack.offline.pipeline.plan_kept`,
`tightpack.core.stats.pack_stats`), so every figure of a row is what packing at that size would write
into its manifest. On top it prices the packs under a cost model and simulates one epoch of the
offline samplers over the data-parallel ranks (`tightpack.core.balance.epoch_rank_costs`).

The recommendation is the largest size among those within a small margin of the fastest epoch, of
the sizes that lose at most ``max_supervised_loss`` of the supervised tokens; the rows keep every
trade-off in view. The rows, the table and the recommendation are `tightpack.reports.pack_size_rows`.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core.balance import epoch_rank_costs, straggler_overhead
from tightpack.core.cost_model import CostModel
from tightpack.core.stats import pack_stats
from tightpack.errors import TightpackError
from tightpack.offline.accounting import (
    LongSamplesError,
    account_samples,
    nothing_left,
    truncation_loss_note,
)
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import Progress, TokenizedInputs, plan_kept, tokenize_inputs
from tightpack.offline.store_reuse import same_texts, text_budget
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.reports.pack_size_rows import PackSizeComparison, PackSizeRow, recommend, relative

DEFAULT_COST_MODEL = "llama-8b"


def compare_pack_sizes(
    inputs: Iterable[Any] | str | Path | None,
    pack_sizes: Sequence[int],
    *,
    token_slots: int,
    config: PackConfig | None = None,
    tokenizer: str | Path | TokenizerSpec | None = None,
    cost_model: CostModel | str | Path = DEFAULT_COST_MODEL,
    data_parallel_size: int = 1,
    max_supervised_loss: float = 0.01,
    split: str | None = None,
    progress: Progress | None = None,
) -> PackSizeComparison:
    """Plan every pack size on one tokenization and compare them at equal token slots per step.

    Args:
        inputs: what `tightpack.offline.pipeline.pack_dataset` takes (None: the embedded demo corpus).
        pack_sizes: the candidate pack sizes P; each must divide ``token_slots``.
        token_slots: tokens per optimizer step, all ranks together (GBS x P for every candidate).
        config: the packing settings besides the pack size (format, alignment, long-sample policy,
            algorithm, tokenization workers); its ``packed_sequence_size`` and ``max_seq_length`` are
            replaced by each candidate's (the cap is the pack size).
        cost_model: a `CostModel`, a preset name or a JSON file (`CostModel.resolve`).
        data_parallel_size: DP, for the straggler simulation; GBS must be a multiple of it.
        max_supervised_loss: the largest share of the supervised tokens a recommended size may lose.

    Example::

        comparison = compare_pack_sizes(["train.jsonl"], [2048, 4096, 8192], token_slots=65536)
        print(comparison.recommended, comparison.reason)
    """
    sizes = _check_sizes(pack_sizes, token_slots)
    if (
        isinstance(data_parallel_size, bool)
        or not isinstance(data_parallel_size, int)
        or data_parallel_size < 1
    ):
        raise TightpackError(f"--dp must be a positive integer, got {data_parallel_size!r}")
    if not 0 <= max_supervised_loss < 1:
        raise TightpackError(f"--max-supervised-loss must be in [0, 1), got {max_supervised_loss}")
    template = config or PackConfig(packed_sequence_size=sizes[-1])
    configs = {size: _at_size(template, size) for size in sizes}
    for candidate in configs.values():
        candidate.validate()
    model = CostModel.resolve(cost_model)
    model_name = cost_model if isinstance(cost_model, str) else str(cost_model)
    with tempfile.TemporaryDirectory(prefix="tightpack-plan-") as work:
        workdir = Path(work)
        largest = tokenize_inputs(
            inputs, configs[sizes[-1]], workdir, tokenizer=tokenizer, split=split, progress=progress
        )
        seconds = {"tokenize": largest.seconds}
        rows, totals = [], {}
        plan_seconds = 0.0
        for size in sizes:
            tokenized = _tokenized_at(largest, size, configs, inputs, workdir, split, progress)
            if tokenized is not largest:
                seconds["tokenize"] += tokenized.seconds
            clock = time.perf_counter()
            staging = workdir / f"size-{size}"
            staging.mkdir()
            row, counts = _plan_size(
                tokenized, size, token_slots // size, configs[size], model, data_parallel_size, staging
            )
            rows.append(row)
            totals = counts or totals
            shutil.rmtree(staging)
            plan_seconds += time.perf_counter() - clock
        sample_lengths = largest.report.store.lengths - 1
        seconds["plan"] = plan_seconds
    rows = relative(rows)
    recommended, reason = recommend(rows, max_supervised_loss)
    return PackSizeComparison(
        rows=tuple(rows),
        recommended=recommended,
        reason=reason,
        samples_in=largest.report.rows_read,
        tokens_in=totals.get("tokens_in"),
        supervised_in=totals.get("supervised_in"),
        samples_tokenized=len(largest.report.store),
        bad_rows=tuple({"location": bad.location, "reason": bad.reason} for bad in largest.report.bad_rows),
        sample_lengths=sample_lengths,
        token_slots=token_slots,
        data_parallel_size=data_parallel_size,
        multiple=template.multiple,
        max_supervised_loss=max_supervised_loss,
        cost_model={"name": model_name, **model.to_dict()},
        seconds=seconds,
        reused_store=largest.report.reused,
    )


def _plan_size(
    tokenized: TokenizedInputs,
    size: int,
    gbs: int,
    config: PackConfig,
    model: CostModel,
    ranks: int,
    staging: Path,
) -> tuple[PackSizeRow, dict[str, int] | None]:
    """One size's row and counts, or, where ``pack`` at this size stops (a long sample under
    ``long_samples="error"``, no sample left), a row that cannot run saying what ``pack`` would, in
    ``plan``'s options, and None."""
    report = tokenized.report
    try:
        counts, keep, aligned, excluded, _ = account_samples(report.store, config, report, staging)
    except LongSamplesError as error:
        note = (
            f"{error.fact}; pack at {size} stops on them with --long-samples error: use --long-samples "
            f"truncate or drop, or leave {size} out of --pack-sizes"
        )
        return PackSizeRow.refused(size, gbs, note), None
    if counts["samples_in"] == 0:
        raise TightpackError("no sample to plan: the inputs held no rows (empty, or blank lines only)")
    if not keep.any():
        lost = excluded["no_supervised_after_truncation"]
        note = truncation_loss_note(report.store, lost, config.cap) if lost else None
        return PackSizeRow.refused(size, gbs, nothing_left(counts, note)), None
    return _row(size, gbs, counts, keep, aligned, config, model, ranks), counts


def _tokenized_at(
    largest: TokenizedInputs,
    size: int,
    configs: dict[int, PackConfig],
    inputs: Any,
    workdir: Path,
    split: str | None,
    progress: Progress | None,
) -> TokenizedInputs:
    """The samples ``tightpack pack`` at ``size`` tokenizes: those of the largest size, unless a field
    may be cut before tokenizing at this size's smaller text budget (`same_texts`): then tokenized anew
    with that budget, so every count is that of ``pack`` at this size."""
    spec, report, top = largest.spec, largest.report, max(configs)
    budget = text_budget(spec, configs[size])
    longest = int(report.store.lengths.max(initial=0))
    if same_texts(text_budget(spec, configs[top]), report.texts_cut, longest, budget, configs[size].cap):
        return largest
    folder = workdir / f"tokenized-{size}"
    folder.mkdir()
    return tokenize_inputs(inputs, configs[size], folder, tokenizer=spec, split=split, progress=progress)


def _check_sizes(pack_sizes: Sequence[int], token_slots: int) -> list[int]:
    sizes = sorted(set(pack_sizes))
    if not sizes:
        raise TightpackError("--pack-sizes is empty; give the candidates, e.g. --pack-sizes 2048,4096,8192")
    if isinstance(token_slots, bool) or not isinstance(token_slots, int) or token_slots < 1:
        raise TightpackError(f"--token-slots must be a positive integer, got {token_slots!r}")
    uneven = [size for size in sizes if size < 1 or token_slots % size]
    if uneven:
        common = math.lcm(*sizes)
        raise TightpackError(
            f"--token-slots {token_slots} is not a multiple of pack size {uneven[0]}: the candidates are "
            f"compared at equal tokens per step (GBS x P); use a multiple of every pack size, e.g. "
            f"{common * max(1, token_slots // common)}"
        )
    return sizes


def _at_size(template: PackConfig, size: int) -> PackConfig:
    return dataclasses.replace(template, packed_sequence_size=size, max_seq_length=None)


def _row(
    size: int,
    gbs: int,
    counts: dict[str, int],
    keep: np.ndarray,
    aligned: np.ndarray,
    config: PackConfig,
    model: CostModel,
    ranks: int,
) -> PackSizeRow:
    """Plan ``size`` as ``tightpack pack`` would, then price and simulate it."""
    lengths = np.where(keep, aligned, 0)  # the planner marks the samples it leaves out in ``aligned``
    plan, _ = plan_kept(aligned, keep, config)
    stats = pack_stats(plan, lengths, size)
    costs = model.pack_costs(plan, lengths)
    steps = len(plan) // gbs
    note, times, overheads = "", {}, {}
    if gbs % ranks:
        note = f"GBS {gbs} is not a multiple of DP {ranks}"
    elif steps == 0:
        note = f"{len(plan)} packs do not fill one global batch of {gbs}"
    else:
        for balanced in (False, True):
            rank_costs = epoch_rank_costs(costs, ranks, gbs, balanced=balanced, seed=config.seed)
            overheads[balanced] = straggler_overhead(rank_costs)
            times[balanced] = float(rank_costs.max(axis=1).sum())
    return PackSizeRow(
        pack_size=size,
        global_batch_size=gbs,
        packs=stats.packs,
        lower_bound=stats.lower_bound,
        lower_bound_l2=stats.lower_bound_l2,
        gap=stats.gap,
        fill=stats.efficiency,
        samples_packed=counts["packed"],
        truncated=counts["truncated"],
        dropped_long=counts["dropped_long"],
        no_supervised=counts["no_supervised"],
        lost_after_truncation=counts["no_supervised_after_truncation"],
        tokens_in=counts["tokens_in"],
        supervised_in=counts["supervised_in"],
        tokens_lost=counts["tokens_lost"],
        supervised_lost=counts["supervised_lost"],
        tokens_lost_share=counts["tokens_lost"] / max(counts["tokens_in"], 1),
        supervised_lost_share=counts["supervised_lost"] / max(counts["supervised_in"], 1),
        alignment_padding=counts["alignment_padding"],
        steps_per_epoch=steps,
        attention_cost=float(plan.pack_loads(lengths, 2).sum()),
        epoch_cost=float(costs.sum()),
        step_cost=float(costs.sum()) * gbs / len(plan),
        overhead_in_order=overheads.get(False),
        overhead_balanced=overheads.get(True),
        epoch_time_in_order=times.get(False),
        epoch_time_balanced=times.get(True),
        note=note,
    )
