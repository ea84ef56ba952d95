"""Shared by the tests of `tightpack.config`: clean base configurations, patch builders, and the CLI runner.

Each rule case is a configuration that triggers the rule and the nearest one that does not, both built by
patching one of the clean base configurations below. Expected numbers are derived by hand from
docs/contract.md §2.4 and §5 (k = lcm over train and eval CP of (2*cp if cp > 1) and (cp*tp under SP))
and from the cases of the reference's ``tests/unit_tests/training/test_config.py`` (the rules of §5).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tightpack.config import ValidationReport, load_config, validate


class _Delete:
    """Marks a key to remove in `merge`; copies are the same object."""

    def __deepcopy__(self, memo: dict) -> _Delete:
        return self


DELETE = _Delete()


def merge(base: dict, *patches: dict) -> dict:
    """A deep copy of ``base`` with the patches merged in (nested dicts merge; DELETE removes a key)."""
    merged = copy.deepcopy(base)
    for patch in patches:
        for key, value in patch.items():
            if value is DELETE:
                merged.pop(key, None)
            elif isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merge(merged[key], value)
            else:
                merged[key] = copy.deepcopy(value)
    return merged


# Clean bases: world 8, TP/PP/CP 1, so DP 8.
SFT = {
    "train": {"micro_batch_size": 1, "global_batch_size": 32},
    "model": {"seq_length": 4096},
    "dataset": {"type": "GPTSFTDatasetConfig", "seq_length": 4096, "dataset_root": "/data/squad"},
    "dist": {"world_size": 8},
}
OFFLINE = merge(
    SFT,
    {
        "dataset": {
            "enable_offline_packing": True,
            "offline_packing_specs": {"packed_sequence_size": 4096},
            "dataset_kwargs": {"pad_to_max_length": True},
        }
    },
)
GPT = merge(SFT, {"dataset": {"type": "GPTDatasetConfig", "dataset_root": DELETE}})
PROVIDER = merge(SFT, {"dataset": {"type": "DatasetProvider", "dataset_root": DELETE}})
DIRECT_HF = merge(SFT, {"dataset": {"type": "DirectHFSFTDatasetConfig", "dataset_root": DELETE}})
MOCK_VLM = merge(DIRECT_HF, {"dataset": {"type": "MockVLMSFTDatasetConfig"}})
IN_BATCH = merge(
    DIRECT_HF, {"train": {"micro_batch_size": 4}, "dataset": {"enable_in_batch_packing": True}}
)  # GBS 32 = MBS 4 * DP 8: one micro-batch per step
ENERGON = {  # native packing
    "train": {"micro_batch_size": 1, "global_batch_size": 8},
    "model": {"seq_length": 4096, "calculate_per_token_loss": True},
    "dataset": {
        "type": "EnergonDatasetConfig",
        "path": "/data/wds",
        "seq_length": 4096,
        "micro_batch_size": 1,
        "task_encoder": "QwenVLEnergonTaskEncoderConfig",
        "packing_buffer_size": 16,
    },
    "dist": {"world_size": 8},
}
ENERGON_COLLATE = merge(  # collate-time in-batch packing, MBS 4
    ENERGON,
    {
        "train": {"micro_batch_size": 4, "global_batch_size": 32},
        "dataset": {"packing_buffer_size": DELETE, "micro_batch_size": 4, "enable_in_batch_packing": True},
    },
)
CP2 = {"model": {"context_parallel_size": 2, "calculate_per_token_loss": True}}
BASES = {
    "SFT": SFT,
    "OFFLINE": OFFLINE,
    "GPT": GPT,
    "PROVIDER": PROVIDER,
    "DIRECT_HF": DIRECT_HF,
    "MOCK_VLM": MOCK_VLM,
    "IN_BATCH": IN_BATCH,
    "ENERGON": ENERGON,
    "ENERGON_COLLATE": ENERGON_COLLATE,
    "OFFLINE_CP2": merge(OFFLINE, merge(CP2, {"dataset": {"offline_packing_specs": {"pad_seq_to_mult": 4}}})),
}


def check(config: dict) -> ValidationReport:
    return validate(load_config(config))


def rule_ids(report: ValidationReport) -> list[str]:
    return [finding.rule for finding in report.findings]


def case(rule, severity, base, bad, good, match, *, name=None):
    """One rule: ``base + bad`` triggers it (reason matching ``match``), ``base + good`` does not."""
    return pytest.param(rule, severity, merge(base, bad), merge(base, good), match, id=name or rule)


def patch(section):
    """``patch("model")(seq_length=8)`` -> ``{"model": {"seq_length": 8}}``; other patches merge in."""

    def make(*others, **values):
        return merge({section: values}, *others)

    return make


train, model, data, evals, dist, ddp = map(patch, ("train", "model", "dataset", "validation", "dist", "ddp"))


def specs(*others, **values):
    return data(*others, offline_packing_specs=values)


def kwargs(*others, **values):
    return data(*others, dataset_kwargs=values)


def te_graph(scope, *others, **values):
    return model(*others, cuda_graph_impl="transformer_engine", cuda_graph_scope=scope, **values)


def seq(length, *others):
    return model(data(*others, seq_length=length), seq_length=length)


NO_FIXED_WIDTH = kwargs(pad_to_max_length=False)
PAD_CU = specs(pad_cu_seqlens=True)
OFFLINE_CP2 = BASES["OFFLINE_CP2"]
CP3_P4098 = seq(
    4098,
    model(context_parallel_size=3, calculate_per_token_loss=True),
    specs(packed_sequence_size=4098, pad_seq_to_mult=6),
)
SP_CP2_TP4 = model(
    context_parallel_size=2,
    tensor_model_parallel_size=4,
    sequence_parallel=True,
    calculate_per_token_loss=True,
)
OFFLINE_4096 = data(enable_offline_packing=True, offline_packing_specs={"packed_sequence_size": 4096})
AS_GPT = data(
    type="GPTDatasetConfig",
    dataset_root=DELETE,
    enable_offline_packing=DELETE,
    offline_packing_specs=DELETE,
    dataset_kwargs=DELETE,
)
MBS4 = train(micro_batch_size=4)


def assert_rule_case(rule, severity, bad, good, match):
    """``bad`` reports ``rule`` with ``severity``, a reason matching ``match`` and a fix; ``good`` not."""
    found = [finding for finding in check(bad).findings if finding.rule == rule]
    assert found, f"{rule} not reported:\n{check(bad).format()}"
    assert any(finding.severity == severity and re.search(match, finding.reason) for finding in found), found
    assert all(finding.fix for finding in found)
    assert rule not in rule_ids(check(good)), check(good).format()


def derived(config: dict):
    return check(config).derived


REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
    command = [sys.executable, "-m", "tightpack.cli", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


# The README's example (offline packed SFT, CP=2, TP=2, SP, 4096 tokens), laid out as a Megatron-Bridge
# override file: no dataset.type. k = lcm(2*CP, CP*TP) = 4; DP = 16 / (TP*CP) = 4; 32 / (1*4) = 8 steps.
README_EXAMPLE = """\
model:
  tensor_model_parallel_size: 2
  context_parallel_size: 2
  sequence_parallel: true
  seq_length: 4096
  calculate_per_token_loss: true  # required with CP (R18)
ddp:
  average_in_collective: false
train:
  micro_batch_size: 1  # one pack per micro-batch (R20)
  global_batch_size: 32
  train_iters: 1000
dist:
  world_size: 16
dataset:
  seq_length: 4096
  dataset_root: /data/squad
  enable_offline_packing: true
  offline_packing_specs:
    packed_sequence_size: 4096
    pad_seq_to_mult: 4  # the CP/SP multiple k
    packed_train_data_path: /data/packed/squad-train
    packed_val_data_path: /data/packed/squad-val
    packed_metadata_path: /data/packed/squad-train/metadata.json
  dataset_kwargs:
    pad_to_max_length: true
"""
