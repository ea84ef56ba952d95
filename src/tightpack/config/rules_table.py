"""docs/validation-rules.md, rendered from the rule registry; regenerate it after changing a rule::

    python -m tightpack.config.rules_table docs/validation-rules.md

Without a path the command prints the Markdown. tests/config/test_config_registry.py fails while the committed
file and the registry differ.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

from tightpack.config.derive import DERIVATIONS
from tightpack.config.rules.base import Rule
from tightpack.config.rules.registry import REGISTRY

COMMAND = "python -m tightpack.config.rules_table docs/validation-rules.md"

_HEADER = f"""\
<!-- Generated from the rule registry (src/tightpack/config/rules/) by `{COMMAND}`.
     Do not edit: change the rules and run the command again. -->

# Configuration validation rules

`tightpack validate CONFIG.yaml` (in Python `tightpack.config.validate`) checks a Megatron-Bridge style
training configuration against every rule below and reports every violation, in this order, each with its
rule id, the reason and the fix.

- **Id**: `R1`-`R22` are the checks of the reference's `ConfigContainer.validate()`, numbered as in section 5
  of the Megatron-Bridge packing contract: R8.x is the dataset configuration's own `validate()`, which it runs
  first, R10.x are the native Energon checks in the reference's order, and R12 and R14 derive values (below).
  `X` rules are the ones the reference enforces elsewhere (its samplers, Megatron-Core, `gpt_step`, the
  dataset configurations); `T` rules are tightpack's additions, for failures the reference lets through.
- **Severity**: E an error (`tightpack validate` exits 1), W a warning, E/W either, by case.
- **Contract**: the sections of the packing contract that state the rule.
- **Module**: where the rule lives, in `src/tightpack/config/rules/`.
- k is the CP/SP alignment multiple: the lcm, over the training and the evaluation CP, of `2*CP` (when CP > 1)
  and `CP*TP` (with sequence parallelism and TP > 1).
"""


def rules_table(rules: Iterable[Rule]) -> str:
    """The Markdown table of ``rules``, one row each: id, severity, contract sections, summary, module.

    >>> print(rules_table(REGISTRY[:2]))
    | Id | Severity | Contract | Rule | Module |
    | --- | --- | --- | --- | --- |
    | R1 | E | §5, §3.7 | `train.num_epochs` only with a GPTSFTDatasetConfig dataset | `batching` |
    | R2 | E | §5, §3.7 | `train.num_epochs` only with `dataloader_type="batch"` | `batching` |
    """
    rows = ["| Id | Severity | Contract | Rule | Module |", "| --- | --- | --- | --- | --- |"]
    for rule in rules:
        severity = "/".join(severity[0].upper() for severity in rule.severities)
        rows.append(f"| {rule.id} | {severity} | {rule.section} | {rule.summary} | `{rule.module}` |")
    return "\n".join(rows)


def data_rules_table() -> str:
    """The Markdown table of the packed-data rules (`tightpack.stale_packs.DATA_RULES`).

    >>> print(data_rules_table().splitlines()[2])  # doctest: +ELLIPSIS
    | D1 | E/W | §2.1 | every packed path the configuration names ...
    """
    from tightpack.stale_packs import DATA_RULES  # a front-layer module that imports this package

    rows = ["| Id | Severity | Contract | Rule |", "| --- | --- | --- | --- |"]
    for rule in DATA_RULES:
        severity = "/".join(severity[0].upper() for severity in rule.severities)
        rows.append(f"| {rule.id} | {severity} | {rule.section} | {rule.summary} |")
    return "\n".join(rows)


_DATA_INTRO = """\
With offline packing, `tightpack validate` also reads the packed data the configuration points at
(`packed_train_data_path`, `packed_val_data_path`, `packed_metadata_path`, or `--packed DIR`) and checks it
against the configuration (`tightpack.stale_packs`). A tightpack output folder's `manifest.json` records the
settings the packs were made with, so by default no row is read; packs without a manifest (Megatron-Bridge's
own) are checked on a fixed, seeded sample of rows; `--deep` reads every row and hashes every file. An
error's fix is the `tightpack pack` command that re-packs for the configuration into a fresh output folder.

The re-pack command changes the topology only. The pack size, the alignment (`--cp`/`--tp`/`--sp` or
`--pad-seq-to-mult`), `--pad-to-max-length` and `--pad-cu-seqlens` come from the configuration; every other
setting the manifest records is written back as the flag that set it: the sources, the tokenizer,
`--max-seq-length` (the configuration's `max_single_sequence_length`, else the manifest's cap when it was
below its pack size, at most the new pack size), `--long-samples`, `--format`, `--prompt-template`, the
input, output, messages and tools keys, `--loss-on`, `--truncate-field`, `--truncation-method`,
`--chat-truncation`, `--template-var`, `--algorithm`, `--seed`, `--balance-costs` (the preset whose
coefficients the manifest records, else `COST_MODEL.json` to replace), `--skip-bad-lines`, `--output-format`
and the vision options (the manifest records the processor's sizes, not its folder: `--vision-processor
PROCESSOR_FOLDER` is to replace). Only values other than the defaults are written. So the new packs hold the
same samples, kept, truncated and dropped for the same reasons, with the same supervised tokens, whenever
the cap is unchanged and cuts at the same length: every run rounds its cap down to its alignment multiple,
so a cap that is not a multiple of the new multiple can cut elsewhere (packs cut at `--max-seq-length 90`
with multiple 1, re-packed with `--cp 2`, multiple 4, are cut at 88, and the samples longer than 88 tokens
lose tokens), and the printed command then says so beside it, with both lengths. Tests run the printed
command and compare the manifests' counts, and the lengths of the rounded case. The table from
setting to flag is `tightpack.offline.pack_flags.SETTING_FLAGS`; a test fails when a field of
`PackConfig` or `FormatConfig` has no entry, or an entry names a flag `tightpack pack` lacks. A manifest
setting the running tightpack does not know (a newer version's) is named after the command, not dropped
silently.
"""


def render() -> str:
    """The whole of docs/validation-rules.md: introduction, rules in `validate`'s order, derived values,
    packed-data rules."""
    derived = ["| Id | Derived value |", "| --- | --- |"]
    derived += [f"| {rule_id} | {summary} |" for rule_id, summary in DERIVATIONS]
    sections = [
        _HEADER,
        "## Rules\n",
        rules_table(REGISTRY) + "\n",
        "## Derived values\n",
        "R11, R12 and R14 also set values, which the reference writes into the configuration. The report "
        'lists them under "derived values"; `ValidationReport.derived.overrides()` returns them.\n',
        "\n".join(derived) + "\n",
        "## Packed data (D rules)\n",
        _DATA_INTRO,
        data_rules_table() + "\n",
    ]
    return "\n".join(sections)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tightpack.config.rules_table [PATH]``: write the file to PATH, or print it."""
    parser = argparse.ArgumentParser(
        prog="python -m tightpack.config.rules_table", description="Render docs/validation-rules.md."
    )
    parser.add_argument("path", nargs="?", type=Path, help="the file to write (default: print the Markdown)")
    path = parser.parse_args(argv).path
    if path is None:
        print(render(), end="")
    else:
        path.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
