"""The ``media`` check of ``tightpack verify``: the files that vision packs refer to are still there,
still decode, and still give the patch grids recorded when packing.

Packs of ``tightpack pack --vision-processor`` hold, per sequence, the JSON of its images and videos
(the ``media`` column); the manifest holds the sizing and the media root they were packed with. Each
item is read again as packing read it (`tightpack.prepare.vision_rows.reread_media_item`: every
picture decoded in full and sized upright), so a file moved, deleted, damaged or replaced since is
found before training reaches it. Every picture is decoded, so this check costs what the packing run
spent on media.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow.parquet as pq

from tightpack.prepare.vision_rows import MediaError, VisionSpec, parse_media_json, reread_media_item
from tightpack.prepare.vision_sizes import VisionSizes
from tightpack.verify.report import VerifyReport


def check_media(files: list[str], manifest: Mapping[str, Any] | None, report: VerifyReport) -> int:
    """Read every media item of the packs again; each fault is a ``media`` violation at its file, row
    and sequence. Returns how many items were read (0 for packs without media or without a manifest)."""
    vision = ((manifest or {}).get("settings", {}).get("format") or {}).get("vision")
    if not vision:
        return 0
    try:
        spec = VisionSpec(VisionSizes(**vision["sizes"]), vision["media_root"], dict(vision["tokens"]))
    except (KeyError, TypeError, ValueError) as error:
        report.add("media", f"the manifest's vision settings cannot be read ({error!r}): media not checked")
        return 0
    items = 0
    for file in files:
        parquet = pq.ParquetFile(file)
        if "media" not in parquet.schema_arrow.names:
            report.add(
                "media", "the manifest records vision packing but the file has no media column", file=file
            )
            continue
        row = 0
        for group in range(parquet.num_row_groups):
            for pack in parquet.read_row_group(group, columns=["media"]).column("media").to_pylist():
                for sequence, text in enumerate(pack or []):
                    for item in parse_media_json(text):
                        items += 1
                        _check_item(item, spec, report, file=file, row=row, sequence=sequence)
                row += 1
    return items


def _check_item(item, spec: VisionSpec, report: VerifyReport, **where: Any) -> None:
    try:
        now = reread_media_item(item, spec)
    except MediaError as error:
        report.add("media", str(error), **where)
        return
    if now.grid != item.grid:
        report.add(
            "media",
            f"{item.kind} {item.paths[0]} has the patch grid {list(now.grid)} now but {list(item.grid)} "
            "when it was packed: the file changed since; re-pack",
            **where,
        )
