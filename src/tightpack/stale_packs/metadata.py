"""D5, D6: what ``pad_cu_seqlens`` reads of ``packed_metadata_path`` (D1 checks that it exists)."""

from __future__ import annotations

from pathlib import Path

from tightpack.core.pack_manifest import METADATA_NAME, metadata_near
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.repack import lowered, repack_fix
from tightpack.stale_packs.rules import SPECS

# What pad_cu_seqlens reads of each metadata entry (docs/contract.md §2.6).
_METADATA_KEYS = ("max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen")


def check_metadata(
    context: CheckContext, splits: list[CheckedSplit], path: Path | None, entries: list[dict] | None
) -> None:
    """D5 and D6 under ``pad_cu_seqlens``: the metadata is configured, complete, of these packs' size,
    and covers every split read."""
    configured = context.specs.packed_metadata_path if context.specs else None
    if not configured:
        found = f"{path}" if path else "the metadata.json of the packs"
        context.add(
            "D5",
            "error",
            f"{SPECS}.pad_cu_seqlens is true but packed_metadata_path is not set: the reference then "
            "reads the builder's default <P>_metadata.jsonl, which explicit packs do not have ('a "
            "metadata json file is required when pad_cu_seqlens is enabled').",
            f"Set {SPECS}.packed_metadata_path: {found}.",
        )
    if path is None or entries is None:
        return
    missing = sorted({key for entry in entries for key in _METADATA_KEYS if key not in entry})
    if not entries or missing:
        context.add(
            "D5",
            "error",
            f"{path} has {len(entries)} entries"
            + (f" without {', '.join(missing)}" if missing else "")
            + ": pad_cu_seqlens sizes the static boundary arrays from them.",
            f"Re-pack with --pad-cu-seqlens (tightpack writes {METADATA_NAME}) and point "
            "packed_metadata_path at it.",
        )
        return
    for split in splits:
        sizes = sorted({entry.get("pack_size") for entry in entries})
        if split.pack_size is not None and sizes != [split.pack_size]:
            context.add(
                "D5",
                "error",
                f"{path} gives pack_size {', '.join(map(str, sizes))}, the {split.name} packs "
                f"{split.path} have {split.pack_size}: the metadata belongs to other packs.",
                f"Point packed_metadata_path at the metadata written with these packs, or "
                f"{lowered(repack_fix(context, split))}",
            )
    for split in splits:
        for key, bound, worse in (
            ("max_samples_per_bin", max, lambda said, real: said < real),
            ("dataset_max_seqlen", max, lambda said, real: said < real),
            ("min_packed_seqlen", min, lambda said, real: said > real),
        ):
            real = split.stats.get(key)
            said = bound(entry[key] for entry in entries)
            if real is not None and worse(said, real):
                which = "max" if bound is max else "min"
                context.add(
                    "D6",
                    "error",
                    f"{path} gives {which} {key} {said} over its {len(entries)} entries, the "
                    f"{split.name} packs {split.path} have {real}: the metadata does not cover them "
                    "(pad_cu_seqlens sizes boundary arrays and max_seqlen from it).",
                    f"Give packed_metadata_path a file listing the {METADATA_NAME} entries of every "
                    f"split read (a JSON list: {', '.join(_metadata_sources(splits))}).",
                )


def _metadata_sources(splits: list[CheckedSplit]) -> list[str]:
    return [str(found) for split in splits if (found := metadata_near(split.folder)) is not None]
