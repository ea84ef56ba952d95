"""Batched tokenization of chunks of rows, in K worker processes, into a token store.

Each chunk is parsed, formatted (`tightpack.prepare.formats`) and tokenized in one batch call of the
Rust tokenizer; its tokens come back as flat numpy arrays and are appended to the token store in
chunk order. Chunks have a fixed number of rows whatever K is, so the store is byte-identical for
any number of workers. At most ``2 * K`` chunks are in flight, so memory does not grow with the input.

The loss mask of each sample comes from its character spans (`tightpack.prepare.token_masks`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tightpack.core.long_samples import LongSampleCut
from tightpack.core.token_store import Segments, TokenStore, TokenStoreWriter, append_eos
from tightpack.errors import TightpackError
from tightpack.prepare.chat_render import reset_warnings
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.format_config import PREFERENCE_FORMATS
from tightpack.prepare.formats import FormatConfig, Rendered, RowError, render_row, row_kind
from tightpack.prepare.pretokenized import pretokenized_arrays
from tightpack.prepare.token_masks import byte_level_body, encode_texts, encode_with_offsets, offsets_body
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.prepare.vision_tokens import VisionTokenIds, expand_vision_tokens
from tightpack.prepare.worker_pool import map_in_processes


@dataclass(frozen=True)
class BadRow:
    """A row that could not be turned into a sample: where, and why."""

    sample_index: int
    location: str
    reason: str


BAD_ROW_PARAMETERS = ("skip_bad_lines=True", "input_key/output_key or format", "media_root")
"""The settings a bad row's reason and `bad_row_error` may name (`TightpackError.parameters`)."""


def bad_row_error(bad: BadRow) -> TightpackError:
    """The error that stops a run at its first bad row (without ``skip_bad_lines``)."""
    return TightpackError(
        f"{bad.location}: {bad.reason} (fix the row, or pass skip_bad_lines=True)",
        parameters=BAD_ROW_PARAMETERS,
    )


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
    kinds: frozenset[str] = frozenset()  # what ``auto`` reads the chunk's object rows as (`row_kind`)


@dataclass
class TokenizeReport:
    store: TokenStore
    rows_read: int
    bad_rows: list[BadRow]
    reused: bool = False  # the store came from the cache of finished stores
    texts_cut: int = 0  # samples whose text lost its middle to the text budget (`Encoder.text_budget`)
    cut: LongSampleCut | None = None  # long samples already cut where they were tokenized (Ray)
    kinds: frozenset[str] = frozenset()  # what ``auto`` reads the object rows as (`row_kind`)
    source_starts: tuple[int, ...] | None = None  # the first row of each source (local engine)


@dataclass(frozen=True)
class Encoder:
    """What turns rows into token ids and loss masks: a tokenizer, a sample format, and the text budget
    (characters per field kept around a cut, `tightpack.prepare.formats.render_row`; None: no cut)."""

    spec: TokenizerSpec
    config: FormatConfig
    text_budget: int | None = None

    def __post_init__(self) -> None:
        if self.config.format in PREFERENCE_FORMATS:
            raise TightpackError(
                f"format {self.config.format!r} rows are preference units, not SFT samples: pack them with "
                "tightpack pack (--format preference|kto|groups) or collate them with "
                "tightpack.runtime.preference_collate.PreferenceCollator",
                parameters=("format",),
            )

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


def parse_chunk(chunk: Chunk) -> Iterator[tuple[int, object]]:
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


def _render_chunk(
    encoder: Encoder, chunk: Chunk
) -> tuple[list[tuple[int, Rendered]], list[BadRow], frozenset[str]]:
    spec, config = encoder.spec, encoder.config
    template, special = spec.chat_template, spec.special_tokens
    rendered: list[tuple[int, Rendered]] = []
    bad_rows = []
    kinds = set()
    for offset, row in parse_chunk(chunk):
        try:
            if isinstance(row, RowError):
                raise row
            if isinstance(row, dict):
                kinds.add(row_kind(row, config))
            sample = render_row(row, config, template, special, encoder.text_budget)
            _check_encodable(sample.text)
            rendered.append((offset, sample))
        except RowError as error:
            bad_rows.append(BadRow(chunk.first_sample + offset, chunk.location(offset), str(error)))
    return rendered, bad_rows, frozenset(kinds)


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


def _assemble(
    encoder: Encoder,
    chunk: Chunk,
    rendered: list[tuple[int, Rendered]],
    encoded: list,
    bad_rows,
    kinds: frozenset[str] = frozenset(),
) -> ChunkResult:
    """Flat token and mask arrays of the chunk's samples, EOS appended."""
    spec = encoder.spec
    body = byte_level_body(spec, rendered, encoded) if spec.byte_level is not None else None
    if body is None:
        if spec.byte_level is not None:  # rare: re-encode this chunk with offsets
            encoded = encode_with_offsets(spec, rendered)
        body = offsets_body(rendered, encoded)
    ids, lengths, mask, segment_starts = body
    eos_supervised = np.array([sample.eos_supervised for _, sample in rendered], dtype=bool)
    append = np.array([sample.append_eos for _, sample in rendered], dtype=bool)
    tokens, loss_mask, stored = append_eos(ids, mask, lengths, spec.eos_id, eos_supervised, append)
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
        tokens,
        loss_mask,
        stored,
        source_index,
        bad_rows,
        len(chunk),
        segments,
        texts_cut=cut,
        media=media,
        kinds=kinds,
    )


def _pretokenized_chunk(encoder: Encoder, chunk: Chunk) -> ChunkResult:
    spec = encoder.spec
    rows = None if chunk.batch is not None else [row for _, row in parse_chunk(chunk)]
    tokens, loss_mask, stored, good, bad = pretokenized_arrays(chunk, rows, spec.vocab_size, spec.eos_id)
    bad_rows = [BadRow(chunk.first_sample + offset, chunk.location(offset), reason) for offset, reason in bad]
    return ChunkResult(tokens, loss_mask, stored, chunk.first_sample + good, bad_rows, rows=len(chunk))


def encode_chunk(encoder: Encoder, chunk: Chunk) -> ChunkResult:
    """Parse, format and tokenize one chunk."""
    if encoder.config.format == "tokens":
        return _pretokenized_chunk(encoder, chunk)
    rendered, bad_rows, kinds = _render_chunk(encoder, chunk)
    return _assemble(encoder, chunk, rendered, encode_texts(encoder.spec, rendered), bad_rows, kinds)


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
            rendered, bad_rows, kinds = _render_chunk(encoder, chunk)
            encoding = thread.submit(encode_texts, encoder.spec, rendered)
            current = (chunk, rendered, encoding, bad_rows, kinds)
            if previous is not None:
                yield _assemble(encoder, *previous[:2], previous[2].result(), *previous[3:])
            previous = current
        if previous is not None:
            yield _assemble(encoder, *previous[:2], previous[2].result(), *previous[3:])


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
        raise TightpackError(f"workers must be at least 1, got {workers}", parameters=("workers",))
    spec.byte_level  # noqa: B018 - computed here once, inherited by forked workers
    reset_warnings()  # each run reports an unknown message key once (once per worker process)
    if config.template_vars and spec.chat_template is None and config.format in ("chat", "auto"):
        raise TightpackError(
            f"template variables (template_vars) are set but tokenizer {spec.name!r} has no chat "
            "template: the built-in template takes none; drop them or use a tokenizer with a chat template",
            parameters=("template_vars",),
        )
    writer = TokenStoreWriter(store_dir)
    rows_read, bad_rows, texts_cut, kinds = 0, [], 0, set()

    def consume(result: ChunkResult) -> None:
        nonlocal rows_read, texts_cut
        if result.bad_rows and not skip_bad_rows:
            raise bad_row_error(result.bad_rows[0])
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
        kinds.update(result.kinds)
        if on_rows is not None:
            on_rows(result.rows)

    encoder = Encoder(spec, config, text_budget)
    if workers == 1:
        for result in _tokenize_in_process(encoder, chunks):
            consume(result)
    else:
        for result in map_in_processes(
            tokenize_chunk, chunks, workers, initializer=_init_worker, initargs=(encoder, True)
        ):
            consume(result)
    return TokenizeReport(writer.close(), rows_read, bad_rows, texts_cut=texts_cut, kinds=frozenset(kinds))
