"""Offline vision packing end to end: rows with image and video files -> packs that reference the
media -> the training-time loader's batch, equal to the collate-time packed batch of the same rows."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from tests.qwen_vl_models import VIDEO_SIZE, drawn_frame, image_processor, tiny_model, video_inputs
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.prepare.vision_placeholders import QWEN_VL_TOKENS
from tightpack.prepare.vision_rows import MediaItem, VisionSpec
from tightpack.prepare.vision_sizes import VisionSizes
from tightpack.runtime import thd
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.hf import packed_forward
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vision_packs import (
    VisionPackedDataset,
    VisionSFTCollator,
    load_visuals,
    processor_media_loader,
)

PACK_SIZE = 320


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Pictures, frame folders, a tokenizer with the Qwen-VL special tokens, and 14 chat rows mixing
    text-only, image, video, and image + video samples."""
    root = tmp_path_factory.mktemp("vision")
    (root / "media").mkdir()
    for i, (height, width) in enumerate([(56, 84), (112, 56), (84, 84), (64, 96)]):
        Image.fromarray(drawn_frame(height, width, i)).save(root / "media" / f"picture{i}.png")
    for k in range(4):
        Image.fromarray(drawn_frame(64, 96, 10 + k)).save(root / "media" / f"frame{k}.png")
    backend = Tokenizer.from_str(load_tokenizer().backend_json)
    backend.add_special_tokens(list(QWEN_VL_TOKENS.values()))
    backend.save(str(root / "tokenizer.json"))
    rows = []
    for i in range(14):
        content = [{"type": "text", "text": f"Question {i}: what do you see?"}]
        if i % 4 in (1, 3):
            content.insert(0, {"type": "image", "image": f"media/picture{i % 4}.png"})
        if i % 4 in (2, 3):
            frames = [f"media/frame{k}.png" for k in range(4)]
            content.append({"type": "video", "video": frames, "fps": 2.0})
        answer = " ".join(["It is a drawing."] * (1 + i % 5))
        rows.append(
            {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}
        )
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root, rows, load_tokenizer(root / "tokenizer.json")


def media_loader(kind: str, root: Path):
    """Images through the real image processor; videos as tests/qwen_vl_models.video_inputs (the video
    processors need torchvision, which this project cannot install)."""

    def load(item: MediaItem) -> dict[str, torch.Tensor]:
        pictures = [Image.open(root / path).convert("RGB") for path in item.paths]
        if item.kind == "image":
            return dict(image_processor(kind)(images=pictures, return_tensors="pt"))
        visual = video_inputs(kind, np.stack([np.asarray(picture) for picture in pictures]))
        if kind == "qwen2_5_vl":
            visual["second_per_grid_ts"] = torch.tensor([item.second_per_grid(2)])
        return visual

    return load


def vision_spec(kind: str, root: Path) -> VisionSpec:
    low, high = VIDEO_SIZE["shortest_edge"], VIDEO_SIZE["longest_edge"]
    return VisionSpec(VisionSizes(kind, video_min_pixels=low, video_max_pixels=high), media_root=str(root))


@pytest.mark.parametrize(
    ("kind", "multiple"), [("qwen2_vl", 1), ("qwen2_vl", 4), ("qwen2_5_vl", 4), ("qwen3_vl", 4)]
)
def test_loader_batch_equals_the_collate_time_batch(corpus, tmp_path, kind, multiple):
    root, rows, spec = corpus
    vision = vision_spec(kind, root)
    config = PackConfig(
        packed_sequence_size=PACK_SIZE, pad_seq_to_mult=multiple, format=FormatConfig(vision=vision)
    )
    result = pack_dataset(root / "rows.jsonl", tmp_path / "packs", config, tokenizer=spec)
    assert result.counts["packed"] == len(rows) and result.counts["dropped_long"] == 0

    ids = {name: spec.backend.token_to_id(token) for name, token in QWEN_VL_TOKENS.items()}
    rope = QwenVLRope(kind, ids["image"], ids["video"], tokens_per_second=2)
    load = media_loader(kind, root)
    collate = PackedCollate(
        pack_size=PACK_SIZE, eos_id=spec.eos_id, pad_seq_length_to_mult=1, pad_seq_to_mult=multiple
    )
    loader = VisionPackedDataset(tmp_path / "packs", collate, rope, load)
    collator = VisionSFTCollator(spec, vision, rope, load, pad_to_multiple_of=multiple)
    table = pq.read_table(sorted((tmp_path / "packs").glob("*.parquet"))[0])
    assert len(loader) == table.num_rows > 1
    seen = 0
    for index in range(len(loader)):
        packed = loader[index]
        members = table.column("sample_index")[index].as_py()
        expected = collator([rows[i] for i in members])
        seen += len(members)
        logical, physical = thd.logical_boundaries(expected), thd.physical_boundaries(expected)
        n = len(members)
        assert torch.equal(thd.logical_boundaries(packed)[: n + 1], logical)
        assert torch.equal(thd.physical_boundaries(packed)[: n + 1], physical)
        width = int(physical[-1])
        mask = packed["loss_mask"].reshape(-1)[:width].to(expected["loss_mask"].dtype)
        assert torch.equal(mask, expected["loss_mask"].reshape(-1))
        supervised = mask.bool()  # the collate's labels are raw next tokens; -100 marks the others here
        assert torch.equal(
            packed["labels"].reshape(-1)[:width][supervised], expected["labels"].reshape(-1)[supervised]
        )
        assert (expected["labels"].reshape(-1)[~supervised] == -100).all()
        assert torch.equal(thd.token_tensor(packed).reshape(-1)[:width], expected["input_ids"].reshape(-1))
        assert torch.equal(packed["mrope_position_ids"][..., :width], expected["mrope_position_ids"])
        real = expected["padding_mask"].reshape(-1) == 0  # text positions (row 0 of the HF forward's)
        assert torch.equal(
            packed["position_ids"].reshape(-1)[:width][real], expected["position_ids"].reshape(-1)[real]
        )
        for key in (
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
            "second_per_grid_ts",
        ):
            assert (key in packed) == (key in expected), key
            if key in packed:
                assert torch.equal(packed[key], expected[key]), key
    assert seen == len(rows)


def test_loader_batches_train_a_model(corpus, tmp_path):
    """The loader's batch goes through the packed Qwen-VL forward as is."""
    root, _, spec = corpus
    vision = vision_spec("qwen2_vl", root)
    config = PackConfig(packed_sequence_size=PACK_SIZE, format=FormatConfig(vision=vision))
    pack_dataset(root / "rows.jsonl", tmp_path / "packs", config, tokenizer=spec)
    ids = {name: spec.backend.token_to_id(token) for name, token in QWEN_VL_TOKENS.items()}
    model = tiny_model("qwen2_vl", dtype=torch.float32)
    model.resize_token_embeddings(spec.vocab_size)
    model.config.image_token_id, model.config.video_token_id = ids["image"], ids["video"]
    model.model.config.image_token_id, model.model.config.video_token_id = ids["image"], ids["video"]
    rope = QwenVLRope.from_config(model.config)
    collate = PackedCollate(pack_size=PACK_SIZE, eos_id=spec.eos_id, pad_seq_length_to_mult=1)
    batch = VisionPackedDataset(tmp_path / "packs", collate, rope, media_loader("qwen2_vl", root))[0]
    logits = packed_forward(model, batch).logits
    assert logits.shape[:2] == thd.token_tensor(batch).shape and torch.isfinite(logits).all()


def test_stale_grids_are_refused(corpus):
    root, _, _ = corpus
    item = MediaItem("image", ("media/picture0.png",), (1, 2, 2))
    with pytest.raises(TightpackError, match="changed since; re-pack"):
        load_visuals([item], media_loader("qwen2_vl", root))


def test_media_problems_are_bad_rows(corpus, tmp_path):
    root, _, spec = corpus
    bad = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "media/missing.png"}]},
                         {"role": "assistant", "content": "No."}]}]  # fmt: skip
    config = PackConfig(
        packed_sequence_size=PACK_SIZE, format=FormatConfig(vision=vision_spec("qwen2_vl", root))
    )
    with pytest.raises(TightpackError, match=r"missing\.png does not exist"):
        pack_dataset(bad, tmp_path / "packs", config, tokenizer=spec)
    with pytest.raises(TightpackError, match="the tokenizer has no token"):
        pack_dataset(bad, tmp_path / "packs", config, tokenizer=load_tokenizer())


def test_the_command_line_packs_vision_rows(corpus, tmp_path):
    """``tightpack pack --vision-processor``: the processor folder gives the sizes, media paths start at
    the input's folder; a user error exits 2 with one line."""
    import subprocess
    import sys

    from transformers import Qwen2VLImageProcessorPil

    root, rows, _ = corpus
    processor = tmp_path / "processor"
    Qwen2VLImageProcessorPil().save_pretrained(processor)
    (processor / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (processor / "video_preprocessor_config.json").write_text(json.dumps({"size": VIDEO_SIZE}))
    command = [sys.executable, "-m", "tightpack.cli", "pack", str(root / "rows.jsonl")]
    command += ["--output", str(tmp_path / "out"), "--pack-size", str(PACK_SIZE)]
    command += ["--tokenizer", str(root / "tokenizer.json"), "--vision-processor", str(processor)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    vision = manifest["settings"]["format"]["vision"]
    assert vision["sizes"]["model"] == "qwen2_5_vl" and vision["media_root"] == str(root.resolve())
    assert manifest["counts"]["packed"] == len(rows)
    missing = subprocess.run(
        [*command[:-1], str(tmp_path / "nowhere"), "--overwrite"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no preprocessor_config.json" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_vision_tokens_spelled_in_text_are_bad_rows(corpus, tmp_path):
    """Text that spells a vision token would be read as an image: the row is refused, the others pack."""
    root, rows, spec = corpus
    spelled = {
        "messages": [
            {"role": "user", "content": "What is <|image_pad|>?"},
            {"role": "assistant", "content": "A token."},
        ]
    }
    plain = {"input": "Name a color.", "output": "Blue."}  # prompt-completion rows pack too
    config = PackConfig(
        packed_sequence_size=PACK_SIZE,
        skip_bad_lines=True,
        format=FormatConfig(vision=vision_spec("qwen2_vl", root)),
    )
    result = pack_dataset([rows[1], spelled, plain], tmp_path / "packs", config, tokenizer=spec)
    assert result.counts["bad_rows"] == 1 and result.counts["packed"] == 2
    manifest = json.loads((tmp_path / "packs" / "manifest.json").read_text())
    assert "the vision tokens are reserved" in manifest["bad_rows"][0]["reason"]


def test_processor_media_loader_runs_the_image_processor(corpus):
    from types import SimpleNamespace

    root, _, _ = corpus
    load = processor_media_loader(SimpleNamespace(image_processor=image_processor("qwen2_vl")), root)
    item = MediaItem("image", ("media/picture1.png",), (1, 8, 4))
    visual = load_visuals([item], load)
    expected = image_processor("qwen2_vl")(
        images=[Image.open(root / item.paths[0]).convert("RGB")], return_tensors="pt"
    )
    assert torch.equal(visual["pixel_values"], expected["pixel_values"]) and visual[
        "image_grid_thw"
    ].tolist() == [[1, 8, 4]]


def _supervised_targets(batch) -> list[tuple[int, ...]]:
    """Each sequence's supervised targets in a THD batch (labels where the loss mask is set)."""
    bounds = thd.physical_boundaries(batch).tolist()
    labels, mask = batch["labels"].reshape(-1), batch["loss_mask"].reshape(-1)
    return [tuple(labels[a:b][mask[a:b] > 0].tolist()) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("long_samples", ["truncate", "drop"])
def test_long_samples_at_collate_time_equal_the_offline_packs(corpus, tmp_path, long_samples):
    """Rows over ``max_length``: text-only ones are cut (or dropped) as ``tightpack pack
    --max-seq-length`` cuts them, ones with media are left out as offline; the same supervised
    targets and the manifest's counts."""
    root, rows, spec = corpus
    long_text = " ".join(f"word{i}" for i in range(60))
    rows = rows + [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": f"{long_text} {i}?"}]},
                      {"role": "assistant", "content": f"Answer {i}."}]}
        for i in range(3)
    ] + [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "media/picture1.png"},
                                                   {"type": "text", "text": long_text}]},
                      {"role": "assistant", "content": "A long look."}]}
    ]  # fmt: skip
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    vision = vision_spec("qwen2_vl", root)
    cap = 48
    config = PackConfig(
        packed_sequence_size=PACK_SIZE, max_seq_length=cap, long_samples=long_samples,
        format=FormatConfig(vision=vision),
    )  # fmt: skip
    counts = pack_dataset(source, tmp_path / "packs", config, tokenizer=spec).counts
    collate = PackedCollate(
        pack_size=PACK_SIZE, eos_id=spec.eos_id, pad_seq_length_to_mult=1, pad_seq_to_mult=1
    )
    packs = PackedDataset(tmp_path / "packs")
    theirs = [seq for i in range(len(packs)) for seq in _supervised_targets(collate([packs[i]]))]

    ids = {name: spec.backend.token_to_id(token) for name, token in QWEN_VL_TOKENS.items()}
    rope = QwenVLRope("qwen2_vl", ids["image"], ids["video"], tokens_per_second=2)
    collator = VisionSFTCollator(
        spec, vision, rope, media_loader("qwen2_vl", root), max_length=cap, long_samples=long_samples
    )
    ours = _supervised_targets(collator(rows))
    assert sorted(ours) == sorted(theirs)
    totals = collator.long_sample_counts
    assert totals["dropped_long"] == counts["dropped_long"] > 0
    assert totals["truncated"] == counts["truncated"] == (3 if long_samples == "truncate" else 0)
    assert totals["fed"] == counts["packed"] and totals["supervised_lost"] == counts["supervised_lost"]
    with pytest.raises(TightpackError, match="no sample of this batch of 1 has a supervised token"):
        collator([rows[-1]])
