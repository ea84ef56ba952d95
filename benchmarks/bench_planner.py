"""Planner benchmark: tightpack's four algorithms against ``lightbinpack.obfd`` on demo-corpus lengths.

Lengths are the runtime lengths (GPT-2 tokens) of the demo corpus as ``tightpack pack`` formats it
(`demo_lengths.py`), resampled with replacement to ``--n`` samples and capped at ``--pack-size``.
Every algorithm packs the same lengths in the same run; the best of ``--repeats`` wall times is
reported with the number of packs and the lower bound ``ceil(sum / pack_size)``.

``obfd`` takes a Python list and returns lists; it is timed on a list prepared beforehand, so its
time excludes the numpy-to-list conversion (its most favourable setting).

Benchmarks report, they never assert::

    .venv/bin/python benchmarks/bench_planner.py --n 10000000 --pack-size 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import lightbinpack
import numpy as np

from demo_lengths import demo_runtime_lengths
from tightpack.core.planner import ALGORITHMS, plan_packs

REFERENCE = "lightbinpack.obfd"


def sample_lengths(source: np.ndarray, n: int, pack_size: int, seed: int) -> np.ndarray:
    """``n`` lengths drawn with replacement from ``source``, capped at ``pack_size``."""
    return np.minimum(np.random.default_rng(seed).choice(source, size=n, replace=True), pack_size)


def best_time(run: Callable[[], int], repeats: int) -> tuple[float, int]:
    """Best wall time of ``repeats`` calls of ``run`` and the pack count of the last call."""
    times, packs = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        packs = run()
        times.append(time.perf_counter() - start)
    return min(times), packs


def run_benchmark(n: int, pack_size: int, repeats: int, seed: int) -> dict:
    """Time every algorithm on the same lengths; returns a JSON-ready report."""
    source = demo_runtime_lengths()
    lengths = sample_lengths(source, n, pack_size, seed)
    lower_bound = math.ceil(int(lengths.sum()) / pack_size)
    as_list = lengths.tolist()

    runners: dict[str, Callable[[], int]] = {
        name: (lambda name=name: len(plan_packs(lengths, pack_size, algorithm=name, seed=seed)))
        for name in ALGORITHMS
    }
    runners[REFERENCE] = lambda: len(lightbinpack.obfd(as_list, pack_size))

    results = {}
    for name, run in runners.items():
        seconds, packs = best_time(run, repeats)
        results[name] = {"seconds": seconds, "packs": packs, "over_lower_bound": packs - lower_bound}
    for result in results.values():
        result["time_vs_obfd"] = result["seconds"] / results[REFERENCE]["seconds"]

    bfd, obfd = results["bfd"], results[REFERENCE]
    checks = {
        "bfd < 1 s": bfd["seconds"] < 1.0,
        "bfd <= 0.25x obfd": bfd["time_vs_obfd"] <= 0.25,
        "bfd packs <= obfd packs": bfd["packs"] <= obfd["packs"],
        "ffd/first_fit/first_fit_shuffle < 5 s": all(
            results[name]["seconds"] < 5.0 for name in ("ffd", "first_fit", "first_fit_shuffle")
        ),
    }
    return {
        "n": n,
        "pack_size": pack_size,
        "repeats": repeats,
        "seed": seed,
        "corpus_conversations": len(source),
        "corpus_mean_tokens": float(source.mean()),
        "corpus_max_tokens": int(source.max()),
        "capped_samples": int((lengths == pack_size).sum()),
        "total_tokens": int(lengths.sum()),
        "lower_bound": lower_bound,
        "results": results,
        "checks": checks,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "numpy": np.__version__},
    }


def print_report(report: dict) -> None:
    print(
        f"N={report['n']:,}  pack_size={report['pack_size']}  "
        f"best of {report['repeats']}  seed={report['seed']}"
    )
    print(
        f"corpus: {report['corpus_conversations']:,} conversations, mean {report['corpus_mean_tokens']:.1f} "
        f"tokens, max {report['corpus_max_tokens']:,}; {report['capped_samples']:,} samples capped"
    )
    print(
        f"total tokens {report['total_tokens']:,}; "
        f"lower bound ceil(sum/pack_size) = {report['lower_bound']:,}"
    )
    print()
    header = f"{'algorithm':<20} {'seconds':>9} {'packs':>11} {'over LB':>9} {'vs obfd':>9}"
    print(header)
    print("-" * len(header))
    for name, r in report["results"].items():
        print(
            f"{name:<20} {r['seconds']:>9.3f} {r['packs']:>11,} {r['over_lower_bound']:>9,} "
            f"{r['time_vs_obfd']:>8.3f}x"
        )
    print()
    for check, passed in report["checks"].items():
        print(f"[{'PASS' if passed else 'FAIL'}] {check}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000, help="number of sampled lengths")
    parser.add_argument("--pack-size", type=int, default=8192, help="pack capacity in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per algorithm (best is kept)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling and of first_fit_shuffle")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    report = run_benchmark(args.n, args.pack_size, args.repeats, args.seed)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
