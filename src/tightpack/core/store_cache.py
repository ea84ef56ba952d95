"""Finished token stores kept between runs, and clean-up of work folders left by killed runs.

A store is written under a ``.partial-*`` folder and renamed to its key only once complete, so a run
killed while tokenizing leaves nothing that looks finished. The key is a fingerprint of everything
that decides the tokens (inputs, tokenizer, sample format): repeating or resuming a ``pack`` with the
same ones reuses the store, and any change of them misses. The most recently used stores are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

__all__ = ["StoreCache", "claim", "sweep_stale"]

_PID_FILE = ".pid"
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
    """Create a work folder owned by this process (its pid marks it as in use)."""
    folder.mkdir(parents=True)
    (folder / _PID_FILE).write_text(str(os.getpid()))


def sweep_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove the ``prefix*`` folders in ``parent`` whose process is gone; returns what was removed.

    A folder without a readable pid file is left alone: it may be being created right now.
    """
    removed = []
    for folder in parent.glob(f"{prefix}*") if parent.is_dir() else ():
        try:
            pid = int((folder / _PID_FILE).read_text())
        except (OSError, ValueError):
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
        (partial / _PID_FILE).unlink()
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
