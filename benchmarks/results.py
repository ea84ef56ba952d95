"""The two sizes of every benchmark and the JSON result each one writes (`benchmarks/results/`).

A benchmark runs a quick size by default and the size the docs quote with ``--full``; `add_size_options`
adds that flag and ``--result`` (where the JSON goes), `choose_size` fills the options the command line
left unset from the chosen size, and `write_result` writes one JSON record: the headline figures,
tables of figures, the whole report, the command line, the size, the machine, the date and the git
commit. The docs' benchmarks page (``docs/benchmarks.md``) is rendered from these files at build time
by ``docs/hooks/benchmark_results.py``.

Set ``TIGHTPACK_BENCH_MACHINE`` to a few words about the machine that the CPU model does not say (for
example ``"2 cores shared with other jobs"``); the record keeps them as ``machine.note``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
ROOT = BENCHMARKS.parent
QUICK, FULL = "quick", "full"


def add_size_options(parser: argparse.ArgumentParser, name: str) -> None:
    """``--full`` (the documented size instead of the quick one) and ``--result PATH``."""
    parser.add_argument(
        "--full", action="store_true", help="run the size the docs quote (default: a quick size)"
    )
    parser.add_argument(
        "--result",
        type=Path,
        default=RESULTS / f"{name}.json",
        metavar="PATH",
        help=f"where the JSON result goes (default: benchmarks/results/{name}.json)",
    )


def choose_size(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any]) -> str:
    """Set every option in ``quick`` (or ``full`` with ``--full``) that the command line left ``None``.

    Returns ``"quick"`` or ``"full"`` (also for a benchmark of one size: ``quick == full``); an option
    given on the command line wins over both sizes.
    """
    size = FULL if args.full or quick == full else QUICK
    for key, value in (full if args.full else quick).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return size


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> dict:
    """A table of figures as the results page renders it: a title, column names, rows of cells."""
    rows = [list(row) for row in rows]
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row needs {len(columns)} cells ({', '.join(columns)})")
    return {"title": title, "columns": list(columns), "rows": rows}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_of(package: str) -> str | None:
    """An installed distribution's version, without importing it (``None`` when missing)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """The machine a result was measured on: CPU, cores, load, Python and library versions."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "note": os.environ.get("TIGHTPACK_BENCH_MACHINE", ""),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "numpy": version_of("numpy"),
        "transformers": version_of("transformers"),
        "tightpack": version_of("tightpack"),
    }


def git_commit() -> dict:
    """The commit of the checkout, and whether the source or the benchmarks differ from it."""

    def git(*command: str) -> str:
        result = subprocess.run(
            ["git", *command], cwd=ROOT, capture_output=True, text=True, check=False, timeout=30
        )
        return result.stdout.strip() if result.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", "src", "benchmarks", ":!benchmarks/results")
    return {"commit": commit or None, "modified": bool(changed)}


def command_line(script: str, arguments: Sequence[str]) -> str:
    """How to run the benchmark again: ``python benchmarks/SCRIPT ARGUMENTS``, without the options that
    only say where the JSON goes (``--result PATH``, ``--json PATH``)."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
        elif argument in ("--result", "--json"):
            skip = True
        elif not argument.startswith(("--result=", "--json=")):
            kept.append(argument)
    return shlex.join(["python", f"benchmarks/{script}", *kept])


def jsonable(value: Any) -> Any:
    """``value`` with paths as strings, numpy scalars and arrays as Python ones, non-finite floats as
    strings: what `json.dumps` writes and every JSON reader reads."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_result(
    name: str,
    args: argparse.Namespace,
    size: str,
    *,
    figures: dict[str, Any],
    tables: dict[str, dict] | None = None,
    report: Any = None,
    seconds: float | None = None,
) -> Path:
    """Write the result of benchmark ``name`` to ``args.result``; returns the path.

    Args:
        name: the benchmark's short name (``bench_planner.py`` is ``planner``).
        args: the parsed command line (its options are kept as ``settings``).
        size: `choose_size`'s answer.
        figures: the headline figures, label -> value (labels carry their unit).
        tables: further figures as `table` dicts, by key.
        report: everything else the run measured, JSON-ready.
        seconds: the run's wall time.
    """
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else f"bench_{name}.py"
    record = {
        "benchmark": name,
        "command": command_line(script, sys.argv[1:]),
        "size": size,
        "settings": {key: value for key, value in vars(args).items() if key not in ("result",)},
        "figures": figures,
        "tables": tables or {},
        "seconds": seconds,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **git_commit(),
        "machine": machine(),
        "report": report,
    }
    path = Path(args.result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(record), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")
    return path
