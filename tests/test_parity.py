"""Parity: a packed step computes what the unpacked steps compute (tiny Llama, random weights).

Batches come from the real offline pipeline on a slice of the demo corpus, through the collate and
the transformers adapter. Per-token losses and gradients of the summed supervised loss must agree
within 1e-5, with eager and sdpa attention, without and with alignment, and at fixed width.

Negative controls: the same packed batches with one causal mask over the whole row (positions still
restarting per sequence, so only the attention changes) must miss the unpacked losses by more than
1e-3, so a parity check that cannot fail is caught.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.hf import packed_forward

from .conftest import write_jsonl

PACK_SIZE = 256
EOS = 50256
CAUGHT = 1e-3  # what attention crossing sequences must change a per-token loss by, at least


@pytest.fixture(scope="module")
def demo_slice(tmp_path_factory) -> list[dict]:
    rows = next(default_corpus().read(0, 60)).parsed_rows()
    folder = tmp_path_factory.mktemp("parity")
    return write_jsonl(folder / "slice.jsonl", rows)


def packed_rows(source, tmp_path, multiple: int) -> list[dict]:
    # Samples capped at half a pack: packs hold 3 to 5 sequences, truncated ones (rounds dropped) among them.
    config = PackConfig(
        packed_sequence_size=PACK_SIZE, max_seq_length=PACK_SIZE // 2, pad_seq_to_mult=multiple, workers=1
    )
    pack_dataset([source], tmp_path / "out", config)
    return pq.read_table(next((tmp_path / "out").glob("*.parquet"))).to_pylist()


def tiny_llama(attention: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=PACK_SIZE, attn_implementation=attention,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")


def crossing_forward(model, batch: dict):
    """The packed row with one causal mask over the whole row: attention crosses sequences, positions
    still restart per sequence. A float additive 4-D mask, which eager and sdpa both take as given."""
    width = batch["tokens"].shape[1]
    allowed = torch.ones(width, width, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, width, width).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return model(
        input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=mask, use_cache=False
    )


def sequence_deviations(packed: torch.Tensor, starts: list[int], pieces) -> list[float]:
    """Largest |packed - unpacked| per-token loss of every sequence; ``starts`` are their physical
    starts in the packed row, ``pieces`` their unpacked ``(losses, mask)``."""
    return [
        float((packed[start : start + len(losses)] - losses).abs().max())
        for (losses, _), start in zip(pieces, starts, strict=False)
    ]


def physical_starts(batch: dict) -> list[int]:
    return batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).flatten().tolist()[:-1]


def most_sequences(rows: list[dict], count: int) -> list[dict]:
    return sorted(rows, key=lambda row: -len(row["seq_start_id"]))[:count]


def unpacked_losses(model, row: dict) -> list[torch.Tensor]:
    """Per-token loss and mask of every sequence of a stored row, each run on its own."""
    ids = torch.tensor(row["input_ids"])
    results = []
    for start, runtime in zip(row["seq_start_id"], row["seq_len"], strict=True):
        real = start + runtime + 1  # end of the sequence's real stored tokens (alignment padding excluded)
        inputs, labels = ids[start : real - 1], ids[start + 1 : real]
        mask = torch.tensor(row["loss_mask"][start : real - 1], dtype=torch.float32)
        logits = model(input_ids=inputs[None], use_cache=False).logits[0]
        results.append((token_losses(logits, labels), mask))
    return results


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize(("multiple", "fixed_width"), [(1, False), (4, False), (4, True)])
def test_packed_loss_and_gradients_equal_unpacked(demo_slice, tmp_path, attention, multiple, fixed_width):
    rows = packed_rows(demo_slice, tmp_path, multiple)
    collate = PackedCollate(
        pack_size=PACK_SIZE, eos_id=EOS, pad_seq_to_mult=multiple, pad_to_max_length=fixed_width
    )
    model = tiny_llama(attention)
    checked = 0
    rows = most_sequences(rows, 3)
    assert min(len(row["seq_start_id"]) for row in rows) >= 3
    for row in rows:
        batch = collate([row])
        model.zero_grad()
        logits = packed_forward(model, batch).logits[0]
        packed = token_losses(logits, batch["labels"][0])
        mask = batch["loss_mask"][0].float()
        (packed * mask).sum().backward()
        packed_grads = [p.grad.clone() for p in model.parameters()]

        model.zero_grad()
        pieces = unpacked_losses(model, row)
        sum(float_loss.mul(piece_mask).sum() for float_loss, piece_mask in pieces).backward()
        # Real tokens of each physical segment, in order, are where the unpacked sequences sit.
        for (losses, piece_mask), start in zip(pieces, physical_starts(batch), strict=False):
            n = len(losses)
            assert torch.equal(mask[start : start + n], piece_mask)
            torch.testing.assert_close(packed[start : start + n], losses, atol=1e-5, rtol=0)
            checked += n
        for packed_grad, parameter in zip(packed_grads, model.parameters(), strict=True):
            torch.testing.assert_close(packed_grad, parameter.grad, atol=1e-5, rtol=0)
        unpacked_mean = sum(loss.mul(m).sum() for loss, m in pieces) / sum(m.sum() for _, m in pieces)
        # The two means sum ~1,000 float32 losses in different orders: a few ulps (~1e-6 at 10.8) apart.
        torch.testing.assert_close((packed * mask).sum() / mask.sum(), unpacked_mean, atol=1e-6, rtol=1e-6)
    assert checked > 500


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_crossing_sequences_fails_the_offline_parity(demo_slice, tmp_path, attention):
    """Negative control of the test above (aligned packs): with one causal mask over the row, the first
    sequence of a pack still matches (nothing before it to attend to) and a later one does not."""
    rows = most_sequences(packed_rows(demo_slice, tmp_path, 4), 3)
    collate = PackedCollate(pack_size=PACK_SIZE, eos_id=EOS, pad_seq_to_mult=4)
    model = tiny_llama(attention)
    with torch.no_grad():
        for row in rows:
            batch = collate([row])
            packed = token_losses(crossing_forward(model, batch).logits[0], batch["labels"][0])
            first, *later = sequence_deviations(packed, physical_starts(batch), unpacked_losses(model, row))
            assert first <= 1e-5 and max(later) > CAUGHT, (first, later)


def test_unsafe_calls_are_refused(demo_slice, tmp_path):
    rows = packed_rows(demo_slice, tmp_path, 1)
    batch = PackedCollate(pack_size=PACK_SIZE, eos_id=EOS)([rows[0]])
    model = tiny_llama("sdpa")
    with pytest.raises(TightpackError, match="use_cache=True on a packed row"):
        packed_forward(model, batch, use_cache=True)
    with pytest.raises(TightpackError, match="2-D attention_mask"):
        packed_forward(model, batch, attention_mask=torch.ones_like(batch["tokens"]))
    with pytest.raises(TightpackError, match=r"one packed row \(\[1, T\] tokens\)"):
        packed_forward(model, PackedCollate(pack_size=PACK_SIZE, eos_id=EOS)(rows[:2]))


def test_padding_rows_add_nothing_to_the_loss_or_its_denominator(demo_slice, tmp_path):
    from tightpack.runtime.dataset import PackedDataset

    packed_rows(demo_slice, tmp_path, 1)
    dataset = PackedDataset(tmp_path / "out", cache_dir=tmp_path / "cache")
    collate = PackedCollate(pack_size=PACK_SIZE, eos_id=EOS)
    model = tiny_llama("sdpa")

    def totals(indices):
        loss, count = torch.zeros(()), torch.zeros(())
        with torch.no_grad():
            for index in indices:  # one micro-batch per pack, as with offline packing
                batch = collate([dataset[index]])
                mask = batch["loss_mask"][0].float()
                loss += (
                    token_losses(packed_forward(model, batch).logits[0], batch["labels"][0]) * mask
                ).sum()
                count += mask.sum()
        return loss, count

    real_loss, real_count = totals([0, 1])
    padded_loss, padded_count = totals([0, 1, -1, -2])  # the sampler's -1 padding of a last global batch
    assert real_count > 0 and padded_count == real_count
    torch.testing.assert_close(padded_loss, real_loss, atol=0, rtol=0)


def in_batch_case(demo_slice, tmp_path) -> tuple[list[dict], dict, dict]:
    """Six unpacked samples (shifted labels, label-aligned mask) that get an alignment tail at m = 4,
    packed at collate time (contract 3.1): the samples, the packed row, and its model batch."""
    from tightpack.runtime.in_batch import build_thd_from_rows

    rows = packed_rows(demo_slice, tmp_path, 1)
    samples = []  # the unpacked samples behind the packs
    for row in most_sequences(rows, 4):
        ids, mask = torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"], dtype=torch.float32)
        for start, runtime in zip(row["seq_start_id"], row["seq_len"], strict=True):
            labels = ids[start + 1 : start + runtime + 1].clone()
            loss_mask = mask[start : start + runtime]
            labels[loss_mask == 0] = -100
            inputs = ids[start : start + runtime]
            samples.append(
                {
                    "input_ids": inputs,
                    "labels": labels,
                    "loss_mask": loss_mask,
                    "position_ids": torch.arange(runtime),
                }
            )
    samples = [s for s in samples if len(s["input_ids"]) % 4][:6]  # rows that do get an alignment tail
    packed = build_thd_from_rows(samples, pad_to_multiple_of=4, pad_token_id=EOS)
    assert len(samples) == 6 and "cu_seqlens_q_padded" in packed
    keys = ("position_ids", "cu_seqlens_q", "cu_seqlens_q_padded")
    return samples, packed, {"tokens": packed["input_ids"], **{key: packed[key] for key in keys}}


def in_batch_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none", ignore_index=-100)


def test_in_batch_packing_with_alignment_equals_unpacked(demo_slice, tmp_path):
    """Collate-time packing (contract 3.1) of unpacked samples, m = 4: same losses and gradients."""
    samples, packed, batch = in_batch_case(demo_slice, tmp_path)
    model = tiny_llama("sdpa")
    logits = packed_forward(model, batch).logits[0]
    labels, mask = packed["labels"][0], packed["loss_mask"][0]
    losses = in_batch_losses(logits, labels)
    (losses * mask).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = 0
    for sample, start in zip(samples, packed["cu_seqlens_q_padded"].tolist(), strict=False):
        out = model(input_ids=sample["input_ids"][None], use_cache=False).logits[0]
        alone = in_batch_losses(out, sample["labels"])
        n = len(alone)
        torch.testing.assert_close(losses[start : start + n], alone, atol=1e-5, rtol=0)
        total = total + (alone * sample["loss_mask"]).sum()
    total.backward()
    for packed_grad, parameter in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed_grad, parameter.grad, atol=1e-5, rtol=0)


def test_attention_crossing_sequences_fails_the_in_batch_parity(demo_slice, tmp_path):
    """Negative control of the test above: one causal mask over the packed row, same positions."""
    samples, packed, batch = in_batch_case(demo_slice, tmp_path)
    model = tiny_llama("sdpa")
    with torch.no_grad():
        losses = in_batch_losses(crossing_forward(model, batch).logits[0], packed["labels"][0])
        pieces = [
            (
                in_batch_losses(
                    model(input_ids=s["input_ids"][None], use_cache=False).logits[0], s["labels"]
                ),
                None,
            )
            for s in samples
        ]
    first, *later = sequence_deviations(losses, physical_starts(packed), pieces)
    assert first <= 1e-5 and max(later) > CAUGHT, (first, later)
