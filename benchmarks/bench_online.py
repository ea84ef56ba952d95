"""Online packing fill: ``best_fill`` against the reference's ``ffd`` semantics, same stream, same run.

A stream of ``--samples`` demo-corpus lengths (GPT-2 tokens, capped at the pack size), one pack per
step. Fill = real tokens / (packs x pack size). Two bounds:

- ``held bound``: the mean over steps of min(tokens held, pack size) / pack size at selection time
  (buffer plus pending groups): no strategy fills a pack with more than it holds. It depends on what
  the strategy leaves in the buffer.
- ``fresh bound``: the same for a buffer of fresh samples from the stream (10,000 draws), the figure
  that does not depend on the strategy.

Also reports waits (steps; best_fill runs with its default max_wait = 4 x buffer), the packs holding a
sample forced in by its deadline, and the selection cost per pack (choosing the members, not building
the tensors).

Quick: 20,000 samples; ``--full``: the documented 100,000.

    .venv/bin/python benchmarks/bench_online.py [--full]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from demo_lengths import demo_runtime_lengths
from results import add_size_options, choose_size, table, write_result
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker


class Measured(OnlinePacker):
    """Records the buffer bound at every step and the time spent choosing groups."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bounds, self.selection_s = [], 0.0

    def _next_group(self, stream_open):
        start = time.perf_counter()
        if self.buffer or self.pending:
            held = sum(c.length for c in self.buffer) + sum(c.length for g in self.pending for c in g)
            group = super()._next_group(stream_open)
            if group is not None:
                self.bounds.append(min(held, self.config.pack_size) / self.config.pack_size)
        else:
            group = super()._next_group(stream_open)
        self.selection_s += time.perf_counter() - start
        return group

    def _pack(self, group):  # count only: building the THD tensors is not the subject here
        self._record(group, tokens=sum(c.length for c in group))


def run(lengths, pack_size, buffer_size, strategy):
    samples = [{"key": i, "input_ids": torch.empty(int(n))} for i, n in enumerate(lengths)]
    config = OnlinePackConfig(pack_size=pack_size, packing_buffer_size=buffer_size, strategy=strategy)
    packer = Measured(lambda start, stride: iter(samples[start::stride]), config)
    for _ in packer:
        pass
    return packer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=None, help="stream length (quick 20,000, full 100,000)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "online")
    args = parser.parse_args()
    size = choose_size(args, quick={"samples": 20_000}, full={"samples": 100_000})
    started = time.perf_counter()
    rows = []
    demo = demo_runtime_lengths()
    print(f"stream: {args.samples:,} demo-distribution samples; best_fill max_wait = 4 x buffer")
    columns = (
        "pack",
        "buffer",
        "strategy",
        "fill",
        "held",
        "fresh",
        "mean wait",
        "max wait",
        "forced",
        "us/pack",
    )
    print(" ".join(f"{name:>9}" for name in columns))
    for pack_size in (8192, 4096):
        lengths = np.minimum(np.random.default_rng(args.seed).choice(demo, size=args.samples), pack_size)
        for buffer_size in (64, 16, 256):
            draws = np.random.default_rng(args.seed + 1).choice(lengths, size=(10_000, buffer_size))
            fresh = np.minimum(draws.sum(axis=1), pack_size).mean() / pack_size
            for strategy in ("ffd", "best_fill"):
                packer = run(lengths, pack_size, buffer_size, strategy)
                values = (
                    pack_size,
                    buffer_size,
                    strategy,
                    f"{packer.fill():.2%}",
                    f"{np.mean(packer.bounds):.2%}",
                    f"{fresh:.2%}",
                    f"{packer.mean_wait:.1f}",
                    packer.counts["max_wait"],
                    f"{packer.counts['forced_packs'] / packer.counts['packs']:.2%}"
                    if strategy == "best_fill"
                    else "-",
                    f"{packer.selection_s / packer.counts['packs'] * 1e6:.0f}",
                )
                print(" ".join(f"{value:>9}" for value in values))
                forced = packer.counts["forced_packs"] / packer.counts["packs"]
                rows.append([
                    pack_size, buffer_size, strategy, 100 * packer.fill(), 100 * np.mean(packer.bounds),
                    100 * fresh, packer.mean_wait, packer.counts["max_wait"],
                    100 * forced if strategy == "best_fill" else None,
                    packer.selection_s / packer.counts["packs"] * 1e6,
                ])  # fmt: skip
    figures = {f"fill (%), pack {row[0]}, buffer {row[1]}, {row[2]}": row[3] for row in rows if row[1] == 64}
    header = ["pack", "buffer", "strategy", "fill %", "held bound %", "fresh bound %", "mean wait",
              "max wait", "forced packs %", "us per pack"]  # fmt: skip
    title = f"{args.samples:,} demo-distribution samples; best_fill max_wait = 4 x buffer"
    write_result("online", args, size, figures=figures, tables={"fill": table(header, rows, title)},
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
