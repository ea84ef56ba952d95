"""Balance benchmark: how long data-parallel ranks wait for the slowest one, per sampler (issue 13).

In a data-parallel step every rank waits for the most loaded one. The metric is torchtitan's
proposal, `tightpack.core.balance.straggler_overhead`: ``sum over steps of the max-rank cost / sum
over steps of the mean-rank cost - 1`` (0 is a perfect balance; 0.05 means steps last 5% longer than
a perfect balance would give). Costs are the training FLOPs of Llama-3-8B
(``CostModel.named("llama-8b")``, ``linear * s + quadratic * s**2`` per sequence of runtime length ``s``).

Per distribution and pack size, ``N`` runtime lengths (the planner's unit) are packed once with ``bfd``
(`tightpack.core.planner.plan_packs`) and costed once (`CostModel.pack_costs`); every data-parallel
size ``DP`` (simulated: no processes) and global batch size ``GBS`` (``DP x 4`` and ``DP x 16`` packs,
one pack per micro-batch) then deals that same plan, with the same seed, to every contender:

- ``baseline``: today's ``PackedBatchSampler(dataloader_type="batch", micro_batch_size=1)``: rank
  ``d`` takes positions ``d, d + DP, ...`` of each global batch;
- ``deal``: ``BalancedPackedBatchSampler(regroup=False)``: the same global batches, dealt by cost
  (`tightpack.core.balance.deal_balanced`);
- ``regroup``: ``BalancedPackedBatchSampler(regroup=True)``, its default: the epoch's packs regrouped
  into global batches by cost (`tightpack.core.balance.balanced_steps`), then dealt;
- ``plan+deal`` / ``plan+regroup``: the two balanced samplers over a cost-balanced rewrite of the
  ``bfd`` plan (`tightpack.core.balanced_plan.balance_pack_costs`; ``--no-balanced-plan`` leaves
  them out).

All ranks are simulated at once (`balance_simulation.py`) with the samplers' own internals
and the core functions their ``_batch`` calls, in the same way; before the grid, `verify_simulation`
checks on small configurations that the simulated index lists equal those of real per-rank samplers,
pack for pack, and the run says so. The goal column checks the default sampler (``regroup``) against
issue 13's target: an overhead of at most 2% wherever the baseline's exceeds 5% (``ok`` / ``MISS``;
``n.a.`` where the baseline is at most 5%).

Two length distributions, each in ``1..pack_size``:

- ``demo``: the runtime lengths (GPT-2 tokens) of the demo corpus as ``tightpack pack`` formats it
  (`demo_lengths.py`, 7,168 values), resampled with replacement and capped at the pack size;
- ``longtail``: exactly 5% of the samples (at random positions) uniform in ``(pack/2, pack]``, each
  filling most of a pack alone; the other 95% ``clip(int(lognormal(mean=6.0, sigma=1.3)), 1, pack/2)``
  (median about 400 tokens, as ``lognormal`` in `bench_planner.py`).

``N`` (``--samples``) defaults, per distribution and pack size, to enough lengths that the plan holds at
least ``--min-steps`` (50) global batches of the largest ``GBS`` (``128 x 16 = 2,048`` packs: about
102,400 packs), from the distribution's mean length; every configuration runs ``--epochs`` (1) epochs.

Sampler cost: one real rank (rank 0) of each sampler iterates a whole epoch at ``DP = 128``,
``GBS = 512`` and ``2,048``, pack size 8,192 (``--timing-*``); milliseconds per global batch are the
epoch's time over its steps, best (minimum) of ``--repeats`` interleaved rounds, beside the latency of
the first batch (the regrouping runs at the epoch's start). The goal is at most 1 ms per global batch.
Construction (a copy and a check of the costs, once per run) is not timed.

Scored by other cost models: every dealing (and the balanced plan) is chosen with ``llama-8b``'s costs,
so its own overhead is what that model predicts for the dealing it chose, near 0 by construction.
The same dealings of the same packs are scored again with models that did not choose them
(`SCORERS`: ``llama-1b``, a token-only model, and one whose ``s**2`` term dominates above 4,096
tokens): each row's ``results[contender]["scored"][name]``, and the ``scored`` tables. All of them
are cost-model predictions; `bench_balance_steps.py` measures real step times.

Quick (the default): DP 4 and 8, pack size 4,096, 10 steps, timings at DP 8; ``--full``: the grid the
docs quote (DP 8, 32, 128; pack sizes 4k to 32k; 50 steps; timings at DP 128). Benchmarks report,
they never assert::

    .venv/bin/python benchmarks/bench_balance.py --full
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from balance_simulation import BASELINE, DEAL, REGROUP, baseline_sampler, overhead, verify_simulation
from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, table, write_result
from tightpack.core.balanced_plan import balance_pack_costs
from tightpack.core.cost_model import CostModel, cost_spread
from tightpack.core.planner import PackPlan, plan_packs
from tightpack.runtime.balanced_sampler import BalancedPackedBatchSampler

DISTRIBUTIONS = ("demo", "longtail")
COST_MODEL = "llama-8b"
PER_RANK = (4, 16)
"""Packs per rank per global batch: ``GBS = DP x 4`` and ``DP x 16``."""
PLAN_DEAL, PLAN_REGROUP = "plan+deal", "plan+regroup"
GOAL_CONTENDER = REGROUP
GOAL_BASELINE_ABOVE = 0.05
GOAL_AT_MOST = 0.02
LONG_FRACTION = 0.05
LOGNORMAL_MEAN, LOGNORMAL_SIGMA = 6.0, 1.3
ATTENTION_FROM = 4096
SCORERS: dict[str, CostModel] = {
    "llama-1b": CostModel.named("llama-1b"),
    "tokens only": CostModel(linear=1.0, quadratic=0.0, unit="tokens"),
    f"s² above {ATTENTION_FROM:,}": CostModel(linear=float(ATTENTION_FROM), quadratic=1.0, unit="tokens²"),
}
"""Cost models that score the dealings chosen with `COST_MODEL`'s costs: Llama-3.2-1B's FLOPs (attention
weighs more: crossover 37,712 tokens against 57,256), tokens alone (no attention term), and a model whose
quadratic term equals the linear one at 4,096 tokens and dominates above."""


# --- lengths and plans -------------------------------------------------------------------------------


def make_lengths(
    distribution: str, n: int, pack_size: int, seed: int, demo: np.ndarray | None = None
) -> np.ndarray:
    """``n`` int64 runtime lengths in ``1..pack_size`` of one distribution (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if distribution == "demo":
        demo = demo_runtime_lengths() if demo is None else demo
        return np.minimum(rng.choice(demo, size=n, replace=True), pack_size)
    if distribution == "longtail":
        half = pack_size // 2
        lengths = np.clip(
            rng.lognormal(mean=LOGNORMAL_MEAN, sigma=LOGNORMAL_SIGMA, size=n).astype(np.int64), 1, half
        )
        long = rng.permutation(n)[: round(LONG_FRACTION * n)]
        lengths[long] = rng.integers(half + 1, pack_size, size=len(long), endpoint=True)
        return lengths
    raise ValueError(f"distribution {distribution!r} is not one of {DISTRIBUTIONS}")


def samples_for(distribution: str, pack_size: int, min_packs: int, seed: int, demo: np.ndarray | None) -> int:
    """Lengths enough for ``min_packs`` full packs: ``min_packs * pack_size / mean length``, plus 2%.

    A plan never fills its packs beyond 100%, so it has about that many packs or more. The mean comes
    from a pilot draw of 100,000 lengths with another seed; `run_pack_size` draws more if a small draw
    falls short.
    """
    pilot = make_lengths(distribution, 100_000, pack_size, seed + 1, demo)
    return math.ceil(1.02 * min_packs * pack_size / pilot.mean())


# --- the grid ----------------------------------------------------------------------------------------


def goal(baseline: float, balanced: float) -> str:
    if baseline <= GOAL_BASELINE_ABOVE:
        return "n.a."
    return "ok" if balanced <= GOAL_AT_MOST else "MISS"


def spread_dict(costs: np.ndarray) -> dict:
    spread = cost_spread(costs)
    return {"mean": spread.mean, "max": spread.max, "max_over_mean": spread.max_over_mean, "cv": spread.cv}


def run_pack_size(
    distribution: str,
    pack_size: int,
    *,
    dps: list[int],
    samples: int | None,
    min_steps: int,
    epochs: int,
    seed: int,
    model: CostModel,
    balance_plan: Callable | None,
    demo: np.ndarray | None,
    scorers: dict[str, CostModel] | None = None,
) -> tuple[dict, np.ndarray]:
    """One plan (and its balanced rewrite, if any) dealt at every DP and GBS; also returns its costs.

    ``scorers``: other cost models that score every dealing again (`SCORERS`).
    """
    scorers = {} if scorers is None else scorers
    start = time.perf_counter()
    min_packs = min_steps * max(dps) * max(PER_RANK)
    n = samples if samples is not None else samples_for(distribution, pack_size, min_packs, seed, demo)
    lengths = make_lengths(distribution, n, pack_size, seed, demo)
    plan = plan_packs(lengths, pack_size, algorithm="bfd")
    while samples is None and len(plan) < min_packs:  # a small draw's mean can miss the pilot's
        n = math.ceil(1.02 * n * min_packs / len(plan))
        lengths = make_lengths(distribution, n, pack_size, seed, demo)
        plan = plan_packs(lengths, pack_size, algorithm="bfd")
    costs = model.pack_costs(plan, lengths)
    plans: dict[str, tuple[PackPlan, np.ndarray]] = {"bfd": (plan, costs)}
    balance_seconds = None
    if balance_plan is not None:
        balance_start = time.perf_counter()
        balanced = balance_plan(plan, lengths, pack_size, model)
        balance_seconds = time.perf_counter() - balance_start
        plans["balanced"] = (balanced, model.pack_costs(balanced, lengths))
    scored = {  # plan name -> scorer -> the plan's pack costs under that scorer
        name: {scorer: other.pack_costs(p, lengths) for scorer, other in scorers.items()}
        for name, (p, _) in plans.items()
    }
    plan_stats = {
        name: {
            "packs": len(p),
            "fill": float(lengths.sum()) / (len(p) * pack_size),
            "cost_spread": spread_dict(c),
            "cost_spread_scored": {scorer: spread_dict(other) for scorer, other in scored[name].items()},
            # every sample exactly once, no pack above pack_size: a rewrite that broke this would not compare
            "valid": bool(
                len(p.order) == n
                and (np.bincount(p.order, minlength=n) == 1).all()
                and int(p.pack_loads(lengths).max()) <= pack_size
            ),
        }
        for name, (p, c) in plans.items()
    }
    rows = []
    for dp in dps:
        for per_rank in PER_RANK:
            gbs = dp * per_rank
            row = {"dp": dp, "gbs": gbs, "per_rank": per_rank}
            if len(plan) < gbs or ("balanced" in plans and len(plans["balanced"][0]) < gbs):
                row["skipped"] = f"{len(plan)} packs < GBS {gbs}"
                rows.append(row)
                continue
            results = {}
            for contender in (BASELINE, DEAL, REGROUP):
                results[contender] = overhead(contender, costs, dp, gbs, seed, epochs, scored["bfd"])
            if "balanced" in plans:
                balanced_costs, again = plans["balanced"][1], scored["balanced"]
                results[PLAN_DEAL] = overhead(DEAL, balanced_costs, dp, gbs, seed, epochs, again)
                results[PLAN_REGROUP] = overhead(REGROUP, balanced_costs, dp, gbs, seed, epochs, again)
            row["results"] = results
            row["steps"] = results[BASELINE]["steps"]
            row["goal"] = goal(results[BASELINE]["overhead"], results[GOAL_CONTENDER]["overhead"])
            if PLAN_REGROUP in results:
                row["goal_balanced_plan"] = goal(
                    results[BASELINE]["overhead"], results[PLAN_REGROUP]["overhead"]
                )
            rows.append(row)
    run = {
        "distribution": distribution,
        "pack_size": pack_size,
        "samples": n,
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "over_half_pack": float((lengths > pack_size // 2).mean()),
        "plans": plan_stats,
        "rows": rows,
        "seconds": time.perf_counter() - start,
        "balance_plan_seconds": balance_seconds,
    }
    return run, costs


# --- sampler cost ------------------------------------------------------------------------------------


def time_samplers(costs: np.ndarray, dp: int, gbs_values: list[int], repeats: int, seed: int) -> list[dict]:
    """Rank 0 of each real sampler iterating epoch 0: ms per global batch and first-batch latency."""
    makers: dict[str, Callable[[int], object]] = {
        BASELINE: lambda gbs: baseline_sampler(len(costs), gbs, dp, 0, seed),
        DEAL: lambda gbs: BalancedPackedBatchSampler(
            costs, global_batch_size=gbs, data_parallel_size=dp, seed=seed, regroup=False
        ),
        REGROUP: lambda gbs: BalancedPackedBatchSampler(
            costs, global_batch_size=gbs, data_parallel_size=dp, seed=seed, regroup=True
        ),
    }
    results = []
    for gbs in gbs_values:
        if len(costs) < gbs:
            results.append({"dp": dp, "gbs": gbs, "skipped": f"{len(costs)} packs < GBS {gbs}"})
            continue
        epoch_s: dict[str, list[float]] = {name: [] for name in makers}
        first_s: dict[str, list[float]] = {name: [] for name in makers}
        steps = len(costs) // gbs
        for make in makers.values():  # warm: imports, caches, numpy dispatch
            list(make(gbs))
        for _ in range(repeats):
            for name, make in makers.items():
                sampler = make(gbs)
                start = time.perf_counter()
                batches = iter(sampler)
                next(batches)
                first = time.perf_counter()
                for _batch in batches:
                    pass
                end = time.perf_counter()
                epoch_s[name].append(end - start)
                first_s[name].append(first - start)
        results.append(
            {
                "dp": dp,
                "gbs": gbs,
                "steps": steps,
                "packs": len(costs),
                "results": {
                    name: {
                        "ms_per_batch": 1e3 * min(epoch_s[name]) / steps,
                        "ms_per_batch_median": 1e3 * statistics.median(epoch_s[name]) / steps,
                        "first_batch_ms": 1e3 * min(first_s[name]),
                        "after_first_ms_per_batch": 1e3
                        * min(e - f for e, f in zip(epoch_s[name], first_s[name], strict=True))
                        / max(steps - 1, 1),
                        "epoch_rounds_s": epoch_s[name],
                        "first_rounds_s": first_s[name],
                    }
                    for name in makers
                },
            }
        )
    return results


# --- the whole run -----------------------------------------------------------------------------------


def run_benchmark(
    *,
    dps: list[int],
    pack_sizes: list[int],
    distributions: list[str],
    samples: int | None = None,
    min_steps: int = 50,
    epochs: int = 1,
    seed: int = 0,
    balanced_plan: bool = True,
    timing_dp: int = 128,
    timing_gbs: list[int] | None = None,
    timing_pack_size: int = 8192,
    repeats: int = 3,
    scorers: dict[str, CostModel] | None = None,
) -> dict:
    """Every distribution and pack size, then the sampler timings; returns a JSON-ready report.

    ``balanced_plan``: add the contenders over `balance_pack_costs`'s rewrite of each plan.
    ``scorers``: the cost models that score every dealing again (default `SCORERS`).
    """
    scorers = SCORERS if scorers is None else scorers
    start = time.perf_counter()
    balance_plan = balance_pack_costs if balanced_plan else None
    model = CostModel.named(COST_MODEL)
    demo = demo_runtime_lengths() if "demo" in distributions else None
    verification = verify_simulation(seed)
    runs = []
    timing_costs: dict[str, np.ndarray] = {}
    for distribution in distributions:
        for pack_size in pack_sizes:
            run, costs = run_pack_size(
                distribution,
                pack_size,
                dps=dps,
                samples=samples,
                min_steps=min_steps,
                epochs=epochs,
                seed=seed,
                model=model,
                balance_plan=balance_plan,
                demo=demo,
                scorers=scorers,
            )
            runs.append(run)
            if pack_size == timing_pack_size:
                timing_costs[distribution] = costs
    timing_gbs = [timing_dp * 4, timing_dp * 16] if timing_gbs is None else timing_gbs
    timings = []
    for distribution in distributions:
        costs = timing_costs.get(distribution)
        if costs is None:  # the timing pack size is not in the grid: plan it now
            n = (
                samples
                if samples is not None
                else samples_for(distribution, timing_pack_size, min_steps * max(timing_gbs), seed, demo)
            )
            lengths = make_lengths(distribution, n, timing_pack_size, seed, demo)
            costs = model.pack_costs(plan_packs(lengths, timing_pack_size, algorithm="bfd"), lengths)
        for entry in time_samplers(costs, timing_dp, timing_gbs, repeats, seed):
            timings.append({"distribution": distribution, "pack_size": timing_pack_size, **entry})
    contenders = [BASELINE, DEAL, REGROUP] + ([PLAN_DEAL, PLAN_REGROUP] if balance_plan is not None else [])
    worst = {}
    for contender in contenders:
        candidates = [
            (
                row["results"][contender]["overhead"],
                run["distribution"],
                run["pack_size"],
                row["dp"],
                row["gbs"],
            )
            for run in runs
            for row in run["rows"]
            if "results" in row
        ]
        if candidates:
            value, distribution, pack_size, dp, gbs = max(candidates)
            worst[contender] = {
                "overhead": value,
                "distribution": distribution,
                "pack_size": pack_size,
                "dp": dp,
                "gbs": gbs,
            }
    worst_scored = {
        scorer: {
            contender: max(
                (row["results"][contender]["scored"][scorer] for run in runs for row in run["rows"]
                 if "results" in row),
                default=None,
            )
            for contender in contenders
        }
        for scorer in scorers
    }  # fmt: skip
    goals = [row["goal"] for run in runs for row in run["rows"] if "goal" in row]
    return {
        "metric": "straggler overhead: sum_steps max-rank cost / sum_steps mean-rank cost - 1",
        "cost_model": {
            "name": COST_MODEL,
            "linear": model.linear,
            "quadratic": model.quadratic,
            "per_sequence": model.per_sequence,
            "unit": model.unit,
            "crossover_length": model.crossover_length(),
        },
        "scorers": {
            name: {**other.to_dict(), "crossover_length": other.crossover_length()}
            for name, other in scorers.items()
        },
        "planner": "bfd",
        "dps": dps,
        "per_rank": list(PER_RANK),
        "pack_sizes": pack_sizes,
        "distributions": distributions,
        "samples": samples,
        "min_steps": min_steps,
        "epochs": epochs,
        "seed": seed,
        "contenders": contenders,
        "balanced_plan": (
            "tightpack.core.balanced_plan.balance_pack_costs"
            if balanced_plan
            else "left out (--no-balanced-plan)"
        ),
        "goal": (
            f"{GOAL_CONTENDER} <= {GOAL_AT_MOST:.0%} where {BASELINE} > {GOAL_BASELINE_ABOVE:.0%}; "
            "sampler <= 1 ms per global batch at DP 128"
        ),
        "goal_counts": {value: goals.count(value) for value in ("ok", "MISS", "n.a.")},
        "simulation_check": verification,
        "runs": runs,
        "worst": worst,
        "worst_scored": worst_scored,
        "timing": {"repeats": repeats, "statistic": "best (min) of interleaved rounds", "runs": timings},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "numpy": np.__version__,
        },
        "wall_seconds": time.perf_counter() - start,
    }


# --- printing ----------------------------------------------------------------------------------------


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def print_report(report: dict) -> None:
    model = report["cost_model"]
    print(
        f"straggler overhead = sum(max rank cost) / sum(mean rank cost) - 1; cost model {model['name']} "
        f"({model['linear']:.4g} * s + {model['quadratic']:.4g} * s^2 {model['unit']} per sequence; "
        f"crossover length {model['crossover_length']:,.0f} tokens); plan {report['planner']}; "
        f"seed {report['seed']}, {report['epochs']} epoch(s); numpy {report['machine']['numpy']}, "
        f"{report['machine']['cpus']} CPUs"
    )
    checks = report["simulation_check"]
    failed = [key for key, passed in checks.items() if not passed]
    print(
        f"simulation check (all ranks at once vs real per-rank samplers, index for index): "
        f"{len(checks) - len(failed)}/{len(checks)} identical" + (f"; DIFFER: {failed}" if failed else "")
    )
    print(f"balanced plan: {report['balanced_plan']}")
    contenders = report["contenders"]
    has_plan_goal = PLAN_REGROUP in contenders
    for run in report["runs"]:
        print()
        print(
            f"## {run['distribution']}, pack size {run['pack_size']:,}: {run['samples']:,} samples, "
            f"mean length {run['mean_length']:.0f}, median {run['median_length']:.0f}, "
            f"{percent(run['over_half_pack'])} over half a pack ({run['seconds']:.1f} s"
            + (
                f", of which {run['balance_plan_seconds']:.1f} s balance_pack_costs)"
                if run["balance_plan_seconds"] is not None
                else ")"
            )
        )
        for name, stats in run["plans"].items():
            spread = stats["cost_spread"]
            print(
                f"   {name} plan: {stats['packs']:,} packs, token fill {percent(stats['fill'])}; "
                f"pack cost mean {spread['mean']:.4g}, max/mean {spread['max_over_mean']:.3f}, "
                f"cv {spread['cv']:.3f}"
                + ("" if stats["valid"] else "; INVALID (a sample lost, repeated or over)")
            )
        header = "| DP | GBS | per rank | steps | " + " | ".join(contenders) + " | goal |"
        header += " goal (balanced plan) |" if has_plan_goal else ""
        print(header)
        print("|" + "---:|" * (4 + len(contenders)) + "---|" + ("---|" if has_plan_goal else ""))
        for row in run["rows"]:
            if "skipped" in row:
                print(f"| {row['dp']} | {row['gbs']} | {row['per_rank']} | skipped: {row['skipped']} |")
                continue
            cells = " | ".join(percent(row["results"][name]["overhead"]) for name in contenders)
            line = f"| {row['dp']} | {row['gbs']} | {row['per_rank']} | {row['steps']:,} | {cells} "
            line += f"| {row['goal']} |"
            if has_plan_goal:
                line += f" {row['goal_balanced_plan']} |"
            print(line)
    print()
    print(
        "worst overhead per contender: "
        + "; ".join(
            f"{name} {percent(w['overhead'])} ({w['distribution']}, pack {w['pack_size']}, "
            f"DP {w['dp']}, GBS {w['gbs']})"
            for name, w in report["worst"].items()
        )
    )
    for scorer, worst in report["worst_scored"].items():
        print(
            f"the same dealings scored by {scorer}, worst overhead: "
            + "; ".join(f"{name} {percent(value)}" for name, value in worst.items() if value is not None)
        )
    counts = report["goal_counts"]
    print(
        f"goal ({report['goal'].split(';')[0]}): {counts['ok']} ok, {counts['MISS']} MISS, "
        f"{counts['n.a.']} n.a."
    )
    print()
    timing = report["timing"]
    print(
        f"sampler cost: rank 0 iterating one epoch, ms per global batch (best of {timing['repeats']} "
        "interleaved rounds; median in brackets), first-batch latency ms and ms per global batch after the "
        "first; goal <= 1 ms per global batch"
    )
    print(
        "| distribution | pack size | DP | GBS | steps | sampler | ms / global batch | first batch ms "
        "| ms / batch after the first |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for entry in timing["runs"]:
        if "skipped" in entry:
            print(
                f"| {entry['distribution']} | {entry['pack_size']} | {entry['dp']} | {entry['gbs']} "
                f"| skipped: {entry['skipped']} |"
            )
            continue
        for name, r in entry["results"].items():
            print(
                f"| {entry['distribution']} | {entry['pack_size']} | {entry['dp']} | {entry['gbs']} "
                f"| {entry['steps']} | {name} | {r['ms_per_batch']:.3f} ({r['ms_per_batch_median']:.3f}) "
                f"| {r['first_batch_ms']:.2f} | {r['after_first_ms_per_batch']:.3f} |"
            )
    print()
    load = report["machine"]["load_average"]
    load_text = (
        "" if load is None else f" (load average at the end {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f})"
    )
    print(f"wall time {report['wall_seconds']:.1f} s{load_text}")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


QUICK = {
    "dp": [4, 8], "pack_sizes": [4096], "min_steps": 10,
    "timing_dp": 8, "timing_gbs": [32, 128], "timing_pack_size": 4096, "repeats": 1,
}  # fmt: skip
FULL = {
    "dp": [8, 32, 128], "pack_sizes": [4096, 8192, 16384, 32768], "min_steps": 50,
    "timing_dp": 128, "timing_gbs": [512, 2048], "timing_pack_size": 8192, "repeats": 3,
}  # fmt: skip


def arrow(row: dict, contender: str, scorer: str | None) -> str:
    """``baseline -> contender`` overheads of one row, scored by ``scorer`` (None: the balancing model)."""

    def value(name: str) -> float:
        result = row["results"][name]
        return result["overhead"] if scorer is None else result["scored"][scorer]

    return f"{percent(value(BASELINE))} → {percent(value(contender))}"


def scorer_name(report: dict, scorer: str | None) -> str:
    return f"{report['cost_model']['name']} (balanced with it)" if scorer is None else scorer


def result_tables(report: dict) -> dict:
    """The tables of the JSON result: overheads self-scored and scored by `SCORERS`, plan spreads, timing."""
    cells = [(row["dp"], row["gbs"]) for row in report["runs"][0]["rows"]]
    columns = ["distribution", "pack size", "scored by"] + [f"DP {dp}, GBS {gbs}" for dp, gbs in cells]
    scorers = [None, *report["scorers"]]
    tables = {}
    for key, contender, what in (
        ("regroup", REGROUP, "BalancedPackedBatchSampler (regroup, the default)"),
        ("deal", DEAL, "BalancedPackedBatchSampler(regroup=False)"),
        ("plan_regroup", PLAN_REGROUP, "balanced plan + BalancedPackedBatchSampler"),
    ):
        if contender not in report["contenders"]:
            continue
        rows = [
            [run["distribution"], run["pack_size"], scorer_name(report, scorer)]
            + [arrow(row, contender, scorer) if "results" in row else row["skipped"] for row in run["rows"]]
            for run in report["runs"]
            for scorer in scorers
        ]
        title = f"straggler overhead predicted by each cost model: baseline → {what}"
        tables[key] = table(columns, rows, title)
    spread_rows = []
    for run in report["runs"]:
        plans = run["plans"]
        for scorer in scorers:
            cv = [
                (p["cost_spread"] if scorer is None else p["cost_spread_scored"][scorer])["cv"]
                for p in plans.values()
            ]
            packs = " → ".join(f"{p['packs']:,}" for p in plans.values())
            cells = [run["distribution"], run["pack_size"], scorer_name(report, scorer), packs]
            spread_rows.append([*cells, " → ".join(f"{v:.3f}" for v in cv)])
    if len(report["runs"][0]["plans"]) > 1:
        title = "packs and pack cost spread (coefficient of variation), bfd plan → balanced plan"
        columns = ["distribution", "pack size", "scored by", "packs", "cost cv"]
        tables["plan_spread"] = table(columns, spread_rows, title)
    timing_rows = [
        [entry["distribution"], entry["pack_size"], entry["dp"], entry["gbs"], name, r["ms_per_batch"],
         r["first_batch_ms"], r["after_first_ms_per_batch"]]
        for entry in report["timing"]["runs"] if "results" in entry
        for name, r in entry["results"].items()
    ]  # fmt: skip
    columns = ["distribution", "pack size", "DP", "GBS", "sampler", "ms per global batch", "first batch ms",
               "ms per batch after the first"]  # fmt: skip
    tables["timing"] = table(columns, timing_rows, "sampler cost: rank 0 iterating one epoch")
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int_list, default=None, help="data-parallel sizes, comma-separated")
    parser.add_argument("--pack-sizes", type=int_list, default=None, help="pack sizes, comma-separated")
    parser.add_argument(
        "--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS), metavar="NAME"
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="lengths per plan (default: enough for --min-steps)"
    )
    parser.add_argument(
        "--min-steps", type=int, default=None, help="global batches of the largest GBS per epoch (sets N)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs dealt per configuration")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and of the samplers")
    parser.add_argument(
        "--balanced-plan",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add plan+deal / plan+regroup over the cost-balanced rewrite of each plan (default: yes)",
    )
    parser.add_argument("--timing-dp", type=int, default=None, help="DP of the sampler timings")
    parser.add_argument("--timing-gbs", type=int_list, default=None, help="GBS of the sampler timings")
    parser.add_argument("--timing-pack-size", type=int, default=None, help="pack size of the sampler timings")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (the best is reported)")
    parser.add_argument("--quick", action="store_true", help="the quick size (the default; see --full)")
    add_size_options(parser, "balance")
    parser.add_argument(
        "--json", dest="result", type=Path, default=argparse.SUPPRESS, help="the same as --result"
    )
    args = parser.parse_args()
    size = choose_size(args, QUICK, FULL)
    report = run_benchmark(
        dps=args.dp,
        pack_sizes=args.pack_sizes,
        distributions=args.distributions,
        samples=args.samples,
        min_steps=args.min_steps,
        epochs=args.epochs,
        seed=args.seed,
        balanced_plan=args.balanced_plan,
        timing_dp=args.timing_dp,
        timing_gbs=args.timing_gbs,
        timing_pack_size=args.timing_pack_size,
        repeats=args.repeats,
    )
    print_report(report)
    figures = {
        f"worst {name} overhead, predicted by {report['cost_model']['name']} (%)": 100 * w["overhead"]
        for name, w in report["worst"].items()
    }
    for scorer, worst in report["worst_scored"].items():
        figures |= {f"worst {name} overhead, predicted by {scorer} (%)": 100 * v for name, v in worst.items()}
    write_result("balance", args, size, figures=figures, tables=result_tables(report), report=report,
                 seconds=report["wall_seconds"])  # fmt: skip


if __name__ == "__main__":
    main()
