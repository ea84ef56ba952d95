"""What collate-time packing keeps of long chat rows, against ``tightpack pack`` at the same cap.

``--rows`` long multilingual chat rows (tests/long_chat_rows.py: real conversations joined into long
user turns, short answers) go one by one through ``PackingCollator(max_length=M)`` (the built-in
GPT-2 tokenizer, loss on the assistant turns), and through ``tightpack pack --max-seq-length M-1``
(the same tokens: offline packs hold no final EOS as input). Printed, for each path: the samples
that lost supervised tokens, the samples left with none (fed with no target, or left out), and the
share of all supervised tokens lost. A row the collator refuses (a batch with no supervised token
left raises) counts as keeping none.

Quick: 200 rows; ``--full``: the documented 1,000.

    .venv/bin/python benchmarks/bench_collate_truncation.py [--full] [--max-length 4096] [--max-rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.long_chat_rows import long_chat_rows

from results import add_size_options, choose_size, write_result
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.tokenize import Encoder
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.hf_trainer import PackingCollator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="long chat rows (quick 200, full 1,000)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--max-rounds", type=int, default=3, help="rounds per row: 1 to this")
    add_size_options(parser, "collate_truncation")
    options = parser.parse_args()
    size = choose_size(options, quick={"rows": 200}, full={"rows": 1000})
    started = time.perf_counter()
    rows = long_chat_rows(options.rows, max_rounds=options.max_rounds)
    spec = load_tokenizer(None)
    encoded = Encoder(spec, FormatConfig()).encode_rows(rows)
    bounds = np.concatenate(([0], np.cumsum(encoded.lengths)))
    whole = np.array([int(encoded.loss_mask[a + 1 : b].sum()) for a, b in itertools.pairwise(bounds)])
    over = int((encoded.lengths > options.max_length).sum())
    print(f"{len(rows)} rows, {over} over max_length={options.max_length}, {int(whole.sum())} supervised")

    collator = PackingCollator(None, max_length=options.max_length)
    kept = np.zeros(len(rows), dtype=np.int64)
    for index, row in enumerate(rows):
        try:
            batch = collator([row])
        except TightpackError:
            continue
        kept[index] = int((batch["shift_labels"] != -100).sum())
    collated = report("PackingCollator", whole, kept)
    totals = getattr(collator, "long_sample_counts", None)  # None: a tightpack that counts nothing
    if totals is None:
        print("  its counts: none (this version of the collator counts nothing)")
    else:
        print("  its counts:", {name: value for name, value in totals.as_dict().items() if value})

    with tempfile.TemporaryDirectory() as folder:
        config = PackConfig(packed_sequence_size=options.max_length, max_seq_length=options.max_length - 1)
        counts = pack_dataset(rows, Path(folder) / "packs", config, tokenizer=spec).counts
    print(
        f"tightpack pack --max-seq-length {options.max_length - 1}: "
        f"{counts['no_supervised_after_truncation']} keep none after the cut, "
        f"{100 * counts['supervised_lost'] / counts['supervised_in']:.1f}% of supervised tokens lost "
        f"({counts['truncated']} truncated)"
    )
    figures = {
        "rows": len(rows),
        f"rows over max_length {options.max_length}": over,
        "PackingCollator: samples that lose supervised tokens": collated["lose"],
        "PackingCollator: samples left with none": collated["none"],
        "PackingCollator: supervised tokens lost (%)": collated["lost_percent"],
        f"tightpack pack --max-seq-length {options.max_length - 1}: samples left with none": counts[
            "no_supervised_after_truncation"
        ],
        f"tightpack pack --max-seq-length {options.max_length - 1}: supervised tokens lost (%)": 100
        * counts["supervised_lost"]
        / counts["supervised_in"],
        f"tightpack pack --max-seq-length {options.max_length - 1}: samples truncated": counts["truncated"],
    }
    write_result("collate_truncation", options, size, figures=figures, seconds=time.perf_counter() - started)


def report(name: str, whole: np.ndarray, kept: np.ndarray) -> dict:
    """Print what a path kept of the supervised tokens; returns the three figures."""
    lost = whole > kept
    none = (whole > 0) & (kept == 0)
    share = 100 * (whole.sum() - kept.sum()) / whole.sum()
    print(
        f"{name}: {int(lost.sum())} samples lose supervision, {int(none.sum())} keep none, "
        f"{share:.1f}% of supervised tokens lost"
    )
    return {"lose": int(lost.sum()), "none": int(none.sum()), "lost_percent": float(share)}


if __name__ == "__main__":
    main()
