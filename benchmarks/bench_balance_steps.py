"""Real data-parallel step times: in-order dealing of packs vs cost-balanced dealing (issue 13).

Two processes (torch.distributed, gloo, one thread each: DP = 2) train the same small Llama (the
calibration model of `tightpack.runtime.calibration`, varlen attention) on packs planned by
`tightpack.core.planner.plan_packs` from long-tailed synthetic lengths. Every step, each rank runs
forward + backward on its packs of the global batch, then the gradients are all-reduced. Two samplers
deal the same packs: exactly ``steps x GBS`` of them, one epoch of each sampler (same seed):

- baseline: `PackedBatchSampler(dataloader_type="batch", micro_batch_size=1)`, rank ``d`` takes
  positions ``d, d + DP, ...``;
- balanced: `BalancedPackedBatchSampler` (its default, ``regroup=True``: packs grouped into global
  batches and dealt by cost) on the pack costs of a cost model, calibrated by both processes at once
  at the start of the run (so the fit sees the same contention as the training steps), or
  ``--cost-model FILE``.

Steps of both run interleaved (baseline step s, balanced step s, control step s) so drifting machine
load hits all of them. The control gives both ranks the same packs (equal work): its straggler
overhead is the timing noise of the machine, the floor any dealing pays here.
A step's compute time is the slower rank's (all-reduce MAX of each rank's forward + backward time);
its wall time adds the gradient all-reduce. The prediction: the same dealing of the same packs,
costed by the cost model (plus its per-pack intercept), max over ranks per step, and
`tightpack.core.balance.straggler_overhead`.

Quick: 8 steps of packs of up to 1,024 tokens; ``--full``: the documented 30 steps of up to 4,096.

    .venv/bin/python benchmarks/bench_balance_steps.py [--full] [--global-batch-size 4]
        [--seed 0] [--cost-model FILE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from results import add_size_options, choose_size, table, write_result
from tightpack.core.balance import straggler_overhead
from tightpack.core.cost_model import CostModel
from tightpack.core.planner import plan_packs
from tightpack.runtime.balanced_sampler import BalancedPackedBatchSampler
from tightpack.runtime.calibration import (
    build_calibration_model,
    calibrate_cost_model,
    packed_inputs,
    train_step,
)
from tightpack.runtime.samplers import PackedBatchSampler

RANKS = 2
MODES = ("baseline", "balanced")
CONTROL = "control"
"""Both ranks run the same packs (rank 0's of the balanced dealing): equal work, so its measured
straggler overhead is the timing noise alone, the floor any dealing pays on this machine."""
TIMED = (*MODES, CONTROL)


def synthetic_lengths(count: int, pack_size: int, rng: np.random.Generator) -> np.ndarray:
    """Long-tailed sample lengths ``[count]``: lognormal (median ~200 tokens) plus 5% above half a pack."""
    lengths = rng.lognormal(mean=np.log(200), sigma=1.0, size=count)
    tail = rng.random(count) < 0.05
    lengths[tail] = rng.uniform(pack_size / 2, pack_size, size=int(tail.sum()))
    return np.clip(np.rint(lengths), 16, pack_size).astype(np.int64)


def plan_packs_for_run(packs_needed: int, pack_size: int, seed: int) -> tuple[int, list[np.ndarray]]:
    """The sample count planned and the sample lengths of ``packs_needed`` packs drawn from the plan.

    Exactly ``steps * GBS`` packs make one epoch of both samplers: the balanced sampler regroups packs
    across the steps of an epoch, so with more packs its first steps would not hold the same packs as
    the baseline's, and the two runs would not do the same work.
    """
    rng = np.random.default_rng(seed)
    count = packs_needed * 4
    while True:
        lengths = synthetic_lengths(count, pack_size, rng)
        plan = plan_packs(lengths, pack_size)
        if len(plan) >= packs_needed:
            chosen = np.sort(rng.choice(len(plan), size=packs_needed, replace=False))
            return len(lengths), [lengths[plan[int(i)]] for i in chosen]
        count *= 2


def dealings(
    sampler_kind: str, pack_costs: np.ndarray, steps: int, gbs: int, seed: int
) -> list[list[list[int]]]:
    """``[rank][step]`` -> the pack indices of that rank at that step, for ``steps`` steps."""
    result = []
    for rank in range(RANKS):
        common = {
            "global_batch_size": gbs,
            "data_parallel_rank": rank,
            "data_parallel_size": RANKS,
            "seed": seed,
        }
        if sampler_kind == "baseline":
            sampler = PackedBatchSampler(
                len(pack_costs), dataloader_type="batch", micro_batch_size=1, **common
            )
        else:
            sampler = BalancedPackedBatchSampler(pack_costs, **common)
        result.append([[int(i) for i in indices] for indices in sampler][:steps])
    return result


def _calibrate_together(rank: int, config: dict) -> dict:
    """Both ranks calibrate at once, so the fit sees the contention of the training run (two processes
    on the machine); rank 0's fit costs the packs and deals them, and every rank gets the result."""
    dist.barrier()
    fit = calibrate_cost_model(
        model_config=config["model_config"], pack_widths=config["widths"], repeats=3, threads=1
    )
    shared = [None]
    if rank == 0:
        costs = np.array([fit.model.sequence_costs(np.array(p)).sum() for p in config["packs"]])
        shared = [
            {
                "cost_model": fit.model.to_dict(),
                "fit": {"r2": fit.r2, "relative_rmse": fit.relative_rmse, "per_pack": fit.per_pack},
                "costs": costs.tolist(),
                "dealings": {
                    kind: dealings(kind, costs, config["steps"], config["gbs"], config["seed"])
                    for kind in MODES
                },
            }
        ]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _worker(rank: int, store_path: str, config: dict, result_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, RANKS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    try:
        started = time.perf_counter()
        if config["dealings"] is None:
            config = config | _calibrate_together(rank, config)
        calibration_seconds = time.perf_counter() - started
        model = build_calibration_model(config["model_config"], seed=config["seed"])
        vocab = model.config.vocab_size
        packs = config["packs"]

        def inputs_of(pack: int) -> dict:
            generator = torch.Generator().manual_seed(config["seed"] * 1_000_003 + pack)
            return packed_inputs(packs[pack], vocab, generator)

        train_step(model, inputs_of(0))  # warm up the kernels
        compute = {mode: np.zeros((config["steps"], RANKS)) for mode in TIMED}
        wall = {mode: np.zeros(config["steps"]) for mode in TIMED}
        for step in range(config["steps"]):
            for mode in TIMED:
                dealt_to = 0 if mode == CONTROL else rank
                mine = config["dealings"]["balanced" if mode == CONTROL else mode][dealt_to][step]
                batch = [inputs_of(pack) for pack in mine]
                model.zero_grad(set_to_none=True)
                dist.barrier()
                start = time.perf_counter()
                for inputs in batch:
                    train_step(model, inputs)
                seconds = time.perf_counter() - start
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
                dist.all_reduce(grads)
                wall[mode][step] = time.perf_counter() - start
                gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(RANKS)]
                dist.all_gather(gathered, torch.tensor([seconds], dtype=torch.float64))
                compute[mode][step] = [float(t) for t in gathered]
        if rank == 0:
            data = {mode: {"compute": compute[mode].tolist(), "wall": wall[mode].tolist()} for mode in TIMED}
            data.update(
                {key: config.get(key) for key in ("cost_model", "fit", "costs", "dealings")},
                calibration_seconds=calibration_seconds,
            )
            Path(result_path).write_text(json.dumps(data))
    finally:
        dist.destroy_process_group()


def predicted_rank_costs(dealt: list[list[list[int]]], costs: np.ndarray, per_pack: float) -> np.ndarray:
    """``[steps, ranks]``: the modelled seconds of each rank's packs at each step."""
    steps = len(dealt[0])
    return np.array(
        [[costs[dealt[r][s]].sum() + per_pack * len(dealt[r][s]) for r in range(RANKS)] for s in range(steps)]
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps of each sampler (quick 8, full 30)")
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--pack-size", type=int, default=None, help="pack size (quick 1,024, full 4,096)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-model", help="a cost model JSON (seconds); default: calibrate first")
    parser.add_argument("--model-config", default="{}", help="LlamaConfig overrides, JSON")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_size_options(parser, "balance_steps")
    args = parser.parse_args(argv)
    args.size = choose_size(
        args, quick={"steps": 8, "pack_size": 1024}, full={"steps": 30, "pack_size": 4096}
    )
    started = time.perf_counter()
    model_config = json.loads(args.model_config)

    needed = args.steps * args.global_batch_size
    samples, pack_lengths = plan_packs_for_run(needed, args.pack_size, args.seed)
    config = {
        "model_config": model_config,
        "seed": args.seed,
        "steps": args.steps,
        "gbs": args.global_batch_size,
        "widths": sorted({args.pack_size // 4, args.pack_size // 2, args.pack_size}),
        "packs": [p.tolist() for p in pack_lengths],
        "dealings": None,  # calibrated and dealt in the workers, under the run's own contention
    }
    if args.cost_model:
        cost_model = CostModel.resolve(args.cost_model)
        costs = np.array([cost_model.sequence_costs(p).sum() for p in pack_lengths])
        config.update(
            cost_model=cost_model.to_dict(),
            fit=None,
            costs=costs.tolist(),
            dealings={
                kind: dealings(kind, costs, args.steps, args.global_batch_size, args.seed) for kind in MODES
            },
        )
    with tempfile.TemporaryDirectory() as folder:
        store_path, result_path = os.path.join(folder, "store"), os.path.join(folder, "result.json")
        timed = time.perf_counter()
        mp.spawn(_worker, args=(store_path, config, result_path), nprocs=RANKS, join=True)
        measured = json.loads(Path(result_path).read_text())
        run_seconds = time.perf_counter() - timed
    cost_model = CostModel.from_dict(measured["cost_model"])
    fit_summary = measured["fit"]
    per_pack = (fit_summary or {}).get("per_pack", 0.0)
    costs, dealt = np.array(measured["costs"]), measured["dealings"]
    predicted = {kind: predicted_rank_costs(dealt[kind], costs, per_pack) for kind in MODES}
    calibration_seconds = measured["calibration_seconds"]
    training_seconds = run_seconds - calibration_seconds

    report = {
        "cost_model": cost_model.to_dict(),
        "fit": fit_summary,
        "crossover_length": cost_model.crossover_length(),
        "samples": samples,
        "packs": len(pack_lengths),
        "steps": args.steps,
        "global_batch_size": args.global_batch_size,
        "pack_size": args.pack_size,
        "calibration_seconds": calibration_seconds,
        "training_seconds": training_seconds,
    }
    for kind in MODES:
        compute = np.array(measured[kind]["compute"])
        packs = sorted(p for rank in dealt[kind] for step in rank for p in step)
        report[kind] = {
            "packs_trained": len(packs),
            "tokens_trained": int(sum(pack_lengths[p].sum() for p in packs)),
            "measured_step_ms": float(compute.max(axis=1).mean() * 1e3),
            "measured_mean_rank_ms": float(compute.mean(axis=1).mean() * 1e3),
            "measured_wall_step_ms": float(np.mean(measured[kind]["wall"]) * 1e3),
            "measured_straggler_overhead": straggler_overhead(compute),
            "predicted_step_ms": float(predicted[kind].max(axis=1).mean() * 1e3),
            "predicted_mean_rank_ms": float(predicted[kind].mean(axis=1).mean() * 1e3),
            "predicted_straggler_overhead": straggler_overhead(predicted[kind]),
        }
    control = np.array(measured[CONTROL]["compute"])
    report["noise_floor_straggler_overhead"] = straggler_overhead(control)
    # Per rank-step, measured over predicted seconds: the spread the cost model does not explain.
    ratios = np.concatenate(
        [np.array(measured[kind]["compute"]).ravel() / predicted[kind].ravel() for kind in MODES]
    )
    report["rank_step_relative_error"] = float(ratios.std() / ratios.mean())
    for key in (
        "measured_step_ms",
        "measured_mean_rank_ms",
        "measured_wall_step_ms",
        "predicted_step_ms",
        "predicted_mean_rank_ms",
    ):
        report[f"ratio_{key}"] = report["balanced"][key] / report["baseline"][key]
    save(report, args, time.perf_counter() - started)
    return report


def save(report: dict, args: argparse.Namespace, seconds: float) -> None:
    """The JSON result: measured and predicted straggler overheads, the noise floor, the step times."""
    base, balanced = report["baseline"], report["balanced"]
    figures = {
        "straggler overhead measured, baseline (%)": 100 * base["measured_straggler_overhead"],
        "straggler overhead measured, balanced (%)": 100 * balanced["measured_straggler_overhead"],
        "noise floor: both ranks the same packs (%)": 100 * report["noise_floor_straggler_overhead"],
        "straggler overhead predicted, baseline (%)": 100 * base["predicted_straggler_overhead"],
        "straggler overhead predicted, balanced (%)": 100 * balanced["predicted_straggler_overhead"],
        "step time measured, balanced / baseline": report["ratio_measured_step_ms"],
        "step time predicted, balanced / baseline": report["ratio_predicted_step_ms"],
        "rank-step measured / predicted, coefficient of variation (%)": 100
        * report["rank_step_relative_error"],
        "cost model fit R²": (report["fit"] or {}).get("r2"),
    }
    keys = [("step, max-rank compute (ms)", "measured_step_ms"),
            ("mean-rank compute (ms)", "measured_mean_rank_ms"),
            ("step, wall with all-reduce (ms)", "measured_wall_step_ms"),
            ("step, predicted (ms)", "predicted_step_ms"),
            ("straggler overhead, measured", "measured_straggler_overhead"),
            ("straggler overhead, predicted", "predicted_straggler_overhead")]  # fmt: skip
    rows = [[title, base[key], balanced[key]] for title, key in keys]
    title = (f"{report['steps']} steps of {report['global_batch_size']} packs of <= {report['pack_size']} "
             f"tokens, DP = {RANKS} gloo processes")  # fmt: skip
    write_result("balance_steps", args, args.size, figures=figures,
                 tables={"steps": table(["", "baseline", "balanced"], rows, title)}, report=report,
                 seconds=seconds)  # fmt: skip


def print_report(report: dict) -> None:
    model = report["cost_model"]
    fit = report["fit"] or {}
    print(
        f"cost model: linear {model['linear']:.3g} s/token, quadratic {model['quadratic']:.3g} s/token², "
        f"per sequence {model['per_sequence']:.3g} s, per pack {fit.get('per_pack', 0.0):.3g} s, "
        f"R² {fit.get('r2', float('nan')):.3f}, crossover {report['crossover_length']:,.0f} tokens "
        f"(calibration {report['calibration_seconds']:.1f} s)"
    )
    print(
        f"{report['samples']} samples planned, {report['packs']} packs of <= {report['pack_size']} "
        "tokens drawn (one epoch of both samplers); "
        f"{report['steps']} steps of {report['global_batch_size']} packs over DP = {RANKS} "
        f"(training {report['training_seconds']:.1f} s)"
    )
    rows = [
        ("packs trained", "packs_trained", "{:d}"),
        ("tokens trained", "tokens_trained", "{:d}"),
        ("step, max-rank compute (ms)", "measured_step_ms", "{:.1f}"),
        ("  mean-rank compute (ms)", "measured_mean_rank_ms", "{:.1f}"),
        ("step, wall incl. all-reduce (ms)", "measured_wall_step_ms", "{:.1f}"),
        ("step, predicted by cost model (ms)", "predicted_step_ms", "{:.1f}"),
        ("  mean-rank predicted (ms)", "predicted_mean_rank_ms", "{:.1f}"),
        ("straggler overhead, measured", "measured_straggler_overhead", "{:.3f}"),
        ("straggler overhead, predicted", "predicted_straggler_overhead", "{:.3f}"),
    ]
    print(f"{'':36} {'baseline':>10} {'balanced':>10} {'ratio':>7}")
    for title, key, form in rows:
        base, balanced = report["baseline"][key], report["balanced"][key]
        ratio = report.get(f"ratio_{key}")
        ratio_text = f"{ratio:.3f}" if ratio is not None else ""
        print(f"{title:36} {form.format(base):>10} {form.format(balanced):>10} {ratio_text:>7}")
    print(
        f"noise floor: straggler overhead {report['noise_floor_straggler_overhead']:.3f} with both ranks "
        "running the same packs; measured / predicted seconds of a rank's step vary by "
        f"{report['rank_step_relative_error']:.1%} (coefficient of variation)"
    )


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv[1:]:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
