# ruff: noqa: E501 - the templates are Jinja text, kept one statement a line
"""Chat templates written here to follow each family's documented behaviour (not copied from model
repositories), the special tokens they use, and 50 real multi-turn conversations with a system message.

- ``LLAMA3``: ``<|start_header_id|>role<|end_header_id|>\\n\\n`` headers, content trimmed, ``<|eot_id|>``
  after every turn; renders prefix by prefix.
- ``QWEN3``: ChatML; an assistant turn's reasoning (``reasoning_content``, or ``<think>...</think>``
  at the start of its content) is written as ``<think>\\n...\\n</think>\\n\\n`` only for the turns after
  the last user query, and dropped from earlier ones; ``enable_thinking=False`` adds an empty think
  block to the generation prompt.
- ``MISTRAL_V03``: ``[INST] ...[/INST]`` and `` answer</s>``; the system prompt goes before the user
  message only when that message is the last one (v0.3's rule: in training rows it disappears).
- ``MISTRAL_LATER``: ``[INST]...[/INST]answer</s>``; the system prompt is placed before the last user
  message, wherever it is.
- ``GEMMA``: ``<start_of_turn>user|model\\n...<end_of_turn>\\n``; no system role: the system prompt is
  merged into the first user turn.
- ``CHATML_ONE_BLOCK``, ``CHATML_TWO_BLOCKS``, ``CHATML_DASH_BLOCK``: ChatML with ``{% generation %}``
  blocks, one per assistant turn (content and ``<|im_end|>``), two (the think block, then the
  answer), and one spelled ``{%- generation -%}``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .llama_tokenizer import llama_style_folder

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3 = """
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is defined and message.reasoning_content else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
{%- set reasoning = reasoning.strip('\\n') %}
{%- set content = content.lstrip('\\n') %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

_MISTRAL_SYSTEM = """
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
"""

MISTRAL_V03 = (
    _MISTRAL_SYSTEM
    + """
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message['role'] == 'user' %}
{%- if loop.last and system_message is defined %}
{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}
{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}
{%- endif %}
{%- endfor %}
"""
)

MISTRAL_LATER = (
    _MISTRAL_SYSTEM
    + """
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message['role'] == 'user' %}
{%- if loop.index0 == ns.last_user and system_message is defined %}
{{- '[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- endif %}
{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}
{%- endif %}
{%- endfor %}
"""
)

GEMMA = """
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""

_CHATML_OTHER = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"

CHATML_ONE_BLOCK = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}{%- else %}" + _CHATML_OTHER + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHATML_TWO_BLOCKS = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- '<think>\\n' + message['reasoning_content'] + "
    "'\\n</think>' }}{% endgeneration %}{{- '\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}" + _CHATML_OTHER + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHATML_DASH_BLOCK = CHATML_ONE_BLOCK.replace("{% generation %}", "{%- generation -%}").replace(
    "{% endgeneration %}", "{%- endgeneration -%}"
)

TEMPLATES = {
    "llama3": LLAMA3,
    "qwen3": QWEN3,
    "mistral-v0.3": MISTRAL_V03,
    "mistral-later": MISTRAL_LATER,
    "gemma": GEMMA,
    "chatml-one-block": CHATML_ONE_BLOCK,
    "chatml-two-blocks": CHATML_TWO_BLOCKS,
    "chatml-dash-block": CHATML_DASH_BLOCK,
}

# Templates of particular closings and tool calls, for span tests on the rendered text (not in
# TEMPLATES: no tokenizer folder is built for them).

#: Phi-3-style: ``<|role|>\n...<|end|>\n``, and the EOS written once, at the end of a conversation.
PHI3 = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

#: Llama-3.1-style tool calls: an assistant turn with calls is written as the JSON of its call, not its
#: content; the tools go into the first user message, so a conversation without one is refused.
LLAMA31_TOOLS = (
    "{{- bos_token }}"
    "{%- if tools and (messages | selectattr('role', 'equalto', 'user') | list | length) == 0 %}"
    "{{- raise_exception('Cannot put tools in the first user message when there is no first user message!') }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls is defined %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- {'name': m.tool_calls[0].function.name, 'parameters': m.tool_calls[0].function.arguments} | tojson }}"
    "{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = [
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "[INST]",
    "[/INST]",
    "<start_of_turn>",
    "<end_of_turn>",
]

SYSTEM = "You are a friendly assistant. Answer in one or two sentences."


def conversations(count: int = 50, seed_offset: int = 0) -> list[dict]:
    """``count`` rows of real chitchat conversations (2 to 20 rounds each, the first ``count`` long
    enough), each with a system message and a reasoning per assistant turn."""
    location = importlib.util.find_spec("chitchat_dataset").submodule_search_locations[0]
    data = json.loads((Path(location) / "dataset.json").read_text(encoding="utf-8"))
    rows = []
    for conversation in list(data.values())[seed_offset:]:
        texts = [" ".join(message["text"] for message in turn) for turn in conversation["messages"]]
        texts = [text.strip() for text in texts if text.strip()][:40]
        if len(texts) < 4:
            continue
        messages = [{"role": "system", "content": SYSTEM}]
        for number, text in enumerate(texts[: len(texts) // 2 * 2]):
            if number % 2 == 0:
                messages.append({"role": "user", "content": text})
            else:
                reasoning = f"The user wrote {len(texts[number - 1].split())} words; reply in kind."
                messages.append({"role": "assistant", "content": text, "reasoning_content": reasoning})
        rows.append({"messages": messages})
        if len(rows) == count:
            break
    return rows


def template_folders(root: Path) -> dict[str, Path]:
    """One tokenizer folder per template under ``root``: the Llama-style SentencePiece tokenizer of
    `tests.llama_tokenizer`, loaded and saved by transformers with `SPECIAL_TOKENS` added."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_style_folder(root / "spm"))
    if len(tokenizer) < 1500:
        raise RuntimeError("the transformers-5 trap: an empty tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    folders = {}
    for name, template in TEMPLATES.items():
        tokenizer.chat_template = template
        tokenizer.save_pretrained(root / name)
        folders[name] = root / name
    return folders
