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
import string
from typing import Any

from tightpack.core.truncation import ANSWER, KEEP, PROMPT
from tightpack.prepare.chat_render import _render_chat
from tightpack.prepare.format_config import FormatConfig
from tightpack.prepare.pretokenized import TOKENS_KEY
from tightpack.prepare.rendered import Rendered, RowError, _bounded
from tightpack.prepare.vision_rows import MediaError, MediaItem, VisionSpec, vision_row

__all__ = ["FormatConfig"]


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
    (so `tightpack.offline.store_reuse` lets them share one token store)."""
    return "chat" if config.messages_key in row else "prompt-completion"


def run_format(config: FormatConfig, first_row: Any) -> FormatConfig:
    """``config`` with ``auto`` resolved once for the run where it must be, by the first row.

    Pre-tokenized rows are read by another path than text rows (`tightpack.prepare.pretokenized`),
    so when the first row is one (``input_ids``, and neither the messages key nor the input key) the
    whole run is ``tokens``. Rows in TRL's preference conventions are units, not samples: ``chosen``
    and ``rejected`` make the run ``preference``, ``prompt`` with ``completions`` ``groups``, and
    ``prompt``, ``completion`` and ``label`` ``kto``. A later row of another kind is a bad row.
    Otherwise ``auto`` stays: chat or prompt-completion, row by row.

    >>> run_format(FormatConfig(), {"input_ids": [5, 6], "loss_mask": [0, 1]}).format
    'tokens'
    >>> run_format(FormatConfig(), {"messages": [], "input_ids": [5]}).format
    'auto'
    >>> run_format(FormatConfig(), {"prompt": "2+2=", "chosen": "4", "rejected": "5"}).format
    'preference'
    """
    if config.format != "auto" or not isinstance(first_row, dict):
        return config
    keys = set(first_row)
    if TOKENS_KEY in keys and config.messages_key not in keys and config.input_key not in keys:
        return dataclasses.replace(config, format="tokens")
    for kind, needed in _PREFERENCE_KEYS:
        if needed <= keys and config.messages_key not in keys and config.input_key not in keys:
            return dataclasses.replace(config, format=kind)
    return config


_PREFERENCE_KEYS = (
    ("preference", {"chosen", "rejected"}),
    ("groups", {"prompt", "completions"}),
    ("kto", {"prompt", "completion", "label"}),
)


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
    if "input_ids" in row:
        return RowError(
            f"missing key {key!r} (keys found: {found}): a pre-tokenized row does not mix with text rows in "
            "one run (pack the pre-tokenized rows in a run of their own)"
        )
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
