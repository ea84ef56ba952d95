"""A whole training run with Hugging Face ``Trainer``, packed against padded, same samples, same steps.

A small Llama (random init, fixed seed, float32) trains for ``--steps`` optimizer steps on the demo
corpus (real conversations, chat format, loss on the assistant turns) twice, in one process:

- ``padded``: each micro-batch right-padded to its longest row with a 2-D attention mask, as
  ``DataCollatorForSeq2Seq`` gives it (tests/hf_training.py ``PaddedCollator``);
- ``packed``: each micro-batch one ``[1, T]`` row from `tightpack.runtime.hf_trainer.PackingCollator`.

The micro-batches are the same in both runs: the samples with a target, in a seeded random order,
each micro-batch filled with the next samples while they fit in ``--budget`` tokens (what a padded run
by token budget over a shuffled dataset sees; the dataset is the list of micro-batches). So both
optimise the same per-token loss (normalized by each step's supervised tokens) on the same samples in
the same order, and the loss curves must agree step by step. Tokenizer: a 1,024-token byte-level
BPE trained on the corpus, so the output layer does not dominate a model this small. Measured: real
tokens per second of each run (``trainer.train()`` wall time, the fastest of ``--rounds`` interleaved
rounds), the padding share of the padded run, the largest relative difference of the two loss curves.
The floor of any run is its real tokens: where the cost is per token (the linear layers, which
dominate real models), packing gains at most ``1 / (1 - padding share)``. A packed row's attention on
CPU (sdpa with a block-diagonal mask) costs the whole row squared, not the sum of its sequences'
squares: with a small model attention dominates (its share grows with ``row / (6 * hidden)``), so a
larger ``--hidden`` moves the ratio towards that bound.

Writes ``training.json``, and with matplotlib (``pip install 'tightpack[plots]'``) ``training_loss.png``
(both loss curves on one chart) and ``training_throughput.png`` (tokens/s bars), into ``--out``.

Quick: 10 steps, 1 round; ``--full``: the documented 50 steps, 2 rounds.

    .venv/bin/python benchmarks/bench_training.py [--full] [--budget 4096] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_training import PaddedCollator, micro_batches, small_tokenizer, tiny_llama, train

from results import add_size_options, choose_size, write_result
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.hf_trainer import PackingCollator


def plot(results: dict, out: Path) -> list[str]:
    """The two PNGs, or nothing (with the reason) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'tightpack[plots]')")
        return []
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for name, style in (("padded", "-"), ("packed", "--")):
        losses = results[name]["losses"]
        axis.plot(range(1, len(losses) + 1), losses, style, label=name)
    axis.set(xlabel="optimizer step", ylabel="loss", title="Loss per step: packed and padded runs")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "training_loss.png", dpi=120)
    figure, axis = plt.subplots(figsize=(4, 3.5))
    names = ["padded", "packed"]
    axis.bar(names, [results[name]["tokens_per_second"] for name in names], color=["#999999", "#2a7ab0"])
    axis.set(ylabel="real tokens / s", title="Training throughput (CPU)")
    figure.tight_layout()
    figure.savefig(out / "training_throughput.png", dpi=120)
    return ["training_loss.png", "training_throughput.png"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (quick 10, full 50)")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (and per pack)")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds, the fastest counts")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate, constant")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    add_size_options(parser, "training")
    args = parser.parse_args()
    size = choose_size(args, quick={"steps": 10, "rounds": 1}, full={"steps": 50, "rounds": 2})
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    rows = [row for chunk in default_corpus().read(0, 4096) for row in chunk.parsed_rows()]
    tokenizer = small_tokenizer(rows)
    groups = micro_batches(rows, tokenizer, args.budget, max_length=args.budget, shuffled_seed=0)
    needed = args.steps * args.accumulation
    if len(groups) < needed:
        raise SystemExit(f"{len(groups)} micro-batches for {needed}: lower --steps or --budget")
    model_text = f"Llama hidden {args.hidden}, {args.layers} layers, vocab {tokenizer.vocab_size}"
    machine = f"{torch.get_num_threads()} threads, {platform.machine()}"
    print(f"{len(rows)} rows -> {len(groups)} micro-batches of <= {args.budget} tokens; {args.steps} steps "
          f"x {args.accumulation}; {model_text}; {machine}")  # fmt: skip
    collators = {
        "padded": PaddedCollator(tokenizer, args.budget),
        "packed": PackingCollator(tokenizer, max_length=args.budget),
    }
    results = {}
    for _ in range(args.rounds):  # interleaved; the fastest round of each counts (the losses are the same)
        for name, collator in collators.items():
            model = tiny_llama(tokenizer.vocab_size, hidden=args.hidden, layers=args.layers)
            with tempfile.TemporaryDirectory() as workdir:
                run = train(
                    model, groups, collator, steps=args.steps, accumulation=args.accumulation, lr=args.lr,
                    workdir=workdir,
                )  # fmt: skip
            run["tokens_per_second"] = run["tokens"] / run["seconds"]
            if name not in results or run["seconds"] < results[name]["seconds"]:
                results[name] = run
    padded, packed = results["padded"], results["packed"]
    difference = np.max(np.abs(np.array(packed["losses"]) - padded["losses"]) / np.abs(padded["losses"]))
    share = padded["padding"] / (padded["padding"] + padded["tokens"])
    print(f"\n{'run':<7} {'real tokens':>11} {'padding':>8} {'seconds':>8} {'tokens/s':>9}")
    for name, run in results.items():
        seconds, speed = f"{run['seconds']:>8.1f}", f"{run['tokens_per_second']:>9,.0f}"
        print(f"{name:<7} {run['tokens']:>11,} {run['padding']:>8,} {seconds} {speed}")
    speedup = packed["tokens_per_second"] / padded["tokens_per_second"]
    print(f"\npacked / padded throughput: {speedup:.2f}x (goal >= 1.5x); padding share of the padded run: "
          f"{share:.1%}, so {1 / (1 - share):.2f}x where the cost is per token; largest relative loss "
          f"difference over {args.steps} steps: {difference:.2e} (must be <= 1e-4)")  # fmt: skip
    summary = {"settings": vars(args) | {"out": str(args.out), "result": str(args.result)},
               "padding_share": share,
               "speedup": speedup,
               "max_relative_loss_difference": float(difference), "runs": results}  # fmt: skip
    summary["plots"] = plot(results, args.out)
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"written: {args.out / 'training.json'}" + "".join(f", {args.out / p}" for p in summary["plots"]))
    figures = {
        "steps": args.steps,
        "padded: real tokens per second": padded["tokens_per_second"],
        "packed: real tokens per second": packed["tokens_per_second"],
        "packed / padded throughput": speedup,
        "padding share of the padded run (%)": 100 * share,
        "bound where the cost is per token, 1 / (1 - padding share)": 1 / (1 - share),
        "largest relative difference of the loss curves": float(difference),
    }
    report = {key: value for key, value in summary.items() if key != "runs"}
    write_result(
        "training", args, size, figures=figures, report=report, seconds=time.perf_counter() - started
    )


if __name__ == "__main__":
    main()
