"""`tightpack pack` and its output folder, through the command line (issue 11 §5, §6).

To add to tests/test_cli.py once pipeline.pack_dataset uses tightpack.offline.output_folder and cli.main
turns OSError into one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import write_jsonl
from .test_cli import error_line, run_cli


def pack(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tightpack.cli", "pack", *map(str, args), "--workers", "1"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def previous(tmp_path, prompt_completion_rows) -> Path:
    """A folder packed by an earlier run, its input inside it (``prev/train.jsonl``)."""
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows[:40])
    assert pack(source, "-o", "prev", "--pack-size", 128, cwd=tmp_path).returncode == 0
    (tmp_path / "prev" / "train.jsonl").write_bytes(source.read_bytes())
    return tmp_path / "prev"


def test_overwrite_never_deletes_the_input_or_other_files(tmp_path, previous):
    before = sorted(p.name for p in previous.iterdir())
    result = pack("prev/train.jsonl", "-o", "prev", "--pack-size", 256, "--overwrite", cwd=tmp_path)
    assert error_line(result) == (
        "error: output 'prev' is or holds the input 'prev/train.jsonl'; write the output to another folder"
    )
    result = pack("train.jsonl", "-o", "prev", "--pack-size", 256, "--overwrite", cwd=tmp_path)
    assert error_line(result) == (
        "error: refusing to overwrite 'prev': it holds files tightpack did not write (train.jsonl); move "
        "them out of the folder or choose another --output"
    )
    assert sorted(p.name for p in previous.iterdir()) == before
    (previous / "train.jsonl").unlink()
    assert pack("train.jsonl", "-o", "prev", "--pack-size", 256, "--overwrite", cwd=tmp_path).returncode == 0
    assert json.loads((previous / "manifest.json").read_text())["settings"]["packed_sequence_size"] == 256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev", "train.jsonl"], "nothing left beside it"


def test_the_current_directory_is_refused_before_any_work(tmp_path, previous):
    result = pack("../train.jsonl", "-o", ".", "--pack-size", 256, "--overwrite", cwd=previous)
    assert error_line(result).startswith(
        f"error: output '.' ({previous}) is the current directory or holds it;"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev", "train.jsonl"]


def test_an_unwritable_output_place_is_one_line_before_any_work(tmp_path, prompt_completion_rows):
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows[:40])
    if os.geteuid() == 0:  # root ignores permission bits; sysfs refuses new files even to root
        if not Path("/sys/kernel").is_dir():
            pytest.skip("running as root without sysfs: no folder refuses root's writes")
        place = Path("/sys")
    else:
        place = tmp_path / "ro"
        place.mkdir(mode=0o555)
    result = pack(source, "-o", place / "packed", "--pack-size", 128, cwd=tmp_path)
    assert error_line(result).startswith(f"error: cannot lock the output '{place / 'packed'}': {place}/")
    result = pack(
        source, "-o", "out", "--pack-size", 128, cwd=tmp_path, env={"TIGHTPACK_CACHE": str(place / "c")}
    )
    assert result.returncode == 0, result.stderr  # an unwritable cache only turns reuse off
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{place}/c" in warnings[0] and "reuse is off" in warnings[0]
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_a_second_run_on_the_same_output_fails_naming_the_first(tmp_path, prompt_completion_rows):
    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows * 300)
    command = [sys.executable, "-m", "tightpack.cli", "pack", source, "-o", "out", "--pack-size", "256",
               "--workers", "1", "--no-reuse"]  # fmt: skip
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".out.lock"
    deadline = time.monotonic() + 60
    while (
        not (lock.exists() and lock.read_text().strip())
        and first.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    second = pack(source, "-o", "out", "--pack-size", 256, "--overwrite", cwd=tmp_path)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert error_line(second) == (
        f"error: output 'out' is being written by another tightpack run (pid {first.pid}); wait for it to "
        "end or choose another --output"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "train.jsonl"]
    assert run_cli("verify", "out", cwd=tmp_path).returncode == 0
