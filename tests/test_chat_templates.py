"""Chat templates as families ship them (tests/chat_templates.py): Llama-3, Qwen3 (reasoning kept for
the last turn only), Mistral v0.3 and later (system prompt moved), Gemma (system merged into the first
user turn) and ChatML with generation blocks, each packed with ``assistant`` and ``last-turn`` loss
through the public API and the command line, on a real Llama-style SentencePiece tokenizer trained
here. The supervised tokens are compared one by one with the supervised text written by hand below
(and with transformers' ``return_assistant_tokens_mask`` where the template has generation blocks);
no sample supervises anything after its end marker; template variables, message weights and unknown
message keys."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from tightpack.output_folder import MANIFEST_NAME
from tightpack.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig

from .chat_templates import SPECIAL_TOKENS, TEMPLATES, conversations
from .conftest import run_main, write_jsonl
from .test_pipeline import read_sequences
from .test_tokenizer import conversation_texts

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
    """One tokenizer folder per template: a Llama-style SentencePiece BPE (1,500 pieces trained on real
    conversations), loaded and saved by transformers with the templates' special tokens added."""
    import sentencepiece
    from transformers import AutoTokenizer

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(conversation_texts(20_000)),
        model_writer=model,
        vocab_size=1500,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        minloglevel=2,
    )
    root = tmp_path_factory.mktemp("templates")
    spm = root / "spm"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (spm / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(spm)
    assert len(tokenizer) >= 1500, "the transformers-5 trap: an empty tokenizer"
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    result = {}
    for name, template in TEMPLATES.items():
        tokenizer.chat_template = template
        tokenizer.save_pretrained(root / name)
        result[name] = root / name
    return result


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
