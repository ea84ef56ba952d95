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
from dataclasses import dataclass, field

import numpy as np

from tightpack.core.token_store import TokenStore, TokenStoreWriter
from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig, Rendered, RowError, render_row
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
    _Worker.spec, _Worker.config, _Worker.backend = spec, config, spec.build()


def _parse(chunk: Chunk) -> Iterator[tuple[int, object]]:
    """(offset, row or BadRow-reason) for every row of the chunk."""
    if chunk.lines is None:
        yield from enumerate(chunk.rows)
        return
    for offset, line in enumerate(chunk.lines):
        try:
            yield offset, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            yield offset, RowError(f"invalid UTF-8 at byte {error.start} of the line")
        except json.JSONDecodeError as error:
            yield offset, RowError(f"malformed JSON: {error.msg} at column {error.colno}")


def _supervised_tokens(encoding, spans, n_tokens: int) -> list[tuple[int, int]]:
    """Token ranges [first, stop) overlapping the character spans.

    ``char_to_token`` gives the first token holding a character; a character split over several
    tokens (a multi-byte character in byte-level BPE) continues into the tokens whose offsets still
    start inside the span, hence the walk forward from the last character's token.
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
        while last + 1 < n_tokens and encoding.token_to_chars(last + 1)[0] < end:
            last += 1
        ranges.append((first, last + 1))
    return ranges


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    """Parse, format and tokenize one chunk (in a worker, or in-process for K = 1)."""
    spec, config, backend = _Worker.spec, _Worker.config, _Worker.backend
    rendered: list[tuple[int, Rendered]] = []
    bad_rows = []
    for offset, row in _parse(chunk):
        if isinstance(row, RowError):
            bad_rows.append(BadRow(chunk.first_sample + offset, chunk.location(offset), str(row)))
            continue
        try:
            rendered.append((offset, render_row(row, config, spec.chat_template, spec.special_tokens)))
        except RowError as error:
            bad_rows.append(BadRow(chunk.first_sample + offset, chunk.location(offset), str(error)))

    encodings: list = [None] * len(rendered)
    for add_special in (True, False):
        picked = [i for i, (_, r) in enumerate(rendered) if r.add_special_tokens is add_special]
        if picked:
            batch = backend.encode_batch(
                [rendered[i][1].text for i in picked], add_special_tokens=add_special
            )
            for i, encoding in zip(picked, batch, strict=True):
                encodings[i] = encoding

    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    ends_with_eos = np.fromiter((bool(x) and x[-1] == spec.eos_id for x in ids), dtype=bool, count=len(ids))
    stored = lengths + ~ends_with_eos
    total = int(stored.sum())
    starts = np.cumsum(stored) - stored

    tokens = np.empty(total, dtype=np.int32)
    body = np.ones(total, dtype=bool)
    body[(starts + stored - 1)[~ends_with_eos]] = False  # the appended EOS slots
    tokens[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    tokens[~body] = spec.eos_id

    # Supervised token ranges -> a +1/-1 difference array -> cumulative sum = mask.
    edges = np.zeros(total + 1, dtype=np.int32)
    for i, (encoding, (_, sample)) in enumerate(zip(encodings, rendered, strict=True)):
        for first, stop in _supervised_tokens(encoding, sample.spans, int(lengths[i])):
            edges[starts[i] + first] += 1
            edges[starts[i] + stop] -= 1
        if sample.eos_supervised:
            edges[starts[i] + stored[i] - 1] += 1
            edges[starts[i] + stored[i]] -= 1
    loss_mask = (np.cumsum(edges[:-1]) > 0).astype(np.int8)

    source_index = np.array([chunk.first_sample + offset for offset, _ in rendered], dtype=np.int64)
    return ChunkResult(tokens, loss_mask, stored, source_index, bad_rows, rows=len(chunk))


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
        for chunk in chunks:
            consume(tokenize_chunk(chunk))
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
