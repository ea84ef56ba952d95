"""Packed Parquet files: filling a `PackPlan` with tokens from a token store, and writing the rows.

The file format is Megatron-Bridge's (docs/contract.md §2.7), which reads any integer list columns
and tolerates extra columns:

============== ============== ==========================================================
column          type           content (one row = one pack)
============== ============== ==========================================================
input_ids       list<int32>    the stored tokens of every sequence, back to back
loss_mask       list<int8>     label-aligned: 1 at position t when token t+1 of the same
                               sequence is a target (the stored mask shifted by one)
seq_start_id    list<int32>    start offset of every sequence in the row (first is 0)
sample_index    list<int64>    source row of every sequence (provenance, ours)
seq_len         list<int32>    real runtime length of every sequence, before alignment
                               padding (ours; the reference infers it by stripping EOS)
media           list<string>   vision packs only: per sequence, the JSON array of its images
                               and videos (files, patch grids, frame rates), read by
                               `tightpack.runtime.vision_packs` (ours)
============== ============== ==========================================================

Each sequence is stored as ``aligned + 1`` tokens: alignment padding (the pad id, loss 0) when the
sample is shorter, truncation when longer. A row holds ``sum(aligned) + n`` tokens, and collates to
``sum(aligned) <= pack_size`` runtime tokens. Packs are gathered in chunks with vectorized index
arithmetic straight from the memory-mapped store: no per-token Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tightpack.core.checksums import file_digest
from tightpack.core.planner import PackPlan
from tightpack.core.ranges import in_ranges
from tightpack.core.token_store import TokenStore

COLUMNS = ("input_ids", "loss_mask", "seq_start_id", "sample_index", "seq_len")
_CHUNK_TOKENS = 1 << 22  # tokens gathered per step: bounds the temporaries to ~100 MB


def default_row_group_size(pack_size: int) -> int:
    """Packs per row group: about 256k tokens, so that reading one pack decodes little else.

    >>> default_row_group_size(4096), default_row_group_size(8192), default_row_group_size(1 << 20)
    (64, 32, 1)
    """
    return int(np.clip((1 << 18) // pack_size, 1, 128))


@dataclass
class PackedRows:
    """A run of packed rows as flat arrays (CSR): ``row_offsets`` over tokens, ``seq_offsets`` over
    sequences; ``seq_start_id`` is relative to each row."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    row_offsets: np.ndarray
    seq_start_id: np.ndarray
    seq_offsets: np.ndarray
    sample_index: np.ndarray
    seq_len: np.ndarray
    media: list[str] | None = None  # per sequence (vision stores only)

    def to_table(self) -> pa.Table:
        def lists(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
            return pa.ListArray.from_arrays(_arrow(offsets.astype(np.int32)), _arrow(values))

        columns = {
            "input_ids": lists(self.row_offsets, self.input_ids.astype(np.int32, copy=False)),
            "loss_mask": lists(self.row_offsets, self.loss_mask.astype(np.int8, copy=False)),
            "seq_start_id": lists(self.seq_offsets, self.seq_start_id.astype(np.int32)),
            "sample_index": lists(self.seq_offsets, self.sample_index.astype(np.int64)),
            "seq_len": lists(self.seq_offsets, self.seq_len.astype(np.int32)),
        }
        if self.media is not None:
            strings = pa.array(self.media, type=pa.string())
            columns["media"] = pa.ListArray.from_arrays(_arrow(self.seq_offsets.astype(np.int32)), strings)
        return pa.Table.from_arrays(list(columns.values()), names=list(columns))


def _arrow(values: np.ndarray) -> pa.Array:
    """A numpy vector as an Arrow array, zero-copy. Built from its buffer on purpose: ``pa.array``
    inspects its input for pandas types and imports pandas when installed (0.3 s)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


@dataclass(frozen=True)
class Overlay:
    """Replacement samples for some of a store's (the truncated ones): sample ``samples[i]`` of the
    main store is replaced by sample ``rows[i]`` of ``store`` (``i`` when ``rows`` is None).

    ``samples`` is ascending. ``store`` is a `TokenStore` or, on Ray, a
    `tightpack.core.parted_store.PartedStore` of the workers' overlays.
    """

    store: TokenStore
    samples: np.ndarray
    rows: np.ndarray | None = None

    def lookup(self, samples: np.ndarray) -> np.ndarray:
        """The row of ``store`` replacing each of ``samples``, -1 where none does."""
        if not len(self.samples):
            return np.full(len(samples), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.samples, samples), len(self.samples) - 1)
        rows = at if self.rows is None else self.rows[at]
        return np.where(self.samples[at] == samples, rows, -1)

    def renumbered(self, samples: np.ndarray) -> Overlay:
        """The entries for ``samples`` only, numbered as ``samples`` are (0, 1, ...): the overlay of
        a plan of some packs whose samples were renumbered so."""
        rows = self.lookup(samples)
        replaced = np.flatnonzero(rows >= 0)
        return Overlay(self.store, replaced, rows[replaced])


def _positions(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[i], starts[i] + 1, ...`` (``counts[i]`` of each), back to back."""
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))


def gather_packs(
    store: TokenStore,
    plan: PackPlan,
    aligned: np.ndarray,
    pad_id: int,
    first_pack: int,
    stop_pack: int,
    overlay: Overlay | None = None,
) -> PackedRows:
    """Tokens and label-aligned masks of packs ``[first_pack, stop_pack)`` of a plan.

    Args:
        store: the token store the plan's sample indices refer to (a `TokenStore`, or any object
            with its ``spans``, ``source_rows``, ``tokens`` and ``loss_mask``, as
            `tightpack.core.parted_store.SelectedSamples`).
        plan: the pack plan.
        aligned: aligned runtime length of every sample, ``[num_samples]``; sequence ``i`` is stored
            as ``aligned[i] + 1`` tokens (padded with ``pad_id`` or truncated).
        pad_id: token id of alignment padding (the EOS id, as the reference).
        overlay: samples that replace some of the store's (the truncated ones), or None.
    """
    lo, hi = plan.offsets[first_pack], plan.offsets[stop_pack]
    samples = plan.order[lo:hi]
    stored = aligned[samples].astype(np.int64) + 1
    store_starts, store_ends = store.spans(samples)
    rows = np.full(len(samples), -1) if overlay is None else overlay.lookup(samples)
    replaced = rows >= 0
    if replaced.any():
        store_starts[replaced], store_ends[replaced] = overlay.store.spans(rows[replaced])
    real = np.minimum(store_ends - store_starts, stored)
    seq_starts = np.cumsum(stored) - stored
    total = int(stored.sum())
    last_token = len(store.tokens) - 1

    source = np.repeat(store_starts - seq_starts, stored)
    source += np.arange(total)
    np.minimum(source, last_token, out=source)  # padding positions may run past the store's end
    input_ids = store.tokens[source]
    source += 1
    np.minimum(source, last_token, out=source)
    # Label-aligned mask: position t trains on token t+1 of the same sequence, if that token is real.
    loss_mask = store.loss_mask[source]
    if replaced.any():  # truncated samples (few): their real tokens come from the overlay
        at = _positions(seq_starts[replaced], real[replaced])
        taken = _positions(store_starts[replaced], real[replaced])
        input_ids[at] = overlay.store.tokens[taken]
        mask_from = np.minimum(taken + 1, len(overlay.store.loss_mask) - 1)
        loss_mask[at] = overlay.store.loss_mask[mask_from]  # the last is cleared below: no label there
    padded = real < stored
    if padded.any():
        input_ids[
            in_ranges(seq_starts[padded] + real[padded], seq_starts[padded] + stored[padded], total)
        ] = pad_id
        loss_mask[in_ranges(seq_starts + real - 1, seq_starts + stored, total)] = 0
    else:
        loss_mask[seq_starts + stored - 1] = 0

    pack_sizes = plan.pack_sizes[first_pack:stop_pack]
    seq_offsets = np.concatenate(([0], np.cumsum(pack_sizes)))
    pack_tokens = np.add.reduceat(stored, seq_offsets[:-1]) if len(stored) else np.zeros(0, np.int64)
    row_offsets = np.concatenate(([0], np.cumsum(pack_tokens)))
    seq_start_id = seq_starts - np.repeat(row_offsets[:-1], pack_sizes)
    return PackedRows(
        input_ids=input_ids.astype(np.int32, copy=False),
        loss_mask=loss_mask.astype(np.int8, copy=False),
        row_offsets=row_offsets,
        seq_start_id=seq_start_id,
        seq_offsets=seq_offsets,
        sample_index=store.source_rows(samples),
        seq_len=real - 1,
        media=store.media_json(samples) if getattr(store, "media_offsets", None) is not None else None,
    )


def _pack_chunks(plan: PackPlan, stored_per_pack: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive pack ranges of at most ``limit`` stored tokens each (at least one pack)."""
    ends = np.cumsum(stored_per_pack)
    ranges, first = [], 0
    while first < len(plan):
        base = ends[first - 1] if first else 0
        stop = max(first + 1, int(np.searchsorted(ends, base + limit, side="right")))
        ranges.append((first, stop))
        first = stop
    return ranges


@dataclass(frozen=True)
class Shard:
    """One output file: packs ``[first, stop)`` of the plan, gathered and written in ``chunks`` (pack
    ranges; each is written as row groups of its own, so they decide the file's bytes)."""

    number: int
    first: int
    stop: int
    chunks: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return f"packs-{self.number:05d}.idx.parquet"

    def shifted(self) -> Shard:
        """The shard with pack numbers relative to its first pack (for a plan of its packs only)."""
        chunks = tuple((first - self.first, stop - self.first) for first, stop in self.chunks)
        return Shard(self.number, 0, self.stop - self.first, chunks)


def shard_layout(plan: PackPlan, aligned: np.ndarray, packs_per_file: int = 100_000) -> list[Shard]:
    """The files a plan is written as: ``packs_per_file`` packs each, gathered in chunks of at most
    ``_CHUNK_TOKENS`` stored tokens (cut at file boundaries)."""
    chunks = _pack_chunks(plan, plan.pack_loads(aligned) + plan.pack_sizes, _CHUNK_TOKENS)  # stored
    shards = []
    for number, file_first in enumerate(range(0, len(plan), packs_per_file)):
        file_stop = min(file_first + packs_per_file, len(plan))
        pieces = tuple(
            (max(first, file_first), min(stop, file_stop))
            for first, stop in chunks
            if stop > file_first and first < file_stop
        )
        shards.append(Shard(number, file_first, file_stop, pieces))
    return shards


def write_shard(
    store,
    plan: PackPlan,
    aligned: np.ndarray,
    directory: str | Path,
    shard: Shard,
    *,
    pad_id: int,
    row_group_size: int,
    on_packs=None,
    overlay: Overlay | None = None,
) -> dict:
    """Write ``shard`` of a plan into ``directory``; returns ``{"name", "rows", "bytes", "sha256"}``.

    ``store`` as for `gather_packs`. ``on_packs`` (optional) is called with the number of packs
    written after each chunk (progress).
    """
    path = Path(directory) / shard.name
    writer = None
    for first, stop in shard.chunks:
        table = gather_packs(store, plan, aligned, pad_id, first, stop, overlay).to_table()
        if writer is None:
            writer = pq.ParquetWriter(
                path, table.schema, compression="zstd", use_dictionary=False, write_statistics=False
            )
        writer.write_table(table, row_group_size=row_group_size)
        if on_packs is not None:
            on_packs(stop - first)
    writer.close()
    return {"name": path.name, "rows": shard.stop - shard.first, **file_digest(path)}


def write_packed_parquet(
    store: TokenStore,
    plan: PackPlan,
    aligned: np.ndarray,
    directory: str | Path,
    *,
    pad_id: int,
    row_group_size: int,
    packs_per_file: int = 100_000,
    on_packs=None,
    overlay: Overlay | None = None,
) -> list[dict]:
    """Write the packs of a plan as Parquet shards ``packs-00000.idx.parquet``, ... in ``directory``
    (`shard_layout`).

    Returns one entry per file: ``{"name", "rows", "bytes", "sha256"}``. ``on_packs`` (optional) is
    called with the number of packs written after each chunk (progress).
    """
    return [
        write_shard(
            store,
            plan,
            aligned,
            directory,
            shard,
            pad_id=pad_id,
            row_group_size=row_group_size,
            on_packs=on_packs,
            overlay=overlay,
        )
        for shard in shard_layout(plan, aligned, packs_per_file)
    ]
