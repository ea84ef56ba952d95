"""Sample formats: one input row -> text plus the character spans that carry the loss.

Two formats (``--format``):

- ``prompt-completion``: ``{input, output}`` (keys configurable) joined by a prompt template, by
  default ``"{input} {output}"`` as Megatron-Bridge; the template must end with the output key. The
  loss is on the completion (and the EOS).
- ``chat``: ``messages`` = a list of ``{role, content}`` with roles system, developer, user, assistant,
  tool; optional ``tools`` (JSON schemas) are passed to the chat template. Rendered with the
  tokenizer's chat template when it has one, else with the built-in template below. The loss is on
  the assistant turns (``assistant``), on the last assistant turn (``last-turn``) or everywhere
  (``all``).
- ``tokens``: pre-tokenized rows, ``input_ids`` and an optional ``loss_mask``
  (`tightpack.prepare.pretokenized`); no text, no tokenizer call.
- ``auto`` picks ``chat`` for a row with ``messages`` and ``prompt-completion`` otherwise.

Built-in chat template (used when the tokenizer has none, e.g. the built-in GPT-2)::

    <|tools|>\\n{tools as JSON}\\n          (only when the row has tools)
    <|{role}|>\\n{content}\\n              (for each message)

An assistant turn's loss span is its content and the newline that closes it, so the model learns
where a turn ends. With a tokenizer's template, the span of assistant turn ``i`` is the text between
rendering ``messages[:i]`` with the generation prompt and rendering ``messages[:i+1]`` (it includes
the end-of-turn marker), or the template's own ``{% generation %}`` blocks when it has them.

Every sample gets an EOS token appended (unless the text already ends with it), supervised when the
last message is: that is how the model learns to stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tightpack.errors import TightpackError, check_choice

__all__ = ["CHAT_ROLES", "FormatConfig", "Rendered", "RowError", "render_row"]

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
Format = Literal["auto", "prompt-completion", "chat", "tokens"]
LossOn = Literal["assistant", "last-turn", "all"]


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
    """

    format: Format = "auto"
    input_key: str = "input"
    output_key: str = "output"
    prompt_template: str | None = None
    messages_key: str = "messages"
    tools_key: str = "tools"
    loss_on: LossOn = "assistant"

    def __post_init__(self) -> None:
        check_choice("--format", self.format, get_args(Format))
        check_choice("--loss-on", self.loss_on, get_args(LossOn))
        suffix = "{" + self.output_key + "}"
        if not self.template.endswith(suffix) or self.template.count(suffix) != 1:
            raise TightpackError(
                f"prompt template {self.template!r} must end with {suffix} (once): the completion is "
                "the supervised tail of the text"
            )

    @property
    def template(self) -> str:
        return self.prompt_template or "{" + self.input_key + "} {" + self.output_key + "}"


@dataclass(frozen=True)
class Rendered:
    """A formatted sample: ``text``, supervised character ``spans`` (sorted, disjoint, half-open),
    whether the tokenizer adds its own special tokens (BOS), and whether the appended EOS is supervised."""

    text: str
    spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool
    eos_supervised: bool


def render_row(
    row: Any, config: FormatConfig, chat_template: str | None, special_tokens: dict[str, str]
) -> Rendered:
    """Format one row.

    >>> render_row({"input": "Q?", "output": "A."}, FormatConfig(), None, {})
    Rendered(text='Q? A.', spans=((3, 5),), add_special_tokens=True, eos_supervised=True)

    Raises:
        RowError: on a row that is not an object, a missing or mistyped key, or an unknown role.
    """
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    kind = config.format
    if kind == "auto":
        kind = "chat" if config.messages_key in row else "prompt-completion"
    if kind == "chat":
        return _render_chat(row, config, chat_template, special_tokens)
    return _render_prompt_completion(row, config)


def _missing_key(key: str, row: dict) -> RowError:
    found = ", ".join(sorted(map(str, row))) or "none"
    return RowError(f"missing key {key!r} (keys found: {found}); set --input-key/--output-key or --format")


def _render_prompt_completion(row: dict, config: FormatConfig) -> Rendered:
    prompt_template = config.template[: -len("{" + config.output_key + "}")]
    try:
        prompt = prompt_template.format_map(_StrictRow(row))
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
    text = prompt + completion
    spans = ((len(prompt), len(text)),) if config.loss_on != "all" else ((0, len(text)),)
    return Rendered(text, spans, add_special_tokens=True, eos_supervised=True)


class _StrictRow(dict):
    """Template values: strings only, so that a list or a number in the prompt is reported."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if not isinstance(value, str):
            raise RowError(f"key {key!r} must be a string, got {type(value).__name__}")
        return value


def _checked_messages(row: dict, config: FormatConfig) -> list[dict[str, str]]:
    messages = row.get(config.messages_key)
    if messages is None:
        raise RowError(f"missing key {config.messages_key!r}")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{config.messages_key!r} must be a non-empty list of {{role, content}} objects")
    if all(
        type(m) is dict and m.get("role") in CHAT_ROLES and type(m.get("content")) is str for m in messages
    ):
        return messages  # the common case, checked in one pass; the loop below says what is wrong
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {number} must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise RowError(
                f"message {number} has unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise RowError(
                f"message {number} ({role}) must have a string 'content', got {type(content).__name__}"
            )
    return messages


def _supervised_turns(messages: list[dict[str, str]], loss_on: LossOn) -> list[int]:
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if loss_on == "last-turn":
        return assistant[-1:]
    return assistant


def _render_chat(
    row: dict, config: FormatConfig, chat_template: str | None, special: dict[str, str]
) -> Rendered:
    messages = _checked_messages(row, config)
    tools = row.get(config.tools_key)
    if tools is not None and not isinstance(tools, list):
        raise RowError(f"{config.tools_key!r} must be a list of tool schemas, got {type(tools).__name__}")
    turns = [] if config.loss_on == "all" else _supervised_turns(messages, config.loss_on)
    last_supervised = config.loss_on == "all" or (bool(turns) and turns[-1] == len(messages) - 1)
    if chat_template is None:
        text, spans = _render_builtin(messages, tools, turns)
        add_special = True
    else:
        text, spans = _render_template(messages, tools, turns, chat_template, special)
        add_special = False  # templates write their own BOS
    if config.loss_on == "all":
        spans = ((0, len(text)),)
    return Rendered(text, tuple(spans), add_special_tokens=add_special, eos_supervised=last_supervised)


_BUILTIN_HEADERS = {role: f"<|{role}|>\n" for role in CHAT_ROLES}


def _render_builtin(messages, tools, turns) -> tuple[str, list[tuple[int, int]]]:
    parts, spans, position = [], [], 0
    if tools:
        parts.append(f"<|tools|>\n{json.dumps(tools, ensure_ascii=False, sort_keys=True)}\n")
        position = len(parts[0])
    supervised = set(turns)
    for number, message in enumerate(messages):
        header, content = _BUILTIN_HEADERS[message["role"]], message["content"]
        position += len(header)
        if number in supervised:  # the content and the newline closing the turn
            spans.append((position, position + len(content) + 1))
        parts += (header, content, "\n")
        position += len(content) + 1
    return "".join(parts), spans


def _render_template(
    messages, tools, turns, chat_template: str, special
) -> tuple[str, list[tuple[int, int]]]:
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

    if "{% generation %}" in chat_template or "{%- generation %}" in chat_template:
        text, generation = render(messages, assistant_mask=True)
        spans = [tuple(span) for span in generation]
        if len(turns) < len(spans):  # last-turn: keep the last generation block
            spans = spans[-len(turns) :] if turns else []
        return text, spans

    text, _ = render(messages)
    spans = []
    for turn in turns:
        prefix, _ = render(messages[:turn], generation_prompt=True)
        through, _ = render(messages[: turn + 1])
        if not (text.startswith(through) and through.startswith(prefix)):
            raise RowError(
                "the chat template does not render conversations prefix by prefix (it rewrites earlier "
                "turns), so assistant spans cannot be located; use --loss-on all, or a template with "
                "{% generation %} blocks"
            )
        spans.append((len(prefix), len(through)))
    return text, spans
