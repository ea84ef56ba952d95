"""Block-diagonal causal masks against attention run sequence by sequence."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.masks import (
    additive_mask,
    document_ids,
    flash_varlen_attention,
    flex_block_mask,
    sdpa_mask,
)

ROWS = [
    {
        "input_ids": [5, 6, 7, 2, 2, 8, 9, 10, 11, 2, 12, 2, 2, 2, 2],
        "loss_mask": [1] * 15,
        "seq_start_id": [0, 5, 10],
    },
]


@pytest.fixture
def batch():
    return PackedCollate(pack_size=16, eos_id=2, pad_seq_to_mult=4, pad_to_max_length=True)(ROWS)


def qkv(total: int):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, total, 8, generator=generator) for _ in range(3)]


def per_sequence_attention(q, k, v, bounds):
    pieces = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(pieces, dim=2)


def test_document_ids_follow_the_physical_segments(batch):
    assert batch["cu_seqlens_q_padded"][0].tolist() == [0, 4, 8, 12, 16]
    assert document_ids(batch).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


def test_attention_across_sequences_differs_from_per_sequence(batch):
    """The negative control of the mask tests below: one causal mask over the whole row is far off."""
    q, k, v = qkv(16)
    expected = per_sequence_attention(q, k, v, batch["cu_seqlens_q_padded"][0].tolist())
    crossing = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(crossing[:, :, :4], expected[:, :, :4], atol=1e-6, rtol=0)  # sees no other
    assert (crossing[:, :, 4:] - expected[:, :, 4:]).abs().max() > 1e-3


def test_sdpa_and_additive_masks_equal_attention_per_sequence(batch):
    q, k, v = qkv(16)
    expected = per_sequence_attention(q, k, v, batch["cu_seqlens_q_padded"][0].tolist())
    with_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(batch))
    torch.testing.assert_close(with_bool, expected, atol=1e-6, rtol=0)
    scores = q @ k.transpose(-1, -2) / 8**0.5 + additive_mask(batch)
    with_additive = torch.softmax(scores, dim=-1) @ v
    torch.testing.assert_close(with_additive, expected, atol=1e-6, rtol=0)
    assert additive_mask(batch, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile"
)  # eager is enough for a test
def test_flex_block_mask_forward_on_cpu(batch):
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = qkv(16)
    expected = per_sequence_attention(q, k, v, batch["cu_seqlens_q_padded"][0].tolist())
    output = flex_attention(q, k, v, block_mask=flex_block_mask(batch))
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn kernels need CUDA")
def test_flash_varlen_attention_matches_per_sequence(batch):
    pytest.importorskip("flash_attn")
    q, k, v = (t[0].transpose(0, 1).cuda().half() for t in qkv(16))
    output = flash_varlen_attention(q, k, v, batch)
    expected = per_sequence_attention(
        *(t.transpose(0, 1)[None].float() for t in (q, k, v)), [0, 4, 8, 12, 16]
    )
    torch.testing.assert_close(output.float(), expected[0].transpose(0, 1), atol=2e-3, rtol=0)
