"""End to end: `tightpack pack` on the demo corpus against tokenizing the same texts alone.

Both sides are whole jobs run as fresh processes, with the same tokenizer (the built-in GPT-2) and the
same number of worker processes K:

- baseline: read the rendered texts (one JSON line each), tokenize them in chunks of 512 with
  ``encode_batch`` (in-process for K = 1, a pool of K processes otherwise), count the tokens;
- tightpack: ``tightpack pack --workers K`` on the embedded default corpus (read, render, tokenize,
  mask, plan, write Parquet, manifest).

The texts are rendered beforehand, outside the timings, with tightpack's own formatter, so the
baseline tokenizes exactly the texts tightpack tokenizes. Runs alternate between the two sides;
reports wall times (best of --repeats: 2, ``--full`` 5) and their ratio; asserts nothing.

    .venv/bin/python benchmarks/bench_pipeline.py [--workers 1 2] [--full]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import add_size_options, choose_size, table, write_result

BASELINE = r"""
import json, multiprocessing, os, sys
from tightpack.prepare.tokenizer import load_tokenizer

def init():
    global backend
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    backend = load_tokenizer(None).backend

def encode(texts):
    return sum(len(e.ids) for e in backend.encode_batch(texts))

if __name__ == "__main__":
    path, workers = sys.argv[1], int(sys.argv[2])
    with open(path, encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    chunks = [texts[i : i + 512] for i in range(0, len(texts), 512)]
    if workers == 1:
        backend = load_tokenizer(None).backend
        total = sum(sum(len(e.ids) for e in backend.encode_batch(chunk)) for chunk in chunks)
    else:
        with multiprocessing.get_context("forkserver").Pool(workers, initializer=init) as pool:
            total = sum(pool.imap(encode, chunks))
    print(total)
"""


def render_texts(path: Path) -> int:
    from tightpack.prepare.formats import FormatConfig, render_row
    from tightpack.prepare.sources import default_corpus

    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for chunk in default_corpus().read(0, 1024):
            for row in chunk.parsed_rows():
                handle.write(json.dumps({"text": render_row(row, FormatConfig(), None, {}).text}) + "\n")
                count += 1
    return count


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=None, help="rounds, the best counts (2; full 5)")
    add_size_options(parser, "pipeline")
    args = parser.parse_args()
    size = choose_size(args, quick={"repeats": 2}, full={"repeats": 5})
    started = time.perf_counter()
    tightpack = str(Path(sys.executable).with_name("tightpack"))
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        texts = scratch / "texts.jsonl"
        count = render_texts(texts)
        script = scratch / "baseline.py"
        script.write_text(BASELINE)
        print(f"demo corpus: {count:,} rendered conversations; best of {args.repeats}\n")
        print(f"{'workers':>7}  {'tokenize only (s)':>17}  {'tightpack pack (s)':>18}  {'ratio':>6}")
        for workers in args.workers:
            baseline_command = [sys.executable, str(script), str(texts), str(workers)]
            pack_command = [
                tightpack,
                "pack",
                "--demo",
                "--workers",
                str(workers),
                "-o",
                str(scratch / "out"),
                "--overwrite",
                "--no-reuse",  # tokenize every time: a reused token store would skip what is measured
            ]
            times = {"baseline": [], "pack": []}
            for _ in range(args.repeats):  # interleaved, so that a drift of the machine hits both sides
                times["baseline"].append(timed(baseline_command))
                times["pack"].append(timed(pack_command))
            baseline, pack = min(times["baseline"]), min(times["pack"])
            ratio = pack / baseline
            results.append({"workers": workers, "tokenize_only_s": baseline, "pack_s": pack, "ratio": ratio})
            print(f"{workers:>7}  {baseline:>17.2f}  {pack:>18.2f}  {ratio:>5.2f}x")
    print()
    for row in results:
        verdict = "PASS" if row["ratio"] <= 1.2 else "FAIL"
        print(f"[{verdict}] workers={row['workers']}: pack <= 1.2x tokenize-only ({row['ratio']:.2f}x)")
    figures = {f"tightpack pack / tokenize only, {row['workers']} workers": row["ratio"] for row in results}
    columns = ["workers", "tokenize only (s)", "tightpack pack (s)", "ratio"]
    rows = [[r["workers"], r["tokenize_only_s"], r["pack_s"], r["ratio"]] for r in results]
    tables = {
        "pipeline": table(columns, rows, f"demo corpus, {count:,} conversations, best of {args.repeats}")
    }
    write_result("pipeline", args, size, figures=figures, tables=tables, report=results,
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
