"""What the equivalence probe costs, against one training step on the same packed row.

A Llama (random init, float32, ``--hidden`` wide, ``--layers`` deep) gets one packed row of
``--samples`` demo conversations from `tightpack.runtime.hf_trainer.PackingCollator`. In one process,
interleaved over ``--rounds`` rounds (fastest kept for each):

- ``step``: one training step on that row: forward, loss, backward, AdamW step (what every step pays);
- ``probe``: `tightpack.runtime.equivalence.check_packing` on the same row: five forwards without
  gradients on at most 128 + 3 x 32 tokens cut from it (what the first step pays once more).

The probe's floor is those five forwards (about 4 x 224 + 96 tokens, no backward), so its ratio to a
step falls as the row grows. Also prints the probe's figures (cross-sequence dependence, the calibrated
leak) for the model, and the family table of docs/equivalence-probe.md: `check_packing` on the tiny
models of tests/tiny_families.py (float32, one row of 6 samples), cross_sequence, leak and verdict.

Quick: 2 rounds; ``--full``: the documented 5.

    .venv/bin/python benchmarks/bench_probe.py [--hidden 256] [--layers 4] [--samples 16] [--full]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_training import small_tokenizer, tiny_llama
from tests.tiny_families import FAMILIES, tiny_model

from results import add_size_options, choose_size, table, write_result
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.equivalence import check_packing, probe_model_inputs
from tightpack.runtime.hf_trainer import PackingCollator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None, help="rounds, the fastest counts (2; full 5)")
    add_size_options(parser, "probe")
    args = parser.parse_args()
    size = choose_size(args, quick={"rounds": 2}, full={"rounds": 5})
    started = time.perf_counter()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [row for chunk in default_corpus().read(0, 256) for row in chunk.parsed_rows()][:96]
    tokenizer = small_tokenizer(rows)
    batch = PackingCollator(tokenizer)(rows[: args.samples])
    model = tiny_llama(tokenizer.vocab_size, hidden=args.hidden, layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model.train()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    report = check_packing(model, batch)  # warm-up (and the figures)
    step()
    times: dict[str, list[float]] = {"step": [], "probe": []}
    for _ in range(args.rounds):
        for name, run in (("step", step), ("probe", lambda: check_packing(model, batch))):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in times.items()}
    result = {
        "row_tokens": int(batch["input_ids"].shape[1]),
        "sequences": int(len(batch["cu_seq_lens_q"]) - 1),
        "hidden": args.hidden,
        "layers": args.layers,
        "threads": torch.get_num_threads(),
        "step_s": round(best["step"], 4),
        "probe_s": round(best["probe"], 4),
        "probe_per_step": round(best["probe"] / best["step"], 4),
        "probe_tokens": report.tokens,
        "cross_sequence": report.cross_sequence,
        "calibrated_leak": report.leak,
    }
    print(json.dumps(result, indent=2))
    family_batch = PackingCollator(tokenizer)(rows[:6])
    print(f"{'family':10s} {'cross_sequence':>15s} {'leak':>10s}  verdict")
    rows = []
    for family in FAMILIES:
        try:
            probe = probe_model_inputs(tiny_model(family), family_batch)
        except Exception as error:  # a family transformers itself refuses to run packed
            print(f"{family:10s} {'-':>15s} {'-':>10s}  raises {type(error).__name__}: {str(error)[:60]}")
            rows.append([family, None, None, f"raises {type(error).__name__}"])
            continue
        verdict = "pass" if probe.passed else "leak"
        print(f"{family:10s} {probe.cross_sequence:15.3g} {probe.leak:10.3g}  {verdict}")
        rows.append([family, probe.cross_sequence, probe.leak, verdict])
    figures = {
        "packed row (tokens)": result["row_tokens"],
        "one training step (s)": result["step_s"],
        "the probe (s)": result["probe_s"],
        "probe / step": result["probe_per_step"],
        "cross-sequence dependence": result["cross_sequence"],
        "calibrated leak": result["calibrated_leak"],
    }
    families = table(["family", "cross_sequence", "leak", "verdict"], rows, "check_packing on tiny models")
    write_result("probe", args, size, figures=figures, tables={"families": families}, report=result,
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
