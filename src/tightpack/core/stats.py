"""Statistics of a pack plan, and the metadata entry Megatron-Bridge reads (contract section 2.6)."""

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
        lower_bound: ``ceil(sum(lengths) / pack_size)``, no plan can use fewer packs.
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
    efficiency: float
    packing_factor: float
    max_samples_per_pack: int
    min_packed_length: int
    dataset_max_length: int
    attention_cost_mean: float
    attention_cost_max: int

    def to_dict(self) -> dict:
        return asdict(self)

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


def pack_stats(plan: PackPlan, lengths: np.ndarray, pack_size: int) -> PackStats:
    """Statistics of ``plan`` over ``lengths`` (``[num_samples]``, the planner's input).

    >>> plan = PackPlan(order=np.array([0, 1, 2]), offsets=np.array([0, 2, 3]))
    >>> stats = pack_stats(plan, np.array([3, 4, 6]), 8)
    >>> stats.packs, stats.lower_bound, round(stats.efficiency, 4), stats.attention_cost_max
    (2, 2, 0.8125, 36)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(plan) == 0:
        return PackStats(pack_size, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0.0, 0)
    loads = plan.pack_loads(lengths)
    attention = plan.pack_loads(lengths**2)
    total = int(lengths[plan.order].sum())
    return PackStats(
        pack_size=pack_size,
        samples=len(plan.order),
        packs=len(plan),
        tokens=total,
        lower_bound=math.ceil(total / pack_size),
        efficiency=total / (len(plan) * pack_size),
        packing_factor=len(plan.order) / len(plan),
        max_samples_per_pack=int(plan.pack_sizes.max()),
        min_packed_length=int(loads.min()),
        dataset_max_length=int(lengths[plan.order].max()),
        attention_cost_mean=float(attention.mean()),
        attention_cost_max=int(attention.max()),
    )
