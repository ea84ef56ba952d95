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

import contextlib
import glob
import importlib.util
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tightpack.core.checksums import sha256_and_count
from tightpack.errors import TightpackError
from tightpack.prepare.chunks import Source
from tightpack.prepare.dataset_sources import (
    dataset_source,
    datasets_kind,
    pick_split,
    rows_source,
    saved_dataset,
)
from tightpack.prepare.file_sources import file_source

DEFAULT_CORPUS_NAME = "chitchat-dataset (embedded default)"


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
    return rows_source(rows, DEFAULT_CORPUS_NAME, identity, conversations)


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


def open_sources(
    inputs: Iterable[Any] | str | Path | None, *, split: str | None = None, owners: list[int] | None = None
) -> list[Source]:
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
        TightpackError: on an empty list (no input given: that is not the demo corpus), a file
            given twice (the same path twice, or a path and a pattern matching it), a path that
            is not a file (a packed folder is named as such), packed data (a Parquet file with a
            ``seq_start_id`` column, a legacy packed ``.npy``, a dataset of packs), a pattern
            matching no file, an unknown file type, a ``DatasetDict`` without ``split`` (when it
            has several), a ``split`` not in it or with no ``DatasetDict`` to apply to, or an
            unsupported input.

    A generator yielding nothing is a source with no rows, which
    `tightpack.offline.pipeline.pack_dataset` reports as such.

    ``owners`` (when given) receives, for each source returned, the position of the input it came
    from in ``inputs`` (a glob pattern gives one source per file; rows are one input).
    """
    sources, positions = _open_sources(inputs, split)
    if owners is not None:
        owners.extend(positions)
    return sources


def _open_sources(inputs, split) -> tuple[list[Source], list[int]]:
    """`open_sources`' sources and, for each, the position of its input."""
    if inputs is None:
        _check_split_used(split, used=False)
        return [default_corpus()], [0]
    if isinstance(inputs, (str, Path)) or datasets_kind(inputs) is not None:
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
        return [rows_source(lambda: (), "rows", {"rows": "python"}, 0)], [0]
    if isinstance(first, dict) and datasets_kind(first) is None:
        _check_split_used(split, used=False)
        if stream:  # the first row was taken to see what the input is: it leads the rest
            rows = itertools.chain([first], items)
            return [rows_source(lambda: rows, "rows", {"rows": "python"}, None, once=True, first=first)], [0]
        count = len(inputs) if hasattr(inputs, "__len__") else None
        return [rows_source(lambda: inputs, "rows", {"rows": "python"}, count)], [0]

    sources, positions = [], []
    used_split = False
    given: dict[Any, str] = {}  # each input file (resolved) or dataset (fingerprint) -> its argument
    for position, argument in enumerate(itertools.chain([first], items)):
        item = saved_dataset(argument)
        opened = len(sources)
        kind = datasets_kind(item)
        if kind is not None:
            if kind == "dict":
                name, item = pick_split(item, split)
                source = dataset_source(item, datasets_kind(item), str(name))
                used_split = True
            else:
                source = dataset_source(item, kind)
            if "fingerprint" in source.identity:  # the same dataset (its content) given twice
                shown = str(argument) if isinstance(argument, (str, Path)) else source.name
                _check_given_once(source.identity["fingerprint"], source.name, shown, given)
            sources.append(source)
        elif isinstance(item, (str, Path)):
            for path in _expand(item):
                _check_given_once(path.resolve(), str(path), str(item), given)
                sources.append(file_source(path))
        elif isinstance(item, dict):
            raise TightpackError(
                "the inputs mix paths or datasets with rows (dicts): give either, or write the rows to a file"
            )
        else:
            raise TightpackError(
                f"unsupported input {type(item).__name__}: give paths, a datasets.Dataset or rows"
            )
        positions += [position] * (len(sources) - opened)
    _check_split_used(split, used=used_split)
    return sources, positions


_END = object()
_GLOB_MAGIC = frozenset("*?[")


def first_row(sources: list[Source]) -> Any:
    """The first row of the inputs, parsed, without taking it from a generator (`Source.peek`); None
    when there is no row or the first line is not JSON (the run then reports it as a bad row).

    ``--format auto`` looks at it to tell pre-tokenized inputs (`tightpack.prepare.formats.run_format`).
    """
    for source in sources:
        if source.peek is not None:
            return source.peek()
        with contextlib.closing(source.read(0, 1)) as chunks:
            chunk = next(chunks, None)
        if chunk is None:
            continue
        if chunk.lines is None:
            return chunk.parsed_rows()[0]
        try:
            return json.loads(chunk.lines[0])
        except (ValueError, RecursionError):
            return None
    return None


def _check_split_used(split: str | None, *, used: bool) -> None:
    if split is not None and not used:
        raise TightpackError(
            f"split {split!r} given, but no input is a DatasetDict or IterableDatasetDict to take it from"
        )


def _check_given_once(key: Any, what: str, argument: str, given: dict[Any, str]) -> None:
    """Refuse an input (a resolved file path, or a dataset's fingerprint) that an earlier argument
    already named (the same path, another spelling of it, a pattern matching it, the same dataset):
    it would be packed twice."""
    if key not in given:
        given[key] = argument
        return
    first = given[key]
    how = f"twice as {first!r}" if first == argument else f"by both {first!r} and {argument!r}"
    raise TightpackError(
        f"input {what!r} is given {how}: it would be packed twice; give each input once; to up-sample a "
        f"dataset on purpose, give it a larger share with {_UPSAMPLE} (docs/mixtures.md)",
        parameters=(_UPSAMPLE,),
    )


_UPSAMPLE = "MixtureConfig(weights=..., max_repetitions=...)"
"""How to repeat a dataset on purpose, in Python; the command line says ``--weights ... --max-repetitions``
(`tightpack.cli.flags.FLAGS`)."""


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
