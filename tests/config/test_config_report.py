"""`validate` and its report: every finding at once, in rule order; the configuration untouched; JSON."""

from __future__ import annotations

import copy
import json

from tightpack.config import load_config, validate

from .helpers import ENERGON, OFFLINE, check, merge, rule_ids


def test_report_collects_many_violations_at_once():
    config = merge(
        OFFLINE,
        {
            "train": {"micro_batch_size": 4, "global_batch_size": 30},
            "model": {
                "seq_length": 4097,
                "context_parallel_size": 2,
                "cuda_graph_impl": "transformer_engine",
            },
            "ddp": {"average_in_collective": True},
            "validation": {"eval_micro_batch_size": 2},
            "dataset": {
                "offline_packing_specs": {"packed_sequence_size": 4098, "pad_cu_seqlens": True},
                "dataset_kwargs": {"pad_to_max_length": False},
            },
        },
    )
    report = check(config)
    assert rule_ids(report) == [
        "R5", "R6", "R16", "R17", "R18", "R18", "R20", "R22", "X1", "X3", "T1", "T2", "T7",
    ]  # fmt: skip
    assert not report.ok
    assert [finding.rule for finding in report.warnings] == ["T7"]
    assert len(report.errors) == 12


def test_validate_does_not_modify_the_config():
    config = load_config(
        merge(ENERGON, {"model": {"expert_model_parallel_size": 8, "delay_wgrad_compute": True}})
    )
    before = copy.deepcopy(config)
    report = validate(config)
    assert config == before
    assert report.derived.overrides()["dataset.pad_to_max_length"] is True
    assert config.dataset.pad_to_max_length is False


def test_report_to_dict_is_json_ready():
    report = check(
        merge(ENERGON, {"model": {"delay_wgrad_compute": True, "pipeline_model_parallel_size": 2}})
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False
    assert [item["rule"] for item in data["errors"]] == ["R10.7"]
    assert [item["rule"] for item in data["warnings"]] == ["R11"]
    assert set(data["errors"][0]) == {"rule", "severity", "reason", "fix"}
    assert data["derived"]["packing"] == "native_energon"
    assert data["overrides"]["model.delay_wgrad_compute"] is False
