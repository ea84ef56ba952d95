"""Chat messages as users have them: content parts, ``content: null``, tool calls and tool results.

This module owns the checks and the normal form of one row's ``messages``; `tightpack.prepare.formats`
owns everything else about chat rows (the key, ``tools``, rendering, loss spans) and turns a
`ContentError` into its ``RowError`` (this module imports nothing from it, so it can import this one).

Accepted (the OpenAI chat format, which Hugging Face chat templates also take):

- ``role``: system, developer, user, assistant or tool.
- ``content``: a string; or a list of parts ``{"type": "text", "text": ...}``, joined with nothing in
  between (what Hugging Face multimodal templates write when they iterate parts); or null (or absent)
  on an assistant turn with tool calls. Any other part type (image, image_url, audio, input_audio,
  video, ...) is refused: this packing is text only.
- ``tool_calls`` (assistant turns only): a list of ``{"id"?, "type": "function", "function": {"name",
  "arguments"}}``; ``arguments`` is a JSON object or a string holding one (as the OpenAI API writes
  it), parsed here so that templates see an object, as Hugging Face templates expect
  (``{{ tool_call.function.arguments | tojson }}``). A null or empty ``tool_calls`` means none.
- ``weight`` (assistant turns only, OpenAI's fine-tuning format): 1 supervises the turn (the
  default), 0 does not, whatever ``--loss-on`` (``last-turn`` with a last turn of weight 0 leaves the
  row without supervision). Any other value is a bad row.
- ``reasoning_content`` and ``thinking`` (assistant turns): the reasoning that Qwen3-style and
  gpt-oss-style templates render; passed to the template as is.
- ``tool_call_id`` and ``name`` (tool turns): strings when present. A tool turn without ``name`` gets
  the name of the call whose ``id`` is its ``tool_call_id`` (the Hugging Face convention is ``name``;
  the OpenAI one is ``tool_call_id``).

`normalize_messages` returns messages whose ``content`` is a string and whose ``tool_calls`` key is
present only when there are calls (templates test ``'tool_calls' in message``); other keys pass
through. A plain conversation (every message ``{role, content: str}``, no tool turn) is returned as
is after one pass over it.

The built-in template writes each message as ``<|{role}|>\\n{text}\\n`` (`formats`), where the text
is `builtin_message_text`: the content, then one line per tool call, and for a tool turn with a known
name a first line naming the tool::

    <|assistant|>
    Let me check.
    <|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}
    <|tool|>
    <|tool_result|>{"name": "get_weather"}
    {"temp_c": 18}

Call lines are JSON in the format of the ``tojson`` filter of Hugging Face templates (``ensure_ascii``
off, keys in the order given, so arguments keep the order in which a model generates them). Call ids
are not written: they are random strings made by the API, so supervising them would teach noise;
calls and results are matched by order, as in most model templates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TOOL_CALL_PREFIX = "<|tool_call|>"
TOOL_RESULT_PREFIX = "<|tool_result|>"

#: The message keys tightpack knows; any other is passed to the chat template and reported once.
MESSAGE_KEYS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "weight", "reasoning_content", "thinking"}
)

# Roles whose plain {role, content: str} messages need no change; a tool turn may need its name.
_PLAIN_ROLES = CHAT_ROLES - {"tool"}


class ContentError(ValueError):
    """A message that cannot be used; the text names the message number (and part or call number)."""


def normalize_messages(messages: list) -> list[dict[str, Any]]:
    """Check a row's messages and return them with string contents and normalized tool calls.

    ``messages`` must be a list (the caller checks that it is one, and not empty). The input is never
    modified: a plain conversation is returned as the same list, any other as new message dicts.

    >>> normalize_messages([{"role": "user", "content": [{"type": "text", "text": "Hi "},
    ...                                                  {"type": "text", "text": "there"}]}])
    [{'role': 'user', 'content': 'Hi there'}]
    >>> call = {"id": "call_1", "type": "function",
    ...         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    >>> assistant, tool = normalize_messages([
    ...     {"role": "assistant", "content": None, "tool_calls": [call]},
    ...     {"role": "tool", "tool_call_id": "call_1", "content": "18C"}])
    >>> assistant
    {'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'call_1', 'type': 'function', \
'function': {'name': 'get_weather', 'arguments': {'city': 'Paris'}}}]}
    >>> tool
    {'role': 'tool', 'tool_call_id': 'call_1', 'content': '18C', 'name': 'get_weather'}

    Raises:
        ContentError: naming the message (and part or call) number and what is wrong.
    """
    try:
        if all(
            type(m) is dict
            and type(m.get("content")) is str
            and m.get("role") in _PLAIN_ROLES
            and "tool_calls" not in m
            and (
                "weight" not in m
                or (m["role"] == "assistant" and m["weight"] in (0, 1) and type(m["weight"]) is int)
            )
            and None not in m.values()
            for m in messages
        ):
            return messages  # the common case, checked in one pass
    except TypeError:  # an unhashable role (a list, an object): the loop below reports it
        pass
    normalized, call_names = [], {}
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ContentError(f"message {number} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ContentError(
                f"message {number} has unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}"
            )
        # A null key is an absent key: Parquet and datasets give every message every struct field.
        out = {key: value for key, value in message.items() if value is not None or key == "content"}
        calls = message.get("tool_calls")
        if calls is not None and calls != []:
            if role != "assistant":
                raise ContentError(
                    f"message {number} ({role}) has 'tool_calls'; only an assistant turn calls tools"
                )
            out["tool_calls"] = calls = _normalized_calls(calls, number)
            call_names.update((call["id"], call["function"]["name"]) for call in calls if "id" in call)
        else:
            out.pop("tool_calls", None)
        out["content"] = _content_text(message, number, role, has_calls=bool(calls))
        if "weight" in out:
            _check_weight(out["weight"], number, role)
        if role == "tool":
            _check_tool_turn(message, number)
            if message.get("name") is None and message.get("tool_call_id") in call_names:
                out["name"] = call_names[message["tool_call_id"]]
        normalized.append(out)
    return normalized


def builtin_message_text(message: Mapping[str, Any]) -> str:
    """The text the built-in template writes for a normalized message (after its role header).

    >>> builtin_message_text({"role": "user", "content": "Hi"})
    'Hi'
    >>> call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    >>> print(builtin_message_text({"role": "assistant", "content": "On it.", "tool_calls": [call, call]}))
    On it.
    <|tool_call|>{"name": "f", "arguments": {"x": 1}}
    <|tool_call|>{"name": "f", "arguments": {"x": 1}}
    >>> builtin_message_text({"role": "tool", "name": "f", "content": "2"})
    '<|tool_result|>{"name": "f"}\\n2'
    """
    content = message["content"]
    calls = message.get("tool_calls")
    if calls:
        lines = [content] if content else []
        lines += [_call_line(call["function"]) for call in calls]
        return "\n".join(lines)
    if message["role"] == "tool" and message.get("name"):
        return f"{TOOL_RESULT_PREFIX}{json.dumps({'name': message['name']}, ensure_ascii=False)}\n{content}"
    return content


def _call_line(function: Mapping[str, Any]) -> str:
    body = {"name": function["name"], "arguments": function["arguments"]}
    return TOOL_CALL_PREFIX + json.dumps(body, ensure_ascii=False)


def _content_text(message: dict, number: int, role: str, *, has_calls: bool) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(part, number, role, index) for index, part in enumerate(content))
    if content is None:
        if has_calls:
            return ""
        if message.get("function_call") is not None:
            raise ContentError(
                f"message {number} ({role}) has a legacy 'function_call'; write it as 'tool_calls': "
                '[{"type": "function", "function": {"name": ..., "arguments": ...}}]'
            )
    # The wording predates content parts; kept so that existing error matches still hold.
    raise ContentError(
        f"message {number} ({role}) must have a string 'content', got {type(content).__name__}"
    )


def _part_text(part: Any, number: int, role: str, index: int) -> str:
    where = f"message {number} ({role}) content part {index}"
    if not isinstance(part, dict):
        raise ContentError(f"{where} must be an object {{type, text}}, got {type(part).__name__}")
    kind = part.get("type")
    if kind != "text":
        raise ContentError(
            f"{where} has type {kind!r}; text-only packing accepts only 'text' parts: remove the "
            f"non-text parts from the row"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise ContentError(f"{where} (text) must have a string 'text', got {type(text).__name__}")
    return text


def _normalized_calls(calls: Any, number: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ContentError(
            f"message {number} (assistant) 'tool_calls' must be a list, got {type(calls).__name__}"
        )
    return [
        _normalized_call(call, f"message {number} (assistant) tool call {i}") for i, call in enumerate(calls)
    ]


def _normalized_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ContentError(f"{where} must be an object {{type, function}}, got {type(call).__name__}")
    kind = call.get("type")
    if kind is not None and kind != "function":
        raise ContentError(f"{where} has type {kind!r}; only 'function' tool calls are supported")
    function = call.get("function")
    if not isinstance(function, dict):
        raise ContentError(
            f"{where} must have a 'function' object {{name, arguments}}, got {type(function).__name__}"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        got = repr(name) if isinstance(name, str) else type(name).__name__
        raise ContentError(f"{where} must have a non-empty string function 'name', got {got}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ContentError(
                f"{where} ({name}) has 'arguments' that are not valid JSON: {error.msg} at column "
                f"{error.colno}"
            ) from None
        except RecursionError:
            raise ContentError(f"{where} ({name}) has 'arguments' nested too deeply") from None
    if not isinstance(arguments, dict):
        raise ContentError(
            f"{where} ({name}) 'arguments' must be a JSON object or a string holding one, got "
            f"{type(arguments).__name__}"
        )
    try:  # checked here so that rendering never fails: a row value may hold non-JSON objects
        json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise ContentError(f"{where} ({name}) 'arguments' cannot be written as JSON: {error}") from None
    normalized: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    call_id = call.get("id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise ContentError(f"{where} ({name}) 'id' must be a string, got {type(call_id).__name__}")
        normalized = {"id": call_id, **normalized}
    return normalized


def _check_weight(weight: Any, number: int, role: str) -> None:
    if role != "assistant":
        raise ContentError(
            f"message {number} ({role}) has a 'weight'; only assistant turns are weighted (0 or 1)"
        )
    if type(weight) not in (int, float) or weight not in (0, 1):
        raise ContentError(
            f"message {number} (assistant) 'weight' must be 0 (not supervised) or 1 (supervised), got "
            f"{weight!r}"
        )


def _check_tool_turn(message: dict, number: int) -> None:
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise ContentError(
                f"message {number} (tool) {key!r} must be a string, got {type(value).__name__}"
            )
