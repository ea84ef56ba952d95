"""Chat rows (``--format chat``) -> text, the supervised spans of the assistant turns, and the rounds
and user text marked as truncation segments; rendered with the tokenizer's chat template, or with the
built-in one. `tightpack.prepare.formats.render_row` dispatches here.

Built-in chat template (used when the tokenizer has none, e.g. the built-in GPT-2)::

    <|tools|>\\n{tools as JSON}\\n          (only when the row has tools)
    <|{role}|>\\n{text}\\n                 (for each message)

where a message's text is its content, then one ``<|tool_call|>{"name": ..., "arguments": {...}}``
line per tool call, and for a tool turn with a known tool name a first ``<|tool_result|>{"name": ...}``
line (`chat_content.builtin_message_text`). An assistant turn's loss span is its text (its calls
included) and the newline that closes it, so the model learns where a turn ends. With a tokenizer's
template, the span of assistant turn ``i`` is the text between rendering ``messages[:i]`` with the
generation prompt and rendering ``messages[:i+1]`` (it includes the end-of-turn marker), or the
template's own ``{% generation %}`` blocks when it has them.
"""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any

from tightpack.core.truncation import ANSWER, KEEP, PROMPT
from tightpack.prepare.chat_content import CHAT_ROLES, ContentError, builtin_message_text, normalize_messages
from tightpack.prepare.rendered import Rendered, RowError, _bounded

if TYPE_CHECKING:  # annotations only: formats imports this module
    from tightpack.prepare.formats import FormatConfig, LossOn

_SYSTEM_ROLES = frozenset({"system", "developer"})


def _checked_messages(row: dict, config: FormatConfig) -> list[dict[str, Any]]:
    messages = row.get(config.messages_key)
    if messages is None:
        raise RowError(f"missing key {config.messages_key!r}")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{config.messages_key!r} must be a non-empty list of {{role, content}} objects")
    try:
        return normalize_messages(messages)
    except ContentError as error:
        raise RowError(str(error)) from None


def _supervised_turns(messages: list[dict[str, Any]], loss_on: LossOn) -> list[int]:
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if loss_on == "last-turn":
        return assistant[-1:]
    return assistant


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
    if chat_template is None:
        text, spans, segments = _render_builtin(messages, tools, turns, units)
        add_special = True
    else:
        text, spans, segments = _render_template(messages, tools, turns, units, chat_template, special)
        add_special = False  # templates write their own BOS
    if config.loss_on == "all":
        spans = ((0, len(text)),)
    if config.chat_truncation == "end":  # no round is dropped and no text trimmed: the end is cut
        segments = [(position, kind & ANSWER, -1) for position, kind, _ in segments]
    return Rendered(text, tuple(spans), add_special, last_supervised, tuple(segments), cut)


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


def _render_template(messages, tools, turns, units, chat_template: str, special):
    """Text, supervised spans and segments of a conversation rendered with a Jinja chat template.

    Assistant turn ``i`` spans from the end of ``messages[:i]`` rendered with the generation prompt
    to the end of ``messages[:i + 1]`` (so it holds the end-of-turn marker). The same prefixes bound
    the rounds; user text is found in the text between them. A template that does not render
    prefixes as prefixes of the whole gets no segments (a long conversation is cut at its end).
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
            )
        except Exception as error:  # jinja raises TemplateError, or whatever raise_exception() is given
            raise RowError(f"the chat template failed on this conversation: {error}") from None
        return texts[0], (generation[0] if generation else [])

    generation_blocks = "{% generation %}" in chat_template or "{%- generation %}" in chat_template
    text, generation = render(messages, assistant_mask=generation_blocks)
    bounds: dict[int, tuple[int, int]] = {}  # assistant turn -> (start, end) in text
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, _ = render(messages[:turn], generation_prompt=True)
        through, _ = render(messages[: turn + 1])
        if text.startswith(through) and through.startswith(prefix):
            bounds[turn] = (len(prefix), len(through))
        elif turn in turns and not generation_blocks:
            raise RowError(
                "the chat template does not render conversations prefix by prefix (it rewrites earlier "
                "turns), so assistant spans cannot be located; use --loss-on all, or a template with "
                "{% generation %} blocks"
            )
    if generation_blocks:
        spans = [tuple(span) for span in generation]
        if len(turns) < len(spans):  # last-turn: keep the last generation block
            spans = spans[-len(turns) :] if turns else []
    else:
        spans = [bounds[turn] for turn in turns]
    return text, spans, _template_segments(text, messages, units, bounds, render)


def _template_segments(text, messages, units, bounds, render) -> list[tuple[int, int, int]]:
    """Segments of a template-rendered conversation (see `_render_template`); [] when the template
    does not render every prefix needed as a prefix of the whole."""
    assistant = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
    if len(bounds) < len(assistant):
        return []
    leading = units.index(0) if 0 in units else len(messages)
    system_end = 0
    if leading and 0 in units:
        head, _ = render(messages[:leading])
        if not text.startswith(head):
            return []
        system_end = len(head)
    segments = [(0, KEEP, -1), (system_end, KEEP, units[leading] if leading < len(units) else -1)]
    cursor = system_end
    for number, (message, unit) in enumerate(zip(messages, units, strict=True)):
        if number < leading:
            continue
        if number in bounds:
            start, end = bounds[number]
            segments += [
                (start, ANSWER, unit),
                (end, KEEP, units[number + 1] if number + 1 < len(units) else -1),
            ]
            cursor = end
            continue
        content = message["content"].strip()
        found = text.find(content, cursor) if content else -1
        if found < 0:
            continue
        segments += [(found, _content_kind(message["role"]), unit), (found + len(content), KEEP, unit)]
        cursor = found + len(content)
    segments.append((len(text), KEEP, -1))
    if any(b[0] < a[0] for a, b in itertools.pairwise(segments)):
        return []
    return segments
