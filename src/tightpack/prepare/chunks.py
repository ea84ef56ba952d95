"""Chunks of rows and sources of them: the types every kind of input is read as.

A chunk carries where its rows came from (file and line, or row number), so that an error names
the exact input location. JSONL lines travel unparsed (bytes): decoding and JSON parsing happen in
the workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: A JSONL chunk also ends once it holds this many bytes: progress advances at least every 256 KiB of
#: input (long rows make 512-row chunks slow), and a chunk of giant rows holds few of them. Fixed, so
#: the chunks (and the output) do not depend on the number of workers.
CHUNK_BYTES = 1 << 18


@dataclass
class Chunk:
    """Consecutive rows of one source.

    Attributes:
        first_sample: global index (across all sources) of the first row.
        source: display name of the source (a path, or a dataset's name).
        first_position: 1-based line number (JSONL) or 0-based row number (other sources) of the first row.
        lines: raw JSONL lines (bytes), with ``positions`` their line numbers; or None.
        rows: parsed rows; or None.
        batch: a pyarrow RecordBatch of Parquet or ``datasets`` rows (converted in the worker); or None.
        nulls_absent: ``rows`` come from a columnar source (``datasets.IterableDataset``), so a key
            whose value is None is absent from the row. Always true of a ``batch``.
    """

    first_sample: int
    source: str
    lines: list[bytes] | None = None
    positions: list[int] | None = None
    rows: list[Any] | None = None
    batch: Any = None
    first_position: int = 0
    nulls_absent: bool = False

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.num_rows
        return len(self.lines if self.lines is not None else self.rows)

    def parsed_rows(self) -> list[Any]:
        """The rows of a ``rows`` or ``batch`` chunk, as Python objects.

        Null values of a columnar source are dropped, so that ``--format auto`` picks a row's format
        by the keys it has, as it does for a JSONL line:

        >>> import pyarrow as pa
        >>> chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        >>> batch = pa.RecordBatch.from_pydict(
        ...     {"input": ["Q?", None], "output": ["A.", None], "messages": [None, chat]}
        ... )
        >>> [sorted(row) for row in Chunk(0, "mixed.parquet", batch=batch).parsed_rows()]
        [['input', 'output'], ['messages']]
        """
        if self.batch is None:
            if not self.nulls_absent:
                return self.rows
            return [
                {key: value for key, value in row.items() if value is not None}
                if isinstance(row, dict) and any(value is None for value in row.values())
                else row
                for row in self.rows
            ]
        rows = self.batch.to_pylist()
        # Only the columns holding a null cost a pass over the rows; most batches have none.
        columns = zip(self.batch.schema.names, self.batch.columns, strict=True)
        nullable = [name for name, column in columns if column.null_count]
        if nullable:
            for row in rows:
                for name in nullable:
                    if row.get(name, 0) is None:
                        del row[name]
        return rows

    def location(self, offset: int) -> str:
        """Human-readable location of the row at ``offset`` within this chunk."""
        if self.positions is not None:
            return f"{self.source}:{self.positions[offset]}"
        return f"{self.source} row {self.first_position + offset}"


@dataclass
class Source:
    """One input: its name, its identity for fingerprints, an estimate of its rows, and a chunk reader."""

    name: str
    identity: dict[str, Any]
    estimated_rows: int | None
    read: Any = field(repr=False)  # (first_sample, chunk_rows) -> Iterator[Chunk]
    file: InputFile | None = None  # a JSONL or Parquet file: what `file_ranges` cuts it by
    peek: Any = field(default=None, repr=False)  # () -> its first row, for a source read only once


@dataclass(frozen=True)
class InputFile:
    """What opening a JSONL or Parquet file recorded of it, to cut it into ranges (`file_ranges`).

    Attributes:
        kind: ``"jsonl"`` or ``"parquet"``.
        size: its size in bytes when it was hashed.
        range_bytes: the range size (`tightpack.prepare.file_ranges.RANGE_BYTES` at open time).
        newlines_before: JSONL: the newlines in ``bytes[0 : k * range_bytes]``, k = 1, 2, ...
        row_groups: Parquet: ``(rows, total_byte_size)`` of each row group.
    """

    kind: str
    size: int
    range_bytes: int
    newlines_before: list[int] | None = None
    row_groups: list[tuple[int, int]] | None = None


def line_chunks(
    numbered: Iterable[tuple[int, bytes]], first_sample: int, source: str, chunk_rows: int
) -> Iterator[Chunk]:
    """Chunks of the JSONL lines ``(line number, bytes)``, blank ones skipped, the first numbered
    ``first_sample``; a chunk ends at ``chunk_rows`` lines or once it holds `CHUNK_BYTES`."""
    lines: list[bytes] = []
    positions: list[int] = []
    size = 0
    for number, line in numbered:
        if not line.strip():
            continue
        lines.append(line)
        positions.append(number)
        size += len(line)
        if len(lines) == chunk_rows or size >= CHUNK_BYTES:
            yield Chunk(first_sample, source, lines=lines, positions=positions)
            first_sample += len(lines)
            lines, positions, size = [], [], 0
    if lines:
        yield Chunk(first_sample, source, lines=lines, positions=positions)
