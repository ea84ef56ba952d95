"""Driver memory per sample of ``--engine ray``: what the driver holds between the two passes.

The driver of a Ray run reads per-sample tables from the workers' parts (stored lengths, source
rows, supervised counts, the cuts of long samples), applies the long-sample policy, plans, and cuts
the plan into one task per output file. This measures the heap those steps allocate, per sample,
on synthetic parts (no Ray: the same functions the engine calls, in this process), at two corpus
sizes; the slope between them is the per-sample cost, the intercept the fixed one. numpy reports
its allocations to ``tracemalloc``, so the peak is the arrays' (not the interpreter's or Ray's, which
`benchmarks/bench_engines.py` measures whole, as the process's resident set).

Samples have demo-like lengths scaled to the pack size (log-normal, the median 300/4096 of it, a
tail past it, so some are cut), stored as parts of 50,000 samples, as a worker writes them; tokens
are written once as zeros (the driver reads only the cut ones). The default pack size of 512 keeps
16M samples within 1.5 GB of disk; the driver's memory per sample does not depend on it. Arrays
over one output file (up to 100,000 packs) are a fixed cost, so the slope is taken between sizes of
several files each. The goal of issue 14: at most 16 bytes per sample.

Quick: 1M and 4M samples (the slope; its intercept is rougher); ``--full``: the documented 4M and 16M.

    .venv/bin/python benchmarks/bench_driver_memory.py [--full] [--pack-size 512]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from results import add_size_options, choose_size, table, write_result
from tightpack.core.long_samples import cut_long_samples, gathered_cut
from tightpack.core.parted_store import PartedStore, write_supervised
from tightpack.core.stats import pack_stats
from tightpack.core.token_store import TokenStoreWriter
from tightpack.offline.accounting import account_samples
from tightpack.offline.config import PackConfig
from tightpack.offline.engines.ray import shard_work
from tightpack.offline.pipeline import plan_kept
from tightpack.prepare.tokenize import TokenizeReport

PART_SAMPLES = 50_000


def write_parts(folder: Path, samples: int, pack_size: int, rng: np.random.Generator) -> list[Path]:
    """Parts of demo-like samples, long ones cut as a worker cuts them (into ``truncated``)."""
    parts = []
    for number, first in enumerate(range(0, samples, PART_SAMPLES)):
        count = min(PART_SAMPLES, samples - first)
        median = pack_size * 300 // 4096  # the demo corpus's median at a pack size of 4,096
        lengths = np.clip(rng.lognormal(np.log(median), 1.0, count).astype(np.int64), 2, 4 * pack_size)
        total = int(lengths.sum())
        mask = np.ones(total, np.int8)
        writer = TokenStoreWriter(folder / f"part-{number:08d}")
        writer.append(np.zeros(total, np.int32), mask, lengths, np.arange(count))
        store = writer.close()
        write_supervised(store)
        long = np.flatnonzero(store.lengths > pack_size + 1)
        cut_long_samples(store, long, pack_size + 1, "right", store.directory / "truncated")
        parts.append(store.directory)
    return parts


def driver_steps(parts: list[Path], config: PackConfig, staging: Path) -> int:
    """What the driver does between the passes; returns the number of output files."""
    counts = [PartedStore.from_parts([part], [0]).first_sample[-1] for part in parts]
    first_row = np.concatenate(([0], np.cumsum(counts)[:-1]))
    store = PartedStore.from_parts(parts, first_row)
    cut = gathered_cut(store, [part / "truncated" for part in parts])
    report = TokenizeReport(store, len(store), [], cut=cut)
    _, keep, aligned, _, overlay = account_samples(store, config, report, staging)
    plan, _ = plan_kept(aligned, keep, config)
    del keep  # as the pipeline does
    pack_stats(plan, aligned, config.packed_sequence_size)
    files = 0
    for _ in shard_work(plan, aligned, overlay):  # what the driver ships to each file's task
        files += 1
    return files


def measure(samples: int, pack_size: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        parts = write_parts(folder, samples, pack_size, np.random.default_rng(seed))
        config = PackConfig(packed_sequence_size=pack_size, reuse_store=False)
        gc.collect()
        tracemalloc.start()
        clock = time.perf_counter()
        files = driver_steps(parts, config, folder / "staging")
        seconds = time.perf_counter() - clock
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return {"samples": samples, "peak": peak, "seconds": seconds, "files": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, nargs=2, default=None, help="the two sizes (quick 1M 4M, full 4M 16M)"
    )
    parser.add_argument("--pack-size", type=int, default=512, help="lengths scale with it (disk: tokens)")
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "driver_memory")
    args = parser.parse_args()
    size = choose_size(
        args, quick={"samples": [1_000_000, 4_000_000]}, full={"samples": [4_000_000, 16_000_000]}
    )
    started = time.perf_counter()
    small, large = (measure(n, args.pack_size, args.seed) for n in args.samples)
    for row in (small, large):
        print(
            f"{row['samples']:>11,} samples: driver heap peak {row['peak'] / 2**20:8.1f} MiB "
            f"({row['peak'] / row['samples']:5.1f} B/sample), {row['seconds']:.2f} s, {row['files']} files"
        )
    slope = (large["peak"] - small["peak"]) / (large["samples"] - small["samples"])
    intercept = small["peak"] - slope * small["samples"]
    print(f"per sample: {slope:.1f} B (goal 16 B); fixed: {intercept / 2**20:.1f} MiB")
    print(f"at 1B samples: {slope * 1e9 / 1e9:.0f} GB of driver heap")
    rows = [
        [r["samples"], r["peak"] / 2**20, r["peak"] / r["samples"], r["seconds"], r["files"]]
        for r in (small, large)
    ]
    header = ["samples", "driver heap peak (MiB)", "bytes per sample", "seconds", "output files"]
    figures = {
        "driver heap per sample, the slope (B)": slope,
        "fixed, the intercept (MiB)": intercept / 2**20,
    }
    write_result("driver_memory", args, size, figures=figures,
                 tables={"sizes": table(header, rows, f"pack size {args.pack_size}")},
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
