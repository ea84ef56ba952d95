"""Where each assistant turn lies in a conversation rendered by a chat template, for templates that
render conversations prefix by prefix and for those that rewrite earlier turns (Qwen3 drops the
reasoning of turns before the last user query, Mistral places the system prompt in the last user
message, Gemma merges it into the first one). `tightpack.prepare.chat_render` builds loss spans and
truncation segments from these positions.

The rule, one for every template (``text`` is the whole conversation rendered):

1. Content: render the conversation again with the turn's content replaced by a sentinel; the text
   the two renderings share at their start and at their end bounds what the template wrote from the
   content, ``[a, b)`` in ``text``.
2. Start: the supervised span starts where the generation prompt before the turn ends. In the
   rendering of the conversation up to this turn, the text between the end of the generation prompt
   (the rendering of the earlier messages with ``add_generation_prompt``) and the content is the
   turn's lead (``<think>\\n`` the model must write, a space); the span starts that many characters
   before ``a`` when ``text`` holds the same lead there, else at ``a``.
3. End: the template's closing of the turn is what it writes after the content (``<|im_end|>\\n``,
   ``<|eot_id|>``, ``</s>``, ``<end_of_turn>\\n``, tool calls before them); the span ends after it,
   without its trailing whitespace (the next header follows, not something the model writes).

A template that renders every prefix as a prefix of the whole gets the spans of rendering it prefix
by prefix, less the whitespace after the end marker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Private-use characters: no real content starts or ends with them, so the shared start and end of
# the two renderings stop exactly at the content.
SENTINEL = "\ue000\ue001\ue000"

Render = Callable[..., str]


@dataclass(frozen=True)
class Turn:
    """An assistant turn located in the rendered text (character positions, half-open).

    Attributes:
        start: where its supervised text starts (end of the generation prompt before it).
        content: ``(a, b)``, what the template wrote from the message's content.
        end: end of its supervised text: the closing end marker, trailing whitespace excluded.
        close: end of the closing with its whitespace: where the next message's text starts.
    """

    start: int
    content: tuple[int, int]
    end: int
    close: int


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (a binary search over slices, so the
    comparisons run in C).

    >>> common_prefix("<|im_end|>\\nuser", "<|im_end|>\\n")
    11
    """
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix(a: str, b: str, limit: int) -> int:
    low, high = 0, min(len(a), len(b), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle :] == b[len(b) - middle :]:
            low = middle
        else:
            high = middle - 1
    return low


def _content_region(text: str, marked: str) -> tuple[int, int] | None:
    """``[a, b)`` of ``text`` where it differs from ``marked`` (the same rendering with a sentinel in
    place of one content); None when they are equal (the template did not write that content)."""
    if text == marked:
        return None
    start = common_prefix(text, marked)
    end = len(text) - _common_suffix(text, marked, min(len(text), len(marked)) - start)
    return start, end


def _with_sentinel(messages: list[dict[str, Any]], turn: int, calls: bool = False) -> list[dict[str, Any]]:
    """``messages`` with the content of ``turn`` replaced by the sentinel; ``calls``: the name and the
    arguments of its tool calls too (for templates that write the calls in place of the content; the
    calls stay, with their ids, so that the tool turns after them still render)."""
    message = {**messages[turn], "content": SENTINEL}
    if calls:
        message["tool_calls"] = [
            {**call, "function": {**call["function"], "name": SENTINEL, "arguments": {SENTINEL: SENTINEL}}}
            for call in message["tool_calls"]
        ]
    return [message if i == turn else m for i, m in enumerate(messages)]


def _turn_region(
    text: str, messages: list[dict[str, Any]], turn: int, render: Render
) -> tuple[int, int] | None:
    """Where ``text`` (``messages`` rendered) holds what the template wrote for assistant ``turn``: from
    its content, or, when the template does not write the content (Llama-3.1 and Mistral write the tool
    calls in its place), from its tool calls; None when neither shows in the text."""
    region = _content_region(text, render(_with_sentinel(messages, turn)))
    if region is None and messages[turn].get("tool_calls"):
        region = _content_region(text, render(_with_sentinel(messages, turn, calls=True)))
    return region


_FOLLOWER = {"role": "user", "content": SENTINEL}


def _closing_end(closing: str, followed: str) -> int:
    r"""How much of ``closing`` (what the template writes after a turn's content at the end of a
    conversation) closes the turn: the part it shares with ``followed`` (what it writes when another
    message follows), cut back to the last whole word when the two part inside one (``<|end|>\n<|``
    of ``<|endoftext|>`` and ``<|user|>``), then without trailing whitespace.

    >>> _closing_end("<|im_end|>\n", "<|im_end|>\n<|im_start|>user")
    10
    >>> _closing_end("<|end|>\n<|endoftext|>", "<|end|>\n<|user|>\nhi")
    7
    """
    shared = common_prefix(closing, followed)
    if shared < len(closing) and shared < len(followed):
        shared = max(closing.rfind(c, 0, shared) + 1 for c in " \n\t>]}")
    return len(closing[:shared].rstrip())


def _prompt_end(prompt: str, through: str, content_start: int) -> int:
    """Where the generation prompt ``prompt`` ends in ``through`` (the rendering up to the turn):
    its length when it is a prefix, else the end of the longest tail of it found before the content
    (a template that rewrites an earlier message for the prompt, e.g. Mistral's system placement)."""
    if through.startswith(prompt) and len(prompt) <= content_start:
        return len(prompt)
    head = through[:content_start]
    low, high = 0, min(len(prompt), content_start)
    while low < high:  # "a tail of length k occurs in head" holds for every k up to the longest
        middle = (low + high + 1) // 2
        if prompt[len(prompt) - middle :] in head:
            low = middle
        else:
            high = middle - 1
    if low == 0:
        return content_start
    return head.rfind(prompt[len(prompt) - low :]) + low


def _followed_closing(messages, turn: int, render: Render, b: int, text: str) -> str | None:
    """What the template writes after the last turn's content when a user message follows it; None
    when it refuses such a conversation or rewrites the turn for it."""
    try:
        longer = render([*messages, _FOLLOWER])
    except Exception:
        return None
    return longer[b:] if longer[:b] == text[:b] else None


def locate_turns(text: str, messages: list[dict[str, Any]], render: Render) -> dict[int, Turn]:
    """The assistant turns of ``messages`` in ``text`` (their rendering), by the module's rule.

    ``render(conversation, generation_prompt=False)`` renders a list of messages with the template.
    A turn whose content the template does not write is left out.
    """
    located: dict[int, Turn] = {}
    floor = 0
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        region = _turn_region(text, messages, turn, render)
        if region is None:
            continue
        a, b = region
        through = render(messages[: turn + 1])
        if text.startswith(through) and b <= len(through):
            local = region  # rendered prefix by prefix: the same positions
        else:
            local = _turn_region(through, messages[: turn + 1], turn, render)
            if local is None:
                continue
        prompt = render(messages[:turn], generation_prompt=True)
        lead = through[_prompt_end(prompt, through, local[0]) : local[0]]
        start = a - len(lead) if text.endswith(lead, floor, a) and a - len(lead) >= floor else a
        closing = through[local[1] :]
        shared = common_prefix(text[b : b + len(closing)], closing)
        followed = text[b:]
        if turn == len(messages) - 1:  # what the template writes when a message follows the last turn
            followed = _followed_closing(messages, turn, render, b, text) or followed
        end = b + _closing_end(closing, followed)
        located[turn] = Turn(start, (a, b), max(end, b), b + shared)
        floor = b + shared
    return located
