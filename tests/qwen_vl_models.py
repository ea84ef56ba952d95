"""Tiny Qwen-VL models built from configs (random weights, no download) and drawn media, for the tests.

Only torch, numpy, PIL and transformers are imported, so the recording scripts in tests/data can
use this module from another transformers version's virtual environment.

Videos: transformers' video processors need torchvision, which cannot be installed next to this
project's pinned CPU torch (PyPI's torchvision fails to import beside it). `video_inputs` runs each
frame through the real image processor (same resize and normalization) and pairs the frames into
temporal patches as the video processor does; tests/data/qwen_vl_video_processor.npz, recorded
with the real video processor (tests/data/record_qwen_vl_video.py), checks that it agrees.
"""

from __future__ import annotations

import numpy as np
import torch

IMAGE, VIDEO, START, END, TIME = 90, 91, 92, 93, 7
MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TOKENS_PER_SECOND = 2
TEXT = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
TOKEN_IDS = {"image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": START,
             "vision_end_token_id": END}  # fmt: skip
# bounds on the pixels of a video (the drawn frames are within them, so no processor resizes them)
VIDEO_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 4 * 112 * 112}


def tiny_config(kind: str, **overrides):
    """A two-layer text model (hidden 32) and a one- or two-block vision tower of the given family."""
    import transformers

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32}
    if kind == "qwen2_vl":
        text = TEXT | {"rope_parameters": rope}
        vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2}
        config_class = transformers.Qwen2VLConfig
    elif kind == "qwen2_5_vl":
        text = TEXT | {"rope_parameters": rope}
        vision |= {"tokens_per_second": TOKENS_PER_SECOND, "fullatt_block_indexes": [1], "window_size": 56}
        config_class = transformers.Qwen2_5_VLConfig
    elif kind == "qwen3_vl":
        text = TEXT | {"rope_parameters": rope | {"mrope_interleaved": True}}
        vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
        config_class = transformers.Qwen3VLConfig
    else:
        raise ValueError(kind)
    return config_class(text_config=text, vision_config=vision, **TOKEN_IDS, **overrides)


def tiny_model(kind: str, attention: str = "eager", dtype: torch.dtype = torch.float64, seed: int = 0):
    """``<Family>ForConditionalGeneration`` with random weights, in ``dtype``, in eval mode (no dropout)."""
    import transformers

    names = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
             "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
             "qwen3_vl": "Qwen3VLForConditionalGeneration"}  # fmt: skip
    model_class = getattr(transformers, names[kind])  # by name: Qwen3-VL exists from transformers 4.57 only
    config = tiny_config(kind)
    config._attn_implementation = attention
    for sub in (config.text_config, config.vision_config):
        sub._attn_implementation = attention
    torch.manual_seed(seed)
    return model_class(config).to(dtype).eval()


def block_ids(kind: str, blocks: list[tuple[str, tuple[int, int, int]]], texts: list[int]) -> torch.Tensor:
    """Token ids of text runs of the given lengths (``len(blocks) + 1`` of them) around vision blocks
    ``(modality, (t, h, w))`` framed by start/end tokens; Qwen3-VL videos one temporal patch at a
    time, each after a timestamp token, as its processor writes them."""
    ids = [1] * texts[0]
    for (modality, (t, h, w)), text in zip(blocks, texts[1:], strict=True):
        token = IMAGE if modality == "image" else VIDEO
        frames = t if kind == "qwen3_vl" and modality == "video" else 1
        for _ in range(frames):
            ids += [TIME] if kind == "qwen3_vl" and token == VIDEO else []
            ids += [START] + [token] * (t * h * w // 4 // frames) + [END]
        ids += [2] * text
    return torch.tensor(ids)


def drawn_frame(height: int, width: int, seed: int) -> np.ndarray:
    """An ``[H, W, 3]`` uint8 picture: a colored field with a moving ellipse."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), color=(seed * 40 % 255, 80, 160))
    shift = seed * 3 % max(1, width // 4)
    ImageDraw.Draw(image).ellipse(
        (4 + shift, 4, width // 2 + shift, height // 2), fill=(250, seed * 70 % 255, 10)
    )
    return np.asarray(image)


def patch_size(kind: str) -> int:
    return 16 if kind == "qwen3_vl" else 14


def image_processor(kind: str, **kwargs):
    """The real image processor of the family, from its defaults (Qwen3-VL: 16-pixel patches, mean and
    std 0.5, 256^2 to 4096^2 pixels, as its published preprocessor config); ``kwargs`` override."""
    from transformers import Qwen2VLImageProcessorPil

    if kind == "qwen3_vl":
        qwen3 = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                 "size": {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}}  # fmt: skip
        kwargs = qwen3 | kwargs
    return Qwen2VLImageProcessorPil(**kwargs)


def image_inputs(kind: str, height: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of one drawn picture, from the real image processor."""
    return dict(image_processor(kind)(images=[drawn_frame(height, width, seed)], return_tensors="pt"))


def video_inputs(kind: str, frames: np.ndarray) -> dict[str, torch.Tensor]:
    """``pixel_values_videos`` ``[t*h*w, 3*2*p*p]`` and ``video_grid_thw`` ``[[t, h, w]]`` of frames
    ``[F, H, W, 3]`` (F even), as the family's video processor computes them (module docstring)."""
    p = patch_size(kind)
    out = image_processor(kind, size=VIDEO_SIZE)(images=list(frames), return_tensors="pt")
    grid = out["image_grid_thw"][0]
    patches = out["pixel_values"].reshape(len(frames), -1, 3, 2, p, p)[:, :, :, 0]  # [F, hw, C, p, p]
    pairs = patches.reshape(len(frames) // 2, 2, *patches.shape[1:])  # [t, 2, hw, C, p, p]
    pixel_values = pairs.permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * 2 * p * p)
    grid_thw = torch.tensor([[len(frames) // 2, int(grid[1]), int(grid[2])]])
    return {"pixel_values_videos": pixel_values, "video_grid_thw": grid_thw}


def drawn_video(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """``[frames, H, W, 3]`` uint8: `drawn_frame` with the ellipse moving from frame to frame."""
    return np.stack([drawn_frame(height, width, seed + k) for k in range(frames)])


def transformers_positions(model, ids: torch.Tensor, **visual) -> torch.Tensor:
    """transformers' own multimodal positions ``[3, 1, L]`` of one sample (``get_rope_index``), in the
    call form of the installed release: transformers 5 also takes each token's modality
    (``mm_token_type_ids``: 1 image, 2 video), 4.x finds them from the token ids."""
    import inspect

    rope_index = model.model.get_rope_index
    if "mm_token_type_ids" in inspect.signature(rope_index).parameters:
        visual["mm_token_type_ids"] = ((ids == IMAGE).int() + 2 * (ids == VIDEO).int())[None]
    positions, _ = rope_index(input_ids=ids[None], **visual)
    return positions
