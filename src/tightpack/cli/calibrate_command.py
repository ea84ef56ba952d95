"""``tightpack calibrate``: fit a cost model in seconds by timing a small Llama on packs.

The timing lives in `tightpack.runtime.calibration`, the fit in `tightpack.core.cost_fit`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tightpack.cli.app import app, stderr, stdout
from tightpack.errors import TightpackError


def fit_statistics_path(output: Path) -> Path:
    """The sidecar file of the fit statistics: ``model.json`` -> ``model.fit.json``."""
    return output.with_name(f"{output.stem}.fit.json")


def parse_pack_widths(text: str) -> list[int]:
    """``"256,512,1024"`` -> ``[256, 512, 1024]``; `TightpackError` on anything else."""
    parts = [part.strip() for part in text.split(",")]
    try:
        widths = [int(part) for part in parts]
    except ValueError:
        raise TightpackError(
            f"--pack-widths must be comma-separated integers such as 256,512,1024; got {text!r}"
        ) from None
    return widths


def parse_model_config(text: str | None) -> dict | None:
    """``--model-config``: inline JSON or the path of a JSON file, an object of LlamaConfig keys."""
    if text is None:
        return None
    source = "--model-config"
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise TightpackError(
                f"--model-config {text!r} is neither a JSON object nor an existing JSON file; pass e.g. "
                "'{\"num_hidden_layers\": 4}'"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise TightpackError(f"cannot read --model-config file {os.fspath(path)!r}: {error}") from None
        source = f"--model-config file {os.fspath(path)!r}"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise TightpackError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise TightpackError(
            f"{source} must be a JSON object of LlamaConfig keys, got {type(config).__name__}"
        )
    return config


@app.command()
def calibrate(
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="The cost model JSON to write (load it with CostModel.load or pass it as --cost-model). "
            "The fit statistics (R², residuals, measurements) go next to it, to <stem>.fit.json.",
        ),
    ],
    pack_widths: Annotated[
        str, typer.Option(help="Comma-separated pack widths in tokens to time, at least two.")
    ] = "256,512,1024",
    repeats: Annotated[int, typer.Option(help="Timed runs per pack; each pack's time is their median.")] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed passes over all packs first.")] = 1,
    device: Annotated[str, typer.Option(help="Torch device: cpu or cuda.")] = "cpu",
    model_config: Annotated[
        str | None,
        typer.Option(
            help="LlamaConfig overrides of the small default model, as a JSON object or a JSON file, "
            'e.g. \'{"hidden_size": 256, "num_hidden_layers": 4}\'.'
        ),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch threads while timing (1 is steadiest on a busy machine).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the model weights and token ids.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the fit as JSON instead of a table.")
    ] = False,
) -> None:
    """Fit a cost model (seconds) by timing forward + backward of a small Llama on packs."""
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise TightpackError(f"--device must be cpu or cuda, got {device!r}")
    widths = parse_pack_widths(pack_widths)
    config = parse_model_config(model_config)
    if output.is_dir():
        raise TightpackError(f"--output {os.fspath(output)!r} is a folder; pass a JSON file path")
    if not output.parent.is_dir():
        raise TightpackError(f"--output: folder {os.fspath(output.parent)!r} does not exist")

    from tightpack.runtime.calibration import calibrate_cost_model  # torch: only once the options are good

    def progress(done: int, total: int, label: str) -> None:
        stderr.print(f"calibrate: pass {done}/{total} ({label})", markup=False, highlight=False)

    fit = calibrate_cost_model(
        model_config=config,
        pack_widths=widths,
        repeats=repeats,
        warmup=warmup,
        device=device,
        seed=seed,
        threads=threads,
        progress=progress,
    )
    fit.model.save(output)
    sidecar = fit_statistics_path(output)
    sidecar.write_text(json.dumps(fit.to_dict(), indent=2) + "\n", encoding="utf-8")
    if as_json:
        print(json.dumps(fit.to_dict(), indent=2))
        return
    summary = Table(
        title=f"cost model {os.fspath(output)} (statistics: {os.fspath(sidecar)})", show_header=False
    )
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    model = fit.model
    summary.add_row("linear (s / token)", f"{model.linear:.4g}")
    summary.add_row("quadratic (s / token²)", f"{model.quadratic:.4g}")
    summary.add_row("per sequence (s)", f"{model.per_sequence:.4g}")
    summary.add_row("per pack intercept (s, not in the model)", f"{fit.per_pack:.4g}")
    summary.add_row("R²", f"{fit.r2:.4f}")
    summary.add_row("relative RMSE", f"{fit.relative_rmse:.2%}")
    summary.add_row("crossover length (tokens)", f"{model.crossover_length():,.0f}")
    stdout.print(summary)
    residuals = Table(title="measurements")
    residuals.add_column("pack")
    for name in ("measured ms", "predicted ms", "residual ms"):
        residuals.add_column(name, justify="right")
    for label, measured, predicted in zip(fit.labels, fit.seconds, fit.predicted, strict=True):
        residuals.add_row(
            label, f"{measured * 1e3:.2f}", f"{predicted * 1e3:.2f}", f"{(measured - predicted) * 1e3:+.2f}"
        )
    stdout.print(residuals)
