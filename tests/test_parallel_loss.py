"""Per-token loss under DP=2 and CP=2 (2 processes, gloo) equals one unpacked process on the original samples.

The packs come from the three packing paths: the in-batch builder, the online packer and the offline
files read back through `PackedDataset` and `PackedCollate`. The reference never looks at a pack: it
runs every original sample (the packers' input: tokens, labels, loss mask) alone with plain causal
attention, in float64, and takes the mean over all supervised tokens. Packs are tied back to the
samples by key (the online packer's ``keys``, the offline ``sample_index`` column, the in-batch
member order) and every sample must sit in exactly one pack, with its own tokens, labels and mask.

`packed_vs_original` measures the largest per-token deviation of the packed forward from the
unpacked one; the negative controls show it does see a corrupted pack and attention that crosses
sequences. The same spawn checks the unpacked per-sequence zigzag against Megatron-Core's
``get_batch_on_this_cp_rank`` on a gloo group.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.runtime import thd
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.context_parallel import cp_attention, slice_for_cp_rank, thd_partition_indices
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.in_batch import pack_samples
from tightpack.runtime.loss import finalize_per_token_grads, global_mean_loss, masked_token_loss, token_losses
from tightpack.runtime.masks import sdpa_mask
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker
from tightpack.runtime.thd import physical_boundaries

VOCAB, DIM, HEADS = 97, 8, 2
EOS = 50256  # the built-in GPT-2 tokenizer's, appended by the offline pipeline; VOCAB folds it to 10
TOLERANCE = 1e-12  # float64 end to end: observed deviations are below 1e-15
CAUGHT = 1e-3  # what a negative control must exceed


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


def block_causal(pack: dict) -> Callable:
    """Attention within the pack's physical segments only."""
    mask = sdpa_mask(pack)[0]

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def tokens_of(batch: dict) -> torch.Tensor:
    return batch["input_ids"] if "input_ids" in batch else batch["tokens"]


def per_token_losses(model: TinyLM, tokens, positions, labels, attend) -> torch.Tensor:
    labels = torch.where(labels >= 0, labels % VOCAB, labels)
    return token_losses(model(tokens, positions, attend), labels)


def alone(model: TinyLM, sample: dict) -> torch.Tensor:
    """Per-token losses ``[1, n]`` of an original sample run on its own, plain causal attention."""
    tokens, labels = sample["input_ids"][None], sample["labels"][None]
    return per_token_losses(model, tokens, torch.arange(tokens.shape[1])[None], labels, causal)


# -- the original samples and their packs ---------------------------------------------------------------


def make_samples(count: int, seed: int) -> list[dict]:
    """Prompt (unsupervised) then answer (supervised, at least 2 tokens) of random lengths; the labels
    are the next tokens, then EOS: the training example the offline pipeline makes of the same tokens
    (it appends EOS, and supervises it when the last token is supervised)."""
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(count):
        prompt, answer = int(rng.integers(1, 8)), int(rng.integers(2, 10))
        tokens = torch.from_numpy(rng.integers(0, VOCAB, prompt + answer))
        labels = torch.cat([tokens[1:], torch.tensor([EOS])])
        mask = torch.cat([torch.zeros(prompt), torch.ones(answer)])
        samples.append({"key": index, "input_ids": tokens, "labels": labels, "loss_mask": mask})
    return samples


def pretokenized_row(sample: dict) -> dict:
    """The sample as a ``--format tokens`` row: its tokens and a mask over tokens (1 = learned as a
    target). Label ``t`` is token ``t + 1``, so the row's mask is the label mask moved one to the right;
    the last label (the appended EOS) is supervised with the last token."""
    mask = sample["loss_mask"].int().tolist()
    assert mask[-1] == mask[-2], "the tokens format supervises EOS exactly when the last token is"
    return {"input_ids": sample["input_ids"].tolist(), "loss_mask": [0, *mask[:-1]]}


def in_batch_packs(samples: list[dict], per_pack: int) -> list[dict]:
    groups = [samples[i : i + per_pack] for i in range(0, len(samples), per_pack)]
    return [dict(pack_samples(g, pad_to_multiple_of=4), keys=[s["key"] for s in g]) for g in groups]


def online_packs(samples: list[dict]) -> list[dict]:
    # The only use of OnlinePacker here: a source(start, stride), the config, and each pack's keys.
    config = OnlinePackConfig(pack_size=40, packing_buffer_size=4, pad_to_multiple_of=4)
    return list(OnlinePacker(lambda start, stride: iter(samples[start::stride]), config))


def offline_packs(tmp_path: Path, samples: list[dict]) -> list[dict]:
    """Packed by `pack_dataset`, read by `PackedDataset` + `PackedCollate`; keys from ``sample_index``."""
    config = PackConfig(packed_sequence_size=48, pad_seq_to_mult=4, format=FormatConfig(format="tokens"),
                        pad_to_max_length=True, workers=1)  # fmt: skip
    pack_dataset([pretokenized_row(s) for s in samples], tmp_path / "packed", config)
    dataset = PackedDataset(tmp_path / "packed", cache_dir=tmp_path / "cache")
    sources = pq.read_table(sorted((tmp_path / "packed").glob("*.parquet")), columns=["sample_index"])
    rows = sources.column("sample_index").to_pylist()
    assert len(rows) == len(dataset)
    collate = PackedCollate(pack_size=48, eos_id=EOS, pad_to_max_length=True, pad_seq_to_mult=4)
    return [
        dict(collate([dataset[i]]), keys=[samples[j]["key"] for j in indices])
        for i, indices in enumerate(rows)
    ]


@dataclass
class Packed:
    """The packs of every path, and the original samples behind them."""

    samples: list[dict]
    packs: list[dict]
    paths: list[str]  # the packing path of every pack
    silent: tuple[dict, dict]  # (sample, pack): nothing supervised
    rank0_only: tuple[dict, dict]  # supervised only in chunks 0 and 3 of its 8 tokens: CP rank 1 holds none


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Packed:
    samples = make_samples(24, seed=1)
    in_batch = in_batch_packs(samples[:9], per_pack=3)
    online = online_packs(samples[9:18])
    offline = offline_packs(tmp_path_factory.mktemp("offline"), samples[18:])
    assert len(online) > 1 and len(offline) > 1
    silent = dict(samples[0], key="silent", loss_mask=torch.zeros(len(samples[0]["input_ids"])))
    ids = torch.arange(8)
    rank0_only = {"key": "rank0_only", "input_ids": ids, "labels": ids + 1,
                  "loss_mask": torch.tensor([1.0, 1, 0, 0, 0, 0, 1, 1])}  # fmt: skip
    return Packed(
        samples,
        in_batch + online + offline,
        ["in_batch"] * len(in_batch) + ["online"] * len(online) + ["offline"] * len(offline),
        (silent, in_batch_packs([silent], per_pack=1)[0]),
        (rank0_only, dict(pack_samples([rank0_only]), keys=["rank0_only"])),
    )


# -- packs against the original samples ---------------------------------------------------------------


def segments_of(pack: dict) -> list[tuple[int, int]]:
    """``(physical start, real length)`` of every non-empty sequence of a packed row, in order."""
    logical = pack["cu_seqlens_q"].flatten().tolist()
    starts = physical_boundaries(pack).tolist()
    return [
        (start, end - begin)
        for begin, end, start in zip(logical[:-1], logical[1:], starts, strict=False)
        if end > begin
    ]


def coverage_problems(packs: list[dict], samples: list[dict]) -> list[str]:
    """What is wrong with the claim that ``packs`` hold every sample exactly once, as it was."""
    by_key = {sample["key"]: sample for sample in samples}
    seen: Counter = Counter()
    problems = []
    for number, pack in enumerate(packs):
        segments = segments_of(pack)
        if len(segments) != len(pack["keys"]):
            problems.append(f"pack {number}: {len(segments)} sequences for {len(pack['keys'])} keys")
        for key, (start, length) in zip(pack["keys"], segments, strict=False):  # counts checked above
            seen[key] += 1
            sample = by_key.get(key)
            if sample is None:
                problems.append(f"pack {number}: key {key!r} is no original sample")
                continue
            if length != len(sample["input_ids"]):
                problems.append(
                    f"pack {number}: sample {key!r} holds {length} tokens, not {len(sample['input_ids'])}"
                )
                continue
            for name, value in (
                ("input_ids", tokens_of(pack)),
                ("labels", pack["labels"]),
                ("loss_mask", pack["loss_mask"]),
            ):
                if not torch.equal(value[0, start : start + length].double(), sample[name].double()):
                    problems.append(f"pack {number}: sample {key!r} has other {name}")
    problems += [f"sample {key!r} is in {seen[key]} packs" for key in by_key if seen[key] != 1]
    return problems


def packed_vs_original(
    packs: list[dict], samples: list[dict], *, attention: str = "block"
) -> tuple[float, list[str]]:
    """Largest per-token loss deviation, over supervised tokens, of the packed forward (attention
    ``block``: within segments; ``crossing``: one causal mask over the whole row) from every original
    sample run alone, and the coverage problems of the packs."""
    model = TinyLM()
    by_key = {sample["key"]: sample for sample in samples}
    deviation = 0.0
    with torch.no_grad():
        for pack in packs:
            attend = block_causal(pack) if attention == "block" else causal
            losses = per_token_losses(model, tokens_of(pack), pack["position_ids"], pack["labels"], attend)[0]
            for key, (start, length) in zip(pack["keys"], segments_of(pack), strict=False):
                sample = by_key.get(key)
                if sample is None or length != len(sample["input_ids"]):
                    continue  # a coverage problem
                gap = (losses[start : start + length] - alone(model, sample)[0]).abs()
                deviation = max(deviation, float(gap.where(sample["loss_mask"].bool(), 0.0).max()))
    return deviation, coverage_problems(packs, samples)


def test_every_original_sample_is_packed_once_with_its_unpacked_losses(packed):
    extra = [packed.silent, packed.rank0_only]
    deviation, problems = packed_vs_original(
        [*packed.packs, *(pack for _, pack in extra)], [*packed.samples, *(sample for sample, _ in extra)]
    )
    assert problems == []
    assert deviation <= TOLERANCE


def drop_last_member(pack: dict, samples: list[dict]) -> dict:
    """The pack a packer that lost its last member would emit (that member's key gone with it)."""
    members = [next(s for s in samples if s["key"] == key) for key in pack["keys"][:-1]]
    return dict(pack_samples(members, pad_to_multiple_of=4), keys=pack["keys"][:-1])


def uneven_neighbours(pack: dict) -> int | None:
    """``i`` such that sequences ``i - 1`` and ``i`` of the pack differ in length, if any."""
    lengths = pack["cu_seqlens_q"].flatten().diff().tolist()
    return next((i for i in range(1, len(lengths)) if lengths[i] and lengths[i] != lengths[i - 1]), None)


def swap_boundaries(pack: dict) -> dict:
    """The lengths of two neighbouring sequences of different lengths exchanged in the boundaries
    (``_q`` and ``_kv``, logical and padded alike); tokens left in place. A consistent batch, so the
    THD validator lets it through to the test's own checks."""
    i = uneven_neighbours(pack)
    swapped = dict(pack)
    for q, kv in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        if pack.get(q) is None:
            continue
        bounds = pack[q].flatten().clone()
        bounds[i] = bounds[i - 1] + bounds[i + 1] - bounds[i]
        swapped[q] = bounds.view(pack[q].shape)
        if pack.get(kv) is not None:
            swapped[kv] = swapped[q]
    return swapped


def corrupt_label(pack: dict) -> dict:
    """One supervised label of the second sequence changed."""
    start, _ = segments_of(pack)[1]
    labels = pack["labels"].clone()
    position = start + int(torch.nonzero(pack["loss_mask"][0, start:])[0, 0])
    labels[0, position] = (labels[0, position] + 1) % VOCAB
    return dict(pack, labels=labels)


CORRUPTIONS = {  # name: (corrupt a pack, seen by the losses too, not only by the coverage check)
    "label": (lambda pack, samples: corrupt_label(pack), True),
    "dropped": (drop_last_member, False),
    "boundaries": (lambda pack, samples: swap_boundaries(pack), False),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupted_pack_is_caught(packed, corruption):
    """Negative control: one corrupted pack of each path is a coverage problem and, for a changed label,
    a loss deviation far above the tolerance (a missing sample or cut has no packed losses to compare)."""
    corrupt, in_losses = CORRUPTIONS[corruption]
    for path in ("in_batch", "online", "offline"):
        number = next(  # a pack with two sequences of different lengths: every corruption changes it
            i for i, p in enumerate(packed.packs) if packed.paths[i] == path and uneven_neighbours(p)
        )
        changed = corrupt(packed.packs[number], packed.samples)
        packs = [changed if i == number else p for i, p in enumerate(packed.packs)]
        with thd.checking(False):  # the THD validator refuses some of these; this test's own checks must too
            deviation, problems = packed_vs_original(packs, packed.samples)
        assert problems, (path, corruption)
        assert deviation > CAUGHT if in_losses else deviation <= TOLERANCE, (path, deviation)


def test_attention_crossing_sequences_is_caught(packed):
    """Negative control: the same packs with one causal mask over the whole row (positions still reset
    per sequence) deviate from the unpacked losses by far more than the tolerance."""
    deviation, problems = packed_vs_original(packed.packs, packed.samples, attention="crossing")
    assert problems == [] and deviation > CAUGHT


# -- DP=2 and CP=2 against one unpacked process ---------------------------------------------------------


def reference(samples: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, no packing: every original sample alone, mean over all supervised tokens."""
    model = TinyLM()
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for sample in samples:
        loss_sum, supervised = masked_token_loss(alone(model, sample), sample["loss_mask"][None])
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
            attend = block_causal(batch)

        losses = per_token_losses(model, tokens_of(batch), batch["position_ids"], batch["labels"], attend)
        loss_sum, supervised = masked_token_loss(losses, batch["loss_mask"])
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


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_dp2_and_cp2_match_one_unpacked_process(packed, tmp_path):
    pytest.importorskip("megatron.core")
    packs, samples = packed.packs, packed.samples
    (silent, silent_pack), (rank0_only, rank0_pack) = packed.silent, packed.rank0_only
    assert {"tokens", "input_ids"} <= {key for pack in packs for key in pack}
    scenarios = {  # name: (cp_size, micro-batches of each rank), with the original samples they hold
        "dp": (1, [packs[0::2], packs[1::2]], samples),
        "dp_silent_rank": (1, [packs, [silent_pack]], [*samples, silent]),
        "cp": (2, [[*packs, rank0_pack], [*packs, rank0_pack]], [*samples, rank0_only]),
        "cp_silent_shard": (2, [[rank0_pack], [rank0_pack]], [rank0_only]),
    }
    for name, (cp_size, per_rank, originals) in scenarios.items():
        held = per_rank[0] + per_rank[1] if cp_size == 1 else per_rank[0]  # CP ranks share their packs
        assert coverage_problems(held, originals) == [], name

    runs = {name: (cp_size, per_rank) for name, (cp_size, per_rank, _) in scenarios.items()}
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path), runs), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(results["oracle"].values()), results["oracle"]
        for name, (_, _, originals) in scenarios.items():
            loss, grads = reference(originals)
            got_loss, got_grads = results[name]
            assert_close(got_loss, loss, f"{name}: the loss")
            for key, grad in grads.items():
                assert_close(got_grads[key], grad, f"{name}: the gradient of {key}")


def assert_close(got, want, what: str) -> None:
    torch.testing.assert_close(
        got, want, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda message: f"{what}: {message}"
    )
