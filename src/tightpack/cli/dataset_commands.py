"""``tightpack inspect``, ``verify`` and ``validate``: read a packed dataset or a training configuration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tightpack.cli.app import app, stderr, stdout
from tightpack.cli.blend_command import TOKENS, MixBy, parse_shares


@app.command()
def inspect(
    path: Annotated[
        str, typer.Argument(help="Packed dataset: folder, Parquet file or glob, or legacy .npy.")
    ],
    pack_size: Annotated[
        int | None,
        typer.Option(help="Pack size, for the fill ratio and the plots when there is no manifest."),
    ] = None,
    cost_model: Annotated[
        str | None,
        typer.Option(
            help="Show the spread of pack cost under a cost model: a preset (llama-8b, llama-1b) or a JSON "
            "file written by CostModel.save."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write the sequence lengths and the fill, sequences and cost per pack as a PNG "
            "(tightpack[plots]); a mixture's shares window by window go beside it, in PLOT.mixture.png."
        ),
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(help="Write a self-contained HTML report (summary, a mixture's table, and plots)."),
    ] = None,
) -> None:
    """Summarize a packed dataset (ours or Megatron-Bridge's); --plot and --html draw it pack by pack."""
    from tightpack.core.cost_model import CostModel
    from tightpack.errors import TightpackError
    from tightpack.reports.mixture import mixture_figure, mixture_problem, mixture_table, mixture_title
    from tightpack.reports.summary import read_pack_arrays, summarize_pack_arrays

    if plot is not None or html is not None:
        from tightpack.reports import plots

        plots.require_matplotlib()  # before reading anything, as the cost model below
    model = None if cost_model is None else CostModel.resolve(cost_model)
    arrays = read_pack_arrays(path)  # read once: the plots draw the arrays the summary is made of
    summary = summarize_pack_arrays(arrays, pack_size=pack_size, cost_model=model)
    rows = []
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
        rows.append((key.replace("_", " "), text))
    cost = summary.get("cost")
    if cost:
        rows.append(("pack cost, mean", f"{cost['mean']:,.4g} {cost['model'].get('unit', '')}".rstrip()))
        rows.append(("pack cost, max / mean", f"{cost['max_over_mean']:.3f}"))
        rows.append(("pack cost, coefficient of variation", f"{cost['cv']:.3f}"))
    manifest = summary.get("manifest")
    mixture = manifest.get("mixture") if manifest else None  # packed in its own order, whatever the algorithm
    problem = mixture_problem(mixture, packs=summary["packs"]) if mixture else None
    if problem:  # the rest is shown; `tightpack verify` tells what changed
        stderr.print(
            f"warning: the manifest's mixture section is not shown: {problem} (tightpack verify "
            f"{summary['path']} names what changed)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if manifest:
        settings = manifest["settings"]
        rows.append(
            (
                "algorithm",
                "mixture (chunks of the interleaved sources, packed apart)"
                if mixture
                else str(settings.get("algorithm", "?")),
            )
        )
        rows.append(("alignment multiple", str(settings.get("pad_seq_to_mult", "?"))))
        if "preference_layout" in settings:
            rows.append(
                ("preference units", f"{settings['format']['format']}, {settings['preference_layout']}")
            )
        rows.append(("tokenizer", str(manifest["tokenizer"].get("name", "?"))))
        for key, value in manifest["counts"].items():
            rows.append((f"count {key.replace('_', ' ')}", f"{value:,}"))
    if plot is not None or html is not None:
        if summary["pack_size"] is None:
            raise TightpackError(
                f"--plot and --html need the pack size and {summary['path']} has no manifest to give it; "
                "pass it, e.g. --pack-size 4096"
            )
        settings = manifest["settings"] if manifest else {}  # no manifest: the cap is unknown
        cap = settings.get("max_seq_length") or settings.get("packed_sequence_size")  # None means P
        figures = [plots.inspect_figure(arrays, pack_size=summary["pack_size"], cap=cap, cost_model=model)]
        if mixture and not problem:
            figures.append(mixture_figure(mixture, packs=summary["packs"], path=summary["path"]))
        if plot is not None:
            plots.save_png(figures[0], plot)
            if len(figures) > 1:  # the mixture beside it: plot.png -> plot.mixture.png
                plots.save_png(figures[1], Path(plot).with_suffix(".mixture.png"))
        if html is not None:
            title = f"tightpack inspect {summary['path']}"
            plots.write_html_report(
                html,
                title,
                [["packed dataset", summary["path"]], *rows],
                figures,
                tables=[(mixture_title(mixture), mixture_table(mixture))] if mixture and not problem else (),
            )
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"packed dataset {summary['path']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, text in rows:
        table.add_row(name, text)
    stdout.print(table)
    if mixture and not problem:
        header, *body = mixture_table(mixture)  # the rows of the --html report's table too
        shares = Table(title=mixture_title(mixture))
        shares.add_column(header[0], style="bold")
        for name in header[1:]:
            shares.add_column(name, justify="right")
        for row in body:
            shares.add_row(*row)
        stdout.print(shares)


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
    media: Annotated[
        bool, typer.Option("--media/--no-media", help="Vision packs: read every media file again.")
    ] = True,
) -> None:
    """Check a packed dataset and name every fault with its file, row and sequence.

    Exits 0 when the dataset is clean, 1 when a fault was found, 2 when it cannot be read.
    """
    from tightpack.verify import verify_packed

    report = verify_packed(
        path, pack_size=pack_size, multiple=multiple, cp=cp, metadata=metadata, media=media
    )
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        checked = ", ".join(f"{value:,} {name.replace('_', ' ')}" for name, value in report.checked.items())
        checked = f" ({checked})" if checked else ""  # nothing read: every shard gone
        for violation in report.violations:
            print(str(violation))
        hidden = sum(report.counts.values()) - len(report.violations)
        if hidden:
            print(f"... and {hidden:,} more (listed per check: {dict(report.counts)})")
        if report.ok:
            print(f"OK: {report.path}{checked}")
        else:
            print(f"FAILED: {sum(report.counts.values()):,} faults in {report.path}{checked}")
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def validate(
    config: Annotated[
        Path, typer.Argument(help="Training configuration (YAML): train, model, dataset, ... sections.")
    ],
    packed: Annotated[
        Path | None,
        typer.Option(
            help="Packed data to check instead of the configuration's packed_train/val_data_path: a "
            "tightpack output folder, a Megatron-Bridge pack folder, or a Parquet file or glob."
        ),
    ] = None,
    deep: Annotated[
        bool, typer.Option("--deep", help="Read every packed row and hash every file (default: manifest).")
    ] = False,
    config_only: Annotated[
        bool,
        typer.Option("--config-only", help="Check the configuration alone, not the packed data it names."),
    ] = False,
    mix_by: Annotated[
        MixBy,
        typer.Option(
            help="What a packed_train_data_blend's weights are meant to count: tokens, supervised-tokens "
            "or samples (rule D11 warns when the packs they draw give other shares than meant)."
        ),
    ] = TOKENS,
    blend_targets: Annotated[
        str | None,
        typer.Option(
            help="The shares of --mix-by that packed_train_data_blend is meant to give, comma-separated in "
            "the order of its sources, e.g. 0.5,0.5 (default: its weights, as written)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check a training configuration against every packing rule, and the packed data it points at.

    Prints the errors, the warnings and the derived values; exits 1 on an error, 2 on a bad file.
    """
    from tightpack.stale_packs import format_report, validate_with_packed_data

    report, checked = validate_with_packed_data(
        config,
        packed=packed,
        deep=deep,
        config_only=config_only,
        mix_by=mix_by.value,
        blend_targets=parse_shares(blend_targets, "--blend-targets"),
    )
    if as_json:
        print(json.dumps({**report.to_dict(), "packed_data": checked.to_dict()}, indent=2))
    else:
        print(format_report(report, checked))
    if not report.ok:
        raise typer.Exit(1)
