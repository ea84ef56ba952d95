"""The benchmarks' JSON results (benchmarks/results.py) and the docs hook that renders them into pages
(docs/hooks/benchmark_results.py): a known value appears in the page, a missing result fails."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _module("benchmark_results_hook", ROOT / "docs" / "hooks" / "benchmark_results.py")
results = _module("benchmark_results_writer", ROOT / "benchmarks" / "results.py")


def _record(tmp_path: Path, monkeypatch, name: str = "example", **extra) -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=None)
    results.add_size_options(parser, name)
    args = parser.parse_args(["--result", str(tmp_path / f"{name}.json")])
    size = results.choose_size(args, quick={"n": 10}, full={"n": 1000})
    monkeypatch.setattr(sys, "argv", [f"benchmarks/bench_{name}.py", "--result", "x.json"])
    monkeypatch.setenv("TIGHTPACK_BENCH_MACHINE", "2 cores shared with other jobs")
    tables = {"rows": results.table(["case", "seconds"], [["first", 0.123456], ["second", 12345.678]], "T")}
    return results.write_result(
        name, args, size, figures={"lengths per second": 1234567.0, "n": args.n}, tables=tables, **extra
    )


def test_a_result_records_its_size_command_machine_date_and_commit(tmp_path, monkeypatch):
    path = _record(tmp_path, monkeypatch, report={"inf": float("inf")}, seconds=1.5)
    record = json.loads(path.read_text())
    assert record["benchmark"] == "example" and record["size"] == "quick" and record["settings"]["n"] == 10
    assert record["command"] == "python benchmarks/bench_example.py"  # where the JSON went is left out
    assert results.command_line("bench_x.py", ["--full", "--json", "a", "--n=3", "--result=b"]) == (
        "python benchmarks/bench_x.py --full --n=3"
    )
    assert record["figures"] == {"lengths per second": 1234567.0, "n": 10}
    assert record["report"] == {"inf": "inf"}  # JSON without Infinity
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"])
    machine = record["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["python"] and machine["torch"]
    assert machine["note"] == "2 cores shared with other jobs"


def test_an_option_given_wins_over_both_sizes():
    args = argparse.Namespace(full=True, n=None, repeats=7)
    assert results.choose_size(args, quick={"n": 1, "repeats": 1}, full={"n": 5, "repeats": 5}) == "full"
    assert (args.n, args.repeats) == (5, 7)
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        results.table(["a", "b"], [[1]])


def test_the_page_shows_a_known_value_with_its_command_machine_and_date(tmp_path, monkeypatch):
    _record(tmp_path, monkeypatch)
    page = "# Benchmarks\n\n<!-- benchmark: example -->\n\nAfter.\n"
    text = hook.render_markers(page, tmp_path)
    assert "<!-- benchmark" not in text and text.endswith("After.\n")
    assert "| lengths per second | 1,234,567 |" in text and "| n | 10 |" in text
    assert "| first | 0.1235 |" in text and "| second | 12,346 |" in text and "**T**" in text
    assert "`python benchmarks/bench_example.py` (quick size)" in text
    assert "2 cores shared with other jobs" in text and "*Observed*, not asserted" in text
    one = hook.render_markers("<!-- benchmark: example table=rows -->", tmp_path)
    assert "| first | 0.1235 |" in one and "lengths per second" not in one
    figures = hook.render_markers("<!-- benchmark: example table=figures -->", tmp_path)
    assert "lengths per second" in figures and "first" not in figures and "quick size" in figures


def test_a_missing_result_or_table_fails_the_build(tmp_path, monkeypatch):
    with pytest.raises(hook.BenchmarkResultError, match=r"missing\.json is missing: run"):
        hook.render_markers("<!-- benchmark: missing -->", tmp_path)
    _record(tmp_path, monkeypatch)
    with pytest.raises(hook.BenchmarkResultError, match=r"asks for table 'nope'.*has \['rows'\]"):
        hook.render_markers("<!-- benchmark: example table=nope -->", tmp_path, "benchmarks.md")


def _markers() -> list[tuple[Path, str, str | None]]:
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for match in hook.MARKER.finditer(page.read_text(encoding="utf-8")):
            found.append((page.relative_to(ROOT), match["name"], match["table"]))
    return found


def test_every_marker_of_the_docs_has_its_committed_result():
    """The strict docs build renders these files: each must be committed, with the table a page asks."""
    markers = _markers()
    assert {name for _, name, _ in markers} >= {"planner", "balance", "balance_steps", "engines"}
    folder = ROOT / "benchmarks" / "results"
    for page, name, table in markers:
        record = hook.load(folder, name)
        assert table in (None, "figures") or table in record["tables"], (page, name, table)
        assert record["benchmark"] == name and record["commit"], (page, name)
        hook.render(record, table)


def test_make_bench_runs_every_benchmark_the_docs_quote():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    run = set(
        re.findall(r"^BENCHES := ((?:.*\\\n)*.*)$", makefile, re.MULTILINE)[0].replace("\\\n", " ").split()
    )
    run |= set(re.findall(r"benchmarks/bench_(\w+)\.py", makefile.split("\nbench:")[1].split("\nclean:")[0]))
    quoted = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        quoted |= set(re.findall(r"bench_(\w+)\.py", path.read_text(encoding="utf-8")))
    quoted |= {name for _, name, _ in _markers()}
    assert quoted <= run, sorted(quoted - run)


def _build(site_root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site_root / "site")],
        cwd=site_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_site_built_with_the_hook_shows_the_result_and_fails_without_it(tmp_path, monkeypatch):
    """A one-page mkdocs site with the hook: the built page holds the JSON's value; without the JSON
    the strict build fails, naming the missing file."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(
        "# Figures\n\n<!-- benchmark: example -->\n", encoding="utf-8"
    )
    hook_path = ROOT / "docs" / "hooks" / "benchmark_results.py"
    (tmp_path / "mkdocs.yml").write_text(f"site_name: t\nhooks:\n  - {hook_path}\n", encoding="utf-8")
    path = _record(tmp_path / "benchmarks" / "results", monkeypatch)
    result = _build(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    page = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "1,234,567" in page and "bench_example.py" in page and "2 cores shared with other jobs" in page
    path.unlink()
    result = _build(tmp_path)
    assert result.returncode != 0 and "example.json is missing" in result.stdout + result.stderr
