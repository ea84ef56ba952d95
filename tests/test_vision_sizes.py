"""Grids from sizes alone equal what the Qwen-VL processors compute."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.errors import TightpackError
from tightpack.prepare.vision_sizes import VisionSizes

RECORDED = Path(__file__).parent / "data" / "qwen_vl_video_processor.npz"


@settings(max_examples=settings.default.max_examples * 3, deadline=None)
@given(height=st.integers(1, 5000), width=st.integers(1, 5000), qwen3=st.booleans())
def test_image_grids_equal_the_image_processor(height, width, qwen3):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sizes = VisionSizes("qwen3_vl" if qwen3 else "qwen2_vl")
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(TightpackError, match="aspect ratio"):
            sizes.image_grid(height, width)
        return
    h, w = smart_resize(height, width, sizes.factor, sizes.image_min_pixels, sizes.image_max_pixels)
    assert sizes.image_grid(height, width) == (1, h // sizes.patch_size, w // sizes.patch_size)


def test_image_defaults_are_the_image_processors():
    from transformers import Qwen2VLImageProcessorPil

    processor, sizes = Qwen2VLImageProcessorPil(), VisionSizes("qwen2_5_vl")
    assert (sizes.patch_size, sizes.merge_size, sizes.temporal_patch_size) == (
        processor.patch_size, processor.merge_size, processor.temporal_patch_size,
    )  # fmt: skip
    assert (sizes.image_min_pixels, sizes.image_max_pixels) == (
        processor.size["shortest_edge"], processor.size["longest_edge"],
    )  # fmt: skip
    assert processor.get_number_of_image_patches(500, 375, {}) == int(np.prod(sizes.image_grid(500, 375)))


@pytest.mark.parametrize(
    ("model", "key"), [("qwen2_vl", "qwen2"), ("qwen2_5_vl", "qwen2"), ("qwen3_vl", "qwen3")]
)
def test_video_grids_equal_the_video_processors(model, key):
    """Recorded with the real video processors, at their defaults (tests/data/record_qwen_vl_video.py)."""
    recorded = np.load(RECORDED)
    sizes = VisionSizes(model)
    patch, merge, temporal, low, high = recorded[f"{key}_video_settings"].tolist()
    assert (sizes.patch_size, sizes.merge_size, sizes.temporal_patch_size) == (patch, merge, temporal)
    assert (sizes.video_min_pixels, sizes.video_max_pixels) == (low, high)
    for frames, height, width, *grid in recorded[f"{key}_grid_cases"].tolist():
        assert sizes.video_grid(frames, height, width) == tuple(grid), (frames, height, width)


def test_settings_come_from_the_processor_folder(tmp_path):
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(
        patch_size=16, size={"shortest_edge": 1024, "longest_edge": 65536}
    ).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe"}))
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 4096, "max_pixels": 8192})
    )
    sizes = VisionSizes.from_folder(tmp_path)
    assert (sizes.model, sizes.patch_size, sizes.image_min_pixels, sizes.image_max_pixels) == (
        "qwen3_vl",
        16,
        1024,
        65536,
    )
    # Qwen3VLVideoProcessor has no min_pixels/max_pixels override: its class `size` stays
    assert (sizes.video_min_pixels, sizes.video_max_pixels) == (128 * 32 * 32, 768 * 32 * 32)
    assert VisionSizes.from_folder(tmp_path, model="qwen2_5_vl").video_max_pixels == 8192
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(TightpackError, match="cannot tell the model family"):
        VisionSizes.from_folder(tmp_path)
    assert VisionSizes.from_folder(tmp_path, model="qwen2_vl").model == "qwen2_vl"
    with pytest.raises(TightpackError, match=r"no preprocessor_config\.json"):
        VisionSizes.from_folder(tmp_path / "missing")


def test_video_errors():
    with pytest.raises(TightpackError, match="at least 2 frames"):
        VisionSizes("qwen3_vl").video_grid(1, 100, 100)
    with pytest.raises(TightpackError, match="at least one frame"):
        VisionSizes("qwen2_vl").video_grid(0, 100, 100)
    with pytest.raises(TightpackError, match="vision model must be one of"):
        VisionSizes("llava")
