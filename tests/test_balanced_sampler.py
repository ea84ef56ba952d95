from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.balance import straggler_overhead
from tightpack.core.cost_model import CostModel
from tightpack.core.row_costs import row_pack_costs, row_runtime_lengths
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.runtime.balanced_sampler import BalancedPackedBatchSampler, pack_costs
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.samplers import PackedBatchSampler

from .conftest import examples, write_jsonl

MODEL = CostModel(linear=1.0, quadratic=0.01, per_sequence=3.0, unit="seconds")


def all_ranks(costs, gbs, dp, **kwargs):
    return [
        BalancedPackedBatchSampler(
            costs, global_batch_size=gbs, data_parallel_rank=d, data_parallel_size=dp, **kwargs
        )
        for d in range(dp)
    ]


def in_order_ranks(total, gbs, dp, **kwargs):
    return [
        PackedBatchSampler(
            total,
            dataloader_type="batch",
            micro_batch_size=1,
            global_batch_size=gbs,
            data_parallel_rank=d,
            data_parallel_size=dp,
            **kwargs,
        )
        for d in range(dp)
    ]


def steps(samplers, epochs=1):
    """``[step][rank]`` index lists over ``epochs`` iterations of every rank's sampler."""
    out = []
    for _ in range(epochs):
        out.extend(map(list, zip(*(list(sampler) for sampler in samplers), strict=True)))
    return out


@st.composite
def setups(draw):
    dp = draw(st.integers(1, 4))
    gbs = dp * draw(st.integers(1, 4))
    drop_last = draw(st.booleans())
    total = draw(st.integers(gbs if drop_last else 1, 40))
    costs = np.array(draw(st.lists(st.floats(0, 1e4), min_size=total, max_size=total)))
    return costs, gbs, dp, drop_last, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=examples(50), deadline=None)
@given(setups())
def test_without_regrouping_each_global_batch_holds_the_packs_of_packed_batch_sampler(setup):
    costs, gbs, dp, drop_last, seed = setup
    kwargs = {"seed": seed, "drop_last": drop_last}
    balanced = steps(all_ranks(costs, gbs, dp, regroup=False, **kwargs), epochs=3)
    reference = steps(in_order_ranks(len(costs), gbs, dp, **kwargs), epochs=3)
    assert len(balanced) == len(reference) > 0
    for step, expected in zip(balanced, reference, strict=True):
        assert all(len(rank) == gbs // dp for rank in step)
        assert sorted(i for rank in step for i in rank) == sorted(i for rank in expected for i in rank)
        real = [i for rank in step for i in rank if i >= 0]
        assert len(real) == len(set(real))  # each pack once


@settings(max_examples=examples(50), deadline=None)
@given(setups())
def test_regrouping_keeps_the_packs_of_each_epoch_and_the_padded_last_batch(setup):
    """Regrouped, the epoch holds PackedBatchSampler's packs (only which step and rank see them
    changes), every step is GBS / DP packs per rank, and the padded last batch is the same batch."""
    costs, gbs, dp, drop_last, seed = setup
    kwargs = {"seed": seed, "drop_last": drop_last}
    balanced = steps(all_ranks(costs, gbs, dp, **kwargs), epochs=3)
    reference = steps(in_order_ranks(len(costs), gbs, dp, **kwargs), epochs=3)
    assert len(balanced) == len(reference) > 0
    per_epoch = len(balanced) // 3
    for epoch in range(3):
        got = balanced[epoch * per_epoch : (epoch + 1) * per_epoch]
        expected = reference[epoch * per_epoch : (epoch + 1) * per_epoch]
        flat = sorted(i for step in got for rank in step for i in rank)
        assert flat == sorted(i for step in expected for rank in step for i in rank)
        assert all(len(rank) == gbs // dp for step in got for rank in step)
        real = [i for i in flat if i >= 0]
        assert len(real) == len(set(real))  # each pack at most once per epoch
        if not drop_last and len(costs) % gbs:  # the padded batch: last, same packs
            assert sorted(i for rank in got[-1] for i in rank) == sorted(
                i for rank in expected[-1] for i in rank
            )


@settings(max_examples=examples(50), deadline=None)
@given(setups(), st.data())
def test_resume_from_consumed_samples_yields_the_continuation(setup, data):
    costs, gbs, dp, drop_last, seed = setup
    rank = data.draw(st.integers(0, dp - 1))
    kwargs = {"seed": seed, "drop_last": drop_last, "data_parallel_rank": rank, "data_parallel_size": dp}
    kwargs["regroup"] = data.draw(st.booleans())
    full = BalancedPackedBatchSampler(costs, global_batch_size=gbs, **kwargs)
    per_epoch = len(full)
    stream = list(full) + list(full)  # two epochs
    cut = data.draw(st.integers(0, len(stream)))
    resumed = BalancedPackedBatchSampler(costs, global_batch_size=gbs, consumed_samples=cut * gbs, **kwargs)
    expected_len = per_epoch - cut % per_epoch
    assert len(resumed) == expected_len
    continuation = list(resumed) + list(resumed)
    assert continuation[: len(stream) - cut] == stream[cut:]


def test_all_ranks_agree_and_a_second_sampler_deals_the_same():
    costs = np.random.default_rng(1).pareto(1.5, size=64) * 100
    first, second = steps(all_ranks(costs, 16, 4, seed=5)), steps(all_ranks(costs, 16, 4, seed=5))
    assert first == second and len(first) == 4
    for step in first:
        assert sorted(i for rank in step for i in rank) == sorted(set(i for rank in step for i in rank))


def test_padding_rows_cost_what_the_row_they_repeat_costs_and_stay_minus_one():
    """A padding row is `PackedDataset`'s index -1 (the last pack, no loss): it costs that pack's compute."""
    costs = np.arange(1.0, 11.0)  # 10 packs, GBS 4: the third global batch has 2 packs and 2 paddings
    epoch = steps(all_ranks(costs, 4, 2, drop_last=False))
    assert len(epoch) == 3 and all(len(rank) == 2 for step in epoch for rank in step)
    assert sorted(i for step in epoch for rank in step for i in rank if i >= 0) == list(range(10))
    # the paddings cost 10 (the last pack), the heaviest of the last batch: round 0 gives one to each rank
    assert [sorted(rank)[0] for rank in epoch[-1]] == [-1, -1]


def test_long_tail_costs_are_far_better_balanced_than_in_order():
    # A pack holds a bounded number of tokens, so its cost is bounded too: a Pareto tail clipped at 4x
    # the cheapest pack (many short sequences: ~1; one long sequence: up to 4, its attention term).
    costs = 1 + np.minimum(np.random.default_rng(0).pareto(1.5, 4096), 3)
    gbs, dp = 64, 8

    def overhead(step_list):
        return straggler_overhead(np.array([[costs[rank].sum() for rank in step] for step in step_list]))

    balanced = overhead(steps(all_ranks(costs, gbs, dp, seed=3)))
    in_order = overhead(steps(in_order_ranks(len(costs), gbs, dp, seed=3)))
    assert in_order > 0.2
    assert balanced < in_order / 10


def test_row_costs_match_a_hand_computed_example():
    # packs of 10 and 6 tokens, starts [0, 4] and [0]: runtime lengths 3, 5 and 5.
    lengths, packs = row_runtime_lengths(np.array([0, 10, 16]), np.array([0, 4, 0]), np.array([0, 2, 3]))
    assert lengths.tolist() == [3, 5, 5] and packs.tolist() == [0, 0, 1]
    costs = row_pack_costs(np.array([0, 10, 16, 16]), np.array([0, 4, 0]), np.array([0, 2, 3, 3]), MODEL)
    assert costs.tolist() == pytest.approx([3 + 0.09 + 3 + 5 + 0.25 + 3, 5 + 0.25 + 3, 0.0])


@pytest.mark.parametrize(
    ("row_offsets", "starts", "seq_offsets", "match"),
    [
        ([0, 10], [0, 4], [0, 1], "end at 2"),
        ([0, 10, 12], [0, 4], [0, 2], "different numbers of packs"),
        ([0, 10], [0, 4, 4], [0, 3], "pack 0 has a sequence of 0 stored tokens"),
        ([0, 10, 12], [0, 0, 2], [0, 1, 3], "pack 1 has a sequence of 0 stored tokens"),
        ([1, 10], [0], [0, 1], "row_offsets must start at 0"),
        ([0, 10], [0.0], [0, 1], "seq_start_id must be a 1-D integer array"),
    ],
)
def test_row_costs_reject_broken_indexes(row_offsets, starts, seq_offsets, match):
    with pytest.raises(TightpackError, match=match):
        row_pack_costs(np.array(row_offsets), np.array(starts), np.array(seq_offsets), MODEL)


@pytest.fixture
def packed(packed_chat):
    return packed_chat


def loop_costs(dataset):
    costs = []
    for i in range(len(dataset)):
        row = dataset[i]
        bounds = [*row["seq_start_id"].tolist(), len(row["input_ids"])]
        runtime = [end - start - 1 for start, end in itertools.pairwise(bounds)]
        costs.append(sum(MODEL.linear * s + MODEL.quadratic * s * s + MODEL.per_sequence for s in runtime))
    return np.array(costs)


def test_pack_costs_of_a_real_dataset_match_a_python_loop(packed, tmp_path):
    dataset = PackedDataset(packed, cache_dir=tmp_path / "cache")
    costs = pack_costs(dataset, MODEL)
    assert len(costs) == len(dataset) > 10 and costs.dtype == np.float64
    np.testing.assert_allclose(costs, loop_costs(dataset), rtol=1e-12)
    assert len(np.unique(costs)) > 1  # the test sees real variation
    mapped = PackedDataset(packed, cache_dir=tmp_path / "cache", max_num_samples=2 * len(dataset) + 3, seed=4)
    np.testing.assert_allclose(pack_costs(mapped, MODEL), loop_costs(mapped), rtol=1e-12)


def test_pack_costs_of_a_legacy_npy_dataset(tmp_path, chat_rows):
    source = write_jsonl(tmp_path / "c.jsonl", chat_rows)
    pack_dataset(
        [source], tmp_path / "npy", PackConfig(packed_sequence_size=128, output_format="npy", workers=1)
    )
    dataset = PackedDataset(tmp_path / "npy" / "packs.npy")
    np.testing.assert_allclose(pack_costs(dataset, MODEL), loop_costs(dataset), rtol=1e-12)


def test_a_dataloader_reads_a_packed_dataset_through_the_sampler(packed, tmp_path):
    dataset = PackedDataset(packed, cache_dir=tmp_path / "cache")
    costs = pack_costs(dataset, MODEL)
    sampler = BalancedPackedBatchSampler(
        costs, global_batch_size=4, data_parallel_rank=1, data_parallel_size=2, seed=2, drop_last=False
    )
    expected = list(
        BalancedPackedBatchSampler(
            costs, global_batch_size=4, data_parallel_rank=1, data_parallel_size=2, seed=2, drop_last=False
        )
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=0, collate_fn=PackedCollate(pack_size=128, eos_id=50256)
    )
    batches = list(loader)
    assert len(batches) == len(expected) > 0
    for batch, indices in zip(batches, expected, strict=True):
        assert batch["tokens"].shape[0] == len(indices) == 2


@pytest.mark.parametrize(
    ("costs", "kwargs", "match"),
    [
        (
            np.ones(8),
            {"global_batch_size": 6, "data_parallel_size": 4},
            r"global_batch_size \(6\) is not divisible",
        ),
        (np.ones(8), {"global_batch_size": 0}, "global_batch_size must be a positive integer, got 0"),
        (
            np.ones(8),
            {"global_batch_size": 4, "data_parallel_size": 0},
            "data_parallel_size must be a positive",
        ),
        (np.ones(8), {"global_batch_size": 4, "data_parallel_size": 2, "data_parallel_rank": 2}, "outside"),
        (np.ones(8), {"global_batch_size": 16}, "Not enough samples for a single global step: 8 < 16"),
        (np.ones(8), {"global_batch_size": 4, "consumed_samples": -4}, "consumed_samples must be >= 0"),
        (np.array([1.0, -1.0]), {"global_batch_size": 2}, "index 1 has cost -1.0"),
        (np.array([1.0, np.nan]), {"global_batch_size": 2}, "finite and >= 0"),
        (np.zeros(0), {"global_batch_size": 2}, "non-empty 1-D array"),
        (np.ones((2, 2)), {"global_batch_size": 2}, "non-empty 1-D array"),
        (np.array(["a", "b"]), {"global_batch_size": 2}, "must be numbers"),
    ],
)
def test_errors(costs, kwargs, match):
    with pytest.raises(TightpackError, match=match):
        BalancedPackedBatchSampler(costs, **kwargs)


def test_costs_are_copied():
    costs = np.ones(8)
    sampler = BalancedPackedBatchSampler(costs, global_batch_size=4, data_parallel_size=2)
    before = list(sampler)
    costs[:] = np.arange(8.0) ** 4
    sampler.consumed_samples = 0
    assert list(sampler) == before
