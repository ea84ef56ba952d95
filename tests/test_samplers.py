"""PackedBatchSampler: the single / cyclic / batch dataloader types, ranks, resume and padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tightpack.errors import TightpackError
from tightpack.runtime.samplers import PackedBatchSampler


def ranks(total, ranks=2, **kwargs):
    return [
        PackedBatchSampler(total, data_parallel_rank=r, data_parallel_size=ranks, **kwargs)
        for r in range(ranks)
    ]


def test_single_is_sequential_and_drops_the_tail():
    first, second = ranks(10, dataloader_type="single", micro_batch_size=2)
    assert list(first) == [[0, 1], [4, 5]]
    assert list(second) == [[2, 3], [6, 7]]
    assert list(first) == []  # not cycled
    alone = PackedBatchSampler(5, dataloader_type="single", micro_batch_size=2, drop_last=False)
    assert list(alone) == [[0, 1], [2, 3], [4]]


def test_single_refuses_an_uneven_tail_over_ranks():
    with pytest.raises(TightpackError, match="cannot split the last 2 samples over 2 data-parallel ranks"):
        PackedBatchSampler(
            10, dataloader_type="single", micro_batch_size=2, data_parallel_size=2, drop_last=False
        )


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_epochs_are_disjoint_over_ranks_and_reshuffled(sharding):
    samplers = ranks(23, dataloader_type="cyclic", micro_batch_size=3, seed=4, data_sharding=sharding)
    epoch1 = [list(itertools.chain.from_iterable(s)) for s in samplers]
    epoch2 = [list(itertools.chain.from_iterable(s)) for s in samplers]
    for epoch in (epoch1, epoch2):
        union = epoch[0] + epoch[1]
        assert len(union) == len(set(union)) == 18 and all(0 <= i < 23 for i in union)
    assert epoch1 != epoch2
    again = ranks(23, dataloader_type="cyclic", micro_batch_size=3, seed=4, data_sharding=sharding)
    assert [list(itertools.chain.from_iterable(s)) for s in again] == epoch1


def test_batch_interleaves_ranks_within_a_global_batch_and_pads_the_tail():
    first, second = ranks(
        10, dataloader_type="batch", micro_batch_size=2, global_batch_size=4, drop_last=False, seed=1
    )
    a, b = list(first), list(second)
    assert len(a) == len(b) == 3 and all(len(step) == 2 for step in a + b)
    order = [*np.random.default_rng((1, 0)).permutation(10).tolist(), -1, -1]
    assert a == [order[0:4][0::2], order[4:8][0::2], order[8:12][0::2]]
    assert b == [order[0:4][1::2], order[4:8][1::2], order[8:12][1::2]]
    assert a[-1] + b[-1] == [order[8], -1, order[9], -1]
    dropping = PackedBatchSampler(10, dataloader_type="batch", micro_batch_size=2, global_batch_size=4)
    assert len(list(dropping)) == 2


@pytest.mark.parametrize(
    ("kind", "extra"), [("cyclic", {}), ("batch", {"global_batch_size": 6, "drop_last": False})]
)
@pytest.mark.parametrize("stop", [0, 1, 3, 5, 8])
def test_resume_from_consumed_samples_continues_the_same_stream(kind, extra, stop):
    def stream(sampler, steps):
        """The first ``steps`` yields of a sampler iterated epoch after epoch."""
        epochs = itertools.chain.from_iterable(iter(sampler) for _ in itertools.count())
        return list(itertools.islice(epochs, steps))

    settings = {"dataloader_type": kind, "micro_batch_size": 3, "data_parallel_size": 2, "seed": 9, **extra}
    uninterrupted = stream(PackedBatchSampler(17, data_parallel_rank=1, **settings), 12)
    head = stream(PackedBatchSampler(17, data_parallel_rank=1, **settings), stop)
    trained = stop * 6  # the loop's count: micro_batch_size 3 x 2 ranks (= the global batch) per step
    resumed = PackedBatchSampler(17, data_parallel_rank=1, consumed_samples=trained, **settings)
    assert head + stream(resumed, 12 - stop) == uninterrupted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataloader_type": "batch", "micro_batch_size": 2}, "needs global_batch_size"),
        ({"dataloader_type": "batch", "micro_batch_size": 1, "global_batch_size": 0},
         "global_batch_size must be a positive integer, got 0"),  # was a ZeroDivisionError
        ({"dataloader_type": "batch", "micro_batch_size": 2, "global_batch_size": 6, "data_parallel_size": 2},
         r"\(6\) is not divisible by `micro_batch_size \(2\) x data_parallel_size \(2\)`"),
        ({"dataloader_type": "cyclic", "micro_batch_size": 8, "data_parallel_size": 2}, "Not enough samples"),
        ({"dataloader_type": "external", "micro_batch_size": 1}, "must be single, cyclic or batch"),
        ({"dataloader_type": "single", "micro_batch_size": 1, "data_parallel_rank": 2,
          "data_parallel_size": 2}, r"data_parallel_rank 2 is outside \[0, 2\)"),
    ],
)  # fmt: skip
def test_invalid_settings(kwargs, message):
    with pytest.raises(TightpackError, match=message):
        PackedBatchSampler(10, **kwargs)


class Echo(torch.utils.data.Dataset):
    """Returns the index it is asked for, so that the test sees what the sampler sent."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        return index


def test_works_as_a_dataloader_batch_sampler_with_workers():
    sampler = PackedBatchSampler(
        10, dataloader_type="batch", micro_batch_size=2, global_batch_size=4, drop_last=False
    )
    loader = torch.utils.data.DataLoader(Echo(), batch_sampler=sampler, num_workers=2, collate_fn=list)
    steps = list(loader)
    assert len(steps) == 3 and all(len(step) == 4 for step in steps)
    assert sorted(i for step in steps for i in step) == [-1, -1, *range(10)]


def test_token_budget_batches_respect_the_budget_and_cover_every_sample():
    from tightpack.runtime.samplers import TokenBudgetBatchSampler

    lengths = np.random.default_rng(3).integers(1, 300, 500)
    samplers = [
        TokenBudgetBatchSampler(lengths, 1024, data_parallel_rank=r, data_parallel_size=2, seed=1)
        for r in (0, 1)
    ]
    epoch = [list(s) for s in samplers]
    assert len(epoch[0]) == len(epoch[1]) == len(samplers[0])
    seen = [i for batches in epoch for batch in batches for i in batch]
    assert len(seen) == len(set(seen))
    assert all(lengths[batch].sum() <= 1024 for batches in epoch for batch in batches)
    dropped = len(samplers[0].plan) % 2
    assert (
        len(seen)
        == len(lengths) - sum(len(samplers[0].plan[i]) for i in range(len(samplers[0].plan))) * 0 - 0
        or dropped
    )
    assert [list(s) for s in samplers] != epoch  # reshuffled next epoch
    fills = [lengths[batch].sum() for batch in epoch[0]]
    assert np.mean(fills) > 0.95 * 1024


def test_token_budget_refuses_a_sample_over_the_budget():
    from tightpack.runtime.samplers import TokenBudgetBatchSampler

    with pytest.raises(TightpackError, match="has length 2000 > pack_size 1024"):
        TokenBudgetBatchSampler([10, 2000], 1024)
