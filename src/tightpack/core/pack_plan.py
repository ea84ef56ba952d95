"""`PackPlan`: which samples go into which pack, as CSR arrays (what every planner returns)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PackPlan"]

_LOAD_PACKS = 1 << 12
"""Packs summed at a time by `PackPlan.pack_loads`."""


@dataclass(frozen=True)
class PackPlan:
    """Which samples go into which pack, as CSR arrays.

    ``order`` (int64, one entry per sample) lists sample indices pack by pack; ``offsets`` (int64,
    ``len(plan) + 1`` entries) delimits the packs: pack ``i`` is ``order[offsets[i]:offsets[i + 1]]``.

    >>> plan = PackPlan(order=np.array([2, 0, 1]), offsets=np.array([0, 1, 3]))
    >>> len(plan), plan[1].tolist()
    (2, [0, 1])
    """

    order: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, pack: int) -> np.ndarray:
        n = len(self)
        if not -n <= pack < n:
            raise IndexError(f"pack index {pack} is out of range for a plan of {n} packs")
        pack %= n
        return self.order[self.offsets[pack] : self.offsets[pack + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def pack_sizes(self) -> np.ndarray:
        """Number of samples in each pack, int64 ``[len(plan)]``."""
        return np.diff(self.offsets)

    def pack_of_sample(self) -> np.ndarray:
        """Pack index of every sample, int64 ``[num_samples]``."""
        packs = np.empty(len(self.order), dtype=np.int64)
        packs[self.order] = np.repeat(np.arange(len(self), dtype=np.int64), self.pack_sizes)
        return packs

    def pack_loads(self, lengths: np.ndarray, power: int = 1) -> np.ndarray:
        """Sum of ``lengths ** power`` in each pack, int64 ``[len(plan)]``.

        Summed a block of packs at a time: the temporaries stay bounded whatever the plan's size.

        >>> plan = PackPlan(order=np.array([2, 0, 1]), offsets=np.array([0, 1, 1, 3]))
        >>> plan.pack_loads(np.array([3, 4, 5]), power=2).tolist()
        [25, 0, 25]
        """
        lengths = np.asarray(lengths)
        loads = np.empty(len(self), dtype=np.int64)
        for first in range(0, len(self), _LOAD_PACKS):
            offsets = self.offsets[first : min(first + _LOAD_PACKS, len(self)) + 1]
            values = lengths[self.order[offsets[0] : offsets[-1]]].astype(np.int64, copy=False) ** power
            cumulative = np.concatenate(([0], np.cumsum(values)))
            loads[first : first + len(offsets) - 1] = (
                cumulative[offsets[1:] - offsets[0]] - cumulative[offsets[:-1] - offsets[0]]
            )
        return loads
