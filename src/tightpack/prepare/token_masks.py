"""Token-level loss masks: the rendered texts of a chunk -> token ids, the per-token loss mask and the
token start of every truncation segment (`tightpack.prepare.tokenize` assembles them into a chunk).

The loss mask is computed from character spans: a token is supervised when its characters overlap
a supervised span. For byte-level BPE tokenizers the token offsets follow from token byte lengths
(`tightpack.prepare.tokenizer.ByteLevelLayout`), so the tokenizer tracks none and the overlap test is
vectorized over the chunk; otherwise only the span ends are looked up (``Encoding.char_to_token``),
so the cost is per span, never per token in Python.
"""

from __future__ import annotations

import itertools

import numpy as np

from tightpack.core.ranges import in_ranges
from tightpack.prepare.rendered import Rendered
from tightpack.prepare.tokenizer import TokenizerSpec


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


def encode_texts(spec: TokenizerSpec, rendered: list[tuple[int, Rendered]]) -> list:
    """Token ids of the rendered texts: lists of ints on the byte-level fast path (the tokenizer
    tracks no offsets; special tokens are added by `byte_level_body`), else ``Encoding`` objects."""
    if spec.byte_level is None:
        return encode_with_offsets(spec, rendered)
    texts = [sample.text for _, sample in rendered]
    batch = spec.backend.encode_batch_fast(texts, add_special_tokens=False)
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


def byte_level_body(spec: TokenizerSpec, rendered: list[tuple[int, Rendered]], id_lists: list[list[int]]):
    """Flat ids, lengths and supervised mask of the samples, from token byte lengths (no offsets).

    Returns None when some sample's tokens do not cover its UTF-8 bytes exactly (an added token that
    strips whitespace, say): the chunk then takes the offsets path.
    """
    layout = spec.byte_level
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


def offsets_body(rendered: list[tuple[int, Rendered]], encodings: list):
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


def encode_with_offsets(spec: TokenizerSpec, rendered: list[tuple[int, Rendered]]) -> list:
    backend = spec.backend
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
