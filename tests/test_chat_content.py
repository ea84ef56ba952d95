"""Chat content as users have it (tightpack.prepare.chat_content): parts, null content, tool calls.

Expected texts are written out in full; `render_builtin` below is the built-in template of
`tightpack.prepare.chat_render` (``<|{role}|>\\n{text}\\n`` per message) with the text taken from
`builtin_message_text`.
"""

from __future__ import annotations

import copy

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tightpack.prepare.chat_content import (
    CHAT_ROLES,
    ContentError,
    builtin_message_text,
    normalize_messages,
)

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}

# The OpenAI form: null content on the calling turn, the result linked by tool_call_id only.
OPENAI_TOOL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    {"role": "assistant", "content": "18 °C in Paris."},
]


def render_builtin(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{builtin_message_text(m)}\n" for m in normalize_messages(messages))


class TestToolCalls:
    def test_openai_conversation_normalizes(self):
        system, user, calling, result, answer = normalize_messages(OPENAI_TOOL_CONVERSATION)
        assert (system, user, answer) == (
            OPENAI_TOOL_CONVERSATION[0],
            OPENAI_TOOL_CONVERSATION[1],
            OPENAI_TOOL_CONVERSATION[4],
        )
        assert calling == {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        }
        # The name comes from the call whose id is the result's tool_call_id.
        assert result == {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temp_c": 18}',
            "name": "get_weather",
        }

    def test_openai_conversation_renders_calls_and_results(self):
        assert render_builtin(OPENAI_TOOL_CONVERSATION) == (
            "<|system|>\nYou can call tools.\n"
            "<|user|>\nWeather in Paris?\n"
            "<|assistant|>\n"
            '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            "<|tool|>\n"
            '<|tool_result|>{"name": "get_weather"}\n'
            '{"temp_c": 18}\n'
            "<|assistant|>\n18 °C in Paris.\n"
        )

    def test_content_before_calls_one_line_per_call(self):
        london = copy.deepcopy(WEATHER_CALL)
        london["id"] = "call_2"
        london["function"]["arguments"] = {"city": "London"}
        calling = {"role": "assistant", "content": "Checking both.", "tool_calls": [WEATHER_CALL, london]}
        [normalized] = normalize_messages([calling])
        assert builtin_message_text(normalized) == (
            "Checking both.\n"
            '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '<|tool_call|>{"name": "get_weather", "arguments": {"city": "London"}}'
        )

    def test_ids_are_not_written(self):
        text = render_builtin(OPENAI_TOOL_CONVERSATION)
        assert "call_1" not in text

    def test_arguments_keep_their_order_and_characters(self):
        # Parsed and written back like the tojson filter: keys in the given order, no \\u escapes.
        call = {"type": "function", "function": {"name": "f", "arguments": '{ "z":1,\n "a" : "日本"}'}}
        [normalized] = normalize_messages([{"role": "assistant", "tool_calls": [call]}])
        assert (
            builtin_message_text(normalized)
            == '<|tool_call|>{"name": "f", "arguments": {"z": 1, "a": "日本"}}'
        )

    @pytest.mark.parametrize("content", [None, "absent"])
    def test_null_or_missing_content_with_calls(self, content):
        message = {"role": "assistant", "tool_calls": [WEATHER_CALL]}
        if content != "absent":
            message["content"] = content
        [normalized] = normalize_messages([message])
        assert normalized["content"] == ""
        assert normalized["tool_calls"][0]["function"]["name"] == "get_weather"

    def test_call_without_id_or_type(self):
        call = {"function": {"name": "now", "arguments": {}}}
        [normalized] = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
        assert normalized["tool_calls"] == [
            {"type": "function", "function": {"name": "now", "arguments": {}}}
        ]
        assert builtin_message_text(normalized) == '<|tool_call|>{"name": "now", "arguments": {}}'

    @pytest.mark.parametrize("calls", [None, []])
    def test_null_or_empty_tool_calls_are_dropped(self, calls):
        # A 'tool_calls' key makes templates such as Llama 3.1's take their tool-call branch.
        [user, assistant] = normalize_messages(
            [{"role": "user", "content": "a", "tool_calls": calls}, {"role": "assistant", "content": "b"}]
        )
        assert user == {"role": "user", "content": "a"}
        assert assistant == {"role": "assistant", "content": "b"}

    def test_tool_turn_keeps_its_own_name(self):
        messages = copy.deepcopy(OPENAI_TOOL_CONVERSATION)
        messages[3]["name"] = "weather_service"
        assert normalize_messages(messages)[3]["name"] == "weather_service"

    def test_tool_turn_without_a_known_call_has_no_name(self):
        messages = [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]
        [normalized] = normalize_messages(messages)
        assert normalized == messages[0]
        assert builtin_message_text(normalized) == "x"

    def test_normalizing_twice_changes_nothing(self):
        once = normalize_messages(OPENAI_TOOL_CONVERSATION)
        assert normalize_messages(once) == once

    def test_input_is_not_modified(self):
        messages = copy.deepcopy(OPENAI_TOOL_CONVERSATION)
        normalize_messages(messages)
        assert messages == OPENAI_TOOL_CONVERSATION


class TestContentParts:
    def test_text_parts_are_joined_with_nothing(self):
        content = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
        [normalized] = normalize_messages([{"role": "user", "content": content}])
        assert normalized == {"role": "user", "content": "Hello world"}

    @pytest.mark.parametrize("role", sorted(CHAT_ROLES))
    def test_parts_in_every_role(self, role):
        [normalized] = normalize_messages([{"role": role, "content": [{"type": "text", "text": "x"}]}])
        assert normalized["content"] == "x"

    def test_empty_part_list_is_empty_content(self):
        assert normalize_messages([{"role": "assistant", "content": []}])[0]["content"] == ""

    def test_extra_keys_in_parts_and_messages(self):
        # As Parquet struct columns give them: every field of the struct, null where unused.
        part = {"type": "text", "text": "hi", "image_url": None}
        message = {"role": "user", "content": [part], "name": None, "tool_call_id": None}
        [normalized] = normalize_messages([message])
        assert normalized == {"role": "user", "content": "hi"}  # null keys are absent

    @pytest.mark.parametrize("kind", ["image", "image_url", "input_audio", "audio", "video", "refusal", None])
    def test_non_text_part_is_refused(self, kind):
        parts = [{"type": "text", "text": "What is this?"}, {"type": kind}]
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]
        with pytest.raises(
            ContentError,
            match=rf"^message 1 \(user\) content part 1 has type {kind!r}; text-only packing accepts only "
            r"'text' parts: remove the non-text parts from the row$",
        ):
            normalize_messages(messages)


class TestFastPath:
    def test_plain_messages_are_returned_as_is(self):
        messages = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "weight": 1},
        ]
        assert normalize_messages(messages) is messages

    def test_plain_messages_render_their_content(self):
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        assert [builtin_message_text(m) for m in normalize_messages(messages)] == ["u", "a"]

    def test_tool_turn_takes_the_checked_path(self):
        messages = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
        normalized = normalize_messages(messages)
        assert normalized == messages
        assert normalized is not messages


class TestErrors:
    @pytest.mark.parametrize(
        ("messages", "message"),
        [
            # The wording of the checks formats made before this module: error matches still hold.
            ([{"role": "user", "content": "a"}, "b"], r"^message 1 must be an object, got str$"),
            ([None], r"^message 0 must be an object, got NoneType$"),
            (
                [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
                r"^message 1 has unknown role 'bot'; expected one of \['assistant', 'developer', 'system', "
                r"'tool', 'user'\]$",
            ),
            ([{"content": "a"}], r"^message 0 has unknown role None"),
            ([{"role": ["user"], "content": "a"}], r"^message 0 has unknown role \['user'\]"),
            ([{"role": {"x": 1}, "content": "a"}], r"^message 0 has unknown role \{'x': 1\}"),
            ([{"role": "user", "content": 5}], r"^message 0 \(user\) must have a string 'content', got int$"),
            (
                [{"role": "assistant"}],
                r"^message 0 \(assistant\) must have a string 'content', got NoneType$",
            ),
            (
                [{"role": "user", "content": None}],
                r"^message 0 \(user\) must have a string 'content', got NoneType$",
            ),
            (
                [{"role": "user", "content": {"type": "text", "text": "a"}}],
                r"^message 0 \(user\) must have a string 'content', got dict$",
            ),
            (
                [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
                r"^message 0 \(assistant\) has a legacy 'function_call'; write it as 'tool_calls'",
            ),
            (
                [{"role": "user", "content": ["hi"]}],
                r"^message 0 \(user\) content part 0 must be an object \{type, text\}, got str$",
            ),
            (
                [{"role": "user", "content": [{"type": "text", "text": None}]}],
                r"^message 0 \(user\) content part 0 \(text\) must have a string 'text', got NoneType$",
            ),
            (
                [{"role": "user", "content": "a", "tool_calls": [WEATHER_CALL]}],
                r"^message 0 \(user\) has 'tool_calls'; only an assistant turn calls tools$",
            ),
            (
                [{"role": "assistant", "content": None, "tool_calls": WEATHER_CALL}],
                r"^message 0 \(assistant\) 'tool_calls' must be a list, got dict$",
            ),
            (
                [{"role": "assistant", "content": None, "tool_calls": ["get_weather"]}],
                r"^message 0 \(assistant\) tool call 0 must be an object \{type, function\}, got str$",
            ),
            (
                [{"role": "assistant", "tool_calls": [{**WEATHER_CALL, "type": "code_interpreter"}]}],
                r"^message 0 \(assistant\) tool call 0 has type 'code_interpreter'; only 'function' tool "
                r"calls are supported$",
            ),
            (
                [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": {}}]}],
                r"^message 0 \(assistant\) tool call 0 must have a 'function' object \{name, arguments\}, "
                r"got NoneType$",
            ),
            (
                [{"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": {}}}]}],
                r"^message 0 \(assistant\) tool call 0 must have a non-empty string function 'name', got ''$",
            ),
            (
                [{"role": "assistant", "tool_calls": [{"function": {"name": 3, "arguments": {}}}]}],
                r"^message 0 \(assistant\) tool call 0 must have a non-empty string function 'name', "
                r"got int$",
            ),
            (
                [
                    {
                        "role": "assistant",
                        "tool_calls": [WEATHER_CALL, {"function": {"name": "f", "arguments": "{"}}],
                    }
                ],
                r"^message 0 \(assistant\) tool call 1 \(f\) has 'arguments' that are not valid JSON: "
                r"Expecting property name enclosed in double quotes at column 2$",
            ),
            (
                [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
                r"^message 0 \(assistant\) tool call 0 \(f\) 'arguments' must be a JSON object or a string "
                r"holding one, got list$",
            ),
            (
                [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}],
                r"^message 0 \(assistant\) tool call 0 \(f\) 'arguments' must be a JSON object .*, "
                r"got NoneType$",
            ),
            (
                [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": {"x": {1, 2}}}}],
                    }
                ],
                r"^message 0 \(assistant\) tool call 0 \(f\) 'arguments' cannot be written as JSON: "
                r"Object of type set is not JSON serializable$",
            ),
            (
                [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": {}}}],
                    }
                ],
                r"^message 0 \(assistant\) tool call 0 \(f\) 'id' must be a string, got int$",
            ),
            (
                [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": 1, "content": "x"}],
                r"^message 1 \(tool\) 'tool_call_id' must be a string, got int$",
            ),
            (
                [{"role": "tool", "name": ["f"], "content": "x"}],
                r"^message 0 \(tool\) 'name' must be a string, got list$",
            ),
        ],
    )
    def test_refused_with_the_message_number_and_the_reason(self, messages, message):
        with pytest.raises(ContentError, match=message):
            normalize_messages(messages)

    def test_content_error_is_a_value_error(self):
        assert issubclass(ContentError, ValueError)

    def test_deeply_nested_arguments(self):
        call = {"function": {"name": "f", "arguments": "[" * 100_000}}
        with pytest.raises(
            ContentError,
            match=r"^message 0 \(assistant\) tool call 0 \(f\) has 'arguments' nested too deeply$",
        ):
            normalize_messages([{"role": "assistant", "tool_calls": [call]}])


# A template that prints the content and loops over the calls the way Hugging Face templates do
# (Qwen 2.5, Llama 3.1): the arguments go through tojson, so they must be an object, not a string.
TOOL_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "[{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}]"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}({{ message['name'] }}){% endif %}{{ '\\n' }}{% endfor %}"
)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
)

# Llama 3.1's test: any 'tool_calls' key, even null, selects the tool-call branch.
TOOL_CALLS_KEY_TEMPLATE = (
    "{% for message in messages %}{% if 'tool_calls' in message %}"
    "{% if message.tool_calls | length != 1 %}{{ raise_exception('one call only') }}{% endif %}"
    "CALL {{ message.tool_calls[0].function.name }}{% else %}{{ message.content }}{% endif %}"
    "{{ '\\n' }}{% endfor %}"
)


def render(messages: list[dict], template: str) -> str:
    texts, _ = render_jinja_template([messages], chat_template=template)
    return texts[0]


class TestTokenizerTemplates:
    def test_template_iterating_tool_calls(self):
        assert render(normalize_messages(OPENAI_TOOL_CONVERSATION), TOOL_TEMPLATE) == (
            "<|system|>You can call tools.\n"
            "<|user|>Weather in Paris?\n"
            '<|assistant|>[get_weather {"city": "Paris", "unit": "celsius"}]\n'
            '<|tool|>{"temp_c": 18}(get_weather)\n'
            "<|assistant|>18 °C in Paris.\n"
        )

    def test_string_only_template_gets_flattened_parts(self):
        messages = [
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello"},
        ]
        assert render(normalize_messages(messages), CHATML) == (
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        )

    def test_null_tool_calls_do_not_select_the_tool_branch(self):
        messages = [
            {"role": "user", "content": "q", "tool_calls": None},
            {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
            {"role": "tool", "content": "18", "tool_calls": None},
        ]
        assert render(normalize_messages(messages), TOOL_CALLS_KEY_TEMPLATE) == "q\nCALL get_weather\n18\n"


def test_null_fields_of_parquet_message_structs_are_absent(tmp_path):
    """A Parquet column of message structs gives every message every field, null where a row had none:
    a template testing `is defined` must see them absent, as in the same rows written as JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers.utils.chat_template_utils import render_jinja_template

    rows = [
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "yo"},
            ]
        },
        {"messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "hello"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    from_parquet = pq.read_table(tmp_path / "chat.parquet").to_pylist()[1]["messages"]
    assert from_parquet[0]["name"] is None  # what Arrow hands over
    template = (
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}:{% endfor %}"
    )
    render = lambda messages: render_jinja_template([messages], chat_template=template)[0][0]  # noqa: E731
    assert render(normalize_messages(from_parquet)) == render(rows[1]["messages"]) == "user:assistant:"
