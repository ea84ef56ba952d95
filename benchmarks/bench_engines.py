"""Engines: `tightpack pack --engine ray` (a local Ray cluster) against `--engine local`, same job.

The corpus is demo-distribution chat text tokenized by the built-in GPT-2: the embedded default
corpus (7,168 conversations) written as JSONL rows (``{"messages": [...]}``, as
``Chunk.parsed_rows()`` gives them), repeated until about ``--tokens`` tokens. Each copy prefixes
its first user message with ``[copy N]`` so that no two rows are identical. The corpus is written
once into ``--work-dir`` (default: a temporary folder) and reused by every run, and by later
invocations given the same folder.

Both contenders are whole jobs run as fresh processes, ``python -m tightpack.cli pack CORPUS
--pack-size P --workers W --no-reuse --overwrite``, on the same inputs, with the same ``--workers``
(default: this machine's CPU count) and the same cache state (``--no-reuse``: every run tokenizes;
a private ``TIGHTPACK_CACHE``):

- local: ``--engine local``, a pool of W worker processes;
- ray: ``--engine ray`` without ``--ray-address``: the run starts a local Ray cluster of W CPUs,
  tokenizes on W actors, and shuts the cluster down; its start-up is part of its wall time.

Rounds are interleaved (the engine that goes first alternates), so that a drift of the machine hits
both sides; reports the best of ``--repeats`` wall times (the median beside) and the ratio
ray / local (goal: at most 1.5x on one machine). To separate Ray's fixed start-up cost from its
throughput, the same pair runs on a tiny corpus (the first 100 rows): the difference of their wall
times is the start-up cost. Throughput is reported as tokens per second per worker, with tokens from
each output's ``manifest.json`` (``counts["tokens_in"]``).

Driver memory: the resident set of the ``tightpack pack`` process alone (not its worker processes,
nor Ray's raylet, GCS and actors), sampled with psutil every ``--interval`` seconds, and its
``VmHWM`` (the kernel's high-water mark, exact between samples) where ``/proc`` has it; the peak is
the larger, set against the goal bound 0.5 GB + 16 bytes x samples (``counts["samples_in"]``).
Without psutil the timings are still taken and the memory rows say so.

Once per invocation (after the first round) the two outputs' ``packs-*.parquet`` and
``metadata.json`` are compared byte for byte (``manifest.json`` differs by design: it names the
engine). Benchmarks report, they never assert.

    .venv/bin/python benchmarks/bench_engines.py          # quick: ~2M tokens, 1 round
    .venv/bin/python benchmarks/bench_engines.py --full   # the documented 50M tokens, best of 3
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results import add_size_options, choose_size, table, write_result

try:
    import psutil
except ImportError:  # the `bench` extra; timings run without it
    psutil = None

MIB = 2**20
GB = 10**9
ENGINES = ("local", "ray")
TINY_ROWS = 100


def demo_rows_with_tokens() -> tuple[list[dict], list[int]]:
    """The demo corpus's rows and the GPT-2 tokens of each as rendered (an estimate of ``tokens_in``)."""
    from tightpack.prepare.formats import FormatConfig, render_row
    from tightpack.prepare.sources import default_corpus
    from tightpack.prepare.tokenizer import load_tokenizer

    rows = [row for chunk in default_corpus().read(0, 1024) for row in chunk.parsed_rows()]
    backend = load_tokenizer(None).backend
    texts = [render_row(row, FormatConfig(), None, {}).text for row in rows]
    counts = [len(encoding.ids) for encoding in backend.encode_batch(texts)]
    return rows, counts


def copy_of(row: dict, copy: int) -> dict:
    """``row`` with ``[copy N]`` before its first user message (a new dict: the source row is kept)."""
    messages = [dict(message) for message in row["messages"]]
    for message in messages:
        if message.get("role") == "user":
            message["content"] = f"[copy {copy}] {message['content']}"
            break
    return {**row, "messages": messages}


def write_corpus(folder: Path, tokens: int) -> tuple[Path, Path]:
    """(corpus, tiny corpus) under ``folder``: written once (temp file, then rename), reused after."""
    corpus, tiny = folder / f"corpus-{tokens}.jsonl", folder / f"tiny-{TINY_ROWS}.jsonl"
    if corpus.exists() and tiny.exists():
        print(f"corpus: reusing {corpus}")
        return corpus, tiny
    start = time.perf_counter()
    rows, counts = demo_rows_with_tokens()
    written = lines = copy = 0
    partial = corpus.with_suffix(".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        while written < tokens:
            for row, count in zip(rows, counts, strict=True):
                handle.write(json.dumps(copy_of(row, copy)) + "\n")
                written, lines = written + count, lines + 1
                if written >= tokens:
                    break
            copy += 1
    partial.rename(corpus)
    partial = tiny.with_suffix(".partial")
    partial.write_text(
        "".join(json.dumps(copy_of(row, 0)) + "\n" for row in rows[:TINY_ROWS]), encoding="utf-8"
    )
    partial.rename(tiny)
    seconds = time.perf_counter() - start
    size = corpus.stat().st_size / MIB
    print(
        f"corpus: wrote {lines:,} rows ({copy} copies, the last cut, ~{written:,} tokens, "
        f"{size:,.0f} MiB), {seconds:.1f} s"
    )
    return corpus, tiny


@dataclass
class Run:
    """One ``tightpack pack`` run: wall time, driver memory (bytes; None without psutil), manifest counts."""

    seconds: float
    peak_rss: int | None
    high_water: int | None
    peak_anon: int | None
    memory_samples: int
    samples_in: int
    tokens_in: int

    @property
    def driver_peak(self) -> int | None:
        if self.peak_rss is None:
            return None
        return max(self.peak_rss, self.high_water or 0)


def proc_status(pid: int) -> dict[str, int]:
    """``VmHWM`` (peak resident set so far) and ``RssAnon`` of a process in bytes; empty where unreadable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmHWM:", "RssAnon:")))
    except OSError:
        return {}
    return {key: int(value.split()[0]) * 1024 for key, value in fields.items()}


def run_pack(command: list[str], env: dict[str, str], output: Path, interval: float) -> Run:
    """Run ``command`` (a ``tightpack pack`` writing ``output``), sampling the driver's memory."""
    peak_rss = high_water = peak_anon = None
    samples = 0
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        if psutil is None:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=errors)
            returncode = process.wait()
        else:
            process = psutil.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=errors)
            peak_rss = 0
            while True:
                try:  # the driver alone: its children (local workers, Ray's processes) are not counted
                    peak_rss = max(peak_rss, process.memory_info().rss)
                    status = proc_status(process.pid)
                    high_water = status.get("VmHWM", high_water)
                    if "RssAnon" in status:
                        peak_anon = max(peak_anon or 0, status["RssAnon"])
                    samples += 1
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    pass  # exited between two samples
                try:  # returns as soon as the driver exits: the wall time is exact, not rounded to a sample
                    returncode = process.wait(timeout=interval)
                    break
                except psutil.TimeoutExpired:
                    continue
        seconds = time.perf_counter() - start
        if returncode != 0:
            errors.seek(0)
            sys.stderr.write(errors.read().decode("utf-8", "replace")[-4000:])
            raise subprocess.CalledProcessError(returncode, command)
    counts = json.loads((output / "manifest.json").read_text(encoding="utf-8"))["counts"]
    return Run(seconds, peak_rss, high_water, peak_anon, samples, counts["samples_in"], counts["tokens_in"])


def identical_outputs(first: Path, second: Path) -> tuple[bool, list[str]]:
    """Whether the packs and metadata of two outputs are byte-identical; the names compared."""
    names = sorted({path.name for folder in (first, second) for path in folder.glob("packs-*.parquet")})
    names.append("metadata.json")
    same = all(
        (first / name).is_file()
        and (second / name).is_file()
        and filecmp.cmp(first / name, second / name, shallow=False)
        for name in names
    )
    return same, names


def rounds(
    corpus: Path, scratch: Path, env: dict[str, str], args: argparse.Namespace, label: str
) -> tuple[dict[str, list[Run]], tuple[bool, list[str]]]:
    """``--repeats`` interleaved rounds of both engines on ``corpus``; their runs and the identity check."""
    runs: dict[str, list[Run]] = {engine: [] for engine in ENGINES}
    identity = (False, [])
    for index in range(args.repeats):
        order = ENGINES if index % 2 == 0 else ENGINES[::-1]  # alternate who goes first
        for engine in order:
            output = scratch / f"out-{label}-{engine}"
            command = [sys.executable, "-m", "tightpack.cli", "pack", str(corpus), "-o", str(output)]
            command += ["--pack-size", str(args.pack_size), "--no-reuse", "--workers", str(args.workers)]
            command += ["--overwrite", "--engine", engine]
            run = run_pack(command, env, output, args.interval)
            runs[engine].append(run)
            print(f"  {label} round {index + 1} {engine:>5}: {run.seconds:7.2f} s", flush=True)
        if index == 0:
            identity = identical_outputs(scratch / f"out-{label}-local", scratch / f"out-{label}-ray")
    return runs, identity


def summary(runs: list[Run], workers: int) -> dict:
    times = [run.seconds for run in runs]
    best = min(times)
    peaks = [run.driver_peak for run in runs if run.driver_peak is not None]
    anon = [run.peak_anon for run in runs if run.peak_anon is not None]
    return {
        "best_s": best,
        "median_s": statistics.median(times),
        "times_s": times,
        "tokens_in": runs[0].tokens_in,
        "samples_in": runs[0].samples_in,
        "tokens_per_s_per_worker": runs[0].tokens_in / best / workers,
        "driver_peak_rss_bytes": max(peaks) if peaks else None,
        "driver_peak_anon_bytes": max(anon) if anon else None,
        "memory_samples": [run.memory_samples for run in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="corpus size (quick 2M, full 50M)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=None, help="rounds (quick 1, full 3)")
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between driver memory samples")
    parser.add_argument("--work-dir", type=Path, default=None, help="corpus cache (default: a temp folder)")
    add_size_options(parser, "engines")
    args = parser.parse_args()
    size = choose_size(
        args, quick={"tokens": 2_000_000, "repeats": 1}, full={"tokens": 50_000_000, "repeats": 3}
    )
    started = time.perf_counter()
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    if psutil is None:
        print("psutil is missing (pip install 'tightpack[bench]' or psutil): driver memory NOT measured")
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        corpus, tiny = write_corpus(work, args.tokens)
        scratch = Path(tempfile.mkdtemp(dir=temporary))  # outputs and the private cache: never reused
        env = {**os.environ, "TIGHTPACK_CACHE": str(scratch / "cache")}
        print(f"--workers {args.workers}, --pack-size {args.pack_size}, best of {args.repeats}, interleaved")
        tiny_runs, tiny_identity = rounds(tiny, scratch, env, args, "tiny")
        big_runs, identity = rounds(corpus, scratch, env, args, "full")
    load = os.getloadavg()
    tiny_result = {engine: summary(tiny_runs[engine], args.workers) for engine in ENGINES}
    result = {engine: summary(big_runs[engine], args.workers) for engine in ENGINES}
    local, ray = result["local"], result["ray"]
    ratio = ray["best_s"] / local["best_s"]
    startup = tiny_result["ray"]["best_s"] - tiny_result["local"]["best_s"]
    ratio_after_startup = (ray["best_s"] - startup) / local["best_s"]
    samples = local["samples_in"]
    bound = 0.5 * GB + 16 * samples
    print()
    print(f"corpus: {samples:,} samples, {local['tokens_in']:,} tokens (manifest tokens_in)")
    columns = ("best (s)", "median (s)", "tokens/s/worker", "driver peak RSS", "peak anon RSS")
    print(f"{'engine':>6}  {columns[0]:>8}  {columns[1]:>10}  " + "  ".join(f"{c:>15}" for c in columns[2:]))
    for engine in ENGINES:
        row = result[engine]
        shown = [
            f"{memory / MIB:,.0f} MiB" if memory is not None else "n/a"
            for memory in (row["driver_peak_rss_bytes"], row["driver_peak_anon_bytes"])
        ]
        print(
            f"{engine:>6}  {row['best_s']:>8.2f}  {row['median_s']:>10.2f}  "
            f"{row['tokens_per_s_per_worker']:>15,.0f}  {shown[0]:>15}  {shown[1]:>15}"
        )
    print("(driver peak RSS: the larger of sampled RSS and VmHWM; anonymous: peak sampled RssAnon,")
    print(" without the file-backed pages of the memory-mapped token store)")
    print(f"ratio ray / local: {ratio:.2f}x (best); {ray['median_s'] / local['median_s']:.2f}x (median)")
    print(
        f"start-up ({TINY_ROWS} rows): local {tiny_result['local']['best_s']:.2f} s, "
        f"ray {tiny_result['ray']['best_s']:.2f} s: Ray's fixed cost ~{startup:.2f} s; "
        f"ray / local without it: {ratio_after_startup:.2f}x"
    )
    same, names = identity
    print(f"outputs byte-identical ({', '.join(names)}): {'yes' if same else 'NO'}")
    print(f"tiny outputs byte-identical: {'yes' if tiny_identity[0] else 'NO'}")
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print()
    verdict = "PASS" if ratio <= 1.5 else "FAIL"
    print(f"[{verdict}] ray <= 1.5x local wall time ({ratio:.2f}x)")
    memory = ray["driver_peak_rss_bytes"]
    if memory is None:
        print("[n/a] driver peak RSS: psutil missing, not measured")
    else:
        for engine in ENGINES:
            memory = result[engine]["driver_peak_rss_bytes"]
            verdict = "PASS" if memory <= bound else "FAIL"
            print(
                f"[{verdict}] {engine} driver peak RSS <= 0.5 GB + 16 B x {samples:,} samples = "
                f"{bound / GB:.3f} GB ({memory / GB:.3f} GB)"
            )
    print(f"[{'PASS' if same else 'FAIL'}] packs and metadata byte-identical across engines")
    payload = {
        "workers": args.workers,
        "pack_size": args.pack_size,
        "repeats": args.repeats,
        "tokens_target": args.tokens,
        "full": result,
        "tiny": tiny_result,
        "ratio_ray_over_local": ratio,
        "ray_startup_s": startup,
        "ratio_after_startup": ratio_after_startup,
        "driver_bound_bytes": bound,
        "byte_identical": same,
        "tiny_byte_identical": tiny_identity[0],
        "load_average_end": load,
    }
    rows = [
        [engine, result[engine]["best_s"], result[engine]["median_s"],
         result[engine]["tokens_per_s_per_worker"],
         None if result[engine]["driver_peak_rss_bytes"] is None
         else result[engine]["driver_peak_rss_bytes"] / GB]
        for engine in ENGINES
    ]  # fmt: skip
    figures = {
        "corpus tokens (manifest tokens_in)": local["tokens_in"],
        "corpus samples": samples,
        "ray / local wall time": ratio,
        "ray / local without Ray's start-up": ratio_after_startup,
        f"Ray's fixed cost ({TINY_ROWS}-row runs, s)": startup,
        "driver bound 0.5 GB + 16 B x samples (GB)": bound / GB,
        "packs and metadata byte-identical": same,
    }
    header = ["engine", "best (s)", "median (s)", "tokens/s per worker", "driver peak RSS (GB)"]
    title = f"{local['tokens_in']:,} tokens, --workers {args.workers}, best of {args.repeats}"
    write_result("engines", args, size, figures=figures, tables={"engines": table(header, rows, title)},
                 report=payload, seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
