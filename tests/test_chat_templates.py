"""Chat templates as families ship them (tests/chat_templates.py): Llama-3, Qwen3 (reasoning kept for
the last turn only), Mistral v0.3 and later (system prompt moved), Gemma (system merged into the first
user turn) and ChatML with generation blocks, each packed with ``assistant`` and ``last-turn`` loss
through the public API and the command line, on a real Llama-style SentencePiece tokenizer trained
here. The supervised tokens are compared one by one with the supervised text written by hand below
(and with transformers' ``return_assistant_tokens_mask`` where the template has generation blocks);
no sample supervises anything after its end marker; template variables, message weights and unknown
message keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tightpack.offline.output_folder import MANIFEST_NAME
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig

from .chat_templates import TEMPLATES, conversations, template_folders
from .conftest import run_main, write_jsonl
from .test_pipeline import read_sequences

END_MARKERS = {
    "llama3": "<|eot_id|>",
    "qwen3": "<|im_end|>",
    "mistral-v0.3": "</s>",
    "mistral-later": "</s>",
    "gemma": "<end_of_turn>",
    "chatml-one-block": "<|im_end|>",
    "chatml-two-blocks": "<|im_end|>",
    "chatml-dash-block": "<|im_end|>",
}
BLOCK_TEMPLATES = ("chatml-one-block", "chatml-two-blocks", "chatml-dash-block")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tokenizer folder per template (a Llama-style SentencePiece BPE with the templates' special
    tokens added: `tests.chat_templates.template_folders`)."""
    return template_folders(tmp_path_factory.mktemp("templates"))


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return conversations(50)


def expected_turns(name: str, messages: list[dict], loss_on: str, variables: dict | None = None) -> list[str]:
    """The supervised text of a conversation, written from each family's documented behaviour: every
    supervised turn is the text the model writes after the generation prompt, through its end marker."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last = assistant[-1]
    thinking = (variables or {}).get("enable_thinking", True)
    texts = []
    for i in assistant if loss_on == "assistant" else [last]:
        message = messages[i]
        if message.get("weight", 1) == 0:
            continue
        content, reasoning = message["content"], message["reasoning_content"]
        if name == "llama3":
            texts.append(content.strip() + "<|eot_id|>")
        elif name == "qwen3":  # reasoning for the turn after the last user query; with thinking off the
            # empty think block belongs to the generation prompt
            if i == last and thinking:
                texts.append(f"<think>\n{reasoning}\n</think>\n\n{content}<|im_end|>")
            else:
                texts.append(content + "<|im_end|>")
        elif name == "mistral-v0.3":
            texts.append(" " + content.strip() + "</s>")
        elif name == "mistral-later":
            texts.append(content + "</s>")
        elif name == "gemma":
            texts.append(content.strip() + "<end_of_turn>")
        elif name == "chatml-two-blocks":
            texts += [f"<think>\n{reasoning}\n</think>", content + "<|im_end|>"]
        else:
            texts.append(content + "<|im_end|>")
    return texts


def expected_mask(tokenizer, text: str, texts: list[str]) -> tuple[list[int], np.ndarray]:
    """Token ids of ``text`` and the mask of the tokens overlapping the expected supervised texts, found
    in order in ``text`` from its end (the last turn is the last of its equals)."""
    spans, cursor = [], len(text)
    for part in reversed(texts):
        start = text.rindex(part, 0, cursor)
        spans.append((start, start + len(part)))
        cursor = start
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s < end and e > start for start, end in spans) for s, e in encoding["offset_mapping"]]
    return encoding["input_ids"], np.array(mask, dtype=np.int8)


def pack(source: Path, out: Path, folder: Path, loss_on: str, size: int = 8192, **format_options) -> dict:
    config = PackConfig(
        packed_sequence_size=size,
        workers=1,
        reuse_store=False,
        format=FormatConfig(format="chat", loss_on=loss_on, **format_options),
    )
    pack_dataset([source], out, config, tokenizer=folder)
    return read_sequences(out)


def unshifted(sequence: dict) -> np.ndarray:
    """The per-token mask of a stored sequence (the packs store it label-aligned: mask[t] is token t+1)."""
    return np.r_[0, sequence["mask"][:-1]].astype(np.int8)


@pytest.mark.parametrize("loss_on", ["assistant", "last-turn"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_supervised_tokens_are_the_expected_text(name, loss_on, folders, rows, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders[name])
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    sequences = pack(source, tmp_path / "out", folders[name], loss_on)
    assert sorted(sequences) == list(range(len(rows))), "no row refused or dropped"
    for index, row in enumerate(rows):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        ids, mask = expected_mask(tokenizer, text, expected_turns(name, row["messages"], loss_on))
        got = sequences[index]
        assert got["tokens"].tolist() == ids, f"row {index}: the template's tokens, no EOS appended"
        np.testing.assert_array_equal(unshifted(got), mask, err_msg=f"{name} {loss_on} row {index}")
        if name in BLOCK_TEMPLATES and loss_on == "assistant":
            reference = tokenizer.apply_chat_template(
                row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            np.testing.assert_array_equal(unshifted(got), reference["assistant_masks"])


def test_qwen3_with_thinking_off_through_the_command_line(folders, rows, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["qwen3"])
    source = write_jsonl(tmp_path / "rows.jsonl", rows[:10])
    outputs = {}
    for name, extra in (("on", []), ("off", ["--template-var", "enable_thinking=false"])):
        run = run_main(
            [
                "pack",
                source,
                "-o",
                tmp_path / name,
                "--pack-size",
                8192,
                "--tokenizer",
                folders["qwen3"],
                "--format",
                "chat",
                "--loss-on",
                "last-turn",
                "--workers",
                1,
                *extra,
            ],
            env={"TIGHTPACK_CACHE": str(tmp_path / "cache")},
        )
        assert run.returncode == 0, run.stderr
        outputs[name] = read_sequences(tmp_path / name)
    manifest = json.loads((tmp_path / "off" / MANIFEST_NAME).read_text())
    assert manifest["settings"]["format"]["template_vars"] == [["enable_thinking", False]]
    for index, row in enumerate(rows[:10]):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, enable_thinking=False)
        texts = expected_turns("qwen3", row["messages"], "last-turn", {"enable_thinking": False})
        ids, mask = expected_mask(tokenizer, text, texts)
        got = outputs["off"][index]
        assert got["tokens"].tolist() == ids
        np.testing.assert_array_equal(unshifted(got), mask)
        assert unshifted(got).sum() < unshifted(outputs["on"][index]).sum(), "the think block is not learned"


def test_template_var_errors_are_one_line(tmp_path, rows):
    source = write_jsonl(tmp_path / "rows.jsonl", rows[:2])
    run = run_main(
        ["pack", source, "-o", tmp_path / "o", "--pack-size", 512, "--template-var", "enable_thinking"]
    )
    assert run.returncode == 2
    assert "--template-var 'enable_thinking' must be NAME=VALUE" in run.stderr


def no_supervision_after_end_marker(packs: Path, folder: Path, end_marker: str) -> None:
    """Through the public collate path: in every sequence the last supervised label is the end marker
    and a supervised end marker is never followed by a supervised label (no second EOS, no newline)."""
    from transformers import AutoTokenizer

    from tightpack.runtime.collate import PackedCollate
    from tightpack.runtime.dataset import PackedDataset

    marker = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(end_marker)
    dataset = PackedDataset(packs)
    collate = PackedCollate.from_dataset(dataset)
    batch = collate([dataset[i] for i in range(len(dataset))])
    labels, mask = batch["labels"].numpy(), batch["loss_mask"].numpy().astype(bool)
    bounds = batch["cu_seqlens_q"].numpy()
    sequences = 0
    for r in range(len(labels)):
        for start, stop in zip(bounds[r][:-1], bounds[r][1:], strict=True):
            if stop <= start or not mask[r, start:stop].any():
                continue
            sequences += 1
            supervised = np.flatnonzero(mask[r, start:stop]) + start
            assert labels[r, supervised[-1]] == marker, "the last supervised label is the end marker"
            after = supervised[labels[r, supervised] == marker] + 1
            after = after[after < stop]
            assert not mask[r, after].any(), "nothing after an end marker is supervised"
    assert sequences == 50


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_no_supervision_after_the_end_marker(name, folders, rows, tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    pack(source, tmp_path / "out", folders[name], "assistant", size=4096)
    no_supervision_after_end_marker(tmp_path / "out", folders[name], END_MARKERS[name])


# Gemma merges the system prompt into the first user turn, so its rounds are not dropped: its long rows
# are made to fit by trimming user text and earlier answers, many short segments sharing the cut (the
# share of a segment shorter than it passes to the others, not to the last answer: core/truncation.py),
# and each such row says why (reason turns_kept, or answer_cut when the last answer lost tokens too).
@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("loss_on", ["assistant", "last-turn"])
def test_oldest_turns_keeps_the_last_turn_for_every_template(name, loss_on, folders, rows, tmp_path):
    """50 multi-turn rows with a system message through ``tightpack pack`` at 8192 (nothing cut) and at
    1024 (oldest-turns): no row refused, none dropped for lack of supervision, and every cut sample
    ends with its last assistant turn whole."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders[name])
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    for size in (8192, 1024):
        out = tmp_path / f"out-{size}"
        run = run_main(
            [
                "pack",
                source,
                "-o",
                out,
                "--pack-size",
                size,
                "--tokenizer",
                folders[name],
                "--format",
                "chat",
                "--loss-on",
                loss_on,
                "--workers",
                1,
                "--no-reuse",
            ]
        )
        assert run.returncode == 0, run.stderr
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        assert manifest["excluded"]["no_supervised"] == [], manifest["excluded"]
        by_reason = manifest["excluded"]["truncated_by_reason"]
        if name == "gemma":  # no round dropped, and every cut row says why
            assert by_reason["turns_dropped"] == [] and by_reason["prompt_trimmed"] == []
            assert (
                sorted(by_reason["turns_kept"] + by_reason["answer_cut"]) == manifest["excluded"]["truncated"]
            )
            assert (size == 1024) == bool(by_reason["turns_kept"]), by_reason
            assert "turns kept (the template merges turns)" in run.stdout or size == 8192
        else:
            assert by_reason["turns_kept"] == []
        sequences = read_sequences(out)
        assert sorted(sequences) == list(range(len(rows)))
        for index, row in enumerate(rows):
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
            ids, mask = expected_mask(tokenizer, text, expected_turns(name, row["messages"], "last-turn"))
            last = int(np.flatnonzero(mask)[0])  # the last turn's first supervised token
            got = sequences[index]["tokens"].tolist()
            assert got[-(len(ids) - last) :] == ids[last:], (
                f"{name} at {size}: row {index} keeps its last turn"
            )
            assert len(got) <= size + 1


def weighted(rows: list[dict], weights: list[int]) -> list[dict]:
    """The rows with ``weight`` set on their assistant turns, in order (cycled)."""
    result = []
    for row in rows:
        assistant = [m for m in row["messages"] if m["role"] == "assistant"]
        lookup = {id(m): weights[i % len(weights)] for i, m in enumerate(assistant)}
        result.append(
            {"messages": [{**m, "weight": lookup[id(m)]} if id(m) in lookup else m for m in row["messages"]]}
        )
    return result


@pytest.mark.parametrize("template", ["llama3", None], ids=["llama3", "builtin"])
def test_message_weight_zero_is_not_supervised(template, folders, rows, tmp_path):
    """OpenAI's fine-tuning format: ``weight`` 0 on an assistant turn takes it out of the loss."""
    from transformers import AutoTokenizer

    data = weighted(rows[:20], [0, 1])  # the first, third, ... assistant turn of each row weigh 0
    source = write_jsonl(tmp_path / "rows.jsonl", data)
    if template is None:
        config = PackConfig(
            packed_sequence_size=8192, workers=1, reuse_store=False, format=FormatConfig(format="chat")
        )
        pack_dataset([source], tmp_path / "out", config)
        plain = write_jsonl(tmp_path / "plain.jsonl", rows[:20])
        pack_dataset([plain], tmp_path / "plain", config)
        got, whole = read_sequences(tmp_path / "out"), read_sequences(tmp_path / "plain")
        for index in range(20):
            assert 0 < got[index]["mask"].sum() < whole[index]["mask"].sum()
        return
    tokenizer = AutoTokenizer.from_pretrained(folders["llama3"])
    sequences = pack(source, tmp_path / "out", folders["llama3"], "assistant")
    for index, row in enumerate(data):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        _, mask = expected_mask(tokenizer, text, expected_turns("llama3", row["messages"], "assistant"))
        np.testing.assert_array_equal(unshifted(sequences[index]), mask)


def test_weight_zero_on_the_last_turn_with_last_turn_leaves_no_supervision(folders, rows, tmp_path):
    data = weighted(rows[:4], [1, 0])
    data = [r for r in data if [m for m in r["messages"] if m["role"] == "assistant"][-1]["weight"] == 0]
    assert data
    source = write_jsonl(tmp_path / "rows.jsonl", [*data, rows[5]])
    config = PackConfig(
        packed_sequence_size=8192,
        workers=1,
        reuse_store=False,
        format=FormatConfig(format="chat", loss_on="last-turn"),
    )
    pack_dataset([source], tmp_path / "out", config, tokenizer=folders["llama3"])
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["excluded"]["no_supervised"] == list(range(len(data)))


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ({"role": "assistant", "content": "a", "weight": 0.5}, r"'weight' must be 0 \(not supervised\) or 1"),
        ({"role": "assistant", "content": "a", "weight": "1"}, r"'weight' must be 0 .* got '1'"),
        ({"role": "user", "content": "a", "weight": 1}, r"message 0 \(user\) has a 'weight'; only assistant"),
    ],
)
def test_bad_weights_are_bad_rows(message, reason, tmp_path):
    rows = [{"messages": [message, {"role": "assistant", "content": "b"}]}]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    run = run_main(["pack", source, "-o", tmp_path / "out", "--pack-size", 256, "--format", "chat"])
    assert run.returncode != 0
    assert re.search(reason, run.stderr), run.stderr


def test_unknown_message_keys_are_reported_once_per_run(rows, tmp_path, caplog):
    data = [{"messages": [{**m, "lang": "en", "mood": "ok"} for m in row["messages"]]} for row in rows[:30]]
    source = write_jsonl(tmp_path / "rows.jsonl", data)
    for run_number in range(2):
        caplog.clear()
        run = run_main(
            [
                "pack",
                source,
                "-o",
                tmp_path / f"out{run_number}",
                "--pack-size",
                4096,
                "--workers",
                1,
                "--no-reuse",
            ]
        )
        assert run.returncode == 0, run.stderr
        notes = [r.message for r in caplog.records if "is not one tightpack knows" in r.message]
        assert [note.split("'")[1] for note in notes] == ["lang", "mood"], (run_number, run.stderr)


def test_template_vars_in_the_python_api():
    config = FormatConfig(format="chat", template_vars={"persona": "a pirate", "enable_thinking": False})
    assert config.template_vars == (("enable_thinking", False), ("persona", "a pirate"))
    assert config == FormatConfig(
        format="chat", template_vars=[("persona", "a pirate"), ("enable_thinking", False)]
    )
    assert hash(FormatConfig(template_vars={"tags": ["a", "b"]})) == hash(FormatConfig())
    from tightpack.errors import TightpackError

    for given, message in [
        ({"messages": []}, r"template variable 'messages' cannot be set"),
        ({"add_generation_prompt": True}, r"'add_generation_prompt' cannot be set"),
        ({"bad name": 1}, r"a name must be an identifier"),
        ({"when": object()}, r"'when' must be a JSON value"),
        ([("a", 1), ("a", 2)], r"name one variable twice"),
    ]:
        with pytest.raises(TightpackError, match=message):
            FormatConfig(template_vars=given)


def test_template_vars_need_a_chat_template(rows, tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", rows[:2])
    run = run_main(
        ["pack", source, "-o", tmp_path / "o", "--pack-size", 4096, "--template-var", "enable_thinking=false"]
    )
    assert run.returncode == 2
    assert "template variables (--template-var) are set but tokenizer 'gpt2 (built-in)'" in run.stderr
    config = PackConfig(
        packed_sequence_size=4096, format=FormatConfig(template_vars={"enable_thinking": False})
    )
    from tightpack.errors import TightpackError

    with pytest.raises(
        TightpackError, match=r"^template variables \(template_vars\) are set but tokenizer 'gpt2"
    ):
        pack_dataset([source], tmp_path / "p", config)


def test_a_model_trained_on_the_packs_learns_no_second_end_marker(folders, rows, tmp_path):
    """A tiny Llama trained briefly on the ChatML packs (the last 64 tokens of every sample, where turns
    end) against the same model trained on the packs as they were before, where the template's newline
    after ``<|im_end|>`` and an appended EOS were supervised too: only the second learns to write an EOS
    after ``<|im_end|>\\n``."""
    import torch
    from transformers import AutoTokenizer

    from .hf_training import tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(folders["chatml-one-block"])
    end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    sequences = pack(source, tmp_path / "out", folders["chatml-one-block"], "assistant", size=4096)
    ours, before = [], []
    for sequence in sequences.values():
        tokens, mask = sequence["tokens"], unshifted(sequence)
        assert tokens[-2] == end and mask[-2] == 1 and mask[-1] == 0, "the sample ends <|im_end|>\\n"
        ours.append((tokens, mask))
        # The former rule: the newline after the end marker and an appended EOS supervised.
        before.append((np.r_[tokens, eos], np.r_[mask[:-1], 1, 1]))

    window = 64
    # The ids the windows use, renumbered 0, 1, ...: the same learning problem with a small output
    # layer (the tokenizer's 50k-entry one was most of the test's time).
    used = np.unique(np.concatenate([t[-window:] for t, _ in ours + before] + [[eos]]))

    def train(samples):
        ids = torch.tensor(
            np.searchsorted(used, np.stack([t[-window:] for t, _ in samples])), dtype=torch.long
        )
        mask = torch.tensor(np.stack([m[-window:] for _, m in samples]), dtype=torch.bool)
        labels = torch.where(mask, ids, -100)
        model = tiny_llama(len(used), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(40):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return model

    probe = torch.tensor(np.searchsorted(used, np.stack([tokens[-window:] for tokens, _ in ours[:10]])))

    def eos_after_end_marker(model) -> float:
        with torch.no_grad():
            logits = model(input_ids=probe, use_cache=False).logits[:, -1]
        return float(torch.softmax(logits, -1)[:, int(np.searchsorted(used, eos))].mean())

    p_ours, p_before = eos_after_end_marker(train(ours)), eos_after_end_marker(train(before))
    assert p_before > 0.5, f"the former labels teach an EOS after <|im_end|>\\n ({p_before:.3f})"
    assert p_ours < 0.05, f"tightpack's packs do not ({p_ours:.3f})"


@pytest.mark.parametrize("name", ["llama3", "chatml-one-block", "qwen3"])
def test_rows_without_a_system_message_drop_their_oldest_rounds(name, folders, rows, tmp_path):
    """The template's own text before the first turn (its BOS) is not part of round 0: conversations
    without a system message drop whole rounds as those with one do (they were all cut as turns_kept)."""
    no_system = [{"messages": [m for m in row["messages"] if m["role"] != "system"]} for row in rows]
    out = tmp_path / "out"
    run = run_main(
        ["pack", write_jsonl(tmp_path / "rows.jsonl", no_system), "-o", out, "--pack-size", 1024,
         "--tokenizer", folders[name], "--format", "chat", "--workers", 1, "--no-reuse"]
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    by_reason = json.loads((out / MANIFEST_NAME).read_text())["excluded"]["truncated_by_reason"]
    assert by_reason["turns_kept"] == [] and by_reason["turns_dropped"], by_reason


def _supervised(rendered) -> list[str]:
    return [rendered.text[start:end] for start, end in rendered.spans]


_TOOL_ROW = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "content": "25C"},
        {"role": "assistant", "content": "It is 25C."},
    ],
}


def test_a_closing_that_differs_at_the_end_of_the_conversation_is_cut_at_the_end_marker():
    """Phi-3-style: the EOS is written only after the last turn, so the closing there is
    ``<|end|>\\n<|endoftext|>`` and between turns ``<|end|>\\n<|user|>``: both supervise ``<|end|>``
    alone (before, the next ``<|`` header and the newline and EOS were supervised)."""
    from tightpack.prepare.formats import FormatConfig, render_row

    from .chat_templates import PHI3

    turns = [("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"), ("assistant", "Goodbye")]
    row = {"messages": [{"role": role, "content": content} for role, content in turns]}
    rendered = render_row(row, FormatConfig(format="chat"), PHI3, {"eos_token": "<|endoftext|>"})
    assert _supervised(rendered) == ["Hello<|end|>", "Goodbye<|end|>"]
    assert not rendered.append_eos and rendered.text.endswith("<|end|>\n<|endoftext|>")


def test_tool_calls_written_in_place_of_the_content_are_supervised_and_tools_with_a_system_turn_render():
    """Llama-3.1-style: the call's JSON is the turn's text (it was left unsupervised), and a template
    that refuses the system turn alone with tools no longer refuses the row."""
    from tightpack.prepare.formats import FormatConfig, render_row

    from .chat_templates import LLAMA31_TOOLS

    rendered = render_row(_TOOL_ROW, FormatConfig(format="chat"), LLAMA31_TOOLS, {"bos_token": "<s>"})
    assert _supervised(rendered) == [
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>',
        "It is 25C.<|eot_id|>",
    ]


def test_a_conversation_ending_with_a_user_turn_gets_no_eos_after_the_templates_text():
    from tightpack.prepare.formats import FormatConfig, render_row

    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"}]}  # fmt: skip
    rendered = render_row(row, FormatConfig(format="chat"), TEMPLATES["chatml-one-block"], {})
    assert rendered.text.endswith("Bye<|im_end|>\n") and not rendered.append_eos


def test_a_template_that_merges_turns_keeps_the_last_question_and_trims_old_rounds_whole(folders, tmp_path):
    """Gemma-style (the system prompt inside the first user turn): rounds are not dropped, and the
    earlier rounds give their user text and their answers, oldest first, before the last user question
    loses anything; the system prompt and the last answer stay whole."""
    from transformers import AutoTokenizer

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    messages = [{"role": "system", "content": "SYSPROMPT be concise."}]
    for number in range(6):
        messages.append({"role": "user", "content": f"USER{number} " + " ".join(words * 3)})
        messages.append({"role": "assistant", "content": f"ASST{number} " + " ".join(words * 3)})
    messages[-2]["content"] = "USER5 what is the last question?"
    messages[-1]["content"] = "ASST5 the last answer."
    source = write_jsonl(tmp_path / "rows.jsonl", [{"messages": messages}])
    for size in (256, 160):
        out = tmp_path / f"out-{size}"
        config = PackConfig(packed_sequence_size=size, format=FormatConfig(format="chat"))
        result = pack_dataset([source], out, config, tokenizer=folders["gemma"])
        assert result.counts["truncated_turns_kept"] == 1, result.counts
        text = AutoTokenizer.from_pretrained(folders["gemma"]).decode(read_sequences(out)[0]["tokens"])
        assert "SYSPROMPT be concise." in text and "USER5 what is the last question?" in text
        assert text.rstrip().endswith("ASST5 the last answer.<end_of_turn>"), text
        assert "USER0" not in text  # the oldest round gave first
