"""D1: the packed paths and the metadata file the configuration names exist."""

from __future__ import annotations

from pathlib import Path

from tightpack.core.pack_manifest import (
    METADATA_NAME,
    locate_packed,
    metadata_near,
    read_manifest,
    read_metadata,
)
from tightpack.errors import TightpackError
from tightpack.stale_packs.context import CheckContext, CheckedSplit, split_attr
from tightpack.stale_packs.rules import SPECS


def open_split(context: CheckContext, name: str, path: str) -> CheckedSplit | None:
    """The split at ``path`` with what its manifest records; None (and a D1 error) when it names no packs."""
    where = "--packed" if name == "packed" else f"{SPECS}.{split_attr(name)}"
    try:
        located = locate_packed(path)
    except TightpackError as error:
        context.add(
            "D1",
            "error",
            f"{where} {path!r} names no packed data: {error}",
            f"Point {where} at the packed folder, Parquet file or glob (the reference raises "
            "FileNotFoundError when it builds PackedSequenceSpecs), or pack it: tightpack pack INPUT "
            f"--output {path}.",
        )
        return None
    files, folder = located.files, located.folder
    if located.manifest is None:
        return CheckedSplit(name, path, files, folder)
    manifest = read_manifest(located.manifest)
    settings = manifest["settings"]
    stats = manifest.get("stats", {})
    recorded = {
        "max_samples_per_bin": stats.get("max_samples_per_pack"),
        "dataset_max_seqlen": stats.get("dataset_max_length"),
        "min_packed_seqlen": stats.get("min_packed_length"),
    }
    return CheckedSplit(
        name,
        path,
        files,
        folder,
        manifest=manifest,
        pack_size=settings.get("packed_sequence_size"),
        multiple=settings.get("pad_seq_to_mult"),
        stats={key: value for key, value in recorded.items() if value is not None},
    )


def find_metadata(context: CheckContext, splits: list[CheckedSplit]) -> tuple[Path | None, list[dict] | None]:
    """The metadata file and its entries: ``packed_metadata_path``, else one found next to the (first)
    packs; (None, None) when there is none, with a D1 finding when the configured one is missing."""
    configured = context.specs.packed_metadata_path if context.specs else None
    if configured:
        path = Path(configured)
        if not path.is_file():
            read = context.pad_cu_seqlens or any(s.files[0].lower().endswith(".npy") for s in splits)
            context.add(
                "D1",
                "error" if read else "warning",
                f"{SPECS}.packed_metadata_path {configured!r} does not exist"
                + ("" if read else " (nothing reads it: Parquet packs without pad_cu_seqlens)"),
                "Point packed_metadata_path at the metadata of the packs (tightpack writes "
                f"{METADATA_NAME} into the output folder)" + ("." if read else ", or remove it."),
            )
            return None, None
        return path, read_metadata(path)
    for split in splits:
        found = metadata_near(split.folder)
        if found is not None:
            return found, read_metadata(found)
    return None, None
