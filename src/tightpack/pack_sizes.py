"""Choosing the pack size: every candidate planned on one tokenization (``tightpack plan``).

The reference's guidance is to benchmark pack lengths at equal token slots per optimizer step (2K with
a global batch of 32, 4K with 16 and 8K with 8 all hold 65,536 tokens) and keep the largest that fits.
`compare_pack_sizes` does that without a GPU: it tokenizes the inputs once (or reuses the cached token
store), then runs, for each pack size, the same accounting and planner as ``tightpack pack``
(`tightpack.sample_accounting.account_samples`, `tightpack.pipeline.plan_kept`,
`tightpack.core.stats.pack_stats`), so every figure of a row is what packing at that size would write
into its manifest. On top it prices the packs under a cost model and simulates one epoch of the
offline samplers over the data-parallel ranks (`tightpack.core.balance.epoch_rank_costs`).

The recommendation is the largest size among those within a small margin of the fastest epoch, of
the sizes that lose at most ``max_supervised_loss`` of the supervised tokens; the rows keep every
trade-off in view.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core.balance import epoch_rank_costs, straggler_overhead
from tightpack.core.cost_model import CostModel
from tightpack.core.stats import pack_stats
from tightpack.errors import TightpackError
from tightpack.pack_config import PackConfig
from tightpack.pipeline import Progress, plan_kept, tokenize_inputs
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.sample_accounting import account_samples

__all__ = ["PackSizeComparison", "PackSizeRow", "compare_pack_sizes"]

DEFAULT_COST_MODEL = "llama-8b"
SAME_TIME = 0.01
"""Epoch times within this fraction of the fastest count as equally fast: the larger size wins."""


@dataclass(frozen=True)
class PackSizeRow:
    """What packing at one pack size gives (one row of ``tightpack plan``).

    Token counts are runtime tokens; costs are in the cost model's unit, ``*_relative`` ones divided by
    the smallest value over the rows (1.0 is the cheapest candidate).

    Attributes:
        pack_size: P.
        global_batch_size: packs per optimizer step at the equal token slots (``token_slots // P``).
        packs, lower_bound, gap: packs planned, the L2 lower bound, and packs above it.
        fill: packed tokens over ``packs * P`` (alignment padding counts as packed).
        samples_packed, truncated, dropped_long: the samples packed (truncated ones included),
            truncated, and dropped for length (``long_samples="drop"``, or media samples).
        lost_after_truncation: samples left without a supervised token by truncation (dropped).
        tokens_lost, supervised_lost: tokens and supervised tokens not trained on.
        supervised_lost_share: ``supervised_lost`` over the supervised tokens of the inputs.
        alignment_padding: tokens of alignment padding (``pad_seq_to_mult``).
        steps_per_epoch: whole global batches (the last ``packs % GBS`` packs wait for the next epoch).
        attention_cost: ``sum(s**2)`` over the packed sequences (aligned lengths), tokens squared.
        epoch_cost: the cost of all packs under the cost model.
        step_cost: mean cost of an optimizer step (all ranks): ``epoch_cost * GBS / packs``.
        overhead_in_order, overhead_balanced: straggler overhead (`straggler_overhead`) of one epoch at
            the data-parallel size, the packs dealt as ``PackedBatchSampler`` and as
            ``BalancedPackedBatchSampler`` do; None when ``GBS`` is no multiple of DP or the packs fill no
            step.
        epoch_time_in_order, epoch_time_balanced: one epoch's time, ``sum over steps of the slowest
            rank's cost``, in the cost model's unit; None as above.
        note: why a row cannot run, or "".
    """

    pack_size: int
    global_batch_size: int
    packs: int
    lower_bound: int
    gap: int
    fill: float
    samples_packed: int
    truncated: int
    dropped_long: int
    lost_after_truncation: int
    tokens_lost: int
    supervised_lost: int
    supervised_lost_share: float
    alignment_padding: int
    steps_per_epoch: int
    attention_cost: float
    epoch_cost: float
    step_cost: float
    overhead_in_order: float | None
    overhead_balanced: float | None
    epoch_time_in_order: float | None
    epoch_time_balanced: float | None
    attention_cost_relative: float = 0.0
    step_cost_relative: float = 0.0
    epoch_time_relative: float | None = None
    note: str = ""

    @property
    def runnable(self) -> bool:
        return self.epoch_time_balanced is not None


@dataclass(frozen=True)
class PackSizeComparison:
    """The rows of `compare_pack_sizes`, the inputs' totals and the recommendation.

    Attributes:
        rows: one per pack size, ascending.
        recommended: the recommended pack size, None when no size can run at this DP.
        reason: why, and what the other sizes would trade.
        samples_in, tokens_in, supervised_in: the inputs' totals (runtime tokens).
        sample_lengths: runtime length of every tokenized sample, int64 ``[samples]`` (for histograms).
        token_slots, data_parallel_size, multiple: the settings compared at.
        max_supervised_loss: the largest share of supervised tokens a recommended size may lose.
        cost_model: the cost model's JSON form (`CostModel.to_dict`), with its name.
        seconds: time per stage (``tokenize``, ``plan``).
        reused_store: whether tokenizing reused the cached token store.
    """

    rows: tuple[PackSizeRow, ...]
    recommended: int | None
    reason: str
    samples_in: int
    tokens_in: int
    supervised_in: int
    sample_lengths: np.ndarray
    token_slots: int
    data_parallel_size: int
    multiple: int
    max_supervised_loss: float
    cost_model: dict[str, Any]
    seconds: dict[str, float]
    reused_store: bool

    def row(self, pack_size: int) -> PackSizeRow:
        return next(row for row in self.rows if row.pack_size == pack_size)

    def table(self) -> list[list[str]]:
        """The table of ``tightpack plan`` (and its HTML report): a header row (``"pack size"``, then
        each size), then one row per measure, its name then one cell per pack size."""
        header = ["pack size", *(f"{row.pack_size:,}" for row in self.rows)]
        return [header, *([name, *(cell(row) for row in self.rows)] for name, cell in _MEASURES)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the per-sample lengths."""
        values = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("rows", "sample_lengths")
        }
        return {**values, "rows": [dataclasses.asdict(row) for row in self.rows]}


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


_MEASURES = (
    ("global batch size", lambda row: f"{row.global_batch_size:,}"),
    ("packs", lambda row: f"{row.packs:,}"),
    ("lower bound (gap)", lambda row: f"{row.lower_bound:,} ({row.gap:,})"),
    ("fill", lambda row: f"{row.fill:.2%}"),
    ("samples truncated", lambda row: f"{row.truncated:,}"),
    ("samples dropped", lambda row: f"{row.dropped_long + row.lost_after_truncation:,}"),
    ("supervised tokens lost", lambda row: f"{row.supervised_lost:,} ({row.supervised_lost_share:.2%})"),
    ("alignment padding", lambda row: f"{row.alignment_padding:,}"),
    ("steps per epoch", lambda row: f"{row.steps_per_epoch:,}"),
    ("attention cost (relative)", lambda row: _ratio(row.attention_cost_relative)),
    ("step cost (relative)", lambda row: _ratio(row.step_cost_relative)),
    ("straggler overhead, in order", lambda row: _share(row.overhead_in_order)),
    ("straggler overhead, balanced", lambda row: _share(row.overhead_balanced)),
    ("epoch time (relative, balanced)", lambda row: _ratio(row.epoch_time_relative)),
)
"""The measures of `PackSizeComparison.table`: a name, and a row's cell."""


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
        inputs: what `tightpack.pipeline.pack_dataset` takes (None: the embedded demo corpus).
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
        tokenized = tokenize_inputs(
            inputs, configs[sizes[-1]], workdir, tokenizer=tokenizer, split=split, progress=progress
        )
        seconds = {"tokenize": tokenized.seconds}
        clock = time.perf_counter()
        report = tokenized.report
        rows, totals = [], {}
        for size in sizes:
            staging = workdir / f"size-{size}"
            staging.mkdir()
            counts, keep, aligned, _, _ = account_samples(report.store, configs[size], report, staging)
            if counts["samples_in"] == 0 or not keep.any():
                raise TightpackError("no sample to plan: the inputs hold no sample with a supervised token")
            totals = counts
            rows.append(
                _row(
                    size, token_slots // size, counts, keep, aligned, configs[size], model, data_parallel_size
                )
            )
            shutil.rmtree(staging)
        sample_lengths = report.store.lengths - 1
        seconds["plan"] = time.perf_counter() - clock
    rows = _relative(rows)
    recommended, reason = _recommend(rows, max_supervised_loss)
    return PackSizeComparison(
        rows=tuple(rows),
        recommended=recommended,
        reason=reason,
        samples_in=totals["samples_in"],
        tokens_in=totals["tokens_in"],
        supervised_in=totals["supervised_in"],
        sample_lengths=sample_lengths,
        token_slots=token_slots,
        data_parallel_size=data_parallel_size,
        multiple=template.multiple,
        max_supervised_loss=max_supervised_loss,
        cost_model={"name": model_name, **model.to_dict()},
        seconds=seconds,
        reused_store=report.reused,
    )


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
        lower_bound=stats.lower_bound_l2,
        gap=stats.gap,
        fill=stats.efficiency,
        samples_packed=counts["packed"],
        truncated=counts["truncated"],
        dropped_long=counts["dropped_long"],
        lost_after_truncation=counts["no_supervised_after_truncation"],
        tokens_lost=counts["tokens_lost"],
        supervised_lost=counts["supervised_lost"],
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


def _relative(rows: list[PackSizeRow]) -> list[PackSizeRow]:
    """The rows with the ``*_relative`` fields: each value over the smallest of the rows."""

    def smallest(values: list[float | None]) -> float:
        present = [value for value in values if value is not None and value > 0]
        return min(present) if present else 1.0

    attention = smallest([row.attention_cost for row in rows])
    step = smallest([row.step_cost for row in rows])
    epoch = smallest([row.epoch_time_balanced for row in rows])
    return [
        dataclasses.replace(
            row,
            attention_cost_relative=row.attention_cost / attention,
            step_cost_relative=row.step_cost / step,
            epoch_time_relative=None if row.epoch_time_balanced is None else row.epoch_time_balanced / epoch,
        )
        for row in rows
    ]


def _recommend(rows: list[PackSizeRow], max_loss: float) -> tuple[int | None, str]:
    """The largest size within `SAME_TIME` of the fastest epoch among those losing at most ``max_loss``
    of the supervised tokens (the least lossy one when none does), and the reason, trade-offs included."""
    runnable = [row for row in rows if row.runnable]
    if not runnable:
        return None, "no pack size can run: " + "; ".join(f"{row.pack_size}: {row.note}" for row in rows)
    within = [row for row in runnable if row.supervised_lost_share <= max_loss]
    if within:
        fastest = min(row.epoch_time_balanced for row in within)
        chosen = max(
            (row for row in within if row.epoch_time_balanced <= fastest * (1 + SAME_TIME)),
            key=lambda row: row.pack_size,
        )
        why = (
            f"{chosen.pack_size}: loses {chosen.supervised_lost_share:.2%} of the supervised tokens "
            f"(at most {max_loss:.2%} allowed) and has the "
            + ("fastest epoch" if chosen.epoch_time_balanced == fastest else "fastest epoch within 1%")
        )
    else:
        chosen = min(runnable, key=lambda row: (row.supervised_lost_share, -row.pack_size))
        why = (
            f"{chosen.pack_size}: every size loses more than {max_loss:.2%} of the supervised tokens; this "
            f"one loses the least ({chosen.supervised_lost_share:.2%})"
        )
    others = [_trade_off(row, chosen, max_loss) for row in rows if row is not chosen]
    return chosen.pack_size, "; ".join([why, *others])


def _trade_off(row: PackSizeRow, chosen: PackSizeRow, max_loss: float) -> str:
    """One other size against the chosen one, in a phrase."""
    if not row.runnable:
        return f"{row.pack_size} cannot run ({row.note})"
    time = row.epoch_time_balanced / chosen.epoch_time_balanced
    kept = (chosen.supervised_lost_share - row.supervised_lost_share) * 100
    loss = (
        f"loses {row.supervised_lost_share:.2%} of the supervised tokens"
        if row.supervised_lost_share > max_loss
        else f"keeps {kept:+.2f} points of the supervised tokens"
    )
    return f"{row.pack_size} {loss} at {time:.3f}x the epoch time"
