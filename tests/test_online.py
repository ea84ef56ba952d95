"""OnlinePacker: nothing lost or duplicated, the reference's ffd semantics, max_wait, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tightpack.core.planner import plan_packs
from tightpack.errors import TightpackError
from tightpack.runtime.online import OnlinePacker


def make_stream(count: int, seed: int, high: int = 300):
    lengths = np.random.default_rng(seed).integers(1, high, count)
    samples = [
        {"key": f"s{i}", "input_ids": torch.arange(n) + i, "loss_mask": torch.ones(n)}
        for i, n in enumerate(lengths)
    ]
    by_key = {s["key"]: s for s in samples}
    return samples, (lambda start: iter(samples[start:])), by_key.__getitem__


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("multiple", [1, 4])
def test_every_sample_once_and_packs_within_size(strategy, multiple):
    samples, source, restore = make_stream(300, seed=1)
    packer = OnlinePacker(source, restore=restore, pack_size=1024, packing_buffer_size=16, strategy=strategy,
                          pad_to_multiple_of=multiple)  # fmt: skip
    packs = list(packer)
    keys = [key for pack in packs for key in pack["keys"]]
    assert sorted(keys) == sorted(s["key"] for s in samples)
    assert all(pack["total_tokens"] <= 1024 for pack in packs)
    for pack in packs:
        offsets = pack.get("cu_seqlens_q_padded", pack["cu_seqlens_q"]).tolist()
        for key, start in zip(pack["keys"], offsets, strict=False):
            ids = samples[int(key[1:])]["input_ids"]
            assert torch.equal(pack["input_ids"][0, start : start + len(ids)], ids)


def test_ffd_groups_the_whole_buffer_first():
    samples, source, restore = make_stream(40, seed=2)
    packer = OnlinePacker(source, restore=restore, pack_size=1024, packing_buffer_size=16, strategy="ffd")
    packs = list(packer)
    plan = plan_packs([len(s["input_ids"]) for s in samples[:16]], 1024, algorithm="ffd")
    assert [pack["keys"] for pack in packs[: len(plan)]] == [
        [f"s{i}" for i in group.tolist()] for group in plan
    ]


@pytest.mark.parametrize(("high", "max_wait"), [(1500, 32), (1500, 40), (900, 32), (2048, 32)])
def test_best_fill_keeps_waits_within_max_wait(high, max_wait):
    _, source, restore = make_stream(2000, seed=3, high=high)  # long samples: leftovers accumulate
    packer = OnlinePacker(source, restore=restore, pack_size=2048, packing_buffer_size=32, max_wait=max_wait)
    list(packer)
    assert packer.counts["samples"] == 2000 and packer.counts["max_wait"] <= max_wait
    assert packer.counts["max_wait"] > packer.mean_wait > 1  # samples did wait, none beyond the bound


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("checkpoint", [0, 1, 5, 17])
def test_resume_yields_exactly_the_uninterrupted_packs(strategy, checkpoint):
    settings = {"pack_size": 1024, "packing_buffer_size": 12, "strategy": strategy, "pad_to_multiple_of": 4}
    _, source, restore = make_stream(150, seed=4)
    uninterrupted = [
        (p["keys"], p["input_ids"].tolist()) for p in OnlinePacker(source, restore=restore, **settings)
    ]
    first = OnlinePacker(source, restore=restore, **settings)
    iterator = iter(first)
    head = [(p["keys"], p["input_ids"].tolist()) for _, p in zip(range(checkpoint), iterator, strict=False)]
    state = first.state_dict()
    assert all(isinstance(key, str) for key, _ in state["buffer"])  # keys, not tensors
    resumed = OnlinePacker(source, restore=restore, **settings)
    resumed.load_state_dict(state)
    assert head + [(p["keys"], p["input_ids"].tolist()) for p in resumed] == uninterrupted


def test_resume_with_other_settings_is_refused():
    _, source, restore = make_stream(20, seed=5)
    state = OnlinePacker(source, restore=restore, pack_size=1024, packing_buffer_size=8).state_dict()
    other = OnlinePacker(source, restore=restore, pack_size=2048, packing_buffer_size=8)
    with pytest.raises(TightpackError, match="different settings: pack_size saved 1024 now 2048"):
        other.load_state_dict(state)


def test_long_samples_are_counted():
    samples = [{"key": "a", "input_ids": torch.arange(50)}, {"key": "b", "input_ids": torch.arange(10)}]
    truncate = OnlinePacker(lambda start: iter(samples[start:]), pack_size=32, packing_buffer_size=2)
    packs = list(truncate)
    assert truncate.counts["truncated"] == 1 and sum(len(p["keys"]) for p in packs) == 2
    drop = OnlinePacker(
        lambda start: iter(samples[start:]), pack_size=32, packing_buffer_size=2, long_samples="drop"
    )
    assert [p["keys"] for p in drop] == [["b"]] and drop.counts["dropped"] == 1
    error = OnlinePacker(
        lambda start: iter(samples[start:]), pack_size=32, packing_buffer_size=2, long_samples="error"
    )
    with pytest.raises(TightpackError, match="sample 'a' has 50 tokens, above the pack size 32"):
        list(error)


def test_max_wait_below_the_buffer_is_refused():
    with pytest.raises(TightpackError, match=r"max_wait \(4\) must be at least packing_buffer_size \(8\)"):
        OnlinePacker(lambda start: iter([]), pack_size=64, packing_buffer_size=8, max_wait=4)
