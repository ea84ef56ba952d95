"""Record transformers' own Qwen-VL ``get_rope_index`` on fixed cases, for tests/test_mrope.py.

The installed transformers checks the default rule directly; this script keeps what another version
computes, so the other text-resume rule is checked against real code too. Run it in a virtual
environment holding that version (torch and transformers only), e.g. for the rule of <= 5.2:

    python -m venv /tmp/t52 && /tmp/t52/bin/pip install torch==2.13.0 transformers==5.2.0 pillow
    /tmp/t52/bin/python tests/data/record_qwen_vl_rope.py tests/data/qwen_vl_rope_transformers_5_2.json

transformers <= 5.2 truncates ``second_per_grid_ts`` to an integer (fixed by PR #48669), so the
Qwen2.5-VL cases use whole seconds, where truncation changes nothing.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.qwen_vl_models import IMAGE, MODELS, TOKENS_PER_SECOND, VIDEO, block_ids, tiny_model

CASES = {
    "images": ([("image", (1, 4, 6)), ("image", (1, 2, 2))], []),
    "video": ([("video", (3, 4, 4))], [2.0]),
    "mixed": (
        [("image", (1, 4, 6)), ("video", (2, 2, 4)), ("image", (1, 6, 2)), ("video", (4, 2, 2))],
        [1.0, 3.0],
    ),
}


def record(kind: str, blocks: list, seconds: list[float]) -> dict:
    ids = block_ids(kind, blocks, [2, *range(len(blocks))])
    grids = {
        f"{modality}_grid_thw": [list(g) for m, g in blocks if m == modality] or None
        for modality in ("image", "video")
    }
    model = tiny_model(kind, dtype=torch.float32).model
    kwargs = {key: torch.tensor(value) for key, value in grids.items() if value}
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = ((ids == IMAGE).int() + 2 * (ids == VIDEO).int())[None]
    if kind == "qwen2_5_vl" and seconds:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    positions, _ = model.get_rope_index(ids[None], **kwargs)
    return {
        "input_ids": ids.tolist(),
        **grids,
        "second_per_grid_ts": seconds if kind == "qwen2_5_vl" else None,
        "positions": positions[:, 0].tolist(),
    }


if __name__ == "__main__":
    cases = {f"{kind}/{name}": record(kind, *case) for kind in MODELS for name, case in CASES.items()}
    out = {"transformers": transformers.__version__, "tokens_per_second": TOKENS_PER_SECOND, "cases": cases}
    Path(sys.argv[1]).write_text(json.dumps(out) + "\n")
