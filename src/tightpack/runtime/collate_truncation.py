"""Long samples at collate time: the offline path's rules on one batch of rows, and their counts.

The collators that tokenize raw rows (`tightpack.runtime.sft_collate.TextSFTCollator`,
`tightpack.runtime.hf_trainer.PackingCollator`, `tightpack.runtime.vision_packs.VisionSFTCollator`)
hand each batch's encoded rows (`tightpack.prepare.tokenize.ChunkResult`, with the segments the
formatter marked) to `LongSampleRules.fit`, which applies what ``tightpack pack`` applies:

- a sample over ``max_length`` is cut by `tightpack.core.truncation.plan_truncation` (drop the
  oldest rounds, trim the prompt, then cut the answer; ``FormatConfig.truncation_method`` and
  ``chat_truncation`` as on the command line) under ``long_samples="truncate"``, left out under
  ``"drop"``, or stops the run under ``"error"``; a sample with images or videos is never cut (a cut
  could split an image's tokens): it is left out, as offline;
- a sample with no supervised token (from the source, or after its cut) is left out of the batch;
- a batch left with no sample raises `TightpackError`: a step on it would train on nothing (loss 0).

Every batch's counts are in ``last`` and their running totals in ``totals`` (`LongSampleCounts`);
the first batch that cuts or leaves out a sample logs one warning.
"""

from __future__ import annotations

from typing import get_args

import numpy as np

from tightpack.core.long_samples import kept_positions
from tightpack.core.token_store import Segments
from tightpack.core.truncation import REASONS, TruncationMethod, plan_truncation
from tightpack.errors import TightpackError, check_choice
from tightpack.logs import logger
from tightpack.prepare.tokenize import ChunkResult
from tightpack.prepare.vision_rows import parse_media_json
from tightpack.runtime.online_config import LongSamples

COUNT_NAMES = (
    "samples",
    "fed",
    "truncated",
    *REASONS,
    "dropped_long",
    "no_supervised",
    "no_supervised_after_truncation",
    "supervision_cut",
    "supervised_in",
    "supervised_fed",
    "supervised_lost",
    "tokens_in",
    "tokens_fed",
)
"""The counts, in order. ``samples`` received, ``fed`` to the model; ``truncated`` samples fed after
a cut, by reason (`tightpack.core.truncation.REASONS`, as the manifest's ``truncated_<reason>``);
``dropped_long`` left out for length; ``no_supervised`` left out with no supervised token, of them
``no_supervised_after_truncation`` because of their cut; ``supervision_cut`` cut samples that lost
supervised tokens (fed or not); label-aligned supervised tokens and row tokens in and fed."""

LOGGED_COUNTS = (*REASONS, "dropped_long", "no_supervised", "supervised_lost")
"""The totals `tightpack.runtime.hf_trainer.PackingCallback` adds to the Trainer's logs."""


class LongSampleCounts:
    """Counts of `COUNT_NAMES` (all 0 at first), readable by name.

    >>> counts = LongSampleCounts(samples=2, prompt_trimmed=1)
    >>> counts["prompt_trimmed"], counts["answer_cut"]
    (1, 0)
    """

    def __init__(self, **values: int) -> None:
        unknown = set(values) - set(COUNT_NAMES)
        if unknown:
            raise TypeError(f"unknown counts {sorted(unknown)}; the counts are {', '.join(COUNT_NAMES)}")
        self._values = dict.fromkeys(COUNT_NAMES, 0) | values

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def add(self, other: LongSampleCounts) -> None:
        """Add ``other``'s counts to these."""
        for name in COUNT_NAMES:
            self._values[name] += other[name]

    def as_dict(self) -> dict[str, int]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LongSampleCounts) and self._values == other._values

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value}" for name, value in self._values.items() if value)
        return f"LongSampleCounts({shown})"


class LongSampleRules:
    """The long-sample and no-supervision rules of one collator, and its counts.

    Args:
        max_length: tokens a sample may take in the batch row (None: no cap).
        long_samples: ``truncate``, ``drop`` or ``error``, as ``tightpack pack --long-samples``.
        method: ``right`` or ``left`` (``FormatConfig.truncation_method``).
        owner: the collator's name, for messages.
        stored_extra: stored tokens of a sample beyond its row tokens: 0 when the sample's final EOS
            is an input of the row (`TextSFTCollator`), 1 when it is a target only (offline packs'
            layout, `VisionSFTCollator`). A sample keeps at most ``max_length + stored_extra`` stored
            tokens, so ``stored_extra=1`` equals ``tightpack pack --max-seq-length max_length``.
    """

    def __init__(
        self,
        max_length: int | None,
        long_samples: LongSamples,
        method: TruncationMethod,
        *,
        owner: str,
        stored_extra: int,
    ) -> None:
        check_choice(f"{owner} long_samples", long_samples, get_args(LongSamples))
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int | np.integer) or max_length < 1
        ):
            raise TightpackError(f"{owner} max_length must be a positive integer, got {max_length!r}")
        max_length = None if max_length is None else int(max_length)
        self.max_length, self.long_samples, self.method = max_length, long_samples, method
        self.owner, self.stored_extra = owner, stored_extra
        self.limit = None if max_length is None else max_length + stored_extra
        self.last = LongSampleCounts()
        self.totals = LongSampleCounts()
        self._warned = False

    def fit(self, result: ChunkResult) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        """The samples of one encoded batch that are fed, and their ``(ids, unshifted mask)``.

        Returns the indices (in the batch) of the samples kept, in order, and their stored tokens
        after any cut. Updates ``last`` and ``totals``.

        Raises:
            TightpackError: a sample over ``max_length`` under ``long_samples="error"``, or a batch
                left with no supervised token.
        """
        lengths = np.asarray(result.lengths, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        long = lengths > self.limit if self.limit is not None else np.zeros(len(lengths), dtype=bool)
        if self.long_samples == "error" and long.any():
            first = int(np.flatnonzero(long)[0])
            tokens = int(lengths[first]) - self.stored_extra
            raise TightpackError(
                f"{self.owner}: {int(long.sum())} samples of this batch are longer than max_length="
                f"{self.max_length} (first: row {first} of the batch, {tokens} tokens); "
                "long_samples='error' stops here: set long_samples='truncate' or 'drop', raise "
                "max_length, or filter the rows"
            )
        dropped = long.copy() if self.long_samples == "drop" else np.zeros_like(long)
        if self.long_samples == "truncate" and result.media is not None:
            dropped |= long & np.array([bool(parse_media_json(media)) for media in result.media], dtype=bool)
        cut = np.flatnonzero(long & ~dropped)
        cut_ids = self._cut(result, offsets, cut)

        counts = dict.fromkeys(COUNT_NAMES, 0)
        counts["samples"] = len(lengths)
        kept: list[int] = []
        samples: list[tuple[np.ndarray, np.ndarray]] = []
        for index, (start, stop) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
            ids, mask = result.tokens[start:stop], result.loss_mask[start:stop]
            supervised_in = int(mask[1:].sum())  # label-aligned: token 0 is never a target
            counts["supervised_in"] += supervised_in
            counts["tokens_in"] += stop - start - self.stored_extra
            if dropped[index]:
                counts["dropped_long"] += 1
                continue
            reason = None
            if index in cut_ids:
                (ids, mask), reason = cut_ids[index]
            supervised = int(mask[1:].sum())
            if reason is not None and supervised < supervised_in:
                counts["supervision_cut"] += 1
            if supervised == 0:
                counts["no_supervised"] += 1
                counts["no_supervised_after_truncation"] += int(supervised_in > 0)
                continue
            if reason is not None:
                counts["truncated"] += 1
                counts[reason] += 1
            counts["fed"] += 1
            counts["supervised_fed"] += supervised
            counts["tokens_fed"] += len(ids) - self.stored_extra
            kept.append(index)
            samples.append((ids, mask))
        counts["supervised_lost"] = counts["supervised_in"] - counts["supervised_fed"]
        self.last = LongSampleCounts(**counts)
        self.totals.add(self.last)
        if not samples:
            raise TightpackError(self._empty_batch_message())
        if not self._warned and (counts["samples"] > counts["fed"] or counts["truncated"]):
            self._warn()
        return kept, samples

    def _cut(
        self, result: ChunkResult, offsets: np.ndarray, cut: np.ndarray
    ) -> dict[int, tuple[tuple[np.ndarray, np.ndarray], str]]:
        """``{sample: ((ids, mask) kept, reason)}`` of the samples in ``cut`` (`plan_truncation`)."""
        if not len(cut):
            return {}
        segments = result.segments or Segments.none(len(offsets) - 1)
        segment_offsets = np.concatenate(([0], np.cumsum(segments.counts)))
        plan = plan_truncation(
            offsets, cut, self.limit, (segment_offsets, segments.starts, segments.kinds, segments.units),
            self.method,
        )  # fmt: skip
        out = {}
        bounds = plan.range_offsets.tolist()
        for i, sample in enumerate(plan.samples.tolist()):
            ranges = slice(bounds[i], bounds[i + 1])
            positions = kept_positions(plan.starts[ranges], plan.stops[ranges])
            out[sample] = ((result.tokens[positions], result.loss_mask[positions]), REASONS[plan.reasons[i]])
        return out

    def _empty_batch_message(self) -> str:
        counts, cap = self.last, f"max_length={self.max_length}"
        parts = []
        if counts["dropped_long"]:
            parts.append(f"{counts['dropped_long']} over {cap} left out (long_samples='drop')")
        after = counts["no_supervised_after_truncation"]
        if after:
            parts.append(f"{after} with no supervised token left after the cut to {cap}")
        if counts["no_supervised"] - after:
            parts.append(f"{counts['no_supervised'] - after} with no supervised token in the row itself")
        return (
            f"{self.owner}: no sample of this batch of {counts['samples']} has a supervised token to train "
            "on "
            f"({', '.join(parts)}); a step on it would have loss 0. Filter such rows out of the dataset "
            "(tightpack pack leaves them out and lists them in its manifest), raise max_length, or check "
            "loss_mode and the format"
        )

    def _warn(self) -> None:
        self._warned = True
        counts = self.last
        reasons = ", ".join(f"{counts[name]} {name.replace('_', ' ')}" for name in REASONS if counts[name])
        logger().warning(
            "%s: of %d samples in a batch, %d were cut to max_length=%s (%s), %d left out for length, "
            "%d left out with no supervised token (%d supervised tokens lost); the running totals are in the "
            "collator's long_sample_counts, and PackingCallback logs them as tightpack/<count>. "
            "This warning is shown once.",
            self.owner, counts["samples"], counts["truncated"], self.max_length, reasons or "none",
            counts["dropped_long"], counts["no_supervised"], counts["supervised_lost"],
        )  # fmt: skip
