"""The rows of ``tightpack plan``: what packing at each size gives, the table, and the recommendation.

`PackSizeRow` holds one size's figures (each what ``tightpack pack`` at that size writes into its
manifest), `PackSizeComparison` all of them with the inputs' totals; `recommend` picks a size and says
why in plain figures: what it and every other size lose, of the supervised tokens and of all tokens,
and at what epoch time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from tightpack.core.stats import bounds_text

SAME_TIME = 0.01
"""Epoch times within this fraction of the fastest count as equally fast: the larger size wins."""


@dataclass(frozen=True)
class PackSizeRow:
    """What packing at one pack size gives (one row of ``tightpack plan``).

    Token counts are runtime tokens; costs are in the cost model's unit, ``*_relative`` ones divided by
    the smallest value over the rows (1.0 is the cheapest candidate). A size ``pack`` refuses (no sample
    left, or a long sample under ``long_samples="error"``) has every figure None and ``note`` says
    what ``pack`` at that size would (`PackSizeRow.refused`).

    Attributes:
        pack_size: P.
        global_batch_size: packs per optimizer step at the equal token slots (``token_slots // P``).
        packs, lower_bound, lower_bound_l2, gap: packs planned, the volume and the L2 lower bound (the
            manifest's ``stats``), and packs above the L2 bound.
        fill: packed tokens over ``packs * P`` (alignment padding counts as packed).
        samples_packed, truncated, dropped_long: the samples packed (truncated ones included),
            truncated, and dropped for length (``long_samples="drop"``, or media samples).
        no_supervised: samples dropped for having no supervised token (in the source or left after
            truncation); lost_after_truncation: those of them left without one by truncation.
        tokens_in, supervised_in: the tokens and supervised tokens of the samples tokenized at this
            size (a field cut before tokenizing keeps fewer at a smaller size, as in ``pack``).
        tokens_lost, supervised_lost: tokens and supervised tokens not trained on: prompt text trimmed,
            answers cut, samples dropped; ``tokens_lost - supervised_lost`` is prompt (unsupervised) text.
        tokens_lost_share, supervised_lost_share: each over ``tokens_in`` / ``supervised_in``.
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
    packs: int | None
    lower_bound: int | None
    lower_bound_l2: int | None
    gap: int | None
    fill: float | None
    samples_packed: int | None
    truncated: int | None
    dropped_long: int | None
    no_supervised: int | None
    lost_after_truncation: int | None
    tokens_in: int | None
    supervised_in: int | None
    tokens_lost: int | None
    supervised_lost: int | None
    tokens_lost_share: float | None
    supervised_lost_share: float | None
    alignment_padding: int | None
    steps_per_epoch: int | None
    attention_cost: float | None
    epoch_cost: float | None
    step_cost: float | None
    overhead_in_order: float | None
    overhead_balanced: float | None
    epoch_time_in_order: float | None
    epoch_time_balanced: float | None
    attention_cost_relative: float | None = None
    step_cost_relative: float | None = None
    epoch_time_relative: float | None = None
    note: str = ""

    @property
    def runnable(self) -> bool:
        return self.epoch_time_balanced is not None

    @property
    def packed(self) -> bool:
        """Whether ``pack`` at this size writes packs (False: it refuses, ``note`` says why)."""
        return self.packs is not None

    @classmethod
    def refused(cls, pack_size: int, global_batch_size: int, note: str) -> PackSizeRow:
        """A size ``pack`` refuses, with ``pack``'s reason: no figure."""
        figures = {
            field.name: None
            for field in dataclasses.fields(cls)
            if field.name not in ("pack_size", "global_batch_size", "note")
        }
        return cls(pack_size=pack_size, global_batch_size=global_batch_size, note=note, **figures)


@dataclass(frozen=True)
class PackSizeComparison:
    """The rows of `compare_pack_sizes`, the inputs' totals and the recommendation.

    Attributes:
        rows: one per pack size, ascending.
        recommended: the recommended pack size, None when no size can run at this DP.
        reason: why, and what the other sizes would trade.
        samples_in, tokens_in, supervised_in: the inputs' totals (runtime tokens; samples_in counts the
            rows read, bad ones included, as ``pack``'s manifest does); the token totals are those of
            the largest size ``pack`` does not refuse (None when it refuses every size).
        samples_tokenized: the samples planned (``samples_in - bad_rows``).
        bad_rows: the rows skipped as bad (``skip_bad_lines``), each as ``{"location", "reason"}``.
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
    tokens_in: int | None
    supervised_in: int | None
    samples_tokenized: int
    bad_rows: tuple[dict[str, str], ...]
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
        return [
            header,
            *(
                [name, *(cell(row) if row.packed or index == 0 else "n/a" for row in self.rows)]
                for index, (name, cell) in enumerate(_MEASURES)
            ),
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the per-sample lengths."""
        values = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("rows", "sample_lengths")
        }
        values["bad_rows"] = list(self.bad_rows)
        return {**values, "rows": [dataclasses.asdict(row) for row in self.rows]}


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


_MEASURES = (
    ("global batch size", lambda row: f"{row.global_batch_size:,}"),
    ("packs (lower bound)", lambda row: f"{row.packs:,} ({_bounds(row)})"),
    ("fill", lambda row: f"{row.fill:.2%}"),
    ("samples truncated", lambda row: f"{row.truncated:,}"),
    ("dropped (too long)", lambda row: f"{row.dropped_long:,}"),
    ("dropped (no supervised token)", lambda row: f"{row.no_supervised:,}"),
    ("  none left after truncation", lambda row: f"{row.lost_after_truncation:,}"),
    ("tokens lost, all", lambda row: f"{row.tokens_lost:,} ({row.tokens_lost_share:.2%})"),
    ("  prompt (unsupervised)", lambda row: f"{row.tokens_lost - row.supervised_lost:,}"),
    ("  supervised", lambda row: f"{row.supervised_lost:,} ({row.supervised_lost_share:.2%})"),
    ("alignment padding", lambda row: f"{row.alignment_padding:,}"),
    ("steps per epoch", lambda row: f"{row.steps_per_epoch:,}"),
    ("attention cost (relative)", lambda row: _ratio(row.attention_cost_relative)),
    ("step cost (relative)", lambda row: _ratio(row.step_cost_relative)),
    ("straggler overhead, in order", lambda row: _share(row.overhead_in_order)),
    ("straggler overhead, balanced", lambda row: _share(row.overhead_balanced)),
    ("epoch time (relative, balanced)", lambda row: _ratio(row.epoch_time_relative)),
)
"""The measures of `PackSizeComparison.table`: a name (``pack``'s summary's where it has the measure),
and a row's cell; the first (global batch size) is the only one a size ``pack`` refuses has."""


def _bounds(row: PackSizeRow) -> str:
    return bounds_text(row.packs, row.lower_bound, row.lower_bound_l2)


def relative(rows: list[PackSizeRow]) -> list[PackSizeRow]:
    """The rows with the ``*_relative`` fields: each value over the smallest of the rows."""

    def smallest(values: list[float | None]) -> float:
        present = [value for value in values if value is not None and value > 0]
        return min(present) if present else 1.0

    def over(value: float | None, base: float) -> float | None:
        return None if value is None else value / base

    attention = smallest([row.attention_cost for row in rows])
    step = smallest([row.step_cost for row in rows])
    epoch = smallest([row.epoch_time_balanced for row in rows])
    return [
        dataclasses.replace(
            row,
            attention_cost_relative=over(row.attention_cost, attention),
            step_cost_relative=over(row.step_cost, step),
            epoch_time_relative=over(row.epoch_time_balanced, epoch),
        )
        for row in rows
    ]


def recommend(rows: list[PackSizeRow], max_loss: float) -> tuple[int | None, str]:
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
        rule = (
            f"the largest size within {SAME_TIME:.0%} of the fastest epoch among those losing at most "
            f"{max_loss:.2%} of the supervised tokens"
        )
    else:
        chosen = min(runnable, key=lambda row: (row.supervised_lost_share, -row.pack_size))
        rule = f"every size loses more than {max_loss:.2%} of the supervised tokens; this one loses the least"
    why = f"{chosen.pack_size} ({rule}): {_losses(chosen)}"
    others = [_trade_off(row, chosen) for row in rows if row is not chosen]
    return chosen.pack_size, "; ".join([why, *others])


def _losses(row: PackSizeRow) -> str:
    """What a size loses, in a phrase: the supervised tokens, and all tokens (prompt text included)."""
    return (
        f"loses {row.supervised_lost_share:.2%} of the supervised tokens and {row.tokens_lost_share:.2%} "
        f"of all tokens ({row.tokens_lost:,}, of which {row.tokens_lost - row.supervised_lost:,} prompt)"
    )


def _trade_off(row: PackSizeRow, chosen: PackSizeRow) -> str:
    """One other size, in a phrase: what it loses and its epoch time against the chosen one's."""
    if not row.runnable:
        return f"{row.pack_size} cannot run ({row.note})"
    time = row.epoch_time_balanced / chosen.epoch_time_balanced
    return f"{row.pack_size} {_losses(row)}, at {time:.3f}x the epoch time"
