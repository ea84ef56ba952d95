"""Vision sizes from a processor folder equal what transformers' processor, loaded from that same
folder, gives for the same file: every way the folder can be written, EXIF orientation included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.qwen_vl_models import drawn_frame
from tightpack.prepare.vision_rows import VisionSpec, vision_row
from tightpack.prepare.vision_sizes import VisionSizes

RECORDED = Path(__file__).parent / "data" / "qwen_vl_processor_folders.json"
FOLDERS = json.loads(RECORDED.read_text())["folders"]


def write_folder(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for file, content in FOLDERS[name]["files"].items():
        (folder / file).write_text(json.dumps(content))
    return folder


def image_row(path: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": path}]}]}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_video_grids_equal_the_video_processor_of_the_folder(tmp_path, name):
    """Recorded with AutoProcessor.from_pretrained on these folders (tests/data/record_qwen_vl_folders.py):
    its video processor needs torchvision, which cannot be installed beside the pinned torch."""
    sizes = VisionSizes.from_folder(write_folder(tmp_path, name))
    for frames, height, width, *grid in FOLDERS[name]["videos"]:
        assert sizes.video_grid(frames, height, width) == tuple(grid), (name, frames, height, width)
    for height, width, *grid in FOLDERS[name]["images"]:
        assert sizes.image_grid(height, width) == tuple(grid), (name, height, width)


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_image_grids_equal_the_image_processor_loaded_from_the_folder(tmp_path, name):
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    # sizes within, below and (for max_pixels) above the bounds; the recorded test has larger ones
    folder = write_folder(tmp_path / "processor", name)
    processor = AutoImageProcessor.from_pretrained(folder)
    spec = VisionSpec(VisionSizes.from_folder(folder), media_root=str(tmp_path))
    for k, (height, width) in enumerate([(240, 320), (37, 501), (700, 900)]):
        Image.fromarray(drawn_frame(height, width, k)).save(tmp_path / f"{k}.png")
        expected = processor(images=[load_image(str(tmp_path / f"{k}.png"))], return_tensors="np")
        _, (item,) = vision_row(image_row(f"{k}.png"), spec)
        assert item.grid == tuple(expected["image_grid_thw"][0].tolist()), (name, height, width)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_is_applied_as_load_image_applies_it(tmp_path, orientation):
    """A photo stored 640 x 360 with an EXIF orientation that turns it: the processor sees it turned."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    folder = write_folder(tmp_path / "processor", "qwen2_5_vl/legacy")
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(drawn_frame(360, 640, 1)).save(tmp_path / "photo.jpg", exif=exif.tobytes())
    expected = AutoImageProcessor.from_pretrained(folder)(
        images=[load_image(str(tmp_path / "photo.jpg"))], return_tensors="np"
    )
    spec = VisionSpec(VisionSizes.from_folder(folder), media_root=str(tmp_path))
    _, (item,) = vision_row(image_row("photo.jpg"), spec)
    assert item.grid == tuple(expected["image_grid_thw"][0].tolist())
    turned = orientation in (6, 8)
    assert (item.grid[1] < item.grid[2]) != turned  # landscape stays, a turned photo is portrait


def test_open_image_turns_like_load_image(tmp_path):
    from PIL import Image
    from transformers.image_utils import load_image

    from tightpack.prepare.media import open_image, picture_size

    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(drawn_frame(360, 640, 2)).save(tmp_path / "photo.jpg", exif=exif.tobytes())
    ours, theirs = open_image(tmp_path / "photo.jpg"), load_image(str(tmp_path / "photo.jpg"))
    assert np.array_equal(np.asarray(ours), np.asarray(theirs.convert("RGB")))
    assert picture_size(tmp_path / "photo.jpg") == (640, 360)


def test_the_command_line_packs_at_the_processors_sizes(tmp_path):
    """``tightpack pack --vision-processor`` on a folder as transformers 5 saves it (one
    processor_config.json) and on one without video settings: the packs' grids are the processor's."""
    import pyarrow.parquet as pq
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    from tests.conftest import run_main
    from tightpack.prepare.tokenizer import load_tokenizer
    from tightpack.prepare.vision_placeholders import QWEN_VL_TOKENS
    from tightpack.prepare.vision_rows import parse_media_json

    backend = Tokenizer.from_str(load_tokenizer().backend_json)
    backend.add_special_tokens(list(QWEN_VL_TOKENS.values()))
    backend.save(str(tmp_path / "tokenizer.json"))
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(drawn_frame(360, 640, 0)).save(tmp_path / "photo.jpg", exif=exif.tobytes())
    for k in range(4):
        Image.fromarray(drawn_frame(240, 320, k)).save(tmp_path / f"frame{k}.png")
    video = {"type": "video", "video": [f"frame{k}.png" for k in range(4)], "fps": 2.0}
    content = [{"type": "image", "image": "photo.jpg"}, video, {"type": "text", "text": "What is it?"}]
    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A drawing."}]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    for name in ("qwen2_5_vl/nested", "qwen2_5_vl/no_video_file"):
        folder = write_folder(tmp_path / name, name)
        out = tmp_path / "out" / name
        command = ["pack", tmp_path / "rows.jsonl", "--output", out, "--pack-size", 4096]
        done = run_main([*command, "--tokenizer", tmp_path / "tokenizer.json", "--vision-processor", folder])
        assert done.returncode == 0, done.stderr
        ((media,),) = (
            pq.read_table(next(out.rglob("*.parquet")), columns=["media"]).column("media").to_pylist()
        )
        image, clip = parse_media_json(media)
        expected = AutoImageProcessor.from_pretrained(folder)(
            images=[load_image(str(tmp_path / "photo.jpg"))], return_tensors="np"
        )
        assert image.grid == tuple(expected["image_grid_thw"][0].tolist())
        (recorded,) = [video[3:] for video in FOLDERS[name]["videos"] if video[:3] == [4, 240, 320]]
        assert clip.grid == tuple(recorded)


def test_a_per_frame_cap_is_refused(tmp_path):
    """``cap_pixels_per_frame`` changes the video processors' sizes in a way tightpack does not model."""
    from tightpack.errors import TightpackError

    folder = write_folder(tmp_path, "qwen3_vl/legacy")
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video | {"cap_pixels_per_frame": True}))
    with pytest.raises(TightpackError, match="cap_pixels_per_frame"):
        VisionSizes.from_folder(folder)
