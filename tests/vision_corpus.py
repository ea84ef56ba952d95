"""Files for vision packing tests: a Qwen2.5-VL processor folder, a tokenizer with the Qwen-VL special
tokens, and chat rows with one image part."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from tests.qwen_vl_models import VIDEO_SIZE
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.prepare.vision_placeholders import QWEN_VL_TOKENS


def processor_folder(folder: Path) -> Path:
    """A Qwen2.5-VL processor folder as ``save_pretrained`` writes it (image and video settings)."""
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil().save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (folder / "video_preprocessor_config.json").write_text(json.dumps({"size": VIDEO_SIZE}))
    return folder


def vision_tokenizer(path: Path) -> Path:
    """The built-in tokenizer with the Qwen-VL special tokens, saved as ``tokenizer.json``."""
    backend = Tokenizer.from_str(load_tokenizer().backend_json)
    backend.add_special_tokens(list(QWEN_VL_TOKENS.values()))
    backend.save(str(path))
    return path


def chat_row(question: str, answer: str, picture: str | None = None) -> dict:
    """A user turn (an optional image part, then the question) and the assistant's answer."""
    content: list[dict] = [{"type": "text", "text": question}]
    if picture is not None:
        content.insert(0, {"type": "image", "image": picture})
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}
