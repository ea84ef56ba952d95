"""Batched tokenization of chunks of rows, in K worker processes, into a token store.

Each chunk is parsed, formatted (`tightpack.prepare.formats`) and tokenized in one batch call of the
Rust tokenizer; its tokens come back as flat numpy arrays and are appended to the token store in
chunk order. Chunks have a fixed number of rows whatever K is, so the store is byte-identical for
any number of workers. At most ``2 * K`` chunks are in flight, so memory does not grow with the input.

The loss mask is computed from character spans: a token is supervised when its characters overlap
a supervised span. For byte-level BPE tokenizers the token offsets follow from token byte lengths
(`tightpack.prepare.tokenizer.ByteLevelLayout`), so the tokenizer tracks none and the overlap test is
vectorized over the chunk; otherwise only the span ends are looked up (``Encoding.char_to_token``),
so the cost is per span, never per token in Python.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tightpack.core.long_samples import LongSampleCut
from tightpack.core.ranges import in_ranges
from tightpack.core.token_store import Segments, TokenStore, TokenStoreWriter, append_eos
from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig, Rendered, RowError, render_row
from tightpack.prepare.pretokenized import pretokenized_arrays
from tightpack.prepare.sources import Chunk
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.prepare.vision_tokens import VisionTokenIds, expand_vision_tokens

__all__ = [
    "BadRow",
    "ChunkResult",
    "Encoder",
    "TokenizeReport",
    "bad_row_error",
    "encode_chunk",
    "max_token_bytes",
    "tokenize_chunk",
    "tokenize_to_store",
]


@dataclass(frozen=True)
class BadRow:
    """A row that could not be turned into a sample: where, and why."""

    sample_index: int
    location: str
    reason: str


def bad_row_error(bad: BadRow) -> str:
    """The message that stops a run at its first bad row (without ``--skip-bad-lines``)."""
    return f"{bad.location}: {bad.reason} (fix the row, or pass --skip-bad-lines)"


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
    segments: Segments | None = None
    texts_cut: int = 0  # samples whose text lost its middle to the text budget
    media: list[str] | None = None  # per sample, its images and videos (vision packing)


@dataclass
class TokenizeReport:
    store: TokenStore
    rows_read: int
    bad_rows: list[BadRow]
    reused: bool = False  # the store came from the cache of finished stores
    texts_cut: int = 0  # samples whose text lost its middle to the text budget (`Encoder.text_budget`)
    cut: LongSampleCut | None = None  # long samples already cut where they were tokenized (Ray)


@dataclass(frozen=True)
class Encoder:
    """What turns rows into token ids and loss masks: a tokenizer, a sample format, and the text budget
    (characters per field kept around a cut, `tightpack.prepare.formats.render_row`; None: no cut)."""

    spec: TokenizerSpec
    config: FormatConfig
    text_budget: int | None = None

    def encode_rows(self, rows: list[Any], first_sample: int = 0, source: str = "rows") -> ChunkResult:
        """Tokens, masks (unshifted) and stored lengths of ``rows``, EOS appended; bad rows reported."""
        return encode_chunk(self, Chunk(first_sample, source, rows=list(rows)))


class _Worker:
    """Per-process state of a tokenization worker."""

    encoder: Encoder | None = None
    vision: tuple[Encoder, VisionTokenIds] | None = None


def vision_ids(encoder: Encoder) -> VisionTokenIds:
    """The vision token ids of the encoder's tokenizer, built once per process."""
    if _Worker.vision is None or _Worker.vision[0] is not encoder:
        _Worker.vision = (encoder, VisionTokenIds(encoder.config.vision, encoder.spec.backend))
    return _Worker.vision[1]


def _init_worker(encoder: Encoder, single_threaded: bool) -> None:
    if single_threaded:  # K processes already use the cores; Rust threads inside each would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _Worker.encoder = encoder


def max_token_bytes(spec: TokenizerSpec) -> int:
    """Most UTF-8 bytes of text one token of ``spec`` can stand for (an upper bound: a vocabulary
    entry's own spelling, which for byte-level and SentencePiece vocabularies is never shorter)."""
    if spec.byte_level is not None:
        return int(spec.byte_level.token_bytes.max())
    vocab = spec.backend.get_vocab(with_added_tokens=True)
    return max(len(token.encode("utf-8")) for token in vocab)


def _parse(chunk: Chunk) -> Iterator[tuple[int, object]]:
    """(offset, row or RowError) for every row of the chunk."""
    if chunk.lines is None:
        yield from enumerate(chunk.parsed_rows())
        return
    for offset, line in enumerate(chunk.lines):
        try:
            text = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            yield offset, RowError(f"invalid UTF-8 at byte {error.start} of the line")
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:  # some messages end in "at" already
            row = RowError(f"malformed JSON: {error.msg.removesuffix(' at')} at column {error.colno}")
        except RecursionError:
            row = RowError("malformed JSON: nested too deeply")
        yield offset, row


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


def _render_chunk(encoder: Encoder, chunk: Chunk) -> tuple[list[tuple[int, Rendered]], list[BadRow]]:
    spec, config = encoder.spec, encoder.config
    template, special = spec.chat_template, spec.special_tokens
    rendered: list[tuple[int, Rendered]] = []
    bad_rows = []
    for offset, row in _parse(chunk):
        try:
            if isinstance(row, RowError):
                raise row
            sample = render_row(row, config, template, special, encoder.text_budget)
            _check_encodable(sample.text)
            rendered.append((offset, sample))
        except RowError as error:
            bad_rows.append(BadRow(chunk.first_sample + offset, chunk.location(offset), str(error)))
    return rendered, bad_rows


def _check_encodable(text: str) -> None:
    """JSON can spell lone surrogates (``"\\ud800"``), which are not text a tokenizer accepts."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            code = ord(text[error.start])
            raise RowError(
                f"the text holds a lone surrogate (U+{code:04X}), which is not valid Unicode"
            ) from None


def _encode(encoder: Encoder, rendered: list[tuple[int, Rendered]]) -> list:
    """Token ids of the rendered texts: lists of ints on the byte-level fast path (the tokenizer
    tracks no offsets; special tokens are added by `_byte_level_body`), else ``Encoding`` objects."""
    if encoder.spec.byte_level is None:
        return _encode_with_offsets(encoder, rendered)
    texts = [sample.text for _, sample in rendered]
    batch = encoder.spec.backend.encode_batch_fast(texts, add_special_tokens=False)
    return [encoding.ids for encoding in batch]


def _char_spans_to_bytes(text: str, spans) -> list[tuple[int, int]]:
    """Character spans of ``text`` as UTF-8 byte spans."""
    if text.isascii():
        return list(spans)
    converted, chars, bytes_ = [], 0, 0
    for start, end in spans:
        bytes_ += len(text[chars:start].encode("utf-8"))
        first = bytes_
        bytes_ += len(text[start:end].encode("utf-8"))
        converted.append((first, bytes_))
        chars = end
    return converted


def _byte_level_body(encoder: Encoder, rendered: list[tuple[int, Rendered]], id_lists: list[list[int]]):
    """Flat ids, lengths and supervised mask of the samples, from token byte lengths (no offsets).

    Returns None when some sample's tokens do not cover its UTF-8 bytes exactly (an added token that
    strips whitespace, say): the chunk then takes the offsets path.
    """
    layout = encoder.spec.byte_level
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=int(lengths.sum()))
    text_bytes = np.array([len(sample.text.encode("utf-8")) for _, sample in rendered], dtype=np.int64)
    if ids.size and ids.max() >= len(layout.token_bytes):
        return None
    token_bytes = layout.token_bytes[ids]
    cumulative = np.concatenate(([0], np.cumsum(token_bytes)))
    sample_ends = np.cumsum(lengths)
    if not np.array_equal(cumulative[sample_ends] - cumulative[sample_ends - lengths], text_bytes):
        return None
    token_starts, token_ends = cumulative[:-1], cumulative[1:]

    byte_base = np.cumsum(text_bytes) - text_bytes
    span_starts, span_ends = [], []
    for (_, sample), base in zip(rendered, byte_base.tolist(), strict=True):
        for start, end in _char_spans_to_bytes(sample.text, sample.spans):
            span_starts.append(base + start)
            span_ends.append(base + end)
    span_starts, span_ends = np.array(span_starts, dtype=np.int64), np.array(span_ends, dtype=np.int64)
    if len(span_starts):  # a token is supervised when its bytes overlap a span (spans are sorted, disjoint)
        index = np.searchsorted(span_ends, token_starts, side="right")
        inside = index < len(span_starts)
        mask = inside & (span_starts[np.minimum(index, len(span_starts) - 1)] < token_ends)
    else:
        mask = np.zeros(len(ids), dtype=bool)

    segment_starts = _byte_level_segments(rendered, byte_base, token_ends, sample_ends - lengths, lengths)
    with_specials = np.array([sample.add_special_tokens for _, sample in rendered], dtype=bool)
    if layout.prefix_ids and with_specials.any():  # the BOS joins each sample's first segment
        counts = np.array([len(sample.segments) for _, sample in rendered], dtype=np.int64)
        first = np.zeros(len(segment_starts), dtype=bool)
        first[(np.cumsum(counts) - counts)[counts > 0]] = True
        segment_starts += np.repeat(with_specials * len(layout.prefix_ids), counts) * ~first
    if (layout.prefix_ids or layout.suffix_ids) and with_specials.any():
        starts = (sample_ends - lengths)[with_specials]
        ends = sample_ends[with_specials]
        prefix, suffix = np.array(layout.prefix_ids, np.int64), np.array(layout.suffix_ids, np.int64)
        positions = np.concatenate((np.repeat(starts, len(prefix)), np.repeat(ends, len(suffix))))
        values = np.concatenate((np.tile(prefix, len(starts)), np.tile(suffix, len(ends))))
        order = np.argsort(positions, kind="stable")
        ids = np.insert(ids, positions[order], values[order])
        mask = np.insert(mask, positions[order], False)
        lengths = lengths + with_specials * (len(prefix) + len(suffix))
    return ids, lengths, mask, segment_starts


def _byte_level_segments(rendered, byte_base, token_ends, token_base, lengths) -> np.ndarray:
    """Token start of every segment, relative to its sample: the first token whose bytes end past the
    segment's first byte (a token that straddles two segments belongs to the later one)."""
    positions = []
    for (_, sample), base in zip(rendered, byte_base.tolist(), strict=True):
        chars = [start for start, _, _ in sample.segments]
        if sample.text.isascii():
            positions += [base + c for c in chars]
            continue
        done, at = 0, base  # UTF-8 offsets, one piece of text between two segment starts at a time
        for c in chars:
            at += len(sample.text[done:c].encode("utf-8"))
            done = c
            positions.append(at)
    counts = np.array([len(sample.segments) for _, sample in rendered], dtype=np.int64)
    found = np.searchsorted(token_ends, np.array(positions, dtype=np.int64), side="right")
    relative = found - np.repeat(token_base, counts)
    starts = np.clip(relative, 0, np.repeat(lengths, counts))
    starts[(np.cumsum(counts) - counts)[counts > 0]] = 0
    return starts


def _offsets_body(rendered: list[tuple[int, Rendered]], encodings: list):
    """Flat ids, lengths and supervised mask of the samples, from the tokenizer's offsets."""
    id_lists = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=int(lengths.sum()))
    starts = (np.cumsum(lengths) - lengths).tolist()
    rises, falls = [], []
    for base, n, encoding, (_, sample) in zip(starts, lengths.tolist(), encodings, rendered, strict=True):
        for first, stop in _supervised_tokens(encoding, sample.text, sample.spans, n):
            rises.append(base + first)
            falls.append(base + stop)
    segment_starts = [
        _token_start(encoding, sample.text, start, n) if number else 0
        for n, encoding, (_, sample) in zip(lengths.tolist(), encodings, rendered, strict=True)
        for number, (start, _, _) in enumerate(sample.segments)
    ]
    return ids, lengths, in_ranges(rises, falls, len(ids)), np.array(segment_starts, dtype=np.int64)


def _token_start(encoding, text: str, start: int, n_tokens: int) -> int:
    """The first token holding a character at or after ``start``; past the last text token when none
    does (the tokens after it, EOS or a suffix, belong to the segment at the text's end)."""
    for position in range(start, len(text)):
        token = encoding.char_to_token(position)
        if token is not None:
            return token
    for position in range(min(start, len(text)) - 1, -1, -1):
        token = encoding.char_to_token(position)
        if token is not None:
            return token + 1
    return n_tokens  # no character of the text has a token: only special tokens


def _assemble(
    encoder: Encoder, chunk: Chunk, rendered: list[tuple[int, Rendered]], encoded: list, bad_rows
) -> ChunkResult:
    """Flat token and mask arrays of the chunk's samples, EOS appended."""
    spec = encoder.spec
    body = _byte_level_body(encoder, rendered, encoded) if spec.byte_level is not None else None
    if body is None:
        if spec.byte_level is not None:  # rare: re-encode this chunk with offsets
            encoded = _encode_with_offsets(encoder, rendered)
        body = _offsets_body(rendered, encoded)
    ids, lengths, mask, segment_starts = body
    eos_supervised = np.array([sample.eos_supervised for _, sample in rendered], dtype=bool)
    tokens, loss_mask, stored = append_eos(ids, mask, lengths, spec.eos_id, eos_supervised)
    source_index = np.array([chunk.first_sample + offset for offset, _ in rendered], dtype=np.int64)
    segments = Segments(
        counts=np.array([len(sample.segments) for _, sample in rendered], dtype=np.int64),
        starts=segment_starts,
        kinds=np.array([kind for _, sample in rendered for _, kind, _ in sample.segments], dtype=np.int8),
        units=np.array([unit for _, sample in rendered for _, _, unit in sample.segments], dtype=np.int32),
    )
    cut = sum(sample.cut for _, sample in rendered)
    media = None
    if encoder.config.vision is not None:
        tokens, loss_mask, stored, segments, media = expand_vision_tokens(
            tokens, loss_mask, stored, segments, [sample.media for _, sample in rendered], vision_ids(encoder)
        )
    return ChunkResult(
        tokens, loss_mask, stored, source_index, bad_rows, len(chunk), segments, texts_cut=cut, media=media
    )


def _encode_with_offsets(encoder: Encoder, rendered: list[tuple[int, Rendered]]) -> list:
    backend = encoder.spec.backend
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


def _pretokenized_chunk(encoder: Encoder, chunk: Chunk) -> ChunkResult:
    spec = encoder.spec
    rows = None if chunk.batch is not None else [row for _, row in _parse(chunk)]
    tokens, loss_mask, stored, good, bad = pretokenized_arrays(chunk, rows, spec.vocab_size, spec.eos_id)
    bad_rows = [BadRow(chunk.first_sample + offset, chunk.location(offset), reason) for offset, reason in bad]
    return ChunkResult(tokens, loss_mask, stored, chunk.first_sample + good, bad_rows, rows=len(chunk))


def encode_chunk(encoder: Encoder, chunk: Chunk) -> ChunkResult:
    """Parse, format and tokenize one chunk."""
    if encoder.config.format == "tokens":
        return _pretokenized_chunk(encoder, chunk)
    rendered, bad_rows = _render_chunk(encoder, chunk)
    return _assemble(encoder, chunk, rendered, _encode(encoder, rendered), bad_rows)


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    """`encode_chunk` with the worker process's encoder."""
    return encode_chunk(_Worker.encoder, chunk)


def _tokenize_in_process(encoder: Encoder, chunks: Iterator[Chunk]) -> Iterator[ChunkResult]:
    """K = 1: the tokenizer's own threads encode chunk i while this thread renders chunk i+1 and
    assembles chunk i-1 (``encode_batch`` releases the GIL)."""
    if encoder.config.format == "tokens":
        yield from (encode_chunk(encoder, chunk) for chunk in chunks)
        return
    with ThreadPoolExecutor(max_workers=1) as thread:
        previous = None
        for chunk in chunks:
            rendered, bad_rows = _render_chunk(encoder, chunk)
            current = (chunk, rendered, bad_rows, thread.submit(_encode, encoder, rendered))
            if previous is not None:
                yield _assemble(encoder, previous[0], previous[1], previous[3].result(), previous[2])
            previous = current
        if previous is not None:
            yield _assemble(encoder, previous[0], previous[1], previous[3].result(), previous[2])


def tokenize_to_store(
    chunks: Iterator[Chunk],
    spec: TokenizerSpec,
    config: FormatConfig,
    store_dir,
    *,
    workers: int = 1,
    skip_bad_rows: bool = False,
    on_rows: Callable[[int], None] | None = None,
    text_budget: int | None = None,
) -> TokenizeReport:
    """Tokenize every chunk into a token store at ``store_dir``.

    Args:
        text_budget: characters kept at each end of a field or message cut before tokenizing (see
            `tightpack.prepare.formats.render_row`); None keeps every character.
        workers: K processes; 1 tokenizes in this process. The store is identical for any K.
        skip_bad_rows: count and report bad rows instead of failing on the first one.
        on_rows: called with the number of rows of each finished chunk (progress).

    Raises:
        TightpackError: on the first bad row (in input order) unless ``skip_bad_rows``.
    """
    if workers < 1:
        raise TightpackError(f"--workers must be at least 1, got {workers}")
    spec.byte_level  # noqa: B018 - computed here once, inherited by forked workers
    writer = TokenStoreWriter(store_dir)
    rows_read, bad_rows, texts_cut = 0, [], 0

    def consume(result: ChunkResult) -> None:
        nonlocal rows_read, texts_cut
        if result.bad_rows and not skip_bad_rows:
            raise TightpackError(bad_row_error(result.bad_rows[0]))
        writer.append(
            result.tokens,
            result.loss_mask,
            result.lengths,
            result.source_index,
            result.segments,
            result.media,
        )
        bad_rows.extend(result.bad_rows)
        rows_read += result.rows
        texts_cut += result.texts_cut
        if on_rows is not None:
            on_rows(result.rows)

    encoder = Encoder(spec, config, text_budget)
    if workers == 1:
        for result in _tokenize_in_process(encoder, chunks):
            consume(result)
    else:
        # Fork on Linux: workers start at once and inherit the loaded tokenizer
        # (as PyTorch's DataLoader workers do); elsewhere spawn, the safe default there. Not in a
        # process connected to Ray: a fork copies locks its threads hold, and the child can hang.
        ray = sys.modules.get("ray")
        threaded = ray is not None and ray.is_initialized()
        context = multiprocessing.get_context("fork" if sys.platform == "linux" and not threaded else "spawn")
        with context.Pool(workers, initializer=_init_worker, initargs=(encoder, True)) as pool:
            pending: deque = deque()
            for chunk in chunks:
                pending.append(pool.apply_async(tokenize_chunk, (chunk,)))
                if len(pending) >= 2 * workers:
                    consume(pending.popleft().get())
            while pending:
                consume(pending.popleft().get())
    return TokenizeReport(writer.close(), rows_read, bad_rows, texts_cut=texts_cut)
