"""Media problems of vision rows: found when packing and reported as bad rows naming the file and the
row (honoured by ``--skip-bad-lines``); media that cannot be read at training time is a
`TightpackError` naming the file and the pack; the loader reads pictures as the processor does."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.conftest import run_main, write_jsonl
from tests.qwen_vl_models import drawn_frame
from tests.vision_corpus import chat_row, processor_folder, vision_tokenizer
from tightpack.errors import TightpackError
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.prepare.vision_placeholders import QWEN_VL_TOKENS
from tightpack.prepare.vision_rows import MediaItem
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vision_packs import VisionPackedDataset, processor_media_loader

PACK_SIZE = 256
BAD_LINE = 3


def truncated_jpeg(path: Path) -> None:
    """A JPEG cut in half: its header (and so its size) reads, its pixels do not decode."""
    encoded = io.BytesIO()
    Image.fromarray(drawn_frame(112, 168, 5)).save(encoded, "JPEG")
    path.write_bytes(encoded.getvalue()[: len(encoded.getvalue()) // 2])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A data folder (pictures, processor, tokenizer) beside a picture that lies outside it."""
    base = tmp_path_factory.mktemp("vision-media")
    root = base / "data"
    (root / "media").mkdir(parents=True)
    for i, (height, width) in enumerate([(56, 84), (84, 56), (84, 84), (56, 56)]):
        Image.fromarray(drawn_frame(height, width, i)).save(root / "media" / f"picture{i}.jpg")
    truncated_jpeg(root / "media" / "truncated.jpg")
    Image.new("RGB", (402, 2), (200, 10, 10)).save(root / "media" / "wide.png")  # aspect ratio 201
    Image.fromarray(drawn_frame(56, 56, 9)).save(base / "outside.png")
    good = [chat_row(f"Question {i}?", "A drawing. " * (1 + i), f"media/picture{i}.jpg") for i in range(4)]
    tokenizer, processor = vision_tokenizer(root / "tokenizer.json"), processor_folder(root / "processor")
    return SimpleNamespace(base=base, root=root, good=good, tokenizer=tokenizer, processor=processor)


def pack(corpus, rows: list[dict], output: Path, *extra):
    source = write_jsonl(corpus.root / f"{output.name}.jsonl", rows)
    return run_main(
        ["pack", source, "--output", output, "--pack-size", PACK_SIZE, "--tokenizer", corpus.tokenizer,
         "--vision-processor", corpus.processor, *extra]
    )  # fmt: skip


def with_bad_row(corpus, picture: str) -> list[dict]:
    """The good rows with one row of ``picture`` at line `BAD_LINE`."""
    rows = list(corpus.good)
    rows.insert(BAD_LINE - 1, chat_row("What is this?", "Nothing.", picture))
    return rows


PROBLEMS = {
    "truncated JPEG": ("media/truncated.jpg", r"truncated\.jpg cannot be decoded \(image file is truncated"),
    "aspect ratio over 200": ("media/wide.png", r"wide\.png: the aspect ratio of 2 x 402 is over 200"),
    "relative path leaving the media root": (
        "../outside.png",
        r"'\.\./outside\.png' is outside the media root",
    ),
    "absolute path outside the media root": (
        "{base}/outside.png",
        r"outside\.png' is outside the media root",
    ),
}


@pytest.mark.parametrize("problem", PROBLEMS)
def test_media_problems_stop_packing_naming_the_file_and_row(corpus, tmp_path, problem):
    picture, reason = PROBLEMS[problem]
    rows = with_bad_row(corpus, picture.format(base=corpus.base))
    done = pack(corpus, rows, tmp_path / "packs")
    assert done.returncode == 2, done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"packs.jsonl:{BAD_LINE}: media " in done.stderr
    assert re.search(reason, done.stderr), done.stderr
    assert "--skip-bad-lines" in done.stderr


@pytest.mark.parametrize("problem", PROBLEMS)
def test_skip_bad_lines_skips_and_counts_media_problems(corpus, tmp_path, problem):
    picture, reason = PROBLEMS[problem]
    rows = with_bad_row(corpus, picture.format(base=corpus.base))
    done = pack(corpus, rows, tmp_path / "packs", "--skip-bad-lines")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "packs" / "manifest.json").read_text())
    assert manifest["counts"]["bad_rows"] == 1 and manifest["counts"]["packed"] == len(corpus.good)
    (bad,) = manifest["bad_rows"]
    assert bad["location"].endswith(f"packs.jsonl:{BAD_LINE}")
    assert re.search(reason, bad["reason"]), bad["reason"]


def test_decompression_bombs_are_bad_rows(corpus, tmp_path, monkeypatch):
    """PIL refuses pictures over twice its pixel limit, lowered here so that picture2 (84 x 84) is over
    it and the others (at most 56 x 84) are not: the inserted row and the good row of picture2 are bad."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 84 * 84 // 3)
    done = pack(corpus, with_bad_row(corpus, "media/picture2.jpg"), tmp_path / "packs", "--skip-bad-lines")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "packs" / "manifest.json").read_text())
    assert [bad["location"].rsplit(":", 1)[1] for bad in manifest["bad_rows"]] == [str(BAD_LINE), "4"]
    assert all(
        "cannot be decoded" in bad["reason"] and "picture2.jpg" in bad["reason"]
        for bad in manifest["bad_rows"]
    )


def test_absolute_paths_inside_the_media_root_pack(corpus, tmp_path):
    rows = with_bad_row(corpus, str(corpus.root / "media" / "picture0.jpg"))
    done = pack(corpus, rows, tmp_path / "packs")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "packs" / "manifest.json").read_text())
    assert manifest["counts"]["packed"] == len(rows) and manifest["counts"]["bad_rows"] == 0


def loader_of(corpus, folder: Path, load) -> VisionPackedDataset:
    spec = load_tokenizer(corpus.tokenizer)
    ids = {name: spec.backend.token_to_id(token) for name, token in QWEN_VL_TOKENS.items()}
    rope = QwenVLRope("qwen2_5_vl", ids["image"], ids["video"], tokens_per_second=2)
    return VisionPackedDataset(folder, PackedCollate(pack_size=PACK_SIZE, eos_id=spec.eos_id), rope, load)


def image_processor(corpus):
    """The corpus's processor as `processor_media_loader` uses it (images only: no torchvision here)."""
    from transformers import AutoImageProcessor

    return SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(corpus.processor))


@pytest.fixture
def packed_copy(corpus, tmp_path):
    """The good rows packed with their pictures copied into ``tmp_path/media``, which tests damage."""
    media = tmp_path / "media"
    media.mkdir()
    for i in range(len(corpus.good)):
        (media / f"picture{i}.jpg").write_bytes((corpus.root / "media" / f"picture{i}.jpg").read_bytes())
    done = pack(corpus, corpus.good, tmp_path / "packs", "--media-root", tmp_path, "--pack-size", 64)
    assert done.returncode == 0, done.stderr
    return tmp_path


def pictures_of_packs(folder: Path) -> list[set[str]]:
    """The picture files each pack refers to, from its ``media`` column."""
    import pyarrow.parquet as pq

    media = pq.read_table(folder / "packs-00000.idx.parquet", columns=["media"]).column("media").to_pylist()
    return [{item["path"] for sequence in pack for item in json.loads(sequence)} for pack in media]


def test_media_damaged_after_packing_names_the_file_and_pack(corpus, packed_copy):
    dataset = loader_of(
        corpus, packed_copy / "packs", processor_media_loader(image_processor(corpus), packed_copy)
    )
    packs = pictures_of_packs(packed_copy / "packs")
    assert len(dataset) == len(packs) > 1 and all(
        len(dataset[i]["image_grid_thw"]) for i in range(len(packs))
    )
    (truncated,), (deleted,) = packs[1], packs[0]  # one picture a pack (pack size 64), each its own
    truncated_jpeg(packed_copy / truncated)
    (packed_copy / deleted).unlink()
    with pytest.raises(
        TightpackError,
        match=rf"^pack 1 \(.*packs-00000\.idx\.parquet, row 1\): media file .*{truncated} cannot be read: "
        "image file is truncated",
    ):
        dataset[1]
    with pytest.raises(TightpackError, match=rf"^pack 0 .*{deleted} does not exist"):
        dataset[0]
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.raises(TightpackError, match=rf"pack 0 .*{deleted} does not exist"):  # through a worker
        next(iter(StatefulDataLoader(dataset, batch_size=None, num_workers=1)))


def test_verify_reads_the_media_again(corpus, packed_copy):
    """``tightpack verify`` finds media damaged, deleted or replaced since packing, at its pack row."""
    folder = packed_copy / "packs"
    clean = run_main(["verify", folder])
    assert clean.returncode == 0 and f"{len(corpus.good)} media items" in clean.stdout, clean.stdout
    packs = pictures_of_packs(folder)
    (truncated,), (deleted,), replaced = packs[0], packs[1], sorted(packs[2])[0]
    truncated_jpeg(packed_copy / truncated)
    (packed_copy / deleted).unlink()
    Image.fromarray(drawn_frame(168, 168, 1)).save(packed_copy / replaced, "JPEG")  # a larger picture
    found = run_main(["verify", folder])
    assert found.returncode == 1, found.stdout
    faults = [line for line in found.stdout.splitlines() if line.startswith("[media]")]
    assert len(faults) == 3, found.stdout
    assert re.search(rf"row 0, sequence 0: media file .*{truncated} cannot be decoded", faults[0])
    assert re.search(rf"row 1, sequence 0: media file .*{deleted} does not exist", faults[1])
    assert re.search(rf"row 2, sequence \d: image {replaced} has the patch grid \[1, 12, 12\] now", faults[2])
    assert run_main(["verify", folder, "--no-media"]).returncode == 0


def test_a_failing_user_loader_names_the_files_and_pack(corpus, packed_copy):
    def load(item: MediaItem) -> dict[str, torch.Tensor]:
        raise OSError("decoder failed")

    dataset = loader_of(corpus, packed_copy / "packs", load)
    (picture,) = pictures_of_packs(packed_copy / "packs")[0]
    with pytest.raises(TightpackError, match=rf"^pack 0 .*image {picture} cannot be loaded: decoder failed"):
        dataset[0]


def turned_jpeg(path: Path) -> Path:
    """A 56 x 112 (height x width) JPEG marked "rotate 90": 112 x 56 to transformers' ``load_image``."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.fromarray(drawn_frame(56, 112, 3)).save(path, exif=exif)
    return path


def test_pictures_are_packed_and_loaded_upright(corpus, tmp_path):
    """Packing sizes and the loader's pixels are the processor's on ``load_image``'s picture."""
    from transformers.image_utils import load_image

    (tmp_path / "media").mkdir()
    picture = turned_jpeg(tmp_path / "media" / "turned.jpg")
    processor = image_processor(corpus)
    expected = processor.image_processor(images=[load_image(str(picture))], return_tensors="pt")
    assert expected["image_grid_thw"].tolist() == [[1, 8, 4]]  # upright: 112 high, 56 wide
    rows = [chat_row("Which way is up?", "This way.", "media/turned.jpg")]
    done = pack(corpus, rows, tmp_path / "packs", "--media-root", tmp_path)
    assert done.returncode == 0, done.stderr
    batch = loader_of(corpus, tmp_path / "packs", processor_media_loader(processor, tmp_path))[0]
    assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(batch["pixel_values"], expected["pixel_values"])
