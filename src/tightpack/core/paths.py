"""Resolution of packed Parquet specs: one file, a glob, or a directory, to a sorted list of shard paths.

Behaviour follows Megatron-Bridge's ``data/packing/paths.py`` (docs/contract.md §2.7, "Spec resolution"),
so that a spec names the same shards here as in the training job that reads them:

* a single file must end in ``.parquet`` or ``.pq``, in any case;
* a glob (``glob.has_magic``) is expanded and filtered to those extensions;
* a directory contributes its ``*.parquet`` and ``*.pq`` entries (not recursive; matched by ``glob``,
  so case-sensitive where the file system is, as in the reference), de-duplicated;
* results are sorted lexicographically;
* an existing path whose name contains ``[`` but no ``*`` or ``?`` is taken literally
  (``shard_[01].idx.parquet``); otherwise ``[01]`` is a character class. The reference does this for
  Parquet files only; here an existing directory such as ``run[1]/`` is taken literally too.

Two deliberate differences from the reference: a path without a Parquet extension raises instead of
resolving to ``[]``, so every branch either returns files or raises; and only regular files are returned,
so a directory that happens to be called ``x.parquet`` is never handed to a Parquet reader as a shard.

Reading and writing the shards lives elsewhere; this module only touches the file system to list names.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from tightpack.errors import TightpackError


def default_cache_dir() -> Path:
    """``$TIGHTPACK_CACHE``, else ``$XDG_CACHE_HOME/tightpack`` (default ``~/.cache/tightpack``)."""
    if os.environ.get("TIGHTPACK_CACHE"):
        return Path(os.environ["TIGHTPACK_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tightpack"


_PARQUET_SUFFIXES = (".parquet", ".pq")


def _spec_text(spec: str | os.PathLike) -> str:
    """The spec as a ``str``; bytes paths and other types are refused."""
    text = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    if not isinstance(text, str):
        raise TightpackError(
            f"A packed Parquet spec must be a str or os.PathLike path, got {type(spec).__name__}: {spec!r}"
        )
    return text


def _has_parquet_suffix(path: str) -> bool:
    return path.lower().endswith(_PARQUET_SUFFIXES)


def resolve_parquet_spec(spec: str | os.PathLike) -> list[str]:
    """Resolve a packed Parquet spec (file, glob or directory) to its shard files, sorted.

    Paths are returned as the file system spelled them from ``spec`` (not made absolute).

    Args:
        spec: ``data/train.idx.parquet``, ``data/shard_*.parquet``, ``data/shard_[01].pq`` or ``data/``.

    Returns:
        The matching Parquet files, sorted lexicographically; never empty.

    Raises:
        TightpackError: when a glob or directory matches no Parquet file, when a ``.parquet``/``.pq``
            file does not exist, or when a path that is not a directory lacks a Parquet extension.

    Example (``tmp`` holds ``b.parquet``, ``a.PQ`` and ``notes.txt``)::

        resolve_parquet_spec(f"{tmp}/*")         # [f"{tmp}/a.PQ", f"{tmp}/b.parquet"]
        resolve_parquet_spec(tmp)                # [f"{tmp}/b.parquet"]  (on a case-sensitive file system)
        resolve_parquet_spec(f"{tmp}/notes.txt") # TightpackError: ... end in .parquet or .pq
    """
    text = _spec_text(spec)

    # Real names may contain brackets (`shard_[01].idx.parquet`, a directory `run[1]`): without `*`
    # or `?`, an existing path is taken literally rather than as a character class.
    literal = "*" not in text and "?" not in text and os.path.exists(text)
    if glob.has_magic(text) and not literal:
        matches = sorted(p for p in glob.glob(text) if _has_parquet_suffix(p) and os.path.isfile(p))
        if not matches:
            raise TightpackError(
                f"No Parquet files found matching pattern: {text}. Packed Parquet files end in .parquet "
                "or .pq; check the pattern and the directory it points into"
            )
        return matches

    if os.path.isdir(text):
        # Escape the directory so brackets in its own name are not read as a character class.
        base = glob.escape(text)
        found = {
            p
            for pattern in ("*.parquet", "*.pq")
            for p in glob.glob(os.path.join(base, pattern))
            if os.path.isfile(p)
        }
        if not found:
            raise TightpackError(
                f"No Parquet files found in directory: {text}. Packed Parquet shards must sit directly in "
                "it (not in subdirectories) and end in .parquet or .pq"
            )
        return sorted(found)

    if _has_parquet_suffix(text):
        if not os.path.exists(text):
            raise TightpackError(
                f"Packed Parquet file not found: {text}. Check the path or write the file first"
            )
        return [text]

    if os.path.exists(text):
        raise TightpackError(
            f"Not a packed Parquet spec: {text} is a file without a Parquet extension; packed Parquet files "
            "end in .parquet or .pq (any case). Rename it, or pass a directory or a glob"
        )
    raise TightpackError(
        f"Packed Parquet spec not found: {text} is neither an existing directory nor a file ending in "
        ".parquet or .pq. Pass a .parquet/.pq file, a directory of shards, or a glob"
    )


def is_packed_parquet_spec(spec: str | os.PathLike) -> bool:
    """Whether ``spec`` names packed Parquet data, for routing between the Parquet and ``.npy`` readers.

    True when any of these holds (docs/contract.md §2.7): it ends in ``.parquet``/``.pq`` (any case, existing
    or not); it has glob magic and contains ``.parquet`` or ``.pq``; it resolves to at least one file; or it
    is an existing directory (even one without shards, so that resolving it reports the problem).

    >>> is_packed_parquet_spec("out/train.idx.PARQUET"), is_packed_parquet_spec("out/shard_*.pq")
    (True, True)
    >>> is_packed_parquet_spec("out/train.npy")
    False
    """
    text = _spec_text(spec)
    lowered = text.lower()
    if lowered.endswith(_PARQUET_SUFFIXES):
        return True
    if glob.has_magic(text) and (".parquet" in lowered or ".pq" in lowered):
        return True
    try:
        resolve_parquet_spec(text)
    except TightpackError:
        pass
    else:
        return True
    return os.path.isdir(text)


def packed_dataset_files(path: str | os.PathLike) -> list[str]:
    """The files of a packed dataset: a legacy ``.npy`` file, a folder of ``.npy`` files (when it has no
    Parquet), or a Parquet spec (`resolve_parquet_spec`)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".npy":
        return [str(path)]
    if path.is_dir() and not any(path.glob("*.parquet")) and not any(path.glob("*.pq")):
        npy = sorted(str(p) for p in path.glob("*.npy"))
        if npy:
            return npy
    return resolve_parquet_spec(path)
