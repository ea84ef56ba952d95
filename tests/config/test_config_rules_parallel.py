"""The rules of `tightpack.config.rules.parallel`: context and sequence parallelism, and the loss.

Each case is a configuration that triggers its rule and the nearest one that does not.
"""

from __future__ import annotations

import pytest

from tightpack.config.rules import parallel

from .helpers import (
    AS_GPT,
    CP2,
    CP3_P4098,
    DIRECT_HF,
    ENERGON_COLLATE,
    MOCK_VLM,
    NO_FIXED_WIDTH,
    OFFLINE,
    OFFLINE_CP2,
    SFT,
    assert_rule_case,
    case,
    ddp,
    dist,
    kwargs,
    merge,
    model,
    seq,
    specs,
)

CASES = [
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
    case("X2", "error", SFT, model(ddp(average_in_collective=True), calculate_per_token_loss=True),
         model(calculate_per_token_loss=True), r"Cannot average in collective when calculating per-token"),
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
]  # fmt: skip


@pytest.mark.parametrize(("rule", "severity", "bad", "good", "match"), CASES)
def test_rule(rule, severity, bad, good, match):
    assert_rule_case(rule, severity, bad, good, match)


def test_every_rule_of_the_module_has_a_case():
    assert {param.values[0] for param in CASES} == {rule.id for rule in parallel.rules}
