"""The test media stand in for the real video processors, and the prompt text matches the processors'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.qwen_vl_models import drawn_video, video_inputs
from tightpack.errors import TightpackError
from tightpack.prepare.vision_placeholders import expand_vision_text, frame_timestamps

# recorded with transformers' Qwen2VLVideoProcessor and Qwen3VLProcessor (tests/data/record_qwen_vl_video.py)
RECORDED = Path(__file__).parent / "data" / "qwen_vl_video_processor.npz"


@pytest.fixture(scope="module")
def recorded():
    return dict(np.load(RECORDED))


@pytest.mark.parametrize(
    ("kind", "key", "video"), [("qwen2_vl", "qwen2", (4, 56, 84, 3)), ("qwen3_vl", "qwen3", (4, 64, 96, 5))]
)
def test_video_inputs_equal_the_video_processor(recorded, kind, key, video):
    ours = video_inputs(kind, drawn_video(*video))
    assert ours["video_grid_thw"].tolist() == recorded[f"{key}_video_grid_thw"].tolist()
    torch.testing.assert_close(
        ours["pixel_values_videos"],
        torch.from_numpy(recorded[f"{key}_pixel_values_videos"]),
        atol=1e-6,
        rtol=0,
    )


def test_qwen3_video_text_equals_the_processor(recorded):
    grid = recorded["qwen3_video_grid_thw"][0].tolist()
    seconds = frame_timestamps([0, 3, 6, 9], fps=2.0)  # the recorded video's metadata
    text = expand_vision_text(
        "<|video_pad|>", model="qwen3_vl", video_grid_thw=[grid], video_timestamps=[seconds]
    )
    assert text == str(recorded["qwen3_prompt"])


def test_expansion_keeps_the_text_and_order_of_mixed_placeholders():
    text = "a <|image_pad|> b <|video_pad|> c <|image_pad|>"
    out = expand_vision_text(
        text, model="qwen2_5_vl", image_grid_thw=[(1, 2, 2), (1, 4, 2)], video_grid_thw=[(2, 2, 4)]
    )
    assert out == "a " + "<|image_pad|>" + " b " + "<|video_pad|>" * 4 + " c " + "<|image_pad|>" * 2


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("<|image_pad|>", {}, "1 image placeholders"),
        ("<|video_pad|>", {"model": "qwen3_vl", "video_grid_thw": [(2, 2, 2)]}, "frame timestamps of each"),
        ("<|video_pad|>", {"model": "qwen3_vl", "video_grid_thw": [(2, 2, 2)], "video_timestamps": [[0.5]]},
         "needs 2 timestamps"),
    ],
)  # fmt: skip
def test_expansion_errors(text, kwargs, message):
    with pytest.raises(TightpackError, match=message):
        expand_vision_text(text, **kwargs)


def test_timestamps_pad_the_last_frame():
    assert frame_timestamps([0, 2, 4], fps=4.0) == [0.25, 1.0]
