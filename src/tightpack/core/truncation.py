"""Long samples made to fit: which tokens of a sample over the cap are kept, and why.

Formatting (`tightpack.prepare.formats`) marks a sample's text as consecutive *segments*, and
tokenization stores the token where each one starts. A segment has a kind, made of two flags, and a
unit:

===============  ==============================================================================
kind             meaning
===============  ==============================================================================
``KEEP`` (0)     template text, role headers, BOS/EOS, the system turn, prompt fields that are
                 not truncation fields: never trimmed
``PROMPT`` (1)   text that may be trimmed: the truncation fields of prompt-completion rows
                 (``--truncate-field``, default the input field), user and tool text in chat
``ANSWER`` (2)   the completion, or an assistant turn's content; ``PROMPT | ANSWER`` when the
                 completion is itself a truncation field
===============  ==============================================================================

``unit`` is -1 for segments that are always kept, else the conversation round they belong to (a
round ends with an assistant turn); rounds are dropped whole. A sample of ``n`` stored tokens above
``limit`` (the cap + 1) is cut by these steps, each only while it is still too long:

1. drop whole rounds, oldest first, never the last one (it holds the last assistant turn);
2. trim ``PROMPT`` text unit by unit (the always-kept unit first, then the oldest round); the
   segments of one unit share the cut equally (the first ones take the remainder, as
   Megatron-Bridge's ``_multiple_truncation``), each from its end (``right``: keep the start, the
   reference's default) or from its start (``left``: keep the end);
3. cut what is still over from the end of the sample: the answer loses its end and its EOS.

An answer too long by itself therefore loses its prompt text and then its end, as in the reference.
One difference: with ``left`` the reference takes that remainder from the start of the sample; here
the answer keeps its beginning, the same rule for every format. Samples without
segments (pre-tokenized rows) go straight to step 3. The reason recorded is the strongest step
taken: ``answer cut`` when an answer lost tokens, else ``turns dropped``, else ``prompt trimmed``;
``end cut`` when only template or unstructured tokens were cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "ANSWER",
    "KEEP",
    "PROMPT",
    "REASONS",
    "TruncationMethod",
    "TruncationPlan",
    "keep_ranges",
    "plan_truncation",
]

KEEP, PROMPT, ANSWER = 0, 1, 2
#: Reason codes of `TruncationPlan.reasons`, by index.
REASONS = ("prompt_trimmed", "turns_dropped", "answer_cut", "end_cut")
_PROMPT_TRIMMED, _TURNS_DROPPED, _ANSWER_CUT, _END_CUT = range(4)

TruncationMethod = Literal["right", "left"]


def keep_ranges(
    n: int, starts: list[int], kinds: list[int], units: list[int], limit: int, method: TruncationMethod
) -> tuple[list[tuple[int, int]], int]:
    """Token ranges ``[start, stop)`` of one sample kept within ``limit`` tokens, and the reason code.

    Args:
        n: stored tokens of the sample (above ``limit``).
        starts: token where each segment starts (the first is 0), sorted; a segment runs to the next
            start or to ``n``. Empty lists: the sample has no structure.
        kinds, units: each segment's kind and unit (see the module docstring).
        limit: stored tokens allowed.
        method: ``right`` trims prompt text at its end, ``left`` at its start.

    A prompt of 6 tokens and an answer of 3, a limit of 6: the prompt keeps its first 3 tokens.

    >>> keep_ranges(9, [0, 6], [PROMPT, ANSWER], [-1, -1], 6, "right")
    ([(0, 3), (6, 9)], 0)
    >>> keep_ranges(9, [0, 6], [PROMPT, ANSWER], [-1, -1], 6, "left")
    ([(3, 9)], 0)

    Two rounds (user 2 + answer 2 tokens each) after a system turn of 1 token, a limit of 5: the
    first round goes.

    >>> keep_ranges(9, [0, 1, 3, 5, 7], [KEEP, PROMPT, ANSWER, PROMPT, ANSWER], [-1, 0, 0, 1, 1], 5, "right")
    ([(0, 1), (5, 9)], 1)
    """
    if not starts:
        return [(0, limit)], _END_CUT
    ends = [*starts[1:], n]
    size = [end - start for start, end in zip(starts, ends, strict=True)]
    front, back = [0] * len(starts), [0] * len(starts)
    over = n - limit

    members: dict[int, list[int]] = {}  # unit -> its segments, in order
    for segment, unit in enumerate(units):
        members.setdefault(unit, []).append(segment)
    rounds = sorted(unit for unit in members if unit >= 0)

    dropped = False
    for unit in rounds[:-1]:
        if over <= 0:
            break
        dropped = True
        for segment in members.pop(unit):
            over -= size[segment]
            back[segment] = size[segment]

    trimmed = answer_cut = False
    for unit in [-1, *rounds]:
        if over <= 0:
            break
        group = [segment for segment in members.get(unit, ()) if kinds[segment] & PROMPT]
        if not group:
            continue
        share, extra = divmod(over, len(group))
        for position, segment in enumerate(group):
            cut = min(share + (position < extra), size[segment] - front[segment] - back[segment])
            if cut > 0:
                trimmed = True
                answer_cut |= bool(kinds[segment] & ANSWER)
                over -= cut
                if method == "left":
                    front[segment] += cut
                else:
                    back[segment] += cut

    for segment in range(len(starts) - 1, -1, -1):
        if over <= 0:
            break
        cut = min(over, size[segment] - front[segment] - back[segment])
        if cut > 0:
            back[segment] += cut
            over -= cut
            answer_cut |= bool(kinds[segment] & ANSWER)

    ranges: list[tuple[int, int]] = []
    for start, end, head, tail in zip(starts, ends, front, back, strict=True):
        first, stop = start + head, end - tail
        if first >= stop:
            continue
        if ranges and ranges[-1][1] == first:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((first, stop))
    reason = (
        _ANSWER_CUT if answer_cut else _TURNS_DROPPED if dropped else _PROMPT_TRIMMED if trimmed else _END_CUT
    )
    return ranges, reason


@dataclass(frozen=True)
class TruncationPlan:
    """Kept tokens of the samples over the limit, as absolute token ranges of the store (CSR).

    Attributes:
        samples: int64 ``[k]``, the truncated samples (store indices), ascending.
        reasons: uint8 ``[k]``, index into `REASONS`.
        range_offsets: int64 ``[k + 1]``: sample ``samples[i]`` keeps the ranges
            ``range_offsets[i]:range_offsets[i + 1]`` of ``starts``/``stops``.
        starts, stops: int64, absolute token positions in the store, sample by sample, ascending.
    """

    samples: np.ndarray
    reasons: np.ndarray
    range_offsets: np.ndarray
    starts: np.ndarray
    stops: np.ndarray

    def reason_counts(self) -> dict[str, int]:
        """Truncated samples per reason (every reason present, 0 included)."""
        counts = np.bincount(self.reasons, minlength=len(REASONS))
        return {name: int(count) for name, count in zip(REASONS, counts, strict=True)}


def plan_truncation(
    offsets: np.ndarray,
    samples: np.ndarray,
    limit: int,
    segments: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    method: TruncationMethod = "right",
) -> TruncationPlan:
    """Which tokens each of ``samples`` keeps within ``limit`` stored tokens (`keep_ranges`).

    Args:
        offsets: the token store's sample offsets, int64 ``[num_samples + 1]``.
        samples: the samples to cut (each longer than ``limit``).
        limit: stored tokens allowed per sample (the cap + 1).
        segments: ``(segment_offsets [num_samples + 1], starts, kinds, units)``, the store's segments
            (starts relative to each sample).
        method: ``right`` or ``left`` (see the module docstring).

    Runs a Python step per truncated sample, over its few segments: truncated samples are a small
    share of a corpus, and the per-sample work is a handful of integer operations.
    """
    segment_offsets, seg_starts, seg_kinds, seg_units = segments
    samples = np.asarray(samples, dtype=np.int64)
    reasons = np.zeros(len(samples), dtype=np.uint8)
    counts = np.zeros(len(samples) + 1, dtype=np.int64)
    starts: list[int] = []
    stops: list[int] = []
    lengths = (offsets[samples + 1] - offsets[samples]).tolist()
    bases = offsets[samples].tolist()
    firsts = segment_offsets[samples].tolist()
    lasts = segment_offsets[samples + 1].tolist()
    for i, (n, base, first, last) in enumerate(zip(lengths, bases, firsts, lasts, strict=True)):
        ranges, reasons[i] = keep_ranges(
            n,
            seg_starts[first:last].tolist(),
            seg_kinds[first:last].tolist(),
            seg_units[first:last].tolist(),
            limit,
            method,
        )
        counts[i + 1] = len(ranges)
        starts += [base + start for start, _ in ranges]
        stops += [base + stop for _, stop in ranges]
    return TruncationPlan(
        samples=samples,
        reasons=reasons,
        range_offsets=np.cumsum(counts),
        starts=np.array(starts, dtype=np.int64),
        stops=np.array(stops, dtype=np.int64),
    )
