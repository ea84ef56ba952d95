"""Packed-row helpers for vision-language models: the MoE padding mask and MRoPE unpack/repack."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.qwen_vl_models import (
    IMAGE,
    VIDEO,
    block_ids,
    drawn_video,
    image_inputs,
    tiny_model,
    transformers_positions,
    video_inputs,
)
from tightpack.runtime.in_batch import build_thd_from_rows
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vlm import (
    expand_placeholders,
    moe_padding_mask,
    pack_vlm_samples,
    repack_position_ids,
    unpack_for_position_ids,
)

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


@settings(max_examples=2 * settings.default.max_examples, deadline=None)
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


@pytest.fixture(scope="module")
def vlm_samples():
    """A text-only sample, an image sample and a video sample, through the real image processor."""
    image = image_inputs("qwen2_5_vl", 56, 84, seed=0)
    video = video_inputs("qwen2_5_vl", drawn_video(4, 56, 84, seed=1))
    samples = []
    for seed, media in enumerate([[], [("image", image)], [("video", video)], [("video", video)]]):
        blocks = [(m, tuple(inputs[f"{m}_grid_thw"][0].tolist())) for m, inputs in media]
        ids = block_ids("qwen2_5_vl", blocks, [2 + seed] * (len(blocks) + 1))
        labels = torch.where((ids == IMAGE) | (ids == VIDEO), -100, ids + 1)
        sample = {"input_ids": ids, "labels": labels, "loss_mask": (labels != -100).float()}
        for _, inputs in media:
            sample |= inputs
        samples.append(sample)
    samples[2]["second_per_grid_ts"] = torch.tensor([0.5])  # the last video has none: transformers takes 1.0
    return samples


def test_placeholders_expand_to_the_visual_token_count():
    ids = expand_placeholders(torch.tensor([1, IMAGE, 2]), torch.tensor([[1, 4, 6]]), IMAGE, 2)
    assert ids.tolist() == [1] + [IMAGE] * 6 + [2]
    with pytest.raises(ValueError, match="1 placeholder tokens for 2 images"):
        expand_placeholders(torch.tensor([1, IMAGE]), torch.tensor([[1, 4, 4], [1, 4, 4]]), IMAGE, 2)


@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_vlm_batch_equals_the_samples_concatenated(vlm_samples, multiple):
    model = tiny_model("qwen2_5_vl", dtype=torch.float32)
    batch = pack_vlm_samples(vlm_samples, QwenVLRope.from_config(model.config), pad_to_multiple_of=multiple)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        assert torch.equal(batch[key], torch.cat([s[key] for s in vlm_samples if key in s]))
    assert batch["second_per_grid_ts"].tolist() == [0.5, 1.0]
    physical = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    covered = torch.zeros(batch["total_tokens"], dtype=torch.bool)
    for sample, start, stop in zip(vlm_samples, physical[:-1], physical[1:], strict=True):
        ids = sample["input_ids"]
        n = len(ids)
        assert torch.equal(batch["input_ids"][0, start : start + n], ids)
        visual = {key: sample.get(key) for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        expected = transformers_positions(model, ids, **visual)
        assert torch.equal(batch["mrope_position_ids"][:, 0, start : start + n], expected[:, 0])
        covered[start : start + n] = True
        assert (batch["mrope_position_ids"][:, 0, start + n : stop] == 0).all()  # alignment gaps at 0
    assert torch.equal(~covered, batch["padding_mask"][0])
    if multiple > 1:
        mask = moe_padding_mask(batch["cu_seqlens_q"], batch["cu_seqlens_q_padded"], batch["total_tokens"])
        assert torch.equal(mask, batch["padding_mask"])


@pytest.mark.parametrize(
    "form",
    [
        lambda seconds: torch.tensor(seconds, dtype=torch.bfloat16),
        lambda seconds: torch.tensor(seconds, dtype=torch.float16),
        lambda seconds: torch.tensor(seconds, dtype=torch.float64),
        list,
    ],
    ids=["bfloat16", "float16", "float64", "list"],
)
def test_packed_positions_scale_time_as_each_sample_alone(form):
    """Long videos whose ``second_per_grid_ts`` comes as bf16/f16/f64 or a list: each member's positions
    in the packed row equal transformers' on that member alone (a float32 cast moved frames by one)."""
    model = tiny_model("qwen2_5_vl", dtype=torch.float32)
    samples = []
    for seconds, frames in [([0.44], 26), ([0.37, 0.61], 40), (None, 30)]:
        grids = [(frames, 2, 2)] * (1 if seconds is None else len(seconds))
        sample = {"input_ids": block_ids("qwen2_5_vl", [("video", g) for g in grids], [1] * (len(grids) + 1))}
        sample["video_grid_thw"] = torch.tensor(grids)
        if seconds is not None:
            sample["second_per_grid_ts"] = form(seconds)
        samples.append(sample)
    batch = pack_vlm_samples(samples, QwenVLRope.from_config(model.config))
    starts = batch["cu_seqlens_q"].tolist()
    for sample, start in zip(samples, starts, strict=False):
        ids = sample["input_ids"]
        expected = transformers_positions(
            model,
            ids,
            video_grid_thw=sample["video_grid_thw"],
            second_per_grid_ts=sample.get("second_per_grid_ts"),
        )
        assert torch.equal(batch["mrope_position_ids"][:, 0, start : start + len(ids)], expected[:, 0])
