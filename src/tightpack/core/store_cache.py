"""Finished token stores kept between runs, and clean-up of work folders left by killed runs.

A store is written under a ``.partial-*`` folder and renamed to its key only once complete, so a run
killed while tokenizing leaves nothing that looks finished. The key is a fingerprint of everything
that decides the tokens (inputs, tokenizer, sample format): repeating or resuming a ``pack`` with the
same ones reuses the store, and any change of them misses. The most recently used stores are kept.

Work folders (a store being written, the staging folder of ``tightpack pack``) are made by `claim`:
they appear with the pid file of their process, never without, so that `sweep_stale` can tell the
folders of killed runs from those of live ones.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

PID_FILE = ".pid"  # in a work folder: the pid of the process writing it
_CLAIMING = ".tightpack-claim-"  # + pid + "-" + random: a work folder before its pid file is written
_INFO_FILE = "info.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def claim(folder: Path) -> None:
    """Create a work folder owned by this process: it appears with its pid file, never without.

    The folder is made under a temporary name that carries the pid (``.tightpack-claim-PID-*``), given
    its pid file, then renamed into place. A process killed at any moment leaves either nothing, a
    temporary folder that `sweep_stale` removes once that pid is gone, or ``folder`` with its pid.
    """
    folder = Path(folder)
    if os.path.lexists(folder):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.parent / f"{_CLAIMING}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    temporary.mkdir()
    try:
        (temporary / PID_FILE).write_text(str(os.getpid()))
        temporary.rename(folder)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _claim_pid(name: str) -> int | None:
    """The pid in the name of a temporary claim folder, or None for any other name."""
    if not name.startswith(_CLAIMING):
        return None
    pid = name[len(_CLAIMING) :].partition("-")[0]
    return int(pid) if pid.isdigit() else None


def sweep_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove the ``prefix*`` folders in ``parent`` whose process is gone; returns what was removed.

    Temporary folders of `claim` in ``parent`` whose process is gone are removed too. A ``prefix*``
    folder without a readable pid file is left alone: its owner removes the pid file just before it
    renames the finished folder into place, and may be doing so right now.
    """
    removed = []
    for folder in sorted(Path(parent).iterdir()) if Path(parent).is_dir() else ():
        if folder.name.startswith(prefix):
            try:
                pid = int((folder / PID_FILE).read_text())
            except (OSError, ValueError):
                continue
        elif (pid := _claim_pid(folder.name)) is None:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class StoreCache:
    """Token stores by key under ``root``; at most ``keep`` of them, the most recently used."""

    def __init__(self, root: Path, keep: int = 4) -> None:
        self.root, self.keep = Path(root), keep

    def lookup(self, key: str) -> tuple[Path, dict[str, Any]] | None:
        """The finished store of ``key`` and the information saved with it, or None."""
        folder = self.root / key
        try:
            info = json.loads((folder / _INFO_FILE).read_text())
        except (OSError, ValueError):
            return None
        os.utime(folder)  # most recently used
        return folder, info

    def new_partial(self) -> Path:
        """A fresh work folder for a store being written."""
        sweep_stale(self.root, ".partial-")
        folder = self.root / f".partial-{uuid.uuid4().hex[:12]}"
        claim(folder)
        return folder

    def commit(self, partial: Path, key: str, info: dict[str, Any]) -> Path:
        """Publish a finished store under ``key`` (another run may have published it first)."""
        (partial / _INFO_FILE).write_text(json.dumps(info))
        (partial / PID_FILE).unlink()
        target = self.root / key
        try:
            partial.rename(target)
        except OSError:  # already there: a concurrent run of the same inputs finished first
            shutil.rmtree(partial, ignore_errors=True)
        self._prune(spare=target)
        return target

    def _prune(self, spare: Path) -> None:
        """Remove all but the ``keep`` most recently used stores (another run may prune at the same time)."""
        used = []
        for folder in self.root.iterdir():
            with contextlib.suppress(OSError):
                if not folder.name.startswith(".") and (folder / _INFO_FILE).exists():
                    used.append((folder.stat().st_mtime, folder))
        used.sort(reverse=True)
        for _, folder in used[self.keep :]:
            if folder != spare:
                shutil.rmtree(folder, ignore_errors=True)
