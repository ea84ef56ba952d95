"""Runtime: shuffled random access to packs, and the cost of collating against a forward pass.

1. A packed dataset of ``--packs`` packs of 4,096 tokens is written by ``tightpack pack`` (pre-tokenized
   random ids, demo-distribution lengths). Shuffled accesses are timed, as delivered tokens per second
   from one process, for:
   - the reference's pattern: find the pack's row group, decode the whole row group, take the row
     (``read_row_group`` + ``to_pylist``), no cache (a shuffled sampler misses it anyway);
   - `PackedDataset` (memory-mapped index); the one-off index build is timed separately.
2. `PackedCollate` per 1M tokens against its floor: decoding the same packs' tokens from the
   memory-mapped index (`tightpack.core.packed_index.PackedIndex`, what `PackedDataset` reads), a
   copy of each pack's token slice and nothing else. Both run over the same ``--collate-packs``
   shuffled packs, with a warm page cache, the fastest of ``--repeats`` passes (more for fast
   steps: `best_seconds`); per 1M stored tokens.
3. `PackedCollate` on one pack (fixed width) against a forward pass of a tiny Llama (the parity
   test's model, a 50k vocabulary, on the CPU) on the collated batch.

Quick: 2,000 packs, 100 accesses, 50 packs collated; ``--full``: the documented 20,000, 300 and 200.

    .venv/bin/python benchmarks/bench_runtime.py [--full]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, write_result
from tightpack.core.packed_index import PackedIndex
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.dataset import PackedDataset

PACK_SIZE = 4096


def write_packs(folder: Path, packs: int, seed: int) -> Path:
    """Pre-tokenized samples for about ``packs`` full packs, packed by the CLI."""
    rng = np.random.default_rng(seed)
    source = np.minimum(demo_runtime_lengths() + 1, PACK_SIZE)
    tokens_needed = packs * PACK_SIZE
    lengths = rng.choice(source, size=int(tokens_needed / source.mean() * 1.02) + 1)
    values = rng.integers(0, 50256, size=int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    corpus = folder / "corpus.parquet"
    pq.write_table(pa.table({"input_ids": column}), corpus, row_group_size=8192)
    out = folder / "packed"
    command = [str(Path(sys.executable).with_name("tightpack")), "pack", str(corpus), "--format", "tokens"]
    subprocess.run(
        [*command, "--pack-size", str(PACK_SIZE), "-o", str(out)], check=True, stdout=subprocess.DEVNULL
    )
    return out


class RowGroupReader:
    """The reference's access pattern: decode the row group holding the pack, on every access."""

    def __init__(self, files: list[Path]) -> None:
        self.files = [pq.ParquetFile(f) for f in files]
        self.starts = []  # (global first row of each row group) -> (file, group, first row)
        self.groups = []
        first = 0
        for f in self.files:
            for g in range(f.num_row_groups):
                self.starts.append(first)
                self.groups.append((f, g))
                first += f.metadata.row_group(g).num_rows
        self.rows = first

    def __getitem__(self, index: int) -> dict:
        group = bisect_right(self.starts, index) - 1
        parquet, number = self.groups[group]
        table = parquet.read_row_group(number, columns=["input_ids", "loss_mask", "seq_start_id"])
        return table.slice(index - self.starts[group], 1).to_pylist()[0]


def tokens_per_second(read, order) -> float:
    start = time.perf_counter()
    tokens = sum(len(read(int(i))["input_ids"]) for i in order)
    return tokens / (time.perf_counter() - start)


def best_seconds(run, repeats: int, budget: float = 0.5) -> float:
    """Fastest of at least ``repeats`` timed calls of ``run`` (after one warm-up call), repeated until
    ``budget`` seconds were timed: a 1 ms step gets hundreds of tries on a busy machine."""
    run()
    times: list[float] = []
    while len(times) < repeats or sum(times) < budget:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


COLLATE_SETTINGS = {
    "fixed width (pad_to_max_length)": {"pad_to_max_length": True},
    "longest row, to a multiple of 16": {},
}


def collate_against_floor(index: PackedIndex, rows: list[dict], packs: np.ndarray, repeats: int) -> dict:
    """Seconds to collate ``rows`` (one pack per batch) with each of `COLLATE_SETTINGS`, and under
    ``"floor"`` to decode the same packs' tokens from the index: one slice copy per pack, no batch."""
    offsets = index.row_offsets

    def decode() -> None:
        for pack in packs:
            np.array(index.input_ids[offsets[pack] : offsets[pack + 1]])

    seconds = {"floor": best_seconds(decode, repeats)}
    for name, options in COLLATE_SETTINGS.items():
        collate = PackedCollate(pack_size=PACK_SIZE, eos_id=50256, **options)
        seconds[name] = best_seconds(lambda collate=collate: [collate([row]) for row in rows], repeats)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=None, help="packs written (quick 2,000, full 20,000)")
    parser.add_argument(
        "--accesses", type=int, default=None, help="shuffled accesses timed for the reference"
    )
    parser.add_argument("--collate-packs", type=int, default=None, help="packs collated, one per batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "runtime")
    args = parser.parse_args()
    size = choose_size(
        args,
        quick={"packs": 2_000, "accesses": 100, "collate_packs": 50},
        full={"packs": 20_000, "accesses": 300, "collate_packs": 200},
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        scratch = Path(scratch)
        out = write_packs(scratch, args.packs, args.seed)
        files = sorted(out.glob("*.parquet"))
        reference = RowGroupReader(files)
        group_rows = pq.ParquetFile(files[0]).metadata.row_group(0).num_rows
        order = np.random.default_rng(args.seed).permutation(reference.rows)
        start = time.perf_counter()
        dataset = PackedDataset(out, cache_dir=scratch / "cache")
        dataset[0]  # builds the index
        build = time.perf_counter() - start
        reference_rate = tokens_per_second(reference.__getitem__, order[: args.accesses])
        ours_rate = tokens_per_second(dataset.__getitem__, order)
        print(f"packed dataset: {reference.rows:,} packs of {PACK_SIZE}, row groups of {group_rows} packs")
        print(f"reference (decode the row group per access): {reference_rate / 1e6:8.2f} M tokens/s")
        print(f"PackedDataset (memory-mapped index):         {ours_rate / 1e6:8.2f} M tokens/s")
        print(f"ratio {ours_rate / reference_rate:.1f}x; index built once in {build:.2f} s")

        packs = order[: args.collate_packs]
        rows = [dataset[int(i)] for i in packs]
        index = PackedIndex.ensure(dataset.files, scratch / "cache")  # the one built above
        seconds = collate_against_floor(index, rows, packs, args.repeats)
        million = sum(len(row["input_ids"]) for row in rows) / 1e6
        floor = seconds["floor"] / million
        print(f"\ncollate against decoding the same {len(rows)} packs' tokens, ms per 1M tokens:")
        print(f"  {'collate':<34} {'collate':>8} {'floor':>7} {'ratio':>6}")
        for name in COLLATE_SETTINGS:
            per_million = seconds[name] / million
            print(f"  {name:<34} {per_million * 1e3:8.1f} {floor * 1e3:7.2f} {per_million / floor:5.0f}x")

        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=PACK_SIZE,
            attn_implementation="sdpa",
        )  # fmt: skip
        model = LlamaForCausalLM(config).eval()
        collate_s = seconds["fixed width (pad_to_max_length)"] / len(rows)
        collate = PackedCollate(pack_size=PACK_SIZE, eos_id=50256, pad_to_max_length=True)
        batches = [collate([row]) for row in rows[:5]]
        with torch.no_grad():
            model(input_ids=batches[0]["tokens"], position_ids=batches[0]["position_ids"], use_cache=False)
            start = time.perf_counter()
            for batch in batches:
                model(input_ids=batch["tokens"], position_ids=batch["position_ids"], use_cache=False)
            forward_s = (time.perf_counter() - start) / len(batches)
        print(f"\ncollate one pack: {collate_s * 1e3:.2f} ms; tiny Llama forward: {forward_s * 1e3:.1f} ms")
        print(f"collate / forward = {collate_s / forward_s:.2%}")
    checks = [
        ("PackedDataset >= 20x the row-group reader", ours_rate >= 20 * reference_rate),
        ("collate <= 10% of a forward pass", collate_s <= 0.1 * forward_s),
    ]
    for name, ok in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    result = {
        "reference_tokens_per_s": reference_rate,
        "ours_tokens_per_s": ours_rate,
        "index_build_s": build,
        "collate_s": collate_s,
        "forward_s": forward_s,
        "collate_packs_s": seconds,  # the same packs: each collate setting, and the token decode floor
        "collate_packs_million_tokens": million,
    }
    million_ms = {name: 1e3 * value / million for name, value in seconds.items()}
    figures = {
        "PackedDataset shuffled access (M tokens/s)": ours_rate / 1e6,
        "row-group reader, the reference's pattern (M tokens/s)": reference_rate / 1e6,
        "PackedDataset / row-group reader": ours_rate / reference_rate,
        "index build, once (s)": build,
        "collate one pack, fixed width (ms)": collate_s * 1e3,
        "tiny Llama forward on it, CPU (ms)": forward_s * 1e3,
        "collate / forward": collate_s / forward_s,
    }
    figures |= {
        ("decoding the tokens, the floor" if name == "floor" else f"collate, {name}")
        + " (ms per 1M tokens)": ms
        for name, ms in million_ms.items()
    }
    write_result("runtime", args, size, figures=figures, report=result, seconds=time.perf_counter() - started)


if __name__ == "__main__":
    main()
