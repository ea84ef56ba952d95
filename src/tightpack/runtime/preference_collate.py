"""Collate raw preference, KTO or group rows into packed preference rows (collate-time packing).

`PreferenceCollator` tokenizes the rows of a micro-batch (`tightpack.prepare.preference_rows`), makes
every unit fit ``max_length`` (`tightpack.core.preference_units.fit_units`: the shared prompt trimmed
first, then the branch ends; a unit that cannot fit is left out whole, with its reason) and lays them
out in one ``[1, T]`` row (`tightpack.runtime.preference_batch.build_preference_row`), or, under a
token budget (``max_tokens``), in as many rows of at most ``max_tokens`` tokens as the units need,
each unit whole in one row. What it trimmed and left out is counted, per batch and in total.

As for SFT rows (`tightpack.runtime.samplers.TokenBudgetBatchSampler`), the micro-batches themselves
can be planned on a token budget: `PreferenceCollator.encode` tokenizes and fits a dataset's rows
once, `PreferenceCollator.unit_sizes` gives the sampler their sizes, and
`PreferenceCollator.collate_units` collates the units of each micro-batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tightpack.core.preference_units import (
    LAYOUTS,
    Layout,
    PreferenceUnits,
    fit_units,
    plan_units,
    unit_sizes,
)
from tightpack.errors import TightpackError, check_choice
from tightpack.logs import logger
from tightpack.prepare.preference_rows import PreferenceEncoder, PreferenceKind
from tightpack.prepare.tokenize import BadRow
from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer
from tightpack.runtime.preference_batch import build_preference_row

__all__ = ["DroppedUnit", "PreferenceCollator"]

COUNTS = ("units", "prompt_trimmed", "branches_cut", "dropped_too_long", "no_supervised", "bad_rows")


@dataclass(frozen=True)
class DroppedUnit:
    """A unit left out because it could not fit ``max_length``: its ``row`` (the position of its row
    among the rows given) and the ``reason``."""

    row: int
    reason: str


class PreferenceCollator:
    """Collate raw rows into one packed preference row ``[1, T]``, or, with ``max_tokens``, into a list
    of such rows of at most ``max_tokens`` tokens each.

    Args:
        tokenizer: a `TokenizerSpec`, a tokenizer path, or None for the built-in GPT-2.
        kind: ``preference`` (prompt / chosen / rejected), ``kto`` or ``groups``.
        layout: ``pairs`` or ``shared-prefix`` (`tightpack.runtime.preference_batch`).
        max_length: tokens one unit may take in a row (its layout's size, alignment included); None:
            ``max_tokens``, or no cap without it.
        max_tokens: tokens per row: the micro-batch's units are planned whole into as many rows as
            they need (`tightpack.core.preference_units.plan_units`, best-fit decreasing), each unit
            in one row, and the call returns the list of rows; None: one row of the whole micro-batch.
        pad_to_multiple_of: alignment of every sequence (tensor / context parallelism).
        skip_bad_rows: leave out a row that cannot become a unit (counted as ``bad_rows``, logged,
            its reason in ``last_bad_rows``) instead of raising.
        template_vars: extra variables of the chat template.

    Counts (``last_batch_counts`` for the last call, ``counts`` in total): ``units`` collated,
    ``prompt_trimmed`` and ``branches_cut`` (units fitted to ``max_length``), ``dropped_too_long``
    (units that cannot fit it even trimmed), ``no_supervised`` (units whose cut would leave a branch
    without a supervised token), ``bad_rows``. ``last_dropped`` holds every left-out unit of the last
    call as a `DroppedUnit`, and each is logged.

    Raises:
        TightpackError: a bad row without ``skip_bad_rows``; a micro-batch left with no unit, saying why.

    >>> collate = PreferenceCollator(kind="preference", layout="shared-prefix")
    >>> batch = collate([{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}])
    >>> batch["branch_index"].tolist(), batch["preference_layout"]
    ([0, 1], 'shared-prefix')
    >>> budget = PreferenceCollator(layout="pairs", max_tokens=20)
    >>> rows = budget([{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}] * 3)  # 12 tokens a pair
    >>> [row["branch_unit"].tolist() for row in rows]
    [[0, 0], [0, 0], [0, 0]]
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec | str | None = None,
        *,
        kind: PreferenceKind = "preference",
        layout: Layout = "pairs",
        max_length: int | None = None,
        max_tokens: int | None = None,
        pad_to_multiple_of: int = 1,
        skip_bad_rows: bool = False,
        template_vars: dict[str, Any] | None = None,
        ignore_index: int = -100,
        pad_token_id: int | None = None,
    ) -> None:
        check_choice("layout", layout, LAYOUTS)
        for name, value in (("max_length", max_length), ("max_tokens", max_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise TightpackError(
                    f"{name} must be an integer of at least 2 (a prompt token and a branch token), "
                    f"got {value!r}"
                )
        if max_tokens is not None and max_length is not None and max_length > max_tokens:
            raise TightpackError(
                f"max_length ({max_length}) is above max_tokens ({max_tokens}): a unit of max_length tokens "
                "could not fit a row; lower max_length, or leave it None to cap every unit at max_tokens"
            )
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
        self.encoder = PreferenceEncoder(spec, kind, tuple(sorted((template_vars or {}).items())))
        self.layout = layout
        self.max_length = max_tokens if max_length is None else max_length
        self.max_tokens = max_tokens
        self.pad_to_multiple_of = pad_to_multiple_of
        self.skip_bad_rows = skip_bad_rows
        self.ignore_index = ignore_index
        self.pad_token_id = spec.eos_id if pad_token_id is None else pad_token_id
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self.last_batch_counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self.last_bad_rows: list[BadRow] = []
        self.last_dropped: list[DroppedUnit] = []

    def __call__(self, rows: Sequence[Any]) -> dict[str, Any] | list[dict[str, Any]]:
        return self.collate_units(self.encode(rows))

    def encode(self, rows: Sequence[Any]) -> PreferenceUnits:
        """The units of ``rows``, tokenized and fitted to ``max_length`` (counted as a batch: the
        counts, ``last_bad_rows`` and ``last_dropped`` are this call's); ``source_index`` is each
        unit's position in ``rows``.

        Raises:
            TightpackError: a bad row without ``skip_bad_rows``; no unit left, saying why.
        """
        encoded = self.encoder.encode_rows(list(rows), source="batch")
        counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self.last_bad_rows, self.last_dropped = encoded.bad_rows, []
        if encoded.bad_rows:
            first = encoded.bad_rows[0]
            if not self.skip_bad_rows:
                raise TightpackError(
                    f"{first.location}: {first.reason} (fix the row, or pass skip_bad_rows=True)"
                )
            for bad in encoded.bad_rows:
                logger().warning("left out a bad row: %s: %s", bad.location, bad.reason)
            counts["bad_rows"] = len(encoded.bad_rows)
        units = encoded.units
        if self.max_length is not None and len(units):
            fit = fit_units(units, self.max_length, self.layout, pad_to_multiple_of=self.pad_to_multiple_of)
            counts["prompt_trimmed"], counts["branches_cut"] = fit.prompt_trimmed, fit.branches_cut
            counts["no_supervised"] = len(fit.no_supervised)
            counts["dropped_too_long"] = len(fit.dropped) - len(fit.no_supervised)
            self.last_dropped = [
                DroppedUnit(int(units.source_index[unit]), reason)
                for unit, reason in sorted(fit.dropped.items())
            ]
            for dropped in self.last_dropped:
                logger().warning(
                    "left out the unit of batch row %d (max_length=%d): %s",
                    dropped.row, self.max_length, dropped.reason,
                )  # fmt: skip
            units = fit.units
        counts["units"] = len(units)
        self.last_batch_counts = counts
        self.counts.update(counts)
        if len(units) == 0:
            raise TightpackError(
                f"no unit of the {len(rows)} rows is left to collate: {self._why_empty(counts)}"
            )
        return units

    def _why_empty(self, counts: Counter[str]) -> str:
        reasons = []
        if counts["bad_rows"]:
            reasons.append(f"{counts['bad_rows']} bad rows (last_bad_rows has their reasons)")
        if counts["dropped_too_long"]:
            reasons.append(f"{counts['dropped_too_long']} units over max_length={self.max_length}")
        if counts["no_supervised"]:
            reasons.append(
                f"{counts['no_supervised']} units that max_length={self.max_length} would leave with a "
                "branch without a supervised token"
            )
        return ", ".join(reasons) or "no rows were given"

    def unit_sizes(self, units: PreferenceUnits) -> np.ndarray:
        """Tokens each unit takes in a row of this collator (layout and alignment), int64 ``[N]``: the
        lengths `tightpack.runtime.samplers.TokenBudgetBatchSampler` plans micro-batches with."""
        return unit_sizes(units, self.layout, self.pad_to_multiple_of)

    def collate_units(self, units: PreferenceUnits) -> dict[str, Any] | list[dict[str, Any]]:
        """The row of ``units`` (already fitted: `encode`), or with ``max_tokens`` the list of rows.

        Raises:
            TightpackError: with ``max_tokens``, a unit larger than it (encode the rows with this
                collator, which fits them).
        """
        if len(units) == 0:
            raise TightpackError("collate_units needs at least one unit")
        if self.max_tokens is None:
            return self._row(units)
        sizes = self.unit_sizes(units)
        over = np.flatnonzero(sizes > self.max_tokens)
        if len(over):
            unit = int(over[0])
            raise TightpackError(
                f"unit {unit} takes {int(sizes[unit])} tokens in the {self.layout} layout, above "
                f"max_tokens={self.max_tokens}; fit the units first (PreferenceCollator.encode, which caps "
                "them at max_length)"
            )
        plan = plan_units(units, self.max_tokens, self.layout, pad_to_multiple_of=self.pad_to_multiple_of)
        rows = sorted((np.sort(plan[pack]) for pack in range(len(plan))), key=lambda members: members[0])
        return [self._row(units.select(members)) for members in rows]

    def _row(self, units: PreferenceUnits) -> dict[str, Any]:
        return build_preference_row(
            units,
            self.layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=self.pad_token_id,
            ignore_index=self.ignore_index,
        )
