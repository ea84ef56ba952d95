"""Input sources: JSONL and Parquet files, Hugging Face datasets, Python rows, the embedded default corpus.

Sources are read in chunks of rows (`Chunk`), in order, so that tokenization workers can run on
them in parallel and the results can be appended in the same order. A chunk carries where its rows
came from (file and line, or row number), so that an error names the exact input location.

JSONL lines travel unparsed (bytes): decoding and JSON parsing happen in the workers. Blank lines
are not samples and are skipped; a UTF-8 byte order mark at the start of a file is ignored.

Every kind of input gives the same rows in the same order as the same rows in a JSONL file: a
generator or iterator is read lazily, once, in chunks; a ``datasets.Dataset`` travels as Arrow
batches (converted in the workers, as Parquet); a ``datasets.IterableDataset`` (streaming too) is
read in one pass, never asked its length. Columnar rows (Parquet, Arrow, ``datasets``) hold every
column of the schema, so a null there means the key is absent from that row: a Parquet file mixing
chat rows (``input``/``output`` null) and prompt-completion rows (``messages`` null) formats as the
same rows written as JSONL without those keys.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tightpack.core.checksums import sha256_and_count
from tightpack.errors import TightpackError

__all__ = ["DEFAULT_CORPUS_NAME", "Chunk", "Source", "default_corpus", "open_sources"]

DEFAULT_CORPUS_NAME = "chitchat-dataset (embedded default)"
#: A JSONL chunk also ends once it holds this many bytes: progress advances at least every 256 KiB of
#: input (long rows make 512-row chunks slow), and a chunk of giant rows holds few of them. Fixed, so
#: the chunks (and the output) do not depend on the number of workers.
CHUNK_BYTES = 1 << 18
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


def _line_count(path: Path, newlines: int) -> int:
    """Lines of a text file: its newlines, plus a last line that has none."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as handle:
        handle.seek(size - 1)
        return newlines + (handle.read(1) != b"\n")


def _jsonl_source(path: Path) -> Source:
    sha256, newlines = sha256_and_count(path)

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        lines: list[bytes] = []
        positions: list[int] = []
        size = 0
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                if not line.strip():
                    continue
                lines.append(line)
                positions.append(number)
                size += len(line)
                if len(lines) == chunk_rows or size >= CHUNK_BYTES:
                    yield Chunk(first_sample, str(path), lines=lines, positions=positions)
                    first_sample += len(lines)
                    lines, positions, size = [], [], 0
        if lines:
            yield Chunk(first_sample, str(path), lines=lines, positions=positions)

    return Source(str(path), {"path": str(path), "sha256": sha256}, _line_count(path, newlines), read)


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


def _rows_source(
    rows: Callable[[], Iterable[Any]],
    name: str,
    identity: dict[str, Any],
    count: int | None,
    *,
    once: bool = False,
    nulls_absent: bool = False,
) -> Source:
    """Rows from ``rows()``, read lazily in chunks; ``once``: it returns a generator or an iterator,
    which a second reading would find exhausted (so that is refused rather than packing nothing)."""
    started = False

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        nonlocal started
        if once and started:
            raise TightpackError(
                f"{name}: a generator or iterator can be read only once; pass a list or a file to "
                "read the rows again"
            )
        started = True
        position = 0
        iterator = iter(rows())
        while batch := list(itertools.islice(iterator, chunk_rows)):
            yield Chunk(
                first_sample + position, name, rows=batch, first_position=position, nulls_absent=nulls_absent
            )
            position += len(batch)

    return Source(name, identity, count, read)


def _datasets_kind(item: Any) -> str | None:
    """``dict`` (a ``DatasetDict`` / ``IterableDatasetDict``), ``map`` (a ``Dataset``), ``iterable``
    (an ``IterableDataset``), or None for anything else. An object of ``datasets`` exists only once
    the package is imported, so this imports nothing."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return None
    if isinstance(item, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return "dict"
    if isinstance(item, datasets.Dataset):
        return "map"
    if isinstance(item, datasets.IterableDataset):
        return "iterable"
    return None


def _pick_split(splits: Any, split: str | None) -> tuple[str, Any]:
    """The name and dataset of the split ``split`` of a ``DatasetDict``; without one, its only split."""
    names = ", ".join(repr(str(name)) for name in splits) or "none"
    if split is None:
        if len(splits) == 1:
            return next(iter(splits.items()))
        raise TightpackError(
            f"the input is a {type(splits).__name__} with the splits {names}: choose one with --split "
            "(command line) or split= (Python)"
        )
    if split not in splits:
        raise TightpackError(f"split {split!r} is not in the {type(splits).__name__}; its splits: {names}")
    return split, splits[split]


def _dataset_source(dataset: Any, kind: str, split: str | None = None) -> Source:
    """A ``datasets.Dataset`` (``kind="map"``) or ``datasets.IterableDataset`` (``"iterable"``).

    A Dataset is read as Arrow batches, in its own row order (after ``shuffle``/``select`` too) and
    with its formatted columns, whatever its output format (numpy, torch, ...); with a transform
    (``set_transform``), as the rows the transform returns. An IterableDataset is read in one pass
    and has no length.
    """
    label = getattr(getattr(dataset, "info", None), "dataset_name", None) or "in memory"
    name = f"dataset {label}" + (f" split {split!r}" if split is not None else "")
    if kind == "iterable":
        identity = {"dataset": name, "streaming": True}  # no content fingerprint: never reused
        return _rows_source(lambda: dataset, name, identity, None, nulls_absent=True)

    identity = {"dataset": name, "fingerprint": dataset._fingerprint, "rows": len(dataset)}
    layout = dataset.format
    if layout["type"] == "custom":
        return _rows_source(lambda: dataset, name, identity, len(dataset), nulls_absent=True)

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        import numpy as np

        arrow = dataset.with_format(
            "arrow", columns=layout["columns"], output_all_columns=layout["output_all_columns"]
        )
        position = 0
        for table in arrow.iter(batch_size=chunk_rows):
            # A table from `iter` is a view on the dataset's (memory-mapped) table, which pickles
            # whole (every row) when the chunk goes to a worker; `take` copies these rows alone.
            (batch,) = table.take(np.arange(table.num_rows)).combine_chunks().to_batches()
            yield Chunk(first_sample, name, batch=batch, first_position=position)
            first_sample += batch.num_rows
            position += batch.num_rows

    return Source(name, identity, len(dataset), read)


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
    return _rows_source(rows, DEFAULT_CORPUS_NAME, identity, conversations)


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


def open_sources(inputs: Iterable[Any] | str | Path | None, *, split: str | None = None) -> list[Source]:
    """Sources for paths (JSONL/JSON lines, Parquet), Hugging Face datasets or an iterable of row dicts.

    Args:
        inputs: None (the embedded default corpus); a path or a glob pattern; a ``datasets.Dataset``,
            ``IterableDataset`` (streaming too), ``DatasetDict`` or ``IterableDatasetDict``; a list of
            these; or rows: a list, generator or iterator of row dicts. A generator or iterator is
            read lazily, once.
        split: the split of a ``DatasetDict`` / ``IterableDatasetDict`` input (``--split``); not
            needed when it has one split only.

    A ``str`` or ``Path`` holding ``*``, ``?`` or ``[`` that is not an existing file is a glob
    pattern: its files, sorted (``**`` spans folders). A folder written by ``save_to_disk`` is
    loaded as the dataset (or dataset dictionary) it holds.

    Raises:
        TightpackError: on an empty list (no input given: that is not the demo corpus), a path that
            is not a file, a pattern matching no file, an unknown file type, a ``DatasetDict``
            without ``split`` (when it has several), a ``split`` not in it or with no
            ``DatasetDict`` to apply to, or an unsupported input.

    A generator yielding nothing is a source with no rows, which `tightpack.pipeline.pack_dataset`
    reports as such.
    """
    if inputs is None:
        _check_split_used(split, used=False)
        return [default_corpus()]
    if isinstance(inputs, (str, Path)) or _datasets_kind(inputs) is not None:
        inputs = [inputs]
    elif isinstance(inputs, dict):
        raise TightpackError("a single row (a dict) is not an input: pass a list of rows, a dataset or paths")
    try:
        items = iter(inputs)
    except TypeError:
        raise TightpackError(
            f"unsupported input {type(inputs).__name__}: give paths, a datasets.Dataset or rows"
        ) from None
    stream = items is inputs  # a generator or an iterator: what is taken from it is gone
    first = next(items, _END)
    if first is _END:
        if not stream:
            raise TightpackError(
                "no input given: pass paths, a dataset or rows (None means the embedded default corpus)"
            )
        _check_split_used(split, used=False)
        return [_rows_source(lambda: (), "rows", {"rows": "python"}, 0)]
    if isinstance(first, dict) and _datasets_kind(first) is None:
        _check_split_used(split, used=False)
        if stream:  # the first row was taken to see what the input is: it leads the rest
            rows = itertools.chain([first], items)
            return [_rows_source(lambda: rows, "rows", {"rows": "python"}, None, once=True)]
        count = len(inputs) if hasattr(inputs, "__len__") else None
        return [_rows_source(lambda: inputs, "rows", {"rows": "python"}, count)]

    sources = []
    used_split = False
    for item in itertools.chain([first], items):
        item = _saved_dataset(item)
        kind = _datasets_kind(item)
        if kind == "dict":
            name, chosen = _pick_split(item, split)
            sources.append(_dataset_source(chosen, _datasets_kind(chosen), str(name)))
            used_split = True
        elif kind is not None:
            sources.append(_dataset_source(item, kind))
        elif isinstance(item, (str, Path)):
            sources.extend(_file_source(path) for path in _expand(item))
        elif isinstance(item, dict):
            raise TightpackError(
                "the inputs mix paths or datasets with rows (dicts): give either, or write the rows to a file"
            )
        else:
            raise TightpackError(
                f"unsupported input {type(item).__name__}: give paths, a datasets.Dataset or rows"
            )
    _check_split_used(split, used=used_split)
    return sources


_END = object()
_GLOB_MAGIC = frozenset("*?[")


def _check_split_used(split: str | None, *, used: bool) -> None:
    if split is not None and not used:
        raise TightpackError(
            f"split {split!r} given, but no input is a DatasetDict or IterableDatasetDict to take it from"
        )


def _saved_dataset(item: Any) -> Any:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict), loaded;
    anything else as it is."""
    if not isinstance(item, (str, Path)) or not Path(item).is_dir():
        return item
    folder = Path(item)
    if not ((folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()):
        return item
    try:
        from datasets import load_from_disk
    except ImportError:
        raise TightpackError(f"input {str(folder)!r} is a saved dataset: pip install datasets") from None
    return load_from_disk(str(folder))


def _expand(item: str | Path) -> list[Path]:
    """The path, or the files a glob pattern matches (sorted); an existing file is taken literally."""
    path = Path(item)
    text = str(item)
    if _GLOB_MAGIC.isdisjoint(text) or path.is_file():
        return [path]
    matches = sorted(match for match in glob.glob(text, recursive=True) if Path(match).is_file())
    if not matches:
        raise TightpackError(f"input pattern {text!r} matched no file")
    return [Path(match) for match in matches]


def _file_source(path: Path) -> Source:
    if not path.is_file():
        raise TightpackError(f"input {str(path)!r} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix in _PARQUET_SUFFIXES:
        return _parquet_source(path)
    if suffix in _JSONL_SUFFIXES:
        return _jsonl_source(path)
    raise TightpackError(
        f"input {str(path)!r}: unknown file type {suffix or '(none)'}; use JSON lines "
        "(.jsonl, .json) or Parquet (.parquet)"
    )
