"""D9: the packed files are the ones the manifest lists, with its sizes (and sha256 under ``deep``)."""

from __future__ import annotations

import os
from pathlib import Path

from tightpack.core.pack_manifest import MANIFEST_NAME
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.repack import lowered, repack_fix


def check_files(context: CheckContext, split: CheckedSplit) -> None:
    """D9 on a split with a manifest: no file added, changed or missing since packing."""
    listed = {entry["name"]: entry for entry in split.manifest.get("files", []) if "name" in entry}
    manifest = split.folder / MANIFEST_NAME
    fix = repack_fix(context, split)
    for file in split.files:
        entry = listed.get(Path(file).name)
        if entry is None:
            context.add(
                "D9",
                "error",
                f"{file} is not in {manifest}: it was added after packing (another run's shard?), and "
                "the training job reads it too.",
                f"Remove {file}, or {lowered(fix)}",
            )
            continue
        size = os.stat(file).st_size
        if entry.get("bytes") is not None and size != entry["bytes"]:
            context.add(
                "D9",
                "error",
                f"{file} has {size:,} bytes, {manifest} lists {entry['bytes']:,}: the file changed "
                "after packing.",
                fix,
            )
        elif context.deep and entry.get("sha256"):
            from tightpack.core.checksums import file_digest

            digest = file_digest(file)["sha256"]
            if digest != entry["sha256"]:
                context.add(
                    "D9",
                    "error",
                    f"{file} has sha256 {digest[:12]}..., {manifest} lists "
                    f"{entry['sha256'][:12]}...: the file changed after packing.",
                    fix,
                )
    if Path(split.path).is_dir():
        for name in sorted(set(listed) - {Path(file).name for file in split.files}):
            context.add(
                "D9",
                "error",
                f"{split.folder / name} is listed in {manifest} but missing.",
                fix,
            )
