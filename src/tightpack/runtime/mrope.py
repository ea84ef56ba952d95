"""Multimodal rotary positions (MRoPE) of the Qwen-VL models: Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Every token gets three positions (temporal, height, width). Text counts up on all three axes. A
visual block (one image, one video, or for Qwen3-VL one frame of a video) of ``t x h x w`` merged
patches starts at the current position ``s``; its token ``(i, j, k)`` sits at
``(s + floor(i * interval), s + j, s + k)``:

- Qwen2-VL: ``interval = 1``.
- Qwen2.5-VL: ``interval = tokens_per_second * second_per_grid_t`` for videos, 1 for images.
- Qwen3-VL: videos are split into one block per temporal patch (``t = 1``); time is carried by the
  text timestamps before each frame (`tightpack.runtime.vlm.expand_placeholders`).

Where the text after a block resumes is a transformers version choice (`RESUME_RULES`):
``"max_plus_one"`` (transformers <= 5.2) resumes at the block's largest position + 1,
``"spatial_extent"`` (>= 5.3, PR #43972) at ``s + max(h, w)``. Images and ``t = 1`` blocks agree;
Qwen2/2.5-VL videos with ``t > 1`` differ. The default is the installed transformers' rule.

The computation is vectorized over the tokens and over the sequences of a packed stream: no Python
loop runs per token, per block or per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from tightpack.errors import TightpackError, check_choice

__all__ = ["QwenVLRope", "qwen_vl_positions"]

MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
RESUME_RULES = ("spatial_extent", "max_plus_one")
# transformers model_type -> the position rule of its family (the MoE variants share the dense one's)
_MODEL_TYPES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl",
                "qwen3_vl_moe": "qwen3_vl"}  # fmt: skip
_FIRST_SPATIAL_EXTENT_VERSION = (5, 3)


def transformers_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed transformers, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("transformers")
    except PackageNotFoundError:
        return None
    major, minor = (int(part) if part.isdigit() else 0 for part in [*text.split("."), "0"][:2])
    return major, minor


def installed_resume_rule() -> str:
    """The text-resume rule of the installed transformers: ``"spatial_extent"`` from 5.3 on, else
    ``"max_plus_one"``; ``"spatial_extent"`` (the reference's pin) when transformers is absent."""
    installed = transformers_version()
    return (
        "max_plus_one"
        if installed is not None and installed < _FIRST_SPATIAL_EXTENT_VERSION
        else "spatial_extent"
    )


@dataclasses.dataclass(frozen=True)
class QwenVLRope:
    """How a Qwen-VL model places its tokens: the model family, its special tokens and merge size.

    ``rule=None`` resolves to `installed_resume_rule` on construction, so the rule in effect is
    recorded on the object. Build it from a transformers config with `from_config`.

    >>> rope = QwenVLRope("qwen2_vl", image_token_id=9, rule="spatial_extent")
    >>> rope.model, rope.merge_size, rope.rule
    ('qwen2_vl', 2, 'spatial_extent')
    """

    model: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
    image_token_id: int
    video_token_id: int | None = None
    merge_size: int = 2
    tokens_per_second: float = 1.0
    rule: str | None = None

    def __post_init__(self) -> None:
        check_choice("QwenVLRope.model", self.model, MODELS)
        if self.rule is None:
            object.__setattr__(self, "rule", installed_resume_rule())
        check_choice("QwenVLRope.rule", self.rule, RESUME_RULES)
        if self.merge_size < 1:
            raise TightpackError(f"QwenVLRope.merge_size must be >= 1, got {self.merge_size}")

    @classmethod
    def from_config(cls, config: Any, *, rule: str | None = None) -> QwenVLRope:
        """The positions of a transformers Qwen-VL config (``model.config``)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            raise TightpackError(
                f"multimodal positions are defined for the Qwen-VL model types {sorted(_MODEL_TYPES)}, "
                f"got {model_type!r}"
            )
        vision = config.vision_config
        return cls(
            _MODEL_TYPES[model_type],
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            merge_size=vision.spatial_merge_size,
            tokens_per_second=getattr(vision, "tokens_per_second", 1.0),
            rule=rule,
        )


def _grids(grid_thw: Any) -> torch.Tensor:
    if grid_thw is None:
        return torch.zeros(0, 3, dtype=torch.long)
    return torch.as_tensor(grid_thw).reshape(-1, 3).long()


def _items(
    rope: QwenVLRope, image_grid_thw: Any, video_grid_thw: Any, second_per_grid_ts: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per visual item of each modality: merged grids ``[n, 3]`` and temporal intervals ``[n]``."""
    images, videos = _grids(image_grid_thw), _grids(video_grid_thw)
    if rope.model == "qwen3_vl":  # one block per temporal patch, timestamps in the text between them
        videos = torch.repeat_interleave(videos, videos[:, 0], dim=0)
        videos[:, 0] = 1
    scale = torch.tensor([1, rope.merge_size, rope.merge_size])
    for kind, grids in (("image", images), ("video", videos)):
        if bool((grids < 1).any()) or bool((grids % scale).any()):
            raise TightpackError(
                f"{kind}_grid_thw {grids.tolist()} must hold positive patch counts, the height and width "
                f"multiples of the merge size {rope.merge_size} (as the processor gives them)"
            )
    image_intervals = torch.ones(len(images), dtype=torch.float32)
    video_intervals = torch.ones(len(videos), dtype=torch.float32)
    if rope.model == "qwen2_5_vl" and second_per_grid_ts is None:  # transformers takes 1 s per grid
        video_intervals *= rope.tokens_per_second
    elif rope.model == "qwen2_5_vl":
        # in the precision transformers multiplies in, so the truncation below matches theirs bit for
        # bit: a float tensor's own dtype (bf16 and f16 included: mixed precision hands those);
        # Python numbers as one float32 rounding of a float64 product
        if isinstance(second_per_grid_ts, (list, tuple)) and any(
            isinstance(value, torch.Tensor) for value in second_per_grid_ts
        ):  # transformers iterates the list: each 0-d tensor keeps its dtype
            second_per_grid_ts = torch.stack(
                [torch.as_tensor(value).reshape(()) for value in second_per_grid_ts]
            )
        if isinstance(second_per_grid_ts, torch.Tensor) and second_per_grid_ts.is_floating_point():
            video_intervals = rope.tokens_per_second * second_per_grid_ts.reshape(-1)
        else:
            seconds = torch.as_tensor(second_per_grid_ts, dtype=torch.float64).reshape(-1)
            video_intervals = (rope.tokens_per_second * seconds).to(torch.float32)
        if len(video_intervals) != len(videos):
            raise TightpackError(
                f"second_per_grid_ts has {len(video_intervals)} values for {len(videos)} videos; give one "
                "per video"
            )
    return images // scale, image_intervals, videos // scale, video_intervals


def _locate(
    rank: torch.Tensor, grids: torch.Tensor, intervals: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Given each visual token's rank among the tokens of one modality, its item's grid, interval
    and its offset inside the item (meaningful where the token is of that modality)."""
    counts = grids.prod(dim=1)
    ends = torch.cumsum(counts, 0)
    found, total = int(rank.max()) + 1 if len(rank) else 0, int(ends[-1]) if len(ends) else 0
    if found != total:
        raise TightpackError(
            f"{found} {kind} tokens for {len(grids)} {kind}s of {total} tokens in all "
            f"(per {kind}: {counts.tolist()}); expand the placeholders with the same grid_thw"
        )
    if not len(grids):  # no item of this modality: any row serves, as no token uses it
        grids, intervals = grids.new_ones(1, 3), intervals.new_ones(1)
        counts, ends = counts.new_ones(1), counts.new_ones(1)
    item = torch.searchsorted(ends, rank.clamp(0, len(rank)), right=True).clamp(max=len(grids) - 1)
    return grids[item], intervals[item], rank - (ends[item] - counts[item])


def _scaled(
    frames: torch.Tensor, is_image: torch.Tensor, image_interval: torch.Tensor, video_interval: torch.Tensor
) -> torch.Tensor:
    """``floor(frame * interval)`` per visual token, each modality in its own intervals' dtype: one
    float tensor for both would promote bf16/f16 video intervals to float32, truncating differently
    from transformers, which scales each block on its own."""
    image_steps = (frames.to(image_interval.dtype) * image_interval).long()
    video_steps = (frames.to(video_interval.dtype) * video_interval).long()
    return torch.where(is_image, image_steps, video_steps)


def qwen_vl_positions(
    input_ids: torch.Tensor,
    rope: QwenVLRope,
    *,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    lengths: Any = None,
) -> torch.Tensor:
    """Multimodal positions ``[3, L]`` (int64) of token ids ``[L]`` with expanded placeholders.

    ``lengths`` splits ``input_ids`` into consecutive sequences whose positions each restart at 0 (a
    packed stream without gaps); the grids are then those of all sequences in stream order. Images
    and videos are matched to their tokens in order, so two blocks may also follow each other
    without text between them.

    >>> rope = QwenVLRope("qwen2_vl", image_token_id=9, rule="spatial_extent")
    >>> qwen_vl_positions(torch.tensor([5, 9, 9, 9, 9, 6]), rope, image_grid_thw=[[1, 4, 4]]).tolist()
    [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    """
    ids = torch.as_tensor(input_ids).reshape(-1)
    images, image_intervals, videos, video_intervals = _items(
        rope, image_grid_thw, video_grid_thw, second_per_grid_ts
    )
    if len(videos) and rope.video_token_id is None:
        raise TightpackError("video_grid_thw given but QwenVLRope.video_token_id is None")
    kind = (ids == rope.image_token_id).to(torch.int8)  # 0 text, 1 image, 2 video
    if rope.video_token_id is not None:
        kind += 2 * (ids == rope.video_token_id).to(torch.int8)
    where = torch.nonzero(kind).reshape(-1)  # the visual tokens, in stream order
    visual_kind = kind[where]
    is_image = visual_kind == 1
    image_rank = torch.cumsum(is_image, 0) - 1
    video_rank = torch.arange(len(where)) - 1 - image_rank
    image_grid, image_interval, image_offset = _locate(
        torch.where(is_image, image_rank, -1), images, image_intervals, "image"
    )
    video_grid, video_interval, video_offset = _locate(
        torch.where(is_image, -1, video_rank), videos, video_intervals, "video"
    )
    grid = torch.where(is_image[:, None], image_grid, video_grid)
    offset = torch.where(is_image, image_offset, video_offset)

    previous = kind[(where - 1).clamp(min=0)]
    broken = (offset > 0) & ((where == 0) | (previous != visual_kind))
    if bool(broken.any()):
        raise TightpackError(
            f"a visual block is interrupted at token {int(where[broken][0])}: the tokens of one image or "
            "video must be contiguous"
        )

    t, h, w = grid.unbind(1)
    frame = offset // (h * w)
    temporal = _scaled(frame, is_image, image_interval, video_interval)
    height, width = (offset // w) % h, offset % w
    if rope.rule == "spatial_extent":
        block_advance = torch.maximum(h, w)
    else:
        last_temporal = _scaled(t - 1, is_image, image_interval, video_interval)
        block_advance = torch.maximum(last_temporal, torch.maximum(h, w) - 1) + 1

    advance = torch.ones(len(ids), dtype=torch.long)  # text moves the position by one
    advance[where] = torch.where(offset == 0, block_advance, 0)
    before = torch.cumsum(advance, 0) - advance  # position in effect at each token
    if lengths is not None:
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        if int(lengths.sum()) != len(ids) or bool((lengths <= 0).any()):
            raise TightpackError(
                f"sequence lengths {lengths.tolist()} must be positive and sum to the {len(ids)} tokens"
            )
        starts = torch.cumsum(lengths, 0) - lengths
        before -= torch.repeat_interleave(before[starts], lengths)
    positions = before.expand(3, -1).clone()
    block_start = before[where - offset]
    positions[:, where] = block_start + torch.stack([temporal, height, width])
    return positions
