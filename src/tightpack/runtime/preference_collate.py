"""Collate raw preference, KTO or group rows into one packed preference row (collate-time packing).

`PreferenceCollator` tokenizes the rows of a micro-batch (`tightpack.prepare.preference_rows`), makes
every unit fit ``max_length`` (`tightpack.core.preference_units.fit_units`: the shared prompt trimmed
first, then the branch ends; a unit that cannot fit is left out whole) and lays them out in one
``[1, T]`` row (`tightpack.runtime.preference_batch.build_preference_row`). What it trimmed and left
out is counted, per batch and in total.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from tightpack.core.preference_units import LAYOUTS, Layout, fit_units
from tightpack.errors import TightpackError, check_choice
from tightpack.logs import logger
from tightpack.prepare.preference_rows import PreferenceEncoder, PreferenceKind
from tightpack.prepare.tokenize import BadRow
from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer
from tightpack.runtime.preference_batch import build_preference_row

__all__ = ["PreferenceCollator"]

COUNTS = ("units", "prompt_trimmed", "branches_cut", "dropped_too_long", "bad_rows")


class PreferenceCollator:
    """Collate raw rows into one packed preference row ``[1, T]``.

    Args:
        tokenizer: a `TokenizerSpec`, a tokenizer path, or None for the built-in GPT-2.
        kind: ``preference`` (prompt / chosen / rejected), ``kto`` or ``groups``.
        layout: ``pairs`` or ``shared-prefix`` (`tightpack.runtime.preference_batch`).
        max_length: tokens one unit may take in the row (its layout's size); None: no cap.
        pad_to_multiple_of: alignment of every sequence (tensor / context parallelism).
        skip_bad_rows: leave out a row that cannot become a unit (counted as ``bad_rows``, logged
            once per batch) instead of raising.
        template_vars: extra variables of the chat template.

    >>> collate = PreferenceCollator(kind="preference", layout="shared-prefix")
    >>> batch = collate([{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}])
    >>> batch["branch_index"].tolist(), batch["preference_layout"]
    ([0, 1], 'shared-prefix')
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec | str | None = None,
        *,
        kind: PreferenceKind = "preference",
        layout: Layout = "pairs",
        max_length: int | None = None,
        pad_to_multiple_of: int = 1,
        skip_bad_rows: bool = False,
        template_vars: dict[str, Any] | None = None,
        ignore_index: int = -100,
        pad_token_id: int | None = None,
    ) -> None:
        check_choice("layout", layout, LAYOUTS)
        if max_length is not None and max_length < 2:
            raise TightpackError(
                f"max_length must be at least 2 (a prompt token and a branch token), got {max_length}"
            )
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
        self.encoder = PreferenceEncoder(spec, kind, tuple(sorted((template_vars or {}).items())))
        self.layout = layout
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.skip_bad_rows = skip_bad_rows
        self.ignore_index = ignore_index
        self.pad_token_id = spec.eos_id if pad_token_id is None else pad_token_id
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self.last_batch_counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self.last_bad_rows: list[BadRow] = []

    def __call__(self, rows: Sequence[Any]) -> dict[str, Any]:
        encoded = self.encoder.encode_rows(list(rows), source="batch")
        counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self.last_bad_rows = encoded.bad_rows
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
            units = fit.units
            counts["prompt_trimmed"], counts["branches_cut"] = fit.prompt_trimmed, fit.branches_cut
            counts["dropped_too_long"] = len(fit.dropped)
        counts["units"] = len(units)
        self.last_batch_counts = counts
        self.counts.update(counts)
        if len(units) == 0:
            reasons = []
            if counts["bad_rows"]:
                reasons.append(f"{counts['bad_rows']} bad rows (last_bad_rows has their reasons)")
            if counts["dropped_too_long"]:
                reasons.append(f"{counts['dropped_too_long']} units over max_length={self.max_length}")
            why = ", ".join(reasons) or "no rows were given"
            raise TightpackError(f"no unit of the {len(rows)} rows is left to collate: {why}")
        return build_preference_row(
            units,
            self.layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=self.pad_token_id,
            ignore_index=self.ignore_index,
        )
