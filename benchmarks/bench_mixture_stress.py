"""Random mixtures the planner was not tuned on: time, fill and the worst global batch of each.

Each case draws 2 to 5 sources of lognormal lengths (medians 30, 200, 800 or 2,500 tokens, cut to the
pack), each with its own share of supervised tokens, random weights by tokens, supervised tokens or
samples, a repetition cap of 1, 3 or 20, and a pack size of 2,048, 4,096 or 8,192; the mixture is the
largest the cap allows. ``plan_mixture`` (global batches of 64 packs) is timed against ``plan_packs``
(best-fit decreasing, the default) over the same chosen samples, one core, CPU time; beside them the
packs of each (the fill) and the mixture's worst global batch. Several cases cannot reach the deal's
half-point aim (a few large samples of a small source): their time is what the exchanges spend before
they give up. The seeds fix the cases; benchmarks report, they never assert::

    .venv/bin/python benchmarks/bench_mixture_stress.py --full
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__" and os.environ.get("OMP_NUM_THREADS") != "1":
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    os.execv(sys.executable, [sys.executable, *sys.argv])  # BLAS pools at one thread, set before import

import numpy as np

from results import add_size_options, choose_size, table, write_result
from tightpack.core.mixture import resolve_mixture
from tightpack.core.mixture_plan import plan_mixture
from tightpack.core.planner import plan_packs

QUICK = {"seeds": 2, "scale": 5000}
FULL = {"seeds": 5, "scale": 20000}
CASES_PER_SEED = 8
WINDOW = 64


def draw_case(rng: np.random.Generator, scale: int) -> dict:
    """One random mixture: lengths, supervised tokens and source of every sample, and its settings."""
    sources = int(rng.integers(2, 6))
    pack_size = int(rng.choice([2048, 4096, 8192]))
    lengths, supervised, source = [], [], []
    for s in range(sources):
        count = int(rng.integers(scale // 10, scale))
        median = float(rng.choice([30, 200, 800, 2500]))
        spread = rng.uniform(0.3, 1.2)
        tokens = np.clip(rng.lognormal(np.log(median), spread, count), 5, pack_size).astype(np.int64)
        share = rng.uniform(0.005, 0.9)
        learned = np.maximum(1, (tokens * rng.uniform(0.5, 1.5, count) * share).astype(np.int64))
        lengths.append(tokens)
        supervised.append(np.minimum(learned, tokens))
        source.append(np.full(count, s))
    weights = rng.dirichlet(np.ones(sources))
    by = str(rng.choice(["tokens", "supervised-tokens", "samples"]))
    cap = float(rng.choice([1, 3, 20]))
    return {
        "lengths": np.concatenate(lengths), "supervised": np.concatenate(supervised),
        "source": np.concatenate(source), "weights": weights, "by": by, "cap": cap, "pack_size": pack_size,
    }  # fmt: skip


def run_case(case: dict) -> dict:
    lengths, supervised = case["lengths"], case["supervised"]
    chosen = resolve_mixture(
        lengths, supervised, case["source"], case["weights"], by=case["by"], max_repetitions=case["cap"]
    )
    measures = {"tokens": lengths, "supervised-tokens": supervised, "samples": np.ones_like(lengths)}
    measure = measures[case["by"]]
    start = time.process_time()
    mixed = plan_mixture(chosen, lengths, measure, case["pack_size"], window=WINDOW)
    mixed_seconds = time.process_time() - start
    start = time.process_time()
    unmixed = plan_packs(lengths[chosen.samples], case["pack_size"])
    unmixed_seconds = time.process_time() - start
    return {
        "sources": len(case["weights"]), "pack_size": case["pack_size"], "by": case["by"], "cap": case["cap"],
        "samples": len(chosen.samples), "packs": len(mixed.plan), "packs_unmixed": len(unmixed),
        "plan_mixture_ms": 1e3 * mixed_seconds, "plan_packs_ms": 1e3 * unmixed_seconds,
        "worst_points": mixed.windows.points,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1, {CASES_PER_SEED} cases each")
    parser.add_argument("--scale", type=int, default=None, help="most samples of a source")
    add_size_options(parser, "mixture_stress")
    args = parser.parse_args()
    size = choose_size(args, QUICK, FULL)
    started = time.perf_counter()
    cases = []
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        for _ in range(CASES_PER_SEED):
            cases.append(run_case(draw_case(rng, args.scale)))
            c = cases[-1]
            print(
                f"seed {seed} S={c['sources']} pack {c['pack_size']:>5} by {c['by']:<17} cap {c['cap']:>4g}: "
                f"{c['samples']:>9,} samples, {c['packs']:>8,} packs (unmixed {c['packs_unmixed']:,}); "
                f"plan_mixture {c['plan_mixture_ms']:8.1f} ms, plan_packs {c['plan_packs_ms']:6.1f} ms; "
                f"worst batch {c['worst_points']:.2f} points",
                flush=True,
            )
    figures = {
        "cases": len(cases),
        "plan_mixture total (s, CPU)": sum(c["plan_mixture_ms"] for c in cases) / 1e3,
        "plan_packs total (s, CPU)": sum(c["plan_packs_ms"] for c in cases) / 1e3,
        "slowest plan_mixture (ms)": max(c["plan_mixture_ms"] for c in cases),
        "worst batches summed (points)": sum(c["worst_points"] for c in cases),
        "cases with a batch over 2 points": sum(c["worst_points"] > 2 for c in cases),
        "most extra packs over unmixed (%)": max(100 * (c["packs"] / c["packs_unmixed"] - 1) for c in cases),
    }
    print()
    for label, value in figures.items():
        print(f"{label}: {round(value, 3)}")
    columns = ["sources", "pack size", "by", "cap", "samples", "packs", "packs unmixed", "plan_mixture ms",
               "plan_packs ms", "worst global batch of 64 packs (points)"]  # fmt: skip
    keys = ["sources", "pack_size", "by", "cap", "samples", "packs", "packs_unmixed", "plan_mixture_ms",
            "plan_packs_ms", "worst_points"]  # fmt: skip
    rows = [[c[k] for k in keys] for c in cases]
    tables = {"cases": table(columns, rows, "every random mixture, in seed order")}
    write_result(
        "mixture_stress", args, size, figures=figures, tables=tables, report={"cases": cases},
        seconds=time.perf_counter() - started,
    )  # fmt: skip


if __name__ == "__main__":
    main()
