"""How far each global batch of a plan strays from the target shares (`window_deviation`): what
`tightpack.core.mixture_plan.plan_mixture` reports and its tolerance checks, and what
``tightpack verify`` and ``tightpack inspect`` count again from the packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tightpack.errors import TightpackError

__all__ = ["WindowDeviation", "window_deviation"]


@dataclass(frozen=True)
class WindowDeviation:
    """How far the shares of the worst global batch of ``window`` packs stray from the targets.

    The batches are consecutive and do not overlap: packs ``[0, window)``, ``[window, 2 window)``, and
    so on. The last batch, when it holds fewer packs (``last_packs``), is counted apart: a run whose
    sampler drops an incomplete batch never reads it.

    Attributes:
        window: packs per batch (the whole plan, as one batch, when it has fewer).
        points: the largest ``|share - target|`` of any source in any full batch, percentage points.
        source: the source of that deviation.
        first_pack: the first pack of that batch (a multiple of ``window``).
        per_source: float64 ``[num_sources]``: each source's worst deviation over the full batches.
        last_packs: packs of the last, incomplete batch (0: every batch is full).
        last_points: its largest ``|share - target|`` (0 when it has none or holds no measure).
    """

    window: int
    points: float
    source: int
    first_pack: int
    per_source: np.ndarray
    last_packs: int = 0
    last_points: float = 0.0

    def to_dict(self) -> dict:
        return {
            "window_packs": self.window,
            "worst_points": self.points,
            "worst_source": self.source,
            "worst_first_pack": self.first_pack,
            "worst_points_per_source": self.per_source.tolist(),
            "last_batch_packs": self.last_packs,
            "last_batch_points": self.last_points,
        }


def window_deviation(composition: np.ndarray, targets: np.ndarray, window: int) -> WindowDeviation:
    """The worst share deviation over the global batches of ``window`` packs (`WindowDeviation`).

    Args:
        composition: ``[num_packs, num_sources]``: each pack's measure from each source, in the order a
            run reads the packs.
        targets: ``[num_sources]``: the target shares (summing to 1).
        window: packs per global batch; a plan with fewer packs is one batch.

    The batches are packs ``[k * window, (k + 1) * window)``; a last batch of fewer packs is counted
    apart (``last_packs``, ``last_points``). A batch with nothing of the measure (possible with
    supervised tokens) has no shares and counts as on target.

    >>> composition = np.array([[3, 1], [1, 3], [2, 2]])
    >>> d = window_deviation(composition, np.array([0.5, 0.5]), 1)
    >>> d.points, d.first_pack
    (25.0, 0)
    >>> d = window_deviation(composition, np.array([0.5, 0.5]), 2)  # packs 0-1 hold 4 of 8; pack 2 apart
    >>> d.points, d.last_packs, d.last_points
    (0.0, 1, 0.0)
    >>> window_deviation(composition[1:], np.array([0.5, 0.5]), 3).points  # one batch: 3 of 8 is 37.5%
    12.5
    """
    if window < 1:
        raise TightpackError(f"window must be at least 1 pack, got {window}", parameters=("window",))
    composition = np.asarray(composition, dtype=np.float64)
    packs, sources = composition.shape
    if packs == 0:
        return WindowDeviation(0, 0.0, 0, 0, np.zeros(sources))
    window = min(window, packs)
    full = packs // window
    sums = composition[: full * window].reshape(full, window, sources).sum(axis=1)
    off = _points_off(sums, targets)
    first, source = np.unravel_index(int(np.argmax(off)), off.shape)
    last_packs = packs - full * window
    last_points = float(_points_off(composition[full * window :].sum(axis=0, keepdims=True), targets).max())
    return WindowDeviation(
        window,
        float(off[first, source]),
        int(source),
        int(first) * window,
        off.max(axis=0),
        last_packs,
        last_points,
    )


def _points_off(sums: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``100 * |share - target|`` of each row of ``sums`` ``[rows, sources]``; 0 for a row of no measure."""
    totals = sums.sum(axis=1, keepdims=True)
    counted = totals[:, 0] > 0
    off = np.zeros_like(sums)
    off[counted] = 100 * np.abs(sums[counted] / totals[counted] - targets)
    return off
