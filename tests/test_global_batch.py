"""Global-batch online packing over two gloo ranks: one pool per step, balanced micro-batches.

A stream of samples of long-tailed lengths; two processes run `GlobalBatchPacker` on it, once taking
other ranks' samples by ``restore`` and once by exchanging them. Every step: each sample of the step's
positions in exactly one micro-batch of one rank, every micro-batch within the budget, both ranks the
same number of micro-batches, the ranks' costs those `plan_step` gives the pooled step (and a lighter
slowest rank than each rank packing its own share), and a resumed packer yields the steps of an
uninterrupted run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tightpack.core.step_planner import plan_step
from tightpack.errors import TightpackError
from tightpack.runtime.global_batch import GlobalBatchPacker

RANKS, PER_STEP, BUDGET = 2, 24, 512


def stream() -> list[dict]:
    rng = np.random.default_rng(4)
    lengths = np.minimum((rng.pareto(1.1, 96) + 1) * 20, 480).astype(int)
    return [
        {"key": i, "input_ids": torch.arange(n) + i, "loss_mask": (torch.arange(n) % 3 > 0).long()}
        for i, n in enumerate(lengths)
    ]


def source(start: int, stride: int):
    return iter(stream()[start::stride])


def run(rank: int, restore: bool, resume_after: int | None = None) -> list[dict]:
    samples = stream()

    def packer():
        return GlobalBatchPacker(source, samples_per_step=PER_STEP, max_tokens=BUDGET, cost_model="llama-8b",
                                 restore=(lambda key: samples[key]) if restore else None)  # fmt: skip

    steps, first = [], packer()
    for step in first:
        steps.append(step)
        if resume_after is not None and len(steps) == resume_after:
            state = first.state_dict()
            second = packer()
            second.load_state_dict(state)
            steps.extend(second)
            break
    return [
        {
            "keys": step.keys,
            "tokens": [int(batch["input_ids"].shape[1]) for batch in step.micro_batches],
            "ids": [batch["input_ids"][0].tolist() for batch in step.micro_batches],
            "rank_cost": step.plan.rank_cost.tolist(),
            "denominators": (step.denominators.tokens, step.denominators.sequences),
        }
        for step in steps
    ]


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, RANKS), rank=rank, world_size=RANKS)
    try:
        results = {"restore": run(rank, True), "exchange": run(rank, False), "resumed": run(rank, True, 2)}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_two_ranks_draw_balanced_micro_batches_from_one_pool_per_step(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=RANKS, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(RANKS)]
    samples = stream()
    lengths = np.array([len(s["input_ids"]) for s in samples])
    for name in ("restore", "exchange", "resumed"):
        assert [r[name] for r in ranks] == [r["restore"] for r in ranks], name  # the same steps every way
    steps = ranks[0]["restore"]
    assert len(steps) == len(samples) // PER_STEP
    pooled = local = 0.0
    for index in range(len(steps)):
        positions = list(range(index * PER_STEP, (index + 1) * PER_STEP))
        keys = [key for r in ranks for batch in r["restore"][index]["keys"] for key in batch]
        assert sorted(keys) == positions  # every sample of the step once, on one rank
        counts = {len(r["restore"][index]["keys"]) for r in ranks}
        assert len(counts) == 1  # the same number of micro-batches on every rank
        for r in ranks:
            step = r["restore"][index]
            for batch_keys, tokens, ids in zip(step["keys"], step["tokens"], step["ids"], strict=True):
                assert tokens <= BUDGET or len(batch_keys) == 1
                assert (
                    ids == [t for key in batch_keys for t in samples[key]["input_ids"].tolist()]
                    or not batch_keys
                )
        # the pool in rank order: rank 0's positions, then rank 1's
        order = [p for rank in range(RANKS) for p in positions[rank::RANKS]]
        plan = plan_step(lengths[order], RANKS, max_tokens=BUDGET, cost_model="llama-8b")
        assert steps[index]["rank_cost"] == plan.rank_cost.tolist()
        pooled += max(plan.rank_cost)
        shares = [lengths[positions[rank::RANKS]] for rank in range(RANKS)]
        own = [plan_step(share, 1, max_tokens=BUDGET, cost_model="llama-8b").rank_cost[0] for share in shares]
        local += max(own)
    assert pooled < local  # one pool balances what each rank's own share does not


def test_settings_are_checked_at_construction():
    with pytest.raises(TightpackError, match="give the micro-batches' token budget"):
        GlobalBatchPacker(source, samples_per_step=8)
    with pytest.raises(TightpackError, match="samples_per_step must be a positive multiple"):
        GlobalBatchPacker(source, samples_per_step=0, max_tokens=64)


def test_one_process_is_one_rank():
    steps = list(GlobalBatchPacker(source, samples_per_step=PER_STEP, max_tokens=BUDGET))
    assert len(steps) == 4 and all(step.plan.ranks == 1 for step in steps)
    assert sorted(k for step in steps for batch in step.keys for k in batch) == list(range(96))
