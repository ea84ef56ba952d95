"""Packed Qwen-VL rows give every token the loss and gradient it has when its sample runs alone.

Tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models (random weights, float64) on real processor outputs:
each pack mixes a text-only sample, image samples, a video sample and an image + video sample. The
unpacked reference is the plain transformers call: one sample, positions computed by the model
itself from ``mm_token_type_ids`` and the grids.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.qwen_vl_models import (
    IMAGE,
    MODELS,
    VIDEO,
    block_ids,
    drawn_video,
    image_inputs,
    tiny_model,
    video_inputs,
)
from tightpack.errors import TightpackError
from tightpack.runtime.hf import packed_forward
from tightpack.runtime.hf_kwargs import hf_packed_vlm_kwargs
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vlm import pack_vlm_samples

SECONDS_PER_GRID = 1.0  # temporal_patch_size 2 at 2 frames per second: temporal step 2 at 2 tokens/s


def make_sample(kind: str, media: list[tuple[str, dict]], texts: list[int], seed: int) -> dict:
    """Token ids around the media's blocks, next-token labels (-100 where the next token is visual or
    absent), and the media's visual tensors."""
    blocks = [(modality, tuple(inputs[f"{modality}_grid_thw"][0].tolist())) for modality, inputs in media]
    ids = block_ids(kind, blocks, texts)
    ids = torch.where(ids < 10, ids + seed * 3 + torch.arange(len(ids)) % 7, ids)  # vary the text tokens
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[(labels == IMAGE) | (labels == VIDEO)] = -100
    sample = {"input_ids": ids, "labels": labels}
    for modality, inputs in media:
        for key, value in inputs.items():
            sample[key] = torch.cat([sample[key], value]) if key in sample else value
        if modality == "video" and kind == "qwen2_5_vl":
            sample["second_per_grid_ts"] = torch.full((len(sample["video_grid_thw"]),), SECONDS_PER_GRID)
    return sample


@pytest.fixture(scope="module", params=MODELS)
def family(request):
    kind = request.param
    height, width = (64, 96) if kind == "qwen3_vl" else (56, 84)
    image = image_inputs(kind, 56, 84, seed=1)
    tall = image_inputs(kind, 112, 56, seed=2)
    video = video_inputs(kind, drawn_video(4, height, width, seed=3))
    samples = [
        make_sample(kind, [], [9], seed=0),
        make_sample(kind, [("image", image)], [3, 4], seed=1),
        make_sample(kind, [("video", video)], [2, 5], seed=2),
        make_sample(kind, [("image", tall), ("video", video)], [1, 2, 3], seed=3),
    ]
    return kind, samples


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none") * (labels != -100)


def alone(model, sample: dict) -> torch.Tensor:
    """Per-token losses of one sample through the plain transformers call (the model's own positions)."""
    ids = sample["input_ids"]
    kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    visual = {k: v for k, v in sample.items() if k not in ("input_ids", "labels")}
    logits = model(input_ids=ids[None], mm_token_type_ids=kinds[None], use_cache=False, **visual).logits[0]
    return token_losses(logits, sample["labels"])


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


TOLERANCE = {"eager": 1e-5, "sdpa": 1e-10}
"""Relative tolerance of the losses and gradients (the gradients' absolute one: this times the tensor's
largest value), per attention: eager attention takes its softmax in float32 in transformers, so a
packed row (other shapes, another summation order) agrees at float32 precision there; sdpa keeps
float64 (docs/vision.md states these)."""


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_losses_and_gradients_equal_unpacked(family, attention, multiple):
    kind, samples = family
    model = tiny_model(kind, attention)
    separate = [alone(model, sample) for sample in samples]
    torch.stack([losses.sum() for losses in separate]).sum().backward()
    expected_grads = gradients(model)

    batch = pack_vlm_samples(samples, QwenVLRope.from_config(model.config), pad_to_multiple_of=multiple)
    losses = token_losses(packed_forward(model, batch).logits[0], batch["labels"][0])
    losses.sum().backward()
    starts = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    for expected, start in zip(separate, starts, strict=False):
        torch.testing.assert_close(
            losses[start : start + len(expected)], expected, atol=1e-10, rtol=min(1e-8, TOLERANCE[attention])
        )
    assert float(losses.detach().sum()) > 0 and all(bool((s > 0).any()) for s in separate)
    grads = gradients(model)
    assert grads.keys() == expected_grads.keys() and any("visual" in name for name in grads)
    for name, grad in grads.items():
        expected, tolerance = expected_grads[name], TOLERANCE[attention]
        scale = float(expected.abs().max())
        torch.testing.assert_close(
            grad, expected, atol=tolerance * scale, rtol=tolerance, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_attention_crossing_sequences_changes_the_losses(family):
    """Negative controls: text positions that do not restart, and the usual 3-row positions (no text
    row, so no packed mask) both let attention cross sequences, which changes later sequences' losses."""
    kind, samples = family
    model = tiny_model(kind, "sdpa")
    batch = pack_vlm_samples(samples, QwenVLRope.from_config(model.config))
    reference = token_losses(packed_forward(model, batch).logits[0], batch["labels"][0])
    kwargs = hf_packed_vlm_kwargs(batch)
    width = batch["total_tokens"]
    continuous = kwargs | {"position_ids": kwargs["position_ids"].clone()}
    continuous["position_ids"][0, 0] = torch.arange(width)
    three_rows = kwargs | {"position_ids": kwargs["position_ids"][1:]}
    first = len(samples[0]["input_ids"])
    for crossing in (continuous, three_rows):
        losses = token_losses(model(**crossing, use_cache=False).logits[0], batch["labels"][0])
        torch.testing.assert_close(losses[:first], reference[:first])  # the first sequence sees only itself
        assert float((losses[first:] - reference[first:]).detach().abs().max()) > 1e-3


def test_packed_forward_refuses_what_would_cross_sequences(family):
    kind, samples = family
    model = tiny_model(kind, "eager")
    rope = QwenVLRope.from_config(model.config)
    batch = pack_vlm_samples(samples[:2], rope)
    text_only = {key: value for key, value in batch.items() if key != "mrope_position_ids"}
    with pytest.raises(TightpackError, match="needs multimodal positions on a packed row"):
        packed_forward(model, text_only)
    with pytest.raises(TightpackError, match="use_cache=True"):
        packed_forward(model, batch, use_cache=True)
    model.config.get_text_config()._attn_implementation = "paged|sdpa"
    with pytest.raises(TightpackError, match=re.escape("'paged|sdpa' does not keep packed sequences apart")):
        packed_forward(model, batch)
