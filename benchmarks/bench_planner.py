"""Planner benchmark: tightpack's four algorithms against numpy's stable sort and ``lightbinpack.obfd``.

Three length distributions, ``--n`` lengths each (10M by default), all in ``1..--pack-size``:

- ``demo``: the runtime lengths (GPT-2 tokens) of the demo corpus as ``tightpack pack`` formats it
  (`demo_lengths.py`), resampled with replacement and capped at the pack size;
- ``uniform``: uniform over ``1..pack_size``, the case where every length is frequent and packs hold
  about two samples;
- ``lognormal``: a long tail, ``clip(int(lognormal(mean=6.0, sigma=1.3)), 1, pack_size)``: median
  about 400 tokens, mean about 880, 1% capped at 8192.

Two comparisons, on the same lengths array in the same run:

- **x floor**: time over the stable-sort floor, ``np.bincount(lengths)`` plus
  ``np.argsort(lengths.astype(np.int16), kind="stable")`` (int32 above a pack size of 32,767). Any
  planner that keeps equal lengths in input order does at least this much work.
- **x obfd (API to API)**: time over ``lightbinpack.obfd`` called the way each library is used:
  tightpack returns two int64 numpy arrays, obfd takes a Python list (prepared beforehand, not timed)
  and returns nested Python lists holding one int object per sample, building which is most of its
  time. Skipped, and said so, when lightbinpack is not installed (``make bench`` installs it).

Every timed call runs once untimed first (warm); then ``--repeats`` rounds call every contender in
turn (interleaved, so that a change of machine load hits all of them alike). Seconds are the best
(minimum) of the rounds, as load on a shared machine only ever adds time; the ratio of the medians is
printed beside, and the JSON result (``--result``, `results.py`) keeps every round. Benchmarks
report, they never assert. Quick: 1M lengths, 3 rounds; ``--full``: the documented 10M lengths, 5 rounds::

    .venv/bin/python benchmarks/bench_planner.py --full
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, table, write_result
from tightpack.core.planner import ALGORITHMS, plan_packs

FLOOR = "floor"
REFERENCE = "lightbinpack.obfd"
DISTRIBUTIONS = ("demo", "uniform", "lognormal")
INT16_MAX = np.iinfo(np.int16).max


def make_lengths(distribution: str, n: int, pack_size: int, seed: int) -> np.ndarray:
    """``n`` int64 lengths in ``1..pack_size`` of one distribution (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if distribution == "demo":
        return np.minimum(rng.choice(demo_runtime_lengths(), size=n, replace=True), pack_size)
    if distribution == "uniform":
        return rng.integers(1, pack_size, size=n, endpoint=True)
    if distribution == "lognormal":
        return np.clip(rng.lognormal(mean=6.0, sigma=1.3, size=n).astype(np.int64), 1, pack_size)
    raise ValueError(f"distribution {distribution!r} is not one of {DISTRIBUTIONS}")


def floor_runner(lengths: np.ndarray, pack_size: int) -> Callable[[], int | None]:
    """The stable-sort floor: a histogram and numpy's stable argsort of the narrowest signed keys."""
    key_dtype = np.int16 if pack_size <= INT16_MAX else np.int32

    def run() -> None:
        np.bincount(lengths)
        np.argsort(lengths.astype(key_dtype), kind="stable")

    return run


def time_rounds(runners: dict[str, Callable[[], int | None]], repeats: int) -> dict[str, dict]:
    """One warm call of each runner, then ``repeats`` interleaved timed rounds."""
    packs = {name: run() for name, run in runners.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {
        name: {
            "seconds": min(times),
            "median_seconds": statistics.median(times),
            "rounds": times,
            "packs": packs[name],
        }
        for name, times in seconds.items()
    }


def run_distribution(distribution: str, n: int, pack_size: int, repeats: int, seed: int, obfd) -> dict:
    """Time the floor, every algorithm and (when given) obfd on one lengths array."""
    lengths = make_lengths(distribution, n, pack_size, seed)
    lower_bound = math.ceil(int(lengths.sum()) / pack_size)
    runners: dict[str, Callable[[], int | None]] = {FLOOR: floor_runner(lengths, pack_size)}
    for name in ALGORITHMS:
        runners[name] = lambda name=name: len(plan_packs(lengths, pack_size, algorithm=name, seed=seed))
    if obfd is not None:
        as_list = lengths.tolist()
        runners[REFERENCE] = lambda: len(obfd(as_list, pack_size))
    results = time_rounds(runners, repeats)
    for result in results.values():
        result["x_floor"] = result["seconds"] / results[FLOOR]["seconds"]
        result["x_floor_median"] = result["median_seconds"] / results[FLOOR]["median_seconds"]
        if obfd is not None:
            result["x_obfd"] = result["seconds"] / results[REFERENCE]["seconds"]
        if result["packs"] is not None:
            result["over_lower_bound"] = result["packs"] - lower_bound
    return {
        "distribution": distribution,
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "capped_samples": int((lengths == pack_size).sum()),
        "total_tokens": int(lengths.sum()),
        "lower_bound": lower_bound,
        "results": results,
    }


def run_benchmark(n: int, pack_size: int, repeats: int, seed: int, distributions: list[str]) -> dict:
    """Every distribution in turn; returns a JSON-ready report."""
    try:
        from lightbinpack import obfd
    except ImportError:
        obfd = None
    runs = [run_distribution(name, n, pack_size, repeats, seed, obfd) for name in distributions]
    checks = {}
    for run in runs:
        results = run["results"]
        checks[f"{run['distribution']}: bfd <= 1x floor"] = results["bfd"]["x_floor"] <= 1.0
        if obfd is not None:
            checks[f"{run['distribution']}: bfd packs <= obfd packs"] = (
                results["bfd"]["packs"] <= results[REFERENCE]["packs"]
            )
    return {
        "n": n,
        "pack_size": pack_size,
        "repeats": repeats,
        "statistic": "best (min) of interleaved warm rounds; x_floor_median: ratio of the medians",
        "seed": seed,
        "obfd": "skipped: lightbinpack is not installed" if obfd is None else "lightbinpack.obfd",
        "runs": runs,
        "checks": checks,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "numpy": np.__version__,
        },
    }


def label(name: str) -> str:
    if name == FLOOR:
        return "floor: bincount + stable argsort"
    if name == REFERENCE:
        return f"{REFERENCE} (nested Python lists)"
    return name


def print_report(report: dict) -> None:
    print(
        f"N={report['n']:,} lengths per distribution, pack_size={report['pack_size']}, "
        f"best of {report['repeats']} interleaved warm rounds, seed={report['seed']}; "
        f"numpy {report['machine']['numpy']}, {report['machine']['cpus']} CPUs"
    )
    if report["obfd"] != REFERENCE:
        print(f"{REFERENCE} {report['obfd']} (`make bench` installs the bench extra)")
    print()
    print(
        "| distribution | contender | seconds | x floor | x floor (medians) | packs | over LB "
        "| x obfd (API to API) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for run in report["runs"]:
        for name, r in run["results"].items():
            packs = "" if r["packs"] is None else f"{r['packs']:,}"
            over = "" if r["packs"] is None else f"{r['over_lower_bound']:,}"
            x_obfd = f"{r['x_obfd']:.3f}x" if "x_obfd" in r else "skipped"
            print(
                f"| {run['distribution']} | {label(name)} | {r['seconds']:.3f} | {r['x_floor']:.2f}x "
                f"| {r['x_floor_median']:.2f}x | {packs} | {over} | {x_obfd} |"
            )
    print()
    for run in report["runs"]:
        print(
            f"{run['distribution']}: mean length {run['mean_length']:.1f}, "
            f"median {run['median_length']:.0f}, "
            f"{run['capped_samples']:,} capped at the pack size; lower bound ceil(sum/pack_size) = "
            f"{run['lower_bound']:,}"
        )
    print()
    for check, passed in report["checks"].items():
        print(f"[{'PASS' if passed else 'FAIL'}] {check}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="lengths per distribution (quick 1M, full 10M)")
    parser.add_argument("--pack-size", type=int, default=8192, help="pack capacity in tokens")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds, the best counts (3; full 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and of first_fit_shuffle")
    parser.add_argument(
        "--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS), metavar="NAME"
    )
    add_size_options(parser, "planner")
    args = parser.parse_args()
    size = choose_size(args, quick={"n": 1_000_000, "repeats": 3}, full={"n": 10_000_000, "repeats": 5})
    start = time.perf_counter()
    report = run_benchmark(args.n, args.pack_size, args.repeats, args.seed, args.distributions)
    print_report(report)
    rows = [
        [run["distribution"], label(name), r["seconds"], r["x_floor"], r.get("packs"),
         r.get("over_lower_bound"), r.get("x_obfd", "skipped")]
        for run in report["runs"]
        for name, r in run["results"].items()
    ]  # fmt: skip
    bfd = {run["distribution"]: run["results"]["bfd"] for run in report["runs"]}
    figures = {f"{name}: bfd seconds for {args.n:,} lengths": r["seconds"] for name, r in bfd.items()}
    figures |= {f"{name}: bfd time / stable-sort floor": r["x_floor"] for name, r in bfd.items()}
    columns = ["distribution", "contender", "seconds", "x floor", "packs", "over lower bound", "x obfd"]
    tables = {"planners": table(columns, rows, f"{args.n:,} lengths, pack size {args.pack_size}")}
    write_result("planner", args, size, figures=figures, tables=tables, report=report,
                 seconds=time.perf_counter() - start)  # fmt: skip


if __name__ == "__main__":
    main()
