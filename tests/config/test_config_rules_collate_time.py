"""The rules of `tightpack.config.rules.collate_time`: collate-time (in-batch) packing.

Each case is a configuration that triggers its rule and the nearest one that does not.
"""

from __future__ import annotations

import pytest

from tightpack.config.rules import collate_time

from .helpers import DIRECT_HF, IN_BATCH, SP_CP2_TP4, assert_rule_case, case, data, seq, train

CASES = [
    case("R8.1", "error", DIRECT_HF, data(pad_to_multiple_of=-3), data(pad_to_multiple_of=1),
         r"pad_to_multiple_of must be greater than 0 \(dataset.pad_to_multiple_of=-3\)"),
    case("R8.1", "error", IN_BATCH, data(in_batch_packing_pad_to_multiple_of=0),
         data(in_batch_packing_pad_to_multiple_of=1),
         r"in_batch_packing_pad_to_multiple_of must be greater than 0",
         name="R8.1-in-batch"),
    case("R13", "error", DIRECT_HF, seq(20, SP_CP2_TP4), seq(24, SP_CP2_TP4),
         r"DirectHFSFTDatasetConfig.seq_length must be divisible by the CP/SP collate padding "
         r"multiple \(8\)"),
    case("R21", "error", IN_BATCH, train(micro_batch_size=1), {},
         r"^micro_batch_size should be greater than 1 when using enable_in_batch_packing=True\. In-batch "
         r"packing concatenates multiple sequences within a microbatch, so at least 2 sequences are required "
         r"per micro-batch\.$"),
    case("T5", "error", IN_BATCH, train(data(dataloader_type="batch"), global_batch_size=64),
         train(global_batch_size=64), r'dataloader_type="batch" .*cannot be split into 2 micro-batches'),
    case("T5", "error", IN_BATCH, train(data(dataloader_type="batch"), global_batch_size=64),
         data(dataloader_type="batch"), r"2 micro-batches", name="T5-one-micro-batch-is-fine"),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "severity", "bad", "good", "match"), CASES)
def test_rule(rule, severity, bad, good, match):
    assert_rule_case(rule, severity, bad, good, match)


def test_every_rule_of_the_module_has_a_case():
    assert {param.values[0] for param in CASES} == {rule.id for rule in collate_time.rules}
