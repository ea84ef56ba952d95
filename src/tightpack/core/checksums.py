"""File checksums, streamed: the one place that reads a file block by block to hash it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import overload

_BLOCK = 1 << 22


@overload
def sha256_and_count(path: str | Path, marker: bytes = ..., every: None = None) -> tuple[str, int]: ...


@overload
def sha256_and_count(path: str | Path, marker: bytes = ..., *, every: int) -> tuple[str, int, list[int]]: ...


def sha256_and_count(
    path: str | Path, marker: bytes = b"\n", every: int | None = None
) -> tuple[str, int] | tuple[str, int, list[int]]:
    """sha256 of a file and how often ``marker`` occurs in it (e.g. lines, as a row estimate).

    With ``every`` (a 1-byte ``marker`` only), also an index, from the same single read: the count
    of ``marker`` in ``bytes[0 : k * every]`` for k = 1, 2, ... while ``k * every`` is below the
    file's size. Each block is counted once, piece by piece between the index's boundaries.
    """
    if every is not None and (every < 1 or len(marker) != 1):
        raise ValueError(f"every must be positive and the marker one byte, not {every}, {marker!r}")
    digest, count, tail = hashlib.sha256(), 0, b""
    index: list[int] = []
    offset = 0  # bytes before the current block
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
            if every is None:
                count += (tail + block).count(marker)  # tail is shorter than marker: no double count
                tail = block[-(len(marker) - 1) :] if len(marker) > 1 else b""
            else:
                previous = 0
                cut = (offset // every + 1) * every - offset  # the next boundary, within the block
                while cut <= len(block):
                    count += block.count(marker, previous, cut)
                    index.append(count)
                    previous, cut = cut, cut + every
                count += block.count(marker, previous)
            offset += len(block)
    if every is None:
        return digest.hexdigest(), count
    del index[(offset - 1) // every if offset else 0 :]  # boundaries at or past the end
    return digest.hexdigest(), count, index


def file_digest(path: str | Path) -> dict:
    """``{"bytes", "sha256"}`` of a file, for manifests."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_and_count(path)[0]}
