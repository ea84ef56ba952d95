"""Prompt text of vision-language samples: each image or video placeholder expanded to its tokens.

A Qwen-VL prompt holds one ``<|image_pad|>`` per image and one ``<|video_pad|>`` per video; the
processor replaces each by as many copies as the item has language-model tokens
(``t * h * w / merge_size**2`` for a grid of ``t x h x w`` patches). Qwen3-VL writes a video frame
by frame instead: before each temporal patch a timestamp ``<{seconds:.1f} seconds>`` and the
patch's tokens between vision start and end tokens. `expand_vision_text` does what the installed
transformers processors do, from the grids alone (no pixels), so token counts can be known before
any image is decoded. Pure Python: the offline packer uses it without torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tightpack.errors import TightpackError, check_choice

QWEN_VL_TOKENS = {
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
}
_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def vision_token_count(grid_thw: Sequence[int], merge_size: int = 2) -> int:
    """Language-model tokens of one image or video of ``(t, h, w)`` patches.

    >>> vision_token_count((2, 4, 6))
    12
    """
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def frame_timestamps(frame_indices: Sequence[int], fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch of a Qwen3-VL video: the mean time of its first and last frame.

    The sampled frame indices are padded with the last one to a multiple of ``temporal_patch_size``.

    >>> frame_timestamps([0, 3, 6, 9], fps=2.0)
    [0.75, 3.75]
    """
    indices = list(frame_indices)
    if not indices or fps <= 0:
        raise TightpackError(f"frame timestamps need frame indices and fps > 0, got {indices!r} at fps={fps}")
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / fps for index in indices]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(seconds), temporal_patch_size)
    ]


def expand_vision_text(
    text: str,
    *,
    model: str = "qwen2_vl",
    image_grid_thw: Iterable[Sequence[int]] = (),
    video_grid_thw: Iterable[Sequence[int]] = (),
    video_timestamps: Iterable[Sequence[float]] = (),
    merge_size: int = 2,
    tokens: dict[str, str] = QWEN_VL_TOKENS,
) -> str:
    """Replace the k-th image and video placeholder of ``text`` by the tokens of image and video k.

    Qwen3-VL (``model="qwen3_vl"``) needs ``video_timestamps``: per video, the seconds of each
    temporal patch (`frame_timestamps`).

    >>> expand_vision_text("a<|image_pad|>b", image_grid_thw=[(1, 2, 4)])
    'a<|image_pad|><|image_pad|>b'
    >>> expand_vision_text("<|video_pad|>", model="qwen3_vl", video_grid_thw=[(2, 2, 2)],
    ...                    video_timestamps=[[0.75, 3.75]]).split("<|vision_end|>")
    ['<0.8 seconds><|vision_start|><|video_pad|>', '<3.8 seconds><|vision_start|><|video_pad|>', '']
    """
    check_choice("model", model, _MODELS)
    images, videos = [tuple(g) for g in image_grid_thw], [tuple(g) for g in video_grid_thw]
    timestamps = [list(s) for s in video_timestamps]
    image, video = tokens["image"], tokens["video"]
    found = {"image": text.count(image), "video": text.count(video)}
    for kind, grids in (("image", images), ("video", videos)):
        if found[kind] != len(grids):
            raise TightpackError(
                f"the text has {found[kind]} {kind} placeholders ({tokens[kind]}) for {len(grids)} {kind}s"
            )
    if model == "qwen3_vl" and len(timestamps) != len(videos):
        raise TightpackError(f"Qwen3-VL needs the frame timestamps of each of the {len(videos)} videos")

    replacements = {"image": iter(image * vision_token_count(g, merge_size) for g in images)}
    if model == "qwen3_vl":
        replacements["video"] = iter(
            _qwen3_video(grid, seconds, merge_size, tokens)
            for grid, seconds in zip(videos, timestamps, strict=True)
        )
    else:
        replacements["video"] = iter(video * vision_token_count(g, merge_size) for g in videos)
    pattern = re.compile(f"(?P<image>{re.escape(image)})|(?P<video>{re.escape(video)})")
    return pattern.sub(lambda match: next(replacements[match.lastgroup]), text)


def _qwen3_video(grid: tuple, seconds: list[float], merge_size: int, tokens: dict[str, str]) -> str:
    t, h, w = (int(v) for v in grid)
    if len(seconds) != t:
        raise TightpackError(f"a video of {t} temporal patches needs {t} timestamps, got {len(seconds)}")
    frame = (
        tokens["vision_start"]
        + tokens["video"] * vision_token_count((1, h, w), merge_size)
        + tokens["vision_end"]
    )
    return "".join(f"<{second:.1f} seconds>{frame}" for second in seconds)
