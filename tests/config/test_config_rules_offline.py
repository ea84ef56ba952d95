"""The rules of `tightpack.config.rules.offline`: offline packing.

Each case is a configuration that triggers its rule and the nearest one that does not.
"""

from __future__ import annotations

import pytest

from tightpack.config.rules import offline

from .helpers import (
    AS_GPT,
    DELETE,
    MBS4,
    NO_FIXED_WIDTH,
    OFFLINE,
    OFFLINE_4096,
    OFFLINE_CP2,
    PAD_CU,
    PROVIDER,
    SFT,
    assert_rule_case,
    case,
    check,
    data,
    evals,
    kwargs,
    merge,
    model,
    specs,
    te_graph,
    train,
)

BLEND = [["packed/a", "packed/b"], [0.5, 0.5]]
CASES = [
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
    case("R19", "error", OFFLINE, specs(packed_sequence_size=-1), specs(packed_sequence_size=4096),
         r"packed_sequence_size must be greater than 0 \(got -1\)"),
    case("R20", "error", OFFLINE, MBS4, train(micro_batch_size=1),
         r"Micro batch size should be 1 when training with packed sequence, but your micro batch size is 4"),
    case("R20", "error", PROVIDER, merge(MBS4, OFFLINE_4096), MBS4, r"micro batch size is 4",
         name="R20-provider-vs-no-packing"),
    case("R20", "error", OFFLINE, MBS4, merge(MBS4, AS_GPT), r"micro batch size is 4",
         name="R20-gpt-dataset-exempt"),
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
    *[
        case("X7", "error", OFFLINE, specs(packed_train_data_blend=bad), specs(packed_train_data_blend=BLEND),
             match, name=f"X7-{name}")
        for name, bad, match in [
            ("pair", [["p/a", "p/b"]], r"must be a \(sources, weights\) pair; it has 1 lists"),
            ("order", [[0.5, 0.5], ["p/a", "p/b"]], r"holds sources then weights"),
            ("quoted", [["p/a", "p/b"], ["0.5", 0.5]], r"weights must be numbers, not strings: \['0.5'\]"),
            ("one-source", [["p/a"], [1.0]], r"at least two sources \(got 1\)"),
            ("lengths", [["p/a", "p/b"], [0.5]], r"same length \(2 sources, 1 weights\)"),
            ("weight", [["p/a", "p/b"], [0.5, 0]], r"weight 1 must be finite and greater than 0, got 0"),
        ]
    ],
    case("X7", "error", OFFLINE, specs(packed_train_data_blend=BLEND, packed_train_data_path="p/a"),
         specs(packed_train_data_blend=BLEND), r"either packed_train_data_path or packed_train_data_blend",
         name="X7-path-and-blend"),
    case("X7", "error", merge(OFFLINE, data(dataset_root=DELETE)), specs(packed_train_data_blend=BLEND),
         merge(specs(packed_train_data_blend=BLEND), data(do_validation=False, do_test=False)),
         r"standalone packed_train_data_blend requires do_validation=False", name="X7-standalone"),
    case("T7", "warning", OFFLINE, specs(packed_sequence_size=2048), {},
         r"packed_sequence_size \(2048\) differs from dataset.seq_length \(4096\)"),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "severity", "bad", "good", "match"), CASES)
def test_rule(rule, severity, bad, good, match):
    assert_rule_case(rule, severity, bad, good, match)


def test_every_rule_of_the_module_has_a_case():
    assert {param.values[0] for param in CASES} == {rule.id for rule in offline.rules}


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
