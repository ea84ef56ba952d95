"""What formatting one row produces: a `Rendered` sample (text, supervised character spans and
truncation segments), the `RowError` of a row that cannot be formatted, and `_bounded`, the cut of a
field longer than the text budget. Shared by `tightpack.prepare.formats` (prompt-completion rows,
the dispatch of `render_row`) and `tightpack.prepare.chat_render` (chat rows)."""

from __future__ import annotations

from dataclasses import dataclass

from tightpack.prepare.vision_rows import MediaItem


class RowError(Exception):
    """A row that cannot be formatted; the caller adds the row's location."""


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
        append_eos: whether an EOS is appended; False when a chat template closed the last turn with
            its own end marker (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``), which then ends the
            sample.
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool
    eos_supervised: bool
    segments: tuple[tuple[int, int, int], ...] = ()
    cut: bool = False
    media: tuple[MediaItem, ...] = ()
    append_eos: bool = True


def _bounded(text: str, budget: int | None) -> tuple[str, bool]:
    """``text`` without its middle when it is longer than twice ``budget`` characters, and whether it
    was cut. Truncation keeps a start or an end of every field, never its middle, and ``budget`` holds
    more tokens than any sample may keep: the tokens kept are the same as from the whole text."""
    if budget is None or len(text) <= 2 * budget:
        return text, False
    return text[:budget] + text[-budget:], True
