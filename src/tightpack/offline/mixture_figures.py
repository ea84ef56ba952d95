"""The figures of a mixture's manifest section that its packs determine, counted one way for both
``tightpack pack`` (`tightpack.offline.mixture`) and ``tightpack verify`` (`tightpack.verify.mixture`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tightpack.core.mixture import sample_measure
from tightpack.core.mixture_windows import window_deviation

__all__ = ["PackedFigures", "packed_figures"]


def sample_sources(
    source_index: np.ndarray, source_starts: list[int], input_of_source: list[int]
) -> np.ndarray:
    """The input each sample came from, int64 ``[num_samples]``: its row (``source_index``) falls in
    the rows of one source (``source_starts``: the first row of each), which belongs to one input.

    >>> sample_sources(np.array([0, 2, 3, 7]), [0, 3, 5], [0, 0, 1]).tolist()
    [0, 0, 0, 1]
    """
    which = np.searchsorted(np.asarray(source_starts, dtype=np.int64), source_index, side="right") - 1
    return np.asarray(input_of_source, dtype=np.int64)[which]


@dataclass(frozen=True)
class PackedFigures:
    """The figures of the manifest's ``mixture`` section that the packs determine (`packed_figures`).

    Attributes:
        sources: one dict per source, its keys those of ``mixture.sources``: ``share``,
            ``token_share``, ``supervised_share``, ``samples_packed``, ``sequences``, ``tokens``,
            ``supervised_tokens``, ``worst_window_points``.
        windows: ``mixture.windows`` (`tightpack.core.mixture_windows.WindowDeviation.to_dict`).
        window_shares: ``mixture.window_shares``: the shares of consecutive windows from pack 0.
        measure: float64 ``[num_sources]``: the ``mix_by`` measure packed, every copy counted.
        distinct_measure: float64 ``[num_sources]``: the measure of the distinct samples packed (each
            once): the measure available to the mixture when it packed every kept sample.
    """

    sources: list[dict[str, Any]]
    windows: dict[str, Any]
    window_shares: list[list[float]]
    measure: np.ndarray
    distinct_measure: np.ndarray


def packed_figures(
    entry_source: np.ndarray,
    entry_sample: np.ndarray,
    tokens: np.ndarray,
    supervised: np.ndarray,
    pack_of: np.ndarray,
    packs: int,
    *,
    by: str,
    targets: np.ndarray,
    window: int,
) -> PackedFigures:
    """What the packs of a mixture hold per source, from its packed sequences in the order a run reads
    them. `plan_mixture_run` writes these figures into the manifest from its plan, and ``tightpack
    verify`` counts them again from the rows (`tightpack.verify.mixture`): one computation for both.

    Args:
        entry_source: int ``[num_entries]``: the source of every packed sequence.
        entry_sample: int ``[num_entries]``: its sample, a non-negative id that is one per sample (a
            repeated sample has the same one in each copy).
        tokens: int ``[num_entries]``: its runtime tokens (before alignment).
        supervised: int ``[num_entries]``: its supervised tokens.
        pack_of: int ``[num_entries]``: its pack, ``0 .. packs - 1`` in reading order.
        packs: the number of packs.
        by: what the weights count (`tightpack.core.mixture.MIX_BY`).
        targets: float64 ``[num_sources]``: the target shares.
        window: packs per window (`tightpack.core.mixture_windows.window_deviation`).

    >>> figures = packed_figures(
    ...     np.array([0, 1, 0, 1]), np.array([0, 5, 0, 6]), np.array([4, 2, 4, 2]), np.array([1, 2, 1, 2]),
    ...     np.array([0, 0, 1, 1]), 2, by="tokens", targets=np.array([0.5, 0.5]), window=1,
    ... )
    >>> [(s["sequences"], s["samples_packed"], s["share"]) for s in figures.sources]
    [(2, 1, 0.6666666666666666), (2, 2, 0.3333333333333333)]
    >>> round(figures.windows["worst_points"], 2), figures.distinct_measure.tolist()  # 4 of 6 tokens: 2/3
    (16.67, [4.0, 4.0])
    """
    count = len(targets)
    entry_source = np.asarray(entry_source, dtype=np.int64)
    measure_of = sample_measure(by, tokens, supervised)
    sums = {
        "sequences": np.bincount(entry_source, minlength=count),
        "tokens": np.bincount(entry_source, tokens, minlength=count),
        "supervised_tokens": np.bincount(entry_source, supervised, minlength=count),
    }
    measure = np.bincount(entry_source, measure_of, minlength=count).astype(np.float64)
    # every sample once, by its id (a table over the ids, not a sort: every copy writes the same values)
    entry_sample = np.asarray(entry_sample, dtype=np.int64)
    span = int(entry_sample.max(initial=-1)) + 1
    packed = np.zeros(span, dtype=bool)
    packed[entry_sample] = True
    source_of, sample_measure_of = np.zeros(span, dtype=np.int64), np.zeros(span)
    source_of[entry_sample], sample_measure_of[entry_sample] = entry_source, measure_of
    distinct = np.bincount(source_of[packed], minlength=count)
    distinct_measure = np.bincount(source_of[packed], sample_measure_of[packed], minlength=count)
    composition = np.bincount(
        np.asarray(pack_of, dtype=np.int64) * count + entry_source, measure_of, minlength=packs * count
    ).reshape(packs, count)
    windows = window_deviation(composition, targets, window)

    def share(values: np.ndarray) -> np.ndarray:
        return values / max(values.sum(), 1)

    shares, token_shares = share(measure), share(sums["tokens"])
    supervised_shares = share(sums["supervised_tokens"])
    sources = [
        {
            "share": float(shares[s]),
            "token_share": float(token_shares[s]),
            "supervised_share": float(supervised_shares[s]),
            "samples_packed": int(distinct[s]),
            **{key: int(values[s]) for key, values in sums.items()},
            "worst_window_points": float(windows.per_source[s]),
        }
        for s in range(count)
    ]
    step = windows.window or 1
    window_sums = (
        np.add.reduceat(composition, np.arange(0, packs, step), axis=0) if packs else np.zeros((0, count))
    )
    window_shares = window_sums / np.maximum(window_sums.sum(axis=1, keepdims=True), 1e-300)
    return PackedFigures(
        sources, windows.to_dict(), np.round(window_shares, 6).tolist(), measure, distinct_measure
    )


def repetitions(measure: np.ndarray, available: np.ndarray) -> np.ndarray:
    """Each source's ``repetitions``: the measure packed over the measure available (0.3: a 30%
    subsample; 2.5: every sample twice, half of them a third time).

    >>> repetitions(np.array([30.0, 25.0]), np.array([100.0, 10.0])).tolist()
    [0.3, 2.5]
    """
    return measure / np.maximum(available, 1)
