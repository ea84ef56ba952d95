"""Multimodal positions of a packed row: tightpack against transformers' ``get_rope_index``, same run.

A pack of about 16k tokens (``--pack-tokens``) holds ``--sequences`` sequences (4) with 8 images and 2
videos between them, text filling the rest; grids as a processor gives for 392 x 560 pictures
(``[1, 28, 40]``: 280 tokens each) and 16-frame videos of 336 x 448 (``[8, 24, 32]``: 1,536 tokens
each). Per family (Qwen2-VL, Qwen2.5-VL with its temporal scaling, Qwen3-VL with per-frame blocks):

- ``transformers``: the model's own ``get_rope_index``, once per sequence (positions restart at
  every sequence, so a packer calls it per member), as the packed ``[3, T]`` row;
- ``tightpack``: `tightpack.runtime.mrope.qwen_vl_positions` over the whole pack in one call
  (``lengths=``), and once per sequence;
- ``floor``: what any solution pays to write the answer: a ``[3, T]`` int64 tensor filled from a
  ``[T]`` one (``expand(3, -1).clone()``).

Outputs are checked equal before timing. Times are the best of ``--repeats`` interleaved rounds.

Quick: 5 rounds; ``--full``: the documented 20.

    .venv/bin/python benchmarks/bench_mrope.py [--full]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.qwen_vl_models import IMAGE, MODELS, VIDEO, block_ids, tiny_model

from results import add_size_options, choose_size, table, write_result
from tightpack.runtime.mrope import QwenVLRope, qwen_vl_positions

IMAGE_GRID, VIDEO_GRID = (1, 28, 40), (8, 24, 32)


def make_pack(kind: str, pack_tokens: int, sequences: int) -> list[dict]:
    """``sequences`` samples, the images and videos dealt round-robin, text padding each to an equal share."""
    blocks = [[] for _ in range(sequences)]
    for k in range(8):
        blocks[k % sequences].append(("image", IMAGE_GRID))
    for k in range(2):
        blocks[(k * 2 + 1) % sequences].append(("video", VIDEO_GRID))
    samples, scaled = [], kind == "qwen2_5_vl"
    for mine in blocks:
        visual = len(block_ids(kind, mine, [0] * (len(mine) + 1)))
        text = max(len(mine) + 1, pack_tokens // sequences - visual)
        runs = [text // (len(mine) + 1)] * (len(mine) + 1)
        ids = block_ids(kind, mine, runs)
        images = [grid for modality, grid in mine if modality == "image"]
        videos = [grid for modality, grid in mine if modality == "video"]
        samples.append({
            "input_ids": ids,
            "image_grid_thw": torch.tensor(images) if images else None,
            "video_grid_thw": torch.tensor(videos) if videos else None,
            "second_per_grid_ts": torch.full((len(videos),), 0.5) if scaled and videos else None,
        })  # fmt: skip
    return samples


def with_transformers(model, samples: list[dict]) -> torch.Tensor:
    rows = []
    for sample in samples:
        ids = sample["input_ids"][None]
        kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        extra = (
            {"second_per_grid_ts": sample["second_per_grid_ts"]}
            if sample["second_per_grid_ts"] is not None
            else {}
        )
        positions, _ = model.get_rope_index(
            ids,
            kinds,
            image_grid_thw=sample["image_grid_thw"],
            video_grid_thw=sample["video_grid_thw"],
            **extra,
        )
        rows.append(positions[:, 0])
    return torch.cat(rows, dim=1)


def with_tightpack(rope: QwenVLRope, samples: list[dict]) -> torch.Tensor:
    def joined(key):
        present = [s[key] for s in samples if s[key] is not None]
        return torch.cat(present) if present else None

    return qwen_vl_positions(
        torch.cat([s["input_ids"] for s in samples]),
        rope,
        image_grid_thw=joined("image_grid_thw"),
        video_grid_thw=joined("video_grid_thw"),
        second_per_grid_ts=joined("second_per_grid_ts"),
        lengths=[len(s["input_ids"]) for s in samples],
    )


def per_sequence(rope: QwenVLRope, samples: list[dict]) -> torch.Tensor:
    return torch.cat(
        [
            qwen_vl_positions(s["input_ids"], rope, image_grid_thw=s["image_grid_thw"],
                              video_grid_thw=s["video_grid_thw"], second_per_grid_ts=s["second_per_grid_ts"])
            for s in samples
        ],
        dim=1,
    )  # fmt: skip


def best_of(repeats: int, contenders: dict) -> dict[str, float]:
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-tokens", type=int, default=16384)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=None, help="rounds, the best counts (5; full 20)")
    add_size_options(parser, "mrope")
    args = parser.parse_args()
    size = choose_size(args, quick={"repeats": 5}, full={"repeats": 20})
    started = time.perf_counter()
    rows = []
    torch.set_num_threads(1)
    print(f"torch threads 1; best of {args.repeats} rounds; milliseconds per pack\n")
    columns = ("transformers", "tightpack", "per seq", "floor", "speedup")
    print(f"{'family':<11} {'tokens':>6} " + " ".join(f"{c:>12}" for c in columns))
    for kind in MODELS:
        model = tiny_model(kind, dtype=torch.float32).model
        rope = QwenVLRope.from_config(model.config)
        samples = make_pack(kind, args.pack_tokens, args.sequences)
        expected = with_transformers(model, samples)
        assert torch.equal(with_tightpack(rope, samples), expected), kind
        assert torch.equal(per_sequence(rope, samples), expected), kind
        flat = expected[0].clone()
        best = best_of(args.repeats, {
            "transformers": partial(with_transformers, model, samples),
            "tightpack": partial(with_tightpack, rope, samples),
            "per seq": partial(per_sequence, rope, samples),
            "floor": partial(torch.Tensor.clone, flat.expand(3, -1)),
        })  # fmt: skip
        ms = {name: 1000 * seconds for name, seconds in best.items()}
        speedup = best["transformers"] / best["tightpack"]
        cells = [f"{ms[c]:>12.3f}" for c in columns[:-1]] + [f"{speedup:>11.1f}x"]
        print(f"{kind:<11} {expected.shape[1]:>6} " + " ".join(cells))
        rows.append([kind, int(expected.shape[1]), *(ms[c] for c in columns[:-1]), speedup])
    figures = {f"{row[0]}: transformers / tightpack": row[-1] for row in rows}
    header = ["family", "tokens", "transformers (ms)", "tightpack (ms)", "per sequence (ms)", "floor (ms)",
              "speedup"]  # fmt: skip
    title = f"positions of one packed row, torch threads 1, best of {args.repeats}"
    write_result("mrope", args, size, figures=figures, tables={"positions": table(header, rows, title)},
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
