"""Chat rows (``--format chat``) -> text, the supervised spans of the assistant turns, and the rounds
and user text marked as truncation segments; rendered with the tokenizer's chat template, or with the
built-in one. `tightpack.prepare.formats.render_row` dispatches here.

Built-in chat template (used when the tokenizer has none, e.g. the built-in GPT-2)::

    <|tools|>\\n{tools as JSON}\\n          (only when the row has tools)
    <|{role}|>\\n{text}\\n                 (for each message)

where a message's text is its content, then one ``<|tool_call|>{"name": ..., "arguments": {...}}``
line per tool call, and for a tool turn with a known tool name a first ``<|tool_result|>{"name": ...}``
line (`chat_content.builtin_message_text`). An assistant turn's loss span is its text (its calls
included) and the newline that closes it, so the model learns where a turn ends, and the appended EOS.
With a tokenizer's template, each assistant turn is located in the rendering of the whole conversation
(`tightpack.prepare.template_turns`, also for templates that rewrite earlier turns); its span runs from
the end of the generation prompt to the template's end marker (whitespace after it excluded), or is
the template's own ``{% generation %}`` blocks that lie in it. No EOS follows a template's end marker.
Turns of ``weight`` 0 carry no loss.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from tightpack.core.truncation import ANSWER, KEEP, PROMPT, ROUNDS_KEPT
from tightpack.logs import logger
from tightpack.prepare.chat_content import (
    CHAT_ROLES,
    MESSAGE_KEYS,
    ContentError,
    builtin_message_text,
    normalize_messages,
)
from tightpack.prepare.format_config import FormatConfig, LossOn
from tightpack.prepare.rendered import Rendered, RowError, _bounded
from tightpack.prepare.template_turns import Turn, locate_turns

_SYSTEM_ROLES = frozenset({"system", "developer"})
_WARNED: set[str] = set()  # what this process has reported: once per run, not once per row


def reset_warnings() -> None:
    """Forget what was reported: a new run reports again (called where tokenization starts)."""
    _WARNED.clear()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger().warning(message)


def _checked_messages(row: dict, config: FormatConfig) -> list[dict[str, Any]]:
    messages = row.get(config.messages_key)
    if messages is None:
        raise RowError(f"missing key {config.messages_key!r}")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{config.messages_key!r} must be a non-empty list of {{role, content}} objects")
    try:
        normalized = normalize_messages(messages)
    except ContentError as error:
        raise RowError(str(error)) from None
    unknown = {key for message in normalized for key in message} - MESSAGE_KEYS
    for key in sorted(unknown):
        _warn_once(
            f"message key {key!r} is not one tightpack knows ({', '.join(sorted(MESSAGE_KEYS))}); it is "
            "passed to the chat template as is and otherwise ignored"
        )
    return normalized


def _supervised_turns(messages: list[dict[str, Any]], loss_on: LossOn) -> list[int]:
    """The assistant turns that carry the loss: all of them, or the last one (``last-turn``), less
    those with ``weight`` 0 (a last turn of weight 0 under ``last-turn`` leaves none)."""
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if loss_on == "last-turn":
        assistant = assistant[-1:]
    return [i for i in assistant if messages[i].get("weight", 1) == 1]


def _rounds(messages: list[dict]) -> list[int]:
    """The round of every message, -1 for those always kept.

    A round starts at a user message that follows an assistant turn and ends with the last assistant
    turn before the next such user message. Leading system messages and the messages after the last
    assistant turn belong to no round.

    >>> _rounds([{"role": r} for r in ("system", "user", "assistant", "user", "assistant", "user")])
    [-1, 0, 0, 1, 1, -1]
    """
    roles = [message["role"] for message in messages]
    last = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
    units, current, answered = [], -1, False
    for number, role in enumerate(roles):
        if number > last or (current == -1 and role in _SYSTEM_ROLES):
            units.append(-1)
            continue
        if current == -1 or (answered and role == "user"):
            current, answered = current + 1, False
        answered |= role == "assistant"
        units.append(current)
    return units


def _content_kind(role: str) -> int:
    return ANSWER if role == "assistant" else KEEP if role in _SYSTEM_ROLES else PROMPT


def _render_chat(
    row: dict,
    config: FormatConfig,
    chat_template: str | None,
    special: dict[str, str],
    text_budget: int | None,
) -> Rendered:
    messages = _checked_messages(row, config)
    cut = False
    if text_budget is not None and any(len(m["content"]) > 2 * text_budget for m in messages):
        bounded = [(m, *_bounded(m["content"], text_budget)) for m in messages]
        messages = [{**m, "content": content} if was_cut else m for m, content, was_cut in bounded]
        cut = True
    tools = row.get(config.tools_key)
    if tools is not None and not isinstance(tools, list):
        raise RowError(f"{config.tools_key!r} must be a list of tool schemas, got {type(tools).__name__}")
    turns = [] if config.loss_on == "all" else _supervised_turns(messages, config.loss_on)
    last_supervised = config.loss_on == "all" or (bool(turns) and turns[-1] == len(messages) - 1)
    units = _rounds(messages)
    variables = dict(config.template_vars)
    if chat_template is None:
        if variables:
            raise RowError(
                "template variables (template_vars) are set but the tokenizer has no chat template: the "
                "built-in template takes none; drop them or use a tokenizer with a chat template"
            )
        text, spans, segments = _render_builtin(messages, tools, turns, units)
        add_special, append_eos = True, True
    else:
        text, spans, segments, open_end, note = _render_template(
            messages, tools, turns, units, chat_template, special, variables
        )
        if note is not None and config.chat_truncation == "oldest-turns":
            _warn_once(note)
        add_special = False  # templates write their own BOS
        append_eos = open_end  # the template's end marker ends the sample, as in transformers' mask
    if config.loss_on == "all":
        spans = ((0, len(text)),)
    if config.chat_truncation == "end":  # no round is dropped and no text trimmed: the end is cut
        segments = [(position, kind & ANSWER, -1) for position, kind, _ in segments]
    return Rendered(
        text, tuple(spans), add_special, last_supervised, tuple(segments), cut, append_eos=append_eos
    )


_BUILTIN_HEADERS = {role: f"<|{role}|>\n" for role in CHAT_ROLES}


def _render_builtin(messages, tools, turns, units):
    parts, spans, position = [], [], 0
    segments = [(0, KEEP, -1)]
    if tools:
        parts.append(f"<|tools|>\n{json.dumps(tools, ensure_ascii=False, sort_keys=True)}\n")
        position = len(parts[0])
    supervised = set(turns)
    for number, (message, unit) in enumerate(zip(messages, units, strict=True)):
        header, content = _BUILTIN_HEADERS[message["role"]], builtin_message_text(message)
        segments.append((position, KEEP, unit))
        position += len(header)
        if number in supervised:  # the content and the newline closing the turn
            spans.append((position, position + len(content) + 1))
        segments.append((position, _content_kind(message["role"]), unit))
        segments.append((position + len(content), KEEP, unit))
        parts += (header, content, "\n")
        position += len(content) + 1
    segments.append((position, KEEP, -1))
    return "".join(parts), spans, segments


def _render_template(messages, tools, turns, units, chat_template: str, special, variables):
    """Text, supervised spans and segments of a conversation rendered with a Jinja chat template, and
    whether the text closes the last turn itself (then no EOS is appended).

    Turns are located in the whole rendering (`tightpack.prepare.template_turns`); a template with
    ``{% generation %}`` blocks supervises its blocks, each given to the turn it lies in.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(conversation, *, generation_prompt: bool = False, assistant_mask: bool = False):
        try:
            texts, generation = render_jinja_template(
                [conversation],
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=generation_prompt,
                return_assistant_tokens_mask=assistant_mask,
                **special,
                **variables,
            )
        except Exception as error:  # jinja raises TemplateError, or whatever raise_exception() is given
            raise RowError(f"the chat template failed on this conversation: {error}") from None
        return texts[0], (generation[0] if generation else [])

    blocks = _GENERATION.search(chat_template) is not None
    text, generation = render(messages, assistant_mask=blocks)
    located = locate_turns(text, messages, lambda conversation, **kw: render(conversation, **kw)[0])
    if blocks:
        spans = _block_spans(generation, located, turns)
    else:
        spans = [(located[t].start, located[t].end) for t in turns if t in located]
    last = len(messages) - 1  # an EOS only after a last assistant turn the template leaves open
    open_end = last in located and located[last].end == located[last].content[1]
    segments, note = _template_segments(text, messages, units, located, render)
    return text, spans, segments, open_end, note


_GENERATION = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


def _block_spans(generation, located: dict[int, Turn], turns: list[int]) -> list[tuple[int, int]]:
    """The generation blocks of the supervised turns: a block belongs to the first located turn whose
    text (its closing included) ends at or after the block's end; blocks after every turn belong to
    none and are kept when every turn is supervised."""
    order = sorted(located)
    closes = [located[t].close for t in order]
    wanted = set(turns)
    everything = wanted >= set(order)
    spans = []
    for start, end in generation:
        owner = next((t for t, close in zip(order, closes, strict=True) if end <= close), None)
        if (owner is None and everything) or owner in wanted:
            spans.append((start, end))
    return spans


def _template_segments(text, messages, units, located, render):
    """Segments of a template-rendered conversation, and a note when its rounds cannot be dropped.

    Rounds are marked droppable only when removing the oldest round's text gives what the template
    renders for the conversation without it (not so when the template merges the system prompt into
    the first user turn, as Gemma's): otherwise no round is dropped, user text is still trimmed first
    and the row's note says why.
    """
    leading = units.index(0) if 0 in units else len(messages)
    head = ""
    if leading and 0 in units:
        try:
            head = render(messages[:leading])[0]
        except RowError:  # a template may refuse the system turn alone (Llama-3.1 with tools)
            head = ""
    system_end = len(head) if text.startswith(head) else 0
    segments = [(0, KEEP, -1), (system_end, KEEP, units[leading] if leading < len(units) else -1)]
    cursor = system_end
    for number, (message, unit) in enumerate(zip(messages, units, strict=True)):
        following = units[number + 1] if number + 1 < len(units) else -1
        if number in located:
            turn = located[number]
            if turn.start < cursor:
                continue
            (a, b), tail = turn.content, (turn.end, KEEP, unit)  # the content alone may be trimmed
            segments += [(turn.start, ANSWER, unit), (a, ANSWER, unit), (b, ANSWER, unit), tail]
            segments.append((turn.close, KEEP, following))
            cursor = turn.close
            continue
        content = message["content"].strip()
        found = text.find(content, cursor) if content and number >= leading else -1
        if found < 0:  # the system text is kept: where the template puts it, it is not searched for
            continue
        segments += [(found, _content_kind(message["role"]), unit), (found + len(content), KEEP, unit)]
        cursor = found + len(content)
    segments.append((len(text), KEEP, -1))
    if any(b[0] < a[0] for a, b in itertools.pairwise(segments)):
        return [
            (0, KEEP, -1),
            (len(text), KEEP, -1),
        ], "the chat template's text could not be divided into turns"
    if max(units, default=-1) < 1:
        return segments, None
    # Round 0 runs to where round 1 starts; dropping it must leave what the template renders without
    # it. Where round 0 starts follows from that: the text before it is the template's own (a BOS, a
    # default system prompt) or the system turn, and must be the shorter rendering's start.
    stop = next(position for position, _, unit in segments if unit == 1)
    shorter = render([m for m, unit in zip(messages, units, strict=True) if unit != 0])[0]
    begin = len(shorter) - (len(text) - stop)
    first = next(i for i, (_, _, unit) in enumerate(segments) if unit == 0)
    droppable = (
        segments[first - 1][0] <= begin <= segments[first + 1][0]
        and text[:begin] == shorter[:begin]
        and text[stop:] == shorter[begin:]
    )
    if droppable:
        segments[first] = (begin, KEEP, 0)
        return segments, None
    # No round is dropped; each earlier round is trimmed as a whole, its answers (through their end
    # markers: a cut answer is not taught to stop) with its user text, oldest round first; the last
    # round, its user question and its answer, last.
    earlier = {
        p for t in located if 0 <= units[t] < max(units) for p in (located[t].start, *located[t].content)
    }
    kept = [
        (p, PROMPT if k & ANSWER and p in earlier else k, -1 if unit < 0 else ROUNDS_KEPT - unit)
        for p, k, unit in segments
    ]
    return kept, None
