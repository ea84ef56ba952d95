"""``tightpack validate``: exit status 0, 1 or 2, the text and JSON reports, and the README's example."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tightpack.config import load_config, validate

from .helpers import (
    OFFLINE,
    README_EXAMPLE,
    REPO_ROOT,
    SFT,
    merge,
    run_cli,
    write_yaml,
)


def test_cli_valid_config_exits_0(tmp_path):
    result = run_cli("validate", write_yaml(tmp_path / "ok.yaml", OFFLINE), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["errors: none", "warnings: none"]
    assert "derived values:" in lines
    assert re.search(r"micro-batches per step\s+4$", result.stdout, re.M)
    assert lines[-1] == "result: ok (0 errors, 0 warnings)"
    assert result.stderr == ""


def test_cli_errors_and_warnings_exit_1(tmp_path):
    config = merge(OFFLINE, {"train": {"micro_batch_size": 4}, "dist": {"eval_context_parallel_size": 2}})
    result = run_cli("validate", write_yaml(tmp_path / "bad.yaml", config), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    errors, warnings, derived_values = (
        out.index("errors (2):"),
        out.index("warnings (1):"),
        out.index("derived"),
    )
    assert errors < warnings < derived_values
    assert re.search(
        r"^  R20 +Micro batch size should be 1.*\n +fix: Use the equivalent configuration", out, re.M
    )
    assert re.search(r"^  T4 +Evaluating fine-tuning data with CP=2", out[warnings:derived_values], re.M)
    assert re.search(r"^  T2 +offline_packing_specs.pad_seq_to_mult \(1\) is not a multiple of 4", out, re.M)
    assert out.splitlines()[-1] == "result: invalid (2 errors, 1 warning)"
    assert "Traceback" not in result.stderr


def test_cli_json(tmp_path):
    config = merge(OFFLINE, {"train": {"micro_batch_size": 2}})
    result = run_cli("validate", write_yaml(tmp_path / "bad.yaml", config), "--json", cwd=tmp_path)
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert [item["rule"] for item in data["errors"]] == ["R20"]
    assert data["derived"]["alignment_multiple"] == 1


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("typo.yaml", json.dumps(merge(SFT, {"train": {"global_batch_sise": 8}})),
         "error: unknown key 'global_batch_sise' in train (train.global_batch_sise); "
         "did you mean train.global_batch_size?"),
        ("seq_lenght.yaml", json.dumps(merge(SFT, {"model": {"seq_lenght": 4096}, "optimizer": {"lr": 1}})),
         "error: unknown key 'seq_lenght' in model (model.seq_lenght); did you mean model.seq_length?"),
        ("broken.yaml", "train: {micro_batch_size: 1", "error: cannot parse config "),
        ("missing.yaml", None, "error: cannot read config "),
    ],
)  # fmt: skip
def test_cli_user_errors_exit_2(tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text, encoding="utf-8")
    result = run_cli("validate", tmp_path / name, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr
    assert "Traceback" not in result.stderr


def test_readme_example_validates_clean(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(README_EXAMPLE, encoding="utf-8")
    report = validate(load_config(path))
    assert report.ok and report.findings == (), report.format()
    assert report.derived.dataset_type == "GPTSFTDatasetConfig"
    assert (report.derived.alignment_multiple, report.derived.micro_batches_per_step) == (4, 8)
    assert report.derived.packing == "offline"
    result = run_cli("validate", path, "--config-only", cwd=tmp_path)  # its packs are not on this machine
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(
        r"^  dataset type +GPTSFTDatasetConfig \(inferred from its fields: dataset_root\)$",
        result.stdout,
        re.M,
    )
    assert result.stdout.splitlines()[-1] == "result: ok (0 errors, 0 warnings)"


def test_the_readme_example_is_the_one_tested_here():
    """The YAML the README shows under `tightpack validate` is README_EXAMPLE, so the two cannot drift."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    shown = readme.split("<!-- file: train.yaml -->\n", 1)[1]
    block = shown.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load(README_EXAMPLE)
