"""Sample formats: one input row -> text plus the character spans that carry the loss.

Two formats (``--format``):

- ``prompt-completion``: ``{input, output}`` (keys configurable) joined by a prompt template, by
  default ``"{input} {output}"`` as Megatron-Bridge; the template must end with the output key. The
  loss is on the completion (and the EOS).
- ``chat``: ``messages`` = a list of ``{role, content}`` with roles system, developer, user, assistant,
  tool, in the OpenAI form: content parts, tool calls and tool results are checked and normalized by
  `tightpack.prepare.chat_content`; optional ``tools`` (JSON schemas) are passed to the chat template.
  Rendered with the tokenizer's chat template when it has one, else with the built-in template below.
  The loss is on the assistant turns (``assistant``), on the last assistant turn (``last-turn``) or
  everywhere (``all``).
- ``tokens``: pre-tokenized rows, ``input_ids`` and an optional ``loss_mask``
  (`tightpack.prepare.pretokenized`); no text, no tokenizer call.
- ``auto`` picks ``chat`` for a row with ``messages`` and ``prompt-completion`` otherwise.

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

Every sample gets an EOS token appended (unless the text already ends with it), supervised when the
last message is: that is how the model learns to stop.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import string
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tightpack.core.truncation import ANSWER, KEEP, PROMPT, TruncationMethod
from tightpack.errors import TightpackError, check_choice
from tightpack.prepare.chat_content import CHAT_ROLES, ContentError, builtin_message_text, normalize_messages
from tightpack.prepare.vision_rows import MediaError, MediaItem, VisionSpec, vision_row

__all__ = ["CHAT_ROLES", "FormatConfig", "Rendered", "RowError", "render_row"]

Format = Literal["auto", "prompt-completion", "chat", "tokens"]
LossOn = Literal["assistant", "last-turn", "all"]
ChatTruncation = Literal["oldest-turns", "end"]
_SYSTEM_ROLES = frozenset({"system", "developer"})


class RowError(Exception):
    """A row that cannot be formatted; the caller adds the row's location."""


@dataclass(frozen=True, kw_only=True)
class FormatConfig:
    """How rows become training text.

    Attributes:
        format: ``auto``, ``prompt-completion``, ``chat`` or ``tokens``.
        input_key: prompt column of prompt-completion rows.
        output_key: completion column of prompt-completion rows.
        prompt_template: ``str.format`` template over the row's columns; must end with
            ``{<output_key>}``. None means ``"{<input_key>} {<output_key>}"``.
        messages_key: chat column.
        tools_key: optional column of tool schemas for the chat template.
        loss_on: chat loss: ``assistant`` turns, the ``last-turn`` only, or ``all`` tokens.
        truncate_fields: template fields trimmed first when a prompt-completion sample is over the
            cap (Megatron-Bridge's ``truncation_field``); None means the input field, ``()`` none
            (the sample is then cut at its end).
        truncation_method: ``right`` trims a field's end (keeps its start, the reference's default),
            ``left`` its start; also how chat user text is trimmed.
        chat_truncation: ``oldest-turns`` keeps the system turn and the last round, dropping the
            oldest rounds whole, then trims user text; ``end`` cuts the conversation at its end.
        vision: image and video parts of chat rows become vision tokens
            (`tightpack.prepare.vision_rows`); None refuses them (text-only packing).

    How these are applied is `tightpack.core.truncation`; here they only mark the text.
    """

    format: Format = "auto"
    input_key: str = "input"
    output_key: str = "output"
    prompt_template: str | None = None
    messages_key: str = "messages"
    tools_key: str = "tools"
    loss_on: LossOn = "assistant"
    truncate_fields: tuple[str, ...] | None = None
    truncation_method: TruncationMethod = "right"
    chat_truncation: ChatTruncation = "oldest-turns"
    vision: VisionSpec | None = None

    def __post_init__(self) -> None:
        check_choice("--format", self.format, get_args(Format))
        check_choice("--loss-on", self.loss_on, get_args(LossOn))
        check_choice("--truncation-method", self.truncation_method, get_args(TruncationMethod))
        check_choice("--chat-truncation", self.chat_truncation, get_args(ChatTruncation))
        fields = {field for _, field, _, _ in string.Formatter().parse(self.template) if field}
        unknown = sorted(set(self.truncation_fields) - fields)
        if self.truncate_fields is not None and unknown:
            raise TightpackError(
                f"--truncate-field {', '.join(unknown)} is not a field of the prompt template "
                f"{self.template!r}; its fields are {', '.join(sorted(fields))}"
            )
        suffix = "{" + self.output_key + "}"
        if not self.template.endswith(suffix) or self.template.count(suffix) != 1:
            raise TightpackError(
                f"prompt template {self.template!r} must end with {suffix} (once): the completion is "
                "the supervised tail of the text"
            )

    @property
    def template(self) -> str:
        return self.prompt_template or "{" + self.input_key + "} {" + self.output_key + "}"

    @property
    def truncation_fields(self) -> tuple[str, ...]:
        """The fields trimmed first (``truncate_fields``, by default the input field)."""
        return (self.input_key,) if self.truncate_fields is None else tuple(self.truncate_fields)


@dataclass(frozen=True)
class Rendered:
    """A formatted sample.

    Attributes:
        text: the training text.
        spans: supervised character spans (sorted, disjoint, half-open).
        add_special_tokens: whether the tokenizer adds its own special tokens (BOS).
        eos_supervised: whether the appended EOS is supervised.
        segments: ``(start character, kind, unit)`` of consecutive parts of the text, for truncation
            (`tightpack.core.truncation`); the first starts at 0, the last at ``len(text)`` (what the
            tokenizer appends after the text, and the EOS). Empty: no structure.
        cut: whether a field longer than the text budget lost its middle before tokenizing.
        media: the images and videos of the sample, in the order of their placeholders in the text.
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool
    eos_supervised: bool
    segments: tuple[tuple[int, int, int], ...] = ()
    cut: bool = False
    media: tuple[MediaItem, ...] = ()


def render_row(
    row: Any,
    config: FormatConfig,
    chat_template: str | None,
    special_tokens: dict[str, str],
    text_budget: int | None = None,
) -> Rendered:
    """Format one row.

    ``text_budget`` (characters): a field or message longer than twice this keeps only its first and
    last ``text_budget`` characters (`_bounded`), so a giant row costs memory in proportion to the
    cap, not to the row. None keeps every character.

    >>> rendered = render_row({"input": "Q?", "output": "A."}, FormatConfig(), None, {})
    >>> rendered.text, rendered.spans, rendered.segments
    ('Q? A.', ((3, 5),), ((0, 0, -1), (0, 1, -1), (2, 0, -1), (3, 2, -1), (5, 0, -1)))

    Raises:
        RowError: on a row that is not an object, a missing or mistyped key, or an unknown role.
    """
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    kind = config.format
    if kind == "auto":
        kind = "chat" if config.messages_key in row else "prompt-completion"
    if kind == "chat" and config.vision is not None:
        try:
            row, media = vision_row(row, config.vision, config.messages_key)
        except MediaError as error:
            raise RowError(str(error)) from None
        if media:  # never cut: a cut could take placeholders with it
            rendered = _render_chat(row, config, chat_template, special_tokens, None)
            return dataclasses.replace(rendered, media=media)
    if kind == "chat":
        return _render_chat(row, config, chat_template, special_tokens, text_budget)
    return _render_prompt_completion(row, config, text_budget)


def _missing_key(key: str, row: dict) -> RowError:
    found = ", ".join(sorted(map(str, row))) or "none"
    return RowError(f"missing key {key!r} (keys found: {found}); set --input-key/--output-key or --format")


def _render_prompt_completion(row: dict, config: FormatConfig, text_budget: int | None) -> Rendered:
    """The template's pieces in order: literal text (kept), fields (trimmable when they are truncation
    fields), and the completion (the answer)."""
    prompt_template = config.template[: -len("{" + config.output_key + "}")]
    values = _StrictRow(row)
    formatter = string.Formatter()
    parts: list[str] = []
    segments: list[tuple[int, int, int]] = [(0, KEEP, -1)]
    position, cut = 0, False
    try:
        for literal, field, spec, conversion in formatter.parse(prompt_template):
            if literal:
                segments.append((position, KEEP, -1))
                parts.append(literal)
                position += len(literal)
            if field is None:
                continue
            value, _ = formatter.get_field(field, (), values)
            value = formatter.format_field(formatter.convert_field(value, conversion), spec or "")
            value, was_cut = _bounded(value, text_budget)
            cut |= was_cut
            segments.append((position, PROMPT if field in config.truncation_fields else KEEP, -1))
            parts.append(value)
            position += len(value)
    except KeyError as error:  # a column the template names is not in the row
        key = error.args[0]
        if key == config.input_key:
            raise _missing_key(key, row) from None
        raise RowError(f"the prompt template uses key {key!r}, missing from the row") from None
    if config.output_key not in row:
        raise _missing_key(config.output_key, row)
    completion = row[config.output_key]
    if not isinstance(completion, str):
        raise RowError(f"key {config.output_key!r} must be a string, got {type(completion).__name__}")
    completion, was_cut = _bounded(completion, text_budget)
    segments.append(
        (position, ANSWER | (PROMPT if config.output_key in config.truncation_fields else KEEP), -1)
    )
    prompt = "".join(parts)
    text = prompt + completion
    segments.append((len(text), KEEP, -1))
    spans = ((len(prompt), len(text)),) if config.loss_on != "all" else ((0, len(text)),)
    return Rendered(text, spans, True, True, tuple(segments), cut or was_cut)


def _bounded(text: str, budget: int | None) -> tuple[str, bool]:
    """``text`` without its middle when it is longer than twice ``budget`` characters, and whether it
    was cut. Truncation keeps a start or an end of every field, never its middle, and ``budget`` holds
    more tokens than any sample may keep: the tokens kept are the same as from the whole text."""
    if budget is None or len(text) <= 2 * budget:
        return text, False
    return text[:budget] + text[-budget:], True


class _StrictRow(dict):
    """Template values: strings only, so that a list or a number in the prompt is reported."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if not isinstance(value, str):
            raise RowError(f"key {key!r} must be a string, got {type(value).__name__}")
        return value


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
