"""Long samples cut to the cap, where their tokens lie (`cut_long_samples`, `LongSampleCut`).

Truncation (`tightpack.core.truncation`) decides what each sample over the cap keeps from its own
length and segments alone, so it runs wherever the samples are: on the driver over the local
engine's token store, or on each Ray worker over the part it has just written (the driver then only
gathers the results, `gathered_cut`). Either way the cut samples are written to an overlay store
(the kept tokens of each, back to back) that the pack writer reads instead of the whole sample; the
token store itself keeps whole samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tightpack.core.packed_parquet import Overlay
from tightpack.core.parted_store import PartedStore, write_supervised
from tightpack.core.token_store import TokenStore, TokenStoreWriter
from tightpack.core.truncation import TruncationMethod, plan_truncation

REASONS_FILE = "reasons.bin"
"""uint8 ``[cut samples]`` in an overlay folder: the `tightpack.core.truncation.REASONS` code of each."""

_COPY_TOKENS = 1 << 24
"""Tokens copied per step into the overlay, bounding the temporaries."""


@dataclass(frozen=True)
class LongSampleCut:
    """The samples cut to the cap, and what each kept.

    Attributes:
        samples: int64 ``[k]``, the cut samples (store indices), ascending.
        lengths: int64 ``[k]``, their stored lengths after the cut.
        supervised: int64 ``[k]``, their label-aligned supervised tokens after the cut.
        reasons: uint8 ``[k]``, `tightpack.core.truncation.REASONS` codes.
        overlay: their kept tokens, for the pack writer; None when no sample is cut.
    """

    samples: np.ndarray
    lengths: np.ndarray
    supervised: np.ndarray
    reasons: np.ndarray
    overlay: Overlay | None

    @classmethod
    def none(cls) -> LongSampleCut:
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty, np.zeros(0, np.uint8), None)


def kept_positions(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Every position of the ranges ``[start, stop)``, range after range (int64 ``[sum of lengths]``).

    >>> kept_positions(np.array([2, 10]), np.array([4, 13])).tolist()
    [2, 3, 10, 11, 12]
    """
    lengths = np.asarray(stops, dtype=np.int64) - starts
    positions = np.repeat(np.asarray(starts, dtype=np.int64) - (np.cumsum(lengths) - lengths), lengths)
    positions += np.arange(int(lengths.sum()))
    return positions


def cut_long_samples(
    store: TokenStore, samples: np.ndarray, limit: int, method: TruncationMethod, directory: str | Path
) -> LongSampleCut:
    """Cut ``samples`` of ``store`` (each over ``limit`` stored tokens: the cap + 1) and write their
    kept tokens to an overlay store at ``directory``, with their supervised counts and reasons (so
    that `gathered_cut` can read them back from there).

    The overlay's ``source_index`` holds the sample each entry replaces.
    """
    samples = np.asarray(samples, dtype=np.int64)
    if not len(samples):
        return LongSampleCut.none()
    cut = plan_truncation(store.offsets, samples, limit, store.segments, method)
    writer = TokenStoreWriter(directory)
    kept = cut.stops - cut.starts
    kept_before = np.concatenate(([0], np.cumsum(kept)))
    per_sample = kept_before[cut.range_offsets[1:]] - kept_before[cut.range_offsets[:-1]]
    ends = np.cumsum(per_sample)
    first = 0
    while first < len(samples):
        base = ends[first - 1] if first else 0
        stop = max(first + 1, int(np.searchsorted(ends, base + _COPY_TOKENS, side="right")))
        ranges = slice(cut.range_offsets[first], cut.range_offsets[stop])
        source = kept_positions(cut.starts[ranges], cut.stops[ranges])
        writer.append(
            store.tokens[source], store.loss_mask[source], per_sample[first:stop], samples[first:stop]
        )
        first = stop
    overlay_store = writer.close()
    write_supervised(overlay_store)
    cut.reasons.astype(np.uint8).tofile(Path(directory) / REASONS_FILE)
    return LongSampleCut(
        samples, per_sample, overlay_store.label_supervised(), cut.reasons, Overlay(overlay_store, samples)
    )


def gathered_cut(store: PartedStore, overlays: list[Path]) -> LongSampleCut:
    """The cuts the workers made, one overlay folder per part of ``store`` (a part that cut nothing
    has none), read back as one: the overlays become parts of a `PartedStore` whose source rows are
    the global indices of the samples they replace."""
    present = [index for index, folder in enumerate(overlays) if (folder / "store.json").exists()]
    if not present:
        return LongSampleCut.none()
    folders = [overlays[index] for index in present]
    parted = PartedStore.from_parts(folders, store.first_sample[present])
    samples = parted.source_index
    reasons = np.concatenate([np.fromfile(folder / REASONS_FILE, dtype=np.uint8) for folder in folders])
    return LongSampleCut(
        samples, parted.lengths, parted.label_supervised(), reasons, Overlay(parted, samples)
    )
