"""A packing run over weighted inputs: `MixtureConfig`, and the plan and statistics of the mixture.

Each input of ``tightpack pack`` (a file, a glob pattern, a dataset) is one source of the mixture,
with one weight. After the samples are tokenized and accounted (truncated, dropped) as in any run,
`plan_mixture_run` picks every source's samples (`tightpack.core.mixture.resolve_mixture`: repeated
up to the cap, or subsampled by seed) and packs them so that every global batch of packs holds the
mixture (`tightpack.core.mixture_plan`). The manifest's ``mixture`` section has the statistics per
source and the worst global batch; ``tightpack inspect`` shows them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tightpack.core.mixture import (
    MIX_BY,
    InfeasibleMixtureError,
    MixBy,
    MixtureSelection,
    resolve_mixture,
    sample_measure,
)
from tightpack.core.mixture_plan import DEFAULT_WINDOW, MixturePlan, pack_mixture, plan_mixture
from tightpack.core.planner import PackPlan
from tightpack.errors import TightpackError, check_choice
from tightpack.offline.mixture_figures import packed_figures, repetitions, sample_sources

__all__ = ["MixtureConfig", "MixtureRun", "plan_mixture_run"]

PACK_SEARCH_ROUNDS = 40
"""Selections `plan_mixture_run` packs at most to meet a pack count exactly (each a resolve and a
count of its packs; interpolation usually needs a handful)."""


@dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    """The mixture of a packing run: one weight per input (``--weights``).

    Attributes:
        weights: one positive weight per input, in input order (normalised to shares).
        mix_by: what the weights count (``--mix-by``): ``tokens``, ``supervised-tokens`` or
            ``samples`` (`tightpack.core.mixture.MIX_BY`).
        max_repetitions: a source is taken at most this many times over (``--max-repetitions``; 1:
            never repeated); a larger source than its share needs is subsampled, by ``seed``.
        total_tokens: the mixture's runtime tokens (``--mix-tokens``); None (and no ``total_packs``):
            the largest mixture the cap allows.
        total_packs: the mixture's packs (``--mix-packs``), exactly: the total whose plan fills them.
        window_packs: packs per global batch (``--mix-window``): every batch of this many
            consecutive packs holds the mixture, and the run measures them.
        tolerance: percentage points (``--mix-tolerance``): a full global batch further than this from
            a target stops the run; None reports the worst batch without a limit.

    >>> MixtureConfig(weights=(5, 3, 2), mix_by="supervised-tokens").validate(3)
    """

    weights: tuple[float, ...]
    mix_by: MixBy = "tokens"
    max_repetitions: float = 1.0
    total_tokens: int | None = None
    total_packs: int | None = None
    window_packs: int = DEFAULT_WINDOW
    tolerance: float | None = None

    def validate(self, inputs: int | None = None) -> None:
        """Check the settings (and, given ``inputs``, one weight per input); raises `TightpackError`."""
        check_choice("mix_by", self.mix_by, MIX_BY)
        if inputs is not None and len(self.weights) != inputs:
            raise TightpackError(
                f"the mixture has {len(self.weights)} weights for {inputs} inputs: give one weight per "
                "input, in input order (a glob pattern is one input)"
            )
        for number, weight in enumerate(self.weights, 1):
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
                raise TightpackError(
                    f"the weight of input {number} is {weight:g}: give a positive number (leave the input "
                    "out instead of weight 0)"
                )
        if not (math.isfinite(self.max_repetitions) and self.max_repetitions >= 1):
            raise TightpackError(
                f"max_repetitions must be at least 1, got {self.max_repetitions!r}",
                parameters=("max_repetitions",),
            )
        if self.total_tokens is not None and self.total_packs is not None:
            raise TightpackError(
                "give total_tokens or total_packs, not both", parameters=("total_tokens", "total_packs")
            )
        for name in ("total_tokens", "total_packs", "window_packs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise TightpackError(f"{name} must be a positive integer, got {value!r}", parameters=(name,))
        if self.tolerance is not None and not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise TightpackError(
                f"tolerance must be a positive number of percentage points, got {self.tolerance!r}",
                parameters=("tolerance",),
            )


@dataclass(frozen=True)
class MixtureRun:
    """The packs of a mixture run and what the manifest says of it.

    Attributes:
        plan: the packs, over the store's samples (a repeated sample listed once per repetition).
        chosen: bool ``[num_samples]``: the samples packed at least once.
        report: the manifest's ``mixture`` section (`plan_mixture_run`).
    """

    plan: PackPlan
    chosen: np.ndarray
    report: dict[str, Any]


def plan_mixture_run(
    mixture: MixtureConfig,
    names: list[str],
    sample_input: np.ndarray,
    keep: np.ndarray,
    real: np.ndarray,
    supervised: np.ndarray,
    aligned: np.ndarray,
    pack_size: int,
    seed: int,
) -> MixtureRun:
    """The packs of a mixture over the kept samples, and its statistics.

    Args:
        mixture: the settings.
        names: each input's name.
        sample_input: int ``[num_samples]``: each sample's input (`sample_sources`).
        keep: bool ``[num_samples]``: the samples the run may pack (accounting kept them).
        real: int ``[num_samples]``: runtime tokens of each kept sample (after truncation).
        supervised: int ``[num_samples]``: supervised tokens of each kept sample (after truncation).
        aligned: int ``[num_samples]``: the lengths in the pack (aligned).
        pack_size: the run's pack size.
        seed: the run's seed (subsamples and the interleave).

    Raises:
        InfeasibleMixtureError: targets past the cap, a source with nothing kept.
        MixtureWindowError: a window past ``mixture.tolerance``.
    """
    mixture.validate(len(names))
    source = np.where(keep, sample_input, -1)
    names = list(names)
    measure = sample_measure(mixture.mix_by, real, supervised)

    def resolve(total_tokens: int | None) -> MixtureSelection:
        return resolve_mixture(
            real,
            supervised,
            source,
            mixture.weights,
            by=mixture.mix_by,
            names=names,
            max_repetitions=mixture.max_repetitions,
            total_tokens=total_tokens,
            seed=seed,
        )

    def plan(selection: MixtureSelection, max_packs: int | None = None, tolerance=None) -> MixturePlan:
        return plan_mixture(
            selection,
            aligned,
            measure,
            pack_size,
            window=mixture.window_packs,
            tolerance=tolerance,
            max_packs=max_packs,
            seed=seed,
            names=names,
        )

    def packs(selection: MixtureSelection) -> int:  # the deal into batches keeps the pack count
        return len(pack_mixture(selection, aligned, measure, pack_size, seed=seed))

    if mixture.total_packs is None:
        mixed = plan(resolve(mixture.total_tokens), tolerance=mixture.tolerance)
    else:
        selection = _selection_for_packs(mixture.total_packs, pack_size, resolve, packs, real)
        mixed = plan(selection, max_packs=mixture.total_packs, tolerance=mixture.tolerance)
    chosen = np.zeros(len(keep), dtype=bool)
    chosen[mixed.plan.order] = True
    report = _report(mixture, names, mixed, sample_input, keep, real, supervised)
    return MixtureRun(mixed.plan, chosen, report)


def _selection_for_packs(packs: int, pack_size: int, resolve, count, real: np.ndarray) -> MixtureSelection:
    """The selection whose plan fills ``packs`` packs (or the fewest past it, the plan then cut): a
    search over the mixture's total tokens, since how full packs are depends on the samples.

    The packs' tokens (every pack full; doubled while the quotas' rounding leaves a pack short) bound
    it from above unless the cap does; then the largest mixture the cap allows does, and fewer packs
    than asked is an error naming the most it fills.
    Between, the total is narrowed (interpolated between the totals that fill too few and enough
    packs, at most `PACK_SEARCH_ROUNDS` counts, ``count`` packing a selection as the plan does) until
    its packs are exactly ``packs`` or no total is left between the two: a count met exactly needs no
    cut, so every source keeps its whole passes first and its quota to half a sample.
    """
    high_tokens, largest = packs * pack_size, False
    while True:  # a total whose plan has the packs: full packs' tokens, doubled while rounding falls short
        try:
            high = resolve(high_tokens)
        except InfeasibleMixtureError:
            high, largest = resolve(None), True  # the largest mixture the cap allows
            high_tokens = int(real[high.samples].sum())
        high_packs = count(high)
        if high_packs >= packs or largest:
            break
        high_tokens *= 2
    if high_packs < packs:
        raise InfeasibleMixtureError(
            f"the largest mixture the repetition cap allows fills {high_packs:,} packs, fewer than the "
            f"{packs:,} asked for: set total_packs to at most {high_packs:,}, or raise max_repetitions",
            parameters=("total_packs", "max_repetitions"),
        )
    low_tokens, low_packs = 0, 0
    for _ in range(PACK_SEARCH_ROUNDS):
        if high_packs == packs or high_tokens - low_tokens <= 1:
            break
        guess = low_tokens + (high_tokens - low_tokens) * (packs - low_packs) // max(
            high_packs - low_packs, 1
        )
        middle = min(max(guess, low_tokens + 1), high_tokens - 1)
        if not low_tokens < middle < high_tokens:
            break
        try:
            selection = resolve(middle)
        except InfeasibleMixtureError:  # under the feasible high: a total too small for some source
            low_tokens, low_packs = middle, 0
            continue
        found = count(selection)
        if found >= packs:
            high, high_tokens, high_packs = selection, middle, found
        else:
            low_tokens, low_packs = middle, found
    return high


def _report(mixture, names, mixed, sample_input, keep, real, supervised) -> dict[str, Any]:
    """The manifest's ``mixture`` section: settings, per-source statistics, the worst global batch, and
    the shares of every batch in order (for the plot)."""
    count = len(names)
    order = mixed.plan.order
    packed = packed_figures(
        mixed.source,
        order,
        real[order],
        supervised[order],
        np.repeat(np.arange(len(mixed.plan)), mixed.plan.pack_sizes),
        len(mixed.plan),
        by=mixture.mix_by,
        targets=mixed.targets,
        window=mixture.window_packs,
    )
    kept = np.bincount(sample_input[keep], minlength=count)
    available = np.bincount(sample_input[keep], sample_measure(mixture.mix_by, real, supervised)[keep], count)
    times = repetitions(packed.measure, available)
    sources = []
    for s, name in enumerate(names):
        entry = {
            "name": name,
            "weight": mixture.weights[s],
            "target_share": float(mixed.targets[s]),
            "samples": int(kept[s]),
            "repetitions": float(times[s]),
            **packed.sources[s],
        }
        sources.append({key: entry[key] for key in _SOURCE_KEYS})
    return {
        "mix_by": mixture.mix_by,
        "max_repetitions": mixture.max_repetitions,
        "total_tokens": mixture.total_tokens,
        "total_packs": mixture.total_packs,
        "window_packs": mixture.window_packs,
        "tolerance_points": mixture.tolerance,
        "sources": sources,
        "windows": packed.windows,
        "window_shares": packed.window_shares,
    }


_SOURCE_KEYS = (
    "name",
    "weight",
    "target_share",
    "share",
    "token_share",
    "supervised_share",
    "samples",
    "samples_packed",
    "sequences",
    "tokens",
    "supervised_tokens",
    "repetitions",
    "worst_window_points",
)
"""The keys of a source of the manifest's ``mixture.sources`` that `_report` writes, in order (then
`count_mixture` adds the rows of every source)."""


def count_mixture(
    counts: dict[str, int],
    excluded: dict[str, Any],
    store,
    report,
    owners: list[int],
    run: MixtureRun,
    keep: np.ndarray,
    measures: dict[str, np.ndarray],
    aligned: np.ndarray,
) -> None:
    """The run's counts and excluded rows as the mixture packed them, and the rows of every source.

    ``packed`` counts the sequences written (a repeated sample once per repetition);
    ``mixture_left_out`` the kept samples the mixture's subsample left out (their source rows in
    ``excluded``), ``mixture_repeats`` the copies past the first; tokens and supervised tokens packed
    are the output's, and lost are those of the input that never reached it. Each source of
    ``run.report`` gains its rows, bad rows, truncated sequences packed (every copy) and dropped
    samples.
    """
    order, chosen = run.plan.order, run.chosen
    tokens, supervised = measures["tokens"], measures["supervised"]
    left_out = keep & ~chosen
    counts["packed"] = len(order)
    counts["mixture_left_out"] = int(left_out.sum())
    counts["mixture_repeats"] = len(order) - int(chosen.sum())
    counts["tokens_packed"] = int(tokens[order].sum())
    counts["tokens_lost"] = counts["tokens_in"] - int(tokens[chosen].sum())
    counts["supervised_packed"] = int(supervised[order].sum())
    counts["supervised_lost"] = counts["supervised_in"] - int(supervised[chosen].sum())
    counts["alignment_padding"] = int(aligned[order].sum()) - counts["tokens_packed"]
    excluded["mixture_left_out"] = store.source_rows(np.flatnonzero(left_out)).tolist()

    starts = list(report.source_starts)

    def input_of_row(rows) -> np.ndarray:
        return sample_sources(np.asarray(rows, dtype=np.int64), starts, owners)

    sources = run.report["sources"]
    count = len(sources)
    rows_per_source = np.diff(np.append(starts, report.rows_read))
    rows = np.bincount(owners, rows_per_source, minlength=count)
    bad = np.bincount(input_of_row([row.sample_index for row in report.bad_rows]), minlength=count)
    truncated_rows = np.asarray(excluded["truncated"], dtype=np.int64)
    truncated_samples = np.searchsorted(store.source_index, truncated_rows)
    copies = np.bincount(order, minlength=len(chosen))  # every copy of a truncated sample counts
    truncated = np.bincount(input_of_row(truncated_rows), copies[truncated_samples], minlength=count).astype(
        int
    )
    dropped_rows = np.concatenate(
        [np.asarray(excluded[reason], dtype=np.int64) for reason in ("dropped_long", "no_supervised")]
    )
    dropped = np.bincount(input_of_row(dropped_rows), minlength=count)
    for s, entry in enumerate(sources):
        entry.update(
            rows=int(rows[s]),
            bad_rows=int(bad[s]),
            truncated_packed=int(truncated[s]),
            dropped=int(dropped[s]),
        )
