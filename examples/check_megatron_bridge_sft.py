"""Pack for a Megatron-Bridge configuration, then prove with ``tightpack validate`` that it fits the packs.

    python examples/check_megatron_bridge_sft.py [TRAIN.jsonl] [--val VAL.jsonl] [--tokenizer DIR]
        [--config examples/megatron_bridge_sft.yaml] [--work DIR]

1. Packs the training and validation rows with the flags the configuration implies (pack size, TP, CP,
   SP, tokenizer), as `tightpack pack` commands it prints.
2. Writes the configuration with its packed paths and tokenizer pointing at what it made.
3. Runs ``tightpack validate`` on it: every configuration rule and every packed-data rule must hold.
4. Changes the topology after packing (CP 2 -> 4) and runs it again: the stale packs must be refused,
   with the re-pack command as the fix.

Without inputs it packs the embedded demo corpus for both splits; without ``--tokenizer`` it saves the
built-in GPT-2 as a Hugging Face tokenizer folder, the kind ``tokenizer.tokenizer_model`` names. Exit
status 0 when both checks behave as stated, 1 otherwise. See examples/megatron_bridge_sft.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path

import yaml

from tightpack.cli import main as tightpack
from tightpack.config import load_config, validate

EXAMPLE = Path(__file__).with_name("megatron_bridge_sft.yaml")


def run(args: list[str]) -> int:
    """``tightpack ARGS``, printed as the command line to copy, in this process."""
    print(f"$ tightpack {shlex.join(args)}", flush=True)
    return tightpack(args)


def pack_flags(config: dict) -> list[str]:
    """The `tightpack pack` flags that make packs ``config`` can train on: its pack size and topology."""
    loaded = load_config(config)
    model, specs = loaded.model, loaded.dataset.offline_packing_specs
    flags = ["--pack-size", str(specs.packed_sequence_size)]
    flags += ["--tp", str(model.tensor_model_parallel_size), "--cp", str(model.context_parallel_size)]
    flags += ["--sp"] if model.sequence_parallel else []
    if specs.max_single_sequence_length:
        flags += ["--max-seq-length", str(specs.max_single_sequence_length)]
    return flags


def gpt2_folder(folder: Path) -> Path:
    """The built-in GPT-2 tokenizer saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer

    from tightpack.prepare.tokenizer import load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer.from_str(load_tokenizer(None).backend_json).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def check(config_path: Path, train: list[str], val: list[str], tokenizer: Path | None, work: Path) -> bool:
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    tokenizer = tokenizer or gpt2_folder(work / "tokenizer")
    flags = [*pack_flags(config), "--tokenizer", str(tokenizer), "--overwrite"]
    folders = {}
    for split, inputs in (("train", train), ("val", val)):
        folders[split] = work / "packs" / split
        if run(["pack", *(inputs or ["--demo"]), "--output", str(folders[split]), *flags]) != 0:
            return False

    specs = config["dataset"]["offline_packing_specs"]
    specs["packed_train_data_path"] = str(folders["train"])
    specs["packed_val_data_path"] = str(folders["val"])
    specs["packed_metadata_path"] = str(folders["train"] / "metadata.json")
    config["tokenizer"]["tokenizer_model"] = str(tokenizer)
    matching = work / "config.yaml"
    matching.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    print("\nThe configuration with its packs: every rule must hold.", flush=True)
    fits = run(["validate", str(matching)]) == 0

    # A topology change after packing, made consistently in the configuration: CP doubled and
    # pad_seq_to_mult with it. The configuration alone is valid; only its packs are stale.
    stale = copy.deepcopy(config)
    stale["model"]["context_parallel_size"] *= 2
    required = validate(load_config(stale)).derived.alignment_multiple
    stale["dataset"]["offline_packing_specs"]["pad_seq_to_mult"] = required
    changed = work / "config-cp-changed.yaml"
    changed.write_text(yaml.safe_dump(stale, sort_keys=False), encoding="utf-8")
    print("\nCP doubled after packing: the configuration alone is valid ...", flush=True)
    valid_alone = run(["validate", str(changed), "--config-only"]) == 0
    print("\n... but its packs are stale and must be refused.", flush=True)
    refused = run(["validate", str(changed)]) == 1
    print(
        f"\nmatching configuration validates: {fits}; after the topology change the configuration alone "
        f"validates: {valid_alone}, and its stale packs are refused: {refused}"
    )
    return fits and valid_alone and refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train", nargs="*", help="training rows (default: the embedded demo corpus)")
    parser.add_argument("--val", nargs="*", default=None, help="validation rows (default: as train)")
    parser.add_argument("--tokenizer", type=Path, help="Hugging Face tokenizer folder (default: GPT-2)")
    parser.add_argument("--config", type=Path, default=EXAMPLE, help="the Megatron-Bridge configuration")
    parser.add_argument("--work", type=Path, default=Path("megatron-bridge-check"), help="working folder")
    args = parser.parse_args(argv)
    val = args.train if args.val is None else args.val
    return 0 if check(args.config, args.train, val, args.tokenizer, args.work) else 1


if __name__ == "__main__":
    sys.exit(main())
