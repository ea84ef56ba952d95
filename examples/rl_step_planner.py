"""A plain PyTorch RL-style loop on two data-parallel ranks (gloo, CPU) with tightpack's per-step planner.

Every step each rank "generates" rollouts (random here: groups of completions of very different
lengths for a few prompts, with rewards), the ranks all-gather them, every rank plans the whole step
alike (`plan_step`: ranks balanced by a cost model, groups whole on one rank, micro-batches under a
token budget, the same count on every rank) and trains on its share: a policy-gradient loss per token
(advantage times log-probability), normalized over the whole step (`packed_step_loss`, token-mean),
gradients accumulated over its micro-batches and averaged over the ranks.

Run it: ``python examples/rl_step_planner.py`` (about ten seconds on two CPU cores). It prints each
step's loss, micro-batches per rank and how far the slowest rank is over the mean.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tightpack.core.step_planner import plan_step
from tightpack.runtime.hf import packed_forward
from tightpack.runtime.in_batch import build_thd_from_rows
from tightpack.runtime.step_loss import packed_step_loss

RANKS, STEPS, VOCAB = 2, 2, 64
PADDING = {  # one token with nothing to learn: the row of an empty micro-batch
    "input_ids": torch.zeros(1, dtype=torch.int64),
    "position_ids": torch.zeros(1, dtype=torch.int64),
    "loss_mask": torch.zeros(1, dtype=torch.int64),
    "advantage": torch.zeros(1),
}
PROMPTS_PER_RANK, GROUP = 2, 4  # each prompt gets GROUP completions: a GRPO group


def generate(rank: int, step: int) -> list[dict]:
    """This rank's rollouts of the step: prompt + completion tokens, the completion's loss mask, the
    group (its prompt) and the advantage (reward minus the group's mean)."""
    rng = np.random.default_rng(1000 * step + rank)
    rollouts = []
    for prompt_index in range(PROMPTS_PER_RANK):
        prompt = rng.integers(0, VOCAB, int(rng.integers(4, 24)))
        rewards = rng.random(GROUP)
        for completion_index in range(GROUP):
            completion = rng.integers(0, VOCAB, int(min(rng.pareto(1.0) * 8 + 1, 120)))
            tokens = np.concatenate([prompt, completion])
            mask = np.zeros(len(tokens), dtype=np.int64)
            mask[len(prompt) - 1 : -1] = 1  # label-aligned: the positions that predict the completion
            rollouts.append(
                {
                    "tokens": tokens,
                    "mask": mask,
                    "group": (rank, prompt_index),
                    "advantage": float(rewards[completion_index] - rewards.mean()),
                }
            )
    return rollouts


def train(rank: int, store: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, RANKS), rank=rank, world_size=RANKS)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **sizes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        everyone: list = [None] * RANKS
        dist.all_gather_object(everyone, generate(rank, step))  # the step's rollouts, every rank's
        rollouts = [rollout for share in everyone for rollout in share]
        groups = {group: index for index, group in enumerate(sorted({r["group"] for r in rollouts}))}
        plan = plan_step(
            [len(r["tokens"]) for r in rollouts],
            RANKS,
            max_tokens=256,
            supervised=[int(r["mask"].sum()) for r in rollouts],
            groups=[groups[r["group"]] for r in rollouts],
            cost_model="llama-1b",
        )  # the same plan on every rank: take this rank's micro-batches
        total = torch.zeros(())
        for indices in plan.rank_batches(rank):
            rows = [
                {
                    "input_ids": torch.from_numpy(rollouts[i]["tokens"]),
                    "position_ids": torch.arange(len(rollouts[i]["tokens"])),
                    "loss_mask": torch.from_numpy(rollouts[i]["mask"]),
                    "advantage": torch.full((len(rollouts[i]["tokens"]),), rollouts[i]["advantage"]),
                }
                for i in indices.tolist()
            ] or [PADDING]  # an empty micro-batch still runs a forward: FSDP or TP would hang without it
            batch = build_thd_from_rows(rows, sequence_tensor_pad_values={"advantage": 0.0})
            logits = packed_forward(model, batch, probe=False).logits[0]
            targets = torch.roll(batch["input_ids"][0], -1)
            logps = -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            per_token = (
                -batch["advantage"][0] * logps
            )  # policy gradient: raise the log-probability of good tokens
            loss = packed_step_loss(per_token, batch, plan.loss_denominators, data_parallel_size=RANKS)
            loss.backward()
            total += loss.detach() / RANKS
        for parameter in model.parameters():  # what DDP does: average the gradients over the ranks
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
                parameter.grad /= RANKS
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"step {step}: loss {float(total):+.5f}, {plan.micro_batches} micro-batches per rank, "
                f"slowest rank {plan.straggler_overhead:.2%} over the mean, "
                f"{plan.empty_micro_batches} empty micro-batches"
            )
    dist.destroy_process_group()


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(train, args=(os.path.join(folder, "store"),), nprocs=RANKS, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
