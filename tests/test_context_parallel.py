"""Context-parallel slicing, per-token loss, and their end-to-end parity under gloo with 2 processes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.errors import TightpackError
from tightpack.runtime.adapters import to_packed_seq_params
from tightpack.runtime.context_parallel import slice_for_cp_rank, thd_partition_indices
from tightpack.runtime.in_batch import build_thd_from_rows
from tightpack.runtime.loss import global_mean_loss, masked_token_loss
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vlm import pack_vlm_samples


def contract_indices(cu: list[int], world: int, rank: int) -> list[int]:
    """The contract's mapping of local position t to a global index, one position at a time."""
    local = [c // world for c in cu]
    out = []
    for t in range(cu[-1] // world):
        i = max(k for k in range(len(cu) - 1) if local[k] <= t)
        j, h = t - local[i], (local[i + 1] - local[i]) // 2
        out.append(cu[i] + rank * h + j if j < h else cu[i] + (2 * world - 1 - rank) * h + (j - h))
    return out


segments = st.integers(1, 4).flatmap(
    lambda world: st.tuples(st.just(world), st.lists(st.integers(1, 5), min_size=1, max_size=6))
)


@settings(max_examples=3 * settings.default.max_examples // 2, deadline=None)
@given(segments)
def test_partition_matches_the_contract_and_balances_every_segment(case):
    world, chunks = case
    lengths = [2 * world * c for c in chunks]
    cu = [0, *np.cumsum(lengths).tolist()]
    boundaries = torch.tensor(cu, dtype=torch.int32)
    shards = [thd_partition_indices(boundaries, world, rank) for rank in range(world)]
    assert [s.tolist() for s in shards] == [contract_indices(cu, world, rank) for rank in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(cu[-1]))  # a permutation of the row
    assert all(len(s) == cu[-1] // world for s in shards)
    for start, end in itertools.pairwise(cu):
        work = [int((s[(s >= start) & (s < end)] - start + 1).sum()) for s in shards]  # causal keys seen
        assert len(set(work)) == 1


@pytest.mark.parametrize(
    ("cu", "dtype", "total", "message"),
    [
        ([0, 8, 14], torch.int32, None, "segment 1 has 6 tokens; .* multiple of 2 \\* cp_size = 4"),
        ([0, 8], torch.int64, None, "boundaries must be int32"),
        ([0, 8], torch.int32, 12, "the row has 12 tokens but its boundaries end at 8"),
        ([0], torch.int32, None, "one packed row"),
        ([0, 0], torch.int32, None, "the row is empty"),
    ],
)
def test_partition_preconditions(cu, dtype, total, message):
    with pytest.raises(TightpackError, match=message):
        thd_partition_indices(torch.tensor(cu, dtype=dtype), 2, 0, total_tokens=total)


def test_partition_refuses_a_rank_outside_the_group():
    with pytest.raises(TightpackError, match=r"rank 2 is not in \[0, cp_size=2\)"):
        thd_partition_indices(torch.tensor([0, 8], dtype=torch.int32), 2, 2)


def packed_vlm_batch() -> dict:
    samples = []
    for n, images in ((6, 1), (9, 0), (5, 1)):
        ids = torch.arange(100, 100 + n)
        sample = {"input_ids": ids, "labels": ids + 1, "loss_mask": torch.ones(n)}
        if images:
            ids[1:5] = 7  # one image of 4 merged patches
            sample |= {"pixel_values": torch.randn(16, 3), "image_grid_thw": torch.tensor([[1, 4, 4]])}
        samples.append(sample)
    return pack_vlm_samples(samples, QwenVLRope("qwen2_vl", image_token_id=7), pad_to_multiple_of=4)


def test_slice_takes_every_sequence_tensor_with_the_same_indices():
    batch = packed_vlm_batch()
    width = batch["input_ids"].shape[1]
    for rank in range(2):
        shard = slice_for_cp_rank(batch, 2, rank)
        index = thd_partition_indices(batch["cu_seqlens_q_padded"], 2, rank)
        for key in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
            assert torch.equal(shard[key], batch[key][:, index]), key
        assert torch.equal(shard["mrope_position_ids"], batch["mrope_position_ids"][:, :, index])
        for key in ("cu_seqlens_q", "cu_seqlens_q_padded", "max_seqlen_q", "pixel_values", "image_grid_thw"):
            assert shard[key] is batch[key], key  # metadata and visual tensors pass through
        assert shard["input_ids"].shape[1] == width // 2 and shard["total_tokens"] == width


def test_slice_refuses_batches_it_cannot_split():
    rows = [{"input_ids": torch.arange(n), "position_ids": torch.arange(n)} for n in (3, 5)]
    unaligned = build_thd_from_rows(rows)
    with pytest.raises(TightpackError, match="segment 0 has 3 tokens"):
        slice_for_cp_rank(unaligned, 2, 0)
    two_rows = {
        "tokens": torch.zeros(2, 8),
        "cu_seqlens_q": torch.tensor([[0, 8], [0, 8]], dtype=torch.int32),
    }
    with pytest.raises(TightpackError, match="one row"):
        slice_for_cp_rank(two_rows, 2, 0)
    with pytest.raises(TightpackError, match="sequence length 6 is not divisible by 2 \\* cp_size = 4"):
        slice_for_cp_rank({"tokens": torch.zeros(2, 6)}, 2, 0)


def test_packed_seq_params_of_a_shard_keep_global_boundaries():
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = packed_vlm_batch()
    whole = to_packed_seq_params(batch, megatron=True)
    for rank in range(2):
        params = to_packed_seq_params(slice_for_cp_rank(batch, 2, rank), megatron=True)
        assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert torch.equal(getattr(params, field), getattr(whole, field)), field
        assert params.cu_seqlens_q_padded[-1] == batch["input_ids"].shape[1]  # global width, not the shard's
        assert params.max_seqlen_q == whole.max_seqlen_q


def test_masked_token_loss_and_its_checks():
    losses = torch.tensor([[1.0, 2.0, float("nan")]])
    assert masked_token_loss(losses, torch.tensor([[1, 1, 0]])) == (torch.tensor(3.0), torch.tensor(2))
    replaced = masked_token_loss((losses, torch.tensor([[0, 1, 0]])), torch.ones(1, 3))
    assert replaced == (torch.tensor(2.0), torch.tensor(1))  # the model's mask wins
    with pytest.raises(TightpackError, match="NaN or infinite"):
        masked_token_loss(losses, torch.ones(1, 3))
    with pytest.raises(TightpackError, match=r"losses \(1, 3\) and loss mask \(1, 2\) differ"):
        masked_token_loss(losses, torch.ones(1, 2))
    assert global_mean_loss(torch.tensor(0.0), torch.tensor(0)) == 0  # no supervised token: no NaN


def test_unpacked_two_dimensional_attention_mask_is_cut_along_the_sequence():
    batch = {"tokens": torch.arange(16).view(2, 8), "attention_mask": torch.arange(16).view(2, 8) % 3 > 0}
    shard = slice_for_cp_rank(batch, 2, 1)
    assert torch.equal(shard["attention_mask"], batch["attention_mask"][:, 2:6])
    assert shard["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
