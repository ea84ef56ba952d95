"""Sample formats: one input row -> text plus the character spans that carry the loss.

Two formats (``--format``):

- ``prompt-completion``: ``{input, output}`` (keys configurable) joined by a prompt template, by
  default ``"{input} {output}"`` as Megatron-Bridge; the template must end with the output key. The
  loss is on the completion (and the EOS).
- ``chat``: ``messages`` = a list of ``{role, content}`` with roles system, developer, user, assistant,
  tool, in the OpenAI form: content parts, tool calls and tool results are checked and normalized by
  `tightpack.prepare.chat_content`; optional ``tools`` (JSON schemas) are passed to the chat template.
  Rendered with the tokenizer's chat template when it has one, else with a built-in template.
  The loss is on the assistant turns (``assistant``), on the last assistant turn (``last-turn``) or
  everywhere (``all``).
- ``tokens``: pre-tokenized rows, ``input_ids`` and an optional ``loss_mask``
  (`tightpack.prepare.pretokenized`); no text, no tokenizer call.
- ``auto`` picks ``chat`` for a row with ``messages`` and ``prompt-completion`` otherwise, row by row;
  inputs whose first row is pre-tokenized (``input_ids``, no ``messages`` or input key) are
  ``tokens`` for the whole run (`run_format`: token rows take another path than text rows).

The chat rendering (the built-in chat template, chat loss spans and segments) is
`tightpack.prepare.chat_render`; the shared `Rendered` and `RowError` are `tightpack.prepare.rendered`.

End of a sample: the model must learn to stop, once. A prompt-completion sample and a chat sample
rendered with the built-in template get an EOS token appended (unless the text already ends with it),
supervised when the last message is: the built-in template's EOS is its end marker. A chat template
closes each turn with its own end marker (``<|im_end|>``, ``<|eot_id|>``, ``</s>``,
``<end_of_turn>``): the assistant turn's supervision ends with it, the whitespace the template
writes after it is not supervised, and no EOS is appended (transformers' assistant mask appends
nothing either). Only a template that writes nothing after the content of a last assistant turn
gets the EOS.
How turns are located in a template's rendering is `tightpack.prepare.template_turns`.
"""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tightpack.core.truncation import ANSWER, KEEP, PROMPT, TruncationMethod
from tightpack.errors import TightpackError, check_choice
from tightpack.prepare.chat_content import CHAT_ROLES
from tightpack.prepare.chat_render import _render_chat
from tightpack.prepare.pretokenized import TOKENS_KEY
from tightpack.prepare.rendered import Rendered, RowError, _bounded
from tightpack.prepare.vision_rows import MediaError, MediaItem, VisionSpec, vision_row

__all__ = ["CHAT_ROLES", "FormatConfig", "Rendered", "RowError", "render_row", "row_kind", "run_format"]

Format = Literal["auto", "prompt-completion", "chat", "tokens"]
LossOn = Literal["assistant", "last-turn", "all"]
ChatTruncation = Literal["oldest-turns", "end"]


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
        template_vars: extra variables of the chat template (``{"enable_thinking": False}``), given
            as a mapping or ``(name, value)`` pairs and kept as pairs sorted by name; values are JSON
            values. Part of the store's cache key and of the manifest's settings.

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
    template_vars: tuple[tuple[str, Any], ...] | Mapping[str, Any] = dataclasses.field(default=(), hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_vars", _template_vars(self.template_vars))
        check_choice("format", self.format, get_args(Format))
        check_choice("loss_on", self.loss_on, get_args(LossOn))
        check_choice("truncation_method", self.truncation_method, get_args(TruncationMethod))
        check_choice("chat_truncation", self.chat_truncation, get_args(ChatTruncation))
        fields = {field for _, field, _, _ in string.Formatter().parse(self.template) if field}
        unknown = sorted(set(self.truncation_fields) - fields)
        if self.truncate_fields is not None and unknown:
            raise TightpackError(
                f"truncate_fields {', '.join(unknown)} is not a field of the prompt template "
                f"{self.template!r}; its fields are {', '.join(sorted(fields))}",
                parameters=("truncate_fields",),
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


# What the renderer itself passes to a chat template: a variable may not replace it.
_RESERVED_VARS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


def _template_vars(given: Any) -> tuple[tuple[str, Any], ...]:
    items = given.items() if isinstance(given, Mapping) else given
    try:
        pairs = sorted(((str(name), value) for name, value in items), key=lambda pair: pair[0])
    except (TypeError, ValueError):
        raise TightpackError(
            f"template_vars must be a mapping of names to values or (name, value) pairs, got {given!r}"
        ) from None
    for name, value in pairs:
        if not name.isidentifier() or name in _RESERVED_VARS:
            raise TightpackError(
                f"template variable {name!r} cannot be set: a name must be an identifier and not one of "
                f"{', '.join(sorted(_RESERVED_VARS))}"
            )
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise TightpackError(
                f"template variable {name!r} must be a JSON value (string, number, bool, null, list, "
                f"object), got {type(value).__name__}"
            ) from None
    if len({name for name, _ in pairs}) != len(pairs):
        raise TightpackError(f"template variables name one variable twice: {[name for name, _ in pairs]}")
    return tuple(pairs)


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
        kind = row_kind(row, config)
    media: tuple[MediaItem, ...] = ()
    if kind == "chat" and config.vision is not None:
        try:
            row, media = vision_row(row, config.vision, config.messages_key)
        except MediaError as error:
            raise RowError(str(error)) from None
    if kind == "chat":  # a sample with media is never cut: a cut could take placeholders with it
        rendered = _render_chat(row, config, chat_template, special_tokens, None if media else text_budget)
    else:
        rendered = _render_prompt_completion(row, config, text_budget)
    if config.vision is None:
        return rendered
    _check_placeholders(rendered.text, media, config.vision)
    return dataclasses.replace(rendered, media=media)


def row_kind(row: dict, config: FormatConfig) -> str:
    """What ``auto`` reads an object row as: ``chat`` (it has the messages key) or
    ``prompt-completion``. Rows of one kind give the same samples under ``auto`` as under that format
    (so `tightpack.store_reuse` lets them share one token store)."""
    return "chat" if config.messages_key in row else "prompt-completion"


def run_format(config: FormatConfig, first_row: Any) -> FormatConfig:
    """``config`` with ``auto`` resolved once for the run where it must be: pre-tokenized rows are read
    by another path than text rows (`tightpack.prepare.pretokenized`), so when the first row is one
    (``input_ids``, and neither the messages key nor the input key) the whole run is ``tokens``, and a
    later text row is a bad row. Otherwise ``auto`` stays: chat or prompt-completion, row by row.

    >>> run_format(FormatConfig(), {"input_ids": [5, 6], "loss_mask": [0, 1]}).format
    'tokens'
    >>> run_format(FormatConfig(), {"messages": [], "input_ids": [5]}).format
    'auto'
    """
    tokens = (
        isinstance(first_row, dict)
        and TOKENS_KEY in first_row
        and config.messages_key not in first_row
        and config.input_key not in first_row
    )
    return dataclasses.replace(config, format="tokens") if config.format == "auto" and tokens else config


def _check_placeholders(text: str, media: tuple[MediaItem, ...], vision: VisionSpec) -> None:
    """Each media item has exactly its one placeholder token in the text: the vision tokens are
    reserved, and text that spells them would be read as images."""
    for kind in ("image", "video"):
        token = vision.tokens[kind]
        found, items = text.count(token), sum(item.kind == kind for item in media)
        if found != items:
            raise RowError(
                f"the text holds {found} {token} for {items} {kind} parts: the vision tokens are reserved "
                "for image and video parts; remove them from the text"
            )


def _missing_key(key: str, row: dict) -> RowError:
    found = ", ".join(sorted(map(str, row))) or "none"
    return RowError(f"missing key {key!r} (keys found: {found}); set input_key/output_key or format")


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


class _StrictRow(dict):
    """Template values: strings only, so that a list or a number in the prompt is reported."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if not isinstance(value, str):
            raise RowError(f"key {key!r} must be a string, got {type(value).__name__}")
        return value
