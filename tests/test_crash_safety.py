"""`tightpack pack` killed with SIGKILL at several moments never leaves a half dataset behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tightpack.verify import verify_packed

from .conftest import write_jsonl


def pack_command(source: Path, output: Path, pack_size: int) -> list[str]:
    return [sys.executable, "-m", "tightpack.cli", "pack", str(source), "-o", str(output),
            "--pack-size", str(pack_size), "--workers", "1", "--overwrite"]  # fmt: skip


def fingerprint(output: Path) -> str:
    return json.loads((output / "manifest.json").read_text())["fingerprint"]


def wait_for(pattern_parent: Path, pattern: str, run: subprocess.Popen, timeout: float = 30.0) -> None:
    """Wait until the run has created its work folder (or has ended)."""
    deadline = time.monotonic() + timeout
    while not list(pattern_parent.glob(pattern)) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_at_any_moment_leaves_the_previous_output_or_nothing(tmp_path, chat_rows):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows * 200)
    output = tmp_path / "out"
    warm = {**os.environ, "TIGHTPACK_CACHE": str(tmp_path / "cache")}
    subprocess.run(pack_command(source, output, 1024), env=warm, check=True, capture_output=True)
    previous = fingerprint(output)

    outcomes = []
    # Kills measured from the moment the run creates its work folder. With a cold cache the run is
    # tokenizing then; with the warm one (the store of the first run) it is planning and writing.
    kills = [("cold", delay) for delay in (0.0, 0.3, 0.8)] + [
        ("warm", d) for d in (0.0, 0.03, 0.08, 0.15, 0.3)
    ]
    for number, (cache, delay) in enumerate(kills):
        env = warm if cache == "warm" else {**os.environ, "TIGHTPACK_CACHE": str(tmp_path / f"cold{number}")}
        pack_size = 256 + 16 * number  # every run its own settings, so a finished run is recognisable
        run = subprocess.Popen(pack_command(source, output, pack_size), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
        wait_for(tmp_path, ".out.partial-*", run)
        time.sleep(delay)
        run.send_signal(signal.SIGKILL)
        run.wait()
        if output.exists():
            report = verify_packed(output)
            assert report.ok, [str(v) for v in report.violations]
            manifest = json.loads((output / "manifest.json").read_text())
            if manifest["fingerprint"] == previous:
                outcomes.append("previous")
            else:  # the run finished before the kill: its own output, complete
                assert manifest["settings"]["packed_sequence_size"] == pack_size
                outcomes.append("new")
            previous = manifest["fingerprint"]
        else:
            outcomes.append("nothing")  # killed between moving the old output away and the new one in
        for work in tmp_path.glob(".out.partial-*"):  # what a kill leaves is never taken for a dataset
            assert [v.check for v in verify_packed(work).violations] == ["complete"]
            outcomes.append("work folder left")

    result = subprocess.run(pack_command(source, output, 512), env=warm, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert verify_packed(output).ok
    assert not list(tmp_path.glob(".out.partial-*")), "work folders of killed runs are swept"
    assert not list((tmp_path / "cache" / "stores").glob(".partial-*"))
    assert outcomes.count("previous") >= 4 and "work folder left" in outcomes, outcomes
