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
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tightpack.core.step_planner import plan_step
from tightpack.errors import TightpackError
from tightpack.runtime.global_batch import GlobalBatchPacker
from tightpack.runtime.step_loss import packed_step_loss

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


def run_ranks(target, tmp_path) -> list[dict]:
    """``target(rank)`` on every rank, in a gloo process group of its own; what each returned."""
    mp.spawn(_on_rank, args=(target, str(tmp_path / "store"), str(tmp_path)), nprocs=RANKS, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(RANKS)]


def _on_rank(rank: int, target, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, RANKS), rank=rank, world_size=RANKS)
    try:
        torch.save(target(rank), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def worker(rank: int) -> dict:
    return {"restore": run(rank, True), "exchange": run(rank, False), "resumed": run(rank, True, 2)}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_two_ranks_draw_balanced_micro_batches_from_one_pool_per_step(tmp_path):
    ranks = run_ranks(worker, tmp_path)
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


def samples_of(count: int, kind: str = "loss_mask", seed: int = 7) -> list[dict]:
    """``count`` samples of 3 to 40 tokens carrying a ``loss_mask``, only ``labels`` or only ``input_ids``."""
    lengths = np.random.default_rng(seed).integers(3, 41, count)
    samples = []
    for key, n in enumerate(lengths.tolist()):
        sample = {"key": key, "input_ids": torch.arange(n) + key}
        if kind == "labels":
            sample["labels"] = torch.where(torch.arange(n) < n // 3, -100, sample["input_ids"])
        elif kind == "loss_mask":
            sample["loss_mask"] = (torch.arange(n) % 2).long()
        samples.append(sample)
    return samples


def source_of(samples: list[dict]):
    return lambda start, stride: iter(samples[start::stride])


def steps_of(samples: list[dict], restore: bool = True, resume_after: int | None = None, **settings):
    """Every step of a packer over ``samples`` (resumed from its state after ``resume_after`` steps),
    and the last packer."""

    def packer() -> GlobalBatchPacker:
        restoring = (lambda key: samples[key]) if restore else None
        return GlobalBatchPacker(source_of(samples), restore=restoring, **settings)

    steps, current = [], packer()
    for step in current:
        steps.append(step)
        if len(steps) == resume_after:
            state, current = current.state_dict(), packer()
            current.load_state_dict(state)
            steps.extend(current)
            break
    return steps, current


def error_of(call) -> str | None:
    try:
        call()
    except TightpackError as error:
        return str(error)
    return None


def edge_worker(rank: int) -> dict:
    results: dict = {}
    settings = dict(samples_per_step=64, max_tokens=128)
    for count in (200, 100, 10):
        samples = samples_of(count)
        for restore in (True, False):
            steps, packer = steps_of(samples, restore, **settings)
            resumed, _ = steps_of(samples, restore, 2, **settings)
            after_end = GlobalBatchPacker(source_of(samples), **settings)  # starts past the end
            after_end.load_state_dict(packer.state_dict())
            results[("keep", count, restore)] = (
                [step.keys for step in steps],
                [step.keys for step in resumed],
                len(list(after_end)),
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps, packer = steps_of(samples, drop_last=True, **settings)
            resumed, _ = steps_of(samples, True, 2, drop_last=True, **settings)
        results[("drop", count)] = (
            [step.keys for step in steps],
            [step.keys for step in resumed],
            packer.left_out,
            packer.state_dict()["left_out"],
            [str(w.message) for w in caught],
        )
    for kind in ("input_ids", "labels"):
        samples = samples_of(40, kind)
        steps, _ = steps_of(samples, samples_per_step=20, max_tokens=96)
        contributions, masks = [], []
        for step in steps:
            ones = [torch.ones(batch["input_ids"].shape) for batch in step.micro_batches]
            contributions.append(
                sum(
                    float(packed_step_loss(loss, batch, step.denominators))
                    for loss, batch in zip(ones, step.micro_batches, strict=True)
                )
            )
            masks.append([batch["loss_mask"][0].tolist() for batch in step.micro_batches])
        untouched = all("loss_mask" not in sample for sample in samples)
        results[("mask", kind)] = ([step.keys for step in steps], contributions, masks, untouched)
    for settings in (dict(samples_per_step=20, max_tokens=96), dict(samples_per_step=4, micro_batches=4)):
        steps, _ = steps_of(samples_of(40), pad_to_multiple_of=8, **settings)
        results[("aligned", settings["samples_per_step"])] = [
            [
                (
                    keys,
                    int(batch["input_ids"].shape[1]),
                    int(step.plan.tokens[rank, index]),
                    batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist(),
                )
                for index, (keys, batch) in enumerate(zip(step.keys, step.micro_batches, strict=True))
            ]
            for step in steps
        ]
    keyless = samples_of(16)
    del keyless[5]["key"]  # position 5: rank 1's in the second step of 4
    oversize = samples_of(16)
    oversize[7] = {"key": 7, "input_ids": torch.arange(200)}
    results["errors"] = [
        error_of(lambda: steps_of(keyless, samples_per_step=4, max_tokens=128)),
        error_of(lambda: steps_of(oversize, samples_per_step=4, max_tokens=128)),
    ]
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_two_ranks_keep_or_report_the_short_last_step_mask_and_align_every_micro_batch(tmp_path):
    ranks = run_ranks(edge_worker, tmp_path)
    for count in (200, 100, 10):
        for restore in (True, False):  # drop_last=False: every key once, the short last step included
            runs = [r[("keep", count, restore)] for r in ranks]
            assert all(run[0] == run[1] for run in runs)  # resumed: the steps of an uninterrupted run
            assert all(run[2] == 0 for run in runs)  # resumed after the end: nothing more
            steps = [
                [batch_keys for keys in step for batch_keys in keys]
                for step in zip(*(r[0] for r in runs), strict=True)
            ]
            assert len(steps) == -(-count // 64)
            keys = [key for step in steps for batch in step for key in batch]
            assert sorted(keys) == list(range(count))
            for per_rank in zip(*(r[0] for r in runs), strict=True):
                assert len({len(keys) for keys in per_rank}) == 1  # as many micro-batches on every rank
        dropped = [r[("drop", count)] for r in ranks]
        kept = count // 64 * 64
        for keys, resumed, left_out, saved, caught in dropped:
            assert keys == resumed and len(keys) == count // 64
            assert left_out == saved == count - kept
            assert len(caught) == 2  # the uninterrupted run's and the resumed run's
            assert all(f"left out the stream's last {count - kept} samples" in message for message in caught)
        assert sorted(k for r in dropped for step in r[0] for batch in step for k in batch) == list(
            range(kept)
        )
    for kind in ("input_ids", "labels"):
        samples = samples_of(40, kind)
        runs = [r[("mask", kind)] for r in ranks]
        assert all(run[3] for run in runs)  # the caller's samples keep no mask of ours
        for index in range(2):
            # ones everywhere, token-mean: the step's contributions add up to 1 exactly when each mask
            # trains what the denominators count
            assert sum(run[1][index] for run in runs) == pytest.approx(1.0)
            for run in runs:
                for keys, mask in zip(run[0][index], run[2][index], strict=True):
                    expected = [
                        [1] * len(samples[key]["input_ids"])
                        if kind == "input_ids"
                        else (samples[key]["labels"] != -100).long().tolist()
                        for key in keys
                    ]
                    assert mask == ([t for m in expected for t in m] if keys else [0])
    for per_step in (20, 4):
        padding = 0
        for r in ranks:
            for step in r[("aligned", per_step)]:
                for keys, width, tokens, bounds in step:
                    sizes = np.diff(bounds)
                    assert (sizes % 8 == 0).all() and width == bounds[-1]
                    if keys:
                        assert width == tokens and len(sizes) == len(keys)
                    else:
                        padding += 1
                        assert width == 8  # one padding token, aligned
        assert padding or per_step == 20
    for r in ranks:  # every rank raises alike, naming the sample
        keyless, oversize = r["errors"]
        assert "position 5 of the stream (rank 1)" in keyless and "'key'" in keyless
        assert (
            "sample 7 has 200 tokens, over max_tokens=128" in oversize and "allow_oversize=True" in oversize
        )


def test_one_rank_reports_bad_samples_and_a_left_out_step():
    keyless = samples_of(8)
    del keyless[3]["key"]
    with pytest.raises(TightpackError, match=r"position 3 of the stream.*samples need both"):
        steps_of(keyless, samples_per_step=4, max_tokens=64)
    oversize = samples_of(8)
    oversize[6] = {"key": 6, "input_ids": torch.arange(61)}  # no mask: the others' have one
    with pytest.raises(
        TightpackError, match=r"sample 6 has 61 tokens \(64 aligned to pad_to_multiple_of=8\)"
    ):
        steps_of(oversize, samples_per_step=4, max_tokens=60, pad_to_multiple_of=8)
    steps, packer = steps_of(oversize, samples_per_step=4, max_tokens=60, allow_oversize=True)
    assert len(steps) == 2
    with pytest.warns(UserWarning, match="left out the stream's last 3 samples"):
        steps, packer = steps_of(samples_of(7), samples_per_step=4, max_tokens=64, drop_last=True)
    assert len(steps) == 1 and packer.left_out == 3
    steps, packer = steps_of(samples_of(7), samples_per_step=4, max_tokens=64)
    assert [len(step.plan.order) for step in steps] == [4, 3] and packer.left_out == 0
