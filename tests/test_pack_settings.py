"""Ids and settings come from the packs (issue 25, section 3), on real packs written by ``tightpack pack``.

Packs are made once per module with the command line: ``llama`` (a 32,000-token Llama-style tokenizer
whose EOS ``</s>`` is id 2, aligned to 4, pack size 256) and ``gpt2`` (the built-in GPT-2, ids up to
50,256, unaligned). ``*_mb`` are their Megatron-Bridge-style copies: the shard and metadata only, no
manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import run_main, write_jsonl
from tightpack.errors import TightpackError
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.hf_trainer import PackingCollator
from tightpack.runtime.pack_rows import PackRowError

PACK_SIZE = 256
LLAMA_VOCAB = 32_000


def _llama_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer laid out as Llama's: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (EOS), 32,000 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, LLAMA_VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "bos_token": "<s>"}), encoding="utf-8"
    )
    return folder


def _mb_copy(source: Path, target: Path) -> Path:
    """The packs as Megatron-Bridge lays them out: ``training_<P>.idx.parquet``, its metadata, no manifest."""
    target.mkdir()
    shutil.copy(source / "packs-00000.idx.parquet", target / f"training_{PACK_SIZE}.idx.parquet")
    shutil.copy(source / "metadata.json", target / f"{PACK_SIZE}_metadata.jsonl")
    return target


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pack-settings")
    rng = np.random.default_rng(25)

    def words(count: int) -> str:
        return " ".join(f"w{int(i)}" for i in rng.integers(3, LLAMA_VOCAB, size=count))

    rows = [
        {"input": words(int(rng.integers(1, 40))), "output": words(int(rng.integers(1, 25)))}
        for _ in range(160)
    ]
    corpus = write_jsonl(root / "corpus.jsonl", rows)
    made = {"tokenizer": _llama_tokenizer(root / "llama-tokenizer")}
    for name, options in (
        ("llama", ["--tokenizer", made["tokenizer"], "--pad-seq-to-mult", "4"]),
        ("gpt2", []),
    ):
        run = run_main(
            ["pack", corpus, "--output", root / name, "--pack-size", PACK_SIZE, "--workers", 1, *options]
        )
        assert run.returncode == 0, run.stderr
        made[name] = root / name
        made[f"{name}_mb"] = _mb_copy(root / name, root / f"{name}-mb")
    return made


def _rows(dataset: PackedDataset) -> list[dict]:
    return [dataset[index] for index in range(len(dataset))]


# --- PackedCollate ---------------------------------------------------------------------------------------


def test_from_dataset_takes_the_llama_packs_ids(packs):
    """Pad id 2 and multiple 4 come from the manifest: the width padding is EOS 2 (GPT-2's 50256
    before, which a 32,000-token embedding cannot look up)."""
    dataset = PackedDataset(packs["llama"])
    collate = PackedCollate.from_dataset(dataset)
    manifest = packs["llama"] / "manifest.json"
    assert (collate.pack_size, collate.eos_id, collate.pad_seq_to_mult, collate.vocab_size) == (
        PACK_SIZE, 2, 4, LLAMA_VOCAB,
    )  # fmt: skip
    assert collate.sources["eos_id"] == f"tokenizer.eos_id of {manifest}"
    shortest = min(range(len(dataset)), key=lambda index: len(dataset[index]["input_ids"]))
    batch = collate([dataset[shortest]])
    width = batch["tokens"].shape[1]
    real = int(batch["cu_seqlens_q_padded"][0, -2])
    assert real < width and set(batch["tokens"][0, real:].tolist()) == {2}
    assert int(batch["tokens"].max()) < LLAMA_VOCAB


TRAINING_LOOP_PAGE = "docs/training-loop.md"  # the section was the README's until issue 27


def _page_block(page: str, section: str) -> str:
    text = (Path(__file__).resolve().parents[1] / page).read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1]
    return body.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_training_loop_runs_on_llama_packs(packs, tmp_path, monkeypatch):
    """The "Training on packed rows" block of docs/training-loop.md, as written, on Llama packs in
    ./packed, with a 32,000-token Llama as ``hf_model``: it padded with GPT-2's 50256 and the forward
    raised IndexError."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.copytree(packs["llama"], tmp_path / "packed")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIGHTPACK_PROBE", "0")
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    torch.manual_seed(0)
    scope = {"rank": 0, "world": 1, "hf_model": LlamaForCausalLM(config)}
    exec(
        compile(_page_block(TRAINING_LOOP_PAGE, "Training on packed rows"), TRAINING_LOOP_PAGE, "exec"), scope
    )
    assert scope["collate"].eos_id == 2 and scope["collate"].pad_seq_to_mult == 4
    assert scope["outputs"].logits.shape[-1] == LLAMA_VOCAB and torch.isfinite(scope["outputs"].logits).all()


def test_gpt2s_eos_id_on_llama_packs_names_both_values(packs):
    manifest = packs["llama"] / "manifest.json"
    with pytest.raises(TightpackError) as error:
        PackedCollate.from_dataset(PackedDataset(packs["llama"]), eos_id=50256)
    assert str(error.value).startswith(
        f"eos_id 50256 (PackedCollate argument) disagrees with 2 (tokenizer.eos_id of {manifest}): "
    )
    gpt2 = r"\(the EOS id of tokenizer 'gpt2 \(built-in\)'\)"
    with pytest.raises(
        TightpackError, match=rf"^eos_id 2 \(tokenizer.eos_id of .*\) disagrees with 50256 {gpt2}"
    ):
        PackedCollate.from_dataset(packs["llama"], tokenizer=load_tokenizer(None))
    with pytest.raises(
        TightpackError,
        match=r"^eos_id 50256 \(PackedCollate argument\) lies outside the vocabulary of 32000 tokens "
        r"\(PackedCollate argument vocab_size\)$",
    ):
        PackedCollate(pack_size=4096, eos_id=50256, vocab_size=LLAMA_VOCAB)


@pytest.mark.parametrize("multiple", [1, 2, 3, 8])
def test_a_multiple_that_disagrees_with_the_packs_is_refused(packs, multiple):
    dataset = PackedDataset(packs["llama"])
    manifest = packs["llama"] / "manifest.json"
    with pytest.raises(TightpackError) as error:
        PackedCollate.from_dataset(dataset, pad_seq_to_mult=multiple)
    assert str(error.value).startswith(
        f"pad_seq_to_mult {multiple} (PackedCollate argument) disagrees with 4 (settings.pad_seq_to_mult of "
        f"{manifest}): "
    )
    # Built by hand, the collate cannot read the manifest; the rows themselves refuse the wrong multiple:
    # segments that are not multiples of 3 or 8, or more padding (seq_len) than 1 or 2 allow.
    collate = PackedCollate(pack_size=PACK_SIZE, eos_id=2, pad_seq_to_mult=multiple)
    key = "seq_start_id" if multiple in (3, 8) else "seq_len"
    with pytest.raises(PackRowError, match=rf"^packed row \d+ of the batch: {key} ") as row:
        collate(_rows(dataset))
    assert f"pad_seq_to_mult {multiple} (PackedCollate argument)" in str(row.value)
    assert row.value.key == key


def test_packs_without_a_manifest_need_the_ids_given_and_the_rows_check_them(packs):
    folder = packs["llama_mb"]
    metadata = folder / f"{PACK_SIZE}_metadata.jsonl"
    settings = PackedDataset(folder).settings
    assert (settings.manifest, settings.eos_id, settings.pad_seq_to_mult) == (None, None, None)
    assert str(settings.pack_size) == f"{PACK_SIZE} (pack_size of {metadata})"
    with pytest.raises(TightpackError, match=r"needs the packs' EOS id .* pass eos_id= .* or tokenizer="):
        PackedCollate.from_dataset(folder, pad_seq_to_mult=4)
    with pytest.raises(
        TightpackError, match=r"needs the packs' alignment multiple: .* pass pad_seq_to_mult="
    ):
        PackedCollate.from_dataset(folder, tokenizer=packs["tokenizer"])
    collate = PackedCollate.from_dataset(folder, tokenizer=packs["tokenizer"], pad_seq_to_mult=4)
    assert (collate.eos_id, collate.vocab_size, collate.pack_size) == (2, LLAMA_VOCAB, PACK_SIZE)
    dataset = PackedDataset(folder)
    by_manifest = PackedCollate.from_dataset(packs["llama"])(_rows(PackedDataset(packs["llama"])))
    batch = collate(_rows(dataset))
    assert all(
        torch.equal(batch[key], by_manifest[key]) for key in ("tokens", "cu_seqlens_q", "cu_seqlens_q_padded")
    )
    with pytest.raises(
        TightpackError, match=r"^pack_size 128 \(PackedCollate argument\) is below the packs' 256"
    ):
        PackedCollate.from_dataset(folder, tokenizer=packs["tokenizer"], pad_seq_to_mult=4, pack_size=128)
    with pytest.raises(PackRowError, match=r"not a multiple of pad_seq_to_mult 8 \(PackedCollate argument\)"):
        PackedCollate.from_dataset(folder, eos_id=2, pad_seq_to_mult=8)(_rows(dataset))


def test_ids_outside_the_vocabulary_name_the_row(packs):
    """A model whose embedding is smaller than the packs' tokenizer: the first row holding a larger id
    stops the collate, before the embedding lookup would."""
    dataset = PackedDataset(packs["llama"])
    collate = PackedCollate.from_dataset(dataset, vocab_size=16_000)
    rows = _rows(dataset)
    first = next(index for index, row in enumerate(rows) if row["input_ids"].max() >= 16_000)
    with pytest.raises(PackRowError) as error:
        collate(rows)
    assert (error.value.row, error.value.key) == (first, "input_ids")
    assert "outside the vocabulary of 16000 tokens (PackedCollate argument vocab_size)" in str(error.value)
    # GPT-2 packs for a 32,000-token model: their own pad id is already outside it
    with pytest.raises(
        TightpackError,
        match=r"^eos_id 50256 \(tokenizer.eos_id of .*gpt2/manifest.json\) lies outside the vocabulary of "
        r"32000 tokens \(PackedCollate argument vocab_size\)",
    ):
        PackedCollate.from_dataset(packs["gpt2"], vocab_size=LLAMA_VOCAB)


# --- PackingCollator (the Trainer path) ----------------------------------------------------------------


def test_packing_collator_reads_the_packs_settings(packs):
    dataset = PackedDataset(packs["llama"])
    features = [dataset[0], dataset[1]]
    from_packs = PackingCollator(packs=dataset)(features)
    by_hand = PackingCollator(pack_size=PACK_SIZE, pad_seq_to_mult=4, eos_id=2)(features)
    assert from_packs.keys() == by_hand.keys()
    assert all(
        torch.equal(value, by_hand[key]) if isinstance(value, torch.Tensor) else value == by_hand[key]
        for key, value in from_packs.items()
    )
    with pytest.raises(TightpackError, match=r"^eos_id 50256 \(PackingCollator argument\) disagrees with 2 "):
        PackingCollator(packs=packs["llama"], eos_id=50256)
    # without packs= the default multiple is 1, which the aligned rows refuse
    with pytest.raises(PackRowError, match=r"pad_seq_to_mult 1 \(PackingCollator's default without packs="):
        PackingCollator()(features)


@pytest.fixture(scope="module")
def collators(packs) -> tuple[PackingCollator, PackingCollator]:
    """For the Llama packs: one given their settings by hand, one reading them (packs=)."""
    return PackingCollator(pad_seq_to_mult=4, eos_id=2), PackingCollator(packs=packs["llama"])


def _breaks(row: dict, how: str) -> dict:
    row = {key: np.asarray(value) for key, value in row.items()}
    if how == "start past the end":
        row["seq_start_id"] = np.append(row["seq_start_id"], len(row["input_ids"]) + 5)
    elif how == "starts not increasing":
        row["seq_start_id"] = row["seq_start_id"][[0, 1, 1, *range(2, len(row["seq_start_id"]))]]
    elif how == "short loss mask":
        row["loss_mask"] = row["loss_mask"][:-3]
    elif how == "missing key":
        row.pop("loss_mask")
    elif how == "nested ids":
        row["input_ids"] = [row["input_ids"].tolist()]
    elif how == "seq_len count":
        row["seq_len"] = row["seq_len"][:-1]
    elif how == "negative id":
        row["input_ids"] = row["input_ids"].copy()
        row["input_ids"][7] = -1
    return row


@pytest.mark.parametrize(
    ("how", "key", "problem"),
    [
        ("start past the end", "seq_start_id", "starts a sequence at"),
        ("starts not increasing", "seq_start_id", "must increase: sequence 2 starts at"),
        ("short loss mask", "loss_mask", "has "),
        ("missing key", "loss_mask", "is missing (the row has input_ids, "),
        ("nested ids", "input_ids", "must be a 1-D list of integers, got a 2-D array"),
        ("seq_len count", "seq_len", "has "),
        ("negative id", "input_ids", "holds id -1 at position 7: ids are never negative"),
    ],
)
def test_malformed_rows_name_the_row_and_the_key(packs, collators, how, key, problem):
    """Before, the collator raised a bare IndexError or ValueError from numpy. Rows of a ``PackedDataset``
    are named by their place in the micro-batch; rows read from the Parquet file (as ``datasets`` reads
    it) also by their ``sample_index``."""
    import pyarrow.parquet as pq

    dataset = PackedDataset(packs["llama"])
    parquet_rows = pq.read_table(packs["llama"] / "packs-00000.idx.parquet").slice(0, 2).to_pylist()
    sources = parquet_rows[1]["sample_index"]
    samples = ", ".join(map(str, sources[:5])) + (", ..." if len(sources) > 5 else "")
    for rows, identity in (
        ([dataset[0], dataset[1]], ""),
        (parquet_rows, f" (source samples {samples})"),
    ):
        features = [rows[0], _breaks(rows[1], how)]
        for collator in collators:
            with pytest.raises(PackRowError) as error:
                collator(features)
            assert str(error.value).startswith(f"packed row 1 of the batch{identity}: {key} {problem}")
            assert (error.value.row, error.value.key) == (1, key)


# --- tightpack validate: D10 ------------------------------------------------------------------------------


def _config(tmp_path: Path, packed: Path, tokenizer: dict) -> Path:
    config = {
        "train": {"micro_batch_size": 1, "global_batch_size": 8},
        "model": {"seq_length": PACK_SIZE},
        "dist": {"world_size": 8},
        "dataset": {
            "type": "GPTSFTDatasetConfig",
            "seq_length": PACK_SIZE,
            "dataset_root": "/data/squad",
            "enable_offline_packing": True,
            "offline_packing_specs": {
                "packed_sequence_size": PACK_SIZE,
                "packed_train_data_path": str(packed),
            },
        },
        "tokenizer": tokenizer,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_validate_checks_ids_of_packs_without_manifest_against_the_tokenizer(packs, tmp_path):
    """GPT-2 packs in Megatron-Bridge's layout against a 32,000-token Llama tokenizer: "errors: none"
    before; now D10, sampled by default and over every row with --deep."""
    llama = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(packs["tokenizer"])}
    path = _config(tmp_path, packs["gpt2_mb"], llama)
    rows = PackedDataset(packs["gpt2_mb"]).rows
    for options in ([], ["--deep"]):
        run = run_main(["validate", path, *options])
        assert run.returncode == 1, run.stdout
        d10 = [line for line in run.stdout.splitlines() if line.lstrip().startswith("D10")]
        assert len(d10) == 1, run.stdout
        outside = "hold token ids outside the 32,000-token vocabulary of tokenizer.tokenizer_model"
        assert f"of the {rows:,} rows {outside}" in d10[0]
        assert "(ids up to 50,256; e.g. training_256.idx.parquet row " in d10[0]
        assert (
            "fix: Configure the tokenizer the packs were made with (tokenizer.tokenizer_model), or re-pack"
            in run.stdout
        )
    gpt2 = {"tokenizer_type": "GPT2BPETokenizer"}
    run = run_main(["validate", _config(tmp_path, packs["gpt2_mb"], gpt2)])
    assert run.returncode == 0 and "D10" not in run.stdout, run.stdout
    named = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "meta-llama/Llama-2-7b-hf"}
    run = run_main(["validate", _config(tmp_path, packs["gpt2_mb"], named)])
    assert run.returncode == 0, run.stdout
    note = "token ids not checked (D10): tokenizer.tokenizer_model 'meta-llama/Llama-2-7b-hf' is no local"
    assert f"{note} tokenizer" in run.stdout
