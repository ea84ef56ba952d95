"""The ``tightpack`` command line: ``pack``, ``plan``, ``inspect``, ``verify``, ``validate``, ``blend``,
``calibrate``.

One module per group of commands (`pack_command`, `plan_command`, `dataset_commands`, `blend_command`,
`calibrate_command`), all registered on the typer `app.app`; this module only runs it.

User errors (`TightpackError`, bad options) print one line on stderr and exit with status 2; there is
no traceback for them. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import sys

import typer

from tightpack.cli import (  # noqa: F401  (importing registers their commands)
    blend_command,
    calibrate_command,
    dataset_commands,
    pack_command,
    plan_command,
)
from tightpack.cli.app import app, stderr, stdout
from tightpack.cli.flags import cli_message
from tightpack.cli.pack_command import Interrupted
from tightpack.errors import TightpackError
from tightpack.offline.output_folder import os_error_message


def _signals(*names: str) -> tuple[type[BaseException], ...]:
    """Typer's exception classes and, where typer still runs on click, click's."""
    found = [getattr(typer, name) for name in names if hasattr(typer, name)]
    try:
        import click.exceptions as click_exceptions
    except ImportError:
        return tuple(found)
    click_names = {"TyperException": "ClickException"}
    return tuple(found + [getattr(click_exceptions, click_names.get(name, name)) for name in names])


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app, turning user errors into one line and exit status 2."""
    try:
        code = app(args=argv, standalone_mode=False)
    except TightpackError as error:  # one line, whatever a wrapped library message held
        stderr.print(f"error: {cli_message(error)}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except _signals("Exit") as done:
        return done.exit_code
    except _signals("TyperException") as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # bare `tightpack`: the help is the answer
            stdout.print(error.format_message(), markup=False, highlight=False)
            return 2
        stderr.print(f"error: {error.format_message()}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except OSError as error:  # read-only output, disk full, unwritable folder: the path and the cause
        sys.stderr.write(f"error: {os_error_message(error)}\n")
        return 2
    except Interrupted as interrupted:
        sys.stderr.write(
            f"interrupted: nothing was published; {interrupted.args[0]} is as it was before the run\n"
        )
        return 130
    except (KeyboardInterrupt, *_signals("Abort")):
        sys.stderr.write("interrupted\n")
        return 130
    if code == 130:  # click's own handling of Ctrl-C in the other commands
        sys.stderr.write("interrupted\n")
    return code if isinstance(code, int) else 0
