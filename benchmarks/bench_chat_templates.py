"""Supervised tokens per chat template and ``--loss-on`` (the table docs/chat-templates.md quotes).

The 50 multi-turn chitchat rows with a system message and the family-style templates of
``tests/chat_templates.py``, a Llama-style SentencePiece BPE of 1,500 pieces trained here on the same
corpus (special tokens added), packed with ``tightpack.pack_dataset`` at ``--pack-size`` 8192 and
1024 (oldest-turns). Per template and mode: supervised tokens, rows without a supervised token; and
for the templates with generation blocks the tokens transformers' ``return_assistant_tokens_mask``
supervises.

One size (50 rows); ``--full`` runs the same.

    .venv/bin/python benchmarks/bench_chat_templates.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chat_templates import TEMPLATES, conversations, template_folders
from tests.conftest import write_jsonl

from results import add_size_options, choose_size, table, write_result
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser, "chat_templates")
    args = parser.parse_args()
    size = choose_size(args, quick={}, full={})
    started = time.perf_counter()
    results = []
    rows = conversations(50)
    root = Path(tempfile.mkdtemp())
    source = write_jsonl(root / "rows.jsonl", rows)
    folders = template_folders(root)
    print("template            loss-on    pack  supervised  no-supervised  transformers")
    for name, folder in folders.items():
        reference = ""
        if re.search(r"\{%[-+]?\s*generation\s*[-+]?%\}", TEMPLATES[name]):
            tokenizer = AutoTokenizer.from_pretrained(folder)
            masks = [
                tokenizer.apply_chat_template(
                    row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )["assistant_masks"]
                for row in rows
            ]
            reference = str(sum(map(sum, masks)))
        for loss_on in ("assistant", "last-turn"):
            for pack_size in (8192, 1024):
                out = root / f"{name}-{loss_on}-{pack_size}"
                config = PackConfig(
                    packed_sequence_size=pack_size, workers=1, reuse_store=False, skip_bad_lines=True,
                    format=FormatConfig(format="chat", loss_on=loss_on),
                )  # fmt: skip
                pack_dataset([source], out, config, tokenizer=folder)
                manifest = json.loads((out / "manifest.json").read_text())
                packed = pq.read_table(sorted(out.glob("*.parquet")), columns=["loss_mask"])
                supervised = sum(map(sum, packed.column("loss_mask").to_pylist()))
                shown = reference if loss_on == "assistant" and pack_size == 8192 else ""
                excluded = len(manifest["excluded"]["no_supervised"])
                print(f"{name:19} {loss_on:10} {pack_size:4}  {supervised:10}  {excluded:13}  {shown}")
                results.append(
                    [name, loss_on, pack_size, supervised, excluded, int(shown) if shown else None]
                )
    header = ["template", "loss-on", "pack", "supervised", "no supervised", "transformers"]
    title = "50 multi-turn rows; transformers: return_assistant_tokens_mask's supervised tokens"
    write_result("chat_templates", args, size, figures={"rows": len(rows)},
                 tables={"templates": table(header, results, title)},
                 seconds=time.perf_counter() - started)  # fmt: skip


if __name__ == "__main__":
    main()
