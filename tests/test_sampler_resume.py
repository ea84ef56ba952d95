"""Resume positions of the offline samplers (issue 25): the training loop's count, never what a
DataLoader drew ahead; one position per iterator; positions off the step grid refused alike."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from tightpack.errors import TightpackError
from tightpack.runtime.balanced_sampler import BalancedPackedBatchSampler
from tightpack.runtime.samplers import PackedBatchSampler, TokenBudgetBatchSampler

TOTAL, GBS = 96, 16  # six global batches per epoch
LENGTHS = np.random.default_rng(7).integers(1, 60, 100)  # token-budget samples


class Echo(torch.utils.data.Dataset):
    """Returns the index it is asked for, so that the test sees what the sampler sent."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, index: int) -> int:
        return index


@dataclass(frozen=True)
class Case:
    """A sampler under test: how to build it at a position, its position's name and one step in it."""

    name: str
    build: Any  # (position, **overrides) -> sampler
    position_name: str = "consumed_samples"
    per_step: int = GBS

    def __call__(self, position: int = 0, **overrides):
        return self.build(position, **overrides)


def _packed(kind: str, **fixed):
    def build(position, **overrides):
        settings = {"dataloader_type": kind, "seed": 3, **fixed, **overrides}
        return PackedBatchSampler(TOTAL, consumed_samples=position, **settings)

    return build


COSTS = np.random.default_rng(5).pareto(1.5, TOTAL) * 100
CASES = [
    Case("batch", _packed("batch", micro_batch_size=1, global_batch_size=GBS)),
    Case("cyclic", _packed("cyclic", micro_batch_size=GBS)),
    Case("single", _packed("single", micro_batch_size=GBS)),
    Case(
        "balanced",
        lambda position, **o: BalancedPackedBatchSampler(
            COSTS, global_batch_size=GBS, seed=3, consumed_samples=position, **o
        ),
    ),
    Case(
        "token_budget",
        lambda position, **o: TokenBudgetBatchSampler(
            LENGTHS[:48], 128, seed=3, consumed_micro_batches=position, **o
        ),
        position_name="consumed_micro_batches",
        per_step=1,
    ),
]
BY_NAME = {case.name: case for case in CASES}


def flat(batches) -> list[int]:
    return [i for batch in batches for i in batch]


def epoch_length(case: Case) -> int:
    return case().epoch_length


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_saved_position_is_the_trained_one_with_prefetching_workers(case):
    """DataLoader(num_workers=2) draws 4 batches ahead; the state saves the loop's count, and both
    ways of resuming (load_state_dict, the constructor) give every pack exactly once, in order."""
    epoch = list(case())
    sampler = case()
    loader = torch.utils.data.DataLoader(Echo(), batch_sampler=sampler, num_workers=2, collate_fn=list)
    batches, trained, consumed = iter(loader), [], 0
    for _ in range(2):
        trained.append(next(batches))
        consumed += case.per_step  # what the loop counts
    if case.position_name == "consumed_samples":  # read from the sampler, it was 96: 64 packs skipped
        with pytest.raises(TightpackError, match="does not know what the training loop consumed"):
            _ = sampler.consumed_samples
    state = sampler.state_dict(consumed)
    del batches
    assert state[case.position_name] == 2 * case.per_step
    from_state = case()
    from_state.load_state_dict(state)
    for resumed in (from_state, case(consumed)):
        rest = list(
            torch.utils.data.DataLoader(Echo(), batch_sampler=resumed, num_workers=2, collate_fn=list)
        )
        assert trained + rest == epoch
        seen = flat(trained + rest)
        assert len(seen) == len(set(seen)) == len(flat(epoch))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_iterators_over_one_sampler_keep_their_own_positions(case):
    sampler, epoch = case(), list(case())
    first = iter(sampler)
    head = next(first)
    assert list(iter(sampler)) == epoch  # started where `first` had drawn to, before
    assert [head, *first] == epoch
    following = list(case(epoch_length(case)))
    assert sampler.state_dict(5 * case.per_step)[case.position_name] == 5 * case.per_step
    assert list(sampler) == following  # the finished passes moved the next iter() one epoch, not two


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_position_off_the_step_grid_is_refused_the_same_way(case):
    unit = 2 if case.name == "token_budget" else GBS
    sampler = case(micro_batches_per_step=unit) if case.name == "token_budget" else case()
    given = unit + unit // 2  # 24 of 16 samples; token budget: 3 of 2 micro-batches per step
    message = (
        rf"{case.position_name}={given} is not a multiple of .*\b{unit}\b.*resume from {unit} or {2 * unit}"
    )
    with pytest.raises(TightpackError, match=message):
        case(given, micro_batches_per_step=2) if case.name == "token_budget" else case(given)
    with pytest.raises(TightpackError, match=message):
        sampler.load_state_dict({**sampler.state_dict(), case.position_name: given})
    with pytest.raises(TightpackError, match=message):
        sampler.state_dict(given)
    if case.position_name == "consumed_samples":
        with pytest.raises(TightpackError, match=message):
            sampler.consumed_samples = given


def test_the_end_of_a_one_pass_sampler_with_a_partial_tail_is_a_position():
    sampler = PackedBatchSampler(5, dataloader_type="single", micro_batch_size=2, drop_last=False)
    assert list(sampler) == [[0, 1], [2, 3], [4]]
    assert len(sampler) == 0 and sampler.state_dict()["consumed_samples"] == 5
    resumed = PackedBatchSampler(5, dataloader_type="single", micro_batch_size=2, drop_last=False)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == []


@pytest.mark.parametrize("per_step", [1, 2])
@pytest.mark.parametrize("cost_model", [None, "llama-8b"])
def test_token_budget_resumes_exactly_at_every_cut_of_two_epochs(per_step, cost_model):
    settings = {
        "seed": 1,
        "data_parallel_size": 2,
        "micro_batches_per_step": per_step,
        "cost_model": cost_model,
    }
    lengths = LENGTHS[:80]
    for rank in (0, 1):

        def build(rank=rank, **extra):
            return TokenBudgetBatchSampler(lengths, 128, data_parallel_rank=rank, **settings, **extra)

        reference = build()
        stream = list(reference) + list(reference)
        assert len(stream) == 2 * reference.epoch_length >= 8
        for cut in range(0, len(stream) + 1, per_step):
            by_keyword = build(consumed_micro_batches=cut)
            by_state = build()
            by_state.load_state_dict(reference.state_dict(cut))
            for resumed in (by_keyword, by_state):
                continuation = list(resumed) + list(resumed)
                assert continuation[: len(stream) - cut] == stream[cut:]


def test_token_budget_epochs_stay_disjoint_over_ranks_and_reshuffle():
    samplers = [
        TokenBudgetBatchSampler(LENGTHS, 128, data_parallel_rank=r, data_parallel_size=2) for r in (0, 1)
    ]
    epochs = [[flat(s) for s in samplers] for _ in range(2)]
    for epoch in epochs:
        union = epoch[0] + epoch[1]
        assert len(union) == len(set(union))
    assert epochs[0] != epochs[1]
    assert samplers[0].epoch == 2


@pytest.mark.parametrize(
    ("name", "settings"),
    [("batch", {}), ("balanced", {}), ("token_budget", {}), ("token_budget", {"micro_batches_per_step": 2})],
    ids=["batch", "balanced", "token_budget", "token_budget-2-per-step"],
)
def test_stateful_dataloader_with_workers_resumes_exactly_at_every_cut(name, settings):
    """torchdata saves the running pass's position as each batch was drawn: every cut, the last
    batch included, continues the epoch exactly, and the next epoch follows. With two micro-batches
    per step half the cuts fall inside an optimizer step (where the loop's own count is refused:
    it saves after whole steps); torchdata's snapshot of the pass resumes there too."""
    case = BY_NAME[name]
    epoch, following = list(case(**settings)), list(case(case(**settings).epoch_length, **settings))

    def loader():
        return StatefulDataLoader(Echo(), batch_sampler=case(**settings), num_workers=2, collate_fn=list)

    for cut in range(len(epoch) + 1):
        first = loader()
        batches = iter(first)
        head = [next(batches) for _ in range(cut)]
        state = first.state_dict()
        del batches, first
        second = loader()
        second.load_state_dict(state)
        assert head + list(second) == epoch, cut
        assert list(second) == following, cut


def test_load_state_dict_refuses_other_settings_and_lets_batch_change_the_data_parallel_size():
    batch = BY_NAME["batch"]
    state = batch().state_dict(2 * GBS)
    with pytest.raises(
        TightpackError, match=r"saved with samples_per_step=16, this sampler has samples_per_step=32"
    ):
        batch(global_batch_size=32).load_state_dict(state)
    with pytest.raises(TightpackError, match=r"saved with seed=3, this sampler has seed=4"):
        batch(seed=4).load_state_dict(state)
    balanced = BY_NAME["balanced"]
    with pytest.raises(
        TightpackError, match="saved with data_parallel_size=1, this sampler has data_parallel_size=2"
    ):
        balanced(data_parallel_size=2).load_state_dict(balanced().state_dict(GBS))
    with pytest.raises(TightpackError, match="not a PackedBatchSampler state"):
        batch().load_state_dict({"epoch": 1})
    # `batch` deals rank-independent global batches: two ranks resume the one-rank stream
    rest = flat(batch(2 * GBS))
    ranks = []
    for rank in (0, 1):
        sampler = batch(data_parallel_rank=rank, data_parallel_size=2)
        sampler.load_state_dict(state)
        ranks.append(list(sampler))
    merged = flat(flat(zip(*ranks, strict=True)))
    assert sorted(merged) == sorted(rest) and len(merged) == len(rest)


def test_a_pass_state_at_the_end_of_its_epoch_finishes_that_epoch():
    sampler = BY_NAME["batch"]()
    passes = iter(sampler)
    list(itertools.islice(passes, 6))
    saved = passes.state_dict()
    assert saved == {"consumed_samples": TOTAL, "epoch": 0}
    restored = iter(BY_NAME["batch"]())
    restored.load_state_dict(saved)
    assert list(restored) == []
    with pytest.raises(TightpackError, match="epoch must be an integer starting at or before 16"):
        restored.load_state_dict({"consumed_samples": 16, "epoch": 1})


@pytest.mark.parametrize("name", ["batch", "balanced"])
def test_two_ranks_with_prefetching_workers_resume_every_pack_exactly_once(name):
    case, ranks = BY_NAME[name], 2

    def loader(sampler):
        return torch.utils.data.DataLoader(Echo(), batch_sampler=sampler, num_workers=2, collate_fn=list)

    trained, states = [], []
    for rank in range(ranks):
        sampler = case(data_parallel_rank=rank, data_parallel_size=ranks)
        batches = iter(loader(sampler))
        trained += flat(next(batches) for _ in range(3))
        states.append(sampler.state_dict(3 * GBS))  # every rank's loop counts the same 3 global steps
        del batches
    rest = []
    for rank, state in enumerate(states):
        resumed = case(data_parallel_rank=rank, data_parallel_size=ranks)
        resumed.load_state_dict(state)
        rest += flat(loader(resumed))
    assert sorted(trained + rest) == list(range(TOTAL))
