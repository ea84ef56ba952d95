"""Which tokenized samples a packing run keeps, and the counts of the manifest (`account_samples`).

The long-sample policy (truncate, drop, error; samples with images or videos are dropped, never
truncated), the no-supervision rule (a sample with no supervised
token left is excluded), the overlay store of truncated samples, and every count and excluded source
row the manifest reports. `tightpack.offline.pipeline` calls it between tokenizing and planning.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tightpack.core.alignment import aligned_lengths
from tightpack.core.long_samples import LongSampleCut, cut_long_samples
from tightpack.core.parted_store import PartedStore
from tightpack.core.token_store import TokenStore
from tightpack.core.truncation import ANSWER, KEEP, REASONS
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig


def row_name(row: int, starts, names: list[str] | None) -> str:
    """A source row (numbered over all inputs) as its input's name and its row there, where the
    inputs' first rows (``starts``) and names are known.

    >>> row_name(7, (0, 5), ["a.jsonl", "b.jsonl"]), row_name(7, None, None)
    ('b.jsonl row 3 (source row 7)', 'source row 7')
    """
    if not names or starts is None or len(starts) != len(names):
        return f"source row {row}"
    which = int(np.searchsorted(np.asarray(starts), row, side="right")) - 1
    return f"{names[which]} row {row - int(starts[which]) + 1} (source row {row})"


class LongSamplesError(TightpackError):
    """``long_samples="error"`` met samples over the cap; ``fact`` says how many and the first one,
    without the advice (``tightpack plan`` gives its own)."""

    def __init__(self, fact: str) -> None:
        super().__init__(
            f"{fact}; set long_samples to truncate or drop, or raise packed_sequence_size/max_seq_length",
            parameters=("long_samples", "packed_sequence_size", "max_seq_length"),
        )
        self.fact = fact

    def __reduce__(self):
        return type(self), (self.fact,)


def account_samples(
    store: TokenStore | PartedStore,
    config: PackConfig,
    report,
    staging: Path,
    *,
    measures: dict[str, np.ndarray] | None = None,
    source_names: list[str] | None = None,
):
    """Apply the long-sample policy and the no-supervision rule; count everything.

    ``source_names`` (the inputs' names, one per source of ``report.source_starts``) lets an error
    name a sample's file and its row there, not only its row over all inputs.

    ``measures`` (a mixture needs them) receives ``tokens`` and ``supervised``: int64
    ``[num_samples]``, each sample's runtime and supervised tokens as packed (after truncation);
    without it they are not kept (the driver's memory).

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
        raise LongSamplesError(
            f"{int(long.sum())} samples are longer than the cap of {cap} tokens (first: "
            f"{row_name(int(store.source_rows(first)[0]), report.source_starts, source_names)}, "
            f"{int(real[first[0]])} tokens)"
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
    if measures is not None:
        measures.update(tokens=real.astype(np.int64), supervised=supervised.astype(np.int64, copy=False))
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


def nothing_left(counts: dict[str, int], note: str | None) -> str:
    """Why a run keeps no sample, from `account_samples`' counts (and `truncation_loss_note`, if any)."""
    return (
        f"no sample left to pack ({counts['samples_in']} rows in, {counts['bad_rows']} bad, "
        f"{counts['dropped_long']} too long, {counts['no_supervised']} without supervised tokens)"
        + (f": {note}" if note else "")
    )


def truncation_loss_note(store: TokenStore | PartedStore, rows: list[int], cap: int) -> str:
    """Why the samples of source ``rows`` lost every supervised token to truncation, and the fix.

    What truncation never trims (`tightpack.core.truncation`: template text, role headers, the
    system turn, prompt fields that are not truncation fields) left no room for the answer under the
    cap. With the local engine's store the note gives the smallest such fixed part among them.
    """
    note = (
        f"{len(rows):,} samples lost every supervised token to truncation: the text truncation never "
        "trims (the chat template's fixed tokens such as the system turn and role headers, or a prompt "
        "template's text and its fields that are not truncation fields)"
    )
    if isinstance(store, TokenStore) and rows:
        samples = np.searchsorted(store.source_index, np.asarray(rows, dtype=np.int64))
        fixed = int(_fixed_tokens(store, samples).min())
        note += f" is {fixed:,} tokens or more before the answer in each, over the cap of {cap:,} tokens"
    else:
        note += f" fills the cap of {cap:,} tokens before their answer"
    return note + "; raise the pack size (and the per-sample cap) above that, or shorten that fixed text"


def _fixed_tokens(store: TokenStore, samples: np.ndarray) -> np.ndarray:
    """Tokens of each of ``samples`` before its last answer that truncation never trims: its ``KEEP``
    segments of the always-kept unit (-1) or of the last round (never dropped) that end before the
    last round's first answer segment, int64 ``[len(samples)]``. Truncation keeps them and cuts what
    follows at the cap, so a sample whose fixed tokens reach the cap + 1 keeps no answer token."""
    segment_offsets, starts, kinds, units = store.segments
    first, counts = segment_offsets[samples], segment_offsets[samples + 1] - segment_offsets[samples]
    owner = np.repeat(np.arange(len(samples)), counts)  # the sample of each segment, by position
    index = np.arange(int(counts.sum())) + np.repeat(first - (np.cumsum(counts) - counts), counts)
    begin = starts[index].astype(np.int64)
    end = np.empty_like(begin)
    end[:-1] = begin[1:]
    last = np.cumsum(counts) - 1  # the last segment of each sample runs to the sample's length
    end[last[counts > 0]] = store.lengths[samples][counts > 0]
    unit = units[index].astype(np.int64)
    last_unit = np.full(len(samples), -1, dtype=np.int64)
    np.maximum.at(last_unit, owner, unit)
    kept_unit = (unit == -1) | (unit == last_unit[owner])
    answer_start = store.lengths[samples].astype(np.int64)
    answers = (kinds[index] & ANSWER).astype(bool) & kept_unit
    np.minimum.at(answer_start, owner[answers], begin[answers])
    fixed = (kinds[index] == KEEP) & kept_unit & (end <= answer_start[owner])
    return np.bincount(owner, weights=(end - begin) * fixed, minlength=len(samples)).astype(np.int64)
