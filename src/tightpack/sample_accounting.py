"""Which tokenized samples a packing run keeps, and the counts of the manifest (`account_samples`).

The long-sample policy (truncate, drop, error; samples with images or videos are dropped, never
truncated), the no-supervision rule (a sample with no supervised
token left is excluded), the overlay store of truncated samples, and every count and excluded source
row the manifest reports. `tightpack.pipeline` calls it between tokenizing and planning.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tightpack.core.alignment import aligned_lengths
from tightpack.core.long_samples import LongSampleCut, cut_long_samples
from tightpack.core.parted_store import PartedStore
from tightpack.core.token_store import TokenStore
from tightpack.core.truncation import REASONS
from tightpack.errors import TightpackError
from tightpack.pack_config import PackConfig

__all__ = ["account_samples"]


def account_samples(store: TokenStore | PartedStore, config: PackConfig, report, staging: Path):
    """Apply the long-sample policy and the no-supervision rule; count everything.

    ``store`` is the local engine's token store, whose long samples are cut here, or the parts the
    Ray engine's workers wrote, with the cuts they made (``report.cut``): of those only per-sample
    tables are read.

    Returns counts, the samples kept (bool ``[num_samples]``), their aligned lengths, the excluded
    source rows by reason, and the overlay of truncated samples (or None).
    """
    # Few arrays over the samples, updated in place: the Ray driver's memory is mostly these
    # (benchmarks/bench_driver_memory.py). Source rows are looked up for the listed samples only.
    real = store.lengths
    real -= 1  # runtime lengths; below, what each keeps
    cap = config.cap
    long = real > cap
    if long.any() and config.long_samples == "error":
        first = np.flatnonzero(long)[:1]
        raise TightpackError(
            f"{int(long.sum())} samples are longer than the cap of {cap} tokens (first: source row "
            f"{int(store.source_rows(first)[0])}, {int(real[first[0]])} tokens); use --long-samples "
            "truncate|drop or a larger --pack-size/--max-seq-length"
        )
    dropped_long = long if config.long_samples == "drop" else np.zeros_like(long)
    if config.long_samples == "truncate" and config.format.vision is not None:
        dropped_long |= long & store.has_media()  # a cut could split an image's tokens: never cut those
    truncated = long & ~dropped_long
    del long
    tokens_in = int(real.sum())
    supervised = store.label_supervised()  # whole; below, what each keeps
    supervised_in = int(supervised.sum())
    cut = LongSampleCut.none()
    if truncated.any():
        cut = report.cut
        if cut is None:
            method = config.format.truncation_method
            cut = cut_long_samples(store, np.flatnonzero(truncated), cap + 1, method, staging / "_truncated")
        elif not np.array_equal(cut.samples, np.flatnonzero(truncated)):
            raise RuntimeError("the workers cut other samples than those over the cap")  # a bug
    lost_to_truncation = (cut.supervised == 0) & (supervised[cut.samples] > 0)  # over cut samples
    supervised[cut.samples] = cut.supervised
    np.minimum(real, cap, out=real)
    real[cut.samples] = cut.lengths - 1
    no_supervised = supervised == 0
    no_supervised &= ~dropped_long
    keep = ~dropped_long
    keep &= ~no_supervised
    tokens_packed = int(np.sum(real, where=keep))
    supervised_packed = int(np.sum(supervised, where=keep))
    del supervised
    aligned = aligned_lengths(real, config.multiple, cap, out=real)  # in place: real is spent
    del real
    kept_cut = keep[cut.samples]
    by_reason = {
        reason: store.source_rows(cut.samples[kept_cut & (cut.reasons == code)]).tolist()
        for code, reason in enumerate(REASONS)
    }
    no_supervised_rows = np.flatnonzero(no_supervised)
    lost_rows = cut.samples[lost_to_truncation]
    counts = {
        "samples_in": report.rows_read,
        "bad_rows": len(report.bad_rows),
        "tokenized": len(store),
        "packed": int(keep.sum()),
        "truncated": int(kept_cut.sum()),
        **{f"truncated_{reason}": len(rows) for reason, rows in by_reason.items()},
        "dropped_long": int(dropped_long.sum()),
        "no_supervised": len(no_supervised_rows),
        "no_supervised_in_source": len(no_supervised_rows) - len(lost_rows),
        "no_supervised_after_truncation": len(lost_rows),
        "texts_cut_before_tokenizing": report.texts_cut,
        "tokens_in": tokens_in,
        "tokens_packed": tokens_packed,
        "tokens_lost": tokens_in - tokens_packed,
        "supervised_in": supervised_in,
        "supervised_packed": supervised_packed,
        "supervised_lost": supervised_in - supervised_packed,
        "alignment_padding": int(np.sum(aligned, where=keep)) - tokens_packed,
    }
    excluded = {
        "truncated": store.source_rows(cut.samples[kept_cut]).tolist(),
        "truncated_by_reason": by_reason,
        "dropped_long": store.source_rows(np.flatnonzero(dropped_long)).tolist(),
        "no_supervised": store.source_rows(no_supervised_rows).tolist(),
        "no_supervised_after_truncation": store.source_rows(lost_rows).tolist(),
    }
    overlay = cut.overlay
    return counts, keep, aligned, excluded, overlay
