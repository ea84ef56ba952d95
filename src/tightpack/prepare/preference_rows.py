"""Preference, KTO and group rows (TRL's conventions) -> tokenized units (`PreferenceUnits`).

Row kinds (``kind``):

- ``preference``: ``prompt`` / ``chosen`` / ``rejected``, as text (the branch follows the prompt
  directly, ``prompt + chosen``) or as conversations (``prompt`` a list of messages, ``chosen`` and
  ``rejected`` the assistant turn(s); a string branch is one assistant message). Without ``prompt``,
  ``chosen`` and ``rejected`` are whole conversations and their longest common run of messages is
  the prompt (TRL's implicit prompt).
- ``kto``: ``prompt`` / ``completion`` / ``label`` (bool: desirable or not); one branch.
- ``groups``: ``prompt`` / ``completions`` (a list of G >= 2), optional ``rewards`` or ``advantages``
  (G numbers each), carried through per completion.

Every branch is rendered with its prompt by the same formatter and tokenizer as the SFT path
(`tightpack.prepare.tokenize.Encoder`; text rows as ``{prompt}{completion}``, conversations with the
chat template, EOS appended as there). Where the prompt ends is where the branch's loss mask starts:
the chat template's generation prompt belongs to the prompt. The prompt is kept once per unit: the
tokens every branch's rendering starts with, up to there. Where a tokenizer merges the prompt's end
with a branch's start (text rows), the differing tokens belong to each branch, masked as its rendering
masks them (a token holding a character of the branch is supervised), so every branch trains on
exactly the tokens of its own rendering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from tightpack.core.preference_units import PreferenceUnits
from tightpack.errors import TightpackError, check_choice
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.format_config import FormatConfig
from tightpack.prepare.rendered import RowError
from tightpack.prepare.tokenize import BadRow, Encoder, parse_chunk
from tightpack.prepare.tokenizer import TokenizerSpec

__all__ = ["PreferenceEncoder", "TokenizedUnits", "branch_rows"]

PreferenceKind = Literal["preference", "kto", "groups"]
PREFERENCE_KINDS: tuple[str, ...] = get_args(PreferenceKind)

_TEXT_FORMAT = dict(format="prompt-completion", input_key="prompt", output_key="completion")
_TEXT_TEMPLATE = "{prompt}{completion}"


@dataclass(frozen=True)
class BranchRows:
    """One input row as the SFT rows of its branches (prompt + branch each) and its per-branch values."""

    rows: list[dict[str, Any]]
    names: list[str]  # what each branch is called in messages: "chosen", "completions[2]", ...
    conversational: bool
    values: dict[str, list[Any]] = field(default_factory=dict)


def _messages(value: Any, name: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not all(isinstance(message, dict) for message in value):
        raise RowError(f"{name!r} must be a string or a list of messages, got {type(value).__name__}")
    return value


def _unweighted(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt's messages with its assistant turns carrying no loss (a multi-turn history)."""
    return [{**message, "weight": 0} if message.get("role") == "assistant" else message for message in prompt]


def _branch_rows(prompt: Any, branches: list[Any], names: list[str]) -> tuple[list[dict[str, Any]], bool]:
    for branch, name in zip(branches, names, strict=True):
        if branch is None:
            raise RowError(f"{name!r} is null" if "[" in name else f"missing key {name!r}, or it is null")
        if branch == "" or branch == []:
            raise RowError(f"{name!r} is empty: a branch needs at least one token after the prompt")
    if isinstance(prompt, str):
        for branch, name in zip(branches, names, strict=True):
            if not isinstance(branch, str):
                raise RowError(
                    f"the prompt is text but {name!r} is {type(branch).__name__}: give both as text or "
                    "both as conversations (lists of messages)"
                )
        return [{"prompt": prompt, "completion": branch} for branch in branches], False
    if not isinstance(prompt, list) or not prompt:
        raise RowError(f"'prompt' must be a string or a non-empty list of messages, got {prompt!r:.60}")
    history = _unweighted(_messages(prompt, "prompt"))
    return [{"messages": history + _messages(b, n)} for b, n in zip(branches, names, strict=True)], True


def _implicit_prompt(chosen: Any, rejected: Any) -> tuple[list, list, list]:
    """TRL's implicit prompt: the longest common run of messages that starts both conversations."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise RowError(
            "missing key 'prompt': without one, 'chosen' and 'rejected' must be whole conversations "
            "(lists of messages) that share their first messages"
        )
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value:
            raise RowError(f"{name!r} is empty: a whole conversation needs its messages")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if shared == len(value):
            raise RowError(
                f"{name!r} has no message after the prompt it shares with the other branch (the implicit "
                "prompt is their common first messages): the pair states no preference"
            )
    if shared == 0:
        raise RowError(
            "'chosen' and 'rejected' share no prompt: their first messages differ (give a 'prompt', or "
            "start both conversations with the same messages)"
        )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _numbers(row: dict, key: str, count: int) -> list[float] | None:
    values = row.get(key)
    if values is None:
        return None
    ok = isinstance(values, list) and len(values) == count
    if not ok or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise RowError(f"{key!r} must be a list of {count} numbers (one per completion), got {values!r:.60}")
    if not all(math.isfinite(v) for v in values):
        raise RowError(f"{key!r} holds a value that is not finite: {values!r:.60}")
    return [float(v) for v in values]


def branch_rows(row: Any, kind: PreferenceKind) -> BranchRows:
    """The SFT rows of one preference, KTO or group row (see the module docstring).

    >>> branch_rows({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "preference").rows
    [{'prompt': '2+2=', 'completion': '4'}, {'prompt': '2+2=', 'completion': '5'}]

    Raises:
        RowError: a missing key, an empty branch, a pair whose branches are identical, a group of
            fewer than two completions, mixed text and conversations, values of the wrong type.
    """
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    prompt = row.get("prompt")
    values: dict[str, list[Any]] = {}
    if kind == "preference":
        chosen, rejected = row.get("chosen"), row.get("rejected")
        if chosen is None or rejected is None:
            hint = (
                " (a row of prompt, completion and label is a KTO row: pack it as format kto)"
                if "label" in row
                else " (a row of prompt and completions is a group: pack it as format groups)"
                if "completions" in row
                else ""
            )
            raise RowError(f"missing key {'chosen' if chosen is None else 'rejected'!r}, or it is null{hint}")
        if prompt is None:
            prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
        if chosen == rejected:
            raise RowError("'chosen' and 'rejected' are identical: the pair states no preference")
        branches, names = [chosen, rejected], ["chosen", "rejected"]
    elif kind == "kto":
        label = row.get("label")
        if label is None:
            raise RowError("missing key 'label', or it is null (true or false: desirable or not)")
        if not isinstance(label, bool):
            raise RowError(f"'label' must be true or false (desirable or not), got {label!r:.40}")
        branches, names, values = [row.get("completion")], ["completion"], {"labels": [label]}
    else:
        completions = row.get("completions")
        if completions is None:
            raise RowError("missing key 'completions', or it is null (a list of the group's completions)")
        if not isinstance(completions, list):
            raise RowError(f"'completions' must be a list of completions, got {type(completions).__name__}")
        if len(completions) < 2:
            raise RowError(
                f"a group needs at least 2 completions (their rewards are compared), got {len(completions)}"
            )
        branches, names = completions, [f"completions[{i}]" for i in range(len(completions))]
        for key, name in (("rewards", "rewards"), ("advantages", "advantages")):
            numbers = _numbers(row, key, len(completions))
            if numbers is not None:
                values[name] = numbers
    if prompt is None:
        raise RowError("missing key 'prompt'")
    rows, conversational = _branch_rows(prompt, branches, names)
    return BranchRows(rows, names, conversational, values)


@dataclass(frozen=True)
class TokenizedUnits:
    """The units of a list of rows and the rows that could not become units."""

    units: PreferenceUnits
    bad_rows: list[BadRow]
    rows: int


@dataclass(frozen=True)
class PreferenceEncoder:
    """Turns preference, KTO or group rows into `PreferenceUnits`, with the tokenizer ``spec``.

    ``template_vars`` are the chat template's extra variables (`FormatConfig.template_vars`).

    >>> from tightpack.prepare.tokenizer import load_tokenizer
    >>> encoder = PreferenceEncoder(load_tokenizer(), "preference")
    >>> result = encoder.encode_rows([{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5"}])
    >>> result.units.prompt_lengths.tolist(), result.units.branch_lengths.tolist()
    ([6], [2, 2])
    """

    spec: TokenizerSpec
    kind: PreferenceKind = "preference"
    template_vars: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, PREFERENCE_KINDS)

    def _encoders(self) -> tuple[Encoder, Encoder]:
        text = FormatConfig(**_TEXT_FORMAT, prompt_template=_TEXT_TEMPLATE, truncate_fields=())
        chat = FormatConfig(format="chat", loss_on="assistant", template_vars=self.template_vars)
        return Encoder(self.spec, text), Encoder(self.spec, chat)

    def encode_rows(self, rows: Sequence[Any], first_sample: int = 0, source: str = "rows") -> TokenizedUnits:
        """Tokenize ``rows``; a row that cannot become a unit is reported in ``bad_rows`` with its
        reason, and the others keep their order (``units.source_index`` is each one's row)."""
        return self._encode(list(enumerate(rows)), [], first_sample, lambda offset: f"{source} row {offset}")

    def encode_chunk(self, chunk: Chunk) -> TokenizedUnits:
        """`encode_rows` of a chunk of an input (JSONL lines are parsed here; a line that does not parse
        is a bad row), its bad rows located by file and line."""
        given, bad = [], []
        for offset, row in parse_chunk(chunk):
            if isinstance(row, RowError):
                bad.append(BadRow(chunk.first_sample + offset, chunk.location(offset), str(row)))
            else:
                given.append((offset, row))
        return self._encode(given, bad, chunk.first_sample, chunk.location, rows=len(chunk))

    def _encode(
        self,
        given: list[tuple[int, Any]],
        bad: list[BadRow],
        first_sample: int,
        location: Callable[[int], str],
        rows: int | None = None,
    ) -> TokenizedUnits:
        parsed: list[tuple[int, BranchRows]] = []
        for offset, row in given:
            try:
                parsed.append((offset, branch_rows(row, self.kind)))
            except RowError as error:
                bad.append(BadRow(first_sample + offset, location(offset), str(error)))
        encoded = self._encode_branches(parsed)
        built: list[tuple[int, list[np.ndarray], list[np.ndarray], dict]] = []
        for (offset, unit), branches in zip(parsed, encoded, strict=True):
            try:
                if isinstance(branches, str):
                    raise RowError(branches)
                prompt, tokens, masks = _split_prompt(branches, unit.names)
                built.append((offset, [prompt, *tokens], masks, unit.values))
            except RowError as error:
                bad.append(BadRow(first_sample + offset, location(offset), str(error)))
        bad.sort(key=lambda row: row.sample_index)
        return TokenizedUnits(_units(built, first_sample), bad, len(given) if rows is None else rows)

    def _encode_branches(self, parsed: list[tuple[int, BranchRows]]) -> list[Any]:
        """Per unit, its branches' ``(tokens, mask)`` (EOS appended), or the reason it failed."""
        text, chat = self._encoders()
        out: list[Any] = [None] * len(parsed)
        for encoder, conversational in ((text, False), (chat, True)):
            which = [i for i, (_, unit) in enumerate(parsed) if unit.conversational == conversational]
            flat = [row for i in which for row in parsed[i][1].rows]
            if not flat:
                continue
            result = encoder.encode_rows(flat)
            failed = {bad.sample_index: bad.reason for bad in result.bad_rows}
            bounds = np.concatenate([[0], np.cumsum(result.lengths)])
            by_sample = {int(s): k for k, s in enumerate(result.source_index)}
            first = 0
            for i in which:
                count = len(parsed[i][1].rows)
                samples = range(first, first + count)
                first += count
                reasons = [failed[s] for s in samples if s in failed]
                if reasons:
                    out[i] = reasons[0]
                    continue
                spans = [(bounds[by_sample[s]], bounds[by_sample[s] + 1]) for s in samples]
                out[i] = [(result.tokens[a:b], result.loss_mask[a:b]) for a, b in spans]
        return out


def _split_prompt(branches: list[tuple[np.ndarray, np.ndarray]], names: list[str]):
    """The prompt and every branch after it. The prompt is the run of tokens all the branches'
    renderings start with, up to where the first of their losses starts; what follows in a branch is
    its own, supervised where the rendering's mask says (tokens where the tokenizer merged the
    prompt's end with the branch's start stay unsupervised there)."""
    starts = []
    for (_, mask), name in zip(branches, names, strict=True):
        supervised = np.flatnonzero(mask)
        if len(supervised) == 0:
            raise RowError(f"{name!r} has no supervised token after the prompt")
        starts.append(int(supervised[0]))
    first_tokens = branches[0][0]
    shared = min(starts)
    for tokens, _ in branches[1:]:
        differ = np.flatnonzero(tokens[:shared] != first_tokens[:shared])
        shared = int(differ[0]) if len(differ) else shared
    if shared == 0:
        reason = (
            "no prompt token is left before a branch's first supervised token: the prompt renders to no "
            "tokens, or the tokenizer merged all of it into the branch's first token (end the prompt with "
            "a separator such as a space or a newline)"
            if min(starts) == 0
            else f"the renderings of {', '.join(map(repr, names))} differ from their first token: the "
            "tokenizer merged the prompt's start with a branch, so no prompt token is shared (start the "
            "branches with a separator such as a space or a newline, or end the prompt with one)"
        )
        raise RowError(reason)
    return (
        first_tokens[:shared],
        [tokens[shared:] for tokens, _ in branches],
        [mask[shared:] for _, mask in branches],
    )


def _concatenated(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _units(
    built: list[tuple[int, list[np.ndarray], list[np.ndarray], dict]], first_sample: int
) -> PreferenceUnits:
    prompts = [arrays[0] for _, arrays, _, _ in built]
    branches = [branch for _, arrays, _, _ in built for branch in arrays[1:]]
    masks = [mask for _, _, unit_masks, _ in built for mask in unit_masks]
    counts = [len(arrays) - 1 for _, arrays, _, _ in built]
    per_branch: dict[str, np.ndarray] = {}
    for name in sorted({name for *_, values in built for name in values}):
        without = [offset for offset, _, _, given in built if name not in given]
        if without:  # a loss weighted by them would be NaN for these groups: refused, not filled
            raise TightpackError(
                f"{name} are given for some groups and not for source row {first_sample + without[0]} "
                f"({len(without)} such): give {name} for every group or for none"
            )
        dtype = bool if name == "labels" else np.float32
        per_branch[name] = np.array([v for *_, given in built for v in given[name]], dtype=dtype)
    return PreferenceUnits(
        prompt_tokens=_concatenated(prompts, np.int64),
        prompt_offsets=_offsets([len(p) for p in prompts]),
        branch_tokens=_concatenated(branches, np.int64),
        branch_loss_mask=_concatenated(masks, np.int8),
        branch_offsets=_offsets([len(b) for b in branches]),
        unit_offsets=_offsets(counts),
        source_index=np.array([first_sample + offset for offset, *_ in built], dtype=np.int64),
        **per_branch,
    )
