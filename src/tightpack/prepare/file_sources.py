"""Input files: JSON lines and Parquet, each hashed once when opened and read in chunks.

Blank JSONL lines are not samples and are skipped; a UTF-8 byte order mark at the start of a file
is ignored. Opening a file also records what `tightpack.prepare.file_ranges` needs to cut it into
pieces that workers read by themselves (`InputFile`), from the same single hashing pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tightpack.core.checksums import sha256_and_count
from tightpack.errors import TightpackError
from tightpack.prepare import file_ranges
from tightpack.prepare.chunks import Chunk, InputFile, Source, line_chunks
from tightpack.prepare.file_ranges import numbered_lines, parquet_chunks

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
#: The column that makes a Parquet file packed data: tightpack's and Megatron-Bridge's packed rows
#: hold several sequences each, and say where each starts. Rows to pack never have it.
PACKED_MARK = "seq_start_id"


def _line_count(path: Path, newlines: int, size: int) -> int:
    """Lines of a text file: its newlines, plus a last line that has none."""
    if size == 0:
        return 0
    with open(path, "rb") as handle:
        handle.seek(size - 1)
        return newlines + (handle.read(1) != b"\n")


def jsonl_source(path: Path) -> Source:
    """A JSON lines file: one row per non-blank line."""
    range_bytes = file_ranges.RANGE_BYTES
    size = path.stat().st_size
    sha256, newlines, index = sha256_and_count(path, every=range_bytes)

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        with open(path, "rb") as handle:
            yield from line_chunks(numbered_lines(handle, 1), first_sample, str(path), chunk_rows)

    return Source(
        str(path),
        {"path": str(path), "sha256": sha256},
        _line_count(path, newlines, size),
        read,
        InputFile("jsonl", size, range_bytes, newlines_before=index),
    )


def parquet_source(path: Path) -> Source:
    """A Parquet file: its rows, read as record batches."""
    import pyarrow.parquet as pq

    range_bytes = file_ranges.RANGE_BYTES
    size = path.stat().st_size
    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise TightpackError(f"{path}: not a readable Parquet file ({error})") from error
    if PACKED_MARK in metadata.schema.to_arrow_schema().names:  # before hashing a large shard
        raise TightpackError(_packed_data(path, f"packed Parquet: a {PACKED_MARK!r} column"))
    sha256, _ = sha256_and_count(path)
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        yield from parquet_chunks(path, None, first_sample, 0, chunk_rows)

    row_groups = [(group.num_rows, group.total_byte_size) for group in groups]
    return Source(
        str(path),
        {"path": str(path), "sha256": sha256},
        metadata.num_rows,
        read,
        InputFile("parquet", size, range_bytes, row_groups=row_groups),
    )


def _packed_data(path: Path, layout: str) -> str:
    """Why a packed file is not an input: re-reading packs as rows would pack their sequences into
    one sample and misread the label-aligned mask as token-aligned."""
    shown = str(path)
    return (
        f"input {shown!r} is packed data ({layout}), not rows: inputs are JSONL or Parquet rows; to "
        f"see the packs run `tightpack inspect {shown}`, to re-pack give the rows they were packed from"
    )


def _not_a_file(path: Path) -> str:
    """Why ``path`` is not an input, and what to give instead."""
    shown = str(path)
    if not path.is_dir():
        return f"input {shown!r} does not exist or is not a file"
    if (path / "manifest.json").is_file() or any(path.glob("*_metadata.jsonl")):
        return (
            f"input {shown!r} is a packed folder (tightpack's manifest.json, or Megatron-Bridge's "
            "metadata), not rows: inputs are JSONL or Parquet rows; to see the packs run "
            f"`tightpack inspect {shown}`, to re-pack give the rows they were packed from"
        )
    return f"input {shown!r} is a folder: give its files, or a pattern such as '{shown}/*.jsonl'"


def file_source(path: Path) -> Source:
    """A JSONL or Parquet file, by its suffix."""
    if not path.is_file():
        raise TightpackError(_not_a_file(path))
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return parquet_source(path)
    if suffix in JSONL_SUFFIXES:
        return jsonl_source(path)
    if suffix == ".npy":
        raise TightpackError(_packed_data(path, "a legacy packed .npy"))
    raise TightpackError(
        f"input {str(path)!r}: unknown file type {suffix or '(none)'}; use JSON lines "
        "(.jsonl, .json) or Parquet (.parquet)"
    )
