"""Batched tokenization of chunks of rows, in K worker processes, into a token store.

Each chunk is parsed, formatted (`tightpack.prepare.formats`) and tokenized in one batch call of the
Rust tokenizer; its tokens come back as flat numpy arrays and are appended to the token store in
chunk order. Chunks have a fixed number of rows whatever K is, so the store is byte-identical for
any number of workers. At most ``2 * K`` chunks are in flight, so memory does not grow with the input.

The loss mask is computed from character spans: a token is supervised when its characters overlap
a supervised span. Only the span ends are looked up (``Encoding.char_to_token``), never per-token
offsets, so the cost is per span, not per token.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tightpack.core.ranges import in_ranges
from tightpack.core.token_store import TokenStore, TokenStoreWriter
from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig, Rendered, RowError, render_row
from tightpack.prepare.pretokenized import pretokenized_arrays
from tightpack.prepare.sources import Chunk
from tightpack.prepare.tokenizer import TokenizerSpec

__all__ = ["BadRow", "ChunkResult", "TokenizeReport", "tokenize_chunk", "tokenize_to_store"]


@dataclass(frozen=True)
class BadRow:
    """A row that could not be turned into a sample: where, and why."""

    sample_index: int
    location: str
    reason: str


@dataclass
class ChunkResult:
    """Samples of one chunk: concatenated tokens and (unshifted) loss mask, per-sample lengths and
    source rows, and the rows that failed."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    source_index: np.ndarray
    bad_rows: list[BadRow] = field(default_factory=list)
    rows: int = 0


@dataclass
class TokenizeReport:
    store: TokenStore
    rows_read: int
    bad_rows: list[BadRow]


class _Worker:
    """Per-process state: the tokenizer backend, built once."""

    spec: TokenizerSpec | None = None
    config: FormatConfig | None = None
    backend = None


def _init_worker(spec: TokenizerSpec, config: FormatConfig, single_threaded: bool) -> None:
    if single_threaded:  # K processes already use the cores; Rust threads inside each would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _Worker.spec, _Worker.config, _Worker.backend = spec, config, spec.backend


def _parse(chunk: Chunk) -> Iterator[tuple[int, object]]:
    """(offset, row or RowError) for every row of the chunk."""
    if chunk.lines is None:
        yield from enumerate(chunk.parsed_rows())
        return
    for offset, line in enumerate(chunk.lines):
        try:
            yield offset, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            yield offset, RowError(f"invalid UTF-8 at byte {error.start} of the line")
        except json.JSONDecodeError as error:
            yield offset, RowError(f"malformed JSON: {error.msg} at column {error.colno}")


def _supervised_tokens(encoding, text: str, spans, n_tokens: int) -> list[tuple[int, int]]:
    """Token ranges [first, stop) overlapping the character spans of ``text``.

    ``char_to_token`` gives the first token holding a character; a non-ASCII character can be split
    over several tokens (byte-level BPE), which continue into the tokens whose offsets still start
    inside the span, hence the walk forward from the last character's token.
    """
    ranges = []
    for start, end in spans:
        first = encoding.char_to_token(start)
        if first is None:  # the span starts with characters no token holds (stripped by the normalizer)
            first = next(
                (t for c in range(start + 1, end) if (t := encoding.char_to_token(c)) is not None), None
            )
            if first is None:
                continue
        last = encoding.char_to_token(end - 1)
        if last is None:
            last = next(
                t for c in range(end - 2, start - 1, -1) if (t := encoding.char_to_token(c)) is not None
            )
        if not text[end - 1].isascii():
            while last + 1 < n_tokens and encoding.token_to_chars(last + 1)[0] < end:
                last += 1
        ranges.append((first, last + 1))
    return ranges


def _render_chunk(chunk: Chunk) -> tuple[list[tuple[int, Rendered]], list[BadRow]]:
    spec, config = _Worker.spec, _Worker.config
    template, special = spec.chat_template, spec.special_tokens
    rendered: list[tuple[int, Rendered]] = []
    bad_rows = []
    for offset, row in _parse(chunk):
        try:
            if isinstance(row, RowError):
                raise row
            rendered.append((offset, render_row(row, config, template, special)))
        except RowError as error:
            bad_rows.append(BadRow(chunk.first_sample + offset, chunk.location(offset), str(error)))
    return rendered, bad_rows


def _encode(rendered: list[tuple[int, Rendered]]) -> list:
    """Encodings of the rendered texts, in order (one batch call per special-token setting)."""
    backend = _Worker.backend
    if all(sample.add_special_tokens for _, sample in rendered):
        return backend.encode_batch([sample.text for _, sample in rendered], add_special_tokens=True)
    encodings: list = [None] * len(rendered)
    for add_special in (True, False):
        picked = [i for i, (_, sample) in enumerate(rendered) if sample.add_special_tokens is add_special]
        if picked:
            batch = backend.encode_batch(
                [rendered[i][1].text for i in picked], add_special_tokens=add_special
            )
            for i, encoding in zip(picked, batch, strict=True):
                encodings[i] = encoding
    return encodings


def _assemble(chunk: Chunk, rendered: list[tuple[int, Rendered]], encodings: list, bad_rows) -> ChunkResult:
    """Flat token and mask arrays of the chunk's samples, EOS appended."""
    eos_id = _Worker.spec.eos_id
    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    ends_with_eos = np.fromiter((bool(x) and x[-1] == eos_id for x in ids), dtype=bool, count=len(ids))
    stored = lengths + ~ends_with_eos
    total = int(stored.sum())
    starts = np.cumsum(stored) - stored

    tokens = np.full(total, eos_id, dtype=np.int32)
    body = np.ones(total, dtype=bool)
    body[(starts + stored - 1)[~ends_with_eos]] = False  # the appended EOS slots
    tokens[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))

    rises, falls = [], []
    for i, (encoding, (_, sample)) in enumerate(zip(encodings, rendered, strict=True)):
        base = int(starts[i])
        for first, stop in _supervised_tokens(encoding, sample.text, sample.spans, int(lengths[i])):
            rises.append(base + first)
            falls.append(base + stop)
        if sample.eos_supervised:
            rises.append(base + int(stored[i]) - 1)
            falls.append(base + int(stored[i]))
    loss_mask = in_ranges(rises, falls, total).astype(np.int8)

    source_index = np.array([chunk.first_sample + offset for offset, _ in rendered], dtype=np.int64)
    return ChunkResult(tokens, loss_mask, stored, source_index, bad_rows, rows=len(chunk))


def _pretokenized_chunk(chunk: Chunk) -> ChunkResult:
    spec = _Worker.spec
    rows = None if chunk.batch is not None else [row for _, row in _parse(chunk)]
    tokens, loss_mask, stored, good, bad = pretokenized_arrays(chunk, rows, spec.vocab_size, spec.eos_id)
    bad_rows = [BadRow(chunk.first_sample + offset, chunk.location(offset), reason) for offset, reason in bad]
    return ChunkResult(tokens, loss_mask, stored, chunk.first_sample + good, bad_rows, rows=len(chunk))


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    """Parse, format and tokenize one chunk (in a worker process)."""
    if _Worker.config.format == "tokens":
        return _pretokenized_chunk(chunk)
    rendered, bad_rows = _render_chunk(chunk)
    return _assemble(chunk, rendered, _encode(rendered), bad_rows)


def _tokenize_in_process(chunks: Iterator[Chunk]) -> Iterator[ChunkResult]:
    """K = 1: the tokenizer's own threads encode chunk i while this thread renders chunk i+1 and
    assembles chunk i-1 (``encode_batch`` releases the GIL)."""
    if _Worker.config.format == "tokens":
        yield from map(tokenize_chunk, chunks)
        return
    with ThreadPoolExecutor(max_workers=1) as encoder:
        previous = None
        for chunk in chunks:
            rendered, bad_rows = _render_chunk(chunk)
            current = (chunk, rendered, bad_rows, encoder.submit(_encode, rendered))
            if previous is not None:
                yield _assemble(previous[0], previous[1], previous[3].result(), previous[2])
            previous = current
        if previous is not None:
            yield _assemble(previous[0], previous[1], previous[3].result(), previous[2])


def tokenize_to_store(
    chunks: Iterator[Chunk],
    spec: TokenizerSpec,
    config: FormatConfig,
    store_dir,
    *,
    workers: int = 1,
    skip_bad_rows: bool = False,
    on_rows: Callable[[int], None] | None = None,
) -> TokenizeReport:
    """Tokenize every chunk into a token store at ``store_dir``.

    Args:
        workers: K processes; 1 tokenizes in this process. The store is identical for any K.
        skip_bad_rows: count and report bad rows instead of failing on the first one.
        on_rows: called with the number of rows of each finished chunk (progress).

    Raises:
        TightpackError: on the first bad row (in input order) unless ``skip_bad_rows``.
    """
    if workers < 1:
        raise TightpackError(f"--workers must be at least 1, got {workers}")
    writer = TokenStoreWriter(store_dir)
    rows_read, bad_rows = 0, []

    def consume(result: ChunkResult) -> None:
        nonlocal rows_read
        if result.bad_rows and not skip_bad_rows:
            bad = result.bad_rows[0]
            raise TightpackError(f"{bad.location}: {bad.reason} (fix the row, or pass --skip-bad-lines)")
        writer.append(result.tokens, result.loss_mask, result.lengths, result.source_index)
        bad_rows.extend(result.bad_rows)
        rows_read += result.rows
        if on_rows is not None:
            on_rows(result.rows)

    if workers == 1:
        _init_worker(spec, config, single_threaded=False)
        for result in _tokenize_in_process(chunks):
            consume(result)
    else:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["tightpack.prepare.tokenize"])
        with context.Pool(workers, initializer=_init_worker, initargs=(spec, config, True)) as pool:
            pending: deque = deque()
            for chunk in chunks:
                pending.append(pool.apply_async(tokenize_chunk, (chunk,)))
                if len(pending) >= 2 * workers:
                    consume(pending.popleft().get())
            while pending:
                consume(pending.popleft().get())
    return TokenizeReport(writer.close(), rows_read, bad_rows)
