"""The output folder of ``tightpack pack``: one run at a time, checked before any work, replaced safely.

The output folder belongs to the user. A run, in this order:

1. `tightpack.offline.output_lock.output_lock`: one run per output folder. A second run fails at
   once and names the first one's pid.
2. `sweep_work`: what killed runs left next to the output. Their work folders (``.NAME.partial-*``)
   are removed; a previous output that a run killed while publishing had set aside (``.NAME.old-*``,
   see `publish`) is put back in place.
3. `check_publishable`, before any tokenizing: the result can be published at all (writable place,
   not the current directory, not a mount point, no input or cache inside) and, when the output
   exists, ``--overwrite`` was given and the folder holds nothing but what tightpack wrote.
4. Work in a folder next to the output (`tightpack.core.store_cache.claim`), then `publish`.

Overwrite policy: only what tightpack wrote is replaced (the files listed in the old ``manifest.json``,
``metadata.json`` and the manifest itself). An output folder that holds anything else is refused,
naming what it holds. Carrying the other files over was the alternative; it was left out because it
is not safe under a crash: moved into the new output before the swap, they would sit in a hidden work
folder that the next run's sweep deletes; moved after the swap, a crash leaves them in a hidden folder
instead of where the user put them; replacing tightpack's files one by one inside the folder would
leave a mix of two datasets. Refusing keeps the swap whole and never moves or deletes a user's file.

`os_error_message` turns an operating-system error (read-only folder, full disk, refused rename) into
the one line the command line prints. The work folders themselves (pid files, the sweep of dead
processes' folders) live in `tightpack.core.store_cache`; the run itself in `tightpack.offline.pipeline`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

from tightpack.core.pack_manifest import MANIFEST_NAME, METADATA_NAME
from tightpack.core.store_cache import PID_FILE, sweep_stale
from tightpack.errors import TightpackError

MANIFEST_FAMILY = "tightpack.packed/"  # any version of it marks a folder tightpack may replace
MANIFEST_FORMAT = MANIFEST_FAMILY + "1"
_SHOWN_NAMES = 5  # foreign files named in a refusal


def os_error_message(error: OSError, path: str | os.PathLike | None = None) -> str:
    """One line naming the path and the cause of an operating-system error.

    ``path`` names the file when the error does not (a failed write reports no file name).

    >>> os_error_message(PermissionError(13, "Permission denied", "/data/out"))
    '/data/out: Permission denied'
    >>> os_error_message(OSError(18, "Invalid cross-device link", "a", None, "b"))
    'a -> b: Invalid cross-device link'
    >>> os_error_message(OSError(28, "No space left on device"), "out/packs-00000.idx.parquet")
    'out/packs-00000.idx.parquet: No space left on device'
    """
    cause = error.strerror or " ".join(str(error).split()) or type(error).__name__
    where = error.filename if error.filename is not None else path
    if where is None:
        return cause
    shown = os.fsdecode(where) if isinstance(where, (str, bytes, os.PathLike)) else str(where)
    if error.filename2 is not None:
        shown += f" -> {os.fsdecode(error.filename2)}"
    return f"{shown}: {cause}"


def resolved_output(output: str | os.PathLike) -> Path:
    """The output folder as the file system will see it: absolute, links resolved."""
    target = Path(output).resolve()
    if not target.name:
        raise TightpackError(f"output {str(output)!r} is the root folder; choose a folder below it")
    return target


def _work_name(target: Path, kind: str) -> Path:
    """``.NAME.<kind>-<random>`` next to the output."""
    return target.parent / f".{target.name}.{kind}-{uuid.uuid4().hex[:12]}"


def sweep_work(output: str | os.PathLike) -> list[Path]:
    """Clear what killed runs left next to the output; call it while holding the output's lock
    (`tightpack.offline.output_lock.output_lock`).

    Removes every ``.NAME.partial-*`` work folder (under the lock no other run is writing one) and
    the temporary folders of `claim` whose process is gone. A ``.NAME.old-*`` folder is a previous
    output that `publish` set aside: when the output is missing (the run was killed between its two
    renames) the newest one is put back; otherwise its tightpack files are removed, and the folder with
    them unless something else is in it. Returns the folders removed.
    """
    target = resolved_output(output)
    if not target.parent.is_dir():
        return []
    partial, old = f".{target.name}.partial-", f".{target.name}.old-"
    removed = sweep_stale(target.parent, partial)
    for folder in sorted(target.parent.iterdir()):
        if folder.name.startswith(partial) and folder not in removed:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    set_aside = sorted(
        (folder for folder in target.parent.iterdir() if folder.name.startswith(old)),
        key=lambda folder: folder.stat().st_mtime,
    )
    if set_aside and not os.path.lexists(target):
        set_aside.pop().rename(target)
    for folder in set_aside:
        try:
            listed = _listed_files(folder) or set()
        except (OSError, ValueError, KeyError, TypeError):
            listed = set()  # not ours to judge: left as it is
        if _discard(folder, _manifest_last(listed)):
            removed.append(folder)
    return removed


def check_publishable(
    output: str | os.PathLike,
    overwrite: bool,
    inputs: Iterable[str | os.PathLike],
    *,
    cache: str | os.PathLike | None = None,
) -> Path:
    """Check, before any work, that a run can publish ``output``; returns it absolute, links resolved.

    Raises `TightpackError` with the path and the fix when the output folder:

    - is or holds one of ``inputs`` or the token ``cache``;
    - is the current directory or one of its parents (an output is replaced by renaming its folder);
    - exists and ``overwrite`` is false; exists and is not a folder, or is a mount point;
    - exists and is not a tightpack output folder (no or an unreadable ``manifest.json``) or holds
      anything besides what tightpack wrote (the files of its manifest, ``metadata.json``, itself);
    - cannot be created or replaced: the folder that holds it (or the nearest existing folder above)
      must let this process create files (checked with a probe file, as root ignores permission bits).
    """
    target = resolved_output(output)
    shown = repr(str(output))
    for path in inputs:
        if _holds(target, Path(output), Path(path)):
            raise TightpackError(
                f"output {shown} is or holds the input {str(path)!r}; write the output to another folder"
            )
    if cache is not None and _holds(target, Path(output), Path(cache)):
        raise TightpackError(
            f"output {shown} is or holds tightpack's cache {str(cache)!r}; write the output to another "
            "folder (or move the cache with $TIGHTPACK_CACHE)"
        )
    if os.path.lexists(target):
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            raise TightpackError(
                f"output {shown} ({target}) is the current directory or holds it; an output folder is "
                f"replaced as a whole, so write to a folder inside it, such as {str(target / 'packed')!r}"
            )
        if not overwrite:
            raise TightpackError(
                f"output {shown} already exists; pass overwrite=True to replace it",
                parameters=("overwrite=True",),
            )
        if not target.is_dir():
            raise TightpackError(
                f"refusing to overwrite {shown}: it is not a folder, so not a tightpack output"
            )
        if os.path.ismount(target):
            raise TightpackError(
                f"refusing to overwrite {shown}: it is a mount point, which cannot be replaced; write to "
                "a folder inside it"
            )
        _owned_files(target, output)
    _check_writable(target, output)
    return target


def _holds(target: Path, given: Path, path: Path) -> bool:
    """Whether the output folder is ``path`` or one of its parents, with or without links resolved."""
    folders = {target, Path(os.path.abspath(given))}
    paths = {path.resolve(), Path(os.path.abspath(path))}
    return any(folder == p or folder in p.parents for folder in folders for p in paths)


def _check_writable(target: Path, output: str | os.PathLike) -> None:
    """Refuse an output whose folder cannot be created, renamed into place, or replaced."""
    shown = repr(str(output))
    place = target.parent
    while not os.path.lexists(place) and place != place.parent:
        place = place.parent  # created by the run
    probe = place / f".{target.name}.probe-{uuid.uuid4().hex[:12]}"
    try:
        if not place.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(place))
        if not os.access(place, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(place))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
        if os.path.lexists(target):
            _check_replaceable(target, place)
    except OSError as error:
        raise TightpackError(
            f"cannot write the output {shown}: {os_error_message(error)}; it is written next to its final "
            "place and renamed into it, so choose an output in a folder you can write to",
            parameters=("an output",),
        ) from error


def _check_replaceable(target: Path, place: Path) -> None:
    """The old output can be renamed away (sticky parent) and emptied of its files (its own mode)."""
    euid = os.geteuid() if hasattr(os, "geteuid") else None
    if euid not in (None, 0):
        held, parent = os.lstat(target), os.stat(place)
        if parent.st_mode & stat.S_ISVTX and euid not in (held.st_uid, parent.st_uid):
            raise PermissionError(errno.EPERM, "owned by another user in a sticky folder", str(target))
    if not os.access(target, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


def _owned_files(folder: Path, output: str | os.PathLike) -> list[str]:
    """The entries of a tightpack output folder, the manifest last; refuses any other folder.

    An empty folder has none. Otherwise the manifest must be a tightpack one, and every entry must be
    a file it lists (its ``files``, its metadata file) or the manifest itself.
    """
    entries = {entry.name: entry for entry in os.scandir(folder)}
    if not entries:
        return []
    refusal = f"refusing to overwrite {str(output)!r}: it is not a tightpack output folder"
    if MANIFEST_NAME not in entries:
        raise TightpackError(f"{refusal} (no {MANIFEST_NAME})")
    try:
        listed = _listed_files(folder)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise TightpackError(f"{refusal} (unreadable {MANIFEST_NAME}: {error})") from error
    if listed is None:
        raise TightpackError(f"{refusal} ({MANIFEST_NAME} is not a tightpack manifest)")
    owned = {name for name in listed if name in entries and _is_file(entries[name])}
    foreign = sorted(set(entries) - owned)
    if foreign:
        named = ", ".join(foreign[:_SHOWN_NAMES])
        if len(foreign) > _SHOWN_NAMES:
            named += f" and {len(foreign) - _SHOWN_NAMES} more"
        raise TightpackError(
            f"refusing to overwrite {str(output)!r}: it holds files tightpack did not write ({named}); "
            "move them out of the folder or choose another output",
            parameters=("another output",),
        )
    return _manifest_last(owned)


def _manifest_last(names: set[str]) -> list[str]:
    """Removal order: a folder keeps describing itself until its last file goes."""
    return [*sorted(names - {MANIFEST_NAME}), *sorted(names & {MANIFEST_NAME})]


def _listed_files(folder: Path) -> set[str] | None:
    """What the folder's manifest says tightpack wrote (with the manifest); None for another manifest.

    Raises what reading and parsing raise for a missing or malformed manifest.
    """
    manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    names = [*(item["name"] for item in manifest["files"]), manifest.get("metadata_file", METADATA_NAME)]
    if not str(manifest["format"]).startswith(MANIFEST_FAMILY) or not all(map(_plain_name, names)):
        return None
    return {*names, MANIFEST_NAME}


def _is_file(entry: os.DirEntry) -> bool:
    """A file or a link (removing a link leaves its target alone); a folder is never ours to remove."""
    return entry.is_symlink() or entry.is_file(follow_symlinks=False)


def _discard(folder: Path, owned: list[str]) -> bool:
    """Remove a set-aside output: its tightpack files (the manifest last), then the folder if empty."""
    for name in owned:
        with contextlib.suppress(OSError):  # gone already, or not a file: then the folder stays
            (folder / name).unlink()
    try:
        folder.rmdir()
    except OSError:  # something else appeared in it: never removed
        return False
    return True


def publish(staging: str | os.PathLike, output: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Move the finished work folder into place, replacing a previous output whole.

    ``staging`` is a work folder of `tightpack.core.store_cache.claim` next to the output; its pid
    file is removed here, just before the move. A previous output is checked again (it must still
    hold only tightpack's files) and replaced:

    - on Linux, in one step (``renameat2`` with ``RENAME_EXCHANGE``): at every moment the output path
      holds the previous dataset or the new one;
    - where the file system cannot swap, in two renames: the previous output to ``.NAME.old-*``, then
      the work folder to the output. A run killed between them leaves no output; the next run's
      `sweep_work` puts the previous one back.

    The previous output's files are then removed. A file put into it in the instant between the check
    and the swap is never deleted: its folder stays as ``.NAME.old-*``.
    """
    staging, target = Path(staging), resolved_output(output)
    if not os.path.lexists(target):
        (staging / PID_FILE).unlink(missing_ok=True)
        os.rename(staging, target)
        return
    if not overwrite:
        raise TightpackError(
            f"output {str(output)!r} already exists; pass overwrite=True to replace it",
            parameters=("overwrite=True",),
        )
    owned = _owned_files(target, output)
    (staging / PID_FILE).unlink(missing_ok=True)
    if _exchange(staging, target):
        if not _discard(staging, owned):
            os.rename(staging, _work_name(target, "old"))
        return
    retired = _work_name(target, "old")
    os.rename(target, retired)
    os.rename(staging, target)
    _discard(retired, owned)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically; False where the system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. NFS, old kernels
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))
