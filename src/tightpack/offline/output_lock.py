"""One packing run per output folder: `output_lock`, the first step of a run
(`tightpack.offline.output_folder` says the others).

The lock is an ``flock`` on ``.NAME.lock`` next to the output. A second run fails at once and names
the first one's pid. The lock dies with its process (SIGKILL included), so a killed run never leaves
it held, and the file is removed when the run ends. Where there is no ``flock`` (Windows) runs are
not serialized.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tightpack.errors import TightpackError
from tightpack.offline.output_folder import os_error_message, resolved_output

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not serialized there
    fcntl = None

# Lock descriptors held by this process. A forked child (tokenization workers) closes its copies at
# once: an flock belongs to the open file, so a worker outliving a killed run would keep it held.
_HELD_LOCKS: set[int] = set()
_fork_hook_registered = False


@contextlib.contextmanager
def output_lock(output: str | os.PathLike) -> Iterator[Path]:
    """Hold the output folder for this run; yields the folder as `check_publishable` returns it.

    Creates the folder that holds the output if it is missing (the lock file lives there). Raises
    `TightpackError` naming the holder's pid when another run holds the folder, or naming the path and
    the cause when the lock file cannot be created.
    """
    target = resolved_output(output)
    lock = target.parent / f".{target.name}.lock"
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where the folder should be
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(target.parent)) from None
        descriptor = _acquire(lock, output) if fcntl is not None else None
    except OSError as error:
        raise TightpackError(
            f"cannot lock the output {str(output)!r}: {os_error_message(error, lock)}; the folder that "
            "holds the output must be writable"
        ) from error
    try:
        yield target
    finally:
        if descriptor is not None:
            _HELD_LOCKS.discard(descriptor)
            with contextlib.suppress(OSError):
                lock.unlink()  # before the lock is released: see _acquire
            os.close(descriptor)


def _acquire(lock: Path, output: str | os.PathLike) -> int:
    """An flock on ``lock`` (non-blocking) with this process's pid written in it; its descriptor."""
    while True:
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            raise TightpackError(
                f"output {str(output)!r} is being written by another tightpack run ({holder}); wait for "
                "it to end or choose another output",
                parameters=("another output",),
            ) from None
        except BaseException:
            os.close(descriptor)
            raise
        # The last holder removes the file before it unlocks: a lock won on a removed file holds
        # nothing, so take the file that is at the path now.
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(descriptor)):
            break
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    _HELD_LOCKS.add(descriptor)
    global _fork_hook_registered
    if not _fork_hook_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_held_locks)
        _fork_hook_registered = True
    return descriptor


def _holder(descriptor: int) -> str:
    """``pid N`` of the process holding the lock (it writes its pid right after locking)."""
    for _ in range(50):
        text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return f"pid {text}"
        time.sleep(0.01)
    return "pid unknown"


def _close_held_locks() -> None:
    for descriptor in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD_LOCKS.clear()
