"""Truncation against Megatron-Bridge's own ``GPTSFTDataset`` (0.6.2), row by row.

Both sides get the same tokens: the dataset's own template pieces (``_separate_template``, each
piece tokenized alone, as its ``_process_example`` does), then its EOS. The dataset truncates them
(``__getitem__``); `tightpack.core.truncation.keep_ranges` cuts the same pieces, marked as segments
(truncation fields ``PROMPT``, the label ``ANSWER``, the rest ``KEEP``). Each truncated row x setting
is classed by how the kept tokens compare (same; tightpack keeps more answer tokens; the EOS rule;
...), and rows that keep no supervised token are counted. Prints observed counts.

The reference does not install into this project's environment (Python 3.11: megatron-bridge 0.6.2
and the megatron-core 0.19 it needs declare Python >= 3.12; importing megatron-core 0.19 imports
triton). To run it anyway, on CPU, into a folder of its own:

    .venv/bin/pip install --no-deps --ignore-requires-python --target .mbref \\
        megatron-bridge==0.6.2 megatron-core==0.19.2 triton
    .venv/bin/python benchmarks/bench_megatron_bridge_truncation.py --reference .mbref

The script then imports the dataset module alone (``megatron.bridge``'s package ``__init__`` imports
every model bridge, which needs another transformers), and gives Python 3.11 the one 3.12 name the
import needs (``typing.override``). One size (22 rows); ``--full`` runs the same.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import logging
import sys
import tempfile
import time
import types
import typing
from pathlib import Path

import numpy as np

from results import add_size_options, choose_size, table, write_result
from tightpack.core.truncation import ANSWER, KEEP, PROMPT, keep_ranges
from tightpack.prepare.tokenizer import load_tokenizer

WORDS = "alpha beta gamma delta pack token answer field context résumé 日本語 ответ".split()
TEMPLATE = "{context} | {input} {output}"


def load_reference(folder: Path):
    """``megatron.bridge.data.datasets.gpt_sft`` from ``folder``, without the package ``__init__``s."""
    sys.path[:0] = [str(folder)]
    if not hasattr(typing, "override"):
        typing.override = lambda function: function  # Python 3.12's decorator, a no-op at run time
    root = folder / "megatron" / "bridge"
    for name, path in [
        ("megatron.bridge", root),
        ("megatron.bridge.data", root / "data"),
        ("megatron.bridge.data.datasets", root / "data" / "datasets"),
        ("megatron.bridge.training", root / "training"),
        ("megatron.bridge.utils", root / "utils"),
    ]:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    return importlib.import_module("megatron.bridge.data.datasets.gpt_sft")


def make_rows(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS, size=words))

    rows = []
    for _ in range(count):
        context, prompt = (int(v) for v in rng.choice([1, 2, 4, 10, 30, 60], size=2))
        rows.append(
            {
                "context": text(context),
                "input": text(prompt),
                "output": text(int(rng.choice([1, 3, 8, 15, 40]))),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reference", type=Path, required=True, help="folder the reference was installed into"
    )
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "megatron_bridge_truncation")
    args = parser.parse_args()
    size = choose_size(args, quick={}, full={})
    started = time.perf_counter()
    gpt_sft = load_reference(args.reference.resolve())
    logging.disable(logging.WARNING)
    spec = load_tokenizer(None)

    class Tokenizer:  # tightpack's default tokenizer, in the shape the dataset's `_tokenize` calls
        legacy = False
        space_sensitive = True
        eos_id = spec.eos_id

        def tokenize(self, text: str) -> list[int]:
            return spec.backend.encode(text).ids

    rows = make_rows(args.rows, args.seed)
    folder = Path(tempfile.mkdtemp())
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tally: collections.Counter = collections.Counter()
    for fields in ("input", "context,input", "input,output"):
        for method in ("right", "left"):
            for cap in (32, 64):
                dataset = gpt_sft.GPTSFTDataset(
                    str(path),
                    Tokenizer(),
                    max_seq_length=cap,
                    prompt_template=TEMPLATE,
                    label_key="output",
                    truncation_field=fields,
                    truncation_method=method,
                    index_mapping_dir=str(folder),
                    memmap_workers=1,
                )
                for index, row in enumerate(rows):
                    values = [row[key].strip(" ") for key in dataset.prompt_template_keys]
                    strings, keys = dataset._separate_template(values)
                    pieces = [Tokenizer().tokenize(string) for string in strings]
                    kinds = [
                        (PROMPT if key in dataset.truncation_fields else KEEP)
                        | (ANSWER if key == "output" else 0)
                        for key in keys
                    ] + [KEEP]
                    sizes = [len(piece) for piece in pieces] + [1]
                    tokens = [token for piece in pieces for token in piece] + [spec.eos_id]
                    if len(tokens) <= cap:
                        continue
                    tally["truncated (row x setting)"] += 1
                    reference = dataset[index]["input_ids"]
                    reference_answer = len(dataset[index]["answer_ids"])
                    starts = np.cumsum([0, *sizes[:-1]]).tolist()
                    ranges, _ = keep_ranges(len(tokens), starts, kinds, [-1] * len(kinds), cap, method)
                    ours = [token for a, b in ranges for token in tokens[a:b]]
                    low, high = starts[-2], starts[-2] + sizes[-2]
                    answer = sum(max(0, min(b, high) - max(a, low)) for a, b in ranges)
                    ends_with_eos = ours[-1] == spec.eos_id
                    if answer == 0 and not ends_with_eos:
                        tally["tightpack: no supervised token left (the row is excluded)"] += 1
                    if ours == reference:
                        tally["same tokens"] += 1
                    elif answer == reference_answer + 1 and not ends_with_eos:
                        tally["answer cut on both sides: one answer token more, no EOS (the EOS rule)"] += 1
                    elif answer > reference_answer:
                        tally["tightpack keeps more answer tokens"] += 1
                    elif answer < reference_answer:
                        tally["tightpack keeps fewer answer tokens"] += 1
                    elif answer == 0:
                        tally["answer gone on both sides; the reference keeps its EOS"] += 1
                    else:
                        tally[f"same answer, other prompt tokens ({method}, fields {fields})"] += 1
    ordered = sorted(tally.items(), key=lambda item: -item[1])
    for name, count in ordered:
        print(f"{count:5d}  {name}")
    title = f"{args.rows} rows x 3 truncation-field settings x 2 methods x 2 caps, Megatron-Bridge 0.6.2"
    write_result("megatron_bridge_truncation", args, size,
                 figures={"truncated (row x setting)": tally["truncated (row x setting)"]},
                 tables={"cases": table(["row-settings", "case"], [[c, n] for n, c in ordered], title)},
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
