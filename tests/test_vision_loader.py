"""The documented training-time loader (`VisionPackedDataset` + `PackedCollate`) on packs written by
``tightpack pack --vision-processor``, at every alignment multiple and batch width: the rounded width
(the collate's default), fixed-width packs (``pad_to_max_length``) and static boundary shapes
(``pad_cu_seqlens``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.conftest import run_main, write_jsonl
from tests.qwen_vl_models import drawn_frame, tiny_model
from tests.vision_corpus import chat_row, processor_folder, vision_tokenizer
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.prepare.vision_placeholders import QWEN_VL_TOKENS
from tightpack.runtime import thd
from tightpack.runtime.collate import PackedCollate, PackingMetadata
from tightpack.runtime.hf import packed_forward
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vision_packs import VisionPackedDataset, processor_media_loader

PACK_SIZE = 256
MULTIPLES = (1, 4, 8)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Thirteen rows (text-only and JPEG/PNG images) packed by the command line at multiples 1, 4, 8."""
    root = tmp_path_factory.mktemp("vision-loader")
    (root / "media").mkdir()
    pictures = []
    for i, (height, width) in enumerate([(56, 84), (112, 56), (84, 84)]):
        name = f"media/picture{i}.{'jpg' if i % 2 else 'png'}"
        Image.fromarray(drawn_frame(height, width, i)).save(root / name)
        pictures.append(name)
    rows = [
        chat_row(
            f"Question {i}?", " ".join(["It is a drawing."] * (1 + i % 4)), pictures[i % 3] if i % 4 else None
        )
        for i in range(13)
    ]
    write_jsonl(root / "rows.jsonl", rows)
    tokenizer, processor = vision_tokenizer(root / "tokenizer.json"), processor_folder(root / "processor")
    for multiple in MULTIPLES:
        done = run_main(
            ["pack", root / "rows.jsonl", "--output", root / f"packs-{multiple}", "--pack-size", PACK_SIZE,
             "--tokenizer", tokenizer, "--vision-processor", processor, "--pad-seq-to-mult", multiple]
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    spec = load_tokenizer(tokenizer)
    ids = {name: spec.backend.token_to_id(token) for name, token in QWEN_VL_TOKENS.items()}
    rope = QwenVLRope("qwen2_5_vl", ids["image"], ids["video"], tokens_per_second=2)
    from transformers import AutoImageProcessor

    load = processor_media_loader(
        SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(processor)), root
    )
    return SimpleNamespace(root=root, rows=rows, spec=spec, ids=ids, rope=rope, load=load)


def collate_for(packed, multiple: int, width: str) -> PackedCollate:
    """The packs' collate with one of the batch widths: ``narrow`` (the longest row, no rounding),
    ``rounded`` (to the default multiple of 16), ``fixed`` (the pack size), ``static`` (fixed width and
    static boundary shapes)."""
    settings: dict = {"pack_size": PACK_SIZE, "eos_id": packed.spec.eos_id, "pad_seq_to_mult": multiple}
    if width == "narrow":
        settings["pad_seq_length_to_mult"] = 1
    elif width in ("fixed", "static"):
        settings["pad_to_max_length"] = True
    if width == "static":
        entries = json.loads((packed.root / f"packs-{multiple}" / "metadata.json").read_text())
        settings |= {"pad_cu_seqlens": True, "metadata": PackingMetadata.from_entries(entries)}
    return PackedCollate(**settings)


@pytest.mark.parametrize("multiple", MULTIPLES)
@pytest.mark.parametrize("width", ["rounded", "fixed", "static"])
def test_every_pack_loads_at_every_multiple_and_width(packed, multiple, width):
    """Each pack's batch holds the same members, tokens, positions and pixels as the narrowest batch of
    the same pack; past its width there is padding only (no loss)."""
    folder = packed.root / f"packs-{multiple}"
    narrow = VisionPackedDataset(folder, collate_for(packed, multiple, "narrow"), packed.rope, packed.load)
    wide = VisionPackedDataset(folder, collate_for(packed, multiple, width), packed.rope, packed.load)
    assert len(wide) == len(narrow) > 1
    images = 0
    for index in range(len(wide)):
        expected, batch = narrow[index], wide[index]
        n = int(expected["total_tokens"])
        assert batch["total_tokens"] == (PACK_SIZE if width != "rounded" else -(-n // 16) * 16)
        members = len(thd.logical_boundaries(expected))
        assert torch.equal(thd.logical_boundaries(batch)[:members], thd.logical_boundaries(expected))
        assert torch.equal(thd.token_tensor(batch)[:, :n], thd.token_tensor(expected))
        assert torch.equal(batch["mrope_position_ids"][..., :n], expected["mrope_position_ids"])
        assert not batch["loss_mask"][:, n:].any()
        for key in ("pixel_values", "image_grid_thw"):
            assert (key in batch) == (key in expected)
            if key in batch:
                assert torch.equal(batch[key], expected[key])
        images += len(batch.get("image_grid_thw", []))
    assert images == sum(1 for row in packed.rows if len(row["messages"][0]["content"]) == 2)


def test_fixed_width_aligned_batch_trains_as_the_narrow_one(packed):
    """Through the packed Qwen2.5-VL forward, a fixed-width batch of multiple-8 packs gives the narrow
    batch's logits on every token of the narrow batch."""
    model = tiny_model("qwen2_5_vl", dtype=torch.float64)
    model.resize_token_embeddings(packed.spec.vocab_size)
    for config in (model.config, model.model.config):
        config.image_token_id, config.video_token_id = packed.ids["image"], packed.ids["video"]
    folder = packed.root / "packs-8"
    narrow = VisionPackedDataset(folder, collate_for(packed, 8, "narrow"), packed.rope, packed.load)[0]
    fixed = VisionPackedDataset(folder, collate_for(packed, 8, "fixed"), packed.rope, packed.load)[0]
    n = int(narrow["total_tokens"])
    with torch.no_grad():
        expected, logits = packed_forward(model, narrow).logits, packed_forward(model, fixed).logits
    assert logits.shape[1] == PACK_SIZE > n
    torch.testing.assert_close(logits[:, :n], expected, rtol=0, atol=1e-9)
