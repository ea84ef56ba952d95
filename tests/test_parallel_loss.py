"""Per-token loss under DP=2 and CP=2 (2 processes, gloo) equals one unpacked process on the same tokens.

The packs come from the three packing paths: the in-batch builder, the online packer and the offline
files read back through `PackedDataset` and `PackedCollate`. The reference runs every sample alone
with plain causal attention and takes the mean over all supervised tokens. The same spawn checks the
unpacked per-sequence zigzag against Megatron-Core's ``get_batch_on_this_cp_rank`` on a gloo group.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tightpack.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.runtime.adapters import physical_boundaries
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.context_parallel import cp_attention, slice_for_cp_rank, thd_partition_indices
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.in_batch import pack_samples
from tightpack.runtime.loss import finalize_per_token_grads, global_mean_loss, masked_token_loss, token_losses
from tightpack.runtime.masks import sdpa_mask
from tightpack.runtime.online import OnlinePacker

VOCAB, DIM, HEADS = 97, 8, 2


class TinyLM(torch.nn.Module):
    """Embeddings, one attention block with a pluggable attention, an LM head; float64."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.positions = torch.nn.Embedding(256, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        for parameter in self.parameters():
            torch.nn.init.normal_(parameter, std=0.5, generator=generator)
        self.double()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        x = self.embed(tokens[0] % VOCAB) + self.positions(positions[0])
        q, k, v = self.qkv(x).view(len(x), 3, HEADS, DIM // HEADS).permute(1, 2, 0, 3)
        x = x + self.out(attend(q, k, v).transpose(0, 1).reshape(len(x), DIM))
        return self.head(x)[None]


def causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def tokens_of(batch: dict) -> torch.Tensor:
    return batch["input_ids"] if "input_ids" in batch else batch["tokens"]


def loss_of(model: TinyLM, tokens, positions, labels, mask, attend) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.where(labels >= 0, labels % VOCAB, labels)
    return masked_token_loss(token_losses(model(tokens, positions, attend), labels), mask)


def samples_of(batch: dict) -> list[tuple[torch.Tensor, ...]]:
    """Every real sequence of a packed row: (tokens, labels, loss_mask), each ``[1, n]``."""
    logical = batch["cu_seqlens_q"].flatten().tolist()
    starts = physical_boundaries(batch).tolist()
    keys = ("tokens" if "tokens" in batch else "input_ids", "labels", "loss_mask")
    return [
        tuple(batch[key][:, start : start + end - begin] for key in keys)
        for begin, end, start in zip(logical[:-1], logical[1:], starts, strict=False)
        if end > begin
    ]


def reference(packs: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, no packing: every sample alone, mean over all supervised tokens."""
    model = TinyLM()
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for pack in packs:
        for tokens, labels, mask in samples_of(pack):
            positions = torch.arange(tokens.shape[1])[None]
            loss_sum, supervised = loss_of(model, tokens, positions, labels, mask, causal)
            loss_sum.backward()
            total, count = total + loss_sum.detach(), count + supervised
    for parameter in model.parameters():
        parameter.grad /= max(int(count), 1)
    return float(total / count), {name: p.grad.clone() for name, p in model.named_parameters()}


def packed_step(micro_batches: list[dict], cp_size: int, rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step over this rank's micro-batches, per-token loss, reduced over the world."""
    model = TinyLM()
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for batch in micro_batches:
        if cp_size > 1:
            boundaries = physical_boundaries(batch)
            index = thd_partition_indices(boundaries, cp_size, rank)
            batch = slice_for_cp_rank(batch, cp_size, rank)

            def attend(q, k, v, index=index, boundaries=boundaries):
                return cp_attention(q, k, v, index=index, boundaries=boundaries)
        else:
            mask = sdpa_mask(batch)[0]

            def attend(q, k, v, mask=mask):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        loss_sum, supervised = loss_of(
            model, tokens_of(batch), batch["position_ids"], batch["labels"], batch["loss_mask"], attend
        )
        loss_sum.backward()  # a sum, never a mean: ranks and micro-batches weigh by their tokens
        total, count = total + loss_sum.detach(), count + supervised
    finalize_per_token_grads(model.parameters(), count)
    loss = global_mean_loss(total, count)
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}


def megatron_oracle(rank: int) -> dict[str, bool]:
    from megatron.core.utils import get_batch_on_this_cp_rank

    generator = torch.Generator().manual_seed(5)
    batch = {
        "tokens": torch.randint(0, 50, (2, 8), generator=generator),
        "labels": torch.randint(0, 50, (2, 8), generator=generator),
        "loss_mask": torch.randint(0, 2, (2, 8), generator=generator).float(),
        "position_ids": torch.arange(8).repeat(2, 1),
        "attention_mask": torch.rand(2, 1, 8, 8, generator=generator) > 0.5,
    }
    ours = slice_for_cp_rank(batch, 2, rank)
    theirs = get_batch_on_this_cp_rank(
        {key: value.clone() for key, value in batch.items()}, cp_group=dist.group.WORLD
    )
    return {key: torch.equal(ours[key], theirs[key]) for key in batch}


def worker(rank: int, store: str, out: str, scenarios: dict) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        results = {"oracle": megatron_oracle(rank)}
        for name, (cp_size, per_rank) in scenarios.items():
            results[name] = packed_step(per_rank[rank], cp_size, rank)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def make_samples(count: int, seed: int) -> list[dict]:
    """Prompt (unsupervised) then answer (supervised) of random lengths; labels are the next token."""
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(count):
        prompt, answer = int(rng.integers(1, 8)), int(rng.integers(1, 10))
        stream = torch.from_numpy(rng.integers(0, VOCAB, prompt + answer + 1))
        mask = torch.cat([torch.zeros(prompt), torch.ones(answer)])
        samples.append({"key": index, "input_ids": stream[:-1], "labels": stream[1:], "loss_mask": mask})
    return samples


def offline_packs(tmp_path: Path, samples: list[dict]) -> list[dict]:
    rows = [
        {"input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].int().tolist()} for s in samples
    ]
    config = PackConfig(packed_sequence_size=48, pad_seq_to_mult=4, format=FormatConfig(format="tokens"),
                        pad_to_max_length=True, workers=1)  # fmt: skip
    pack_dataset(rows, tmp_path / "packed", config)
    dataset = PackedDataset(tmp_path / "packed", cache_dir=tmp_path / "cache")
    collate = PackedCollate(pack_size=48, eos_id=50256, pad_to_max_length=True, pad_seq_to_mult=4)
    return [collate([dataset[i]]) for i in range(len(dataset))]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_dp2_and_cp2_match_one_unpacked_process(tmp_path):
    pytest.importorskip("megatron.core")
    samples = make_samples(24, seed=1)
    in_batch = [pack_samples(samples[i : i + 3], pad_to_multiple_of=4) for i in range(0, 9, 3)]
    online = list(OnlinePacker(lambda start, stride: iter(samples[9 + start : 18 : stride]), pack_size=40,
                               packing_buffer_size=4, pad_to_multiple_of=4))  # fmt: skip
    offline = offline_packs(tmp_path, samples[18:])
    packs = in_batch + online + offline
    silent = pack_samples([dict(samples[0], loss_mask=torch.zeros(len(samples[0]["input_ids"])))],
                          pad_to_multiple_of=4)  # fmt: skip
    # Supervised only in chunks 0 and 3 of its single 8-token segment: CP rank 1 holds none of it.
    ids = torch.arange(8)
    rank0_only = pack_samples(
        [{"input_ids": ids, "labels": ids + 1, "loss_mask": torch.tensor([1.0, 1, 0, 0, 0, 0, 1, 1])}]
    )
    scenarios = {
        "dp": (1, [packs[0::2], packs[1::2]]),
        "dp_silent_rank": (1, [packs, [silent]]),
        "cp": (2, [[*packs, rank0_only], [*packs, rank0_only]]),
        "cp_silent_shard": (2, [[rank0_only], [rank0_only]]),
    }
    expected = {
        "dp": reference(packs),
        "dp_silent_rank": reference([*packs, silent]),
        "cp": reference([*packs, rank0_only]),
        "cp_silent_shard": reference([rank0_only]),
    }
    assert len(online) > 1 and len(offline) > 1 and {"tokens", "input_ids"} <= {k for p in packs for k in p}

    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path), scenarios), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(results["oracle"].values()), results["oracle"]
        for name, (loss, grads) in expected.items():
            got_loss, got_grads = results[name]
            assert abs(got_loss - loss) <= 1e-5, (name, got_loss, loss)
            worst = max(float((got_grads[key] - grads[key]).abs().max()) for key in grads)
            assert worst <= 1e-5, (name, worst)
