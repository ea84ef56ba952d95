"""File checksums, streamed: the one place that reads a file block by block to hash it."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["file_digest", "sha256_and_count"]

_BLOCK = 1 << 22


def sha256_and_count(path: str | Path, marker: bytes = b"\n") -> tuple[str, int]:
    """sha256 of a file and how often ``marker`` occurs in it (e.g. lines, as a row estimate)."""
    digest, count, tail = hashlib.sha256(), 0, b""
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
            count += (tail + block).count(marker)  # tail is shorter than marker: no double count
            tail = block[-(len(marker) - 1) :] if len(marker) > 1 else b""
    return digest.hexdigest(), count


def file_digest(path: str | Path) -> dict:
    """``{"bytes", "sha256"}`` of a file, for manifests."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_and_count(path)[0]}
