"""Long samples made to fit: which tokens of a sample over the cap are kept, and why.

Formatting (`tightpack.prepare.formats`) marks a sample's text as consecutive *segments*, and
tokenization stores the token where each one starts. A segment has a kind, made of two flags, and a
unit:

===============  ==============================================================================
kind             meaning
===============  ==============================================================================
``KEEP`` (0)     template text, role headers, BOS/EOS, the system turn, prompt fields that are
                 not truncation fields: cut only in steps 3 and 5, or with a dropped round
``PROMPT`` (1)   text that may be trimmed: the truncation fields of prompt-completion rows
                 (``--truncate-field``, default the input field), user and tool text in chat
``ANSWER`` (2)   the completion, or an assistant turn's content; ``PROMPT | ANSWER`` when the
                 completion is itself a truncation field
===============  ==============================================================================

``unit`` is -1 for segments that are always kept, else the conversation round they belong to (a
round ends with an assistant turn); rounds are dropped whole. ``ROUNDS_KEPT - r`` (-2, -3, ...) marks
round ``r`` of a conversation whose rounds cannot be dropped (a chat template that merges text across
turns, such as Gemma's system prompt in the first user turn): no such round is dropped, their text is
trimmed round by round after the -1 unit, oldest first, and such a sample that must be cut records
why (``turns_kept``). A sample of ``n`` stored tokens above
``limit`` (the cap + 1) is cut by these steps, each only while it is still too long:

1. drop whole rounds, oldest first, never the last one (it holds the last assistant turn);
2. trim ``PROMPT`` text that is not an answer, unit by unit (the always-kept unit first, then the
   oldest round left). The segments of one unit share the cut equally, the first ones taking the
   remainder (as Megatron-Bridge's ``_multiple_truncation``); a segment shorter than its share gives
   all it has and the others share the rest again; what the unit cannot give passes to the next
   unit. Each segment is cut at its end (``right``: keep the start, the reference's default) or at
   its start (``left``: keep the end);
3. ``left`` only, prompt-completion samples with a truncation field (every unit -1, some ``PROMPT``
   text): cut what precedes the answer (template text, fields that are not truncation fields) from
   the sample's start, as the reference does. Never in conversations: their system turn is kept;
4. trim ``PROMPT | ANSWER`` segments (an answer named as a truncation field, earlier answers of a
   conversation whose rounds are kept) as in step 2; with ``right`` the last answer is left to
   step 5, so that it loses its EOS with its end (with ``left`` it keeps its end, and its EOS);
5. cut what is still over from the end of the sample: the EOS (or the turn's end marker) goes first,
   then the end of the answer, then whatever precedes it.

So an answer loses a token only when no trimmable prompt text is left (with ``left``, in a
prompt-completion sample: no token before it at all), and ``KEEP`` text only in steps 3 and 5 or with
a dropped round; with ``right``,
the ``KEEP`` text before the answer goes only after the whole answer. The kept tokens number exactly
``limit``, fewer only when a dropped round took more than needed. Samples without segments
(pre-tokenized rows) go straight to step 5.

Why the EOS goes with a cut answer: what is kept of the answer is a prefix of it, and an EOS after
that prefix would teach the model to stop mid-answer. With the EOS gone, the sample trains the
answer's first tokens and nothing about where it ends (as a cut pretraining document does).

The reason recorded (`REASONS`) is the strongest step taken: ``answer_cut`` when a token of an answer
or of what follows the answer (its EOS, its end marker) was cut, else ``turns_dropped``, else
``turns_kept`` for a ``ROUNDS_KEPT`` sample (its prompt was trimmed where rounds would have been
dropped), else ``prompt_trimmed``; ``end_cut`` when the sample has no answer segment (pre-tokenized rows, or
no structure) and its end was cut.

Where Megatron-Bridge's ``GPTSFTDataset`` (``_multiple_truncation``, 0.6.2) differs, every other
case being the same tokens:

- a truncation field shorter than its share gives what it has and the rest is not shared again: it
  goes to the reference's end cut, so the answer is cut although another field still had text;
- the label named as a truncation field shares the cut equally with the other fields; here it is
  trimmed only once they are empty (step 4);
- when the answer must be cut, the reference keeps the EOS and drops one answer token more (its
  length counts the EOS); here the EOS goes (above);
- with ``left`` and a short field, the rest goes to the reference's end cut, which starts at the
  sample's start: template text can go before another field's text; here the fields share it;
- with ``left`` and an answer longer than what is left, the reference's end cut goes on into the
  answer's start (its declarative ``prompt_completion_config`` path too keeps the completion's end);
  here the answer keeps its start and loses its end, as with ``right``;
- with ``right`` and text outside the truncation fields filling the cap, both lose the whole answer:
  the reference keeps its EOS (a row whose only supervised token is an EOS right after a cut
  prompt), here no supervised token is left and the row is excluded (counted, listed);
- chat rows: the reference does not truncate them when tokenizing (its packer drops them, or cuts
  their end when padding to a multiple); here every step applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

KEEP, PROMPT, ANSWER = 0, 1, 2
#: Reason codes of `TruncationPlan.reasons`, by index.
REASONS = ("prompt_trimmed", "turns_dropped", "answer_cut", "end_cut", "turns_kept")
_PROMPT_TRIMMED, _TURNS_DROPPED, _ANSWER_CUT, _END_CUT, _TURNS_KEPT = range(5)
#: The unit of round 0 of a conversation whose rounds cannot be dropped, round r is ``ROUNDS_KEPT - r``.
ROUNDS_KEPT = -2

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
        method: ``right`` trims prompt text at its end, ``left`` at its start (and then, before
            any answer token, what precedes the answer from the sample's start).

    Returns the kept ranges, sorted, disjoint and not touching (adjacent ones are merged), and a
    `REASONS` index. They hold ``limit`` tokens, fewer only when whole rounds were dropped.

    A prompt of 6 tokens and an answer of 3, a limit of 6: the prompt keeps its first 3 tokens.

    >>> keep_ranges(9, [0, 6], [PROMPT, ANSWER], [-1, -1], 6, "right")
    ([(0, 3), (6, 9)], 0)
    >>> keep_ranges(9, [0, 6], [PROMPT, ANSWER], [-1, -1], 6, "left")
    ([(3, 9)], 0)

    Two prompt fields of 2 and 10 tokens, an answer of 8, a limit of 10: the short field gives its
    2 tokens and the long one the other 8 (the answer lost 3 tokens here before issue 26).

    >>> keep_ranges(20, [0, 2, 12], [PROMPT, PROMPT, ANSWER], [-1, -1, -1], 10, "right")
    ([(2, 4), (12, 20)], 0)

    Two rounds (user 2 + answer 2 tokens each) after a system turn of 1 token, a limit of 5: the
    first round goes.

    >>> keep_ranges(9, [0, 1, 3, 5, 7], [KEEP, PROMPT, ANSWER, PROMPT, ANSWER], [-1, 0, 0, 1, 1], 5, "right")
    ([(0, 1), (5, 9)], 1)
    """
    if not starts:
        return [(0, min(n, limit))], _END_CUT
    ends = [*starts[1:], n]
    size = [end - start for start, end in zip(starts, ends, strict=True)]
    front, back = [0] * len(starts), [0] * len(starts)
    over = n - limit

    members: dict[int, list[int]] = {}  # unit -> its segments, in order
    for segment, unit in enumerate(units):
        members.setdefault(unit, []).append(segment)
    rounds = sorted(unit for unit in members if unit >= 0)
    # -1, then the rounds of a conversation whose rounds are kept, oldest first (-2, -3, ...)
    always = sorted((unit for unit in members if unit < 0), reverse=True)

    dropped = False
    for unit in rounds[:-1]:
        if over <= 0:
            break
        dropped = True
        for segment in members.pop(unit):
            over -= size[segment]
            back[segment] = size[segment]

    # Steps 2 to 4: prompt-only text, everywhere; with left, whatever precedes the answer (from the
    # start); an answer that is itself a truncation field. Step 5 (the end) below.
    trimmed = answer_cut = False
    answers = [segment for unit in members for segment in members[unit] if kinds[segment] & ANSWER]
    # The last answer, trimmed at its end, is left to step 5, which takes its EOS first.
    final = max(answers) if answers and method == "right" else -1
    # Step 3 is for prompt-completion samples with a truncation field (no rounds, some prompt text).
    prompt_completion = always == [-1] and not rounds and any(kind & PROMPT for kind in kinds)
    from_start = method == "left" and bool(answers) and prompt_completion
    for answer in (False, True):
        for unit in [*always, *rounds]:
            if over <= 0:
                break
            group = [
                segment
                for segment in members.get(unit, ())
                if kinds[segment] & PROMPT and bool(kinds[segment] & ANSWER) == answer and segment != final
            ]
            remaining = [size[s] - front[s] - back[s] for s in group]
            for segment, cut in zip(group, _shared_cut(over, remaining), strict=True):
                if cut:
                    trimmed = True
                    answer_cut |= answer
                    over -= cut
                    if method == "left":
                        front[segment] += cut
                    else:
                        back[segment] += cut
        if not answer and over > 0 and from_start:
            for segment in range(min(answers)):
                cut = min(over, size[segment] - front[segment] - back[segment])
                if cut > 0:
                    trimmed = True
                    front[segment] += cut
                    over -= cut

    if over > 0:  # no trimmable text left: the sample loses its end, EOS first
        answer_cut |= bool(answers)
        for segment in range(len(starts) - 1, -1, -1):
            cut = min(over, size[segment] - front[segment] - back[segment])
            back[segment] += cut
            over -= cut
            if over <= 0:
                break

    ranges: list[tuple[int, int]] = []
    for start, end, head, tail in zip(starts, ends, front, back, strict=True):
        first, stop = start + head, end - tail
        if first >= stop:
            continue
        if ranges and ranges[-1][1] == first:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((first, stop))
    if answer_cut:
        return ranges, _ANSWER_CUT
    if dropped:
        return ranges, _TURNS_DROPPED
    if always[-1:] and always[-1] <= ROUNDS_KEPT:
        return ranges, _TURNS_KEPT
    return ranges, _PROMPT_TRIMMED if trimmed else _END_CUT


def _shared_cut(over: int, sizes: list[int]) -> list[int]:
    """Tokens each segment of ``sizes`` gives so that together they give ``over`` (or all they have):
    equal shares, the first ones taking the remainder; a segment too short for its share gives all
    it has and the others share the rest. The same as giving one token at a time, always from the
    segment that has given least (the first of those).

    >>> _shared_cut(10, [2, 10])
    [2, 8]
    >>> _shared_cut(5, [4, 4, 4])
    [2, 2, 1]
    >>> _shared_cut(9, [10, 10, 1, 10])
    [3, 3, 1, 2]
    """
    cuts = [0] * len(sizes)
    live = [i for i, size in enumerate(sizes) if size > 0]
    while over > 0 and live:
        step = min(over // len(live), min(sizes[i] - cuts[i] for i in live))
        if step == 0:  # fewer tokens left to give than segments: one each, the first ones
            for i in live[:over]:
                cuts[i] += 1
            break
        for i in live:
            cuts[i] += step
        over -= step * len(live)
        live = [i for i in live if cuts[i] < sizes[i]]
    return cuts


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
