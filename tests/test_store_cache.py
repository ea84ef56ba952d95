"""The cache of finished token stores and the sweep of work folders left by killed runs."""

from __future__ import annotations

import os
import subprocess
import sys

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
    (tmp_path / ".out.partial-unmarked").mkdir()  # no pid yet: may be being created
    removed = sweep_stale(tmp_path, ".out.partial-")
    assert [p.name for p in removed] == [".out.partial-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial-mine", ".out.partial-unmarked"]
