"""A token store made of parts: one `TokenStore` folder per piece of input, read as one store.

``--engine ray`` tokenizes pieces of the inputs on many workers; each worker writes the samples of
its piece as a store folder of its own (a *part*) on storage every node reaches, instead of sending
tokens to the driver. `PartedStore` numbers the samples of all parts in input order (part by part)
and reads them where they lie: the driver needs only the per-sample lengths, source rows and
supervised counts, and the workers that write the packs read the tokens of their packs' samples.

Sample ``i`` of part ``p`` is global sample ``first_sample[p] + i``; its source row is
``first_row[p]`` plus the row the part recorded (rows are numbered within a piece, because a worker
does not know how many rows the pieces before its own hold). Token positions are global too:
``first_token[p]`` plus the position within the part, so `PartedStore.tokens` reads like the flat
``tokens`` array of a single store.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tightpack.core.token_store import TokenStore

SUPERVISED_FILE = "supervised.bin"
"""int64 ``[num_samples]`` in a part folder: label-aligned supervised tokens of every sample
(`TokenStore.label_supervised`), so that the driver never reads a loss mask."""


def write_supervised(store: TokenStore) -> None:
    """Write `SUPERVISED_FILE` into a finished part's folder."""
    store.label_supervised().tofile(store.directory / SUPERVISED_FILE)


def _by_part(starts: np.ndarray, positions: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(part, where)`` for every part holding some of ``positions`` (global numbers, the parts
    starting at ``starts``): ``positions[where]`` are that part's. One sort, whatever the number of
    parts touched."""
    if not len(positions):
        return
    part = np.searchsorted(starts, positions, side="right") - 1
    by_part = np.argsort(part, kind="stable")
    touched, firsts = np.unique(part[by_part], return_index=True)
    stops = np.append(firsts[1:], len(positions))
    for p, first, stop in zip(touched.tolist(), firsts.tolist(), stops.tolist(), strict=True):
        yield p, by_part[first:stop]


class _PartedArray:
    """``tokens`` or ``loss_mask`` of a `PartedStore`: indexed by global token positions."""

    def __init__(self, store: PartedStore, name: str) -> None:
        self.store, self.name = store, name

    def __len__(self) -> int:
        return int(self.store.first_token[-1])

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        first_token = self.store.first_token
        values = np.empty(len(positions), dtype=np.int32 if self.name == "tokens" else np.int8)
        for p, at in _by_part(first_token, positions):
            values[at] = getattr(self.store.part(p), self.name)[positions[at] - first_token[p]]
        return values


@dataclass
class PartedStore:
    """Parts (store folders) read as one store, in part order.

    Attributes:
        parts: the part folders, in input order.
        first_sample: int64 ``[num_parts + 1]``, global index of each part's first sample (and the total).
        first_token: int64 ``[num_parts + 1]``, global position of each part's first token (and the total).
        first_row: int64 ``[num_parts]``, source row of each part's row 0.

    >>> import tempfile
    >>> from tightpack.core.token_store import TokenStoreWriter
    >>> folders = [tempfile.mkdtemp(), tempfile.mkdtemp()]
    >>> for folder, tokens in zip(folders, ([5, 6, 7], [8, 9])):
    ...     writer = TokenStoreWriter(folder)
    ...     writer.append(np.array(tokens), np.ones(len(tokens)), np.array([len(tokens)]), np.array([0]))
    ...     _ = writer.close()
    >>> store = PartedStore.from_parts(folders, first_row=[0, 1])
    >>> store.tokens[np.array([4, 0])].tolist(), store.lengths.tolist(), store.source_index.tolist()
    ([9, 5], [3, 2], [0, 1])
    """

    parts: list[Path]
    first_sample: np.ndarray
    first_token: np.ndarray
    first_row: np.ndarray
    _open: dict[int, TokenStore] = field(default_factory=dict, repr=False)

    @classmethod
    def from_parts(cls, parts: list[str | Path], first_row) -> PartedStore:
        """The store of ``parts``; counts come from each part's ``store.json`` (no array is read)."""
        paths = [Path(part) for part in parts]
        samples, tokens = np.zeros(len(paths) + 1, np.int64), np.zeros(len(paths) + 1, np.int64)
        for index, path in enumerate(paths):
            samples[index + 1], tokens[index + 1] = TokenStore.counts(path)
        return cls(paths, np.cumsum(samples), np.cumsum(tokens), np.asarray(first_row, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.first_sample[-1])

    def __getstate__(self) -> dict:  # memory maps are opened again where the store is unpickled
        return {**self.__dict__, "_open": {}}

    def part(self, index: int) -> TokenStore:
        """Part ``index``, opened (memory-mapped) on first use."""
        if index not in self._open:
            self._open[index] = TokenStore.open(self.parts[index])
        return self._open[index]

    @property
    def tokens(self) -> _PartedArray:
        return _PartedArray(self, "tokens")

    @property
    def loss_mask(self) -> _PartedArray:
        return _PartedArray(self, "loss_mask")

    def _table(self, part: int, name: str, extra: int = 0) -> np.ndarray:
        """int64 table ``name`` of a part (``extra`` entries past one per sample), read, not kept:
        the driver reads every part's tables once and holds only what it computes from them."""
        count = int(self.first_sample[part + 1] - self.first_sample[part]) + extra
        return np.fromfile(self.parts[part] / name, dtype=np.int64, count=count)

    def _concatenate(self, read, dtype=np.int64) -> np.ndarray:
        """One array over all samples, ``read(part)`` part by part into it."""
        values = np.empty(len(self), dtype)
        for part in range(len(self.parts)):
            values[self.first_sample[part] : self.first_sample[part + 1]] = read(part)
        return values

    @property
    def lengths(self) -> np.ndarray:
        """Stored length of every sample, int32 ``[num_samples]`` (half the driver's memory of int64)."""
        return self._concatenate(lambda p: np.diff(self._table(p, "offsets.bin", extra=1)), np.int32)

    @property
    def source_index(self) -> np.ndarray:
        """Source row of every sample, int64 ``[num_samples]``."""
        return self._concatenate(lambda p: self._table(p, "source_index.bin") + self.first_row[p])

    def label_supervised(self) -> np.ndarray:
        """Label-aligned supervised tokens of every sample, int32 ``[num_samples]``, as each part's
        worker counted them (`SUPERVISED_FILE`)."""
        return self._concatenate(lambda p: self._table(p, SUPERVISED_FILE), np.int32)

    def spans(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global token ``(starts, ends)`` of ``samples``, int64 each."""
        samples = np.asarray(samples, dtype=np.int64)
        starts, ends = np.empty(len(samples), np.int64), np.empty(len(samples), np.int64)
        for p, at in _by_part(self.first_sample, samples):
            local = samples[at] - self.first_sample[p]
            offsets = self.part(p).offsets
            starts[at] = offsets[local] + self.first_token[p]
            ends[at] = offsets[local + 1] + self.first_token[p]
        return starts, ends

    def source_rows(self, samples: np.ndarray) -> np.ndarray:
        """Source rows of ``samples``, int64 (the tables of the parts they are in are read, not kept)."""
        samples = np.asarray(samples, dtype=np.int64)
        rows = np.empty(len(samples), np.int64)
        for p, at in _by_part(self.first_sample, samples):
            table = self._table(p, "source_index.bin")
            rows[at] = table[samples[at] - self.first_sample[p]] + self.first_row[p]
        return rows

    def select(self, samples: np.ndarray) -> SelectedSamples:
        """A view numbering ``samples`` 0, 1, ... (the samples of one shard, in plan order)."""
        return SelectedSamples(self, np.asarray(samples, dtype=np.int64))


@dataclass
class SelectedSamples:
    """Some samples of a `PartedStore` renumbered from 0: what `gather_packs` needs to write one
    shard (``spans``, ``source_rows``, ``tokens``, ``loss_mask``) without the whole store's tables."""

    store: PartedStore
    samples: np.ndarray

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> _PartedArray:
        return self.store.tokens

    @property
    def loss_mask(self) -> _PartedArray:
        return self.store.loss_mask

    def spans(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.store.spans(self.samples[samples])

    def source_rows(self, samples: np.ndarray) -> np.ndarray:
        return self.store.source_rows(self.samples[samples])
