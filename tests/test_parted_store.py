"""`PartedStore`: parts written by workers read as one token store, and shards written from it.

Every check compares against the same samples in a single `TokenStore`, which the local engine
writes and reads: the parts must read as that store does, and a shard written from a selection of
parts must be the bytes the local engine writes for the same plan.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tightpack.core import packed_parquet
from tightpack.core.long_samples import cut_long_samples, gathered_cut
from tightpack.core.packed_parquet import shard_layout, write_packed_parquet, write_shard
from tightpack.core.parted_store import PartedStore, write_supervised
from tightpack.core.planner import PackPlan, plan_packs
from tightpack.core.token_store import Segments, TokenStoreWriter


def random_samples(rng: np.random.Generator, count: int):
    """``count`` samples: token ids, masks, lengths, source rows and a few segments each."""
    lengths = rng.integers(1, 60, count)
    tokens = rng.integers(0, 50_000, int(lengths.sum())).astype(np.int32)
    mask = (rng.random(int(lengths.sum())) < 0.6).astype(np.int8)
    rows = np.cumsum(rng.integers(1, 3, count)) - 1  # gaps: bad rows between samples
    # Segments as formatting marks them: the first at token 0, then ascending starts; kinds keep,
    # prompt, answer (or both), units -1 for kept text, else rounds in order.
    counts = np.minimum(rng.integers(1, 5, count), lengths)
    starts = np.concatenate(
        [
            np.sort(np.append(0, rng.choice(np.arange(1, n), c - 1, replace=False)))
            for n, c in zip(lengths, counts, strict=True)
        ]
    )
    kinds = rng.integers(0, 4, len(starts))
    units = np.where(kinds == 0, -1, np.concatenate([np.arange(c) // 2 for c in counts]))
    segments = Segments(counts, starts, kinds, units)
    return tokens, mask, lengths, rows, segments


def sliced_segments(segments: Segments, first: int, stop: int) -> Segments:
    """The segments of samples ``[first, stop)``."""
    ends = np.concatenate(([0], np.cumsum(segments.counts)))
    at = slice(ends[first], ends[stop])
    return Segments(segments.counts[first:stop], segments.starts[at], segments.kinds[at], segments.units[at])


def cut_in_parts(parted: PartedStore, limit: int):
    """The samples over ``limit`` cut part by part, as each worker cuts its own, and gathered."""
    overlays = [part / "truncated" for part in parted.parts]
    for index, overlay in enumerate(overlays):
        store = parted.part(index)
        cut_long_samples(store, np.flatnonzero(store.lengths > limit), limit, "right", overlay)
    return gathered_cut(parted, overlays)


@pytest.fixture(params=[0, 1, 2])
def whole_and_parts(request, tmp_path):
    """One store of 300 samples, and the same samples as parts of random sizes (rows numbered within
    each part, as a worker numbers them)."""
    rng = np.random.default_rng(request.param)
    tokens, mask, lengths, rows, segments = random_samples(rng, 300)
    ends = np.concatenate(([0], np.cumsum(lengths)))
    writer = TokenStoreWriter(tmp_path / "whole")
    writer.append(tokens, mask, lengths, rows, segments)
    whole = writer.close()
    cuts = np.unique(np.concatenate(([0, 300], rng.integers(0, 300, 12))))
    parts, first_row = [], []
    for number, (first, stop) in enumerate(itertools.pairwise(cuts)):
        base = (
            int(rows[first - 1]) + 1 if first else 0
        )  # rows before the part: its row numbering starts there
        writer = TokenStoreWriter(tmp_path / f"part-{number}")
        span = slice(ends[first], ends[stop])
        writer.append(
            tokens[span],
            mask[span],
            lengths[first:stop],
            rows[first:stop] - base,
            sliced_segments(segments, first, stop),
        )
        write_supervised(writer.close())
        parts.append(tmp_path / f"part-{number}")
        first_row.append(base)
    return whole, PartedStore.from_parts(parts, first_row)


def test_parts_read_as_the_single_store(whole_and_parts):
    whole, parted = whole_and_parts
    assert len(parted) == len(whole) and len(parted.tokens) == len(whole.tokens)
    np.testing.assert_array_equal(parted.lengths, whole.lengths)
    np.testing.assert_array_equal(parted.source_index, whole.source_index)
    np.testing.assert_array_equal(parted.label_supervised(), whole.label_supervised())
    positions = np.random.default_rng(9).integers(0, len(whole.tokens), 2_000)
    np.testing.assert_array_equal(parted.tokens[positions], whole.tokens[positions])
    np.testing.assert_array_equal(parted.loss_mask[positions], whole.loss_mask[positions])
    samples = np.random.default_rng(8).permutation(len(whole))[:100]
    for got, expected in zip(parted.spans(samples), whole.spans(samples), strict=True):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(parted.source_rows(samples), whole.source_rows(samples))
    nothing = np.zeros(0, np.int64)  # what accounting asks when a reason lists no sample
    assert parted.source_rows(nothing).tolist() == [] and parted.tokens[nothing].tolist() == []
    assert [array.tolist() for array in parted.spans(nothing)] == [[], []]


def test_long_samples_cut_part_by_part_are_the_cut_of_the_whole_store(whole_and_parts, tmp_path):
    """Each worker cuts the long samples of its part; gathered, the cut is the driver's cut of the
    single store: the same samples, lengths, supervised counts, reasons and kept tokens."""
    whole, parted = whole_and_parts
    limit = 30
    expected = cut_long_samples(
        whole, np.flatnonzero(whole.lengths > limit), limit, "right", tmp_path / "whole-cut"
    )
    gathered = cut_in_parts(parted, limit)
    assert len(gathered.samples) > 10
    for name in ("samples", "lengths", "supervised", "reasons"):
        np.testing.assert_array_equal(getattr(gathered, name), getattr(expected, name))
    np.testing.assert_array_equal(gathered.overlay.samples, expected.overlay.samples)
    everything = np.arange(len(gathered.samples))
    np.testing.assert_array_equal(
        gathered.overlay.store.tokens[np.arange(len(gathered.overlay.store.tokens))],
        expected.overlay.store.tokens,
    )
    for got, want in zip(
        gathered.overlay.store.spans(everything), expected.overlay.store.spans(everything), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_shards_written_from_selected_parts_are_the_local_bytes(whole_and_parts, tmp_path, monkeypatch):
    """Several files, chunks straddling file boundaries, cut samples: each shard written alone from
    a selection of the parts and their overlays (as a Ray task writes it) equals the file the local
    engine writes from its store and overlay."""
    whole, parted = whole_and_parts
    monkeypatch.setattr(packed_parquet, "_CHUNK_TOKENS", 300)
    limit = 34
    aligned = np.minimum(whole.lengths - 1, limit - 1) // 4 * 4 + 3  # padding, and past the cut
    plan = plan_packs(aligned, 128, algorithm="ffd")
    overlay = cut_long_samples(
        whole, np.flatnonzero(whole.lengths > limit), limit, "right", tmp_path / "whole-cut"
    ).overlay
    parted_overlay = cut_in_parts(parted, limit).overlay
    settings = {"pad_id": 7, "row_group_size": 3}
    (tmp_path / "local").mkdir()
    (tmp_path / "parted").mkdir()
    local = write_packed_parquet(
        whole, plan, aligned, tmp_path / "local", packs_per_file=9, overlay=overlay, **settings
    )
    shards = shard_layout(plan, aligned, packs_per_file=9)
    assert len(shards) > 2 and any(len(shard.chunks) > 1 for shard in shards)
    for shard, expected in zip(shards, local, strict=True):
        lo, hi = plan.offsets[shard.first], plan.offsets[shard.stop]
        samples = plan.order[lo:hi]
        own_plan = PackPlan(np.arange(hi - lo), plan.offsets[shard.first : shard.stop + 1] - lo)
        entry = write_shard(
            parted.select(samples),
            own_plan,
            aligned[samples],
            tmp_path / "parted",
            shard.shifted(),
            overlay=parted_overlay.renumbered(samples),
            **settings,
        )
        assert entry == expected
        assert (tmp_path / "parted" / entry["name"]).read_bytes() == (
            tmp_path / "local" / entry["name"]
        ).read_bytes()
