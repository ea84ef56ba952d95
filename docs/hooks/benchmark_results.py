"""An mkdocs hook: the benchmarks' committed JSON results (``benchmarks/results/``) rendered into pages.

A line ``<!-- benchmark: NAME -->`` in a page becomes the figures of ``benchmarks/results/NAME.json``
(its headline figures and every table), ``<!-- benchmark: NAME table=KEY -->`` one table of it, and
``<!-- benchmark: NAME table=figures -->`` its headline figures alone;
each with the command that produced it, its size, the machine, the date and the commit. A marker
whose file is missing, or whose table is not in it, fails the build (`BenchmarkResultError`), so a
page never shows a figure that no committed run produced.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- benchmark: (?P<name>[\w.-]+)(?: table=(?P<table>[\w.-]+))? -->$", re.MULTILINE)


FIGURES = "figures"
"""The ``table=`` value that renders a result's headline figures alone."""


class BenchmarkResultError(PluginError):
    """A page names a benchmark result (or a table of one) that is not in ``benchmarks/results/``."""


def cell(value: Any) -> str:
    """A figure as a table cell: 4 significant digits (whole numbers from 1,000, thousands separated)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3g}"
    if value is None:
        return ""
    return str(value).replace("|", "\\|")


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(record: dict) -> str:
    """Where a result comes from: the command, its size, the machine, the date and the commit."""
    machine = record.get("machine", {})
    cores = machine.get("usable_cores") or machine.get("cores")
    parts = [f"{machine.get('cpu', 'unknown CPU')}, {cores} cores"]
    if machine.get("note"):
        parts.append(machine["note"])
    parts.append(f"Python {machine.get('python')}")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    commit = (record.get("commit") or "unknown")[:10]
    modified = " (with uncommitted changes)" if record.get("modified") else ""
    return (
        f"*Observed*, not asserted: `{record['command']}` ({record['size']} size), "
        f"{record['date'][:10]}, commit `{commit}`{modified}; {'; '.join(parts)}."
    )


def render(record: dict, table: str | None = None) -> str:
    """The Markdown of one result, or of its table ``table``."""
    blocks = []
    if table in (None, FIGURES):
        figures = record.get("figures") or {}
        if figures:
            blocks.append(markdown_table(["figure", "value"], [[k, v] for k, v in figures.items()]))
        keys = list(record.get("tables") or {}) if table is None else []
    else:
        keys = [table]
    for key in keys:
        data = record["tables"][key]
        title = f"**{data['title']}**\n\n" if data.get("title") and table is None else ""
        blocks.append(title + markdown_table(data["columns"], data["rows"]))
    blocks.append(provenance(record))
    return "\n\n".join(blocks)


def load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    if not path.is_file():
        raise BenchmarkResultError(
            f"benchmark result {path} is missing: run `python benchmarks/bench_{name}.py` "
            "(`make bench` runs them all) and commit the JSON it writes"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def render_markers(markdown: str, results: Path, page: str = "a page") -> str:
    """``markdown`` with every benchmark marker replaced by the result it names."""

    def replace(match: re.Match) -> str:
        name, table = match["name"], match["table"]
        record = load(results, name)
        if table not in (None, FIGURES) and table not in (record.get("tables") or {}):
            raise BenchmarkResultError(
                f"{page} asks for table {table!r} of benchmarks/results/{name}.json, which has "
                f"{sorted(record.get('tables') or {})}"
            )
        return render(record, table)

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: render the benchmark markers of every page."""
    results = Path(config.config_file_path).resolve().parent / "benchmarks" / "results"
    return render_markers(markdown, results, page.file.src_uri)
