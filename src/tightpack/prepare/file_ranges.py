"""Pieces of input files that workers read by themselves.

A distributed run must not read its input rows on the driver: that would funnel every byte through
one process. The driver only hashes each file when it opens it (a pass it makes anyway, which also
records where the newlines fall, `InputFile`), cuts each file into `FileRange` descriptors of about
`RANGE_BYTES` (byte ranges of a JSONL file, runs of row groups of a Parquet file) and hands those
out; each worker reads its piece with `read_range`. The rows of the ranges of a file, in order, are
the rows the local reader gives, with the same line or row numbers.

A JSONL range owns the lines that start in it: a line starts at offset 0 and right after each
newline. Its last line may run past the range's end (to the end of the file, newline or not).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tightpack.errors import TightpackError
from tightpack.prepare.chunks import Chunk, Source, line_chunks

#: The size of a range: a JSONL range spans this many bytes, a Parquet range gathers row groups
#: until they hold this many (uncompressed). Read when a file is opened (`InputFile.range_bytes`).
RANGE_BYTES = 1 << 25
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class FileRange:
    """A piece of one input file that a worker reads by itself (picklable, small).

    Attributes:
        source: the file, as `Chunk.source` names it: ``str(path)``.
        kind: ``"jsonl"`` or ``"parquet"``.
        start: JSONL: the first byte offset; Parquet: the first row group.
        stop: JSONL: the byte offset ending the range (exclusive); Parquet: the row group (exclusive).
        first_line: JSONL: the 1-based number of the first line that starts in ``[start, stop)``
            (perhaps blank, perhaps starting past ``stop`` when no line starts in the range);
            Parquet: the 0-based row number, within the file, of row group ``start``.
    """

    source: str
    kind: str
    start: int
    stop: int
    first_line: int


def file_ranges(sources: Iterable[Source]) -> list[FileRange] | None:
    """Every source's ranges, in input order; None when a source is not a JSONL or Parquet file
    (a dataset, Python rows, the default corpus): those are read on the driver."""
    sources = list(sources)
    if any(source.file is None for source in sources):
        return None
    ranges: list[FileRange] = []
    for source in sources:
        ranges.extend(_jsonl_ranges(source) if source.file.kind == "jsonl" else _parquet_ranges(source))
    return ranges


def _jsonl_ranges(source: Source) -> list[FileRange]:
    """``[k * R, (k + 1) * R)`` clipped to the size, R the recorded range size.

    The line starting first at or after offset ``s > 0`` is line ``2 + N(s - 1)``, N(x) the newlines
    in ``bytes[0:x]``: if byte ``s - 1`` is a newline, a line starts at ``s``, number ``1 + N(s)``
    ``= 2 + N(s - 1)``; if not, the next line starts after the first newline at or after ``s``, and
    none lies in ``[s - 1, s)``, so again ``1 + N(s) + 1 = 2 + N(s - 1)``. ``N(s)`` is in the index;
    byte ``s - 1`` is read from the file (one byte per range).
    """
    file = source.file
    step, index = file.range_bytes, file.newlines_before
    ranges = []
    with open(source.name, "rb") as handle:
        for k, start in enumerate(range(0, file.size, step)):
            first_line = 1
            if start:
                handle.seek(start - 1)
                first_line = 1 + index[k - 1] + (handle.read(1) != b"\n")
            ranges.append(FileRange(source.name, "jsonl", start, min(start + step, file.size), first_line))
    return ranges


def _parquet_ranges(source: Source) -> list[FileRange]:
    """Consecutive row groups, gathered until they hold the recorded range size (one at least)."""
    groups = source.file.row_groups
    ranges, first, row = [], 0, 0
    while first < len(groups):
        stop, size = first, 0
        while stop < len(groups) and (stop == first or size < source.file.range_bytes):
            size += groups[stop][1]
            stop += 1
        ranges.append(FileRange(source.name, "parquet", first, stop, row))
        row += sum(rows for rows, _ in groups[first:stop])
        first = stop
    return ranges


def read_range(file_range: FileRange, chunk_rows: int) -> Iterator[Chunk]:
    """The rows of a range as chunks numbered within it (the first chunk's ``first_sample`` is 0),
    carrying the file's line numbers (JSONL ``positions``) or row numbers (``first_position``)."""
    if file_range.kind == "parquet":
        groups = range(file_range.start, file_range.stop)
        yield from parquet_chunks(file_range.source, groups, 0, file_range.first_line, chunk_rows)
        return
    with open(file_range.source, "rb") as handle:
        lines = numbered_lines(_owned_lines(handle, file_range.start, file_range.stop), file_range.first_line)
        yield from line_chunks(lines, 0, file_range.source, chunk_rows)


def _owned_lines(handle: BinaryIO, start: int, stop: int) -> Iterator[bytes]:
    """The raw lines of the file that start at an offset in ``[start, stop)``."""
    offset = start
    if start:
        handle.seek(start - 1)
        offset += len(handle.readline()) - 1  # past the first newline at or after start - 1
    for line in handle:
        if offset >= stop:
            return
        yield line
        offset += len(line)


def numbered_lines(lines: Iterable[bytes], first_line: int) -> Iterator[tuple[int, bytes]]:
    """The lines numbered from ``first_line``; a byte order mark is dropped from line 1."""
    for number, line in enumerate(lines, start=first_line):
        yield number, line[3:] if number == 1 and line.startswith(BOM) else line


def parquet_chunks(
    path: str | Path, row_groups: Sequence[int] | None, first_sample: int, position: int, chunk_rows: int
) -> Iterator[Chunk]:
    """Batches of a Parquet file's rows (of ``row_groups`` only, when given), the first being row
    ``position`` of the file and numbered ``first_sample``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows, row_groups=row_groups):
            yield Chunk(first_sample, str(path), batch=batch, first_position=position)
            first_sample += batch.num_rows
            position += batch.num_rows
    except (OSError, pa.ArrowException) as error:
        raise TightpackError(f"{path}: cannot read row {position} onwards ({error})") from error
