"""Per-step planning benchmark: `plan_step` against verl, slime-style KK, FFD and today's pieces (issue 29).

One RL step's rollouts must be dealt to ``DP`` data-parallel ranks and cut into micro-batches under a
token budget, every rank the same number of micro-batches. The step lasts as long as the slowest rank,
whose time is the sum of its sequences' costs: the cost model is Llama-3-8B's training FLOPs
(``CostModel.resolve("llama-8b")``, ``linear * s + quadratic * s**2`` per sequence of ``s`` tokens) for
every planner that takes costs, and every planner is scored by it. Planners (`bench_step_planner_peers.py`
says exactly what each one runs):

- ``verl``: verl 0.9.1's ``balance_batch`` (its own ``get_seqlen_balanced_partitions``, Karmarkar-Karp
  with equal counts on its shipped workload ``24576 s + s**2``), then ``rearrange_micro_batches`` with
  ``same_micro_num_in_dp`` on every rank; ``verl (cost model)``: the same, ``balance_batch`` fed the
  shared cost model's costs. The wheel is downloaded into the virtual environment on first use
  (``pip download verl==0.9.1 --no-deps``) and its ``seqlen_balancing.py`` imported by path.
- ``slime-style KK``: the scheme of slime PR #2017 (``--balance-by-flops``), reimplemented: micro-batches
  by Karmarkar-Karp on the costs (``ceil(tokens / budget)`` of them, a multiple of ``DP``, no cap), dealt
  to ranks by Karmarkar-Karp with equal counts.
- ``FFD round-robin``: first-fit decreasing by tokens under the budget, micro-batch ``i`` to rank ``i % DP``.
- ``tightpack pieces``: ``plan_packs`` under the budget, then ``deal_balanced`` by cost.
- ``plan_step``: `tightpack.core.step_planner.plan_step`.

Steps: ``--rollouts`` sequences in GRPO groups of 8 (one prompt, 8 responses): prompt log-uniform in
512..4,096 tokens, response ``lognormal(median 3,000, sigma 1.2)`` clipped to 100..``max response``, a
long tail whose top is the rollout engine's limit. As verl requires (``max_token_len >= max_seq_len``),
the limit is set so that every sequence fits the budget: ``max response = min(32,768, budget - 4,096)``.
The steps depend on the rollouts, the budget, ``--seed`` and the step number, not on ``DP``: every DP
size plans the same steps. ``--steps`` steps per configuration.

Per configuration (rollouts x DP x budget), over its steps:

- **straggler overhead**: ``sum over steps of the slowest rank's cost / sum of the mean rank's cost - 1``
  (`tightpack.core.balance.straggler_overhead`), beside the **floor**: no dealing can make the slowest
  rank cost less than ``max(mean rank cost, the costliest single sequence)``, so the floor's overhead
  is ``sum of that / sum of the mean - 1``;
- **micro-batches per rank** (the mean over steps), the empty ones a planner pads with;
- **budget violations**: micro-batches over the budget holding more than one sequence;
- **planning time** per step on one core (``OMP/MKL/OPENBLAS_NUM_THREADS=1``, torch one thread; the script
  re-executes itself with them set): FFD, the pieces and ``plan_step`` best of ``--repeats``
  interleaved rounds, slime-style once; the median over steps. verl: its ``balance_batch`` (verl's code,
  every step) and, where verl's own ``rearrange_micro_batches`` ran (`--verl-check-limit`), its slowest
  rank (ranks micro-batch in parallel);
- **robustness**: the same layouts (balanced with ``llama-8b``) scored by a token-only model and by
  ``llama-8b`` with a 10x quadratic term.

verl's micro-batching is replayed (`verl_micro_batches`: its loop around the same Karmarkar-Karp,
which verl runs in pure Python for minutes per step where ranks hold thousands of sequences); on the
first step of every configuration small enough (``rollouts x count <= --verl-check-limit``) verl's own
``rearrange_micro_batches`` runs on every rank and the run reports whether each micro-batch holds the
same lengths.

Goals of issue 29, per configuration: ``plan_step``'s overhead at most half the best peer's or at most
0.5% absolute; never more micro-batches per rank than verl (either variant) on any step; planning at most
10 ms per step for 16,384 rollouts at DP 256 on one core. An extra table plans steps whose responses run
to 32,768 tokens at the smallest budget (sequences above it): ``plan_step`` with ``allow_oversize``, FFD
and the pieces give such a sequence a micro-batch of its own, slime-style ignores the budget, and verl
refuses the step.

Quick (the default, a few minutes on 2 busy cores): 1,024 and 16,384 rollouts, DP 8 and 256, budgets 16k
and 64k, 3 steps. ``--full``: the issue's grid (1,024 / 4,096 / 16,384 rollouts, DP 8 / 64 / 256,
budgets 16k / 32k / 64k), 10 steps. Benchmarks report, they never assert::

    .venv/bin/python benchmarks/bench_step_planner.py --full
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _one_core() -> None:
    """Re-execute with the thread pools of numpy's BLAS and torch at one thread (set before import)."""
    if any(os.environ.get(name) != "1" for name in THREAD_VARIABLES):
        os.environ.update(dict.fromkeys(THREAD_VARIABLES, "1"))
        os.execv(sys.executable, [sys.executable, *sys.argv])


if __name__ == "__main__":
    _one_core()

import numpy as np  # noqa: E402

from bench_step_planner_peers import (  # noqa: E402
    Layout,
    VerlRefused,
    check_layout,
    ffd_plan,
    load_verl,
    pieces_plan,
    slime_plan,
    step_plan,
    verl_balance,
    verl_micro_batches,
    verl_micro_batches_by_verl,
)
from results import add_size_options, choose_size, table, write_result  # noqa: E402
from tightpack.core.balance import straggler_overhead  # noqa: E402
from tightpack.core.cost_model import CostModel  # noqa: E402

COST_MODEL = "llama-8b"
GROUP = 8
PROMPT_MIN, PROMPT_MAX = 512, 4096
RESPONSE_MIN, RESPONSE_MAX = 100, 32768
RESPONSE_MEDIAN, RESPONSE_SIGMA = 3000.0, 1.2

VERL, VERL_COST = "verl", "verl (cost model)"
SLIME, FFD, PIECES, STEP = "slime-style KK", "FFD round-robin", "tightpack pieces", "plan_step"
PLANNERS = (VERL, VERL_COST, SLIME, FFD, PIECES, STEP)
PEERS = PLANNERS[:-1]
VERLS = (VERL, VERL_COST)
TIMED = (FFD, PIECES, STEP)
"""Timed best of ``--repeats`` interleaved rounds; slime-style once; verl apart (module docstring)."""

GOAL_RATIO, GOAL_ABSOLUTE = 0.5, 0.005
GOAL_MS, GOAL_ROLLOUTS, GOAL_DP = 10.0, 16384, 256

LLAMA = CostModel.resolve(COST_MODEL)
SCORERS: dict[str, CostModel] = {
    COST_MODEL: LLAMA,
    "tokens only": CostModel(linear=1.0, quadratic=0.0, unit="tokens"),
    "quadratic x10": CostModel(linear=LLAMA.linear, quadratic=10 * LLAMA.quadratic, unit="flops"),
}
"""The model every planner balances with (first) and the two that score the same layouts again."""

QUICK = {"rollouts": [1024, 16384], "dp": [8, 256], "budgets": [16384, 65536], "steps": 3, "repeats": 5}
FULL = {
    "rollouts": [1024, 4096, 16384],
    "dp": [8, 64, 256],
    "budgets": [16384, 32768, 65536],
    "steps": 10,
    "repeats": 7,
}


# --- steps ---------------------------------------------------------------------------------------------


def make_step(rollouts: int, budget: int, seed: int, step: int, capped: bool = True) -> np.ndarray:
    """One step's sequence lengths, int64 ``[rollouts]`` (module docstring); ``capped``: every one fits
    ``budget`` (the rollout engine's limit is ``budget - PROMPT_MAX``), else responses run to 32k."""
    rng = np.random.default_rng([seed, rollouts, budget, step, int(capped)])
    groups = -(-rollouts // GROUP)
    prompts = np.exp(rng.uniform(np.log(PROMPT_MIN), np.log(PROMPT_MAX), size=groups)).astype(np.int64)
    limit = min(RESPONSE_MAX, budget - PROMPT_MAX) if capped else RESPONSE_MAX
    responses = rng.lognormal(np.log(RESPONSE_MEDIAN), RESPONSE_SIGMA, size=rollouts)
    responses = np.clip(responses.astype(np.int64), RESPONSE_MIN, limit)
    return np.repeat(prompts, GROUP)[:rollouts] + responses


# --- one configuration ---------------------------------------------------------------------------------


def evaluate(layout: Layout, lengths: np.ndarray, ranks: int, budget: int, scored: dict) -> dict:
    """What one layout gives: rank costs per scorer, micro-batches, empty ones, violations."""
    check_layout(layout, len(lengths), ranks)
    slot = layout.rank * layout.per_rank + layout.batch
    slots = ranks * layout.per_rank
    tokens = np.bincount(slot, weights=lengths, minlength=slots)
    members = np.bincount(slot, minlength=slots)
    over = tokens > budget
    return {
        "rank_costs": {
            name: np.bincount(layout.rank, weights=c, minlength=ranks) for name, c in scored.items()
        },
        "per_rank": layout.per_rank,
        "empty": int((members == 0).sum()),
        "violations": int((over & (members > 1)).sum()),
        "alone_over": int((over & (members == 1)).sum()),
        "max_tokens": int(tokens.max()),
    }


def same_lengths(a: Layout, b: Layout, lengths: np.ndarray, ranks: int) -> bool:
    """Whether two layouts hold the same lengths in every rank's micro-batches (up to their order)."""
    if a.per_rank != b.per_rank:
        return False

    def content(layout: Layout, rank: int) -> list:
        mine = np.flatnonzero(layout.rank == rank)
        return sorted(
            tuple(sorted(lengths[mine[layout.batch[mine] == k]].tolist())) for k in range(a.per_rank)
        )

    return all(content(a, r) == content(b, r) for r in range(ranks))


def best_of(runners: dict[str, Callable[[], Layout]], repeats: int) -> tuple[dict, dict, dict]:
    """One warm call of each runner (its layout), then ``repeats`` interleaved rounds: the best CPU
    seconds and the best wall seconds of each."""
    layouts = {name: run() for name, run in runners.items()}
    cpu: dict[str, list] = {name: [] for name in runners}
    wall: dict[str, list] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return layouts, {name: min(v) for name, v in cpu.items()}, {name: min(v) for name, v in wall.items()}


def run_config(verl, rollouts: int, ranks: int, budget: int, args, capped: bool = True) -> dict:
    """Every planner on ``args.steps`` steps of one configuration; returns its figures (JSON-ready)."""
    started = time.perf_counter()
    results: dict[str, list] = {name: [] for name in PLANNERS}
    ms: dict[str, list] = {name: [] for name in (*PLANNERS, "verl balance")}
    wall_ms: list[float] = []
    beyond_bound = 0
    refused: dict[str, str] = {}
    floors: dict[str, list] = {name: [] for name in SCORERS}
    means: dict[str, list] = {name: [] for name in SCORERS}
    longest, check = 0, None
    for step in range(args.steps):
        lengths = make_step(rollouts, budget, args.seed, step, capped)
        longest = max(longest, int(lengths.max()))
        scored = {name: model.sequence_costs(lengths) for name, model in SCORERS.items()}
        costs = scored[COST_MODEL]
        for name, c in scored.items():
            floors[name].append(max(c.sum() / ranks, c.max()))
            means[name].append(c.sum() / ranks)
        layouts: dict[str, Layout | None] = {}
        for name, workloads in ((VERL, None), (VERL_COST, costs)):
            start = time.process_time()
            shares = verl_balance(verl, lengths, ranks, workloads)
            if name == VERL:
                ms["verl balance"].append(1e3 * (time.process_time() - start))
            try:
                layouts[name] = verl_micro_batches(lengths, shares, budget)
            except VerlRefused as refusal:
                layouts[name] = None
                refused[name] = str(refusal)
                continue
            if name == VERL and step == 0 and rollouts * layouts[name].per_rank <= args.verl_check_limit:
                own, slowest = verl_micro_batches_by_verl(verl, lengths, shares, budget)
                check = {
                    "same": same_lengths(own, layouts[name], lengths, ranks),
                    "slowest_rank_ms": 1e3 * slowest,
                }
        start = time.process_time()
        layouts[SLIME] = slime_plan(lengths, ranks, budget, LLAMA.sequence_costs(lengths))
        ms[SLIME].append(1e3 * (time.process_time() - start))
        runners = {
            FFD: lambda x=lengths: ffd_plan(x, ranks, budget),
            PIECES: lambda x=lengths: pieces_plan(x, ranks, budget, LLAMA.sequence_costs(x)),
            STEP: lambda x=lengths: step_plan(x, ranks, budget, LLAMA, allow_oversize=not capped),
        }
        timed, best, wall = best_of(runners, args.repeats)
        layouts.update(timed)
        for name, seconds in best.items():
            ms[name].append(1e3 * seconds)
        wall_ms.append(1e3 * wall[STEP])
        for name in PLANNERS:
            if layouts.get(name) is not None:
                results[name].append(evaluate(layouts[name], lengths, ranks, budget, scored))
        # plan_step's stated bound: the slowest rank costs at most mean + (1 - 1/DP) * the costliest sequence
        slowest = results[STEP][-1]["rank_costs"][COST_MODEL].max()
        beyond_bound += bool(slowest > (costs.sum() / ranks + (1 - 1 / ranks) * costs.max()) * (1 + 1e-12))
    floor = {name: float(np.sum(floors[name]) / np.sum(means[name]) - 1.0) for name in SCORERS}
    planners = {}
    for name in PLANNERS:
        runs = results[name]
        if not runs:
            planners[name] = {"refused": refused.get(name, "")}
            continue
        planners[name] = {
            "overhead": {
                scorer: straggler_overhead(np.stack([r["rank_costs"][scorer] for r in runs]))
                for scorer in SCORERS
            },
            "per_rank": [r["per_rank"] for r in runs],
            "empty": sum(r["empty"] for r in runs),
            "violations": sum(r["violations"] for r in runs),
            "alone_over": sum(r["alone_over"] for r in runs),
            "max_tokens": max(r["max_tokens"] for r in runs),
            "ms": statistics.median(ms[name]) if ms[name] else None,
            "ms_max": max(ms[name]) if ms[name] else None,
        }
    planners[STEP]["wall_ms"] = statistics.median(wall_ms)
    planners[STEP]["steps_beyond_bound"] = beyond_bound
    verl_ms = statistics.median(ms["verl balance"])
    config = {
        "rollouts": rollouts,
        "dp": ranks,
        "budget": budget,
        "capped": capped,
        "steps": args.steps,
        "longest": longest,
        "floor": floor,
        "planners": planners,
        "verl_balance_ms": verl_ms,
        "verl_check": check,
        "seconds": time.perf_counter() - started,
    }
    config["goals"] = goals(config)
    return config


def goals(config: dict) -> dict:
    """Issue 29's three goals on one configuration: True, False, or None where they do not apply."""
    planners = config["planners"]
    mine = planners[STEP]
    overhead = mine["overhead"][COST_MODEL]
    peers = {name: planners[name]["overhead"][COST_MODEL] for name in PEERS if "overhead" in planners[name]}
    fitting = {name: value for name, value in peers.items() if planners[name]["violations"] == 0}
    best = min(peers.values())
    best_fitting = min(fitting.values()) if fitting else None
    verls = [planners[name]["per_rank"] for name in VERLS if "per_rank" in planners[name]]
    fewer = None
    if verls:
        fewer = all(m <= min(v[i] for v in verls) for i, m in enumerate(mine["per_rank"]))
    timed = config["rollouts"] == GOAL_ROLLOUTS and config["dp"] == GOAL_DP
    floor = config["floor"][COST_MODEL]
    return {
        "at_floor": overhead <= floor + 1e-9 * (1 + floor),
        "best_peer": min(peers, key=peers.get),
        "best_peer_overhead": best,
        "best_fitting_peer_overhead": best_fitting,
        "overhead": overhead <= GOAL_RATIO * best or overhead <= GOAL_ABSOLUTE,
        "overhead_by_ratio": overhead <= GOAL_RATIO * best,
        "at_most_best_peer": overhead <= best,
        "at_most_best_fitting_peer": None if best_fitting is None else overhead <= best_fitting,
        "overhead_vs_fitting": None
        if best_fitting is None
        else overhead <= GOAL_RATIO * best_fitting or overhead <= GOAL_ABSOLUTE,
        "micro_batches": fewer,
        "most_more_than_verl": None
        if not verls
        else max(m - min(v[i] for v in verls) for i, m in enumerate(mine["per_rank"])),
        "time": (mine["ms"] <= GOAL_MS) if timed else None,
        "time_wall": (mine["wall_ms"] <= GOAL_MS) if timed else None,
    }


# --- report --------------------------------------------------------------------------------------------


def verdict(value: bool | None, at_floor: bool = False) -> str:
    """``met``, ``MISS`` (``at floor`` where no planner could do better), ``n.a.`` where it does not apply."""
    if value is None:
        return "n.a."
    return "met" if value else ("at floor" if at_floor else "MISS")


def overhead_verdict(goal: dict) -> str:
    """``met: half`` (at most half the best peer's), ``met: <=0.5%`` (only by the absolute clause),
    ``at floor`` (missed, but no planner can do better) or ``MISS``."""
    if goal["overhead_by_ratio"]:
        return "met: half"
    if goal["overhead"]:
        return "met: <=0.5%"
    return "at floor" if goal["at_floor"] else "MISS"


def pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def cell(planner: dict, key: Callable[[dict], object]) -> object:
    return "refused" if "refused" in planner else key(planner)


def tables(configs: list[dict], oversize: list[dict]) -> dict:
    """The result's tables (rendered by the docs' hook)."""
    head = ["rollouts", "DP", "budget"]

    def where(config: dict) -> list:
        return [config["rollouts"], config["dp"], config["budget"]]

    out = {}
    rows = []
    for c in configs:
        p = c["planners"]
        rows.append(
            [
                *where(c),
                pct(c["floor"][COST_MODEL]),
                *[cell(p[name], lambda x: pct(x["overhead"][COST_MODEL])) for name in PLANNERS],
                overhead_verdict(c["goals"]),
            ]
        )
    out["overhead"] = table(
        [*head, "floor %", *[f"{name} %" for name in PLANNERS], "goal"],
        rows,
        f"straggler overhead (%), scored by {COST_MODEL}: sum of slowest rank / sum of mean - 1 over the "
        "steps; goal: plan_step at most half the best peer's (met: half) or at most 0.5% (met: <=0.5%); at "
        "floor: missed, but no planner can do better than the floor",
    )
    rows = []
    for c in configs:
        p, g = c["planners"], c["goals"]
        rows.append(
            [
                *where(c),
                *[cell(p[name], lambda x: float(np.mean(x["per_rank"]))) for name in PLANNERS],
                g["most_more_than_verl"],
                p[STEP]["empty"],
                verdict(g["micro_batches"]),
            ]
        )
    out["micro_batches"] = table(
        [*head, *PLANNERS, "plan_step - verl (most)", "plan_step empty", "goal"],
        rows,
        "micro-batches per rank (mean over steps; every rank the same count); goal: plan_step never more "
        "than verl on any step",
    )
    rows = []
    for c in configs:
        p = c["planners"]
        rows.append([*where(c), *[cell(p[name], lambda x: x["violations"]) for name in PLANNERS]])
    out["violations"] = table(
        [*head, *PLANNERS],
        rows,
        "budget violations: micro-batches over the budget holding two or more sequences (all steps)",
    )
    rows = []
    for c in configs:
        p, check = c["planners"], c["verl_check"]
        rows.append(
            [
                *where(c),
                c["verl_balance_ms"],
                None if check is None else check["slowest_rank_ms"],
                *[p[name]["ms"] for name in (SLIME, FFD, PIECES, STEP)],
                p[STEP]["ms_max"],
                p[STEP]["wall_ms"],
                verdict(c["goals"]["time"]),
                verdict(c["goals"]["time_wall"]),
            ]
        )
    out["timing"] = table(
        [
            *head,
            "verl balance_batch ms",
            "verl micro-batching ms (slowest rank)",
            f"{SLIME} ms",
            f"{FFD} ms",
            f"{PIECES} ms",
            f"{STEP} ms",
            f"{STEP} ms (slowest step)",
            f"{STEP} wall ms",
            "goal (CPU)",
            "goal (wall)",
        ],
        rows,
        "planning time per step on one core, CPU ms (median over steps; FFD, pieces and plan_step best "
        "of the rounds; plan_step's wall-clock best beside); verl's micro-batching only where verl's own "
        f"code ran (the first step); goal: plan_step at most {GOAL_MS:g} ms at {GOAL_ROLLOUTS:,} "
        f"rollouts, DP {GOAL_DP}",
    )
    for key, scorer in (("robust_tokens", "tokens only"), ("robust_quadratic", "quadratic x10")):
        rows = []
        for c in configs:
            p = c["planners"]
            rows.append(
                [
                    *where(c),
                    pct(c["floor"][scorer]),
                    *[cell(p[name], lambda x, s=scorer: pct(x["overhead"][s])) for name in PLANNERS],
                ]
            )
        out[key] = table(
            [*head, "floor %", *[f"{name} %" for name in PLANNERS]],
            rows,
            f"straggler overhead (%) of the same layouts (balanced with {COST_MODEL}) scored by {scorer}",
        )
    rows = []
    for c in oversize:
        p = c["planners"]
        rows.append(
            [
                *where(c),
                c["longest"],
                *[cell(p[name], lambda x: pct(x["overhead"][COST_MODEL])) for name in PLANNERS],
                *[
                    cell(p[name], lambda x: float(np.mean(x["per_rank"])))
                    for name in (SLIME, FFD, PIECES, STEP)
                ],
                *[cell(p[name], lambda x: x["violations"]) for name in (SLIME, FFD, PIECES, STEP)],
            ]
        )
    out["oversize"] = table(
        [
            *head,
            "longest",
            *[f"{name} %" for name in PLANNERS],
            *[f"{name} per rank" for name in (SLIME, FFD, PIECES, STEP)],
            *[f"{name} violations" for name in (SLIME, FFD, PIECES, STEP)],
        ],
        rows,
        "responses to 32,768 tokens at the smallest budget (sequences above it): overhead (%) by "
        f"{COST_MODEL}, micro-batches per rank, violations; a sequence above the budget alone is not one",
    )
    rows = [
        [*where(c), c["verl_check"]["same"], c["verl_check"]["slowest_rank_ms"]]
        for c in configs
        if c["verl_check"] is not None
    ]
    out["verl_check"] = table(
        [*head, "same micro-batches", "slowest rank ms"],
        rows,
        "verl's own rearrange_micro_batches on every rank (first step) against the replay: the same "
        "lengths in every micro-batch",
    )
    return out


def headline(configs: list[dict]) -> dict:
    def count(key: str) -> str:
        applies = [c["goals"][key] for c in configs if c["goals"][key] is not None]
        return f"{sum(applies)} of {len(applies)}"

    timed = [c for c in configs if c["goals"]["time"] is not None]
    mine = [c["planners"][STEP]["overhead"][COST_MODEL] for c in configs]
    best = [c["goals"]["best_peer_overhead"] for c in configs]
    missed = [c for c in configs if c["goals"]["overhead"] is False]
    figures = {
        "configurations": len(configs),
        "overhead goal met (configurations)": count("overhead"),
        "overhead goal missed with plan_step at the floor": f"{sum(c['goals']['at_floor'] for c in missed)} "
        f"of {len(missed)}",
        "overhead goal met against peers within the budget": count("overhead_vs_fitting"),
        "overhead goal met by its first clause (at most half the best peer's)": count("overhead_by_ratio"),
        "plan_step's overhead at most the best peer's": count("at_most_best_peer"),
        "plan_step's overhead at most the best peer's within the budget": count("at_most_best_fitting_peer"),
        "micro-batch goal met (configurations)": count("micro_batches"),
        "worst plan_step overhead (%)": 100 * max(mine),
        "worst best-peer overhead (%)": 100 * max(best),
        "best-peer overhead, median over configurations (%)": 100 * statistics.median(best),
    }
    if timed:
        figures[f"plan_step ms per step, {GOAL_ROLLOUTS:,} rollouts at DP {GOAL_DP} (slowest budget)"] = max(
            c["planners"][STEP]["ms"] for c in timed
        )
        figures[
            f"plan_step wall ms per step, {GOAL_ROLLOUTS:,} rollouts at DP {GOAL_DP} (slowest budget)"
        ] = max(c["planners"][STEP]["wall_ms"] for c in timed)
        figures["planning-time goal met (CPU)"] = count("time")
        figures["planning-time goal met (wall)"] = count("time_wall")
    figures["steps where plan_step's slowest rank exceeds its stated bound"] = sum(
        c["planners"][STEP]["steps_beyond_bound"] for c in configs
    )
    checks = [c["verl_check"]["same"] for c in configs if c["verl_check"] is not None]
    figures["verl replay equal to verl's own micro-batching (steps checked)"] = (
        f"{sum(checks)} of {len(checks)}"
    )
    return figures


def print_config(config: dict) -> None:
    p, g = config["planners"], config["goals"]
    kind = "" if config["capped"] else " (oversize)"
    print(
        f"\n{config['rollouts']:>6} rollouts, DP {config['dp']:>3}, budget {config['budget']:>6}{kind}: "
        f"floor {100 * config['floor'][COST_MODEL]:.3f}%  ({config['seconds']:.1f} s)"
    )
    for name in PLANNERS:
        x = p[name]
        if "refused" in x:
            print(f"  {name:<18} refused: {x['refused']}")
            continue
        ms = "" if x["ms"] is None else f"{x['ms']:8.2f} ms"
        scored = "  ".join(f"{scorer} {100 * value:7.3f}%" for scorer, value in x["overhead"].items())
        print(
            f"  {name:<18} {scored}  per rank {np.mean(x['per_rank']):7.1f}  empty {x['empty']:4}  "
            f"violations {x['violations']:4}  {ms}"
        )
    print(
        f"  goals: overhead {verdict(g['overhead'], g['at_floor'])} (best peer {g['best_peer']} "
        f"{100 * g['best_peer_overhead']:.3f}%), micro-batches {verdict(g['micro_batches'])}, "
        f"time {verdict(g['time'])} (wall {verdict(g['time_wall'])}, {p[STEP]['wall_ms']:.2f} ms); "
        f"verl balance {config['verl_balance_ms']:.1f} ms"
        + ("" if config["verl_check"] is None else f"; verl check {config['verl_check']}")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--dp", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per configuration")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (the best is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--verl-check-limit",
        type=int,
        default=150_000,
        help="run verl's own rearrange_micro_batches where rollouts x micro-batches per rank is at most this",
    )
    add_size_options(parser, "step_planner")
    args = parser.parse_args()
    size = choose_size(args, QUICK, FULL)
    started = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    verl = load_verl()
    print(f"verl's module: {verl.__tightpack_source__}; cost model {COST_MODEL}: {LLAMA}")
    configs, oversize = [], []
    for rollouts in args.rollouts:
        for budget in args.budgets:
            for ranks in args.dp:
                configs.append(run_config(verl, rollouts, ranks, budget, args))
                print_config(configs[-1])
    for rollouts in args.rollouts:
        for ranks in args.dp:
            oversize.append(run_config(verl, rollouts, ranks, min(args.budgets), args, capped=False))
            print_config(oversize[-1])
    figures = headline(configs)
    print()
    for label, value in figures.items():
        print(f"{label}: {value}")
    report = {
        "cost_model": {"name": COST_MODEL, **LLAMA.to_dict()},
        "scorers": {name: model.to_dict() for name, model in SCORERS.items()},
        "verl": {"version": "0.9.1", "module": verl.__tightpack_source__},
        "configs": configs,
        "oversize": oversize,
    }
    write_result(
        "step_planner",
        args,
        size,
        figures=figures,
        tables=tables(configs, oversize),
        report=report,
        seconds=time.perf_counter() - started,
    )


if __name__ == "__main__":
    main()
