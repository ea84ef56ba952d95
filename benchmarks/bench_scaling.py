"""Two serial steps of the Ray engine's driver that docs/scaling.md projects to 1B samples.

- **The plan**: `tightpack.core.planner.plan_packs` (``bfd``) on ``--lengths`` demo-distribution
  lengths (`demo_lengths.py`, resampled, capped at the pack size): wall seconds (best of
  ``--repeats``) and the peak of numpy's allocations during the call (``tracemalloc``), beside the
  int64 lengths array itself.
- **Hashing the inputs**: `tightpack.prepare.file_sources` hashes every input file once with
  ``sha256_and_count(path, every=RANGE_BYTES)`` (sha256 plus the newline index the byte ranges
  need), on one core. Timed on a JSONL file of ``--hash-mib`` MiB of the demo corpus's rows, written
  first (the page cache then holds it: this is the hashing's speed, not the disk's), best of
  ``--repeats``.

Quick: 10M lengths, 64 MiB; ``--full``: the documented 100M lengths and 207 MiB (the size of
`bench_engines.py`'s 50M-token corpus). Benchmarks report, they never assert.

    .venv/bin/python benchmarks/bench_scaling.py [--full]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, write_result
from tightpack.core.checksums import sha256_and_count
from tightpack.core.planner import plan_packs
from tightpack.prepare import file_ranges
from tightpack.prepare.sources import default_corpus

MIB = 2**20


def time_plan(count: int, pack_size: int, repeats: int, seed: int) -> dict:
    """Seconds (best of ``repeats``) and allocation peak of ``plan_packs`` on ``count`` lengths."""
    lengths = np.minimum(np.random.default_rng(seed).choice(demo_runtime_lengths(), size=count), pack_size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_packs(lengths, pack_size, algorithm="bfd")
        times.append(time.perf_counter() - start)
        del plan
    gc.collect()
    tracemalloc.start()
    plan = plan_packs(lengths, pack_size, algorithm="bfd")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "lengths": count,
        "packs": len(plan),
        "seconds": min(times),
        "rounds_s": times,
        "peak_bytes": peak,
        "lengths_bytes": lengths.nbytes,
    }


def time_hashing(size: int, repeats: int) -> dict:
    """Seconds (best of ``repeats``) of ``sha256_and_count(every=RANGE_BYTES)`` on ``size`` bytes of JSONL."""
    rows = [json.dumps(row) + "\n" for chunk in default_corpus().read(0, 1024) for row in chunk.parsed_rows()]
    with tempfile.TemporaryDirectory(dir=".") as folder:
        path = Path(folder) / "rows.jsonl"
        written = 0
        with open(path, "w", encoding="utf-8") as handle:
            while written < size:
                for row in rows:
                    handle.write(row)
                    written += len(row.encode("utf-8"))
                    if written >= size:
                        break
        actual = path.stat().st_size
        sha256_and_count(path, every=file_ranges.RANGE_BYTES)  # warm the page cache
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sha256_and_count(path, every=file_ranges.RANGE_BYTES)
            times.append(time.perf_counter() - start)
    return {"bytes": actual, "seconds": min(times), "rounds_s": times, "bytes_per_s": actual / min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=None, help="lengths planned (quick 10M, full 100M)")
    parser.add_argument("--hash-mib", type=int, default=None, help="MiB of JSONL hashed (quick 64, full 207)")
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, the best counts")
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "scaling")
    args = parser.parse_args()
    size = choose_size(
        args, quick={"lengths": 10_000_000, "hash_mib": 64}, full={"lengths": 100_000_000, "hash_mib": 207}
    )
    started = time.perf_counter()
    plan = time_plan(args.lengths, args.pack_size, args.repeats, args.seed)
    print(
        f"plan_packs bfd, {plan['lengths']:,} lengths -> {plan['packs']:,} packs: {plan['seconds']:.2f} s "
        f"(best of {args.repeats}); allocation peak {plan['peak_bytes'] / 1e9:.2f} GB beside the lengths' "
        f"{plan['lengths_bytes'] / 1e9:.2f} GB"
    )
    hashing = time_hashing(args.hash_mib * MIB, args.repeats)
    print(
        f"sha256_and_count(every={file_ranges.RANGE_BYTES:,}) on {hashing['bytes'] / MIB:,.0f} MiB: "
        f"{hashing['seconds']:.2f} s, {hashing['bytes_per_s'] / 1e9:.2f} GB/s on one core"
    )
    figures = {
        f"plan (bfd) of {args.lengths:,} lengths (s)": plan["seconds"],
        "plan: allocation peak during the call (GB)": plan["peak_bytes"] / 1e9,
        "plan: the int64 lengths themselves (GB)": plan["lengths_bytes"] / 1e9,
        f"hashing the inputs, sha256 + newline index, {hashing['bytes'] / MIB:,.0f} MiB (GB/s)": hashing[
            "bytes_per_s"
        ]
        / 1e9,
    }
    write_result(
        "scaling", args, size, figures=figures, report={"plan": plan, "hashing": hashing},
        seconds=time.perf_counter() - started,
    )  # fmt: skip


if __name__ == "__main__":
    main()
