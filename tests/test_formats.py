"""Sample formats: rows -> text and supervised character spans (tightpack.prepare.formats).

Offsets in the expected values are counted by hand from the rendered text; each test also checks
the text under every span, so an off-by-one shows as a visible string difference.
"""

from __future__ import annotations

import pytest

from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig, Rendered, RowError, render_row

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Assistant content inside {% generation %} blocks (the transformers convention for assistant masks).
# The block tags trim the newline that follows them (the template environment uses trim_blocks).
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]


def chat(**kwargs) -> FormatConfig:
    return FormatConfig(format="chat", **kwargs)


def covered(rendered: Rendered) -> list[str]:
    return [rendered.text[start:end] for start, end in rendered.spans]


class TestPromptCompletion:
    def test_default_template(self):
        rendered = render_row({"input": "Q?", "output": "A."}, FormatConfig(), None, {})
        # "Q? A.": the prompt "Q? " is 3 characters, the completion "A." is [3, 5).
        # Segments: the input (trimmable, 1) at 0, the literal space at 2, the answer (2) at 3, the end at 5.
        segments = ((0, 0, -1), (0, 1, -1), (2, 0, -1), (3, 2, -1), (5, 0, -1))
        assert rendered == Rendered("Q? A.", ((3, 5),), True, True, segments)

    def test_extra_columns_are_ignored(self):
        rendered = render_row({"input": "a", "output": "b", "id": 7, "meta": [1]}, FormatConfig(), None, {})
        assert (rendered.text, rendered.spans) == ("a b", ((2, 3),))

    def test_custom_keys(self):
        config = FormatConfig(input_key="question", output_key="answer")
        assert config.template == "{question} {answer}"
        rendered = render_row({"question": "2+2?", "answer": "4"}, config, None, {})
        assert rendered.text == "2+2? 4"
        assert covered(rendered) == ["4"]

    def test_custom_template_with_other_columns(self):
        config = FormatConfig(prompt_template="### System: {system}\n### Q: {input}\n### A: {output}")
        row = {"system": "terse", "input": "Why?", "output": "Because."}
        rendered = render_row(row, config, None, {})
        assert rendered.text == "### System: terse\n### Q: Why?\n### A: Because."
        # prompt: "### System: terse\n" 18 + "### Q: Why?\n" 12 + "### A: " 7 = 37, then the completion.
        assert rendered.spans == ((37, 45),)
        assert covered(rendered) == ["Because."]

    def test_custom_template_that_does_not_use_the_input_key(self):
        config = FormatConfig(prompt_template="Q: {question}\nA: {answer}", output_key="answer")
        rendered = render_row({"question": "why", "answer": "because"}, config, None, {})
        assert rendered.text == "Q: why\nA: because"
        assert covered(rendered) == ["because"]

    def test_loss_on_all_covers_the_prompt(self):
        rendered = render_row({"input": "Q?", "output": "A."}, FormatConfig(loss_on="all"), None, {})
        assert rendered.spans == ((0, 5),)
        assert rendered.eos_supervised

    def test_empty_completion_gives_an_empty_span(self):
        rendered = render_row({"input": "Q?", "output": ""}, FormatConfig(), None, {})
        assert (rendered.text, rendered.spans, rendered.eos_supervised) == ("Q? ", ((3, 3),), True)

    def test_non_ascii_offsets_are_characters(self):
        rendered = render_row({"input": "日本", "output": "über"}, FormatConfig(), None, {})
        assert rendered.spans == ((3, 7),)
        assert covered(rendered) == ["über"]

    @pytest.mark.parametrize(
        ("row", "message"),
        [
            ({"output": "b", "other": 1}, r"missing key 'input' \(keys found: other, output\)"),
            ({"input": "a"}, r"missing key 'output' \(keys found: input\)"),
            ({}, r"missing key 'input' \(keys found: none\)"),
        ],
    )
    def test_missing_key_names_the_key_and_the_keys_found(self, row, message):
        with pytest.raises(RowError, match=message):
            render_row(row, FormatConfig(), None, {})

    def test_missing_custom_key_suggests_the_option(self):
        with pytest.raises(RowError, match=r"missing key 'answer' .*set input_key/output_key or format$"):
            render_row({"question": "q"}, FormatConfig(input_key="question", output_key="answer"), None, {})

    @pytest.mark.parametrize(
        ("row", "message"),
        [
            ({"input": "a", "output": ["b"]}, r"key 'output' must be a string, got list"),
            ({"input": "a", "output": None}, r"key 'output' must be a string, got NoneType"),
            ({"input": 3, "output": "b"}, r"key 'input' must be a string, got int"),
            ({"input": {"x": 1}, "output": "b"}, r"key 'input' must be a string, got dict"),
        ],
    )
    def test_non_string_values(self, row, message):
        with pytest.raises(RowError, match=message):
            render_row(row, FormatConfig(), None, {})

    def test_template_column_missing_from_the_row(self):
        config = FormatConfig(prompt_template="{system}: {input} {output}")
        with pytest.raises(RowError, match=r"the prompt template uses key 'system', missing from the row"):
            render_row({"input": "a", "output": "b"}, config, None, {})

    @pytest.mark.parametrize(
        "template",
        [
            "{output} {input}",  # output not at the end
            "{input} {output}.",  # one character after it
            "{input} {output} {output}",  # twice
            "{input}",  # absent
        ],
    )
    def test_template_must_end_with_the_output_key_once(self, template):
        with pytest.raises(TightpackError, match=r"must end with \{output\} \(once\)"):
            FormatConfig(prompt_template=template)

    def test_template_is_checked_against_a_custom_output_key(self):
        with pytest.raises(TightpackError, match=r"'\{input\} \{output\}' must end with \{answer\}"):
            FormatConfig(prompt_template="{input} {output}", output_key="answer")

    def test_unknown_format_and_loss_on(self):
        with pytest.raises(
            TightpackError,
            match=(
                r"^format must be one of auto, prompt-completion, chat, tokens, preference, kto, groups; "
                r"got 'x'$"
            ),
        ):
            FormatConfig(format="x")  # type: ignore[arg-type]
        with pytest.raises(
            TightpackError, match=r"^loss_on must be one of assistant, last-turn, all; got 'y'$"
        ):
            FormatConfig(loss_on="y")  # type: ignore[arg-type]


class TestRowShape:
    @pytest.mark.parametrize(
        ("row", "name"), [([1, 2], "list"), ("text", "str"), (3, "int"), (None, "NoneType")]
    )
    @pytest.mark.parametrize("kind", ["auto", "prompt-completion", "chat"])
    def test_row_not_an_object(self, row, name, kind):
        with pytest.raises(RowError, match=rf"expected a JSON object, got {name}"):
            render_row(row, FormatConfig(format=kind), None, {})


class TestAutoFormat:
    def test_messages_pick_chat(self):
        rendered = render_row({"messages": CONVERSATION[1:3]}, FormatConfig(), None, {})
        assert rendered.text == "<|user|>\nHi\n<|assistant|>\nHello!\n"

    def test_no_messages_picks_prompt_completion(self):
        rendered = render_row({"input": "a", "output": "b"}, FormatConfig(), None, {})
        assert rendered.text == "a b"

    def test_messages_win_over_input_output(self):
        row = {"messages": CONVERSATION[1:3], "input": "a", "output": "b"}
        assert render_row(row, FormatConfig(), None, {}).text.startswith("<|user|>")

    def test_custom_messages_key(self):
        row = {"conversation": CONVERSATION[1:3]}
        rendered = render_row(row, FormatConfig(messages_key="conversation"), None, {})
        assert covered(rendered) == ["Hello!\n"]

    def test_neither_shape_reports_the_prompt_completion_keys(self):
        with pytest.raises(RowError, match=r"missing key 'input' \(keys found: conversation\)"):
            render_row({"conversation": []}, FormatConfig(), None, {})

    def test_forced_prompt_completion_ignores_messages(self):
        with pytest.raises(RowError, match=r"missing key 'input' \(keys found: messages\)"):
            render_row({"messages": CONVERSATION}, FormatConfig(format="prompt-completion"), None, {})


class TestBuiltinChatTemplate:
    TEXT = (
        "<|system|>\nBe brief.\n"  # 11 + 10 = 21
        "<|user|>\nHi\n"  # 9 + 3 -> 33
        "<|assistant|>\nHello!\n"  # header 14 -> 47, body 7 -> 54
        "<|user|>\nBye\n"  # 9 + 4 -> 67
        "<|assistant|>\nSee you.\n"  # header 14 -> 81, body 9 -> 90
    )

    def test_two_turns_with_a_system_prompt(self):
        rendered = render_row({"messages": CONVERSATION}, chat(), None, {})
        assert rendered.text == self.TEXT
        assert rendered.spans == ((47, 54), (81, 90))
        assert covered(rendered) == ["Hello!\n", "See you.\n"]
        assert rendered.add_special_tokens is True
        assert rendered.eos_supervised is True

    def test_last_turn(self):
        rendered = render_row({"messages": CONVERSATION}, chat(loss_on="last-turn"), None, {})
        assert rendered.text == self.TEXT
        assert rendered.spans == ((81, 90),)
        assert rendered.eos_supervised is True

    def test_all(self):
        rendered = render_row({"messages": CONVERSATION}, chat(loss_on="all"), None, {})
        assert rendered.spans == ((0, 90),)
        assert rendered.eos_supervised is True

    def test_tools_are_rendered_first_as_sorted_json(self):
        tools = [{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}]
        rendered = render_row({"messages": CONVERSATION[1:3], "tools": tools}, chat(), None, {})
        header = (
            '<|tools|>\n[{"description": "Weather", "name": "get_weather", '
            '"parameters": {"type": "object"}}]\n'
        )
        assert rendered.text == header + "<|user|>\nHi\n<|assistant|>\nHello!\n"
        start = len(header) + 9 + 3 + 14
        assert rendered.spans == ((start, start + 7),)
        assert covered(rendered) == ["Hello!\n"]

    @pytest.mark.parametrize("tools", [None, []])
    def test_no_tools_or_an_empty_list_renders_no_tools_block(self, tools):
        rendered = render_row({"messages": CONVERSATION[1:3], "tools": tools}, chat(), None, {})
        assert not rendered.text.startswith("<|tools|>")

    def test_conversation_without_assistant_turn(self):
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        for loss_on in ("assistant", "last-turn"):
            rendered = render_row({"messages": messages}, chat(loss_on=loss_on), None, {})
            assert rendered.spans == ()
            assert rendered.eos_supervised is False

    def test_conversation_ending_with_a_user_turn(self):
        messages = CONVERSATION[:4]
        rendered = render_row({"messages": messages}, chat(), None, {})
        assert covered(rendered) == ["Hello!\n"]
        assert rendered.eos_supervised is False, "the EOS follows a user turn"
        last = render_row({"messages": messages}, chat(loss_on="last-turn"), None, {})
        assert covered(last) == ["Hello!\n"], "last-turn is the last assistant turn, not the last message"
        assert last.eos_supervised is False
        everything = render_row({"messages": messages}, chat(loss_on="all"), None, {})
        assert everything.eos_supervised is True

    @pytest.mark.parametrize("role", ["developer", "tool"])
    def test_other_roles(self, role):
        messages = [{"role": role, "content": "x"}, {"role": "assistant", "content": "y"}]
        rendered = render_row({"messages": messages}, chat(), None, {})
        assert rendered.text == f"<|{role}|>\nx\n<|assistant|>\ny\n"


class TestChatErrors:
    @pytest.mark.parametrize(
        ("row", "message"),
        [
            ({"input": "a"}, r"missing key 'messages'"),
            ({"messages": "hello"}, r"'messages' must be a non-empty list of \{role, content\} objects"),
            ({"messages": {"role": "user"}}, r"'messages' must be a non-empty list"),
            ({"messages": []}, r"'messages' must be a non-empty list"),
            ({"messages": [{"role": "user", "content": "a"}, "b"]}, r"message 1 must be an object, got str"),
            ({"messages": [None]}, r"message 0 must be an object, got NoneType"),
            (
                {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
                r"message 1 has unknown role 'bot'; expected one of \['assistant', 'developer', 'system', "
                r"'tool', 'user'\]",
            ),
            ({"messages": [{"content": "a"}]}, r"message 0 has unknown role None"),
            (
                {"messages": [{"role": "user", "content": 5}]},
                r"message 0 \(user\) must have a string 'content', got int",
            ),
            (
                {"messages": [{"role": "assistant"}]},
                r"message 0 \(assistant\) must have a string 'content', got NoneType",
            ),
            (
                {"messages": [{"role": "user", "content": "a"}], "tools": {"name": "f"}},
                r"'tools' must be a list of tool schemas, got dict",
            ),
            (
                {"messages": [{"role": "user", "content": "a"}], "tools": "f"},
                r"'tools' must be a list of tool schemas, got str",
            ),
        ],
    )
    @pytest.mark.parametrize("template", [None, CHATML], ids=["builtin", "jinja"])
    def test_bad_rows(self, row, message, template):
        with pytest.raises(RowError, match=message):
            render_row(row, chat(), template, {})


class TestJinjaChatTemplate:
    def test_spans_cover_content_and_end_of_turn(self):
        rendered = render_row({"messages": CONVERSATION}, chat(), CHATML, {})
        assert rendered.text == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\nSee you.<|im_end|>\n"
        )
        # system turn 12 + 6 + 1 + 9 + 10 + 1 = 39, user turn 12 + 4 + 1 + 2 + 10 + 1 = 30 -> 69;
        # the assistant header "<|im_start|>assistant\n" is 22 -> 91; "Hello!<|im_end|>" is 16 -> 107
        # (the newline after the end marker is the template's, not the model's).
        assert rendered.spans[0] == (91, 107)
        assert covered(rendered) == ["Hello!<|im_end|>", "See you.<|im_end|>"]
        assert rendered.add_special_tokens is False, "templates write their own special tokens"
        assert rendered.append_eos is False, "<|im_end|> ends the sample: no second end marker"

    def test_last_turn_and_all(self):
        last = render_row({"messages": CONVERSATION}, chat(loss_on="last-turn"), CHATML, {})
        assert covered(last) == ["See you.<|im_end|>"]
        everything = render_row({"messages": CONVERSATION}, chat(loss_on="all"), CHATML, {})
        assert everything.spans == ((0, len(everything.text)),)

    def test_first_message_from_the_assistant(self):
        rendered = render_row({"messages": [{"role": "assistant", "content": "Hi"}]}, chat(), CHATML, {})
        assert rendered.text == "<|im_start|>assistant\nHi<|im_end|>\n"
        assert rendered.spans == ((22, 34),)  # "Hi<|im_end|>" is 2 + 10 characters

    def test_conversation_without_assistant_turn(self):
        rendered = render_row({"messages": CONVERSATION[:2]}, chat(), CHATML, {})
        assert rendered.text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        assert (rendered.spans, rendered.eos_supervised) == ((), False)

    def test_special_tokens_and_tools_reach_the_template(self):
        template = (
            "{{ bos_token }}{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
            "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
        )
        row = {"messages": CONVERSATION[1:3], "tools": [{"name": "f"}]}
        rendered = render_row(row, chat(), template, {"bos_token": "<s>", "eos_token": "</s>"})
        assert rendered.text == '<s>TOOLS [{"name": "f"}]\nuser: Hi</s>\nassistant: Hello!</s>\n'
        assert covered(rendered) == ["Hello!</s>"]

    def test_template_without_generation_prompt_supervises_the_header(self):
        # Without add_generation_prompt support the assistant header is part of the turn's span:
        # the span starts where rendering messages[:i] ends. It writes no end marker: the EOS is.
        template = (
            "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
        )
        rendered = render_row({"messages": CONVERSATION[1:3]}, chat(), template, {})
        assert covered(rendered) == ["assistant: Hello!"]
        assert (rendered.append_eos, rendered.eos_supervised) == (True, True)

    def test_generation_blocks(self):
        rendered = render_row({"messages": CONVERSATION}, chat(), CHATML_GENERATION, {})
        assert rendered.text == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\nSee you.<|im_end|>"
        )
        assert covered(rendered) == ["Hello!<|im_end|>", "See you.<|im_end|>"]
        last = render_row({"messages": CONVERSATION}, chat(loss_on="last-turn"), CHATML_GENERATION, {})
        assert covered(last) == ["See you.<|im_end|>"]
        assert last.eos_supervised is True

    def test_generation_blocks_with_whitespace_control(self):
        template = CHATML_GENERATION.replace("{% generation %}", "{%- generation %}")
        rendered = render_row({"messages": CONVERSATION}, chat(), template, {})
        assert covered(rendered) == ["Hello!<|im_end|>", "See you.<|im_end|>"]

    def test_generation_blocks_without_assistant_turn(self):
        rendered = render_row(
            {"messages": CONVERSATION[:2]}, chat(loss_on="last-turn"), CHATML_GENERATION, {}
        )
        assert (rendered.spans, rendered.eos_supervised) == ((), False)

    @pytest.mark.parametrize(
        ("template", "expected"),
        [
            # Renders only the last two messages: earlier turns vanish as the conversation grows.
            (
                "{% for message in messages[-2:] %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
                ["See you."],
            ),
            # A header that depends on the number of messages rewrites the start of the text.
            ("{{ messages | length }} messages\n" + CHATML, ["Hello!<|im_end|>", "See you.<|im_end|>"]),
            # Marks the final message: the marker moves as turns are added.
            (
                "{% for message in messages %}{% if loop.last %}[final] {% endif %}"
                "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}",
                ["Hello!", "See you."],
            ),
        ],
        ids=["last-two", "length-header", "final-marker"],
    )
    def test_template_that_is_not_prefix_stable(self, template, expected):
        # Turns are located in the whole rendering (tightpack.prepare.template_turns): a turn the
        # template does not write ("last-two" drops "Hello!") is not supervised.
        rendered = render_row({"messages": CONVERSATION}, chat(), template, {})
        assert covered(rendered) == expected
        last = render_row({"messages": CONVERSATION}, chat(loss_on="last-turn"), template, {})
        assert covered(last) == expected[-1:]

    def test_loss_on_all_accepts_a_template_that_is_not_prefix_stable(self):
        template = "{{ messages | length }} messages\n" + CHATML
        everything = render_row({"messages": CONVERSATION}, chat(loss_on="all"), template, {})
        assert everything.text.startswith("5 messages\n<|im_start|>system")
        assert everything.spans == ((0, len(everything.text)),)

    def test_template_errors_become_row_errors(self):
        template = (
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with a user') }}"
            "{% endif %}" + CHATML
        )
        with pytest.raises(
            RowError, match=r"the chat template failed on this conversation: .*start with a user"
        ):
            render_row({"messages": CONVERSATION}, chat(), template, {})
        rendered = render_row({"messages": CONVERSATION[1:3]}, chat(), template, {})
        assert covered(rendered) == ["Hello!<|im_end|>"]
