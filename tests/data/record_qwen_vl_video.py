"""Record the real Qwen-VL video processors on drawn frames, for tests/test_qwen_vl_media.py.

transformers' video processors need torchvision, which cannot be installed next to this project's
pinned CPU torch, so the tests build video inputs from the image processor (tests/qwen_vl_models.py)
and compare them with what this script keeps. Run it where torchvision imports, e.g.:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers pillow
    /tmp/tv/bin/python tests/data/record_qwen_vl_video.py tests/data/qwen_vl_video_processor.npz

It keeps, per family, ``pixel_values_videos`` and ``video_grid_thw`` of `VIDEO` (drawn frames), and
for Qwen3-VL the prompt text its processor puts in place of the video (timestamps before each frame).
It also keeps the video processors' default sizing settings and the grids they give for the sizes of
`GRID_CASES` (``get_num_of_video_patches`` and their own resize rule), for
tests/test_vision_sizes.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.qwen_vl_models import VIDEO_SIZE, drawn_video

VIDEO = {"frames": 4, "height": 56, "width": 84, "seed": 3}
QWEN3_VIDEO = {"frames": 4, "height": 64, "width": 96, "seed": 5}
QWEN3_METADATA = {"fps": 2.0, "frames_indices": [0, 3, 6, 9], "total_num_frames": 12}
# (frames, height, width): tiny, odd, wide, tall, large and long videos
GRID_CASES = [(2, 56, 84), (3, 30, 40), (4, 100, 1000), (5, 1000, 90), (8, 1080, 1920), (16, 336, 448),
              (64, 720, 1280), (2, 20, 20), (7, 481, 639)]  # fmt: skip


def qwen3_prompt(video: dict) -> str:
    """The text Qwen3VLProcessor puts in place of the video, with a word-level tokenizer built here."""
    from tokenizers import Tokenizer, models
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )
    from transformers.video_utils import VideoMetadata

    specials = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<unk>"]
    words = Tokenizer(models.WordLevel({token: i for i, token in enumerate(specials)}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", additional_special_tokens=specials[:4]
    )
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(size=VIDEO_SIZE, do_sample_frames=False),
    )  # fmt: skip
    outputs = processor.video_processor(
        videos=[video],
        video_metadata=[VideoMetadata(**QWEN3_METADATA)],
        return_metadata=True,
        return_tensors="pt",
    )
    return processor.replace_video_token(outputs, 0), outputs


def grid_table() -> dict[str, np.ndarray]:
    """Per family: default settings, and ``[frames, height, width, t, h, w]`` for every case."""
    import importlib

    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    out = {}
    for key, processor_class, module in (
        ("qwen2", Qwen2VLVideoProcessor, "transformers.models.qwen2_vl.video_processing_qwen2_vl"),
        ("qwen3", Qwen3VLVideoProcessor, "transformers.models.qwen3_vl.video_processing_qwen3_vl"),
    ):
        processor = processor_class()
        resize = importlib.import_module(module).smart_resize
        patch, merge, temporal = processor.patch_size, processor.merge_size, processor.temporal_patch_size
        low, high = processor.size["shortest_edge"], processor.size["longest_edge"]
        rows = []
        for frames, height, width in GRID_CASES:
            if key == "qwen3":
                if frames < temporal:
                    continue
                h, w = resize(frames, height, width, temporal, patch * merge, low, high)
            else:
                h, w = resize(height, width, patch * merge, low, high)
            t = -(-frames // temporal)
            assert t * h * w // patch**2 == processor.get_num_of_video_patches(frames, height, width, {})
            rows.append([frames, height, width, t, h // patch, w // patch])
        out[f"{key}_grid_cases"] = np.array(rows)
        out[f"{key}_video_settings"] = np.array([patch, merge, temporal, low, high])
    return out


def main(path: str) -> None:
    from transformers import Qwen2VLVideoProcessor

    video = drawn_video(VIDEO["frames"], VIDEO["height"], VIDEO["width"], VIDEO["seed"])
    qwen2 = Qwen2VLVideoProcessor(size=VIDEO_SIZE)(videos=[video], return_tensors="pt")
    qwen3_frames = drawn_video(
        QWEN3_VIDEO["frames"], QWEN3_VIDEO["height"], QWEN3_VIDEO["width"], QWEN3_VIDEO["seed"]
    )
    prompt, qwen3 = qwen3_prompt(qwen3_frames)
    np.savez_compressed(
        path,
        qwen2_pixel_values_videos=qwen2["pixel_values_videos"].numpy(),
        qwen2_video_grid_thw=qwen2["video_grid_thw"].numpy(),
        qwen3_pixel_values_videos=qwen3["pixel_values_videos"].numpy(),
        qwen3_video_grid_thw=qwen3["video_grid_thw"].numpy(),
        qwen3_prompt=np.array(prompt),
        **grid_table(),
    )


if __name__ == "__main__":
    main(sys.argv[1])
