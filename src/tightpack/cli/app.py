"""The typer application every ``tightpack`` command registers on, its consoles and shared option types."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, get_args

import typer
from rich.console import Console

from tightpack import __version__, pack_config
from tightpack.core.planner import ALGORITHMS
from tightpack.prepare import formats

app = typer.Typer(
    name="tightpack",
    help="Sequence packing for LLM and VLM fine-tuning.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
stdout = Console()
stderr = Console(stderr=True)

DEMO_OUTPUT = Path("packed-demo")
DEMO_PACK_SIZE = 4096


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of the library's own allowed values, for typer's choice checking and help."""
    return Enum(name, {value: value for value in values}, type=str)


Format = _choices("Format", get_args(formats.Format))
LossOn = _choices("LossOn", get_args(formats.LossOn))
Algorithm = _choices("Algorithm", tuple(ALGORITHMS))
LongSamples = _choices("LongSamples", get_args(pack_config.LongSamples))
TruncationMethod = _choices("TruncationMethod", get_args(formats.TruncationMethod))
ChatTruncation = _choices("ChatTruncation", get_args(formats.ChatTruncation))
OLDEST_TURNS = ChatTruncation("oldest-turns")
OutputFormat = _choices("OutputFormat", get_args(pack_config.OutputFormat))
Engine = _choices("Engine", get_args(pack_config.Engine))


def _version(value: bool) -> None:
    if value:
        print(f"tightpack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Sequence packing for LLM and VLM fine-tuning."""
