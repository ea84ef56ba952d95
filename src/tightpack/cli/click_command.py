"""The ``tightpack`` application as the click command typer builds from it, for the documentation site.

``mkdocs-click`` renders the command line reference (docs/reference/cli.md) from `command`, so the
reference is the ``--help`` text of every command and never written by hand. Importing this module
registers every command (it imports the `tightpack.cli` package first).
"""

from __future__ import annotations

import typer.main

from tightpack.cli import app

command = typer.main.get_command(app)
