"""Packed-row helpers for vision-language models: the MoE padding mask and MRoPE unpack/repack."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.runtime.in_batch import build_thd_from_rows
from tightpack.runtime.vlm import moe_padding_mask, repack_position_ids, unpack_for_position_ids

F, T = False, True


def test_moe_padding_mask_excludes_only_physical_gaps():
    mask = moe_padding_mask(torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8]), 8)
    assert mask.tolist() == [[F, F, F, T, F, F, T, T]] and mask.dtype == torch.bool


def test_moe_padding_mask_none_without_padding():
    assert moe_padding_mask(torch.tensor([0, 3, 5]), None, 5) is None
    assert moe_padding_mask(torch.tensor([0, 3, 5]), torch.tensor([0, 3, 5]), 5) is None
    assert moe_padding_mask(torch.tensor([0, 3, 5]), torch.tensor([0, 3, 5]), 7).tolist() == [
        [F] * 5 + [T, T]
    ]


@pytest.mark.parametrize(
    ("logical", "physical", "total", "message"),
    [
        ([0, 3, 5], [0, 4], 8, "requires matching 1D query cu_seqlens"),
        ([0, 3, 3], [0, 4, 8], 8, "invalid logical or physical query boundaries"),
        ([0, 3, 5], [0, 2, 8], 8, "invalid logical or physical query boundaries"),
        ([0, 3, 5], [0, 4, 9], 8, "invalid logical or physical query boundaries"),
    ],
)
def test_moe_padding_mask_checks(logical, physical, total, message):
    with pytest.raises(ValueError, match=message):
        moe_padding_mask(torch.tensor(logical), torch.tensor(physical), total)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    multiple=st.integers(1, 4),
    axes=st.integers(1, 3),
)
def test_unpack_then_repack_restores_positions_with_gaps_at_zero(lengths, multiple, axes):
    rows = [{"input_ids": torch.arange(100 * i + 1, 100 * i + 1 + n), "position_ids": torch.arange(n)}
            for i, n in enumerate(lengths)]  # fmt: skip
    packed = build_thd_from_rows(rows, pad_to_multiple_of=multiple)
    padded = packed.get("cu_seqlens_q_padded")
    unpacked, mask, starts, real = unpack_for_position_ids(
        packed["input_ids"], packed["cu_seqlens_q"], padded
    )
    assert real.tolist() == lengths
    for row, n, expected in zip(unpacked, lengths, rows, strict=True):
        assert torch.equal(row[:n], expected["input_ids"])
    per_sequence = torch.stack(
        [torch.where(mask, torch.arange(mask.shape[1])[None] + axis, 0) for axis in range(axes)]
    )
    repacked = repack_position_ids(per_sequence, starts, real, packed["total_tokens"])
    assert repacked.shape == (axes, 1, packed["total_tokens"])
    for axis in range(axes):
        for start, n in zip(starts.tolist(), lengths, strict=True):
            assert repacked[axis, 0, start : start + n].tolist() == [axis + k for k in range(n)]
    gaps = moe_padding_mask(packed["cu_seqlens_q"], padded, packed["total_tokens"])
    if gaps is not None:
        assert (repacked[:, 0][:, gaps[0]] == 0).all()


def test_unpack_and_repack_errors():
    with pytest.raises(ValueError, match=r"expects a packed row \[1, T\]"):
        unpack_for_position_ids(torch.zeros(2, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="do not fit a packed row of 4 tokens"):
        unpack_for_position_ids(torch.zeros(1, 4), torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="must be positive"):
        unpack_for_position_ids(torch.zeros(1, 4), torch.tensor([0, 0, 2]))
    with pytest.raises(ValueError, match=r"must be \[axes, N, longest\] for N = 2"):
        repack_position_ids(torch.zeros(3, 1, 4), torch.tensor([0, 4]), torch.tensor([3, 2]), 8)
    with pytest.raises(ValueError, match="end past the packed row of 6 tokens"):
        repack_position_ids(torch.zeros(3, 2, 4), torch.tensor([0, 4]), torch.tensor([3, 3]), 6)
