"""Tokens per packed row with collate-time packing: fixed micro-batch size vs a token budget.

Demo-corpus lengths (as ``tightpack pack`` formats them, capped at the budget). Fixed-MBS batching
takes shuffled samples ``MBS`` at a time, with ``MBS`` chosen so that the mean row holds about the
budget; `TokenBudgetBatchSampler` plans the micro-batches with the packer. Reports the spread of
tokens per row (a row is what one step's attention and memory must fit).

One size (the whole demo corpus, seconds); ``--full`` runs the same.

    .venv/bin/python benchmarks/bench_token_budget.py [--budget 4096]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, table, write_result
from tightpack.runtime.samplers import TokenBudgetBatchSampler

COLUMNS = ["batching", "rows", "mean", "std", "cv", "p5", "p50", "p95", "max", "over budget"]


def describe(name: str, tokens: np.ndarray, budget: int) -> list:
    """Print the spread of tokens per row; returns it as a row of `COLUMNS`."""
    p5, p50, p95 = np.percentile(tokens, [5, 50, 95])
    cv = float(tokens.std() / tokens.mean())
    print(
        f"{name:<22} rows {len(tokens):>6,}  mean {tokens.mean():>7,.0f}  std {tokens.std():>7,.0f}  "
        f"cv {tokens.std() / tokens.mean():5.2f}  p5 {p5:>6,.0f}  p50 {p50:>6,.0f}  p95 {p95:>6,.0f}  "
        f"max {tokens.max():>6,}  over budget {int((tokens > budget).sum()):,}"
    )
    stats = [float(tokens.mean()), float(tokens.std()), cv, float(p5), float(p50), float(p95)]
    return [name, len(tokens), *stats, int(tokens.max()), int((tokens > budget).sum())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "token_budget")
    args = parser.parse_args()
    size = choose_size(args, quick={}, full={})
    started = time.perf_counter()
    lengths = np.minimum(demo_runtime_lengths(), args.budget)
    micro_batch_size = max(1, round(args.budget / lengths.mean()))
    order = np.random.default_rng(args.seed).permutation(len(lengths))
    rows = len(order) // micro_batch_size
    fixed = lengths[order[: rows * micro_batch_size]].reshape(rows, micro_batch_size).sum(axis=1)
    sampler = TokenBudgetBatchSampler(lengths, args.budget, seed=args.seed)
    budgeted = np.array([lengths[batch].sum() for batch in sampler])
    print(f"demo corpus: {len(lengths):,} samples, mean {lengths.mean():.0f} tokens; budget {args.budget}")
    rows = [
        describe(f"fixed MBS = {micro_batch_size}", fixed, args.budget),
        describe("token budget (bfd)", budgeted, args.budget),
    ]
    figures = {
        "tokens per row, cv, fixed micro-batch size": rows[0][4],
        "tokens per row, cv, token budget": rows[1][4],
        "rows over the budget, fixed micro-batch size": rows[0][-1],
        "rows over the budget, token budget": rows[1][-1],
    }
    title = f"tokens per row, demo corpus ({len(lengths):,} samples), budget {args.budget}"
    write_result("token_budget", args, size, figures=figures, tables={"rows": table(COLUMNS, rows, title)},
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
