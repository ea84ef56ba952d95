"""``tightpack validate`` on packed data: each D rule against real packs made by `pack_dataset`.

The packs are made once per module: ``main`` (pack size 256, CP 2 so m = 4, a tokenizer folder), ``val_m1``
(the same corpus with m = 1). Expected values: the configuration's k = lcm(2*CP, CP*TP with SP).
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.config.helpers import DELETE, merge
from tests.conftest import random_words, write_jsonl
from tightpack.cli import main as cli_main
from tightpack.config import load_config, validate
from tightpack.core.checksums import file_digest
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.stale_packs import DATA_RULES, SAMPLE_ROWS, check_packed_data

PACK_SIZE = 256


def _tokenizer_folder(folder: Path, extra_token: str | None = None) -> Path:
    """GPT-2 as a Hugging Face tokenizer folder; ``extra_token`` makes it another tokenizer."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(load_tokenizer(None).backend_json)
    if extra_token:
        backend.add_tokens([extra_token])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>"}), encoding="utf-8"
    )
    return folder


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stale")
    rng = np.random.default_rng(3)
    rows = [
        {
            "input": random_words(rng, int(rng.integers(1, 40))),
            "output": random_words(rng, int(rng.integers(1, 30))),
        }
        for _ in range(240)
    ]
    corpus = write_jsonl(root / "corpus.jsonl", rows)
    tok_a = _tokenizer_folder(root / "tok_a")
    made = {"corpus": corpus, "tok_a": tok_a, "tok_b": _tokenizer_folder(root / "tok_b", "<|extra|>")}
    for name, config in (
        ("main", PackConfig(packed_sequence_size=PACK_SIZE, cp=2)),
        ("val_m1", PackConfig(packed_sequence_size=PACK_SIZE)),
    ):
        pack_dataset([str(corpus)], root / name, config, tokenizer=tok_a)
        made[name] = root / name
    return made


def base(packs: dict[str, Path], **specs) -> dict:
    """A clean configuration for ``main``: CP 2, pack size 256, m 4, its tokenizer."""
    return {
        "train": {"micro_batch_size": 1, "global_batch_size": 8},
        "model": {"seq_length": PACK_SIZE, "context_parallel_size": 2, "calculate_per_token_loss": True},
        "ddp": {"average_in_collective": False},
        "dist": {"world_size": 8},
        "dataset": {
            "type": "GPTSFTDatasetConfig",
            "seq_length": PACK_SIZE,
            "dataset_root": "/data/squad",
            "enable_offline_packing": True,
            "dataset_kwargs": {"pad_to_max_length": True},
            "offline_packing_specs": {
                "packed_sequence_size": PACK_SIZE,
                "pad_seq_to_mult": 4,
                "packed_train_data_path": str(packs["main"]),
                **specs,
            },
        },
        "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(packs["tok_a"])},
    }


def check(config: dict, **options):
    return check_packed_data(load_config(config), raw=config, **options)


def only(checked, rule: str):
    """The one finding of ``checked``, which must be of ``rule``."""
    assert [finding.rule for finding in checked.findings] == [rule], checked.findings
    return checked.findings[0]


def test_rules_are_listed_in_order():
    assert [rule.id for rule in DATA_RULES] == [f"D{index}" for index in range(1, 12)]


def test_matching_config_has_no_findings(packs):
    config = base(packs, packed_val_data_path=str(packs["main"]))
    assert validate(load_config(config)).findings == ()
    checked = check(config)
    assert checked.findings == ()
    assert [(split.split, split.manifest, split.rows_read) for split in checked.splits] == [
        ("train", str(packs["main"] / "manifest.json"), 0),
        ("val", str(packs["main"] / "manifest.json"), 0),
    ]
    assert checked.tokenizer == "fingerprint"
    assert checked.metadata == str(packs["main"] / "metadata.json")


def test_nothing_to_check_without_offline_packing_or_paths(packs):
    config = base(packs)
    config["dataset"]["offline_packing_specs"].pop("packed_train_data_path")
    assert check(config).notes == (
        "nothing to check: no packed_train_data_path, packed_train_data_blend or packed_val_data_path "
        "(nor --packed)",
    )
    plain = merge(config, {"dataset": {"enable_offline_packing": False, "offline_packing_specs": DELETE}})
    checked = check(plain)
    assert (checked.findings, checked.notes) == (
        (),
        ("nothing to check: the configuration has no offline packing",),
    )


def test_pack_size_larger_than_configured_is_an_error(packs):
    config = merge(
        base(packs, packed_sequence_size=128),
        {"model": {"seq_length": 128}, "dataset": {"seq_length": 128}},
    )
    finding = only(check(config), "D2")
    assert finding.severity == "error"
    assert (
        "made with pack size 256 (manifest), above dataset.offline_packing_specs.packed_sequence_size 128"
        in (finding.reason)
    )
    out = f"{packs['main']}-p128-m4"
    assert finding.fix == (
        f"Re-pack into a fresh output folder: tightpack pack {packs['corpus']} --tokenizer {packs['tok_a']} "
        f"--cp 2 --pack-size 128 --pad-to-max-length --output {out}; then set "
        f"dataset.offline_packing_specs.packed_train_data_path: {out}."
    )


def test_pack_size_smaller_than_configured_is_a_warning(packs):
    config = merge(
        base(packs, packed_sequence_size=512),
        {"model": {"seq_length": 512}, "dataset": {"seq_length": 512}},
    )
    finding = only(check(config), "D2")
    assert finding.severity == "warning"
    assert (
        "pack size 256 (manifest), below dataset.offline_packing_specs.packed_sequence_size 512"
        in finding.reason
    )
    assert "--pack-size 512" in finding.fix and finding.fix.endswith(
        "packed_sequence_size: 256 (with the sequence lengths to match)."
    )


def test_context_parallel_change_needs_a_repack(packs):
    config = merge(base(packs, pad_seq_to_mult=8), {"model": {"context_parallel_size": 4}})
    finding = only(check(config), "D3")
    assert finding.severity == "error"
    assert finding.reason == (
        f"train packs {packs['main']} are aligned to pad_seq_to_mult 4 (manifest), not a multiple of 8 "
        "(k = 8 from TP=1, CP=4, eval CP=4, SP=False): context-parallel slicing needs every segment "
        "divisible by 8 (2*CP)."
    )
    assert f"--cp 4 --pack-size 256 --pad-to-max-length --output {packs['main']}-p256-m8;" in finding.fix
    assert finding.fix.startswith("Re-pack into a fresh output folder: tightpack pack ")


def test_sequence_parallel_added_is_a_warning(packs):
    config = merge(
        base(packs, pad_seq_to_mult=8),
        {"model": {"tensor_model_parallel_size": 4, "sequence_parallel": True}},
    )
    finding = only(check(config), "D3")
    assert finding.severity == "warning"
    assert (
        "pad_seq_to_mult 4 (manifest), not a multiple of the sequence-parallel multiple 8" in finding.reason
    )
    assert "--cp 2 --tp 4 --sp --pack-size 256" in finding.fix


@pytest.mark.parametrize(
    ("configured", "said", "how"),
    [(8, "8", "as aligned and strips trailing EOS"), (None, "1", "as unaligned: no cu_seqlens_q_padded")],
)
def test_a_different_pad_seq_to_mult_is_a_warning(packs, configured, said, how):
    finding = only(check(base(packs, pad_seq_to_mult=configured)), "D4")
    assert finding.severity == "warning"
    assert "aligned to pad_seq_to_mult 4 (manifest), the configuration says " in finding.reason
    assert f"pad_seq_to_mult {said}; the reference reads the packs {how}" in finding.reason
    assert finding.fix == "Set dataset.offline_packing_specs.pad_seq_to_mult: 4 (what the packs hold)."


def test_pad_cu_seqlens_needs_the_metadata_path(packs):
    finding = only(check(base(packs, pad_cu_seqlens=True)), "D5")
    assert "pad_cu_seqlens is true but packed_metadata_path is not set" in finding.reason
    assert finding.fix == (
        f"Set dataset.offline_packing_specs.packed_metadata_path: {packs['main'] / 'metadata.json'}."
    )
    missing = str(packs["main"] / "missing.json")
    finding = only(check(base(packs, pad_cu_seqlens=True, packed_metadata_path=missing)), "D1")
    assert (finding.severity, finding.reason) == (
        "error",
        f"dataset.offline_packing_specs.packed_metadata_path {missing!r} does not exist",
    )
    finding = only(check(base(packs, packed_metadata_path=missing)), "D1")  # nothing reads it
    assert finding.severity == "warning" and "nothing reads it" in finding.reason


def test_metadata_must_cover_every_split(packs, tmp_path):
    entry = json.loads((packs["main"] / "metadata.json").read_text())[0]
    stats = json.loads((packs["main"] / "manifest.json").read_text())["stats"]
    short = tmp_path / "short.json"
    short.write_text(json.dumps([{**entry, "max_samples_per_bin": 1}]))
    finding = only(check(base(packs, pad_cu_seqlens=True, packed_metadata_path=str(short))), "D6")
    assert finding.reason.startswith(
        f"{short} gives max max_samples_per_bin 1 over its 1 entries, the train packs {packs['main']} have "
        f"{stats['max_samples_per_pack']}: the metadata does not cover them"
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{**entry, "pack_size": 512}]))
    finding = only(check(base(packs, pad_cu_seqlens=True, packed_metadata_path=str(other))), "D5")
    assert f"{other} gives pack_size 512, the train packs {packs['main']} have 256" in finding.reason
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps([{"pack_size": 256, "max_samples_per_bin": 3}]))
    finding = only(check(base(packs, pad_cu_seqlens=True, packed_metadata_path=str(partial))), "D5")
    assert f"{partial} has 1 entries without dataset_max_seqlen, min_packed_seqlen" in finding.reason


def test_another_tokenizer_is_found_by_fingerprint(packs):
    config = merge(base(packs), {"tokenizer": {"tokenizer_model": str(packs["tok_b"])}})
    checked = check(config)
    finding = only(checked, "D7")
    manifest = json.loads((packs["main"] / "manifest.json").read_text())["tokenizer"]
    other = load_tokenizer(packs["tok_b"]).fingerprint
    assert finding.severity == "error" and checked.tokenizer == "fingerprint"
    assert finding.reason == (
        f"train packs {packs['main']} were tokenized with {str(packs['tok_a'])!r} (fingerprint "
        f"{manifest['fingerprint'][:12]}), tokenizer.tokenizer_model {str(packs['tok_b'])!r} has fingerprint "
        f"{other[:12]}: other token ids."
    )
    assert f"--tokenizer {packs['tok_b']} --cp 2" in finding.fix


def test_a_tokenizer_name_is_compared_by_name(packs):
    checked = check(merge(base(packs), {"tokenizer": {"tokenizer_model": "meta-llama/Llama-3.1-8B"}}))
    finding = only(checked, "D7")
    assert finding.severity == "warning" and checked.tokenizer == "name"
    assert (
        "the configuration names tokenizer.tokenizer_model 'meta-llama/Llama-3.1-8B' (names compared"
        in finding.reason
    )
    same_name = merge(base(packs), {"tokenizer": DELETE})
    same_name["dataset"]["offline_packing_specs"]["tokenizer_model_name"] = "tok_a"
    assert check(same_name).findings == ()


def test_a_file_changed_or_added_after_packing(packs, tmp_path):
    copy = Path(shutil.copytree(packs["main"], tmp_path / "copy"))
    shard = copy / "packs-00000.idx.parquet"
    size = shard.stat().st_size
    with shard.open("ab") as file:
        file.write(b"\0" * 10)
    finding = only(check(base(packs, packed_train_data_path=str(copy))), "D9")
    assert finding.reason == (
        f"{shard} has {size + 10:,} bytes, {copy / 'manifest.json'} lists {size:,}: the file changed "
        "after packing."
    )
    assert f"--output {copy}-p256-m4;" in finding.fix
    shard.write_bytes((packs["main"] / "packs-00000.idx.parquet").read_bytes())
    shutil.copy(shard, copy / "packs-00001.idx.parquet")
    finding = only(check(base(packs, packed_train_data_path=str(copy))), "D9")
    assert finding.reason.startswith(f"{copy / 'packs-00001.idx.parquet'} is not in {copy / 'manifest.json'}")


def test_a_validation_pack_with_other_settings(packs):
    finding = only(check(base(packs, packed_val_data_path=str(packs["val_m1"]))), "D3")
    assert finding.severity == "error"
    assert finding.reason.startswith(
        f"val packs {packs['val_m1']} are aligned to pad_seq_to_mult 1 (manifest)"
    )
    assert finding.fix.endswith(
        f"then set dataset.offline_packing_specs.packed_val_data_path: {packs['val_m1']}-p256-m4."
    )


def test_a_missing_path_is_an_error(packs, tmp_path):
    missing = tmp_path / "nope"
    finding = only(check(base(packs, packed_train_data_path=str(missing))), "D1")
    assert finding.reason.startswith(
        f"dataset.offline_packing_specs.packed_train_data_path {str(missing)!r} names no packed data"
    )


def _megatron_bridge_copy(source: Path, target: Path) -> Path:
    """A Megatron-Bridge style folder: training_256.idx.parquet and 256_metadata.jsonl, no manifest."""
    target.mkdir()
    shutil.copy(source / "packs-00000.idx.parquet", target / f"training_{PACK_SIZE}.idx.parquet")
    shutil.copy(source / "metadata.json", target / f"{PACK_SIZE}_metadata.jsonl")
    return target


def test_packs_without_manifest_are_sampled(packs, tmp_path):
    folder = _megatron_bridge_copy(packs["main"], tmp_path / "mb")
    rows = pq.ParquetFile(folder / f"training_{PACK_SIZE}.idx.parquet").metadata.num_rows
    checked = check(base(packs, packed_train_data_path=str(folder)))
    assert checked.findings == ()
    (split,) = checked.splits
    assert (split.manifest, split.rows, split.rows_read) == (None, rows, min(rows, SAMPLE_ROWS))
    assert checked.metadata == str(folder / f"{PACK_SIZE}_metadata.jsonl")
    finding = only(
        check(
            merge(
                base(packs, packed_train_data_path=str(folder), pad_seq_to_mult=8),
                {"model": {"context_parallel_size": 4}},
            )
        ),
        "D8",
    )
    assert (
        f"segments of {min(rows, SAMPLE_ROWS):,} sampled rows of {rows:,} are not divisible by 8"
        in finding.reason
    )
    assert "(the sampled segments share the multiple 4)" in finding.reason
    # no manifest, so no sources: a placeholder, and the configuration's tokenizer
    assert f"tightpack pack TRAINING.jsonl --tokenizer {packs['tok_a']} --cp 4 --pack-size 256" in finding.fix


def test_deep_reads_every_row(packs, tmp_path):
    copy = Path(shutil.copytree(packs["main"], tmp_path / "deep"))
    shard = copy / "packs-00000.idx.parquet"
    table = pq.read_table(shard)
    starts = table.column("seq_start_id").to_pylist()
    row = next(index for index, row_starts in enumerate(starts) if len(row_starts) > 1)
    starts[row][1] += 1  # the first sequence one token longer, no longer a multiple of 4
    column = table.schema.get_field_index("seq_start_id")
    table = table.set_column(column, "seq_start_id", pa.array(starts, table.schema.field(column).type))
    pq.write_table(table, shard)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][0].update(file_digest(shard))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    config = base(packs, packed_train_data_path=str(copy))
    assert check(config).findings == ()  # the manifest still says m = 4
    findings = check(config, deep=True).findings
    assert [finding.rule for finding in findings if finding.rule != "D8"] == []
    alignment = [finding for finding in findings if "'alignment' check" in finding.reason]
    assert len(alignment) == 1, findings
    assert f"row {row}, sequence 0: runtime length" in alignment[0].reason
    assert "is not a multiple of the alignment multiple 4" in alignment[0].reason


def _yaml(path: Path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def test_cli_reports_packed_data(packs, tmp_path, capsys):
    path = _yaml(tmp_path / "ok.yaml", base(packs))
    assert cli_main(["validate", path]) == 0
    out = capsys.readouterr().out.splitlines()
    block = out.index("packed data:")
    assert out[block + 1] == f"  train {packs['main']} (manifest, 1 file, no rows read)"
    assert out[-1] == "result: ok (0 errors, 0 warnings)"

    bad = _yaml(
        tmp_path / "cp4.yaml", merge(base(packs, pad_seq_to_mult=8), {"model": {"context_parallel_size": 4}})
    )
    assert cli_main(["validate", bad, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [item["rule"] for item in data["errors"]] == ["D3"]
    assert data["packed_data"]["splits"][0]["manifest"] == str(packs["main"] / "manifest.json")

    assert cli_main(["validate", path, "--packed", str(packs["val_m1"])]) == 1
    assert "D3     packed packs" in capsys.readouterr().out


def test_cli_unreadable_manifest_exits_2(packs, tmp_path, capsys):
    copy = Path(shutil.copytree(packs["main"], tmp_path / "broken"))
    (copy / "manifest.json").write_text("{not json")
    path = _yaml(tmp_path / "c.yaml", base(packs, packed_train_data_path=str(copy)))
    assert cli_main(["validate", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {copy / 'manifest.json'}: not a readable manifest")
    assert captured.err.count("\n") == 1


def test_cli_config_only_skips_the_packed_data(packs, tmp_path, capsys):
    missing = str(tmp_path / "not-mounted")
    path = _yaml(tmp_path / "c.yaml", base(packs, packed_train_data_path=missing))
    assert cli_main(["validate", path]) == 1
    assert (
        f"D1     dataset.offline_packing_specs.packed_train_data_path {missing!r}" in capsys.readouterr().out
    )
    assert cli_main(["validate", path, "--config-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["packed data: not checked (--config-only)", "result: ok (0 errors, 0 warnings)"]


_REPACK_SETTINGS = {
    "drop": [
        "--long-samples", "drop", "--max-seq-length", "48", "--format", "prompt-completion",
        "--prompt-template", "Question: {input}\nAnswer: {output}", "--algorithm", "first_fit_shuffle",
        "--seed", "7", "--skip-bad-lines",
    ],
    "truncate": [
        "--max-seq-length", "40", "--input-key", "question", "--output-key", "answer",
        "--truncation-method", "left", "--truncate-field", "question,context",
        "--prompt-template", "{context} | {question} -> {answer}", "--loss-on", "last-turn",
        "--messages-key", "conversation", "--chat-truncation", "end",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_REPACK_SETTINGS))
def test_following_the_repack_fix_keeps_every_sample_setting(packs, tmp_path, capsys, name):
    """Pack with settings that change the samples, ask validate for a smaller pack size, run the
    printed command: the new packs hold the same samples (same accounting), only the pack size moves."""
    rows = [
        {
            "question": random_words(np.random.default_rng(i), 5 + i % 40),
            "context": random_words(np.random.default_rng(1000 + i), i % 25),
            "answer": random_words(np.random.default_rng(2000 + i), 1 + i % 20),
        }
        for i in range(200)
    ]
    corpus = write_jsonl(
        tmp_path / "corpus.jsonl", [{"input": r["question"], "output": r["answer"], **r} for r in rows]
    )
    old = tmp_path / "old"
    made = ["pack", str(corpus), "--tokenizer", str(packs["tok_a"]), "--pack-size", "256", "--cp", "2"]
    assert cli_main([*made, *_REPACK_SETTINGS[name], "--output", str(old)]) == 0
    config = merge(
        base(packs, packed_sequence_size=128, packed_train_data_path=str(old)),
        {"model": {"seq_length": 128}, "dataset": {"seq_length": 128}},
    )
    capsys.readouterr()
    assert cli_main(["validate", _yaml(tmp_path / "c.yaml", config), "--json"]) == 1
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert error["rule"] == "D2"
    command = error["fix"].removeprefix("Re-pack into a fresh output folder: ").split("; then set")[0]
    words = shlex.split(command)
    assert words[:2] == ["tightpack", "pack"]
    assert cli_main(words[1:]) == 0
    new_folder = Path(words[words.index("--output") + 1])
    before = json.loads((old / "manifest.json").read_text())
    after = json.loads((new_folder / "manifest.json").read_text())
    assert after["settings"]["packed_sequence_size"] == 128
    for manifest in (before, after):  # the topology the configuration asks for
        for key in ("packed_sequence_size", "pad_to_max_length"):
            manifest["settings"][key] = None
    assert after["settings"] == before["settings"]
    assert after["counts"] == before["counts"]
    assert before["counts"]["dropped_long" if name == "drop" else "truncated"] > 0
    config = merge(
        config, {"dataset": {"offline_packing_specs": {"packed_train_data_path": str(new_folder)}}}
    )
    assert cli_main(["validate", _yaml(tmp_path / "new.yaml", config)]) == 0


def test_every_recorded_setting_has_a_flag_of_pack():
    """A new PackConfig or FormatConfig field must get an entry in SETTING_FLAGS, and each flag there
    must be an option of ``tightpack pack``: otherwise validate's re-pack command would forget it."""
    import typer.main

    from tightpack.cli.app import app
    from tightpack.offline.mixture import MixtureConfig
    from tightpack.offline.pack_flags import SETTING_FLAGS, recorded_paths
    from tightpack.prepare.format_config import FormatConfig

    sft = recorded_paths(PackConfig(packed_sequence_size=64).settings())
    units = PackConfig(packed_sequence_size=64, format=FormatConfig(format="preference")).settings()
    mixed = PackConfig(packed_sequence_size=64, mixture=MixtureConfig(weights=(1, 1))).settings()
    assert "preference_layout" not in sft  # an SFT manifest records what it did before preference packing
    assert "mixture" not in sft  # nor a mixture, without one
    recorded = set(sft) | set(recorded_paths(units)) | set(recorded_paths(mixed))
    assert sorted(recorded) == sorted(SETTING_FLAGS)
    command = typer.main.get_command(app).commands["pack"]
    options = {option for param in command.params for option in param.opts}
    flags = {entry.flag for entry in SETTING_FLAGS.values() if entry.flag is not None}
    assert sorted(flags - options) == []


def test_repack_words_for_vision_cost_models_and_settings_of_a_newer_tightpack():
    """The processor folder is not recorded (a placeholder names it); a cost model is named by its
    preset; a setting this tightpack has no entry for is returned, never dropped silently."""
    from tightpack.core.cost_model import COST_MODELS
    from tightpack.offline.pack_flags import sample_flags

    settings = PackConfig(packed_sequence_size=64).settings()
    settings["balance_costs"] = COST_MODELS["llama-1b"].to_dict()
    settings["format"] |= {
        "vision": {"sizes": {"model": "qwen2_5_vl"}, "media_root": "/data/my media", "tokens": {}},
        "truncate_fields": [],
        "future_setting": 3,
    }
    words, unknown = sample_flags(settings)
    assert words == [
        "--balance-costs", "llama-1b", "--truncate-field", "none", "--vision-processor", "PROCESSOR_FOLDER",
        "--vision", "qwen2_5_vl", "--media-root", "'/data/my media'",
    ]  # fmt: skip
    assert unknown == ["format.future_setting"]


def test_a_repack_whose_cap_rounds_down_to_the_new_multiple_says_the_counts_differ(packs, tmp_path, capsys):
    """Packs cut at 90 tokens (multiple 1), a configuration with CP 2 (multiple 4): the printed command
    keeps ``--max-seq-length 90``, which the re-pack rounds down to 88, and says so beside it."""
    rows = [
        {
            "input": random_words(np.random.default_rng(i), 20 + i % 60),
            "output": random_words(np.random.default_rng(500 + i), 30),
        }
        for i in range(120)
    ]
    corpus = write_jsonl(tmp_path / "long.jsonl", rows)
    old = tmp_path / "old"
    made = ["pack", str(corpus), "--tokenizer", str(packs["tok_a"]), "--pack-size", "256"]
    assert cli_main([*made, "--max-seq-length", "90", "--output", str(old)]) == 0
    capsys.readouterr()
    assert (
        cli_main(
            ["validate", _yaml(tmp_path / "c.yaml", base(packs, packed_train_data_path=str(old))), "--json"]
        )
        == 1
    )
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    command = error["fix"].removeprefix("Re-pack into a fresh output folder: ").split("; then set")[0]
    note = (
        " (its cap of 90 tokens, rounded down to the multiple 4, is 88; the packs were cut at 90: samples "
        "longer than 88 tokens are cut shorter than before, and the manifest's counts can differ)"
    )
    assert command.endswith(f"--max-seq-length 90 --pad-to-max-length --output {old}-p256-m4{note}"), command
    assert cli_main(shlex.split(command.removesuffix(note))[1:]) == 0
    before = json.loads((old / "manifest.json").read_text())
    after = json.loads((Path(f"{old}-p256-m4") / "manifest.json").read_text())
    assert (before["stats"]["dataset_max_length"], after["stats"]["dataset_max_length"]) == (90, 88)
    assert after["counts"]["tokens_packed"] < before["counts"]["tokens_packed"]
