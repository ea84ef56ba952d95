"""Statistics of a pack plan, and the metadata entry Megatron-Bridge reads (docs/contract.md §2.6).

Two lower bounds on the number of packs are reported: the volume bound ``ceil(sum / pack_size)`` and
the tighter Martello-Toth L2 bound (`l2_lower_bound`), which also counts the samples longer than half
a pack, since no two of them share a pack.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from tightpack.core.planner import PackPlan

__all__ = ["PackStats", "pack_stats"]


@dataclass(frozen=True)
class PackStats:
    """How well a plan packs. Lengths are runtime tokens (aligned), capacities the pack size.

    Attributes:
        samples: sequences packed.
        packs: packs (rows).
        lower_bound: the volume bound ``ceil(sum(lengths) / pack_size)``; no plan can use fewer packs.
        lower_bound_l2: the Martello-Toth L2 bound (`l2_lower_bound`), ``>= lower_bound``; no plan can
            use fewer packs either. At capacity 10, ``[6, 6, 6, 6]`` has a volume bound of 3 but no two
            6s share a pack: L2 is 4.
        gap: ``packs - lower_bound_l2``. 0 proves the plan optimal; a positive gap does not prove it
            suboptimal (L2 is a bound, not always the optimum).
        efficiency: ``sum(lengths) / (packs * pack_size)``, in [0, 1].
        packing_factor: samples per pack.
        max_samples_per_pack: most sequences in one pack.
        min_packed_length: smallest pack load.
        dataset_max_length: longest sequence.
        attention_cost_mean: mean over packs of ``sum(s**2)`` (causal attention work of a pack with
            per-sequence masks), tokens squared.
        attention_cost_max: the same, maximum over packs.
    """

    pack_size: int
    samples: int
    packs: int
    tokens: int
    lower_bound: int
    lower_bound_l2: int
    gap: int
    efficiency: float
    packing_factor: float
    max_samples_per_pack: int
    min_packed_length: int
    dataset_max_length: int
    attention_cost_mean: float
    attention_cost_max: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def efficiency_at_bound(self) -> float:
        """The efficiency a plan of ``lower_bound_l2`` packs (the tighter bound) would reach: the best
        any plan can; equal to ``efficiency`` when the gap is 0. 0.0 for no packs."""
        return self.tokens / (max(self.lower_bound_l2, 1) * self.pack_size)

    def megatron_metadata(self) -> dict:
        """The metadata entry of Megatron-Bridge's packing (one element of its JSON list)."""
        return {
            "dataset_max_seqlen": self.dataset_max_length,
            "max_samples_per_bin": self.max_samples_per_pack,
            "packing_factor": round(self.packing_factor, 2),
            "packing_efficiency": round(self.efficiency * 100, 2),
            "pack_size": self.pack_size,
            "min_packed_seqlen": self.min_packed_length,
        }


_STATS_SAMPLES = 1 << 16
"""Samples whose lengths `pack_stats` counts at a time."""


def pack_stats(plan: PackPlan, lengths: np.ndarray, pack_size: int) -> PackStats:
    """Statistics of ``plan`` over ``lengths`` (``[num_samples]``, the planner's input).

    >>> plan = PackPlan(order=np.array([0, 1, 2]), offsets=np.array([0, 2, 3]))
    >>> stats = pack_stats(plan, np.array([3, 4, 6]), 8)
    >>> stats.packs, stats.lower_bound, round(stats.efficiency, 4), stats.attention_cost_max
    (2, 2, 0.8125, 36)

    Four samples of 6 at pack size 10: the volume bound says 3 packs, L2 proves 4 are needed, so the
    plan with one sample per pack is optimal (gap 0):

    >>> plan = PackPlan(order=np.arange(4), offsets=np.arange(5))
    >>> stats = pack_stats(plan, np.array([6, 6, 6, 6]), 10)
    >>> stats.packs, stats.lower_bound, stats.lower_bound_l2, stats.gap
    (4, 3, 4, 0)
    >>> stats.efficiency_at_bound == stats.efficiency  # 24 / (4 * 10), not 24 / (3 * 10)
    True
    """
    lengths = np.asarray(lengths)  # int32 or int64; blocks are summed as int64
    if len(plan) == 0:
        return PackStats(
            pack_size=pack_size,
            samples=0,
            packs=0,
            tokens=0,
            lower_bound=0,
            lower_bound_l2=0,
            gap=0,
            efficiency=0.0,
            packing_factor=0.0,
            max_samples_per_pack=0,
            min_packed_length=0,
            dataset_max_length=0,
            attention_cost_mean=0.0,
            attention_cost_max=0,
        )
    loads, attention = plan.pack_loads(lengths), plan.pack_loads(lengths, 2)
    values, counts = _merged_counts(  # the plan's lengths, a block of samples at a time
        [
            _length_counts(lengths[plan.order[first : first + _STATS_SAMPLES]])
            for first in range(0, len(plan.order), _STATS_SAMPLES)
        ]
    )
    total = int(loads.sum())
    lower_bound_l2 = l2_bound_of_counts(values, counts, pack_size)
    return PackStats(
        pack_size=pack_size,
        samples=len(plan.order),
        packs=len(plan),
        tokens=total,
        lower_bound=math.ceil(total / pack_size),
        lower_bound_l2=lower_bound_l2,
        gap=len(plan) - lower_bound_l2,
        efficiency=total / (len(plan) * pack_size),
        packing_factor=len(plan.order) / len(plan),
        max_samples_per_pack=int(plan.pack_sizes.max()),
        min_packed_length=int(loads.min()),
        dataset_max_length=int(values[-1]),
        attention_cost_mean=float(attention.mean()),
        attention_cost_max=int(attention.max()),
    )


def bounds_text(packs: int, lower_bound: int, lower_bound_l2: int) -> str:
    """The lower bound of a plan of ``packs`` packs, as ``pack``'s summary and ``plan``'s table show it:
    the volume bound, and the tighter L2 bound with the gap to it when it is above.

    >>> bounds_text(5, 5, 5), bounds_text(5, 3, 5)
    ('5', 'volume 3, L2 5; gap 0')
    """
    if lower_bound_l2 == lower_bound:
        return f"{lower_bound:,}"
    return f"volume {lower_bound:,}, L2 {lower_bound_l2:,}; gap {packs - lower_bound_l2:,}"


def l2_lower_bound(lengths: np.ndarray, pack_size: int) -> int:
    """The Martello-Toth L2 lower bound on the number of packs of capacity ``pack_size``.

    Martello, S. and Toth, P. (1990). "Lower bounds and reduction procedures for the bin packing
    problem". Discrete Applied Mathematics 28(1), 59-70, bound L2. With ``C = pack_size`` and a
    threshold ``k`` in ``[0, C/2]``:

    - ``N1``: items ``> C - k``; nothing else fits next to them (a length ``>= k`` would overflow);
    - ``N2``: items in ``(C/2, C - k]``; one per pack, and none shares a pack with an ``N1`` item;
    - ``N3``: items in ``[k, C/2]``; at best they fill the room ``|N2| * C - sum(N2)`` left next to
      ``N2``, the rest needs packs of its own.

    ``L(k) = |N1| + |N2| + max(0, ceil((sum(N3) - (|N2| * C - sum(N2))) / C))`` and L2 is the maximum
    over ``k``. ``L(0) = max(|items > C/2|, ceil(sum / C))``, so L2 is never below the volume bound.
    Within two consecutive distinct lengths ``L(k)`` only grows with ``k``, so the thresholds 0 and the
    distinct lengths ``<= C/2`` suffice: the bound is evaluated for all of them at once with prefix sums
    over the distinct lengths, O(samples + D log D) for D distinct lengths, whatever the pack size.

    Args:
        lengths: non-negative item lengths, ``[num_items]``, each ``<= pack_size``.
        pack_size: the capacity of a pack.

    Returns:
        The bound, 0 for no items.

    Capacity 10: three 6s leave room for the three 1s (volume bound 3, L2 3), but four 6s need four
    packs although their volume fits in three:

    >>> l2_lower_bound(np.array([6, 6, 6, 1, 1, 1]), 10), l2_lower_bound(np.array([6, 6, 6, 6]), 10)
    (3, 4)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return 0
    return l2_bound_of_counts(*_length_counts(lengths), pack_size)


def l2_bound_of_counts(values: np.ndarray, counts: np.ndarray, pack_size: int) -> int:
    """`l2_lower_bound` of the items ``values[i]`` (ascending, distinct) taken ``counts[i]`` times."""
    if len(values) == 0:
        return 0
    count_below = np.concatenate(([0], np.cumsum(counts)))  # items among values[:i]
    volume_below = np.concatenate(([0], np.cumsum(values * counts)))  # their total length
    half = int(np.searchsorted(values, pack_size // 2, side="right"))  # values[:half] are <= C/2
    thresholds = np.concatenate(([0], values[:half]))
    small_from = np.searchsorted(values, thresholds, side="left")  # N3 is values[small_from:half]
    fit_end = np.searchsorted(values, pack_size - thresholds, side="right")  # N2 is values[half:fit_end]
    n1 = count_below[-1] - count_below[fit_end]
    n2 = count_below[fit_end] - count_below[half]
    room = n2 * pack_size - (volume_below[fit_end] - volume_below[half])
    excess = volume_below[half] - volume_below[small_from] - room
    return int((n1 + n2 + np.maximum(0, -(-excess // pack_size))).max())


def _merged_counts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values (ascending) and counts of several ``(values, counts)`` taken together."""
    values, inverse = np.unique(np.concatenate([values for values, _ in parts]), return_inverse=True)
    counts = np.bincount(inverse, weights=np.concatenate([counts for _, counts in parts]))
    return values, counts.astype(np.int64)


def _length_counts(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct lengths (ascending) and their counts, in O(samples + distinct lengths) memory.

    A ``bincount`` while the length range stays within a few times the number of samples, else
    ``np.unique`` (a sort), so that a pack size of 10**9 never costs a histogram of 10**9 entries.
    """
    longest = int(lengths.max())
    if longest < 2 * len(lengths) + 2**16:
        histogram = np.bincount(lengths, minlength=longest + 1)
        values = np.flatnonzero(histogram)
        return values, histogram[values]
    return np.unique(lengths, return_counts=True)
