"""Multimodal positions of Qwen2-VL, Qwen2.5-VL and Qwen3-VL against transformers' own get_rope_index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.qwen_vl_models import IMAGE, MODELS, TOKENS_PER_SECOND, VIDEO, block_ids, tiny_model
from tightpack.errors import TightpackError
from tightpack.runtime.mrope import QwenVLRope, installed_resume_rule, qwen_vl_positions

RECORDED_5_2 = Path(__file__).parent / "data" / "qwen_vl_rope_transformers_5_2.json"


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind, dtype=torch.float32) for kind in MODELS}


def transformers_positions(model, ids, images, videos, seconds):
    kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    kwargs = {"second_per_grid_ts": seconds} if seconds is not None else {}
    positions, _ = model.model.get_rope_index(
        ids[None], kinds[None], image_grid_thw=images, video_grid_thw=videos, **kwargs
    )
    return positions[:, 0]


def split(blocks):
    images = [grid for modality, grid in blocks if modality == "image"]
    videos = [grid for modality, grid in blocks if modality == "video"]
    return (torch.tensor(images) if images else None), (torch.tensor(videos) if videos else None)


CASES = {
    "images": [("image", (1, 4, 6)), ("image", (1, 2, 2))],
    "video": [("video", (3, 4, 4))],
    "several_blocks": [
        ("image", (1, 2, 4)),
        ("video", (2, 2, 2)),
        ("image", (1, 6, 2)),
        ("video", (4, 2, 4)),
    ],
    "text_only": [],
}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("case", CASES)
def test_positions_equal_transformers(models, kind, case):
    blocks = CASES[case]
    ids = block_ids(kind, blocks, [3] + [2] * len(blocks))
    images, videos = split(blocks)
    seconds = (
        torch.tensor([0.5, 1 / 3][: len(videos)]) if kind == "qwen2_5_vl" and videos is not None else None
    )
    rope = QwenVLRope.from_config(models[kind].config)
    ours = qwen_vl_positions(
        ids, rope, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=seconds
    )
    assert torch.equal(ours, transformers_positions(models[kind], ids, images, videos, seconds))


grid = st.tuples(st.integers(1, 4), st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 8]))
layouts = st.lists(st.tuples(st.sampled_from(["image", "video"]), grid), max_size=4)


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(
    kind=st.sampled_from(MODELS),
    blocks=layouts,
    texts=st.lists(st.integers(0, 5), min_size=5, max_size=5),
    seconds=st.lists(st.sampled_from([0.1, 0.25, 1 / 3, 0.5, 1.0, 2.0]), min_size=4, max_size=4),
)
def test_positions_equal_transformers_on_any_layout(models, kind, blocks, texts, seconds):
    blocks = [(m, (1 if m == "image" else t, h, w)) for m, (t, h, w) in blocks]
    ids = block_ids(kind, blocks, [texts[0] + 1, *texts[1 : len(blocks) + 1]])
    images, videos = split(blocks)
    per_video = torch.tensor(seconds[: len(videos)]) if kind == "qwen2_5_vl" and videos is not None else None
    rope = QwenVLRope.from_config(models[kind].config)
    ours = qwen_vl_positions(
        ids, rope, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=per_video
    )
    assert torch.equal(ours, transformers_positions(models[kind], ids, images, videos, per_video))


SECONDS = [0.7, 0.15]


@pytest.mark.parametrize(
    "seconds",
    [
        None,
        SECONDS,
        torch.tensor(SECONDS),
        torch.tensor(SECONDS, dtype=torch.float64),
        torch.tensor([1 / 3, 0.35]),
    ],
)
def test_temporal_scaling_in_the_precision_transformers_uses(models, seconds):
    """Over 12 temporal patches, these intervals truncate differently in float32 and float64 (checked:
    computing a float32 tensor's positions in float64 differs from transformers)."""
    blocks = [("video", (12, 2, 2)), ("video", (12, 2, 4))]
    ids = block_ids("qwen2_5_vl", blocks, [1, 1, 1])
    _, videos = split(blocks)
    rope = QwenVLRope.from_config(models["qwen2_5_vl"].config)
    ours = qwen_vl_positions(ids, rope, video_grid_thw=videos, second_per_grid_ts=seconds)
    assert torch.equal(ours, transformers_positions(models["qwen2_5_vl"], ids, None, videos, seconds))


SECOND_FORMS = {
    "float16": lambda values: torch.tensor(values, dtype=torch.float16),
    "bfloat16": lambda values: torch.tensor(values, dtype=torch.bfloat16),
    "float32": lambda values: torch.tensor(values, dtype=torch.float32),
    "float64": lambda values: torch.tensor(values, dtype=torch.float64),
    "list": list,
    "list_of_bfloat16": lambda values: [torch.tensor(v, dtype=torch.bfloat16) for v in values],
}


@pytest.mark.parametrize("form", SECOND_FORMS)
@pytest.mark.parametrize("with_image", [False, True])
def test_temporal_positions_in_the_seconds_own_dtype(models, form, with_image):
    """Mixed precision hands ``second_per_grid_ts`` as a bf16/f16 tensor: transformers scales the
    frame index in that dtype (0.44 s in bfloat16: frame 25 at 22, not float32's 21), images or not."""
    blocks = [("image", (1, 2, 2))] * with_image + [("video", (26, 2, 2)), ("video", (40, 2, 4))]
    ids = block_ids("qwen2_5_vl", blocks, [1] * (len(blocks) + 1))
    images, videos = split(blocks)
    seconds = SECOND_FORMS[form]([0.44, 0.37])
    rope = QwenVLRope.from_config(models["qwen2_5_vl"].config)
    ours = qwen_vl_positions(
        ids, rope, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=seconds
    )
    theirs = transformers_positions(models["qwen2_5_vl"], ids, images, videos, seconds)
    assert torch.equal(ours, theirs)


@settings(max_examples=settings.default.max_examples // 2, deadline=None)
@given(
    form=st.sampled_from(sorted(SECOND_FORMS)),
    seconds=st.lists(st.integers(5, 400).map(lambda hundredths: hundredths / 100), min_size=2, max_size=2),
    frames=st.lists(st.integers(1, 64), min_size=2, max_size=2),
)
def test_temporal_positions_equal_transformers_for_any_seconds(models, form, seconds, frames):
    blocks = [("image", (1, 2, 2)), ("video", (frames[0], 2, 2)), ("video", (frames[1], 2, 4))]
    ids = block_ids("qwen2_5_vl", blocks, [1, 1, 0, 2])
    images, videos = split(blocks)
    per_video = SECOND_FORMS[form](seconds)
    rope = QwenVLRope.from_config(models["qwen2_5_vl"].config)
    ours = qwen_vl_positions(
        ids, rope, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=per_video
    )
    assert torch.equal(ours, transformers_positions(models["qwen2_5_vl"], ids, images, videos, per_video))


def test_the_other_rule_equals_transformers_5_2():
    """transformers 5.2 resumed text at the largest position + 1 (tests/data/record_qwen_vl_rope.py)."""
    recorded = json.loads(RECORDED_5_2.read_text())
    assert recorded["transformers"] == "5.2.0"
    differs = []
    for name, case in recorded["cases"].items():
        kind = name.split("/")[0]
        ids = torch.tensor(case["input_ids"])
        grids = {"image_grid_thw": case.get("image_grid_thw"), "video_grid_thw": case.get("video_grid_thw"),
                 "second_per_grid_ts": case["second_per_grid_ts"]}  # fmt: skip
        old = QwenVLRope(
            kind, IMAGE, VIDEO, tokens_per_second=recorded["tokens_per_second"], rule="max_plus_one"
        )
        assert qwen_vl_positions(ids, old, **grids).tolist() == case["positions"], name
        new = QwenVLRope(
            kind, IMAGE, VIDEO, tokens_per_second=recorded["tokens_per_second"], rule="spatial_extent"
        )
        if qwen_vl_positions(ids, new, **grids).tolist() != case["positions"]:
            differs.append(name)
    # the rules part on Qwen2/2.5-VL videos of more than one temporal patch, nowhere else
    assert sorted(differs) == ["qwen2_5_vl/mixed", "qwen2_5_vl/video", "qwen2_vl/mixed", "qwen2_vl/video"]


def test_default_rule_is_the_installed_transformers_rule():
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    assert installed_resume_rule() == ("spatial_extent" if (major, minor) >= (5, 3) else "max_plus_one")
    assert QwenVLRope("qwen2_vl", IMAGE).rule == installed_resume_rule()


def test_packed_stream_restarts_positions_at_every_sequence():
    rope = QwenVLRope("qwen2_5_vl", IMAGE, VIDEO, tokens_per_second=TOKENS_PER_SECOND)
    samples = [
        (block_ids("qwen2_5_vl", [("image", (1, 4, 4))], [2, 1]), [[1, 4, 4]], None, None),
        (torch.tensor([5, 6, 7]), None, None, None),
        (block_ids("qwen2_5_vl", [("video", (2, 2, 4))], [1, 3]), None, [[2, 2, 4]], [0.5]),
        (block_ids("qwen2_5_vl", [("video", (3, 2, 2)), ("image", (1, 2, 2))], [1, 0, 2]), [[1, 2, 2]],
         [[3, 2, 2]], [2.0]),
    ]  # fmt: skip
    separate = [
        qwen_vl_positions(ids, rope, image_grid_thw=i, video_grid_thw=v, second_per_grid_ts=s)
        for ids, i, v, s in samples
    ]
    images = [g for _, i, _, _ in samples if i for g in i]
    videos = [g for _, _, v, _ in samples if v for g in v]
    seconds = [x for _, _, v, s in samples if v for x in s]
    together = qwen_vl_positions(
        torch.cat([ids for ids, *_ in samples]), rope, image_grid_thw=images, video_grid_thw=videos,
        second_per_grid_ts=seconds, lengths=[len(ids) for ids, *_ in samples],
    )  # fmt: skip
    assert torch.equal(together, torch.cat(separate, dim=1))


def test_adjacent_blocks_need_no_text_between_them():
    rope = QwenVLRope("qwen2_vl", IMAGE, VIDEO, rule="spatial_extent")
    ids = torch.tensor([1] + [IMAGE] * 2 + [IMAGE] * 4 + [3])
    positions = qwen_vl_positions(ids, rope, image_grid_thw=[[1, 2, 4], [1, 4, 4]])
    assert positions[:, :4].tolist() == [[0, 1, 1, 3], [0, 1, 1, 3], [0, 1, 2, 3]]
    assert positions[:, -1].tolist() == [5, 5, 5]


@pytest.mark.parametrize(
    ("ids", "grids", "message"),
    [
        ([1, IMAGE, IMAGE, 2], {"image_grid_thw": [[1, 4, 4]]}, "2 image tokens for 1 images of 4 tokens"),
        ([IMAGE, IMAGE, 2, IMAGE, IMAGE], {"image_grid_thw": [[1, 4, 4]]}, "interrupted at token 3"),
        ([IMAGE, VIDEO, IMAGE, IMAGE], {"image_grid_thw": [[1, 2, 6]], "video_grid_thw": [[1, 2, 2]]},
         "interrupted at token 2"),
        ([VIDEO], {"video_grid_thw": [[1, 2, 2]], "second_per_grid_ts": [1.0, 2.0]}, "2 values for 1 videos"),
    ],
)  # fmt: skip
def test_errors_say_what_is_wrong(ids, grids, message):
    rope = QwenVLRope("qwen2_5_vl", IMAGE, VIDEO)
    with pytest.raises(TightpackError, match=message):
        qwen_vl_positions(torch.tensor(ids), rope, **grids)


def test_rope_settings_are_checked():
    with pytest.raises(TightpackError, match=r"QwenVLRope\.model must be one of"):
        QwenVLRope("llava", IMAGE)
    with pytest.raises(TightpackError, match=r"QwenVLRope\.rule must be one of"):
        QwenVLRope("qwen2_vl", IMAGE, rule="newest")
    with pytest.raises(TightpackError, match="video_token_id is None"):
        qwen_vl_positions(torch.tensor([1]), QwenVLRope("qwen2_vl", IMAGE), video_grid_thw=[[1, 2, 2]])

    class Llama:
        model_type = "llama"

    with pytest.raises(TightpackError, match="Qwen-VL model types"):
        QwenVLRope.from_config(Llama())
