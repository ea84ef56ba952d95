"""The token store: tokenized samples as flat memory-mapped arrays on disk.

Layout of a store folder (all little-endian, native numpy ``.bin`` files):

- ``tokens.bin``     int32 ``[total_tokens]``: every sample's token ids, back to back (EOS included);
- ``loss_mask.bin``  int8  ``[total_tokens]``: 1 where the token is a training target (unshifted: the
  flag belongs to the token itself, not to the position that predicts it);
- ``offsets.bin``    int64 ``[num_samples + 1]``: sample ``i`` is ``tokens[offsets[i]:offsets[i+1]]``;
- ``source_index.bin`` int64 ``[num_samples]``: the input row each sample came from;
- ``segment_offsets.bin`` int64 ``[num_samples + 1]``, ``segment_starts.bin`` int32,
  ``segment_kinds.bin`` int8, ``segment_units.bin`` int32 ``[num_segments]``: the parts of every sample
  that truncation treats differently (`tightpack.core.truncation`): sample ``i`` has the segments
  ``segment_offsets[i]:segment_offsets[i+1]``, each starting at a token relative to the sample;
- ``media.jsonl`` and ``media_offsets.bin`` int64 ``[num_samples + 1]`` (vision stores only): one
  line per sample, the JSON array of its images and videos (``[]`` for none); sample ``i`` is the
  bytes ``media_offsets[i]:media_offsets[i+1]`` (`tightpack.prepare.vision_rows.media_json`);
- ``store.json``     counts and a format version.

Samples are appended chunk by chunk; memory never holds more than one chunk of tokens. Readers map
the files, so a store of any size opens in constant memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STORE_FORMAT_VERSION = 2
_SUM_CHUNK_TOKENS = 1 << 24
"""Tokens summed per step by `TokenStore.label_supervised`, bounding its temporaries."""


class TokenStoreWriter:
    """Append-only writer of a token store folder.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> writer = TokenStoreWriter(folder)
    >>> tokens, mask = np.array([5, 6, 7], np.int32), np.array([0, 1, 1], np.int8)
    >>> writer.append(tokens, mask, lengths=np.array([2, 1]), source_index=np.array([0, 1]))
    >>> store = writer.close()
    >>> store.sample_tokens(1).tolist(), store.lengths.tolist()
    ([7], [2, 1])
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._tokens = open(self.directory / "tokens.bin", "wb")  # closed in close()
        self._mask = open(self.directory / "loss_mask.bin", "wb")
        self._lengths: list[np.ndarray] = []
        self._sources: list[np.ndarray] = []
        self._segments: list[Segments] = []
        self._media = None  # media.jsonl, opened by the first sample with media
        self._media_bytes: list[np.ndarray] = []
        self._samples = 0

    def append(
        self,
        tokens: np.ndarray,
        loss_mask: np.ndarray,
        lengths: np.ndarray,
        source_index: np.ndarray,
        segments: Segments | None = None,
        media: list[str] | None = None,
    ) -> None:
        """Append samples: their concatenated ``tokens`` and ``loss_mask``, per-sample ``lengths`` and
        source rows, their `Segments` (None: samples without structure) and the JSON of their media
        (None: none). ``lengths`` must sum to ``len(tokens)``."""
        if (
            int(np.sum(lengths)) != len(tokens)
            or len(tokens) != len(loss_mask)
            or len(lengths) != len(source_index)
            or (segments is not None and len(segments.counts) != len(lengths))
            or (media is not None and len(media) != len(lengths))
        ):
            raise ValueError(
                "token store append: tokens, loss_mask, lengths, source_index, segments disagree"
            )
        self._tokens.write(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
        self._mask.write(np.ascontiguousarray(loss_mask, dtype=np.int8).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._sources.append(np.asarray(source_index, dtype=np.int64))
        self._segments.append(segments if segments is not None else Segments.none(len(lengths)))
        if media is not None and self._media is None:
            self._media = open(self.directory / "media.jsonl", "wb")  # closed in close()
            self._write_media(["[]"] * self._samples)
        if self._media is not None:
            self._write_media(media if media is not None else ["[]"] * len(lengths))
        self._samples += len(lengths)

    def _write_media(self, lines: list[str]) -> None:
        encoded = [line.encode() + b"\n" for line in lines]
        self._media.write(b"".join(encoded))
        self._media_bytes.append(np.fromiter(map(len, encoded), np.int64, len(encoded)))

    def close(self) -> TokenStore:
        """Finish the files and open the store for reading."""
        self._tokens.close()
        self._mask.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        offsets.tofile(self.directory / "offsets.bin")
        sources = np.concatenate(self._sources) if self._sources else np.zeros(0, np.int64)
        sources.tofile(self.directory / "source_index.bin")
        segments = Segments.concatenate(self._segments)
        segment_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(segments.counts, out=segment_offsets[1:])
        segment_offsets.tofile(self.directory / "segment_offsets.bin")
        segments.starts.astype(np.int32).tofile(self.directory / "segment_starts.bin")
        segments.kinds.astype(np.int8).tofile(self.directory / "segment_kinds.bin")
        segments.units.astype(np.int32).tofile(self.directory / "segment_units.bin")
        meta = {
            "format_version": STORE_FORMAT_VERSION,
            "num_samples": len(lengths),
            "num_tokens": int(offsets[-1]),
            "num_segments": len(segments.starts),
        }
        if self._media is not None:
            self._media.close()
            media_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(np.concatenate(self._media_bytes), out=media_offsets[1:])
            media_offsets.tofile(self.directory / "media_offsets.bin")
            meta["media"] = True
        (self.directory / "store.json").write_text(json.dumps(meta, indent=2) + "\n")
        return TokenStore.open(self.directory)


@dataclass(frozen=True)
class Segments:
    """Segments of consecutive samples (`tightpack.core.truncation`): ``counts`` per sample, then
    every segment's token ``starts`` (relative to its sample), ``kinds`` and ``units``, sample by sample."""

    counts: np.ndarray
    starts: np.ndarray
    kinds: np.ndarray
    units: np.ndarray

    @classmethod
    def none(cls, samples: int) -> Segments:
        """``samples`` samples without segments."""
        empty = np.zeros(0, np.int64)
        return cls(np.zeros(samples, np.int64), empty, empty, empty)

    @classmethod
    def concatenate(cls, parts: list[Segments]) -> Segments:
        if not parts:
            return cls.none(0)
        return cls(
            *(np.concatenate([getattr(part, name) for part in parts]) for name in cls.__dataclass_fields__)
        )


def _map(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


@dataclass(frozen=True)
class TokenStore:
    """A read-only token store (see the module docstring for the layout)."""

    directory: Path
    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    source_index: np.ndarray
    segments: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    media_offsets: np.ndarray | None = None

    @classmethod
    def open(cls, directory: str | Path) -> TokenStore:
        directory = Path(directory)
        meta = json.loads((directory / "store.json").read_text())
        if meta.get("format_version") != STORE_FORMAT_VERSION:
            raise ValueError(
                f"token store {directory} has format {meta.get('format_version')}, "
                f"expected {STORE_FORMAT_VERSION}"
            )
        n, total, segments = meta["num_samples"], meta["num_tokens"], meta["num_segments"]
        return cls(
            directory=directory,
            tokens=_map(directory / "tokens.bin", np.int32, total),
            loss_mask=_map(directory / "loss_mask.bin", np.int8, total),
            offsets=np.fromfile(directory / "offsets.bin", dtype=np.int64, count=n + 1),
            source_index=np.fromfile(directory / "source_index.bin", dtype=np.int64, count=n),
            segments=(
                np.fromfile(directory / "segment_offsets.bin", dtype=np.int64, count=n + 1),
                np.fromfile(directory / "segment_starts.bin", dtype=np.int32, count=segments),
                np.fromfile(directory / "segment_kinds.bin", dtype=np.int8, count=segments),
                np.fromfile(directory / "segment_units.bin", dtype=np.int32, count=segments),
            ),
            media_offsets=(
                np.fromfile(directory / "media_offsets.bin", dtype=np.int64, count=n + 1)
                if meta.get("media")
                else None
            ),
        )

    @staticmethod
    def counts(directory: str | Path) -> tuple[int, int]:
        """``(num_samples, num_tokens)`` of the store at ``directory``, from ``store.json`` alone."""
        meta = json.loads((Path(directory) / "store.json").read_text())
        return meta["num_samples"], meta["num_tokens"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def spans(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ``(starts, ends)`` of ``samples`` in ``tokens``, int64 each."""
        return self.offsets[samples], self.offsets[samples + 1]

    def source_rows(self, samples: np.ndarray) -> np.ndarray:
        """Source rows of ``samples``, int64."""
        return self.source_index[samples]

    def has_media(self) -> np.ndarray:
        """Whether each sample has images or videos, bool ``[num_samples]`` (all False without media)."""
        if self.media_offsets is None:
            return np.zeros(len(self), dtype=bool)
        return np.diff(self.media_offsets) > len(b"[]\n")

    def media_json(self, samples: np.ndarray) -> list[str]:
        """The media JSON of ``samples`` (``"[]"`` for none), read from ``media.jsonl``."""
        if self.media_offsets is None:
            return ["[]"] * len(samples)
        data = np.memmap(self.directory / "media.jsonl", dtype=np.uint8, mode="r")
        starts, ends = self.media_offsets[samples], self.media_offsets[np.asarray(samples) + 1] - 1
        return [bytes(data[a:b]).decode() for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]

    def label_supervised(self) -> np.ndarray:
        """Label-aligned supervised tokens of every sample: ``sum(mask[1:n])`` (token 0 is never a
        target), int64 ``[num_samples]``, summed a bounded number of tokens at a time."""
        n, offsets = len(self), self.offsets
        supervised = np.zeros(n, np.int64)
        first = 0
        while first < n:
            stop = int(np.searchsorted(offsets, offsets[first] + _SUM_CHUNK_TOKENS, side="right")) - 1
            stop = min(max(first + 1, stop), n)
            base = offsets[first]
            cumulative = np.zeros(offsets[stop] - base + 1, dtype=np.int64)
            np.cumsum(self.loss_mask[base : offsets[stop]], out=cumulative[1:])
            starts, ends = offsets[first:stop] - base, offsets[first + 1 : stop + 1] - base
            supervised[first:stop] = cumulative[ends] - cumulative[np.minimum(starts + 1, ends)]
            first = stop
        return supervised

    @property
    def lengths(self) -> np.ndarray:
        """Stored length of every sample (tokens, EOS included), int64 ``[num_samples]``."""
        return np.diff(self.offsets)

    def sample_tokens(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[index] : self.offsets[index + 1]])


def append_eos(
    ids: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    eos_id: int,
    eos_supervised: np.ndarray,
    append: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples stored back to back, each ending with EOS (appended unless it is already the last
    token), the EOS supervised where ``eos_supervised``. Returns tokens (int32), mask (int8) and the
    stored lengths. ``append`` (bool per sample, default all True): where False nothing is appended
    and the mask is left as it is (a chat template's own end marker ends that sample).

    >>> tokens, mask, stored = append_eos(np.array([5, 6, 9, 7]), np.array([0, 1, 0, 1]), np.array([2, 2]),
    ...                                   9, np.array([True, False]))
    >>> tokens.tolist(), mask.tolist(), stored.tolist()
    ([5, 6, 9, 9, 7, 9], [0, 1, 1, 0, 1, 0], [3, 3])
    """
    ends = np.cumsum(lengths)
    last = np.maximum(ends - 1, 0)
    has_eos = (lengths > 0) & (ids[last] == eos_id) if len(ids) else np.zeros(len(lengths), dtype=bool)
    appended = np.ones(len(lengths), dtype=bool) if append is None else append
    needs = ~has_eos & appended
    tokens = np.insert(ids, ends[needs], eos_id).astype(np.int32)
    stored = lengths + needs
    loss_mask = np.insert(mask, ends[needs], 0).astype(np.int8)
    loss_mask[(np.cumsum(stored) - 1)[eos_supervised & appended]] = 1
    return tokens, loss_mask, stored
