"""The metadata checks: what ``pad_cu_seqlens`` reads of ``packed_metadata_path`` (D1, D5, D6)."""

from __future__ import annotations

from pathlib import Path

from tightpack.core.pack_manifest import metadata_near
from tightpack.offline.output_folder import METADATA_NAME
from tightpack.packed_summary import read_metadata
from tightpack.stale_packs.result import CheckedSplit
from tightpack.stale_packs.rules import SPECS as _SPECS

# What pad_cu_seqlens reads of each metadata entry (contract §2.6).
_METADATA_KEYS = ("max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen")


class MetadataChecks:
    """`_Checker`'s metadata checks (a mixin: it uses the checker's specs, ``add`` and ``_repack_fix``)."""

    def _metadata(
        self, splits: list[CheckedSplit], packed: Path | None
    ) -> tuple[Path | None, list[dict] | None]:
        """The metadata file: ``packed_metadata_path``, else one found next to the (first) packs."""
        configured = self.specs.packed_metadata_path if self.specs else None
        if configured:
            path = Path(configured)
            if not path.is_file():
                read = self.pad_cu_seqlens or any(s.files[0].lower().endswith(".npy") for s in splits)
                self.add(
                    "D1",
                    "error" if read else "warning",
                    f"{_SPECS}.packed_metadata_path {configured!r} does not exist"
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

    def _check_metadata(
        self, splits: list[CheckedSplit], path: Path | None, entries: list[dict] | None
    ) -> None:
        configured = self.specs.packed_metadata_path if self.specs else None
        if not configured:
            found = f"{path}" if path else "the metadata.json of the packs"
            self.add(
                "D5",
                "error",
                f"{_SPECS}.pad_cu_seqlens is true but packed_metadata_path is not set: the reference then "
                "reads the builder's default <P>_metadata.jsonl, which explicit packs do not have ('a "
                "metadata json file is required when pad_cu_seqlens is enabled').",
                f"Set {_SPECS}.packed_metadata_path: {found}.",
            )
        if path is None or entries is None:
            return
        missing = sorted({key for entry in entries for key in _METADATA_KEYS if key not in entry})
        if not entries or missing:
            self.add(
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
                self.add(
                    "D5",
                    "error",
                    f"{path} gives pack_size {', '.join(map(str, sizes))}, the {split.name} packs "
                    f"{split.path} have {split.pack_size}: the metadata belongs to other packs.",
                    f"Point packed_metadata_path at the metadata written with these packs, or "
                    f"{self._repack_fix(split)[0].lower()}{self._repack_fix(split)[1:]}",
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
                    self.add(
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
