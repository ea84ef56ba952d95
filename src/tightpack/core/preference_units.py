"""Preference pairs and groups as packing units: one prompt and its branches, kept whole.

A *unit* is a prompt and G >= 1 branches that continue it: a DPO-family pair (G = 2, branch 0
``chosen``, branch 1 ``rejected``), a KTO sample (G = 1, with its label) or a GRPO-style group of G
completions (with optional per-completion rewards or advantages). Units are packed whole: all
branches of a unit lie in one pack, next to each other.

Two layouts (`LAYOUTS`) put a unit into a row:

- ``pairs``: each branch is its own sequence ``prompt + branch``; plain block-diagonal attention.
- ``shared-prefix``: the prompt once, then its branches, each attending to the prompt and to itself.
  The shared part is the prompt less its last token, and every branch starts with that last token,
  so the position that predicts a branch's first token is the branch's own: every logit has one
  target, and labels stay one per token. A unit then takes ``P + B + G - 1`` tokens (``P`` prompt,
  ``B`` all branch tokens) instead of ``G * P + B``.

Everything here is numpy; `tightpack.runtime.preference_batch` builds the torch rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.pack_plan import PackPlan
from tightpack.core.planner import ALGORITHMS, plan_packs
from tightpack.core.unit_fill import plan_drained
from tightpack.errors import TightpackError, check_choice

__all__ = [
    "PreferenceUnits",
    "UnitFit",
    "fit_units",
    "plan_units",
    "sequence_plan",
    "unit_attention_costs",
    "unit_sizes",
]

Layout = Literal["pairs", "shared-prefix"]
LAYOUTS: tuple[str, ...] = get_args(Layout)


def concatenated_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices ``starts[i], ..., starts[i] + lengths[i] - 1`` of every range, one after another.

    >>> concatenated_ranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(starts - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


@dataclass(frozen=True)
class PreferenceUnits:
    """N units as CSR arrays: prompts, branches, and which branches belong to which unit.

    ``prompt_tokens`` holds the prompts back to back (``prompt_offsets``, ``[N + 1]``);
    ``branch_tokens`` and ``branch_loss_mask`` (unshifted, 1 = supervised; EOS included) the branches
    (``branch_offsets``, ``[NB + 1]``); unit ``u`` owns branches ``unit_offsets[u]:unit_offsets[u + 1]``
    in order (``chosen`` then ``rejected`` for pairs). Optional per-branch values: ``labels`` (KTO,
    bool), ``rewards`` and ``advantages`` (float32). ``source_index`` is each unit's input row.

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> len(units), units.prompt_lengths.tolist(), units.branch_lengths.tolist()
    (1, [3], [2, 1])
    """

    prompt_tokens: np.ndarray
    prompt_offsets: np.ndarray
    branch_tokens: np.ndarray
    branch_loss_mask: np.ndarray
    branch_offsets: np.ndarray
    unit_offsets: np.ndarray
    source_index: np.ndarray
    labels: np.ndarray | None = None
    rewards: np.ndarray | None = None
    advantages: np.ndarray | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_lists(
        cls,
        prompts: list[list[int]],
        branches: list[list[int]],
        branches_per_unit: list[int],
        *,
        loss_masks: list[list[int]] | None = None,
        source_index: list[int] | None = None,
        labels: list[bool] | None = None,
        rewards: list[float] | None = None,
        advantages: list[float] | None = None,
    ) -> PreferenceUnits:
        """Units from Python lists: one token list per prompt, one per branch (in unit order), the
        number of branches of each unit; loss masks default to every branch token supervised."""
        masks = loss_masks if loss_masks is not None else [[1] * len(branch) for branch in branches]
        branch_lengths = np.array([len(branch) for branch in branches], dtype=np.int64)
        return cls(
            prompt_tokens=np.array([t for p in prompts for t in p], dtype=np.int64),
            prompt_offsets=_offsets(np.array([len(p) for p in prompts], dtype=np.int64)),
            branch_tokens=np.array([t for b in branches for t in b], dtype=np.int64),
            branch_loss_mask=np.array([m for mask in masks for m in mask], dtype=np.int8),
            branch_offsets=_offsets(branch_lengths),
            unit_offsets=_offsets(np.asarray(branches_per_unit, dtype=np.int64)),
            source_index=np.arange(len(prompts)) if source_index is None else np.asarray(source_index),
            labels=None if labels is None else np.asarray(labels, dtype=bool),
            rewards=None if rewards is None else np.asarray(rewards, dtype=np.float32),
            advantages=None if advantages is None else np.asarray(advantages, dtype=np.float32),
        )

    @classmethod
    def concatenate(cls, parts: list[PreferenceUnits]) -> PreferenceUnits:
        """The units of ``parts``, one after another. A per-branch value (``labels``, ``rewards``,
        ``advantages``) must be set in all parts or in none.

        >>> a = PreferenceUnits.from_lists([[1]], [[2], [3]], [2], rewards=[1.0, 0.0])
        >>> b = PreferenceUnits.from_lists([[4, 5]], [[6], [7]], [2], source_index=[9], rewards=[0.5, 0.5])
        >>> both = PreferenceUnits.concatenate([a, b])
        >>> both.prompt_lengths.tolist(), both.source_index.tolist(), both.rewards.tolist()
        ([1, 2], [0, 9], [1.0, 0.0, 0.5, 0.5])
        """
        if not parts:
            raise ValueError("concatenate needs at least one part")
        if len(parts) == 1:
            return parts[0]

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(part, name) for part in parts])

        def offsets(name: str) -> np.ndarray:
            return _offsets(np.concatenate([np.diff(getattr(part, name)) for part in parts]))

        values: dict[str, np.ndarray] = {}
        for name in ("labels", "rewards", "advantages"):
            given = [getattr(part, name) for part in parts]
            if all(value is None for value in given):
                continue
            without = next((part for part, value in zip(parts, given, strict=True) if value is None), None)
            if without is not None:  # a loss weighted by them would be NaN for those units: refused
                row = int(without.source_index[0]) if len(without) else -1
                raise TightpackError(
                    f"{name} are given for some units and not for source row {row}: give {name} for every "
                    "unit or for none"
                )
            values[name] = np.concatenate(given)
        return cls(
            prompt_tokens=joined("prompt_tokens"),
            prompt_offsets=offsets("prompt_offsets"),
            branch_tokens=joined("branch_tokens"),
            branch_loss_mask=joined("branch_loss_mask"),
            branch_offsets=offsets("branch_offsets"),
            unit_offsets=offsets("unit_offsets"),
            source_index=joined("source_index"),
            **values,
        )

    def __len__(self) -> int:
        return len(self.prompt_offsets) - 1

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.diff(self.prompt_offsets)

    @property
    def branch_lengths(self) -> np.ndarray:
        return np.diff(self.branch_offsets)

    @property
    def branches_per_unit(self) -> np.ndarray:
        return np.diff(self.unit_offsets)

    @property
    def branch_unit(self) -> np.ndarray:
        """The unit of every branch, ``[NB]``."""
        return np.repeat(np.arange(len(self)), self.branches_per_unit)

    @property
    def branch_index(self) -> np.ndarray:
        """Every branch's place in its unit (0 = ``chosen`` of a pair), ``[NB]``."""
        counts = self.branches_per_unit
        return np.arange(int(counts.sum())) - np.repeat(self.unit_offsets[:-1], counts)

    def prompt(self, unit: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_offsets[unit] : self.prompt_offsets[unit + 1]]

    def branch(self, branch: int) -> np.ndarray:
        return self.branch_tokens[self.branch_offsets[branch] : self.branch_offsets[branch + 1]]

    def per_branch(self) -> dict[str, np.ndarray]:
        """The optional per-branch values that are set, by name (``labels``, ``rewards``, ``advantages``)."""
        values = {"labels": self.labels, "rewards": self.rewards, "advantages": self.advantages}
        return {name: value for name, value in values.items() if value is not None}

    def select(self, units: np.ndarray) -> PreferenceUnits:
        """The units ``units`` (indices, in that order), as a new `PreferenceUnits`."""
        units = np.asarray(units, dtype=np.int64)
        prompt_lengths = self.prompt_lengths[units]
        prompt_index = concatenated_ranges(self.prompt_offsets[units], prompt_lengths)
        counts = self.branches_per_unit[units]
        branches = concatenated_ranges(self.unit_offsets[units], counts)
        branch_lengths = self.branch_lengths[branches]
        token_index = concatenated_ranges(self.branch_offsets[branches], branch_lengths)
        return PreferenceUnits(
            prompt_tokens=self.prompt_tokens[prompt_index],
            prompt_offsets=_offsets(prompt_lengths),
            branch_tokens=self.branch_tokens[token_index],
            branch_loss_mask=self.branch_loss_mask[token_index],
            branch_offsets=_offsets(branch_lengths),
            unit_offsets=_offsets(counts),
            source_index=self.source_index[units],
            **{name: value[branches] for name, value in self.per_branch().items()},
        )

    def with_lengths(self, prompt_keep: np.ndarray, branch_keep: np.ndarray) -> PreferenceUnits:
        """Every prompt keeps its *last* ``prompt_keep[u]`` tokens and every branch its *first*
        ``branch_keep[b]`` tokens (the truncation of `fit_units`)."""
        prompt_keep = np.asarray(prompt_keep, dtype=np.int64)
        branch_keep = np.asarray(branch_keep, dtype=np.int64)
        prompt_index = concatenated_ranges(self.prompt_offsets[1:] - prompt_keep, prompt_keep)
        token_index = concatenated_ranges(self.branch_offsets[:-1], branch_keep)
        return dataclasses.replace(
            self,
            prompt_tokens=self.prompt_tokens[prompt_index],
            prompt_offsets=_offsets(prompt_keep),
            branch_tokens=self.branch_tokens[token_index],
            branch_loss_mask=self.branch_loss_mask[token_index],
            branch_offsets=_offsets(branch_keep),
        )


def _per_unit_sum(values: np.ndarray, unit_offsets: np.ndarray) -> np.ndarray:
    sums = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return sums[unit_offsets[1:]] - sums[unit_offsets[:-1]]


def unit_sizes(units: PreferenceUnits, layout: Layout, pad_to_multiple_of: int = 1) -> np.ndarray:
    """Tokens each unit takes in a row, ``[N]`` int64, alignment padding included: ``pairs`` aligns
    each sequence ``prompt + branch`` to the multiple, ``shared-prefix`` the unit as a whole.

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> unit_sizes(units, "pairs").tolist(), unit_sizes(units, "shared-prefix").tolist()
    ([9], [7])
    """
    check_choice("layout", layout, LAYOUTS)
    prompts = np.repeat(units.prompt_lengths, units.branches_per_unit)
    if layout == "pairs":
        sequences = ceil_to_multiple(prompts + units.branch_lengths, pad_to_multiple_of)
        return _per_unit_sum(sequences, units.unit_offsets)
    branches = _per_unit_sum(units.branch_lengths, units.unit_offsets)
    return ceil_to_multiple(units.prompt_lengths + branches + units.branches_per_unit - 1, pad_to_multiple_of)


def unit_attention_costs(units: PreferenceUnits, layout: Layout, pad_to_multiple_of: int = 1) -> np.ndarray:
    """Causal attention work of every unit in ``layout``, in the ``s**2`` units of
    `tightpack.core.stats.PackStats.attention_cost_mean` (a sequence of ``s`` tokens costs ``s**2``),
    int64 ``[N]``.

    ``pairs``: the sum over its sequences of their aligned length squared. ``shared-prefix``: a branch
    attends to the shared prompt and to itself, never to a sibling, so the unit costs its size
    squared less twice every pair of sibling branches: ``p**2 + sum(b**2 + 2 * p * b)`` with ``p`` the
    shared prompt (``P - 1``) and ``b`` each branch with its copy of the prompt's last token (the
    alignment tail counted in the last branch).

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> unit_attention_costs(units, "pairs").tolist(), unit_attention_costs(units, "shared-prefix").tolist()
    ([41], [37])
    """
    check_choice("layout", layout, LAYOUTS)
    prompts = np.repeat(units.prompt_lengths, units.branches_per_unit)
    if layout == "pairs":
        return _per_unit_sum(
            ceil_to_multiple(prompts + units.branch_lengths, pad_to_multiple_of) ** 2, units.unit_offsets
        )
    shared = units.prompt_lengths - 1
    branches = units.branch_lengths + 1
    last = units.unit_offsets[1:] - 1
    branches[last] += (
        unit_sizes(units, layout, pad_to_multiple_of) - shared - _per_unit_sum(branches, units.unit_offsets)
    )
    per_branch = branches**2 + 2 * np.repeat(shared, units.branches_per_unit) * branches
    return shared**2 + _per_unit_sum(per_branch, units.unit_offsets)


def sequence_plan(
    units: PreferenceUnits, plan: PackPlan, layout: Layout, pad_to_multiple_of: int = 1
) -> tuple[PackPlan, np.ndarray]:
    """``plan`` over the THD sequences of its units (a branch for ``pairs``, a unit for
    ``shared-prefix``) and their aligned lengths: what a reader of the rows sees (Megatron-Bridge's
    metadata counts sequences per pack).

    >>> units = PreferenceUnits.from_lists([[1, 2, 3], [4]], [[7, 8], [9], [5], [6]], [2, 2])
    >>> plan = plan_units(units, 20, "pairs")
    >>> sequences, lengths = sequence_plan(units, plan, "pairs")
    >>> [pack.tolist() for pack in sequences], lengths.tolist()
    ([[0, 1, 2, 3]], [5, 4, 2, 2])
    """
    if layout == "shared-prefix":
        return plan, unit_sizes(units, layout, pad_to_multiple_of)
    counts = units.branches_per_unit[plan.order]
    order = concatenated_ranges(units.unit_offsets[plan.order], counts)
    offsets = np.concatenate([[0], np.cumsum(counts)])[plan.offsets]
    prompts = np.repeat(units.prompt_lengths, units.branches_per_unit)
    return PackPlan(order, offsets), ceil_to_multiple(prompts + units.branch_lengths, pad_to_multiple_of)


@dataclass(frozen=True)
class UnitFit:
    """Units made to fit a cap (`fit_units`): what was kept and what each unit lost.

    ``units`` are the kept units, in input order; ``kept`` their indices in the input;
    ``prompt_trimmed`` and ``branches_cut`` count the kept units whose prompt lost tokens at its
    start, and whose branches lost tokens at their end; ``dropped`` maps each dropped unit's input
    index to its reason.
    """

    units: PreferenceUnits
    kept: np.ndarray
    prompt_trimmed: int = 0
    branches_cut: int = 0
    dropped: dict[int, str] = field(default_factory=dict)
    no_supervised: tuple[int, ...] = ()
    """The dropped units a cut would have left with a branch without a supervised token."""


def _size(prompt: int, branch_lengths: np.ndarray, layout: Layout, multiple: int) -> int:
    """`unit_sizes` of one unit of prompt length ``prompt`` and these branch lengths."""
    if layout == "pairs":
        return int(ceil_to_multiple(prompt + branch_lengths, multiple).sum())
    return int(ceil_to_multiple(prompt + int(branch_lengths.sum()) + len(branch_lengths) - 1, multiple))


def _fit_one(
    prompt: int, lengths: np.ndarray, cap: int, layout: Layout, multiple: int
) -> tuple[int, np.ndarray] | str:
    """The prompt length and branch lengths of one unit made to fit ``cap``, or why it cannot."""

    def fits(prompt: int, branch_lengths: np.ndarray) -> bool:
        return _size(prompt, branch_lengths, layout, multiple) <= cap

    least = _size(1, np.ones(len(lengths), dtype=np.int64), layout, multiple)
    if least > cap:
        return (
            f"its {len(lengths)} branches need at least {least} tokens in the {layout} layout (one "
            f"prompt token and one per branch), over the cap of {cap}"
        )
    prompt = _largest_fitting(1, prompt, lambda keep: fits(keep, lengths))
    if fits(prompt, lengths):
        return prompt, lengths
    level = _largest_fitting(1, int(lengths.max()), lambda level: fits(1, np.minimum(lengths, level)))
    return 1, np.minimum(lengths, level)


def _largest_fitting(low: int, high: int, fits) -> int:
    """The largest ``n`` in ``[low, high]`` with ``fits(n)``, for a ``fits`` true up to some point
    (``low`` when none is)."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def fit_units(units: PreferenceUnits, cap: int, layout: Layout, *, pad_to_multiple_of: int = 1) -> UnitFit:
    """Make every unit fit ``cap`` tokens (its `unit_sizes`), or drop it whole.

    Over the cap, the prompt (shared by every branch) is trimmed first, at its start, keeping its
    end (the question and the generation prompt) and at least one token; then the branches are cut
    at their end, the longest first, each keeping at least one token. A unit that cannot fit even
    then, or whose cut leaves a branch without a supervised token, is dropped, with its reason.

    >>> units = PreferenceUnits.from_lists([[1, 2, 3, 4, 5]], [[7, 8], [9]], [2])
    >>> fit = fit_units(units, 7, "pairs")
    >>> fit.units.prompt_lengths.tolist(), fit.units.branch_lengths.tolist(), fit.prompt_trimmed
    ([2], [2, 1], 1)
    """
    sizes = unit_sizes(units, layout, pad_to_multiple_of)
    over = np.flatnonzero(sizes > cap)
    if len(over) == 0:
        return UnitFit(units, np.arange(len(units)))
    prompt_keep = units.prompt_lengths.copy()
    branch_keep = units.branch_lengths.copy()
    dropped: dict[int, str] = {}
    lost: list[int] = []
    trimmed = cut = 0
    for unit in over.tolist():  # only the units over the cap: a few, not every unit
        branches = slice(units.unit_offsets[unit], units.unit_offsets[unit + 1])
        lengths = units.branch_lengths[branches]
        fitted = _fit_one(int(prompt_keep[unit]), lengths, cap, layout, pad_to_multiple_of)
        if isinstance(fitted, str):
            dropped[unit] = fitted
            continue
        prompt, kept = fitted
        starts = units.branch_offsets[branches.start : branches.stop]
        unsupervised = [
            b for b, (start, keep) in enumerate(zip(starts, kept, strict=True))
            if not units.branch_loss_mask[start : start + keep].any()
        ]  # fmt: skip
        if unsupervised:
            dropped[unit] = (
                f"cutting it to the cap of {cap} leaves branch {unsupervised[0]} without a supervised token"
            )
            lost.append(unit)
            continue
        trimmed += int(prompt < prompt_keep[unit])
        cut += int((kept < lengths).any())
        prompt_keep[unit] = prompt
        branch_keep[branches] = kept
    fitted = units.with_lengths(prompt_keep, branch_keep)
    kept = np.setdiff1d(np.arange(len(units)), np.fromiter(dropped, dtype=np.int64, count=len(dropped)))
    return UnitFit(fitted.select(kept), kept, trimmed, cut, dropped, tuple(lost))


def plan_units(
    units: PreferenceUnits,
    pack_size: int,
    layout: Layout,
    *,
    pad_to_multiple_of: int = 1,
    algorithm: str = "bfd_drain",
) -> PackPlan:
    """Pack whole units into packs of ``pack_size`` tokens: a planner over every unit's `unit_sizes`,
    so no unit is ever split. Fit them first (`fit_units`).

    ``algorithm`` is ``bfd_drain`` (`tightpack.core.unit_fill.plan_drained`: best-fit decreasing,
    then packs emptied into others by exact refills; never more packs than ``bfd``) or one of the
    planner's (`tightpack.core.planner.ALGORITHMS`).

    >>> units = PreferenceUnits.from_lists([[1, 2, 3], [4]], [[7, 8], [9], [5], [6]], [2, 2])
    >>> [pack.tolist() for pack in plan_units(units, 10, "pairs")]
    [[0], [1]]
    """
    sizes = unit_sizes(units, layout, pad_to_multiple_of)
    if algorithm == "bfd_drain":
        return plan_drained(sizes, pack_size)
    if algorithm not in ALGORITHMS:
        raise TightpackError(
            f"unknown packing algorithm {algorithm!r}; choose one of {sorted(['bfd_drain', *ALGORITHMS])}"
        )
    return plan_packs(sizes, pack_size, algorithm=algorithm)
