"""The cache of finished token stores and the sweep of work folders left by killed runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tightpack.core.store_cache import StoreCache, claim, sweep_stale


def test_commit_lookup_and_keep_the_most_recent(tmp_path):
    cache = StoreCache(tmp_path, keep=2)
    for key in ("a", "b", "c"):
        partial = cache.new_partial()
        (partial / "tokens.bin").write_bytes(key.encode())
        cache.commit(partial, key, {"rows_read": len(key)})
        os.utime(tmp_path / key, (0, {"a": 1, "b": 3, "c": 2}[key]))  # b used last, then c, then a
    assert cache.lookup("zzz") is None
    cache.commit(cache.new_partial(), "d", {"rows_read": 4})  # prunes to the two most recent (d, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "d"]
    folder, info = cache.lookup("b")
    assert (folder / "tokens.bin").read_bytes() == b"b" and info == {"rows_read": 1}


def test_sweep_removes_only_folders_of_dead_processes(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / ".out.partial-dead").mkdir()
    (tmp_path / ".out.partial-dead" / ".pid").write_text(dead.stdout.strip())
    claim(tmp_path / ".out.partial-mine")  # this process: alive
    (tmp_path / ".out.partial-unmarked").mkdir()  # pid removed: its owner may be publishing it now
    removed = sweep_stale(tmp_path, ".out.partial-")
    assert [p.name for p in removed] == [".out.partial-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial-mine", ".out.partial-unmarked"]


CLAIM_LOOP = """
import sys
from pathlib import Path
from tightpack.core.store_cache import claim
parent = Path(sys.argv[1])
print("ready", flush=True)
for number in range(3000):
    claim(parent / f".out.partial-{number:05d}")
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("delay", [0.005, 0.02, 0.05, 0.1])
def test_a_claim_killed_at_any_moment_leaves_nothing_the_sweep_must_spare(tmp_path, delay):
    """A work folder appears with its pid file: a SIGKILL between creating the folder and writing the
    pid would leave a folder that `sweep_stale` spares for ever (it may be being published)."""
    run = subprocess.Popen(
        [sys.executable, "-c", CLAIM_LOOP, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert run.stdout.readline() == "ready\n"
    time.sleep(delay)
    run.send_signal(signal.SIGKILL)
    run.wait()
    run.stdout.close()
    claimed = sorted(tmp_path.glob(".out.partial-*"))
    assert [folder.name for folder in claimed if not (folder / ".pid").is_file()] == []
    sweep_stale(tmp_path, ".out.partial-")
    assert sorted(tmp_path.iterdir()) == [], f"{len(claimed)} claimed; the sweep leaves nothing"


def test_claim_refuses_an_existing_folder_and_sweeps_only_dead_claims(tmp_path):
    claim(tmp_path / ".out.partial-a")
    with pytest.raises(FileExistsError, match=r"File exists: '.*\.out\.partial-a'"):
        claim(tmp_path / ".out.partial-a")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / f".tightpack-claim-{dead.stdout.strip()}-0123").mkdir()  # killed inside claim
    (tmp_path / f".tightpack-claim-{os.getpid()}-4567").mkdir()  # this process, claiming right now
    removed = sweep_stale(tmp_path, ".out.partial-")
    assert [p.name for p in removed] == [f".tightpack-claim-{dead.stdout.strip()}-0123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".out.partial-a",
        f".tightpack-claim-{os.getpid()}-4567",
    ]
