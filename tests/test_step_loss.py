"""A packed step over two data-parallel ranks computes the unpacked step's loss and gradients.

One step of random rollouts (lengths and supervised tokens of very different sizes), planned by
`plan_step` for DP=2 with several micro-batches per rank; two gloo processes each run their share, a
tiny Llama in float64 on packed rows, with `packed_step_loss` in every mode, gradients accumulated over
the micro-batches and averaged over the ranks (as DDP does). One process runs every rollout alone and
normalizes as the mode says. The two agree within 1e-12; dividing by each rank's own counts (the local
denominators a naive loop uses) does not.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tightpack.core.step_planner import LossDenominators, plan_step
from tightpack.errors import TightpackError
from tightpack.runtime.in_batch import build_thd_from_rows
from tightpack.runtime.step_loss import LOSS_MODES, packed_step_loss

RANKS = 2
VOCAB = 48


def rollouts(seed: int = 11) -> list[dict[str, torch.Tensor]]:
    """Twelve rollouts: a prompt (no loss) then a response (loss), of lengths 3 to 60."""
    generator = np.random.default_rng(seed)
    rows = []
    for _ in range(12):
        prompt, response = int(generator.integers(2, 20)), int(generator.integers(1, 40))
        tokens = torch.from_numpy(generator.integers(0, VOCAB, prompt + response))
        mask = torch.zeros(len(tokens), dtype=torch.long)
        mask[prompt - 1 : -1] = 1  # label-aligned: position t trains on token t + 1, a response token
        rows.append({"input_ids": tokens, "position_ids": torch.arange(len(tokens)), "loss_mask": mask})
    return rows


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = LlamaConfig(vocab_size=VOCAB, num_key_value_heads=1, attn_implementation="sdpa", **sizes)
    return LlamaForCausalLM(config).double()


def token_losses(model, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss at every position of a packed row ``[1, T]`` (its labels: the next token of its sequence)."""
    from tightpack.runtime.hf import packed_forward

    logits = packed_forward(model, row, probe=False).logits[0]
    labels = torch.roll(row["input_ids"][0], -1)
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none")[None]


def the_plan(rows):
    lengths = [len(row["input_ids"]) for row in rows]
    supervised = [int(row["loss_mask"].sum()) for row in rows]
    return plan_step(lengths, RANKS, max_tokens=64, supervised=supervised)


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, RANKS), rank=rank, world_size=RANKS)
    try:
        rows = rollouts()
        plan = the_plan(rows)  # every rank computes the same plan and takes its share
        results = {}
        model = tiny_model()
        for mode in LOSS_MODES:
            for local in (False, True):
                model.zero_grad(set_to_none=True)
                total = torch.zeros((), dtype=torch.float64)
                for batch_index in plan.rank_batches(rank):
                    if not len(batch_index):
                        continue
                    batch = build_thd_from_rows([rows[i] for i in batch_index.tolist()])
                    denominators = plan.loss_denominators
                    if local:  # the control: this rank's own counts
                        mine = plan.supervised[rank].sum(), plan.trained[rank].sum()
                        denominators = LossDenominators(int(mine[0]), int(mine[1]))
                    loss = packed_step_loss(token_losses(model, batch), batch, denominators, mode=mode,
                                            data_parallel_size=RANKS)  # fmt: skip
                    loss.backward()  # accumulated over the rank's micro-batches
                    total += loss.detach() / RANKS
                dist.all_reduce(total)
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= RANKS  # what DDP does
                results[(mode, local)] = (total, [p.grad.clone() for p in model.parameters()])
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def unpacked(mode: str):
    """Every rollout alone, the step's loss in ``mode`` and its gradients."""
    rows = rollouts()
    model = tiny_model()
    losses, masks = [], []
    for row in rows:
        logits = model(input_ids=row["input_ids"][None], use_cache=False).logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], row["input_ids"][1:], reduction="none"))
        masks.append(row["loss_mask"][:-1].double())
    sums = torch.stack([(loss * mask).sum() for loss, mask in zip(losses, masks, strict=True)])
    counts = torch.stack([mask.sum() for mask in masks])
    if mode == "token-mean":
        loss = sums.sum() / counts.sum()
    elif mode == "sequence-mean-token-mean":
        loss = (sums / counts).sum() / len(rows)
    else:
        loss = sums.sum() / len(rows)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_every_mode_of_a_packed_step_over_two_ranks_equals_the_unpacked_step(tmp_path):
    plan = the_plan(rollouts())
    assert plan.micro_batches >= 2 and (plan.sequences.sum(axis=1) > 0).all()  # several per rank
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=RANKS, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(RANKS)]
    for mode in LOSS_MODES:
        loss, gradients = unpacked(mode)
        for results in ranks:
            got_loss, got_gradients = results[(mode, False)]
            assert abs(float(got_loss - loss)) <= 1e-12 * abs(float(loss)), mode
            for got, expected in zip(got_gradients, gradients, strict=True):
                assert (got - expected).abs().max() <= 1e-12 * max(expected.abs().max(), 1e-3), mode
            local_loss, local_gradients = results[(mode, True)]
            worst = max(
                float((got - expected).abs().max())
                for got, expected in zip(local_gradients, gradients, strict=True)
            )
            assert worst > 1e-6 and abs(float(local_loss - loss)) > 1e-6, f"{mode}: local denominators agree"


def test_untrained_positions_may_hold_any_value_and_labels_may_stand_for_the_mask():
    rows = [
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "position_ids": torch.arange(3),
            "loss_mask": torch.tensor([1, 1, 0]),
        },
        {
            "input_ids": torch.tensor([8, 9]),
            "position_ids": torch.arange(2),
            "loss_mask": torch.tensor([1, 0]),
        },
    ]
    batch = build_thd_from_rows(rows)
    step = LossDenominators(tokens=3, sequences=2)
    finite = torch.tensor([[2.0, 4.0, 0.0, 6.0, 0.0]], dtype=torch.float64, requires_grad=True)
    wild = torch.tensor(
        [[2.0, 4.0, float("inf"), 6.0, float("nan")]], dtype=torch.float64, requires_grad=True
    )
    labelled = {key: value for key, value in batch.items() if key != "loss_mask"}
    labelled["labels"] = torch.where(batch["loss_mask"] > 0, batch["input_ids"], -100)
    for mode in LOSS_MODES:
        expected = packed_step_loss(finite, batch, step, mode=mode)
        got = packed_step_loss(wild, batch, step, mode=mode)
        assert torch.isfinite(got) and got == expected
        assert packed_step_loss(finite, labelled, step, mode=mode) == expected
        (gradient,) = torch.autograd.grad(got, wild)
        assert torch.isfinite(gradient).all() and gradient[0, 2] == 0 and gradient[0, 4] == 0
    bare = {key: value for key, value in batch.items() if key != "loss_mask"}
    with pytest.raises(TightpackError, match="neither loss_mask nor labels"):
        packed_step_loss(finite, bare, step)
