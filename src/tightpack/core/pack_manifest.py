"""What packed data says of itself: the manifest and metadata files next to the shards, and the settings
(pad id, alignment multiple, pack size, vocabulary) they record, each with the file and key it came from.

A tightpack output folder holds ``manifest.json`` (settings, tokenizer identity, counts) and the
reference's ``metadata.json``; a Megatron-Bridge folder holds only ``<P>_metadata.jsonl`` (docs/contract.md
§2.6), which records the pack size and nothing about ids or alignment. `read_pack_settings`
reads what there is; the runtime (`tightpack.runtime.pack_settings`) compares it with what a training
script passes. JSON only: no rows are read here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tightpack.errors import TightpackError

# The two files of an output folder besides its shards: tightpack's manifest and the reference's metadata.
MANIFEST_NAME = "manifest.json"
METADATA_NAME = "metadata.json"
_MANIFEST_KEYS = ("settings", "tokenizer", "counts", "sources")


def read_manifest(path: Path) -> dict[str, Any]:
    """A tightpack manifest, checked enough to be used: JSON, an object, with its main sections."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TightpackError(f"{path}: not a readable manifest ({error})") from error
    missing = [key for key in _MANIFEST_KEYS if not isinstance(manifest, dict) or key not in manifest]
    if missing:
        raise TightpackError(f"{path}: the manifest lacks {', '.join(missing)}; pack the dataset again")
    if not isinstance(manifest["settings"], dict) or "packed_sequence_size" not in manifest["settings"]:
        raise TightpackError(
            f"{path}: the manifest's settings lack packed_sequence_size; pack the dataset again"
        )
    return manifest


def read_metadata(path: Path) -> list[dict]:
    """The packing metadata of the reference (docs/contract.md §2.6): a JSON list of objects, one per split.

    A single object is read as a list of one. Raises `TightpackError` naming the file when it cannot
    be read or is not that.
    """
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TightpackError(f"{path}: not readable packing metadata ({error})") from error
    entries = loaded if isinstance(loaded, list) else [loaded]
    if not all(isinstance(entry, dict) for entry in entries):
        raise TightpackError(f"{path}: packing metadata must be a JSON list of objects")
    return entries


def metadata_near(folder: Path) -> Path | None:
    """tightpack's ``metadata.json``, else Megatron-Bridge's ``<P>_metadata.jsonl``, in ``folder``."""
    folder = Path(folder)
    if (folder / METADATA_NAME).is_file():
        return folder / METADATA_NAME
    found = sorted(folder.glob("*_metadata.jsonl"))
    return found[0] if found else None


@dataclass(frozen=True)
class PackedData:
    """Where the packs of a packed data path are (`locate_packed`).

    Attributes:
        files: the shard files, sorted (`tightpack.core.paths.packed_dataset_files`).
        folder: the folder the path names, else the one its first file sits in.
        manifest: that folder's ``manifest.json``; None when it has none (Megatron-Bridge's packs).
    """

    files: list[str]
    folder: Path
    manifest: Path | None


def locate_packed(path: str | os.PathLike) -> PackedData:
    """The files of a packed folder, Parquet file or glob and the manifest that describes them, as
    ``tightpack validate`` reads a configuration's packed paths and ``tightpack blend`` its folders.

    Raises:
        TightpackError: the path names no packed data (the message says why).
    """
    from tightpack.core.paths import packed_dataset_files

    files = packed_dataset_files(path)
    folder = Path(path) if Path(path).is_dir() else Path(files[0]).parent
    manifest = folder / MANIFEST_NAME
    return PackedData(files, folder, manifest if manifest.is_file() else None)


@dataclass(frozen=True)
class Recorded:
    """One value the packs record, and where: ``Recorded(2, "tokenizer.eos_id of packs/manifest.json")``."""

    value: int
    source: str

    def __str__(self) -> str:
        return f"{self.value} ({self.source})"


@dataclass(frozen=True)
class PackSettings:
    """The settings packed files record (None: not recorded, as in Megatron-Bridge's folders).

    Attributes:
        folders: the folders the shards are in.
        manifest: the manifest read, or None.
        eos_id: the EOS id, which is also the id of alignment padding (manifest ``tokenizer.eos_id``).
        pad_seq_to_mult: the alignment multiple m (manifest ``settings.pad_seq_to_mult``).
        pack_size: P (manifest ``settings.packed_sequence_size``, else metadata ``pack_size``).
        vocab_size: tokens of the packing tokenizer (manifest ``tokenizer.vocab_size``).
        tokenizer: the packing tokenizer's name (manifest ``tokenizer.name``).
    """

    folders: tuple[str, ...]
    manifest: str | None = None
    eos_id: Recorded | None = None
    pad_seq_to_mult: Recorded | None = None
    pack_size: Recorded | None = None
    vocab_size: Recorded | None = None
    tokenizer: str | None = None

    @property
    def where(self) -> str:
        """The folder(s), for messages."""
        return ", ".join(self.folders)


_FROM_MANIFEST = (
    ("eos_id", ("tokenizer", "eos_id")),
    ("pad_seq_to_mult", ("settings", "pad_seq_to_mult")),
    ("pack_size", ("settings", "packed_sequence_size")),
    ("vocab_size", ("tokenizer", "vocab_size")),
)


def _one_folder(folder: Path) -> PackSettings:
    values: dict[str, Any] = {}
    manifest_path = folder / MANIFEST_NAME
    if manifest_path.is_file():
        manifest = read_manifest(manifest_path)
        for name, (section, key) in _FROM_MANIFEST:
            value = manifest.get(section, {}).get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                values[name] = Recorded(value, f"{section}.{key} of {manifest_path}")
        values["tokenizer"] = manifest.get("tokenizer", {}).get("name")
        values["manifest"] = str(manifest_path)
    if "pack_size" not in values and (metadata := metadata_near(folder)) is not None:
        sizes = [entry.get("pack_size") for entry in read_metadata(metadata)]
        sizes = [size for size in sizes if isinstance(size, int) and not isinstance(size, bool)]
        if sizes:
            values["pack_size"] = Recorded(max(sizes), f"pack_size of {metadata}")
    return PackSettings(folders=(str(folder),), **values)


def read_pack_settings(files: Sequence[str | os.PathLike]) -> PackSettings:
    """The settings recorded next to ``files`` (the shards of one dataset).

    Shards in several folders must record the same values.

    Raises:
        TightpackError: a manifest or metadata file that cannot be read, or folders that disagree.

    Example (a tightpack output folder packed with ``--pad-seq-to-mult 4`` and a Llama tokenizer)::

        settings = read_pack_settings(["packs/packs-00000.idx.parquet"])
        settings.eos_id.value, settings.pad_seq_to_mult.value  # 2, 4
        str(settings.eos_id)  # "2 (tokenizer.eos_id of packs/manifest.json)"
    """
    folders = list(dict.fromkeys(Path(file).parent for file in files))
    if not folders:
        raise TightpackError("no packed files to read settings from")
    settings = [_one_folder(folder) for folder in folders]
    first = settings[0]
    for other in settings[1:]:
        for name in ("eos_id", "pad_seq_to_mult", "pack_size", "vocab_size"):
            mine, theirs = getattr(first, name), getattr(other, name)
            if mine is not None and theirs is not None and mine.value != theirs.value:
                raise TightpackError(
                    f"the packed files disagree on {name}: {mine} against {theirs}; read one set of "
                    "packs at a time"
                )
    merged = {
        name: next((getattr(s, name) for s in settings if getattr(s, name) is not None), None)
        for name in ("manifest", "eos_id", "pad_seq_to_mult", "pack_size", "vocab_size", "tokenizer")
    }
    return PackSettings(folders=tuple(str(folder) for folder in folders), **merged)
