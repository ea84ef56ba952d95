"""The typer application every ``tightpack`` command registers on, its consoles and shared option types."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, get_args

import typer
from rich.console import Console

from tightpack import __version__
from tightpack.cli.flags import cli_text
from tightpack.core.planner import ALGORITHMS
from tightpack.offline import config as pack_config
from tightpack.prepare import format_config
from tightpack.prepare.tokenize import BAD_ROW_PARAMETERS

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


def print_bad_rows(bad_rows: Sequence[tuple[str, str]], listed: str = "") -> None:
    """The first five rows skipped as bad, ``(location, reason)``, on stderr with the reasons in the
    command line's flags (``--input-key``, not ``input_key``), then how many more (``listed``: where)."""
    for location, reason in bad_rows[:5]:
        text = f"skipped {location}: {cli_text(reason, BAD_ROW_PARAMETERS)}"
        stderr.print(text, markup=False, highlight=False, soft_wrap=True)
    if len(bad_rows) > 5:
        stderr.print(f"... and {len(bad_rows) - 5} more bad rows{listed}", markup=False, highlight=False)


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of the library's own allowed values, for typer's choice checking and help."""
    return Enum(name, {value: value for value in values}, type=str)


Format = _choices("Format", get_args(format_config.Format))
LossOn = _choices("LossOn", get_args(format_config.LossOn))
Algorithm = _choices("Algorithm", tuple(ALGORITHMS))
LongSamples = _choices("LongSamples", get_args(pack_config.LongSamples))
TruncationMethod = _choices("TruncationMethod", get_args(format_config.TruncationMethod))
ChatTruncation = _choices("ChatTruncation", get_args(format_config.ChatTruncation))
OLDEST_TURNS = ChatTruncation("oldest-turns")
OutputFormat = _choices("OutputFormat", get_args(pack_config.OutputFormat))
Engine = _choices("Engine", get_args(pack_config.Engine))
PreferenceLayout = _choices("PreferenceLayout", get_args(pack_config.Layout))


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
