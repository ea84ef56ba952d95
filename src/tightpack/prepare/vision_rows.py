"""Vision-language chat rows: images and videos referenced by local files, sized from their headers.

A row is a chat row (``messages``) whose content parts may be media, in the message format of
qwen-vl-utils and the Hugging Face processors::

    {"type": "image", "image": "pictures/cat.jpg"}
    {"type": "video", "video": ["clip/0001.jpg", "clip/0002.jpg", ...], "fps": 2.0}

A video is a list of frame files, already sampled; ``fps`` is their rate (frames per second of the
list), from which Qwen2.5-VL's ``second_per_grid_ts`` and Qwen3-VL's timestamps follow. Relative
paths are taken from ``VisionSpec.media_root``; a ``file://`` prefix is allowed; a path (relative or
absolute) that leads outside the media root is refused.

`vision_row` decodes each file in full (so that a damaged file is the row's error now, not the
training loader's), takes its size upright (EXIF orientation applied, as the processors load it),
computes the patch grid with `tightpack.prepare.vision_sizes.VisionSizes`, and replaces the part by
the text the chat template writes for it (vision start, one placeholder token, vision end);
`tightpack.prepare.vision_tokens` later widens each placeholder token to the item's tokens. The media
go with the sample as `MediaItem` records (`media_json`), so a training-time loader can load them and
check the grids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tightpack.errors import TightpackError
from tightpack.prepare.media import picture_size
from tightpack.prepare.vision_placeholders import QWEN_VL_TOKENS, frame_timestamps
from tightpack.prepare.vision_sizes import VisionSizes


class MediaError(ValueError):
    """A media part that cannot be used; `tightpack.prepare.formats` makes it the row's error."""


@dataclass(frozen=True)
class VisionSpec:
    """How vision parts become tokens: the processor's sizing, where relative paths start, the
    special tokens of the model's tokenizer."""

    sizes: VisionSizes
    media_root: str = "."
    tokens: dict[str, str] = field(default_factory=lambda: dict(QWEN_VL_TOKENS))


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a sample: its files as written in the row, its patch grid ``(t, h, w)``,
    and for a video its frame rate and the seconds of each temporal patch (Qwen3-VL's timestamps)."""

    kind: str
    paths: tuple[str, ...]
    grid: tuple[int, int, int]
    fps: float | None = None

    def second_per_grid(self, temporal_patch_size: int) -> float | None:
        """Qwen2.5-VL's ``second_per_grid_ts`` of a video: ``temporal_patch_size / fps``."""
        return None if self.fps is None else temporal_patch_size / self.fps

    def timestamps(self, temporal_patch_size: int) -> list[float]:
        """Seconds of each temporal patch of a video (`frame_timestamps` over frames ``0..n-1``)."""
        return frame_timestamps(range(len(self.paths)), self.fps or 1.0, temporal_patch_size)


def media_json(items: tuple[MediaItem, ...]) -> str:
    """The sample's media as one JSON array (``[]`` for none), as stored with it and in the packs."""
    records = []
    for item in items:
        if item.kind == "image":
            record = {"type": "image", "path": item.paths[0], "grid_thw": list(item.grid)}
        else:
            record = {"type": "video", "frames": list(item.paths), "grid_thw": list(item.grid)}
        if item.fps is not None:
            record["fps"] = item.fps
        records.append(record)
    return json.dumps(records, separators=(",", ":"))


def parse_media_json(text: str) -> list[MediaItem]:
    """The `MediaItem` records of one sample's `media_json`."""
    items = []
    for record in json.loads(text):
        paths = (record["path"],) if record["type"] == "image" else tuple(record["frames"])
        items.append(MediaItem(record["type"], paths, tuple(record["grid_thw"]), record.get("fps")))
    return items


def _resolve(path: Any, spec: VisionSpec) -> tuple[str, Path]:
    """The path as written and where it lies; a path that leaves the media root is refused."""
    if not isinstance(path, str) or not path:
        raise MediaError(f"a media path must be a non-empty string, got {path!r}")
    written = path.removeprefix("file://")
    root = os.path.abspath(spec.media_root)
    # Lexical, so a symbolic link placed inside the root (a deliberate choice) is followed when read.
    target = os.path.normpath(os.path.join(root, written))
    if os.path.commonpath([root, target]) != root:
        raise MediaError(
            f"media path {path!r} is outside the media root {root}; set media_root to a folder "
            "that holds every media file"
        )
    return written, Path(target)


def _picture_size(path: Path) -> tuple[int, int]:
    """``(height, width)`` of a picture as the processors see it (`tightpack.prepare.media.picture_size`:
    upright by its EXIF orientation, decoded in full, so a damaged file fails when packing)."""
    from PIL import Image, UnidentifiedImageError

    try:
        height, width = picture_size(path)
    except FileNotFoundError:
        raise MediaError(f"media file {path} does not exist") from None
    except UnidentifiedImageError as error:
        raise MediaError(f"media file {path} is not a picture PIL can read ({error})") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise MediaError(f"media file {path} cannot be decoded ({error})") from None
    return height, width


def _grid(path: Path, size: Callable[[], tuple[int, int, int]]) -> tuple[int, int, int]:
    """The patch grid from ``size()``; a size the processor refuses (an aspect ratio over 200, too
    few frames) is the row's error, naming the file."""
    try:
        return size()
    except TightpackError as error:
        raise MediaError(f"media file {path}: {error}") from None


def _media_item(part: dict, spec: VisionSpec) -> MediaItem:
    kind = part["type"]
    if kind == "image":
        written, path = _resolve(part.get("image"), spec)
        height, width = _picture_size(path)
        return MediaItem("image", (written,), _grid(path, lambda: spec.sizes.image_grid(height, width)))
    frames = part.get("video")
    if not isinstance(frames, list) or not frames:
        raise MediaError('a video part needs "video": a non-empty list of frame files')
    fps = part.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
        raise MediaError(f'a video part needs "fps" > 0 (frames per second of its frame list), got {fps!r}')
    resolved = [_resolve(frame, spec) for frame in frames]
    sizes = {_picture_size(path) for _, path in resolved}
    if len(sizes) != 1:
        raise MediaError(f"the frames of a video must all have one size, got {sorted(sizes)}")
    (height, width) = sizes.pop()
    grid = _grid(resolved[0][1], lambda: spec.sizes.video_grid(len(frames), height, width))
    return MediaItem("video", tuple(written for written, _ in resolved), grid, float(fps))


def reread_media_item(item: MediaItem, spec: VisionSpec) -> MediaItem:
    """``item`` as its files give it now, read as packing reads them (decoded, sized upright, its grid
    computed); compare the grids to find files changed since packing.

    Raises:
        MediaError: as `vision_row` for the same part (missing, undecodable, outside the media root).
    """
    if item.kind == "image":
        return _media_item({"type": "image", "image": item.paths[0]}, spec)
    return _media_item({"type": "video", "video": list(item.paths), "fps": item.fps}, spec)


def vision_row(
    row: dict, spec: VisionSpec, messages_key: str = "messages"
) -> tuple[dict, tuple[MediaItem, ...]]:
    """The row with each media part replaced by its placeholder text part, and the media in order.

    Raises:
        MediaError: a media part without its file, with an unreadable file, or malformed.
    """
    messages = row.get(messages_key)
    if not isinstance(messages, list):
        return row, ()
    items: list[MediaItem] = []
    rewritten = []
    start, end = spec.tokens["vision_start"], spec.tokens["vision_end"]
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(
            isinstance(part, dict) and part.get("type") in ("image", "video") for part in content
        ):
            rewritten.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image", "video"):
                items.append(_media_item(part, spec))
                parts.append({"type": "text", "text": start + spec.tokens[part["type"]] + end})
            else:
                parts.append(part)
        rewritten.append({**message, "content": parts})
    return {**row, messages_key: rewritten}, tuple(items)
