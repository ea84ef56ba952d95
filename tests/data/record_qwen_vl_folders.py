"""Record what real Qwen-VL processors, loaded with AutoProcessor from folders written every way
transformers reads them, give for pictures and videos of several sizes; for tests/test_vision_folders.py.

Video processors need torchvision, which cannot be installed next to this project's pinned CPU torch,
so run this where torchvision imports (see tests/data/record_qwen_vl_video.py), e.g.:

    /tmp/tv/bin/python tests/data/record_qwen_vl_folders.py tests/data/qwen_vl_processor_folders.json

Folder forms, per family: ``nested`` (processor.save_pretrained in transformers 5: one
processor_config.json), ``legacy`` (preprocessor_config.json and video_preprocessor_config.json),
``no_video_file`` (preprocessor_config.json only: transformers builds the video processor from it),
``pixels_and_size`` (``size`` together with ``min_pixels``/``max_pixels`` in both files).
The JSON keeps each folder's files, so the test writes the same folders.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.qwen_vl_models import drawn_frame, drawn_video

IMAGES = [(240, 320), (500, 375), (3000, 4000), (20, 30), (1080, 1920)]
VIDEOS = [(4, 240, 320), (8, 100, 1000), (6, 56, 84), (4, 720, 1280)]
PIXELS = {"min_pixels": 128 * 28 * 28, "max_pixels": 300 * 28 * 28}


def processor(kind: str):
    from tokenizers import Tokenizer, models
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    specials = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<unk>"]
    words = Tokenizer(models.WordLevel({token: i for i, token in enumerate(specials)}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", additional_special_tokens=specials[:4]
    )
    if kind == "qwen3_vl":
        image = Qwen2VLImageProcessor(
            patch_size=16, size={"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}
        )
        return Qwen3VLProcessor(
            image_processor=image, tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor()
        )
    classes = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}
    return classes[kind](
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )


def folder_forms(kind: str) -> dict[str, dict[str, dict]]:
    """Folder form -> file name -> JSON content (tokenizer files left out: sizes do not read them)."""
    with tempfile.TemporaryDirectory() as folder:
        processor(kind).save_pretrained(folder)
        nested = json.loads((Path(folder) / "processor_config.json").read_text())
    image, video = nested["image_processor"], nested["video_processor"]
    config = {"config.json": {"model_type": kind}}
    return {
        "nested": config | {"processor_config.json": nested},
        "legacy": config | {"preprocessor_config.json": image, "video_preprocessor_config.json": video},
        "no_video_file": config | {"preprocessor_config.json": image},
        "pixels_and_size": config | {"preprocessor_config.json": image | PIXELS,
                                     "video_preprocessor_config.json": video | PIXELS},
    }  # fmt: skip


def main(out: str) -> None:
    import transformers
    from transformers import AutoProcessor

    recorded = {"transformers": transformers.__version__, "folders": {}}
    for kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        for form, files in folder_forms(kind).items():
            with tempfile.TemporaryDirectory() as folder:
                for name, content in files.items():
                    (Path(folder) / name).write_text(json.dumps(content))
                loaded = processor(kind)  # tokenizer files, then the settings under test on top
                loaded.tokenizer.save_pretrained(folder)
                loaded = AutoProcessor.from_pretrained(folder)
            images = []
            for k, (height, width) in enumerate(IMAGES):
                out_image = loaded.image_processor(
                    images=[drawn_frame(height, width, k)], return_tensors="pt"
                )
                images.append([height, width, *out_image["image_grid_thw"][0].tolist()])
            videos = []
            for k, (frames, height, width) in enumerate(VIDEOS):
                video = drawn_video(frames, height, width, k)
                out_video = loaded.video_processor(
                    videos=[video], do_sample_frames=False, return_tensors="pt"
                )
                videos.append([frames, height, width, *out_video["video_grid_thw"][0].tolist()])
            recorded["folders"][f"{kind}/{form}"] = {"files": files, "images": images, "videos": videos}
            print(kind, form, images, videos)
    Path(out).write_text(json.dumps(recorded, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
