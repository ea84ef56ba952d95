"""Memory: peak resident set of `tightpack pack` on a synthetic corpus of 100M tokens.

The corpus is pre-tokenized (``--format tokens``): random GPT-2 ids, lengths drawn from the demo
corpus's distribution (`demo_lengths.py`) and capped at the pack size, written as Parquet in
row groups. ``tightpack pack`` runs as a child process; its peak RSS (and that of the largest of its
worker processes) comes from ``getrusage(RUSAGE_CHILDREN)``. For scale, the same run is timed and the
size of the token store (int32 tokens + int8 mask) is reported: a packer that holds samples as
Python lists would need about 30 bytes per token (3 GB here).

    .venv/bin/python benchmarks/bench_memory.py [--tokens 100000000] [--pack-size 8192] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from demo_lengths import demo_runtime_lengths


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    tightpack = str(Path(sys.executable).with_name("tightpack"))
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        scratch = Path(scratch)
        corpus = scratch / "corpus.parquet"
        samples, tokens = write_corpus(corpus, args.tokens, args.pack_size, args.seed)
        size_mib = corpus.stat().st_size / 2**20
        print(f"synthetic corpus: {samples:,} samples, {tokens:,} tokens, {size_mib:,.0f} MiB")
        command = [tightpack, "pack", str(corpus), "--format", "tokens", "--pack-size", str(args.pack_size)]
        command += ["-o", str(scratch / "out"), "--workers", str(args.workers), "--no-reuse"]
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        out_mib = sum(p.stat().st_size for p in (scratch / "out").iterdir()) / 2**20
    store_mib = tokens * 5 / 2**20
    result = {"samples": samples, "tokens": tokens, "seconds": seconds, "peak_rss_mib": peak_mib}
    print(f"tightpack pack: {seconds:.1f} s, peak RSS {peak_mib:,.0f} MiB (largest process)")
    print(f"token store on disk {store_mib:,.0f} MiB, packed output {out_mib:,.0f} MiB")
    verdict = "PASS" if peak_mib < 1.5 * 1024 else "FAIL"
    print(f"[{verdict}] peak RSS < 1.5 GB ({peak_mib / 1024:.2f} GiB)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
