"""Mixtures of sources: what a weight means, and how many of each source's samples a mixture takes.

A mixture gives every source a weight; ``mix_by`` says what the weights count:

- ``tokens``: runtime tokens (what the model reads);
- ``supervised-tokens``: tokens with a loss (what the model learns from);
- ``samples``: samples, as Megatron's ``BlendedDataset`` and Energon's blends count them.

`resolve_mixture` turns the weights into per-source quotas of that measure and picks the samples
that meet them: a source is repeated whole (at most ``max_repetitions`` times, the last repetition
a subsample) or subsampled, deterministically by seed. Nothing is rescaled silently: targets a
source cannot reach under the cap are an `InfeasibleMixtureError` naming the achievable mixture and
the cap that would allow the asked one. The order of the chosen samples and their packs is
`tightpack.core.mixture_plan`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from tightpack.core.mixture_caps import closest_quotas, fits_cap, within_caps
from tightpack.errors import TightpackError

__all__ = [
    "MIX_BY",
    "InfeasibleMixtureError",
    "MixtureSelection",
    "resolve_mixture",
    "sample_measure",
]

MixBy = Literal["tokens", "supervised-tokens", "samples"]
MIX_BY: tuple[str, ...] = get_args(MixBy)
"""What a mixture weight counts: runtime tokens, supervised tokens, or samples."""

MAX_ENTRIES = 10**8
"""The most samples (repetitions counted) one mixture may hold: past it, a large repetition cap with no
total is an error before any memory is taken, not an allocation that fails."""

SKIPPED_SAMPLES = 64
"""Samples a last, partial pass leaves out at most because each would pass its quota by more than it
would miss it without (`_last_pass`)."""


class InfeasibleMixtureError(TightpackError):
    """Mixture targets that a source cannot reach under the repetition cap."""


def sample_measure(by: str, lengths: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """What each sample counts for under ``by`` (`MIX_BY`): its runtime tokens, its supervised
    tokens, or 1. ``lengths`` and ``supervised`` are ``[num_samples]`` integers.

    >>> sample_measure("supervised-tokens", np.array([10, 4]), np.array([3, 1])).tolist()
    [3, 1]
    >>> sample_measure("samples", np.array([10, 4]), np.array([3, 1])).tolist()
    [1, 1]
    """
    if by == "tokens":
        return np.asarray(lengths, dtype=np.int64)
    if by == "supervised-tokens":
        return np.asarray(supervised, dtype=np.int64)
    if by == "samples":
        return np.ones(len(lengths), dtype=np.int64)
    raise TightpackError(f"unknown mix_by {by!r}; choose one of {', '.join(MIX_BY)}", parameters=("mix_by",))


def check_weights(weights: Sequence[float], names: Sequence[str]) -> np.ndarray:
    """The weights as shares summing to 1; an error naming the source of a weight that is not a finite
    positive number, or when their count is not the sources'."""
    if len(weights) != len(names):
        raise TightpackError(
            f"{len(weights)} mixture weights for {len(names)} sources: give one weight per input",
            parameters=("weights",),
        )
    for weight, name in zip(weights, names, strict=True):
        number = isinstance(weight, (int, float, np.integer, np.floating)) and not isinstance(weight, bool)
        if not (number and math.isfinite(weight) and weight > 0):
            raise TightpackError(
                f"mixture weight {weight!r} of {name} must be a positive number (leave the input out "
                "instead of giving it weight 0)",
                parameters=("weights",),
            )
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.max()  # 1e308 and 1e308 are 1 and 1: the sum cannot overflow
    return shares / shares.sum()


@dataclass(frozen=True)
class MixtureSelection:
    """The samples a mixture takes, and what it counts.

    Attributes:
        samples: int64 ``[num_entries]``: the chosen samples (indices into the caller's arrays), a
            repeated sample once per repetition, grouped by source.
        source: int64 ``[num_entries]``: the source of each entry.
        repetition: int64 ``[num_entries]``: which repetition of its sample each entry is (0: the
            first); a source's entries are listed one repetition after the other.
        targets: float64 ``[num_sources]``: the target shares (the weights normalised).
        quotas: float64 ``[num_sources]``: the measure each source was asked for.
        available: int64 ``[num_sources]``: the measure each source holds (every sample once).
        chosen: int64 ``[num_sources]``: the measure of the chosen entries.
        repetitions: float64 ``[num_sources]``: chosen over available (2.5: every sample twice, half
            of them a third time; 0.3: a 30% subsample).
    """

    samples: np.ndarray
    source: np.ndarray
    repetition: np.ndarray
    targets: np.ndarray
    quotas: np.ndarray
    available: np.ndarray
    chosen: np.ndarray
    repetitions: np.ndarray

    @property
    def shares(self) -> np.ndarray:
        """The achieved share of every source (of the chosen measure)."""
        return self.chosen / max(int(self.chosen.sum()), 1)


def resolve_mixture(
    lengths: np.ndarray,
    supervised: np.ndarray,
    source: np.ndarray,
    weights: Sequence[float],
    *,
    by: str = "tokens",
    names: Sequence[str] | None = None,
    max_repetitions: float = 1.0,
    total_tokens: int | None = None,
    seed: int = 0,
) -> MixtureSelection:
    """The samples a mixture takes: every source's share of the ``by`` measure is its weight's.

    Args:
        lengths: int ``[num_samples]``: runtime tokens per sample.
        supervised: int ``[num_samples]``: supervised tokens per sample.
        source: int ``[num_samples]``: the source of each sample, ``0 .. len(weights) - 1``, or -1 for
            a sample that is not packed (it is never chosen).
        weights: one positive weight per source (normalised to shares).
        by: what the weights count (`MIX_BY`).
        names: the sources' names for messages (default ``source 0``, ...).
        max_repetitions: R: a source is taken at most R times over (R >= 1 repeats, the fraction a
            seeded subsample); a source larger than its share is subsampled.
        total_tokens: the mixture's runtime tokens (about: to the nearest sample per source). None:
            the largest mixture the cap allows (its tightest source taken R times).
        seed: seeds the subsamples (one generator per source: a source's draw does not depend on the
            others).

    Every source's chosen measure is within half its largest sample of its quota (and is not zero).

    Raises:
        InfeasibleMixtureError: a source holds nothing of the measure, a quota rounds to no sample, or
            ``total_tokens`` needs a source more than R times over; the message gives the largest
            total R allows these weights, the R the asked mixture needs, and the closest mixture
            (of the measure) that reaches ``total_tokens`` at R, or, when even every source at R holds
            fewer runtime tokens, that no mixture of that total exists and what the inputs hold.

    >>> lengths, supervised = np.array([10, 10, 10, 40]), np.array([5, 5, 5, 20])
    >>> chosen = resolve_mixture(lengths, supervised, np.array([0, 0, 0, 1]), [1, 1], by="tokens")
    >>> chosen.samples.tolist(), chosen.shares.tolist()
    ([0, 1, 2, 3], [0.4285..., 0.5714...])
    """
    source = np.asarray(source, dtype=np.int64)
    names = list(names) if names is not None else [f"source {s}" for s in range(len(weights))]
    targets = check_weights(weights, names)
    if max_repetitions < 1 or not math.isfinite(max_repetitions):
        raise TightpackError(
            f"max_repetitions must be a number >= 1, got {max_repetitions!r}", parameters=("max_repetitions",)
        )
    count = len(targets)
    if len(source) and (source.max() >= count or source.min() < -1):
        raise TightpackError(f"source ids must be -1 or 0..{count - 1}")  # a caller's bug, named
    measure = sample_measure(by, lengths, supervised)
    used = source >= 0
    available = np.bincount(source[used], measure[used], minlength=count).astype(np.int64)
    tokens = np.bincount(source[used], np.asarray(lengths)[used], minlength=count)
    empty = np.flatnonzero(available == 0)
    if len(empty):
        raise InfeasibleMixtureError(
            f"{names[empty[0]]} has no {_unit(by)} to mix (every sample of it was dropped or skipped as a "
            "bad row, or it has none): remove it from the mixture",
            parameters=("weights",),
        )
    largest = float((max_repetitions * available / targets).min())  # total measure the cap allows
    tokens_per_unit = tokens / available  # runtime tokens per unit of the measure, by source
    if total_tokens is None:
        total = largest
    else:
        total = total_tokens / float((targets * tokens_per_unit).sum())
        if not fits_cap(targets, available, tokens_per_unit, max_repetitions, total_tokens):
            raise InfeasibleMixtureError(
                _infeasible(total_tokens, targets, available, tokens, names, by, max_repetitions),
                parameters=("max_repetitions", "total_tokens", "weights"),
            )
    quotas = targets * total
    entries = float((quotas / available * np.bincount(source[used], minlength=count)).sum())
    if entries > MAX_ENTRIES:
        raise InfeasibleMixtureError(
            f"the mixture would hold about {entries:,.0f} samples (the largest at the repetition cap of "
            f"{max_repetitions:g}), over the {MAX_ENTRIES:,} one run can plan: ask for a total "
            "(total_tokens or total_packs) or a lower max_repetitions",
            parameters=("max_repetitions", "total_tokens"),
        )
    rng_seeds = np.random.SeedSequence(seed).spawn(count)
    parts, passes, chosen, firsts = [], [], np.zeros(count, np.int64), np.zeros(count, np.int64)
    for s in range(count):
        members = np.flatnonzero(source == s)
        ratio = quotas[s] / available[s]
        whole = math.floor(ratio + 1e-9)  # the tightest source at the cap: exactly R copies
        rest = quotas[s] - whole * available[s]
        order = np.random.default_rng(rng_seeds[s]).permutation(members)
        room = (max_repetitions - whole) * available[s] * (1 + 1e-12)  # the cap, never passed by rounding
        last = _last_pass(order, measure[order], rest, room)
        part = np.concatenate([np.tile(members, whole), last])
        parts.append(part)
        passes.append(np.repeat(np.arange(whole + 1), [len(members)] * whole + [len(last)]))
        chosen[s] = int(measure[part].sum())
        firsts[s] = int(measure[order[np.argmax(measure[order] > 0)]]) if len(order) else 0
    if (chosen == 0).any():
        none = int(np.argmax(chosen == 0))
        raise InfeasibleMixtureError(
            _takes_nothing(
                names[none],
                float(quotas[none]),
                int(firsts[none]),
                int(measure[(source == none) & (measure > 0)].min()),
                by,
                total_tokens is not None,
                max_repetitions,
            ),
            parameters=("total_tokens", "weights", "seed", "max_repetitions"),
        )
    samples = np.concatenate(parts)
    return MixtureSelection(
        samples=samples.astype(np.int64, copy=False),
        source=np.repeat(np.arange(count), [len(p) for p in parts]),
        repetition=np.concatenate(passes).astype(np.int64) if passes else np.zeros(0, np.int64),
        targets=targets,
        quotas=quotas,
        available=available,
        chosen=chosen,
        repetitions=chosen / available,
    )


def _last_pass(order: np.ndarray, measure: np.ndarray, quota: float, room: float) -> np.ndarray:
    """The samples of a source's last, partial pass: ``order`` (seeded) taken in turn while the sum
    of ``measure`` stays under ``quota``; a sample that would pass it is taken when that ends nearer
    the quota than leaving it out (and keeps the sum within ``room``, the cap), else left out and the
    samples after it fill on (at most `SKIPPED_SAMPLES` left out): one large sample at the cut costs
    the mixture its share only when no smaller sample after it fits.

    >>> _last_pass(np.arange(5), np.array([3.0, 9.0, 2.0, 1.0, 4.0]), 6.0, 100.0).tolist()
    [0, 2, 3]
    """
    reached = np.cumsum(measure)
    taken: list[np.ndarray] = []
    start, total = 0, 0.0
    for _ in range(SKIPPED_SAMPLES + 1):
        before = reached[start - 1] if start else 0.0
        stop = int(np.searchsorted(reached, before + quota - total, side="right"))  # fits under the quota
        taken.append(order[start:stop])
        total += (reached[stop - 1] if stop > start else before) - before
        if stop == len(order) or total >= quota:
            break
        over = total + measure[stop] - quota  # the next sample passes the quota by this much
        if over < quota - total and total + measure[stop] <= room:
            taken.append(order[stop : stop + 1])
            break
        start = stop + 1
    return np.concatenate(taken) if taken else order[:0]


def _takes_nothing(
    name: str, quota: float, first: int, smallest: int, by: str, has_total: bool, cap: float = 1.0
) -> str:
    """The message of a source whose quota takes no sample. Its subsample takes a seeded order in turn
    (`_last_pass`): the quota is under half of each sample it tried, ``first`` the first of them (with
    some measure), which the seed picks; under half of its ``smallest`` sample too, no seed takes one.
    Without a total, the largest mixture grows with the repetition cap ``cap``: where a cap up to 100
    times larger would give the source a sample, the message names it.

    >>> _takes_nothing("a.jsonl", 2.0, 6, 6, "tokens", False, 1.0).split(": ")[-1]
    'max_repetitions 2 or more'
    """
    unit = _unit(by)
    text = f"the mixture takes nothing of {name}: its quota of {quota:.1f} {unit} is under half of "
    if 2 * quota <= smallest:
        text += f"its smallest sample ({smallest:,} {unit}), whatever the seed; "
        if not has_total:
            needed = cap * smallest / (2 * quota) if quota > 0 else math.inf  # quotas grow with the cap
            if needed <= 100 * cap:
                larger = math.floor(needed) + 1
                return (
                    text + "its weight is too small for any sample of the largest mixture the cap allows: "
                    f"give it a larger weight, or a larger mixture: max_repetitions {larger:g} or more"
                )
            return text + "its weight is too small for any sample: give it a larger weight"
    else:
        text += (
            f"each sample its seeded subsample tried (the first holds {first:,} {unit}; its smallest "
            f"holds {smallest:,}): another seed may try a smaller one, or "
        )
    if has_total:
        return text + "ask for a larger mixture in total_tokens, or give it a larger weight"
    return text + "give it a larger weight"


def _unit(by: str) -> str:
    return {"tokens": "tokens", "supervised-tokens": "supervised tokens", "samples": "samples"}[by]


def _infeasible(
    total_tokens: int,
    targets: np.ndarray,
    available: np.ndarray,
    tokens: np.ndarray,
    names: Sequence[str],
    by: str,
    cap: float,
) -> str:
    """The message of a total past the cap: the tightest source and what it needs, then the ways out:
    the largest total the cap allows these shares (floored: asking for it is accepted), the cap the
    asked mixture needs, and the mixture nearest the shares that reaches the total at the cap (given
    as weights with the same total and cap, it is accepted), or, where no shares reach the total,
    the runtime tokens the inputs hold at the cap (``tokens``: each source's, every sample once)."""
    tokens_per_unit = tokens / available
    per_unit = float((targets * tokens_per_unit).sum())  # runtime tokens per unit of the measure
    needed = targets * (total_tokens / per_unit) / available
    tight = int(np.argmax(needed))
    largest_tokens = math.floor(float((cap * available / targets).min()) * per_unit * (1 + 1e-10))
    allow = math.ceil(needed[tight] * 100 * (1 - 1e-12)) / 100  # at least the need: it is accepted
    quotas = closest_quotas(targets, cap * available, tokens_per_unit, total_tokens)
    just_past = round(float(needed[tight]), 2) <= cap  # "2.00 times over" is not past a cap of 2
    closest = None  # just past the cap, the closest mixture is all but the asked one: the total is the fix
    if quotas is not None and not just_past:
        capped = quotas >= cap * available * (1 - 1e-9)
        closest = _printed_shares(
            quotas, capped, targets, available, tokens_per_unit, cap, total_tokens, names
        )
    times = f"a little more than {cap:g}" if just_past else f"{needed[tight]:.2f}"
    head = (
        f"the mixture of {total_tokens:,} tokens needs {names[tight]} {times} times over (its "
        f"{int(available[tight]):,} {_unit(by)} for a {targets[tight]:.1%} share), "
        f"{'just past' if just_past else 'past'} the repetition cap of {cap:g}"
    )
    if quotas is None:  # every source at its cap holds less: no shares reach the total
        held = math.floor(cap * int(tokens.sum()))
        return (
            f"{head}; no mixture of {total_tokens:,} tokens exists at this cap (the inputs hold {held:,} "
            f"tokens at the cap). Ask for a total of at most {held:,} tokens in total_tokens (at most "
            f"about {largest_tokens:,} tokens with these weights), or allow this one with max_repetitions "
            f"{allow:g}"
        )
    text = (
        f"{head}. The largest mixture at the cap is about {largest_tokens:,} tokens (ask for at most that "
        f"in total_tokens), or allow this one with max_repetitions {allow:g}"
    )
    if closest is not None:
        text += (
            f"; at the cap, the closest mixture of {total_tokens:,} tokens is "
            + ", ".join(f"{name} {share}" for name, share in zip(names, closest, strict=True))
            + f" of the {_unit(by)} (give these as weights)"
        )
    return text


def _printed_shares(
    quotas: np.ndarray,
    capped: np.ndarray,
    targets: np.ndarray,
    available: np.ndarray,
    tokens_per_unit: np.ndarray,
    cap: float,
    total_tokens: int,
    names: Sequence[str],
) -> list[str] | None:
    """The shares of ``quotas`` as percentages that, given as weights with ``total_tokens`` at
    ``cap``, pass `fits_cap` and do not print as ``targets`` (the asked mixture): the ``capped`` sources'
    rounded down, the others' rounded so that they sum to 100; where that takes a source past its cap
    (a capped source rounded down less than the others lowers the runtime tokens per unit, and so
    raises every quota), a unit of the last decimal moves from the source furthest past its cap to
    the one that can take it with the most runtime tokens per unit. To 0.1%, or to as many more
    decimals (up to 6) as that needs for every share to be within 0.1 of a point of its quota's and
    none to be 0. None where none of these does."""
    shares = quotas / quotas.sum()
    free = np.flatnonzero(~capped)
    limits = cap * available.astype(np.float64)  # the measure each source holds at the cap
    for decimals in range(1, 7):
        scaled = shares * 10 ** (decimals + 2)
        counts = np.floor(scaled + np.where(capped, 0, 1e-9)).astype(np.int64)
        rest = 10 ** (decimals + 2) - int(counts.sum())
        if rest > 0 and not len(free):
            return None
        by_remainder = free[np.argsort(-(scaled - counts)[free], kind="stable")]
        for step in range(rest):  # the rest to the sources below their cap, largest remainder first
            counts[by_remainder[step % len(by_remainder)]] += 1
        counts = within_caps(counts, limits, tokens_per_unit, total_tokens)
        if counts is None or np.abs(counts - scaled).max() > 10 ** (decimals - 1):  # 0.1 of a point
            continue
        weights = counts / 10**decimals  # what the user gives back: 52.4 for 52.4%
        printed = [f"{weight:.{decimals}f}%" for weight in weights]
        if printed == [f"{100 * target:.{decimals}f}%" for target in targets]:
            continue
        if fits_cap(check_weights(weights.tolist(), names), available, tokens_per_unit, cap, total_tokens):
            return printed
    return None
