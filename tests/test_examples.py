"""examples/: the Megatron-Bridge configuration of megatron_bridge_sft.md, and its check script, run."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np

from tightpack.config import load_config, validate

from .conftest import random_words, write_jsonl

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _check_script():
    spec = importlib.util.spec_from_file_location(
        "check_megatron_bridge_sft", EXAMPLES / "check_megatron_bridge_sft.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_walk_through_shows_the_configuration_file_verbatim():
    """The page's YAML block is the file the check script reads (its comment header aside)."""
    page = (EXAMPLES / "megatron_bridge_sft.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", page, re.S)
    config = (EXAMPLES / "megatron_bridge_sft.yaml").read_text(encoding="utf-8")
    body = "".join(line for line in config.splitlines(keepends=True) if not line.startswith("#"))
    assert blocks == [body]


def test_the_configuration_is_valid_on_its_own():
    report = validate(load_config(EXAMPLES / "megatron_bridge_sft.yaml"))
    assert report.ok and report.findings == (), report.format()
    derived = report.derived
    assert (derived.packing, derived.alignment_multiple, derived.data_parallel_size) == ("offline", 4, 4)


def test_the_check_script_packs_validates_and_refuses_stale_packs(tmp_path, capsys):
    rng = np.random.default_rng(5)
    rows = [
        {
            "input": random_words(rng, int(rng.integers(5, 400))),
            "output": random_words(rng, int(rng.integers(5, 200))),
        }
        for _ in range(200)
    ]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:160])
    val = write_jsonl(tmp_path / "val.jsonl", rows[160:])
    work = tmp_path / "work"
    status = _check_script().main([str(train), "--val", str(val), "--work", str(work)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "$ tightpack pack" in out and "--pack-size 8192 --tp 2 --cp 2 --sp" in out
    checked = load_config(work / "config.yaml")
    specs = checked.dataset.offline_packing_specs
    assert (specs.packed_train_data_path, specs.packed_val_data_path) == (
        str(work / "packs" / "train"),
        str(work / "packs" / "val"),
    )
    assert "tokenizer compared by fingerprint" in out
    refusals = re.findall(r"^  D3 +(\w+) packs .* not a multiple of 8", out, re.M)
    assert refusals == ["train", "val"], out
    assert (
        f"tightpack pack {train} --tokenizer {work / 'tokenizer'} --cp 4 --tp 2 --sp --pack-size 8192" in out
    )


def test_the_rl_loop_trains_two_ranks_on_planned_micro_batches():
    """examples/rl_step_planner.py runs as its docstring says: two gloo ranks, every step planned."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "rl_step_planner.py")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("micro-batches per rank" in line for line in lines), run.stdout
