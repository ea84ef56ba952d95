"""Patch grids of images and videos from their sizes alone, as the Qwen-VL processors compute them.

A processor resizes a picture so both sides are multiples of ``factor = patch_size * merge_size``
and its pixels lie within ``[min_pixels, max_pixels]``, keeping the aspect ratio as closely as it
can (`fitted_size`); the grid is then ``(t, height / patch_size, width / patch_size)``. Videos have
``t = ceil(frames / temporal_patch_size)`` (the last frame repeated to fill the last temporal patch).
Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL, and any folder whose video settings fall back to the
image ones) bounds each frame's pixels; Qwen3VLVideoProcessor bounds the whole video's
(``frames * height * width``). `VisionSizes.from_folder` reads a processor folder where and as
transformers reads it (no per-frame cap on the video budget: a folder asking for one is refused);
tests compare the grids with the processors loaded from the same folders.

Only sizes are needed, so packing reads image headers, never pixels. Pure Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from tightpack.errors import TightpackError, check_choice

# Defaults per family: the installed transformers processor classes' (Qwen2VLImageProcessor,
# Qwen2VLVideoProcessor, Qwen3VLVideoProcessor); Qwen3-VL images use Qwen2VLImageProcessor with the
# settings of the published checkpoints' preprocessor_config.json (16-pixel patches, 256^2 to 4096^2).
_QWEN2 = {"patch_size": 14, "image_min_pixels": 56 * 56, "image_max_pixels": 28 * 28 * 1280,
          "video_min_pixels": 128 * 28 * 28, "video_max_pixels": 28 * 28 * 768}  # fmt: skip
_DEFAULTS = {
    "qwen2_vl": _QWEN2,
    "qwen2_5_vl": _QWEN2,
    "qwen3_vl": {
        "patch_size": 16,
        "image_min_pixels": 256 * 256,
        "image_max_pixels": 4096 * 4096,
        "video_min_pixels": 128 * 32 * 32,
        "video_max_pixels": 768 * 32 * 32,
    },
}


def fitted_size(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1, temporal: int = 1
) -> tuple[int, int]:
    """``(height, width)`` a Qwen-VL processor resizes to: multiples of ``factor``, with
    ``frames * height * width`` within ``[min_pixels, max_pixels]`` (``frames = 1``: per picture).

    >>> fitted_size(500, 375, 28, 56 * 56, 28 * 28 * 1280)
    (504, 364)
    """
    if min(height, width) < 1:
        raise TightpackError(f"an image of {height} x {width} pixels has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise TightpackError(f"the aspect ratio of {height} x {width} is over 200, which Qwen-VL refuses")
    fitted_h, fitted_w = round(height / factor) * factor, round(width / factor) * factor
    stacked = round(frames / temporal) * temporal if temporal > 1 else frames
    if stacked * fitted_h * fitted_w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        fitted_h = max(factor, math.floor(height / beta / factor) * factor)
        fitted_w = max(factor, math.floor(width / beta / factor) * factor)
    elif stacked * fitted_h * fitted_w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        fitted_h = math.ceil(height * beta / factor) * factor
        fitted_w = math.ceil(width * beta / factor) * factor
    return fitted_h, fitted_w


@dataclass(frozen=True)
class VisionSizes:
    """A Qwen-VL processor's sizing settings (``preprocessor_config.json``, and
    ``video_preprocessor_config.json`` for videos).

    >>> sizes = VisionSizes("qwen2_vl")
    >>> sizes.image_grid(500, 375), sizes.video_grid(5, 336, 448)
    ((1, 36, 26), (3, 24, 32))
    """

    model: str
    patch_size: int | None = None
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_bounds: str | None = None
    """``"frame"``: pixel bounds per frame (Qwen2VLVideoProcessor); ``"clip"``: bounds on the whole
    video (Qwen3VLVideoProcessor). None: the family's own video processor's."""

    def __post_init__(self) -> None:
        check_choice("vision model", self.model, tuple(_DEFAULTS))
        if self.video_bounds is None:
            object.__setattr__(self, "video_bounds", "clip" if self.model == "qwen3_vl" else "frame")
        check_choice("video_bounds", self.video_bounds, ("frame", "clip"))
        for name, value in _DEFAULTS[self.model].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    @classmethod
    def from_folder(cls, folder: str | Path, model: str | None = None) -> VisionSizes:
        """The settings saved with a model's processor, found where transformers looks: the image
        processor's in ``processor_config.json`` (``"image_processor"``, as transformers 5 saves a
        processor) else ``preprocessor_config.json``; the video processor's in
        ``processor_config.json`` (``"video_processor"``) else ``video_preprocessor_config.json``
        else ``preprocessor_config.json`` (transformers builds the video processor from the image
        settings then). ``min_pixels`` / ``max_pixels`` override ``size`` as the Qwen2-VL processors'
        constructors do. The family comes from ``config.json``'s ``model_type`` unless ``model`` names it.

        Raises:
            TightpackError: when the folder holds no image processor settings, no family is known,
                or the video settings ask for a per-frame cap (``cap_pixels_per_frame``), not modeled.
        """
        folder = Path(folder)
        image = _processor_settings(folder, "image_processor", ("preprocessor_config.json",))
        if image is None:
            raise TightpackError(
                f"{folder} has no processor_config.json with image_processor settings and no "
                "preprocessor_config.json; pass the folder of the model's processor "
                "(processor.save_pretrained(folder) writes it)"
            )
        if model is None:
            config_file = folder / "config.json"
            model_type = (
                json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
            )
            model = {"qwen3_vl_moe": "qwen3_vl"}.get(model_type, model_type)
            if model not in _DEFAULTS:
                raise TightpackError(
                    f"cannot tell the model family of {folder} (config.json model_type {model_type!r}); "
                    "name it with model='qwen2_vl' (or 'qwen2_5_vl', 'qwen3_vl')",
                    parameters=("model='qwen2_vl'",),
                )
        sizes = cls(model)
        low, high = _pixel_bounds(image, sizes.image_min_pixels, sizes.image_max_pixels, True)
        sizes = replace(
            sizes,
            patch_size=image.get("patch_size", sizes.patch_size),
            merge_size=image.get("merge_size", sizes.merge_size),
            temporal_patch_size=image.get("temporal_patch_size", sizes.temporal_patch_size),
            image_min_pixels=low,
            image_max_pixels=high,
        )
        video = _processor_settings(
            folder, "video_processor", ("video_preprocessor_config.json", "preprocessor_config.json")
        )
        if video is not None:
            if video.get("cap_pixels_per_frame"):
                raise TightpackError(
                    f"the video processor settings of {folder} set cap_pixels_per_frame, which tightpack "
                    "does not model; remove it from the settings or pack without videos"
                )
            # transformers picks the class from the settings (a Qwen3-VL folder without video
            # settings gets Qwen2VLVideoProcessor); Qwen3VLVideoProcessor has no min/max_pixels override
            bounds = _VIDEO_BOUNDS.get(_video_processor_class(video), sizes.video_bounds)
            low, high = _pixel_bounds(
                video, sizes.video_min_pixels, sizes.video_max_pixels, bounds == "frame"
            )
            sizes = replace(sizes, video_min_pixels=low, video_max_pixels=high, video_bounds=bounds)
        return sizes

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def image_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(1, h, w)`` patches of a ``height x width`` picture."""
        h, w = fitted_size(height, width, self.factor, self.image_min_pixels, self.image_max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def video_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of ``frames`` frames of ``height x width``."""
        if frames < 1:
            raise TightpackError("a video needs at least one frame")
        if self.video_bounds == "clip":
            if frames < self.temporal_patch_size:
                raise TightpackError(
                    f"Qwen3-VL needs at least {self.temporal_patch_size} frames per video, got {frames}"
                )
            if min(height, width) < self.factor:  # small frames are first scaled up to the factor
                scale = max(self.factor / height, self.factor / width)
                height, width = int(height * scale), int(width * scale)
            h, w = fitted_size(
                height, width, self.factor, self.video_min_pixels, self.video_max_pixels,
                frames=frames, temporal=self.temporal_patch_size,
            )  # fmt: skip
        else:
            h, w = fitted_size(height, width, self.factor, self.video_min_pixels, self.video_max_pixels)
        return -(-frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size


_VIDEO_BOUNDS = {"Qwen2VLVideoProcessor": "frame", "Qwen3VLVideoProcessor": "clip"}


def _video_processor_class(video: dict) -> str | None:
    """The video processor class transformers' AutoVideoProcessor builds from these settings: theirs,
    or for image settings (no video file) the image class's name with "Video" for "Image"."""
    if video.get("video_processor_type"):
        return video["video_processor_type"]
    image_class = video.get("image_processor_type")
    return image_class.replace("ImageProcessor", "VideoProcessor") if image_class else None


def _processor_settings(folder: Path, part: str, files: tuple[str, ...]) -> dict | None:
    """One processor's saved settings, in transformers' order: the nested ``processor_config.json``
    entry ``part``, else the first of ``files`` present; None when none holds them."""
    nested = folder / "processor_config.json"
    if nested.is_file():
        settings = json.loads(nested.read_text())
        if isinstance(settings.get(part), dict):
            return settings[part]
    for name in files:
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return None


def _pixel_bounds(config: dict, low: int, high: int, pixels_override_size: bool) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a processor's settings: ``size`` (``shortest_edge`` and
    ``longest_edge`` hold pixel counts in Qwen-VL processors), with ``min_pixels`` / ``max_pixels``
    replacing them where given (and ``pixels_override_size``), as the processors' constructors do."""
    size = config.get("size") or {}
    low, high = size.get("shortest_edge", low), size.get("longest_edge", high)
    if pixels_override_size:
        low = low if config.get("min_pixels") is None else config["min_pixels"]
        high = high if config.get("max_pixels") is None else config["max_pixels"]
    return int(low), int(high)
