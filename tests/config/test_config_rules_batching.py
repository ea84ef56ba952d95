"""The rules of `tightpack.config.rules.batching`: run length, loader, batch arithmetic, sequence length.

Each case is a configuration that triggers its rule and the nearest one that does not.
"""

from __future__ import annotations

import pytest

from tightpack.config.rules import batching

from .helpers import (
    DIRECT_HF,
    GPT,
    OFFLINE_CP2,
    SFT,
    assert_rule_case,
    case,
    check,
    data,
    dist,
    evals,
    merge,
    model,
    seq,
    train,
)

CASES = [
    case("R1", "error", DIRECT_HF, train(data(dataloader_type="batch"), num_epochs=1),
         data(dataloader_type="batch"),
         r"only supported for finite GPTSFTDatasetConfig"),
    case("R1", "error", DIRECT_HF, train(num_epochs=1), {}, r"DirectHFSFTDatasetConfig", name="R1-cyclic"),
    case("R2", "error", SFT, train(data(dataloader_type="single"), num_epochs=2), train(num_epochs=2),
         r'only with dataloader_type="batch"'),
    case("R16", "error", SFT, evals(eval_global_batch_size=12), evals(eval_global_batch_size=16),
         r"eval_global_batch_size \(12\) is not divisible by eval micro batch size \(1\) times eval data "
         r"parallel size \(8\)"),
    case("R16", "error", SFT, dist(evals(eval_global_batch_size=6), eval_context_parallel_size=2),
         dist(evals(eval_global_batch_size=8), eval_context_parallel_size=2),
         r"eval data parallel size \(4\)", name="R16-eval-cp"),
    case("R16", "error", SFT, dist(seq(4104), eval_context_parallel_size=3),
         dist(eval_context_parallel_size=4),
         r"not divisible by TP\*PP\*eval CP \(3\)", name="R16-eval-dp-not-integral"),
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
]  # fmt: skip


@pytest.mark.parametrize(("rule", "severity", "bad", "good", "match"), CASES)
def test_rule(rule, severity, bad, good, match):
    assert_rule_case(rule, severity, bad, good, match)


def test_every_rule_of_the_module_has_a_case():
    assert {param.values[0] for param in CASES} == {rule.id for rule in batching.rules}


def test_fixes_give_the_nearest_valid_numbers():
    report = check(merge(OFFLINE_CP2, {"dataset": {"offline_packing_specs": {"packed_sequence_size": 4094}}}))
    (t1,) = [finding for finding in report.findings if finding.rule == "T1"]
    assert "a multiple of 4: 4092 or 4096" in t1.fix
    (x1,) = check(merge(SFT, {"train": {"global_batch_size": 12}})).errors
    assert x1.fix == "Set train.global_batch_size to a multiple of 8: 8 or 16."
