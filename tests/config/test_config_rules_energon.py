"""The rules of `tightpack.config.rules.energon`: Energon datasets and native Energon packing.

Each case is a configuration that triggers its rule and the nearest one that does not.
"""

from __future__ import annotations

import pytest

from tightpack.config.rules import energon

from .helpers import (
    DELETE,
    ENERGON,
    ENERGON_COLLATE,
    assert_rule_case,
    case,
    check,
    data,
    ddp,
    dist,
    evals,
    kwargs,
    merge,
    model,
    rule_ids,
    train,
)

CASES = [
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
    case("R15", "error", ENERGON_COLLATE, evals(eval_micro_batch_size=2),
         evals(data(do_validation=False), eval_micro_batch_size=2),
         r"must match validation.eval_micro_batch_size \(4 != 2\)"),
    case("T6", "warning", ENERGON_COLLATE, model(expert_model_parallel_size=2),
         model(data(defer_in_batch_packing_to_step=True), expert_model_parallel_size=2),
         r"fixed width \(forced by PP>1 or EP>1, R12\) puts 4 rows into one row of seq_length=4096"),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "severity", "bad", "good", "match"), CASES)
def test_rule(rule, severity, bad, good, match):
    assert_rule_case(rule, severity, bad, good, match)


def test_every_rule_of_the_module_has_a_case():
    assert {param.values[0] for param in CASES} == {rule.id for rule in energon.rules}


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
