"""The sample settings of a run (`FormatConfig`: format, keys, template, loss, truncation, chat
template variables, vision) and their checks; `tightpack.prepare.formats` formats rows by them and
`tightpack.prepare.chat_render` renders chat rows by them."""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tightpack.core.truncation import TruncationMethod
from tightpack.errors import TightpackError, check_choice
from tightpack.prepare.vision_rows import VisionSpec

__all__ = ["FormatConfig"]

Format = Literal["auto", "prompt-completion", "chat", "tokens", "preference", "kto", "groups"]
PREFERENCE_FORMATS: tuple[str, ...] = ("preference", "kto", "groups")
"""The formats whose rows are preference units (`tightpack.prepare.preference_rows`), not SFT samples."""
LossOn = Literal["assistant", "last-turn", "all"]
ChatTruncation = Literal["oldest-turns", "end"]


@dataclass(frozen=True, kw_only=True)
class FormatConfig:
    """How rows become training text.

    Attributes:
        format: ``auto``, ``prompt-completion``, ``chat`` or ``tokens`` (SFT samples); ``preference``
            (prompt / chosen / rejected), ``kto`` or ``groups`` (units of a prompt and its branches,
            `tightpack.prepare.preference_rows`; the offline path only).
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
        if self.format in PREFERENCE_FORMATS:
            return  # no prompt template: a unit's rows have their own keys (the run refuses SFT settings)
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
