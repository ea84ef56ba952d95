"""Which tokenized samples a packing run keeps, and the counts of the manifest (`account_samples`).

The long-sample policy (truncate, drop, error), the no-supervision rule (a sample with no supervised
token left is excluded), the overlay store of truncated samples, and every count and excluded source
row the manifest reports. `tightpack.pipeline` calls it between tokenizing and planning.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tightpack.core.alignment import aligned_lengths
from tightpack.core.packed_parquet import Overlay
from tightpack.core.parted_store import PartedStore
from tightpack.core.token_store import TokenStore, TokenStoreWriter
from tightpack.core.truncation import REASONS, plan_truncation
from tightpack.errors import TightpackError
from tightpack.pack_config import PackConfig

__all__ = ["account_samples"]

_SUM_CHUNK_TOKENS = 1 << 24
"""Tokens copied per step into the overlay, bounding the temporaries."""


def account_samples(store: TokenStore | PartedStore, config: PackConfig, report, staging: Path):
    """Apply the long-sample policy and the no-supervision rule; count everything.

    ``store`` is the local engine's token store or the parts the Ray engine's workers wrote; of the
    latter only the per-sample tables are read, and the tokens of the samples truncation cuts.

    Returns counts, the samples kept (bool ``[num_samples]``), their aligned lengths, the excluded
    source rows by reason, and the overlay of truncated samples (or None).
    """
    stored, source_index = store.lengths, store.source_index
    runtime = stored - 1
    cap = config.cap
    long = runtime > cap
    if long.any() and config.long_samples == "error":
        first = int(np.flatnonzero(long)[0])
        raise TightpackError(
            f"{int(long.sum())} samples are longer than the cap of {cap} tokens (first: source row "
            f"{int(source_index[first])}, {int(runtime[first])} tokens); use --long-samples "
            "truncate|drop or a larger --pack-size/--max-seq-length"
        )
    dropped_long = long if config.long_samples == "drop" else np.zeros_like(long)
    truncated = long & ~dropped_long
    supervised_whole = store.label_supervised()
    supervised_kept = supervised_whole.copy()
    real = np.minimum(runtime, cap)
    overlay, reasons = None, np.zeros(0, np.uint8)
    if truncated.any():
        long_samples = np.flatnonzero(truncated)
        holder, held = store.samples_store(long_samples, staging / "_long")
        cut = plan_truncation(holder.offsets, held, cap + 1, holder.segments, config.format.truncation_method)
        overlay = _write_overlay(holder, cut, staging / "_truncated", long_samples, len(store))
        supervised_kept[long_samples] = overlay.store.label_supervised()
        real[long_samples] = overlay.store.lengths - 1
        reasons = cut.reasons
    no_supervised = ~dropped_long & (supervised_kept == 0)
    lost_to_truncation = no_supervised & (supervised_whole > 0)
    keep = ~dropped_long & ~no_supervised
    aligned = aligned_lengths(real, config.multiple, cap)
    truncated_rows = np.flatnonzero(truncated)
    kept_truncated = keep[truncated_rows]
    by_reason = {
        reason: source_index[truncated_rows[kept_truncated & (reasons == code)]].tolist()
        for code, reason in enumerate(REASONS)
    }
    counts = {
        "samples_in": report.rows_read,
        "bad_rows": len(report.bad_rows),
        "tokenized": len(store),
        "packed": int(keep.sum()),
        "truncated": int((truncated & keep).sum()),
        **{f"truncated_{reason}": len(rows) for reason, rows in by_reason.items()},
        "dropped_long": int(dropped_long.sum()),
        "no_supervised": int(no_supervised.sum()),
        "no_supervised_in_source": int((no_supervised & ~lost_to_truncation).sum()),
        "no_supervised_after_truncation": int(lost_to_truncation.sum()),
        "texts_cut_before_tokenizing": report.texts_cut,
        "tokens_in": int(runtime.sum()),
        "tokens_packed": int(real[keep].sum()),
        "tokens_lost": int(runtime.sum() - real[keep].sum()),
        "supervised_in": int(supervised_whole.sum()),
        "supervised_packed": int(supervised_kept[keep].sum()),
        "supervised_lost": int(supervised_whole.sum() - supervised_kept[keep].sum()),
        "alignment_padding": int((aligned - real)[keep].sum()),
    }
    excluded = {
        "truncated": source_index[truncated & keep].tolist(),
        "truncated_by_reason": by_reason,
        "dropped_long": source_index[dropped_long].tolist(),
        "no_supervised": source_index[no_supervised].tolist(),
        "no_supervised_after_truncation": source_index[lost_to_truncation].tolist(),
    }
    return counts, keep, aligned, excluded, overlay


def _write_overlay(store: TokenStore, cut, directory: Path, samples: np.ndarray, total: int) -> Overlay:
    """The truncated samples as a token store of their own (the kept ranges of each, back to back),
    written a bounded number of tokens at a time. ``cut`` plans the cut of ``samples`` (of ``total``
    samples in all), read from ``store``."""
    writer = TokenStoreWriter(directory)
    kept = cut.stops - cut.starts
    per_sample = np.add.reduceat(kept, cut.range_offsets[:-1])
    ends = np.cumsum(per_sample)
    first = 0
    while first < len(cut.samples):
        base = ends[first - 1] if first else 0
        stop = max(first + 1, int(np.searchsorted(ends, base + _SUM_CHUNK_TOKENS, side="right")))
        ranges = slice(cut.range_offsets[first], cut.range_offsets[stop])
        lengths = kept[ranges]
        source = np.repeat(cut.starts[ranges] - (np.cumsum(lengths) - lengths), lengths)
        source += np.arange(int(lengths.sum()))
        writer.append(
            store.tokens[source], store.loss_mask[source], per_sample[first:stop], samples[first:stop]
        )
        first = stop
    index = np.full(total, -1, dtype=np.int64)
    index[samples] = np.arange(len(samples))
    return Overlay(writer.close(), index)
