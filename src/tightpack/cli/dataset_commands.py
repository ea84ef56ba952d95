"""``tightpack inspect``, ``verify`` and ``validate``: read a packed dataset or a training configuration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tightpack.cli.app import app, stdout


@app.command()
def inspect(
    path: Annotated[
        str, typer.Argument(help="Packed dataset: folder, Parquet file or glob, or legacy .npy.")
    ],
    pack_size: Annotated[
        int | None, typer.Option(help="Pack size, for the fill ratio when there is no manifest.")
    ] = None,
    cost_model: Annotated[
        str | None,
        typer.Option(
            help="Show the spread of pack cost under a cost model: a preset (llama-8b, llama-1b) or a JSON "
            "file written by CostModel.save."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Summarize a packed dataset (ours or Megatron-Bridge's)."""
    from tightpack.packed_summary import summarize_packed

    summary = summarize_packed(path, pack_size=pack_size, cost_model=cost_model)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"packed dataset {summary['path']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in summary.items():
        if key in ("path", "manifest", "cost"):
            continue
        text = (
            f"{value:.2%}"  # the same form as the summary of `tightpack pack`
            if key == "efficiency"
            else f"{value:,.4f}"
            if isinstance(value, float)
            else f"{value:,}"
            if isinstance(value, int)
            else str(value)
        )
        table.add_row(key.replace("_", " "), text)
    cost = summary.get("cost")
    if cost:
        table.add_row("pack cost, mean", f"{cost['mean']:,.4g} {cost['model'].get('unit', '')}".rstrip())
        table.add_row("pack cost, max / mean", f"{cost['max_over_mean']:.3f}")
        table.add_row("pack cost, coefficient of variation", f"{cost['cv']:.3f}")
    manifest = summary.get("manifest")
    if manifest:
        settings = manifest["settings"]
        table.add_row("algorithm", str(settings.get("algorithm", "?")))
        table.add_row("alignment multiple", str(settings.get("pad_seq_to_mult", "?")))
        table.add_row("tokenizer", str(manifest["tokenizer"].get("name", "?")))
        for key, value in manifest["counts"].items():
            table.add_row(f"count {key.replace('_', ' ')}", f"{value:,}")
    stdout.print(table)


@app.command()
def verify(
    path: Annotated[
        str, typer.Argument(help="Packed dataset: folder, Parquet file or glob, or legacy .npy.")
    ],
    pack_size: Annotated[int | None, typer.Option(help="Pack size (default: the manifest's).")] = None,
    multiple: Annotated[
        int | None, typer.Option(help="Alignment multiple of every sequence (default: the manifest's).")
    ] = None,
    cp: Annotated[int | None, typer.Option(help="Check divisibility for this context parallel size.")] = None,
    metadata: Annotated[
        Path | None, typer.Option(help="metadata.json to check (default: the folder's).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check a packed dataset and name every fault with its file, row and sequence.

    Exits 0 when the dataset is clean, 1 when a fault was found, 2 when it cannot be read.
    """
    from tightpack.verify import verify_packed

    report = verify_packed(path, pack_size=pack_size, multiple=multiple, cp=cp, metadata=metadata)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        checked = ", ".join(f"{value:,} {name.replace('_', ' ')}" for name, value in report.checked.items())
        for violation in report.violations:
            print(str(violation))
        hidden = sum(report.counts.values()) - len(report.violations)
        if hidden:
            print(f"... and {hidden:,} more (listed per check: {dict(report.counts)})")
        if report.ok:
            print(f"OK: {report.path} ({checked})")
        else:
            print(f"FAILED: {sum(report.counts.values()):,} faults in {report.path} ({checked})")
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def validate(
    config: Annotated[
        Path, typer.Argument(help="Training configuration (YAML): train, model, dataset, ... sections.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check a training configuration against every packing rule.

    Prints the errors, the warnings and the derived values; exits 1 on an error, 2 on a bad file.
    """
    from tightpack.config import load_config
    from tightpack.config import validate as validate_config

    report = validate_config(load_config(config))
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.format())
    if not report.ok:
        raise typer.Exit(1)
