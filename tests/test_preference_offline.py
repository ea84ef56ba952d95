"""The offline path of preference packing: ``tightpack pack --format preference|kto|groups``.

What a pack read back from disk must be: the very row the collate-time path builds from the same rows
(`build_preference_row` of the units `PreferenceEncoder` makes of them, fitted as `fit_units` fits
them), in both layouts, at alignment 1 and 8. Around it: every source row accounted for once in the
manifest, ``verify`` passing on what pack wrote and failing on each kind of corruption, Megatron-Bridge's
reader refusing the files, the output the same bytes for any number of workers, and the CLI's refusals.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tightpack.core.preference_units import PreferenceUnits, fit_units
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.format_config import FormatConfig
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_packs import PackedPreferenceDataset
from tightpack.runtime.thd import validate_thd_batch
from tightpack.verify import verify_packed

from .chat_templates import template_folders
from .conftest import run_main, write_jsonl
from .preference_data import conversation_pairs, groups, text_pairs

LAYOUTS = ("pairs", "shared-prefix")


def kto_rows(count: int) -> list[dict]:
    return [
        {"prompt": row["prompt"], "completion": row["chosen" if i % 3 else "rejected"], "label": bool(i % 3)}
        for i, row in enumerate(text_pairs(count))
    ]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    return template_folders(tmp_path_factory.mktemp("templates"))["llama3"]


def _pack(rows, tmp_path: Path, kind: str, layout: str, *, tokenizer=None, name="out", **settings) -> Path:
    source = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    config = PackConfig(format=FormatConfig(format=kind), preference_layout=layout, **settings)
    return pack_dataset([source], tmp_path / name, config, tokenizer=tokenizer).output


def _expected_units(rows, kind: str, layout: str, cap: int, multiple: int, tokenizer=None) -> PreferenceUnits:
    spec = load_tokenizer(tokenizer)
    units = PreferenceEncoder(spec, kind).encode_rows(rows).units
    return fit_units(units, cap, layout, pad_to_multiple_of=multiple).units


def _same_batch(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


CASES = [
    ("preference", text_pairs, None),
    ("preference", conversation_pairs, "llama3"),
    ("kto", kto_rows, None),
    ("groups", lambda n: groups(n, 4), "llama3"),
]


NAMES = ["text", "chat", "kto", "groups"]
# Every kind in both layouts with alignment tails (8); without alignment (1) on text pairs only.
GRID = [
    pytest.param(*case, layout, multiple, id=f"{name}-{layout}-{multiple}")
    for (name, case), multiples in zip(zip(NAMES, CASES, strict=True), ([1, 8], [8], [8], [8]), strict=True)
    for multiple in multiples
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("kind", "make", "template", "layout", "multiple"), GRID)
def test_a_pack_read_back_is_the_row_the_collator_builds(
    tmp_path, llama3, kind, make, template, layout, multiple
):
    rows = make(24)
    tokenizer = llama3 if template else None
    out = _pack(rows, tmp_path, kind, layout, tokenizer=tokenizer, packed_sequence_size=1024,
                max_seq_length=320, pad_seq_to_mult=multiple)  # fmt: skip
    expected = _expected_units(rows, kind, layout, 320, multiple, tokenizer)
    by_row = {int(source): unit for unit, source in enumerate(expected.source_index)}
    dataset = PackedPreferenceDataset(out)
    assert (dataset.kind, dataset.layout, dataset.multiple) == (kind, layout, multiple)
    seen = []
    pad = load_tokenizer(tokenizer).eos_id
    for index in range(len(dataset)):
        units = dataset[index]
        order = [by_row[int(source)] for source in units.source_index]
        seen += order
        batch = dataset.collate([units])
        validate_thd_batch(batch)
        assert batch["input_ids"].shape[1] <= 1024
        want = build_preference_row(expected.select(np.array(order)), layout, pad_to_multiple_of=multiple,
                                    pad_token_id=pad)  # fmt: skip
        _same_batch(batch, want)
    assert sorted(seen) == list(range(len(expected)))  # every unit once
    assert verify_packed(out).ok


def test_every_row_is_accounted_for_once(tmp_path):
    rows = text_pairs(30)
    rows[3] = {"prompt": "x", "chosen": "y"}  # bad: no rejected
    rows[5]["prompt"] = rows[5]["prompt"] * 40  # long prompt: trimmed
    rows[7]["chosen"] = rows[7]["chosen"] * 60  # long branch: cut
    out = _pack(rows, tmp_path, "preference", "pairs", packed_sequence_size=512, max_seq_length=256,
                skip_bad_lines=True)  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    counts, excluded = manifest["counts"], manifest["excluded"]
    assert counts["samples_in"] == 30 and counts["bad_rows"] == 1
    assert [bad["sample_index"] for bad in manifest["bad_rows"]] == [3]
    tables = [pq.read_table(shard) for shard in out.glob("*.parquet")]
    packed = sorted(int(i) for table in tables for row in table["sample_index"].to_pylist() for i in row)
    assert len(packed) == counts["packed"]
    others = excluded["dropped_long"] + excluded["no_supervised"] + [3]
    assert sorted(packed + others) == list(range(30))  # each row exactly once
    assert {5, 7} <= set(excluded["truncated"]) <= set(packed)
    assert counts["truncated_prompt_trimmed"] >= 1 and counts["truncated_branches_cut"] >= 1
    assert counts["supervised_packed"] <= counts["supervised_in"]
    assert verify_packed(out).ok


def test_long_units_are_trimmed_prompt_first_dropped_or_refused(tmp_path):
    rows = text_pairs(12)
    rows[2]["prompt"] *= 60  # about 360 tokens: over the cap of 200
    sizes = dict(packed_sequence_size=512, max_seq_length=200)
    truncated = _pack(rows, tmp_path, "preference", "shared-prefix", name="t", **sizes)
    units = PackedPreferenceDataset(truncated)
    prompt_of_2 = next(
        u.prompt(k)
        for i in range(len(units))
        for u in [units[i]]
        for k, s in enumerate(u.source_index)
        if s == 2
    )
    full = PreferenceEncoder(load_tokenizer(), "preference").encode_rows(rows).units
    assert len(prompt_of_2) < len(full.prompt(2))
    assert np.array_equal(prompt_of_2, full.prompt(2)[-len(prompt_of_2) :])  # trimmed at its start
    dropped = _pack(rows, tmp_path, "preference", "shared-prefix", name="d", long_samples="drop", **sizes)
    manifest = json.loads((dropped / "manifest.json").read_text())
    assert manifest["excluded"]["dropped_long"] == [2]
    assert "over the cap of 200" in manifest["excluded"]["dropped_reasons"]["2"]
    with pytest.raises(
        TightpackError, match=r"1 units are larger than the cap of 200 .*\(first: source row 2, 376 tokens\)"
    ):
        _pack(rows, tmp_path, "preference", "shared-prefix", name="e", long_samples="error", **sizes)


def test_the_output_is_the_same_bytes_for_any_number_of_workers(tmp_path):
    rows = text_pairs(40) * 15  # several chunks of 512 rows
    digests = []
    for workers in (1, 2):
        out = _pack(rows, tmp_path, "preference", "shared-prefix", name=f"w{workers}",
                    packed_sequence_size=2048, workers=workers)  # fmt: skip
        digests.append(hashlib.sha256((out / "packs-00000.idx.parquet").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_megatron_bridges_reader_refuses_the_files(tmp_path):
    out = _pack(text_pairs(8), tmp_path, "preference", "pairs", packed_sequence_size=1024)
    with pytest.raises(TightpackError, match="missing required columns: seq_start_id"):
        PackedDataset(out)
    sft_rows = [{"input": row["prompt"], "output": row["chosen"]} for row in text_pairs(8)]
    sft = _pack(sft_rows, tmp_path, "prompt-completion", "pairs", name="sft", packed_sequence_size=1024)
    with pytest.raises(TightpackError, match="is not packed preference Parquet"):
        PackedPreferenceDataset(sft)


def _corrupted(folder: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / f"corrupt-{edit.__name__}"
    shutil.copytree(folder, copy)
    shard = copy / "packs-00000.idx.parquet"
    table = pq.read_table(shard)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), shard)
    return copy


def split_a_pair(rows):  # the last pair of row 0 loses its rejected branch (open-instruct #1466's class)
    row = rows[0]
    for key in ("branch_index", "branch_prompt_length", "branch_start", "branch_length"):
        row[key] = row[key][:-1]
    row["sequence_start"], row["sequence_length"] = row["sequence_start"][:-1], row["sequence_length"][:-1]


def swap_chosen_and_rejected_index(rows):
    rows[0]["branch_index"][:2] = [1, 0]


def change_a_rejected_prompt(rows):  # pairs: a branch's prompt no longer its unit's prompt
    row = rows[0]
    row["input_ids"][row["branch_start"][1] - 1] += 1


def shift_a_branch_start(rows):
    rows[0]["branch_start"][1] += 1


def supervise_a_prompt_token(rows):
    row = rows[0]
    row["loss_mask"][row["sequence_start"][0]] = 1


def drop_a_source_row(rows):
    rows[0]["sample_index"] = rows[0]["sample_index"][:-1]


@pytest.mark.parametrize(
    ("edit", "check"),
    [
        (split_a_pair, "units"),
        (swap_chosen_and_rejected_index, "units"),
        (change_a_rejected_prompt, "layout"),
        (shift_a_branch_start, "layout"),
        (supervise_a_prompt_token, "layout"),
        (drop_a_source_row, "units"),
    ],
)
def test_verify_names_every_corruption(tmp_path, edit, check):
    out = _pack(text_pairs(20), tmp_path, "preference", "pairs", packed_sequence_size=1024)
    assert verify_packed(out).ok
    report = verify_packed(_corrupted(out, tmp_path, edit))
    assert not report.ok and report.counts[check] >= 1, report.counts
    assert any(v.check == check and v.row == 0 for v in report.violations)


def test_the_cli_packs_preference_rows_and_refuses_what_it_cannot(tmp_path):
    source = write_jsonl(tmp_path / "pairs.jsonl", text_pairs(10))
    run = run_main(["pack", source, "-o", tmp_path / "auto", "--pack-size", "1024"])  # --format auto
    assert run.returncode == 0, run.stderr
    assert "units packed (preference, pairs)" in run.stdout and "10" in run.stdout
    assert (
        json.loads((tmp_path / "auto" / "manifest.json").read_text())["settings"]["format"]["format"]
        == "preference"
    )
    assert run_main(["verify", tmp_path / "auto"]).returncode == 0
    assert "preference units" in run_main(["inspect", tmp_path / "auto"]).stdout
    for extra, named in (
        (["--engine", "ray"], "engine"),
        (["--output-format", "npy"], "output-format"),
        (["--balance-costs", "llama-8b"], "balance-costs"),
        (["--loss-on", "all"], "--loss-on"),  # settings of SFT rows: refused, not silently ignored
        (["--truncate-field", "prompt"], "--truncate-field"),
        (["--preference-layout", "shared-prefix", "--cp", "2"], "cannot take --cp 2"),
    ):
        run = run_main(["pack", source, "-o", tmp_path / "x", "--pack-size", "1024", "--format", "preference",
                        *extra])  # fmt: skip
        assert run.returncode == 2 and named in run.stderr and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
    prompts = write_jsonl(tmp_path / "sft.jsonl", [{"input": "a", "output": "b"}])
    run = run_main(
        ["pack", prompts, "-o", tmp_path / "y", "--pack-size", "64", "--preference-layout", "shared-prefix"]
    )
    assert (
        run.returncode == 2 and "--preference-layout 'shared-prefix' lays out preference units" in run.stderr
    )
    assert "is an SFT sample" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    run = run_main(["pack", prompts, "-o", tmp_path / "y", "--pack-size", "64", "--format", "chat",
                    "--preference-layout", "shared-prefix"])  # fmt: skip
    assert run.returncode == 2 and "it needs --format preference, kto, groups (got 'chat')" in run.stderr
    run = run_main(
        [
            "pack",
            source,
            "-o",
            tmp_path / "auto-sp",
            "--pack-size",
            "1024",
            "--preference-layout",
            "shared-prefix",
        ]
    )  # fmt: skip  (--format auto on preference rows)
    assert run.returncode == 0 and "units packed (preference, shared-prefix)" in run.stdout, run.stderr


def test_log_probs_read_from_disk_equal_each_branch_alone(tmp_path):
    """A tiny Llama in float64: the per-branch log-probs of a pack read back equal each branch's own run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tightpack.runtime.preference_hf import preference_logps

    rows = text_pairs(6)
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(vocab_size=50257, num_key_value_heads=2, attn_implementation="sdpa", **sizes)
    model = LlamaForCausalLM(config).double().eval()
    for layout in LAYOUTS:
        out = _pack(
            rows, tmp_path, "preference", layout, name=layout, packed_sequence_size=4096, pad_seq_to_mult=8
        )
        dataset = PackedPreferenceDataset(out)
        units = dataset[0]
        with torch.no_grad():
            packed = preference_logps(model, dataset.collate([units])).sums
            alone = []
            for branch in range(len(units.branch_lengths)):
                unit = int(units.branch_unit[branch])
                ids = torch.from_numpy(
                    np.concatenate([units.prompt(unit), units.branch(branch)]).astype(np.int64)
                )
                logp = model(ids[None]).logits[0, :-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]
                start = units.branch_offsets[branch]
                mask = units.branch_loss_mask[start : start + units.branch_lengths[branch]]
                trained = np.concatenate([np.zeros(len(units.prompt(unit)) - 1), mask]).astype(bool)
                alone.append(logp[torch.from_numpy(trained)].sum())
        torch.testing.assert_close(packed, torch.stack(alone), rtol=0, atol=1e-10)


def test_verify_takes_the_multiple_and_cp_it_is_given_and_counts_every_sound_row(tmp_path):
    out = _pack(text_pairs(20), tmp_path, "preference", "pairs", packed_sequence_size=1024)
    assert verify_packed(out).ok
    for report in (verify_packed(out, multiple=16), verify_packed(out, cp=2)):
        assert not report.ok and set(report.counts) == {"alignment"}, report.counts  # no knock-on faults
        assert report.checked["sequences"] == 40 and report.checked["units"] == 20
