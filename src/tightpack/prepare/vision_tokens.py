"""Vision placeholders widened to their tokens, after tokenizing (`expand_vision_tokens`).

The text of a vision sample holds one placeholder token per image or video (`vision_rows`), so the
text stays short and no cut or tokenizer merge can split a block. Here each placeholder token becomes
what the installed transformers processors write for the item: ``t * h * w / merge_size**2`` copies
of itself for an image, and for a video in Qwen2/2.5-VL; for a Qwen3-VL video, per temporal patch a
timestamp ``<{seconds:.1f} seconds>`` (tokenized on its own: special tokens surround it, so it
tokenizes the same inside the text), vision start, the patch's tokens, vision end
(`tightpack.prepare.vision_placeholders.expand_vision_text` is the same rule on text). Inserted
tokens carry no loss. One Python step per media item, none per token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from tightpack.core.token_store import Segments
from tightpack.errors import TightpackError
from tightpack.prepare.vision_placeholders import vision_token_count
from tightpack.prepare.vision_rows import MediaItem, VisionSpec, media_json


class VisionTokenIds:
    """The ids of the vision special tokens in a tokenizer, and its timestamp tokens (cached)."""

    def __init__(self, spec: VisionSpec, backend: Any) -> None:
        self.spec, self.backend = spec, backend
        ids = {name: backend.token_to_id(token) for name, token in spec.tokens.items()}
        missing = [spec.tokens[name] for name, value in ids.items() if value is None]
        if missing:
            raise TightpackError(
                f"the tokenizer has no token {', '.join(missing)}: vision packing needs the model's own "
                "tokenizer (its vision tokens are special tokens of one id each)"
            )
        self.ids = ids
        self._timestamps: dict[str, list[int]] = {}

    def timestamp(self, seconds: float) -> list[int]:
        text = f"<{seconds:.1f} seconds>"
        if text not in self._timestamps:
            self._timestamps[text] = self.backend.encode(text, add_special_tokens=False).ids
        return self._timestamps[text]

    def block(self, item: MediaItem) -> np.ndarray:
        """The tokens that replace one placeholder token of ``item``."""
        sizes, ids = self.spec.sizes, self.ids
        if item.kind == "image":
            return np.full(vision_token_count(item.grid, sizes.merge_size), ids["image"], np.int32)
        if sizes.model != "qwen3_vl":
            return np.full(vision_token_count(item.grid, sizes.merge_size), ids["video"], np.int32)
        t, h, w = item.grid
        frame = [ids["vision_start"], *[ids["video"]] * vision_token_count((1, h, w), sizes.merge_size)]
        frame.append(ids["vision_end"])
        seconds = item.timestamps(sizes.temporal_patch_size)
        return np.array(
            [token for k in range(t) for token in (*self.timestamp(seconds[k]), *frame)], np.int32
        )


def expand_vision_tokens(
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    lengths: np.ndarray,
    segments: Segments,
    media: list[tuple[MediaItem, ...]],
    vision: VisionTokenIds,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Segments, list[str]]:
    """Samples stored back to back (``lengths``) with each placeholder widened; also every sample's
    `media_json`. ``media`` lists each sample's items in placeholder order.

    Returns the new tokens, loss mask, lengths, segments (starts moved with the tokens) and media.
    """
    ids = vision.ids
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    is_placeholder = (tokens == ids["image"]) | (tokens == ids["video"])
    where = np.flatnonzero(is_placeholder)
    items = [item for sample in media for item in sample]
    owner = np.searchsorted(starts, where, side="right") - 1
    expected = np.array([len(sample) for sample in media], np.int64)
    if len(where) != len(items) or not np.array_equal(np.bincount(owner, minlength=len(media)), expected):
        raise RuntimeError("vision placeholders and media items disagree")  # vision_row guarantees it
    kinds = np.where(tokens[where] == ids["image"], "image", "video")
    if any(kind != item.kind for kind, item in zip(kinds, items, strict=True)):
        raise RuntimeError("vision placeholders and media items disagree in kind")
    if not items:
        return tokens, loss_mask, lengths, segments, [media_json(sample) for sample in media]
    blocks = [vision.block(item) for item in items]
    grown = np.array([len(block) - 1 for block in blocks], np.int64)
    pieces_tokens, pieces_mask, previous = [], [], 0
    for position, block in zip(where.tolist(), blocks, strict=True):
        pieces_tokens += [tokens[previous:position], block]
        pieces_mask += [loss_mask[previous:position], np.zeros(len(block), loss_mask.dtype)]
        previous = position + 1
    new_tokens = np.concatenate([*pieces_tokens, tokens[previous:]]).astype(tokens.dtype, copy=False)
    new_mask = np.concatenate([*pieces_mask, loss_mask[previous:]])
    new_lengths = lengths + np.bincount(owner, weights=grown, minlength=len(lengths)).astype(lengths.dtype)
    # a segment starting after a placeholder moves by what every earlier placeholder grew
    segment_owner = np.repeat(np.arange(len(lengths)), segments.counts)
    positions = starts[segment_owner] + segments.starts
    shift = np.concatenate([[0], np.cumsum(grown)])
    moved = positions + shift[np.searchsorted(where, positions, side="left")]
    new_starts = np.concatenate([[0], np.cumsum(new_lengths)[:-1]]).astype(np.int64)
    new_segments = replace(segments, starts=(moved - new_starts[segment_owner]).astype(segments.starts.dtype))
    return new_tokens, new_mask, new_lengths, new_segments, [media_json(sample) for sample in media]
