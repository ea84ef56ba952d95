"""Input sources: JSONL and Parquet files, Hugging Face datasets, Python rows, the embedded default corpus.

Sources are read in chunks of rows (`Chunk`), in order, so that tokenization workers can run on
them in parallel and the results can be appended in the same order. A chunk carries where its rows
came from (file and line, or row number), so that an error names the exact input location.

JSONL lines travel unparsed (bytes): decoding and JSON parsing happen in the workers. Blank lines
are not samples and are skipped; a UTF-8 byte order mark at the start of a file is ignored.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tightpack.core.checksums import sha256_and_count
from tightpack.errors import TightpackError

__all__ = ["DEFAULT_CORPUS_NAME", "Chunk", "Source", "default_corpus", "open_sources"]

DEFAULT_CORPUS_NAME = "chitchat-dataset (embedded default)"
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class Chunk:
    """Consecutive rows of one source.

    Attributes:
        first_sample: global index (across all sources) of the first row.
        source: display name of the source (a path, or a dataset's name).
        first_position: 1-based line number (JSONL) or 0-based row number (other sources) of the first row.
        lines: raw JSONL lines (bytes), with ``positions`` their line numbers; or None.
        rows: parsed rows; or None.
        batch: a pyarrow RecordBatch of Parquet rows (converted in the worker); or None.
    """

    first_sample: int
    source: str
    lines: list[bytes] | None = None
    positions: list[int] | None = None
    rows: list[Any] | None = None
    batch: Any = None
    first_position: int = 0

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.num_rows
        return len(self.lines if self.lines is not None else self.rows)

    def parsed_rows(self) -> list[Any]:
        """The rows of a ``rows`` or ``batch`` chunk, as Python objects."""
        return self.batch.to_pylist() if self.batch is not None else self.rows

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


def _jsonl_source(path: Path) -> Source:
    sha256, newlines = sha256_and_count(path)

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        lines: list[bytes] = []
        positions: list[int] = []
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                if not line.strip():
                    continue
                lines.append(line)
                positions.append(number)
                if len(lines) == chunk_rows:
                    yield Chunk(first_sample, str(path), lines=lines, positions=positions)
                    first_sample += len(lines)
                    lines, positions = [], []
        if lines:
            yield Chunk(first_sample, str(path), lines=lines, positions=positions)

    return Source(str(path), {"path": str(path), "sha256": sha256}, newlines + 1, read)


def _parquet_source(path: Path) -> Source:
    import pyarrow.parquet as pq

    sha256, _ = sha256_and_count(path)
    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise TightpackError(f"{path}: not a readable Parquet file ({error})") from error

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        import pyarrow as pa

        position = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows):
                yield Chunk(first_sample, str(path), batch=batch, first_position=position)
                first_sample += batch.num_rows
                position += batch.num_rows
        except (OSError, pa.ArrowException) as error:
            raise TightpackError(f"{path}: cannot read row {position} onwards ({error})") from error

    return Source(str(path), {"path": str(path), "sha256": sha256}, rows, read)


def _rows_source(rows: Iterable[Any], name: str, identity: dict[str, Any], count: int | None) -> Source:
    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        batch: list[Any] = []
        position = 0
        for row in rows:
            batch.append(row)
            if len(batch) == chunk_rows:
                yield Chunk(first_sample, name, rows=batch, first_position=position)
                first_sample += len(batch)
                position += len(batch)
                batch = []
        if batch:
            yield Chunk(first_sample, name, rows=batch, first_position=position)

    return Source(name, identity, count, read)


def _dataset_source(dataset: Any) -> Source:
    """A Hugging Face ``datasets.Dataset`` (duck-typed: ``iter(batch_size)``, ``column_names``)."""
    name = f"dataset {(getattr(getattr(dataset, 'info', None), 'dataset_name', None) or 'in memory')}"
    fingerprint = getattr(dataset, "_fingerprint", None)

    def rows() -> Iterator[dict]:
        for batch in dataset.iter(batch_size=1024):
            columns = list(batch)
            yield from (
                dict(zip(columns, values, strict=True))
                for values in zip(*(batch[c] for c in columns), strict=True)
            )

    identity = {"dataset": name, "fingerprint": fingerprint, "rows": len(dataset)}
    return _rows_source(rows(), name, identity, len(dataset))


def default_corpus() -> Source:
    """The embedded default: the 7,168 conversations of the PyPI package ``chitchat-dataset`` (MIT).

    Each conversation is a list of turns, each turn a list of utterances by one sender. A turn
    becomes one message (utterances joined by newlines); the sender of the first turn is the
    ``user``, the other one the ``assistant``. The file is decoded one conversation at a time, so
    the first chunk is ready at once and the rest of the decoding overlaps tokenization.
    """
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise TightpackError(
            "the embedded default corpus needs the package chitchat-dataset: pip install 'tightpack[demo]'"
        )
    path = Path(spec.submodule_search_locations[0]) / "dataset.json"
    # One '"messages":' key per conversation (inside strings the quotes would be escaped).
    sha256, conversations = sha256_and_count(path, marker=b'"messages":')

    def rows() -> Iterator[dict]:
        for conversation in _object_values(path.read_text(encoding="utf-8")):
            yield chitchat_messages(conversation)

    identity = {"path": DEFAULT_CORPUS_NAME, "sha256": sha256}
    return _rows_source(rows(), DEFAULT_CORPUS_NAME, identity, conversations)


_SEPARATOR = re.compile(r"[\s,]*")
_COLON = re.compile(r"\s*:\s*")


def _object_values(text: str) -> Iterator[Any]:
    """The values of a top-level JSON object, decoded one at a time.

    >>> list(_object_values('{"a": [1, 2], "b" : {"c": 3}}'))
    [[1, 2], {'c': 3}]
    """
    decoder = json.JSONDecoder()
    position = _SEPARATOR.match(text).end()
    if text[position : position + 1] != "{":
        raise TightpackError("the default corpus file is not a JSON object")
    position += 1
    while True:
        position = _SEPARATOR.match(text, position).end()
        if text[position : position + 1] == "}":
            return
        _, position = decoder.raw_decode(text, position)
        position = _COLON.match(text, position).end()
        value, position = decoder.raw_decode(text, position)
        yield value


def chitchat_messages(conversation: dict) -> dict:
    """A chitchat conversation as a chat row: one message per turn, first sender = user."""
    turns = conversation["messages"]
    first = turns[0][0]["sender"] if turns else None
    return {
        "messages": [
            {
                "role": "user" if turn[0]["sender"] == first else "assistant",
                "content": "\n".join([utterance["text"] for utterance in turn]),
            }
            for turn in turns
        ]
    }


def open_sources(inputs: Iterable[Any] | None) -> list[Source]:
    """Sources for paths (JSONL/JSON lines, Parquet), Hugging Face datasets or an iterable of row dicts.

    None or an empty list means the embedded default corpus.
    """
    if inputs is None:
        return [default_corpus()]
    if isinstance(inputs, (str, Path)) or hasattr(inputs, "column_names"):
        inputs = [inputs]
    sources = []
    for item in inputs:
        if hasattr(item, "column_names") and hasattr(item, "iter"):
            sources.append(_dataset_source(item))
        elif isinstance(item, (str, Path)):
            path = Path(item)
            if not path.is_file():
                raise TightpackError(f"input {str(path)!r} does not exist or is not a file")
            suffix = path.suffix.lower()
            if suffix in _PARQUET_SUFFIXES:
                sources.append(_parquet_source(path))
            elif suffix in _JSONL_SUFFIXES:
                sources.append(_jsonl_source(path))
            else:
                raise TightpackError(
                    f"input {str(path)!r}: unknown file type {suffix or '(none)'}; use JSON lines "
                    "(.jsonl, .json) or Parquet (.parquet)"
                )
        elif isinstance(item, dict):
            sources.append(_rows_source(list(inputs), "rows", {"rows": "python"}, None))
            break
        else:
            raise TightpackError(
                f"unsupported input {type(item).__name__}: give paths, a datasets.Dataset or rows"
            )
    if not sources:
        return [default_corpus()]
    return sources
