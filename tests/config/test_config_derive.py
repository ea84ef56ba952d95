"""`tightpack.config.derive`: the values the reference derives (R11, R12, R14, the batch arithmetic)."""

from __future__ import annotations

import pytest

from .helpers import (
    CP2,
    DIRECT_HF,
    ENERGON,
    ENERGON_COLLATE,
    GPT,
    IN_BATCH,
    MBS4,
    MOCK_VLM,
    NO_FIXED_WIDTH,
    OFFLINE,
    SFT,
    SP_CP2_TP4,
    check,
    data,
    derived,
    dist,
    evals,
    merge,
    model,
)


@pytest.mark.parametrize(
    ("config", "in_batch", "non_packed"),
    [
        # docs/contract.md §2.4 and §5 (R14): CP2/TP4/SP -> lcm(4, 8) = 8; the non-packed multiple is
        # lcm(user 3, 8) = 24.
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
