"""Memory: peak memory of `tightpack pack`, parent and workers together, on a synthetic corpus of 100M tokens.

The corpus is pre-tokenized (``--format tokens``): random GPT-2 ids, lengths drawn from the demo
corpus's distribution (`demo_lengths.py`) and capped at the pack size, written as Parquet in
row groups. ``tightpack pack`` runs as a child process, its workers are forked from it, and the whole
process tree is sampled with psutil every ``--interval`` seconds:

- peak tree PSS (the verdict): every process's proportional set size, summed. A page shared by k
  processes counts 1/k in each, so what the forked workers share with the parent (copy-on-write
  heap, libraries, the memory-mapped token store) counts once: the memory the tree holds.
- peak tree RSS: resident sets summed; shared pages count once per process (an upper bound).
- per-process peaks: each process's ``VmHWM`` (its kernel high-water mark, exact between samples),
  the largest and their sum (an upper bound of the tree's RSS peak: the peaks need not coincide).

Sampling misses tree peaks shorter than the interval; ``VmHWM`` has no such gap but sees one process.
``getrusage(RUSAGE_CHILDREN).ru_maxrss`` is not used: it is the largest single descendant, not a sum,
and on Linux a child's figure includes this process's own resident set when it was forked (the
pre-exec image), so it measured the benchmark as much as ``tightpack pack``.

For scale, the run is timed (sampling included: reading every process's ``smaps_rollup`` costs CPU
and takes its memory-map lock, which slowed a 30M-token run by up to 40% on 2 busy cores; speed is
`bench_pipeline.py`'s job), and the token store it writes (into a private ``TIGHTPACK_CACHE``) is
measured on disk: every file under it, apparent size and allocated blocks (``du``). A packer that
holds samples as Python lists would need about 30 bytes per token (3 GB here). Linux only (PSS,
``/proc``).

Quick: 10M tokens; ``--full``: the documented 100M.

    .venv/bin/python benchmarks/bench_memory.py [--full] [--pack-size 8192] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, write_result

MIB = 2**20


def write_corpus(path: Path, tokens: int, pack_size: int, seed: int) -> tuple[int, int]:
    """Parquet of random-id samples until ``tokens`` tokens; returns (samples, tokens)."""
    rng = np.random.default_rng(seed)
    source = np.minimum(demo_runtime_lengths() + 1, pack_size)
    written = samples = 0
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    with pq.ParquetWriter(path, schema) as writer:
        while written < tokens:
            lengths = rng.choice(source, size=8192)
            lengths = (
                lengths[np.cumsum(lengths) <= tokens - written]
                if lengths.sum() > tokens - written
                else lengths
            )
            if len(lengths) == 0:
                lengths = np.array([tokens - written])
            values = rng.integers(0, 50256, size=int(lengths.sum()), dtype=np.int32)
            offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
            column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            writer.write_table(pa.table({"input_ids": column}), row_group_size=4096)
            written += int(lengths.sum())
            samples += len(lengths)
    return samples, written


@dataclass
class TreePeak:
    """Peaks over the samples of a process tree, in bytes."""

    pss: int = 0
    rss: int = 0
    processes: int = 0  # most processes seen at once
    samples: int = 0
    high_water: dict[int, int] = field(default_factory=dict)  # pid -> last VmHWM seen


def high_water_mark(pid: int) -> int:
    """``VmHWM`` of a process in bytes: its peak resident set so far (reset at exec)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def run_sampled(command: list[str], env: dict[str, str], interval: float) -> TreePeak:
    """Run ``command``, sampling its process tree every ``interval`` seconds until it exits."""
    peak = TreePeak()
    process = psutil.Popen(command, env=env, stdout=subprocess.DEVNULL)
    while process.poll() is None:
        pss = rss = seen = 0
        try:
            tree = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:  # exited between poll and listing
            break
        for member in tree:
            try:
                info = member.memory_full_info()  # /proc/PID/smaps_rollup: cheap on Linux
                peak.high_water[member.pid] = high_water_mark(member.pid)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError, StopIteration):
                continue  # a worker that just ended
            pss, rss, seen = pss + info.pss, rss + info.rss, seen + 1
        peak.pss, peak.rss = max(peak.pss, pss), max(peak.rss, rss)
        peak.processes, peak.samples = max(peak.processes, seen), peak.samples + 1
        time.sleep(interval)
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, command)
    return peak


def disk_usage(folder: Path) -> tuple[int, int, int]:
    """(files, apparent bytes, allocated bytes as ``du`` counts them) of everything under ``folder``."""
    files = apparent = allocated = 0
    for root, _, names in os.walk(folder):
        for name in names:
            stat = os.lstat(os.path.join(root, name))
            files, apparent, allocated = files + 1, apparent + stat.st_size, allocated + stat.st_blocks * 512
    return files, apparent, allocated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="corpus tokens (quick 10M, full 100M)")
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between tree samples")
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "memory")
    args = parser.parse_args()
    size = choose_size(args, quick={"tokens": 10_000_000}, full={"tokens": 100_000_000})
    tightpack = str(Path(sys.executable).with_name("tightpack"))
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        scratch = Path(scratch)
        corpus = scratch / "corpus.parquet"
        samples, tokens = write_corpus(corpus, args.tokens, args.pack_size, args.seed)
        corpus_mib = corpus.stat().st_size / MIB
        print(f"synthetic corpus: {samples:,} samples, {tokens:,} tokens, {corpus_mib:,.0f} MiB")
        # The store is kept (--reuse, the default) in a private cache, so that it can be measured.
        env = {**os.environ, "TIGHTPACK_CACHE": str(scratch / "cache")}
        command = [tightpack, "pack", str(corpus), "--format", "tokens", "--pack-size", str(args.pack_size)]
        command += ["-o", str(scratch / "out"), "--workers", str(args.workers), "--reuse"]
        start = time.perf_counter()
        peak = run_sampled(command, env, args.interval)
        seconds = time.perf_counter() - start
        store_files, store_bytes, store_allocated = disk_usage(scratch / "cache" / "stores")
        _, out_bytes, _ = disk_usage(scratch / "out")
    largest, summed = max(peak.high_water.values()), sum(peak.high_water.values())
    result = {
        "samples": samples,
        "tokens": tokens,
        "seconds": seconds,
        "peak_tree_pss": peak.pss,
        "peak_tree_rss": peak.rss,
        "largest_process_peak_rss": largest,
        "summed_process_peaks_rss": summed,
        "processes": len(peak.high_water),
        "tree_samples": peak.samples,
        "store_bytes": store_bytes,
        "store_allocated_bytes": store_allocated,
        "store_files": store_files,
        "output_bytes": out_bytes,
    }
    runs = f"{peak.samples} samples of its tree, {len(peak.high_water)} processes"
    print(f"tightpack pack --workers {args.workers}: {seconds:.1f} s with sampling ({runs})")
    print(f"  peak tree PSS        {peak.pss / MIB:7,.0f} MiB  parent + workers, shared pages counted once")
    print(f"  peak tree RSS        {peak.rss / MIB:7,.0f} MiB  shared pages counted in every process")
    print(f"  largest process      {largest / MIB:7,.0f} MiB  its VmHWM (kernel high-water mark)")
    print(f"  sum of process peaks {summed / MIB:7,.0f} MiB  VmHWM summed: bounds the tree's RSS peak")
    print(
        f"token store on disk: {store_bytes / MIB:,.0f} MiB in {store_files} files "
        f"({store_allocated / MIB:,.0f} MiB allocated), {store_bytes / tokens:.2f} bytes per token"
    )
    print(f"packed output: {out_bytes / MIB:,.0f} MiB")
    verdict = "PASS" if peak.pss < 1.5 * 2**30 else "FAIL"
    print(f"[{verdict}] peak tree PSS < 1.5 GiB ({peak.pss / 2**30:.2f} GiB)")
    figures = {
        "corpus tokens": tokens,
        "corpus samples": samples,
        "peak tree PSS (MiB), parent + workers": peak.pss / MIB,
        "peak tree RSS (MiB), shared pages in every process": peak.rss / MIB,
        "largest process VmHWM (MiB)": largest / MIB,
        "token store on disk (bytes per token)": store_bytes / tokens,
        "wall time with sampling (s)": seconds,
    }
    write_result("memory", args, size, figures=figures, report=result, seconds=seconds)


if __name__ == "__main__":
    main()
