"""`tightpack.config`: loading, every validation rule (both sides), derived values and ``tightpack validate``.

Each rule case is a configuration that triggers the rule and the nearest one that does not, both built by
patching one of the clean base configurations below. Expected numbers are derived by hand from contract §5
(k = lcm over train and eval CP of (2*cp if cp > 1) and (cp*tp under SP)) and from the cases of the
reference's ``tests/unit_tests/training/test_config.py`` (contract §8.2).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tightpack.config import (
    DATASET_TYPES,
    RULES,
    PackedSequenceSpecs,
    TrainConfig,
    ValidationReport,
    load_config,
    validate,
)
from tightpack.errors import TightpackError


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

CASES = [
    case("R1", "error", DIRECT_HF, train(data(dataloader_type="batch"), num_epochs=1),
         data(dataloader_type="batch"),
         r"only supported for finite GPTSFTDatasetConfig"),
    case("R1", "error", DIRECT_HF, train(num_epochs=1), {}, r"DirectHFSFTDatasetConfig", name="R1-cyclic"),
    case("R2", "error", SFT, train(data(dataloader_type="single"), num_epochs=2), train(num_epochs=2),
         r'only with dataloader_type="batch"'),
    case("R3", "error", PROVIDER, merge(MBS4, OFFLINE_4096, data(enable_in_batch_packing=True)), OFFLINE_4096,
         r"enable_offline_packing and enable_in_batch_packing are mutually exclusive"),
    case("R4", "error", SFT, data(enable_offline_packing=True), OFFLINE,
         r"offline_packing_specs must be set when enable_offline_packing=True",
         name="R4-enable-without-specs"),
    case("R4", "error", SFT, specs(packed_sequence_size=4096), OFFLINE,
         r"enable_offline_packing must be True when offline_packing_specs is set",
         name="R4-specs-without-enable"),
    case("R5", "error", OFFLINE, merge(PAD_CU, NO_FIXED_WIDTH), PAD_CU,
         r"pad_cu_seqlens=True requires dataset pad_to_max_length=True"),
    case("R6", "error", OFFLINE, te_graph(["mlp"], NO_FIXED_WIDTH), te_graph(["mlp"]),
         r"Offline packing with CUDA graphs requires dataset pad_to_max_length=True", name="R6-mlp-only-te"),
    case("R6", "error", OFFLINE, model(NO_FIXED_WIDTH, cuda_graph_impl="full_iteration"),
         model(PAD_CU, cuda_graph_impl="full_iteration"), r"requires dataset pad_to_max_length",
         name="R6-full-iteration"),
    case("R6", "error", OFFLINE,
         model(NO_FIXED_WIDTH, cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]),
         model(NO_FIXED_WIDTH, cuda_graph_impl="local", cuda_graph_scope=["attn"]),
         r"requires dataset pad_to_max_length", name="R6-local-full-iteration-vs-local-layer"),
    *[
        case("R7", "error", OFFLINE, te_graph(scope), te_graph(["mlp"]),
             r"Packed attention CUDA graphs require offline_packing_specs.pad_cu_seqlens=True",
             name=f"R7-te-{'-'.join(scope) or 'whole-layer'}")
        for scope in ([], ["attn"], ["attn", "mlp"])
    ],
    case("R7", "error", OFFLINE, model(cuda_graph_impl="full_iteration"),
         model(PAD_CU, cuda_graph_impl="full_iteration"), r"pad_cu_seqlens=True", name="R7-full-iteration"),
    case("R8.1", "error", DIRECT_HF, data(pad_to_multiple_of=-3), data(pad_to_multiple_of=1),
         r"pad_to_multiple_of must be greater than 0 \(dataset.pad_to_multiple_of=-3\)"),
    case("R8.1", "error", IN_BATCH, data(in_batch_packing_pad_to_multiple_of=0),
         data(in_batch_packing_pad_to_multiple_of=1),
         r"in_batch_packing_pad_to_multiple_of must be greater than 0",
         name="R8.1-in-batch"),
    case("R8.2", "error", ENERGON, data(path=" "), {}, r"path must be a non-empty path"),
    case("R8.3", "error", ENERGON, data(do_test=True), data(do_test=False),
         r"does not support a distinct test split"),
    case("R8.4", "error", ENERGON, kwargs(batch_size=2, split_part="train"),
         kwargs(subflavors={"source": "coco"}),
         r"cannot override builder-owned arguments: batch_size, split_part"),
    case("R8.5", "error", ENERGON, data(packing_buffer_size=0), data(packing_buffer_size=1),
         r"packing_buffer_size must be greater than 0 when set \(got 0\)"),
    case("R8.6", "error", ENERGON, data(enable_in_batch_packing=True), {},
         r"packing_buffer_size and enable_in_batch_packing=True are mutually exclusive"),
    case("R8.7", "error", ENERGON, data(defer_in_batch_packing_to_step=True), {},
         r"incompatible with defer_in_batch_packing_to_step=True"),
    case("R8.8", "error", ENERGON, data(micro_batch_size=2), {},
         r"Energon native sequence packing requires micro_batch_size=1"),
    case("R8.9", "error", ENERGON, data(task_encoder="GenericHFTaskEncoderConfig"), {},
         r"supports only QwenVLEnergonTaskEncoderConfig"),
    case("R8.9", "error", ENERGON, data(task_encoder=DELETE), {}, r"task_encoder=None", name="R8.9-unset"),
    case("R9", "error", ENERGON_COLLATE, data(micro_batch_size=2), {},
         r"micro_batch_size must match train.micro_batch_size \(2 != 4\)"),
    case("R10.1", "error", ENERGON, train(micro_batch_size=2, global_batch_size=16), {},
         r"requires train.micro_batch_size=1"),
    case("R10.2", "error", ENERGON, model(calculate_per_token_loss=False), {},
         r"requires model.calculate_per_token_loss=True"),
    case("R10.3", "error", ENERGON, ddp(average_in_collective=True), ddp(average_in_collective=False),
         r"requires ddp.average_in_collective=False"),
    case("R10.4", "error", ENERGON, model(mtp_num_layers=1), model(mtp_num_layers=0),
         r"does not support MTP"),
    case("R10.5", "error", ENERGON, model(cuda_graph_impl="local"), model(cuda_graph_impl=None),
         r"does not support CUDA graphs \(model.cuda_graph_impl='local'\)"),
    case("R10.5", "error", ENERGON, model(vision_cuda_graph_impl="transformer_engine"),
         model(vision_cuda_graph_impl="none"), r"vision_cuda_graph_impl='transformer_engine'",
         name="R10.5-vision"),
    case("R10.6", "error", ENERGON, {"dist_train": {"use_dist_train": True}},
         {"dist_train": {"use_dist_train": False}}, r"does not support Qwen3-VL DistTrain"),
    case("R10.7", "error", ENERGON, model(pipeline_model_parallel_size=2),
         model(expert_model_parallel_size=8),
         r"does not yet support pipeline parallelism"),
    case("R11", "warning", ENERGON, model(overlap_moe_expert_parallel_comm=True),
         model({"comm_overlap": {"delay_wgrad_compute": False}}, overlap_moe_expert_parallel_comm=False),
         r"Disabling MoE expert-parallel communication overlap.*"
         r"requested by model.overlap_moe_expert_parallel_comm"),
    case("R11", "warning", ENERGON,
         {"comm_overlap": {"user_comm_overlap_cfg": {"delay_wgrad_compute": True}}},
         {"comm_overlap": {"user_comm_overlap_cfg": {"delay_wgrad_compute": False}}},
         r"requested by comm_overlap.user_comm_overlap_cfg.delay_wgrad_compute", name="R11-user-cfg"),
    case("R13", "error", DIRECT_HF, seq(20, SP_CP2_TP4), seq(24, SP_CP2_TP4),
         r"DirectHFSFTDatasetConfig.seq_length must be divisible by the CP/SP collate padding "
         r"multiple \(8\)"),
    case("R15", "error", ENERGON_COLLATE, evals(eval_micro_batch_size=2),
         evals(data(do_validation=False), eval_micro_batch_size=2),
         r"must match validation.eval_micro_batch_size \(4 != 2\)"),
    case("R16", "error", SFT, evals(eval_global_batch_size=12), evals(eval_global_batch_size=16),
         r"eval_global_batch_size \(12\) is not divisible by eval micro batch size \(1\) times eval data "
         r"parallel size \(8\)"),
    case("R16", "error", SFT, dist(evals(eval_global_batch_size=6), eval_context_parallel_size=2),
         dist(evals(eval_global_batch_size=8), eval_context_parallel_size=2),
         r"eval data parallel size \(4\)", name="R16-eval-cp"),
    case("R16", "error", SFT, dist(seq(4104), eval_context_parallel_size=3),
         dist(eval_context_parallel_size=4),
         r"not divisible by TP\*PP\*eval CP \(3\)", name="R16-eval-dp-not-integral"),
    case("R17", "error", SFT, seq(510, CP2), seq(512, CP2),
         r"Sequence length must be divisible by 2 \* context parallel size"),
    case("R17", "error", SFT, seq(4100, model(context_parallel_size=4, calculate_per_token_loss=True)),
         model(context_parallel_size=4, calculate_per_token_loss=True), r"2\*CP=8", name="R17-cp4"),
    case("R18", "error", SFT, model(context_parallel_size=2), CP2, r"calculate_per_token_loss must be True"),
    case("R18", "error", SFT, ddp(CP2, average_in_collective=True), CP2,
         r"average_in_collective must be False", name="R18-average"),
    case("R18", "error", MOCK_VLM, model(context_parallel_size=2), CP2, r"calculate_per_token_loss",
         name="R18-mock-vlm"),
    case("R18", "error", ENERGON_COLLATE, model(context_parallel_size=2, calculate_per_token_loss=False),
         model(context_parallel_size=2), r"calculate_per_token_loss", name="R18-energon"),
    case("R18", "error", DIRECT_HF, model(context_parallel_size=2), {}, r"calculate_per_token_loss",
         name="R18-direct-hf-vs-cp1"),
    case("R18", "error", SFT, model(context_parallel_size=2), model(AS_GPT, context_parallel_size=2),
         r"calculate_per_token_loss", name="R18-pretraining-exempt"),
    case("R19", "error", OFFLINE, specs(packed_sequence_size=-1), specs(packed_sequence_size=4096),
         r"packed_sequence_size must be greater than 0 \(got -1\)"),
    case("R20", "error", OFFLINE, MBS4, train(micro_batch_size=1),
         r"Micro batch size should be 1 when training with packed sequence, but your micro batch size is 4"),
    case("R20", "error", PROVIDER, merge(MBS4, OFFLINE_4096), MBS4, r"micro batch size is 4",
         name="R20-provider-vs-no-packing"),
    case("R20", "error", OFFLINE, MBS4, merge(MBS4, AS_GPT), r"micro batch size is 4",
         name="R20-gpt-dataset-exempt"),
    case("R21", "error", IN_BATCH, train(micro_batch_size=1), {},
         r"^micro_batch_size should be greater than 1 when using enable_in_batch_packing=True\. In-batch "
         r"packing concatenates multiple sequences within a microbatch, so at least 2 sequences are required "
         r"per micro-batch\.$"),
    case("R22", "error", SFT, data(seq_length=2048), {}, r"model.seq_length=4096, dataset.seq_length=2048"),
    case("R22", "error", GPT, model(seq_length=2048), model(data(type="DatasetProvider"), seq_length=2048),
         r"configuration in model config and dataset config match", name="R22-gpt-vs-provider"),
    case("X1", "error", SFT, train(global_batch_size=12), train(global_batch_size=16),
         r"global batch size \(12\) is not divisible by micro batch size \(1\) times data parallel size "
         r"\(8\)\.$"),
    case("X1", "error", SFT, train(global_batch_size=4), train(global_batch_size=8),
         r"at least one micro-batch", name="X1-below-one-micro-batch"),
    case("X1", "error", SFT, model(tensor_model_parallel_size=3), model(tensor_model_parallel_size=4),
         r"dist.world_size \(8\) is not divisible by TP\*PP\*CP = 3\*1\*1 = 3", name="X1-dp-not-integral"),
    case("X2", "error", SFT, model(ddp(average_in_collective=True), calculate_per_token_loss=True),
         model(calculate_per_token_loss=True), r"Cannot average in collective when calculating per-token"),
    case("X3", "error", OFFLINE, evals(eval_micro_batch_size=2),
         evals(data(do_validation=False), eval_micro_batch_size=2),
         r"Packed THD batches need micro-batch size 1"),
    case("X3", "error", OFFLINE_CP2, evals(eval_micro_batch_size=2), evals(eval_micro_batch_size=1),
         r"expect micro-batch size 1 for context-parallel slicing", name="X3-cp"),
    case("X4", "error", OFFLINE, specs(pad_seq_to_mult=0), specs(pad_seq_to_mult=None),
         r"pad_seq_to_mult must be a positive integer when provided \(got 0\)", name="X4-multiple"),
    case("X4", "error", OFFLINE, specs(max_single_sequence_length=0), specs(max_single_sequence_length=1),
         r"max_single_sequence_length must be positive", name="X4-cap-positive"),
    case("X4", "error", OFFLINE, specs(max_single_sequence_length=4097),
         specs(max_single_sequence_length=4096),
         r"max_single_sequence_length \(4097\) cannot exceed packed_sequence_size \(4096\)",
         name="X4-cap-fits"),
    case("X4", "warning", OFFLINE, specs(packed_train_data_path="/p/train.NPY"),
         specs(packed_train_data_path="/p/train.idx.parquet"), r"\.npy packed sequence format is deprecated",
         name="X4-npy"),
    case("X5", "error", OFFLINE, data(specs(packed_val_data_path="/p/val.parquet"), hf_rewrite=True),
         data(hf_rewrite=True), r"hf_rewrite cannot safely replace explicit packed data paths"),
    case("X5", "error", OFFLINE, kwargs(max_num_samples=100), data(max_train_samples=100),
         r"Set max_train_samples directly", name="X5-max-num-samples"),
    *[
        case("X6", "error", OFFLINE, te_graph(scope, PAD_CU, num_moe_experts=8),
             te_graph(["attn", "mlp"], PAD_CU, num_moe_experts=8),
             r"Packed MoE padding masks do not support router-scoped",
             name=f"X6-{'-'.join(scope) or 'whole-layer'}")
        for scope in ([], ["moe_router"], ["attn", "moe"])
    ],
    case("X6", "error", OFFLINE, te_graph([], PAD_CU, num_moe_experts=8), te_graph([], PAD_CU),
         r"router-scoped", name="X6-dense-model-exempt"),
    case("T1", "error", OFFLINE_CP2, specs(packed_sequence_size=4094), specs(packed_sequence_size=4092),
         r"packed_sequence_size \(4094\) is not a multiple of 4 .*trailing width segment",
         name="T1-pack-size"),
    case("T1", "error", OFFLINE, merge(CP3_P4098, NO_FIXED_WIDTH), CP3_P4098,
         r"rounded up to pad_seq_length_to_mult=16, which is not a multiple of 6", name="T1-width-rounding"),
    case("T1", "error", OFFLINE_CP2, kwargs(pad_to_max_length=False, pad_seq_length_to_mult=2),
         NO_FIXED_WIDTH,
         r"pad_seq_length_to_mult=2", name="T1-rounding-cp2-vs-default-16"),
    case("T1", "error", OFFLINE, kwargs(CP3_P4098, pad_to_max_length=False, ceil_to_power_2=True),
         kwargs(OFFLINE_CP2, pad_to_max_length=False, ceil_to_power_2=True), r"ceil_to_power_2",
         name="T1-power-of-two"),
    case("T2", "error", OFFLINE_CP2, specs(pad_seq_to_mult=2), specs(pad_seq_to_mult=8),
         r"pad_seq_to_mult \(2\) is not a multiple of 4 .*divisible by 2\*CP"),
    case("T2", "warning", OFFLINE, model(tensor_model_parallel_size=4, sequence_parallel=True),
         model(specs(pad_seq_to_mult=4), tensor_model_parallel_size=4, sequence_parallel=True),
         r"not a multiple of the sequence-parallel multiple 4", name="T2-sp-only"),
    case("T2", "error", OFFLINE_CP2, dist(eval_context_parallel_size=4),
         dist(specs(pad_seq_to_mult=8), eval_context_parallel_size=4),
         r"not a multiple of 8 \(k = 8 from TP=1, CP=2, eval CP=4", name="T2-eval-cp"),
    case("T3", "error", SFT, dist(seq(4100), eval_context_parallel_size=4),
         dist(seq(4100), eval_context_parallel_size=2),
         r"divisible by 2 \* the evaluation context parallel size \(model.seq_length=4100, 2\*eval CP=8\)"),
    case("T4", "warning", SFT, dist(eval_context_parallel_size=2),
         dist(model(calculate_per_token_loss=True), eval_context_parallel_size=2),
         r"Evaluating fine-tuning data with CP=2 without calculate_per_token_loss"),
    case("T5", "error", IN_BATCH, train(data(dataloader_type="batch"), global_batch_size=64),
         train(global_batch_size=64), r'dataloader_type="batch" .*cannot be split into 2 micro-batches'),
    case("T5", "error", IN_BATCH, train(data(dataloader_type="batch"), global_batch_size=64),
         data(dataloader_type="batch"), r"2 micro-batches", name="T5-one-micro-batch-is-fine"),
    case("T6", "warning", ENERGON_COLLATE, model(expert_model_parallel_size=2),
         model(data(defer_in_batch_packing_to_step=True), expert_model_parallel_size=2),
         r"fixed width \(forced by PP>1 or EP>1, R12\) puts 4 rows into one row of seq_length=4096"),
    case("T7", "warning", OFFLINE, specs(packed_sequence_size=2048), {},
         r"packed_sequence_size \(2048\) differs from dataset.seq_length \(4096\)"),
]  # fmt: skip


@pytest.mark.parametrize("name", BASES)
def test_bases_are_clean(name):
    report = check(BASES[name])
    assert report.ok and report.findings == (), report.format()


@pytest.mark.parametrize(("rule", "severity", "bad", "good", "match"), CASES)
def test_rule(rule, severity, bad, good, match):
    found = [finding for finding in check(bad).findings if finding.rule == rule]
    assert found, f"{rule} not reported:\n{check(bad).format()}"
    assert any(finding.severity == severity and re.search(match, finding.reason) for finding in found), found
    assert all(finding.fix for finding in found)
    assert rule not in rule_ids(check(good)), check(good).format()


def test_every_rule_has_a_case_and_runs_in_contract_order():
    assert {param.values[0] for param in CASES} == {rule_id for rule_id, _ in RULES}
    assert [rule_id for rule_id, _ in RULES] == [
        "R1", "R2", "R3", "R4", "R5", "R6", "R7",
        *(f"R8.{i}" for i in range(1, 10)), "R9", *(f"R10.{i}" for i in range(1, 8)),
        "R11", "R13", "R15", "R16", "R17", "R18", "R19", "R20", "R21", "R22",
        "X1", "X2", "X3", "X4", "X5", "X6", "T1", "T2", "T3", "T4", "T5", "T6", "T7",
    ]  # fmt: skip


def test_native_rules_are_all_reported_in_order():
    """The reference raises at the first R10 error; the report lists every one, in the reference's order."""
    config = merge(
        ENERGON,
        model(mtp_num_layers=1, cuda_graph_impl="local", pipeline_model_parallel_size=2),
        train(micro_batch_size=2, global_batch_size=8),
        ddp(average_in_collective=True),
        dist(world_size=4),
        {"dist_train": {"use_dist_train": True}},
    )
    native = [rule for rule in rule_ids(check(config)) if rule.startswith(("R9", "R10", "R15"))]
    # Dataset MBS 1 vs train MBS 2: R9, and R15 through the eval MBS, which defaults to the train MBS.
    assert native == ["R9", "R10.1", "R10.3", "R10.4", "R10.5", "R10.6", "R10.7", "R15"]


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


# -- derived values (R11, R12, R14, the batch arithmetic) ------------------------------------------


def derived(config: dict):
    return check(config).derived


@pytest.mark.parametrize(
    ("config", "in_batch", "non_packed"),
    [
        # Contract §8.2: CP2/TP4/SP -> lcm(4, 8) = 8; the non-packed multiple is lcm(user 3, 8) = 24.
        (merge(IN_BATCH, SP_CP2_TP4), 8, None),
        (merge(DIRECT_HF, SP_CP2_TP4, data(pad_to_multiple_of=3)), None, 24),
        # CP2/TP2/SP and eval CP4: lcm(4, 4, 8, 8) = 8.
        (merge(IN_BATCH, SP_CP2_TP4, model(tensor_model_parallel_size=2), dist(eval_context_parallel_size=4)),
         8, None),
        # Eval CP2 alone: lcm(3, 4) = 12.
        (merge(DIRECT_HF, data(pad_to_multiple_of=3), dist(eval_context_parallel_size=2)), None, 12),
        # Energon deferred packing still gets the packed multiple; non-packed Energon gets lcm(3, 8).
        (merge(ENERGON_COLLATE, SP_CP2_TP4, data(defer_in_batch_packing_to_step=True)), 8, None),
        (merge(ENERGON_COLLATE, SP_CP2_TP4, data(enable_in_batch_packing=False, pad_to_multiple_of=3)),
         None, 24),
        (merge(ENERGON, SP_CP2_TP4), 8, None),
        (merge(MOCK_VLM, SP_CP2_TP4, MBS4, data(enable_in_batch_packing=True)), 8, None),
        (merge(MOCK_VLM, SP_CP2_TP4, data(pad_to_multiple_of=3)), None, 24),
        # No CP/SP: the user's in-batch value is overwritten with k = 1.
        (merge(IN_BATCH, data(in_batch_packing_pad_to_multiple_of=64)), 1, None),
    ],
)  # fmt: skip
def test_r14_collate_multiples(config, in_batch, non_packed):
    values = derived(config)
    assert values.in_batch_packing_pad_to_multiple_of == in_batch
    assert values.pad_to_multiple_of == non_packed
    assert values.enable_in_batch_packing == (in_batch is not None)


def test_r14_native_packing_marks_the_transformer_and_pp_sets_variable_lengths():
    native = derived(merge(ENERGON, SP_CP2_TP4))
    assert native.packing == "native_energon" and native.enable_in_batch_packing
    assert native.alignment_multiple == 8
    assert native.overrides()["model._enable_in_batch_packing"] is True
    piped = derived(merge(IN_BATCH, {"model": {"pipeline_model_parallel_size": 2}}))
    assert piped.variable_seq_lengths and piped.overrides()["model.variable_seq_lengths"] is True
    assert not derived(IN_BATCH).variable_seq_lengths


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (ENERGON, False),
        (merge(ENERGON, model(expert_model_parallel_size=8)), True),  # any EP dispatcher
        (merge(IN_BATCH, model(pipeline_model_parallel_size=2)), True),
        (merge(DIRECT_HF, data(pad_to_max_length=True)), True),  # a user True stays True
        (OFFLINE, True),  # GPT SFT: read from dataset_kwargs, never forced
        (merge(OFFLINE, model(expert_model_parallel_size=2), NO_FIXED_WIDTH), False),
        (GPT, None),
    ],
)
def test_r12_effective_pad_to_max_length(config, expected):
    assert derived(config).pad_to_max_length is expected


def test_r11_forces_every_copy_off_and_warns_once_per_report():
    config = merge(
        ENERGON,
        {
            "model": {"overlap_moe_expert_parallel_comm": True},
            "comm_overlap": {
                "overlap_moe_expert_parallel_comm": True,
                "user_comm_overlap_cfg": {"delay_wgrad_compute": True, "tp_comm_bootstrap_backend": "nccl"},
            },
        },
    )
    report = check(config)
    assert [finding.rule for finding in report.warnings] == ["R11"]
    assert report.ok
    assert report.derived.forced_off == (
        "model.overlap_moe_expert_parallel_comm",
        "model.delay_wgrad_compute",
        "comm_overlap.overlap_moe_expert_parallel_comm",
        "comm_overlap.delay_wgrad_compute",
        "comm_overlap.user_comm_overlap_cfg.delay_wgrad_compute",
    )
    assert all(value is False for key, value in report.derived.overrides().items() if "overlap" in key)
    assert derived(merge(IN_BATCH, {"model": {"delay_wgrad_compute": True}})).forced_off == ()


def test_batch_arithmetic():
    values = derived(
        merge(SFT, CP2, dist(world_size=16, eval_context_parallel_size=4), evals(eval_global_batch_size=8))
    )
    # DP = 16 / (1*1*2) = 8 -> 32 / (1*8) = 4 micro-batches; eval DP = 16 / 4 = 4 -> 8 / 4 = 2.
    assert (values.data_parallel_size, values.micro_batches_per_step) == (8, 4)
    assert (values.eval_data_parallel_size, values.eval_micro_batches_per_step) == (4, 2)
    assert (values.eval_context_parallel_size, values.eval_micro_batch_size) == (4, 1)
    assert values.alignment_multiple == 8  # lcm(2*2, 2*4)
    assert derived(merge(SFT, {"train": {"global_batch_size": 12}})).micro_batches_per_step is None


def test_r20_fix_gives_the_equivalent_configuration():
    report = check(merge(OFFLINE, {"train": {"micro_batch_size": 4, "global_batch_size": 32}}))
    (finding,) = report.errors
    assert "train.micro_batch_size: 1 (now 4)" in finding.fix
    assert "train.global_batch_size: 8 (now 32)" in finding.fix
    assert "packed_sequence_size: 16384 (now 4096)" in finding.fix
    odd = check(merge(OFFLINE, {"train": {"micro_batch_size": 3, "global_batch_size": 48}}))
    assert "train.global_batch_size: 16 (now 48)" in odd.errors[0].fix
    uneven = check(merge(OFFLINE, {"train": {"micro_batch_size": 4, "global_batch_size": 30}}))
    assert "GBS/MBS is not an integer" in uneven.errors[0].fix


def test_fixes_give_the_nearest_valid_numbers():
    report = check(merge(OFFLINE_CP2, {"dataset": {"offline_packing_specs": {"packed_sequence_size": 4094}}}))
    (t1,) = [finding for finding in report.findings if finding.rule == "T1"]
    assert "a multiple of 4: 4092 or 4096" in t1.fix
    (x1,) = check(merge(SFT, {"train": {"global_batch_size": 12}})).errors
    assert x1.fix == "Set train.global_batch_size to a multiple of 8: 8 or 16."


# -- loading ------------------------------------------------------------------------------------


def test_load_from_yaml_and_dict_agree(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        """
train: {micro_batch_size: 1, global_batch_size: 32}
model:
  seq_length: 4096
  cuda_graph_impl: null
  cuda_graph_scope: [attn, mlp]
dist: {world_size: 8, eval_context_parallel_size: 2}
dataset:
  type: GPTSFTDatasetConfig
  seq_length: 4096
  hf_dataset: {path_or_dataset: squad}
  enable_offline_packing: true
  offline_packing_specs:
    packed_sequence_size: 4096
    pad_seq_to_mult: null
  dataset_kwargs: {pad_to_max_length: true}
""",
        encoding="utf-8",
    )
    from_yaml = load_config(path)
    assert from_yaml == load_config(str(path))
    expected = merge(
        OFFLINE,
        {
            "model": {"cuda_graph_impl": None, "cuda_graph_scope": ["attn", "mlp"]},
            "dist": {"eval_context_parallel_size": 2},
            "dataset": {"dataset_root": DELETE, "hf_dataset": {"path_or_dataset": "squad"},
                        "offline_packing_specs": {"pad_seq_to_mult": None}},
        },
    )  # fmt: skip
    assert from_yaml == load_config(expected)
    assert isinstance(from_yaml.dataset.offline_packing_specs, PackedSequenceSpecs)
    assert from_yaml.dataset.dataloader_type == "batch"  # the kind's default
    assert from_yaml.validation.eval_micro_batch_size is None and from_yaml.comm_overlap is None


@pytest.mark.parametrize(("kind", "loader"), [(name, cls) for name, cls in DATASET_TYPES.items()])
def test_dataset_kinds_and_their_loader_defaults(kind, loader):
    config = merge(SFT, {"dataset": {"type": kind, "dataset_root": DELETE}})
    if kind == "EnergonDatasetConfig":
        config = merge(ENERGON, {})
    elif kind == "GPTSFTDatasetConfig":
        config = SFT
    dataset = load_config(config).dataset
    assert type(dataset) is loader
    defaults = {
        "GPTSFTDatasetConfig": "batch",
        "DirectHFSFTDatasetConfig": "cyclic",
        "MockVLMSFTDatasetConfig": "single",
        "EnergonDatasetConfig": "external",
    }
    assert dataset.dataloader_type == defaults.get(kind, "single")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train": {"micro_batch_sise": 1}},
         r"^unknown key 'micro_batch_sise' in train \(train.micro_batch_sise\); "
         r"did you mean train.micro_batch_size\?$"),
        (merge(SFT, {"train": {"seq_length": 4096}}),
         r"unknown key 'seq_length' in train .*did you mean model.seq_length or dataset.seq_length\?"),
        (merge(SFT, {"model": {"eval_context_parallel_size": 2}}),
         r"did you mean dist.eval_context_parallel_size\?"),
        (merge(OFFLINE, {"dataset": {"offline_packing_specs": {"pad_seq_to_multiple": 4}}}),
         r"in dataset.offline_packing_specs .*did you mean dataset.offline_packing_specs.pad_seq_to_mult\?"),
        (merge(SFT, {"dataset": {"pad_to_max_length": True}}),
         r"unknown key 'pad_to_max_length' in dataset \(GPTSFTDatasetConfig\).*it is a field of "
         r"DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig, "
         r"not of GPTSFTDatasetConfig.*"
         r"takes it as dataset.dataset_kwargs.pad_to_max_length"),
        (merge(SFT, data(packing_buffer_size=8)), r"it is a field of EnergonDatasetConfig, not of GPTSFT"),
        (merge(SFT, {"bogus_section": {}}),
         r"unknown key 'bogus_section' in the top level \(bogus_section\); valid keys: train, model, "),
        (merge(SFT, {"dataset": {"type": "GPTSFTDataset"}}),
         r"unknown dataset.type 'GPTSFTDataset'; did you mean 'GPTSFTDatasetConfig'\?"),
        (merge(GPT, data(type=DELETE, split=DELETE)),
         r"^dataset has no type and its fields \(seq_length\) fit 6 dataset types"),
        (merge(SFT, {"model": {"seq_length": DELETE}}), r"^missing required key model.seq_length$"),
        (merge(ENERGON, {"dataset": {"path": DELETE}}), r"^missing required key dataset.path$"),
        (merge(SFT, train(micro_batch_size=True)),
         r"^train.micro_batch_size must be an integer, got bool True$"),
        (merge(SFT, train(micro_batch_size="4")), r"train.micro_batch_size must be an integer, got str '4'"),
        (merge(SFT, model(sequence_parallel="yes")), r"model.sequence_parallel must be true or false"),
        (merge(SFT, {"model": {"cuda_graph_impl": "transformer-engine"}}),
         r"model.cuda_graph_impl must be one of none, local, transformer_engine, full_iteration, got "
         r"'transformer-engine'; did you mean 'transformer_engine'\?"),
        (merge(SFT, model(cuda_graph_scope=["attn", "mpl"])), r"model.cuda_graph_scope\[1\] must be one of"),
        (merge(SFT, model(cuda_graph_scope="attn")), r"model.cuda_graph_scope must be a list of .* or null"),
        (merge(SFT, {"dataset": {"offline_packing_specs": [4096]}}),
         r"dataset.offline_packing_specs must be a mapping or null, got list"),
        (merge(SFT, model(context_parallel_size=0)),
         r"^model.context_parallel_size must be at least 1, got 0$"),
        (merge(SFT, dist(eval_context_parallel_size=-2)),
         r"dist.eval_context_parallel_size must be at least 1, got -2"),
        (merge(SFT, {"dataset": {"dataloader_type": "batched"}}), r"did you mean 'batch'\?"),
        (merge(SFT, {"train": [1, 2]}), r"^train must be a mapping, got list"),
        ({**SFT, 3: {}}, r"non-string key 3"),
    ],
)  # fmt: skip
def test_load_errors_name_the_path(config, message):
    with pytest.raises(TightpackError, match=message):
        load_config(config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train: [\n", r"cannot parse config .*bad.yaml as YAML: .*\(line 2, column 1\)"),
        ("", r"must be a mapping of sections .*got null"),
        ("- train\n", r"must be a mapping of sections .*got list"),
        ("train: {micro_batch_size: 1, global_batch_size: 8}\n", r"^missing required key model$"),
    ],
)
def test_yaml_file_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TightpackError, match=message):
        load_config(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(TightpackError, match=r"cannot read config .*missing.yaml: No such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(TightpackError, match=r"cannot read config"):
        load_config(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"train: caf\xe9\n")
    with pytest.raises(TightpackError, match=r"cannot read config .*latin1.yaml"):
        load_config(tmp_path / "latin1.yaml")


def test_direct_construction_checks_ranges():
    with pytest.raises(TightpackError, match=r"^TrainConfig.micro_batch_size must be at least 1, got 0$"):
        TrainConfig(micro_batch_size=0, global_batch_size=8)
    assert (
        dataclasses.replace(TrainConfig(micro_batch_size=1, global_batch_size=8), num_epochs=2).num_epochs
        == 2
    )


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


# -- the command line ----------------------------------------------------------------------------


def run_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
    command = [sys.executable, "-m", "tightpack.cli", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


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


# -- configuration files as users have them: no dataset.type, _target_ class paths ---------------

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

# A configuration as Megatron-Bridge serializes it: every section names its class with _target_.
SERIALIZED = """\
_target_: megatron.bridge.training.config.ConfigContainer
comm_overlap: null
train:
  _target_: megatron.bridge.training.config.TrainingConfig
  micro_batch_size: 1
  global_batch_size: 32
model:
  _target_: megatron.bridge.models.llama.llama_provider.Llama31ModelProvider
  seq_length: 4096
  context_parallel_size: 2
  calculate_per_token_loss: true
ddp:
  _target_: megatron.bridge.training.config.DistributedDataParallelConfig
  average_in_collective: false
  use_distributed_optimizer: true
validation:
  _target_: megatron.training.config.ValidationConfig
  eval_iters: 32
dist:
  _target_: megatron.bridge.training.config.DistributedInitConfig
  world_size: 8
dataset:
  _target_: megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig
  seq_length: 4096
  dataset_root: /data/squad
  enable_offline_packing: true
  offline_packing_specs:
    _target_: megatron.bridge.data.packing.config.PackedSequenceSpecs
    packed_sequence_size: 4096
    pad_seq_to_mult: 4
  dataset_kwargs:
    pad_to_max_length: true
"""


def test_readme_example_validates_clean(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(README_EXAMPLE, encoding="utf-8")
    report = validate(load_config(path))
    assert report.ok and report.findings == (), report.format()
    assert report.derived.dataset_type == "GPTSFTDatasetConfig"
    assert (report.derived.alignment_multiple, report.derived.micro_batches_per_step) == (4, 8)
    assert report.derived.packing == "offline"
    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(
        r"^  dataset type +GPTSFTDatasetConfig \(inferred from its fields: dataset_root\)$",
        result.stdout,
        re.M,
    )
    assert result.stdout.splitlines()[-1] == "result: ok (0 errors, 0 warnings)"


@pytest.mark.parametrize(
    ("section", "kind", "source"),
    [
        # A field only one type has decides it.
        ({"seq_length": 4096, "hf_dataset": "squad"}, "GPTSFTDatasetConfig", "hf_dataset"),
        ({"seq_length": 4096, "split": "99,1,0"}, "GPTDatasetConfig", "split"),
        ({"seq_length": 4096, "path": "/data/wds", "micro_batch_size": 1, "task_encoder": "T"},
         "EnergonDatasetConfig", "path, micro_batch_size, task_encoder"),
        ({"seq_length": 4096, "dataset_kwargs": {}, "pad_to_multiple_of": 8, "path": "/wds",
          "micro_batch_size": 1},
         "EnergonDatasetConfig", "path, micro_batch_size"),
        # Megatron-Bridge's fields decide too; a key no kind has (cache_tag) does not.
        ({"seq_length": 4096, "data_path": ["/data/a"], "blend": None, "cache_tag": "v2"},
         "GPTDatasetConfig", "data_path, blend"),
        ({"seq_length": 4096, "hf_output_root": "/data/out"}, "GPTSFTDatasetConfig", "hf_output_root"),
        # No field is unique, but only the custom provider has both: the named fields are the combination.
        ({"seq_length": 4096, "enable_in_batch_packing": True, "offline_packing_specs": None},
         "DatasetProvider", "enable_in_batch_packing, offline_packing_specs"),
    ],
)  # fmt: skip
def test_dataset_type_inferred_from_its_fields(section, kind, source):
    config = load_config({**SFT, "dataset": section})
    assert config.dataset.type == kind
    assert validate(config).derived.dataset_type_source == f"inferred from its fields: {source}"


def test_dataset_type_source_when_given():
    assert derived(SFT).dataset_type_source == "dataset.type"
    target = {"_target_": "megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig"}
    both = merge(SFT, {"dataset": target})
    assert derived(both).dataset_type_source == "dataset.type"
    only_target = merge(both, data(type=DELETE))
    assert derived(only_target).dataset_type_source == "dataset._target_"
    assert load_config(only_target) == load_config(SFT)


def test_serialized_config_with_targets_on_every_section(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text(SERIALIZED, encoding="utf-8")
    config = load_config(path)
    plain = yaml.safe_load(SERIALIZED.replace("_target_:", "_dropped_:"))

    def strip(value):
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items() if key != "_dropped_"}
        return value

    plain = strip(plain)
    plain["dataset"]["type"] = "GPTSFTDatasetConfig"
    assert config == load_config(plain)
    report = validate(config)
    assert report.ok and report.findings == (), report.format()
    assert report.derived.dataset_type_source == "dataset._target_"
    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^  dataset type +GPTSFTDatasetConfig \(from dataset._target_\)$", result.stdout, re.M)


@pytest.mark.parametrize(
    "target",
    [
        "megatron.bridge.training.config.FinetuningDatasetConfig",  # the deprecated name of GPT SFT
        "megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig",
        "GPTSFTDatasetConfig",  # a bare class name
    ],
)
def test_target_names_for_gpt_sft(target):
    config = merge(SFT, data(type=DELETE, _target_=target))
    assert load_config(config).dataset.type == "GPTSFTDatasetConfig"


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        ("megatron.bridge.training.config.MockGPTDatasetConfig", "GPTDatasetConfig"),
        ("megatron.bridge.training.config.GPTDatasetConfig", "GPTDatasetConfig"),
        ("megatron.bridge.data.builders.mock_vlm_sft.MockVLMSFTDatasetConfig", "MockVLMSFTDatasetConfig"),
        ("megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig", "DirectHFSFTDatasetConfig"),
    ],
)
def test_target_resolves_types_fields_cannot(target, kind):
    """DirectHF and MockVLM have the same fields; a class path tells them apart."""
    config = merge(SFT, data(type=DELETE, dataset_root=DELETE, _target_=target))
    assert load_config(config).dataset.type == kind


def test_custom_provider_target_with_type_dataset_provider():
    config = merge(PROVIDER, data(_target_="my_project.data.ShardedProvider"))
    assert load_config(config).dataset.type == "DatasetProvider"


@pytest.mark.parametrize(
    ("model_target"),
    [
        "megatron.bridge.models.GPTModelProvider",
        "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider",
        "megatron.bridge.models.gpt.gpt_builder.GPTModelConfig",
        "megatron.bridge.models.megatron_mimo.megatron_mimo_provider.MegatronMIMOProvider",
    ],
)
def test_model_target_accepts_any_model_provider(model_target):
    assert load_config(merge(SFT, model(_target_=model_target))) == load_config(SFT)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # Ambiguous: a Megatron-Bridge recipe override sets only the length.
        ({**SFT, "dataset": {"seq_length": 2048}},
         r"^dataset has no type and its fields \(seq_length\) fit 6 dataset types: GPTDatasetConfig, "
         r"GPTSFTDatasetConfig, DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig, "
         r"DatasetProvider; set dataset.type to the one you mean \(e.g. type: GPTDatasetConfig\) or "
         r"dataset._target_ to its class path "
         r"\(e.g. _target_: megatron.bridge.training.config.GPTDatasetConfig\)$"),
        ({**SFT, "dataset": {"seq_length": 4096, "enable_offline_packing": True,
                             "offline_packing_specs": {"packed_sequence_size": 4096}}},
         r"fields \(seq_length, enable_offline_packing, offline_packing_specs\) fit 2 dataset types: "
         r"GPTSFTDatasetConfig, DatasetProvider; set dataset.type .*\(e.g. _target_: "
         r"megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig\)$"),
        (merge(IN_BATCH, data(type=DELETE)),
         r"fit 4 dataset types: DirectHFSFTDatasetConfig, EnergonDatasetConfig, MockVLMSFTDatasetConfig, "
         r"DatasetProvider;"),
        # Fits none: every field is known, but to different types.
        (merge(SFT, data(type=DELETE, packing_buffer_size=8)),
         r"^dataset has no type and its fields fit no dataset type: dataset_root is a field of "
         r"GPTSFTDatasetConfig only, packing_buffer_size of EnergonDatasetConfig only; set dataset.type "
         r"and remove the fields it does not have$"),
        # Unknown fields are named as with a type.
        (merge(SFT, data(type=DELETE, dataset_root=DELETE, dataset_rot="/data")),
         r"^unknown key 'dataset_rot' in dataset \(dataset.dataset_rot\); no dataset type has it; did you "
         r"mean dataset.dataset_root\?$"),
        # Only the keys that look like a checked field are errors ('colour' is accepted, not checked).
        (merge(SFT, data(type=DELETE, global_batch_size=8, colour="red")),
         r"^unknown key 'global_batch_size' in dataset \(dataset.global_batch_size\); no dataset type has "
         r"it; did you mean train.global_batch_size\?$"),
        (merge(SFT, data(type=DELETE, global_batch_size=8, seq_lenght=4096)),
         r"^unknown keys 'global_batch_size', 'seq_lenght' in dataset "
         r"\(dataset.global_batch_size, dataset.seq_lenght\); no dataset type has them; did you mean "
         r"train.global_batch_size \(for global_batch_size\), dataset.seq_length \(for seq_lenght\)\?$"),
        # Inferred, then incomplete: the message says which type was inferred.
        (merge(SFT, data(type=DELETE, dataset_root=DELETE, packing_buffer_size=8)),
         r"^missing required key dataset.path \(dataset type inferred as EnergonDatasetConfig from its "
         r"fields: packing_buffer_size; set dataset.type if you meant another\)$"),
        # _target_ on the dataset.
        (merge(SFT, data(_target_="megatron.bridge.data.builders.energon.EnergonDatasetConfig")),
         r"^dataset.type 'GPTSFTDatasetConfig' and dataset._target_ "
         r"'megatron.bridge.data.builders.energon.EnergonDatasetConfig' name different dataset types "
         r"\(GPTSFTDatasetConfig, EnergonDatasetConfig\); keep the one you mean and remove the other$"),
        (merge(SFT, data(type=DELETE, _target_="megatron.bridge.data.builders.hf_dataset.HFDatasetConfig")),
         r"^unknown dataset._target_ 'megatron.bridge.data.builders.hf_dataset.HFDatasetConfig': its class "
         r"HFDatasetConfig is none of GPTDatasetConfig, GPTSFTDatasetConfig, DirectHFSFTDatasetConfig, "
         r"EnergonDatasetConfig, MockVLMSFTDatasetConfig, DatasetProvider \(or FinetuningDatasetConfig, "
         r"MockGPTDatasetConfig, GPTFIMDatasetConfig\); "
         r"for a custom provider set dataset.type: DatasetProvider$"),
        (merge(SFT, data(_target_="megatron.bridge.data.builders.gpt_sft.GPTSFTDataset")),
         r"its class GPTSFTDataset is none of .*; did you mean GPTSFTDatasetConfig\?"),
        (merge(SFT, data(type=DELETE, _target_=None)),
         r"^dataset._target_ must be a dotted class path \(e.g. megatron.bridge.data.builders.gpt_sft."
         r"GPTSFTDatasetConfig\), got null$"),
        (merge(SFT, data(type=DELETE, _target_="megatron.bridge.")),
         r"dataset._target_ must be a dotted class"),
        # _target_ on the other sections: the expected class or an error.
        (merge(SFT, train(_target_="megatron.bridge.training.config.SchedulerConfig")),
         r"^train._target_ 'megatron.bridge.training.config.SchedulerConfig' names SchedulerConfig, "
         r"but train holds Megatron-Bridge's TrainingConfig; "
         r"move the keys to their section or remove train._target_$"),
        (merge(SFT, model(_target_="megatron.bridge.data.base.DatasetProvider")),
         r"model._target_ .* names DatasetProvider, but model holds a model provider \(a class named "
         r"\*Provider or \*ModelConfig, e.g. GPTModelProvider\)"),
        (merge(OFFLINE, specs(_target_="megatron.bridge.training.config.TrainingConfig")),
         r"^dataset.offline_packing_specs._target_ .* but dataset.offline_packing_specs holds "
         r"Megatron-Bridge's PackedSequenceSpecs"),
        ({**SFT, "_target_": "megatron.bridge.training.config.TrainingConfig"},
         r"^_target_ 'megatron.bridge.training.config.TrainingConfig' names TrainingConfig, "
         r"but the top level holds Megatron-Bridge's ConfigContainer; .* or remove _target_$"),
        (merge(SFT, ddp(_target_=3)), r"^ddp._target_ must be a dotted class path .*got int 3$"),
    ],
)  # fmt: skip
def test_dataset_type_and_target_errors(config, message):
    with pytest.raises(TightpackError, match=message):
        load_config(config)


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"seq_length": 2048},
         "error: dataset has no type and its fields (seq_length) fit 6 dataset types: "),
        ({"type": "GPTSFTDatasetConfig", "_target_": "x.EnergonDatasetConfig", "seq_length": 4096},
         "error: dataset.type 'GPTSFTDatasetConfig' and dataset._target_ 'x.EnergonDatasetConfig' name "),
        ({"_target_": "x.HFDatasetConfig", "seq_length": 4096},
         "error: unknown dataset._target_ 'x.HFDatasetConfig'"),
    ],
)  # fmt: skip
def test_cli_dataset_type_errors_exit_2(tmp_path, dataset, message):
    path = write_yaml(tmp_path / "override.yaml", {**SFT, "dataset": dataset})
    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


# -- keys tightpack does not read: Megatron-Bridge's other sections and fields ------------------

# A training configuration as Megatron-Bridge 067f987 serializes it (ConfigContainer.to_yaml: sorted keys, a
# _target_ on every dataclass, enums, dtypes and functions as _target_ mappings), trimmed to a few fields per
# section but with the model's full variety. Offline packed SFT with TP=2, CP=2, SP:
# k = lcm(2*CP, CP*TP) = 4, DP = 16 / (TP*CP) = 4, 32 / (1*4) = 8 micro-batches per step;
# pad_seq_to_mult 1 breaks T2 (an error with CP).
MB_SERIALIZED = """\
_target_: megatron.bridge.training.config.ConfigContainer
checkpoint:
  _target_: megatron.bridge.training.config.CheckpointConfig
  async_save: false
  ckpt_format: torch_dist
  load: null
  pretrained_checkpoint: /ckpt/gemma3-1b
  save: /results/checkpoints
  save_interval: 200
comm_overlap: null
dataset:
  _target_: megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig
  data_sharding: true
  dataloader_type: batch
  dataset_kwargs:
    pad_to_max_length: true
  dataset_root: /data/squad
  do_test: true
  do_validation: true
  enable_offline_packing: true
  hf_output_root: null
  memmap_workers: 1
  num_workers: 8
  offline_packing_specs:
    _target_: megatron.bridge.data.packing.config.PackedSequenceSpecs
    packed_sequence_size: 4096
    pad_cu_seqlens: false
    pad_seq_to_mult: 1
    tokenizer_model_name: google/gemma-3-1b-pt
  seed: 1234
  seq_length: 4096
ddp:
  _target_: megatron.bridge.training.config.DistributedDataParallelConfig
  average_in_collective: false
  bucket_size: null
  check_for_nan_in_grad: true
  data_parallel_sharding_strategy: no_shard
  grad_reduce_in_fp32: true
  overlap_grad_reduce: true
  overlap_param_gather: true
  use_distributed_optimizer: true
  use_megatron_fsdp: false
dist:
  _target_: megatron.bridge.training.config.DistributedInitConfig
  distributed_backend: nccl
  distributed_timeout_minutes: 10
  eval_context_parallel_size: null
  external_gpu_device_mapping: false
  use_megatron_fsdp: false
  use_torch_fsdp2: false
  world_size: 16  # tightpack's: Megatron-Bridge takes the world size from the launcher
env_vars: {}
ft: null
inprocess_restart: null
logger:
  _target_: megatron.bridge.training.config.LoggerConfig
  log_interval: 10
  tensorboard_dir: /results/tb
  wandb_project: null
mixed_precision:
  _target_: megatron.bridge.training.mixed_precision.MixedPrecisionConfig
  bf16: true
  params_dtype:
    _call_: false
    _target_: torch.bfloat16
model:
  _target_: megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider
  activation_func:
    _call_: false
    _target_: megatron.bridge.models.gemma.gemma_provider.fast_gelu
  add_bias_linear: false
  attention_backend:
    _args_:
    - 5
    _call_: true
    _name_: auto
    _target_: megatron.core.transformer.enums.AttnBackend
  attention_dropout: 0.0
  bf16: true
  calculate_per_token_loss: true
  context_parallel_size: 2
  cuda_graph_impl: none
  cuda_graph_modules: []
  cuda_graph_scope: null
  cuda_graph_warmup_steps: 3
  delay_wgrad_compute: false
  expert_model_parallel_size: 1
  expert_tensor_parallel_size: null
  ffn_hidden_size: 6912
  gated_linear_unit: true
  hidden_dropout: 0.0
  hidden_size: 1152
  interleaved_attn_pattern:
  - 5
  - 1
  is_vision_language: false
  kv_channels: 256
  make_vocab_size_divisible_by: 128
  mtp_num_layers: null
  normalization: RMSNorm
  num_attention_heads: 4
  num_layers: 26
  num_moe_experts: null
  num_query_groups: 1
  overlap_moe_expert_parallel_comm: false
  params_dtype:
    _call_: false
    _target_: torch.bfloat16
  pipeline_model_parallel_layout: null
  pipeline_model_parallel_size: 1
  position_embedding_type: rope
  rotary_base: 1000000
  seq_length: 4096
  sequence_parallel: true
  share_embeddings_and_output_weights: true
  tensor_model_parallel_size: 2
  virtual_pipeline_model_parallel_size: null
  vocab_size: 262144
  window_size:
  - 512
  - 0
nvrx_straggler: null
optimizer:
  _target_: megatron.bridge.training.config.OptimizerConfig
  adam_beta1: 0.9
  adam_beta2: 0.98
  bf16: true
  clip_grad: 1.0
  lr: 5.0e-06
  optimizer: adam
  use_distributed_optimizer: true
  weight_decay: 0.01
optimizer_config_override_provider:
  _target_: megatron.bridge.training.config.OptimizerConfigOverrideProvider
peft: null
profiling:
  _target_: megatron.bridge.training.config.ProfilingConfig
  profile_ranks:
  - 0
  use_nsys_profiler: false
rerun_state_machine:
  _target_: megatron.bridge.training.config.RerunStateMachineConfig
  rerun_mode: disabled
rng:
  _target_: megatron.training.config.common_config.RNGConfig
  seed: 1234
  te_rng_tracker: false
scheduler:
  _target_: megatron.bridge.training.config.SchedulerConfig
  lr_decay_style: cosine
  lr_warmup_iters: 50
  min_lr: 5.0e-07
straggler: null
tensor_inspect: null
tokenizer:
  _target_: megatron.bridge.training.tokenizers.config.TokenizerConfig
  tokenizer_model: google/gemma-3-1b-pt
  tokenizer_type: HuggingFaceTokenizer
train:
  _target_: megatron.bridge.training.config.TrainingConfig
  eval_interval: null
  eval_iters: null
  exit_signal:
    _args_:
    - 15
    _call_: true
    _name_: SIGTERM
    _target_: signal.Signals
  global_batch_size: 32
  manual_gc: true
  manual_gc_interval: 100
  micro_batch_size: 1
  num_epochs: null
  rampup_batch_size: null
  train_iters: 1000
  train_samples: null
validation:
  _target_: megatron.training.config.training_config.ValidationConfig
  eval_global_batch_size: null
  eval_interval: 100
  eval_iters: 32
  eval_micro_batch_size: null
  full_validation: false
  skip_train: false
"""
# The Megatron-Bridge sections tightpack does not model, in file order; and the model keys it reads.
MB_OTHER_SECTIONS = [
    "checkpoint", "env_vars", "ft", "inprocess_restart", "logger", "mixed_precision", "nvrx_straggler",
    "optimizer", "optimizer_config_override_provider", "peft", "profiling", "rerun_state_machine", "rng",
    "scheduler", "straggler", "tensor_inspect", "tokenizer",
]  # fmt: skip
MODEL_KEYS_READ = {
    "_target_", "calculate_per_token_loss", "context_parallel_size", "cuda_graph_impl", "cuda_graph_scope",
    "delay_wgrad_compute", "expert_model_parallel_size", "mtp_num_layers", "num_moe_experts",
    "overlap_moe_expert_parallel_comm", "pipeline_model_parallel_size", "seq_length", "sequence_parallel",
    "tensor_model_parallel_size",
}  # fmt: skip


def test_megatron_bridge_serialized_config_gets_the_packing_report(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text(MB_SERIALIZED, encoding="utf-8")
    report = validate(load_config(path))
    assert rule_ids(report) == ["T2"], report.format()
    assert report.errors[0].reason.startswith(
        "offline_packing_specs.pad_seq_to_mult (1) is not a multiple of 4"
    )
    assert (report.derived.alignment_multiple, report.derived.micro_batches_per_step) == (4, 8)
    assert report.derived.dataset_type_source == "dataset._target_"

    skipped = report.not_checked
    assert [key for key in skipped if "." not in key] == MB_OTHER_SECTIONS
    model_keys = [key.removeprefix("model.") for key in skipped if key.startswith("model.")]
    # Every model key but the 14 read (42 in all), the fields of Gemma3ModelProvider alone
    # (interleaved_attn_pattern, is_vision_language) included: the _target_ names a provider.
    assert model_keys == [key for key in yaml.safe_load(MB_SERIALIZED)["model"] if key not in MODEL_KEYS_READ]
    assert len(model_keys) == 28
    assert "interleaved_attn_pattern" in model_keys and "cuda_graph_modules" in model_keys
    others = [key for key in skipped if key not in MB_OTHER_SECTIONS and not key.startswith("model.")]
    assert others == [  # in file order
        "dataset.hf_output_root",
        "ddp.bucket_size", "ddp.data_parallel_sharding_strategy", "ddp.use_megatron_fsdp",
        "dist.distributed_backend", "dist.distributed_timeout_minutes", "dist.external_gpu_device_mapping",
        "dist.use_megatron_fsdp", "dist.use_torch_fsdp2",
        "train.eval_interval", "train.eval_iters", "train.exit_signal", "train.manual_gc",
        "train.manual_gc_interval", "train.rampup_batch_size", "train.train_samples",
        "validation.full_validation", "validation.skip_train",
    ]  # fmt: skip
    assert len(skipped) == 17 + 28 + 18

    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        r"^  T2 +offline_packing_specs.pad_seq_to_mult \(1\) is not a multiple of 4", result.stdout, re.M
    )
    notes = [line for line in result.stdout.splitlines() if "not checked" in line]
    assert notes == [
        "not checked by tightpack: " + ", ".join(MB_OTHER_SECTIONS) + ", dataset.hf_output_root, "
        "ddp.bucket_size, ddp.data_parallel_sharding_strategy, ddp.use_megatron_fsdp, 5 keys of dist, "
        "28 keys of model, 7 keys of train, validation.full_validation, validation.skip_train (63 keys)"
    ]
    assert result.stdout.splitlines()[-1] == "result: invalid (1 error, 0 warnings)"
    assert result.stderr == ""

    as_json = run_cli("validate", path, "--json", cwd=tmp_path)
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["not_checked"] == list(skipped)

    clean = write_yaml(
        tmp_path / "clean.yaml",
        yaml.safe_load(MB_SERIALIZED.replace("pad_seq_to_mult: 1", "pad_seq_to_mult: 4")),
    )
    result = run_cli("validate", clean, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum("not checked by tightpack: checkpoint, " in line for line in result.stdout.splitlines()) == 1
    assert result.stdout.splitlines()[-1] == "result: ok (0 errors, 0 warnings)"


def test_recipe_override_with_megatron_bridge_keys_validates(tmp_path):
    """A recipe override has no _target_: Megatron-Bridge's fields are accepted, even near a checked one."""
    override = merge(
        yaml.safe_load(README_EXAMPLE),
        {
            "model": {"hidden_size": 4096, "num_layers": 32, "expert_tensor_parallel_size": 1,
                      "virtual_pipeline_model_parallel_size": None, "vision_cuda_graph_scope": [],
                      "tp_size": 2},  # not Megatron-Bridge's, and not near a checked field: not checked
            "train": {"eval_iters": 10, "exit_interval": 900},
            "dist": {"use_megatron_fsdp": False},
            "optimizer": {"lr": 1.0e-5, "weight_decay": 0.01},
            "scheduler": {"lr_warmup_iters": 50},
            "logger": {"log_interval": 10},
            "checkpoint": {"save": "/results/ckpt", "save_interval": 200},
        },
    )  # fmt: skip
    path = write_yaml(tmp_path / "override.yaml", override)
    report = validate(load_config(path))
    assert report.ok and report.findings == (), report.format()
    assert report.not_checked == (  # in file order: README_EXAMPLE's sections, then the new ones
        "model.hidden_size", "model.num_layers", "model.expert_tensor_parallel_size",
        "model.virtual_pipeline_model_parallel_size", "model.vision_cuda_graph_scope", "model.tp_size",
        "train.eval_iters", "train.exit_interval", "dist.use_megatron_fsdp",
        "optimizer", "scheduler", "logger", "checkpoint",
    )  # fmt: skip
    result = run_cli("validate", path, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-2:] == [
        "not checked by tightpack: optimizer, scheduler, logger, checkpoint, 6 keys of model, "
        "train.eval_iters, train.exit_interval, dist.use_megatron_fsdp (13 keys)",
        "result: ok (0 errors, 0 warnings)",
    ]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # A typo of a checked field, in every modelled section: an error naming the closest field.
        (merge(SFT, {"model": {"seq_length": DELETE, "seq_lenght": 4096, "hidden_size": 4096}}),
         r"^unknown key 'seq_lenght' in model \(model.seq_lenght\); did you mean model.seq_length\?$"),
        (merge(SFT, model(tensor_parallel_size=2)),  # not Megatron-Bridge's spelling either
         r"^unknown key 'tensor_parallel_size' in model .*did you mean model.tensor_model_parallel_size\?$"),
        (merge(SFT, model(context_paralel_size=2)), r"did you mean model.context_parallel_size\?$"),
        (merge(SFT, ddp(average_in_colective=False)), r"did you mean ddp.average_in_collective\?$"),
        (merge(SFT, dist(eval_context_paralel_size=2)), r"did you mean dist.eval_context_parallel_size\?$"),
        (merge(SFT, evals(eval_micro_batch_sise=1)), r"did you mean validation.eval_micro_batch_size\?$"),
        (merge(SFT, data(seq_lenght=4096)),
         r"^unknown key 'seq_lenght' in dataset \(GPTSFTDatasetConfig\) \(dataset.seq_lenght\); "
         r"did you mean dataset.seq_length\?$"),
        (merge(SFT, data(enable_offline_packng=True)), r"did you mean dataset.enable_offline_packing\?$"),
        (merge(OFFLINE, specs(packed_sequence_sise=4096)),
         r"did you mean dataset.offline_packing_specs.packed_sequence_size\?$"),
        (merge(SFT, {"comm_overlap": {"overlap_moe_expert_parallel_com": True}}),
         r"did you mean comm_overlap.overlap_moe_expert_parallel_comm\?$"),
        (merge(PROVIDER, data(enable_in_batch_packng=True)),
         r"in dataset \(DatasetProvider\) .*did you mean dataset.enable_in_batch_packing\?$"),
        # Top level: a closed list of sections, so a stray name is an error.
        (merge(SFT, {"optimiser": {"lr": 1e-5}}),
         r"^unknown key 'optimiser' in the top level \(optimiser\); did you mean optimizer\?$"),
        (merge(SFT, {"bogus_section": {}}),
         r"valid keys: train, .*, dist_train, and Megatron-Bridge's other sections, which tightpack does not "
         r"check: checkpoint, env_vars, "),
    ],
)  # fmt: skip
def test_typos_of_checked_fields_are_still_errors(config, message):
    with pytest.raises(TightpackError, match=message):
        load_config(config)


@pytest.mark.parametrize(
    ("config", "paths"),
    [
        # Far from every checked field: a newer Megatron-Core field, or one Megatron-Bridge will reject.
        (merge(SFT, model(tp_size=2)), ("model.tp_size",)),
        (merge(SFT, ddp(megatron_fsdp_new_option=True)), ("ddp.megatron_fsdp_new_option",)),
        # Megatron-Bridge's own fields, though near a checked one or a field tightpack reads elsewhere.
        (merge(SFT, model(expert_tensor_parallel_size=2)), ("model.expert_tensor_parallel_size",)),
        (merge(GPT, data(context_parallel_size=1)), ("dataset.context_parallel_size",)),
        # A custom provider's own fields, named like fields of train or the Energon kind.
        (merge(PROVIDER, data(global_batch_size=32, path="/data/wds", packing_buffer_size=8)),
         ("dataset.global_batch_size", "dataset.path", "dataset.packing_buffer_size")),
        # A model with a provider _target_ (a serialized file) accepts any key, as its class defines them.
        (merge(SFT, model(_target_="megatron.bridge.models.gpt_provider.GPTModelProvider", seq_lenght=4096)),
         ("model.seq_lenght",)),
        # An untyped dataset: keys no kind has and far from the checked ones do not decide the kind.
        (merge(SFT, data(type=DELETE, cache_tag="v2")), ("dataset.cache_tag",)),
    ],
)  # fmt: skip
def test_keys_accepted_without_checking(config, paths):
    loaded = load_config(config)
    assert loaded.not_checked == paths
    assert validate(loaded).not_checked == paths


def test_config_built_in_python_has_nothing_unchecked():
    config = load_config(SFT)
    assert config.not_checked == ()
    assert "not checked" not in validate(config).format()
    assert validate(config).to_dict()["not_checked"] == []


def test_the_readme_example_is_the_one_tested_here():
    """The YAML the README shows under `tightpack validate` is README_EXAMPLE, so the two cannot drift."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("validates clean:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load(README_EXAMPLE)
