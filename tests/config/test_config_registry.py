"""The rule registry: its declared order, a triggering and a clean case per rule, docs/validation-rules.md."""

from __future__ import annotations

import pytest

from tightpack.config import RULES
from tightpack.config.rules import ORDER, REGISTRY
from tightpack.config.rules.base import RuleGroup
from tightpack.config.rules.registry import ordered
from tightpack.config.rules_table import COMMAND, main, render, rules_table

from .helpers import (
    BASES,
    CP2,
    DIRECT_HF,
    ENERGON,
    ENERGON_COLLATE,
    IN_BATCH,
    MBS4,
    NO_FIXED_WIDTH,
    OFFLINE,
    OFFLINE_4096,
    OFFLINE_CP2,
    PAD_CU,
    PROVIDER,
    REPO_ROOT,
    SFT,
    SP_CP2_TP4,
    check,
    data,
    ddp,
    dist,
    evals,
    kwargs,
    merge,
    model,
    rule_ids,
    seq,
    specs,
    te_graph,
    train,
)


@pytest.mark.parametrize("name", BASES)
def test_bases_are_clean(name):
    report = check(BASES[name])
    assert report.ok and report.findings == (), report.format()


def test_rules_run_in_contract_order():
    assert [rule_id for rule_id, _ in RULES] == [
        "R1", "R2", "R3", "R4", "R5", "R6", "R7",
        *(f"R8.{i}" for i in range(1, 10)), "R9", *(f"R10.{i}" for i in range(1, 8)),
        "R11", "R13", "R15", "R16", "R17", "R18", "R19", "R20", "R21", "R22",
        "X1", "X2", "X3", "X4", "X5", "X6", "X7", "T1", "T2", "T3", "T4", "T5", "T6", "T7",
    ]  # fmt: skip


def test_registry_order_is_the_declared_order():
    assert tuple(rule.id for rule in REGISTRY) == ORDER
    assert tuple(rule_id for rule_id, _ in RULES) == ORDER
    assert [check for _, check in RULES] == [rule.check for rule in REGISTRY]


# One pair per rule id: (a configuration that triggers the rule, one for which it reports nothing), each a
# minimal patch of a clean base. A rule added to the registry without a pair fails below.
MINIMAL_CASES: dict[str, tuple[dict, dict]] = {
    "R1": (merge(DIRECT_HF, train(num_epochs=1)), DIRECT_HF),
    "R2": (merge(SFT, train(data(dataloader_type="single"), num_epochs=2)), merge(SFT, train(num_epochs=2))),
    "R3": (merge(PROVIDER, MBS4, OFFLINE_4096, data(enable_in_batch_packing=True)),
           merge(PROVIDER, OFFLINE_4096)),
    "R4": (merge(SFT, data(enable_offline_packing=True)), OFFLINE),
    "R5": (merge(OFFLINE, PAD_CU, NO_FIXED_WIDTH), merge(OFFLINE, PAD_CU)),
    "R6": (merge(OFFLINE, te_graph(["mlp"], NO_FIXED_WIDTH)), merge(OFFLINE, te_graph(["mlp"]))),
    "R7": (merge(OFFLINE, te_graph([])), merge(OFFLINE, te_graph(["mlp"]))),
    "R8.1": (merge(DIRECT_HF, data(pad_to_multiple_of=0)), DIRECT_HF),
    "R8.2": (merge(ENERGON, data(path=" ")), ENERGON),
    "R8.3": (merge(ENERGON, data(do_test=True)), ENERGON),
    "R8.4": (merge(ENERGON, kwargs(batch_size=2)), merge(ENERGON, kwargs(subflavors={"source": "coco"}))),
    "R8.5": (merge(ENERGON, data(packing_buffer_size=0)), merge(ENERGON, data(packing_buffer_size=1))),
    "R8.6": (merge(ENERGON, data(enable_in_batch_packing=True)), ENERGON),
    "R8.7": (merge(ENERGON, data(defer_in_batch_packing_to_step=True)), ENERGON),
    "R8.8": (merge(ENERGON, data(micro_batch_size=2)), ENERGON),
    "R8.9": (merge(ENERGON, data(task_encoder="GenericHFTaskEncoderConfig")), ENERGON),
    "R9": (merge(ENERGON_COLLATE, data(micro_batch_size=2)), ENERGON_COLLATE),
    "R10.1": (merge(ENERGON, train(micro_batch_size=2, global_batch_size=16)), ENERGON),
    "R10.2": (merge(ENERGON, model(calculate_per_token_loss=False)), ENERGON),
    "R10.3": (merge(ENERGON, ddp(average_in_collective=True)), ENERGON),
    "R10.4": (merge(ENERGON, model(mtp_num_layers=1)), merge(ENERGON, model(mtp_num_layers=0))),
    "R10.5": (merge(ENERGON, model(cuda_graph_impl="local")), ENERGON),
    "R10.6": (merge(ENERGON, {"dist_train": {"use_dist_train": True}}), ENERGON),
    "R10.7": (merge(ENERGON, model(pipeline_model_parallel_size=2)), ENERGON),
    "R11": (merge(ENERGON, model(delay_wgrad_compute=True)), ENERGON),
    "R13": (merge(DIRECT_HF, seq(20, SP_CP2_TP4)), merge(DIRECT_HF, seq(24, SP_CP2_TP4))),
    "R15": (merge(ENERGON_COLLATE, evals(eval_micro_batch_size=2)), ENERGON_COLLATE),
    "R16": (merge(SFT, evals(eval_global_batch_size=12)), merge(SFT, evals(eval_global_batch_size=16))),
    "R17": (merge(SFT, seq(510, CP2)), merge(SFT, seq(512, CP2))),
    "R18": (merge(SFT, model(context_parallel_size=2)), merge(SFT, CP2)),
    "R19": (merge(OFFLINE, specs(packed_sequence_size=-1)), OFFLINE),
    "R20": (merge(OFFLINE, MBS4), OFFLINE),
    "R21": (merge(IN_BATCH, train(micro_batch_size=1)), IN_BATCH),
    "R22": (merge(SFT, data(seq_length=2048)), SFT),
    "X1": (merge(SFT, train(global_batch_size=12)), merge(SFT, train(global_batch_size=16))),
    "X2": (merge(SFT, model(ddp(average_in_collective=True), calculate_per_token_loss=True)),
           merge(SFT, model(calculate_per_token_loss=True))),
    "X3": (merge(OFFLINE, evals(eval_micro_batch_size=2)), merge(OFFLINE, evals(eval_micro_batch_size=1))),
    "X4": (merge(OFFLINE, specs(pad_seq_to_mult=0)), merge(OFFLINE, specs(pad_seq_to_mult=None))),
    "X5": (merge(OFFLINE, kwargs(max_num_samples=100)), merge(OFFLINE, data(max_train_samples=100))),
    "X6": (merge(OFFLINE, te_graph(["moe_router"], PAD_CU, num_moe_experts=8)),
           merge(OFFLINE, te_graph(["attn"], PAD_CU, num_moe_experts=8))),
    "X7": (merge(OFFLINE, specs(packed_train_data_blend=[["packed/a", "packed/b"], [0.5]])),
           merge(OFFLINE, specs(packed_train_data_blend=[["packed/a", "packed/b"], [0.5, 0.5]]))),
    "T1": (merge(OFFLINE_CP2, specs(packed_sequence_size=4094)), OFFLINE_CP2),
    "T2": (merge(OFFLINE_CP2, specs(pad_seq_to_mult=2)), OFFLINE_CP2),
    "T3": (merge(SFT, dist(seq(4100), eval_context_parallel_size=4)),
           merge(SFT, dist(seq(4104), eval_context_parallel_size=4))),
    "T4": (merge(SFT, dist(eval_context_parallel_size=2)),
           merge(SFT, dist(model(calculate_per_token_loss=True), eval_context_parallel_size=2))),
    "T5": (merge(IN_BATCH, train(data(dataloader_type="batch"), global_batch_size=64)),
           merge(IN_BATCH, data(dataloader_type="batch"))),
    "T6": (merge(ENERGON_COLLATE, model(expert_model_parallel_size=2)), ENERGON_COLLATE),
    "T7": (merge(OFFLINE, specs(packed_sequence_size=2048)), OFFLINE),
}  # fmt: skip


@pytest.mark.parametrize("rule", REGISTRY, ids=lambda rule: rule.id)
def test_every_rule_has_a_triggering_and_a_clean_case(rule):
    assert rule.id in MINIMAL_CASES, (
        f"rule {rule.id} has no minimal case: add (a triggering configuration, a clean one) to MINIMAL_CASES "
        f"in {__name__}"
    )
    bad, clean = MINIMAL_CASES[rule.id]
    found = [finding for finding in check(bad).findings if finding.rule == rule.id]
    assert found, f"{rule.id} not reported:\n{check(bad).format()}"
    assert {finding.severity for finding in found} <= set(rule.severities), found
    assert rule.id not in rule_ids(check(clean)), check(clean).format()


def test_minimal_cases_name_registered_rules():
    assert set(MINIMAL_CASES) <= set(ORDER), set(MINIMAL_CASES) - set(ORDER)


def _group(*rule_ids: str) -> RuleGroup:
    group = RuleGroup()
    for rule_id in rule_ids:
        group.add(rule_id, "error", section="§5", summary=f"rule {rule_id}")(lambda config, derived: ())
    return group


@pytest.mark.parametrize(
    ("groups", "order", "message"),
    [
        ([_group("A", "B")], ["A"],
         r"^rule registry: rules without an id in ORDER: B \(test_config_registry\); add each id to ORDER in "
         r"tightpack.config.rules.registry, or remove the rule$"),
        ([_group("A")], ["A", "B"], r"^rule registry: ids in ORDER without a rule: B$"),
        ([_group("A"), _group("A")], ["A"],
         r"^rule registry: ids with more than one rule: A \(test_config_registry, test_config_registry\)$"),
        ([_group("A")], ["A", "A"], r"^rule registry: ids listed more than once in ORDER: A$"),
        ([_group("A", "C")], ["A", "B"], r"ids in ORDER without a rule: B; rules without an id in ORDER: C "),
    ],
)  # fmt: skip
def test_registry_needs_exactly_one_rule_per_declared_id(groups, order, message):
    with pytest.raises(ValueError, match=message):
        ordered(groups, order)


def test_ordered_keeps_the_declared_order():
    rules = ordered([_group("B", "A"), _group("C")], ["C", "A", "B"])
    assert [rule.id for rule in rules] == ["C", "A", "B"]


@pytest.mark.parametrize("severities", [(), ("fatal",), ("error", "info")])
def test_rules_have_known_severities(severities):
    message = r"^rule R99: severities must be one or both of \('error', 'warning'\), got "
    with pytest.raises(ValueError, match=message):
        RuleGroup().add("R99", *severities, section="§5", summary="")


def test_docs_rules_table_is_the_registry():
    committed = (REPO_ROOT / "docs" / "validation-rules.md").read_text(encoding="utf-8")
    assert committed == render(), (
        f"docs/validation-rules.md differs from the rule registry: run `{COMMAND}` in the repository root "
        "and commit the file"
    )


def test_the_table_has_one_row_per_rule_in_order():
    rows = rules_table(REGISTRY).splitlines()[2:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(ORDER)


def test_rules_table_command_writes_or_prints(tmp_path, capsys):
    target = tmp_path / "rules.md"
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render()
    assert main([]) == 0
    assert capsys.readouterr().out == render()
