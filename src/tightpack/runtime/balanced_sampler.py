"""A cost-balanced batch sampler for the offline (pre-packed) path, and the pack costs it needs (issue 13).

`BalancedPackedBatchSampler` is `tightpack.runtime.samplers.PackedBatchSampler` with
``dataloader_type="batch"`` and one pack per micro-batch: every global batch holds the same ``GBS``
packs, from the same seeded permutation, but they are dealt to the data-parallel ranks with
`tightpack.core.balance.deal_balanced` on their costs instead of rank ``d`` taking positions
``d, d + DP, ...``; the slowest rank, which every step waits for, gets lighter. `pack_costs` gives the
cost of each index of a `tightpack.runtime.dataset.PackedDataset`. The arithmetic on the index lives in
`tightpack.core.row_costs`; the cost model in `tightpack.core.cost_model`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from tightpack.core import legacy_npy
from tightpack.core.balance import balanced_steps, deal_balanced, regroup_generator
from tightpack.core.cost_model import CostModel
from tightpack.core.packed_index import PackedIndex
from tightpack.core.row_costs import row_pack_costs
from tightpack.errors import TightpackError
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.resumable import array_checksum
from tightpack.runtime.samplers import PackedBatchSampler

__all__ = ["BalancedPackedBatchSampler", "pack_costs"]


def pack_costs(dataset: PackedDataset, cost_model: CostModel | str | os.PathLike) -> np.ndarray:
    """The cost of each index of ``dataset``, float64 ``[len(dataset)]``, for `BalancedPackedBatchSampler`.

    Parquet datasets are costed from their memory-mapped index (`PackedIndex`, built if missing) in a
    few vectorized passes. A legacy ``.npy`` dataset has no index: its rows are read (the whole file,
    as `PackedDataset` does) and its sequence starts gathered with one Python step per row. With
    ``max_num_samples`` index ``i`` is row ``dataset.mapping[i]``, so it costs what that row costs.

    Args:
        cost_model: a `CostModel`, a preset name or a saved model's path (`CostModel.resolve`).
    """
    model = CostModel.resolve(cost_model)
    if dataset.is_npy:
        rows = legacy_npy.read_legacy_npy(dataset.files[0])
        # One step per row: the legacy format is a pickled list of dicts, with no flat index to slice.
        row_lengths = np.array([len(row["input_ids"]) for row in rows], dtype=np.int64)
        starts = [np.asarray(row["seq_start_id"], dtype=np.int64) for row in rows]
        seq_counts = np.array([len(s) for s in starts], dtype=np.int64)
        seq_start_id = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        row_offsets = np.concatenate(([0], np.cumsum(row_lengths)))
        seq_offsets = np.concatenate(([0], np.cumsum(seq_counts)))
    else:
        index = PackedIndex.ensure(dataset.files, dataset.cache_dir)
        row_offsets, seq_start_id, seq_offsets = index.row_offsets, index.seq_start_id, index.seq_offsets
    costs = row_pack_costs(row_offsets, seq_start_id, seq_offsets, model)
    if dataset.mapping is not None:
        costs = costs[dataset.mapping]
    return costs


class BalancedPackedBatchSampler(PackedBatchSampler):
    """One data-parallel rank's dataset indices per global batch, balanced by cost (a ``batch_sampler``).

    Same contract as ``PackedBatchSampler(len(pack_costs), dataloader_type="batch",
    micro_batch_size=1, ...)``: per epoch the permutation of ``np.random.default_rng((seed, epoch))``
    decides which packs the epoch's global batches hold (the last ``total % GBS`` dropped, or with
    ``drop_last=False`` a last global batch padded with ``-1``: a padding row, the last index with no
    loss, costed as that index); ``consumed_samples`` counts the samples of all ranks, as the
    training loop counts them (a multiple of the global batch), so a new sampler from a checkpoint's
    ``consumed_samples`` or `state_dict` continues exactly (`tightpack.runtime.resumable`). Each rank
    keeps the permutation's order among its own packs. Micro-batches hold one pack each (the offline
    path needs ``micro_batch_size`` 1), so a rank's ``GBS / DP`` indices are its micro-batches of a
    step. The balancing depends only on the costs, the seed and the epoch, so every rank computes the
    same one.

    What differs is how the packs of the epoch are grouped and dealt:

    - ``regroup=True`` (default): `tightpack.core.balance.balanced_steps` groups the epoch's packs into
      global batches by cost, each a stratified sample of the epoch's pack costs, and deals each so
      that every rank carries the same cost within a tier's spread. This is what keeps ranks balanced
      when each holds few packs per step (``GBS / DP`` of 1 to 4). The order of the global batches is
      seeded and random; the set of packs of the epoch is the same as ``PackedBatchSampler``'s.
    - ``regroup=False``: the global batches are ``PackedBatchSampler``'s, pack for pack; only their
      dealing changes (`tightpack.core.balance.deal_balanced`, equal-count LPT).

    Args:
        pack_costs: float ``[total_samples]``, the cost of each dataset index (see `pack_costs`);
            finite and ``>= 0``.
        global_batch_size: packs per global batch, all ranks together; a multiple of
            ``data_parallel_size``.
        regroup: group packs into global batches by cost (see above), or keep today's global batches.

    Raises:
        TightpackError: costs that are not 1-D, empty, negative or non-finite; a global batch size
            that is not a positive multiple of the data-parallel size; or whatever `PackedBatchSampler`
            rejects (rank outside the data-parallel size, a ``consumed_samples`` that is negative or
            not a multiple of the global batch, fewer samples than one global batch with ``drop_last``).

    The in-order dealing of ``batch`` would give rank 0 the packs costing 8 and 7 (15) and rank 1 those
    costing 1 and 1 (2); balanced, each gets one heavy and one light pack:

    >>> costs = np.array([8.0, 1.0, 7.0, 1.0])
    >>> ranks = [BalancedPackedBatchSampler(costs, global_batch_size=4, data_parallel_rank=d,
    ...                                     data_parallel_size=2) for d in range(2)]
    >>> [sorted(costs[next(iter(sampler))].tolist()) for sampler in ranks]
    [[1.0, 8.0], [1.0, 7.0]]
    """

    def __init__(
        self,
        pack_costs: np.ndarray,
        *,
        global_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        consumed_samples: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        regroup: bool = True,
    ) -> None:
        costs = np.asarray(pack_costs)
        if costs.ndim != 1 or costs.size == 0:
            raise TightpackError(
                f"pack_costs must be a non-empty 1-D array, one cost per dataset index; got shape "
                f"{costs.shape}; compute it with pack_costs(dataset, cost_model) from this module"
            )
        if not (np.issubdtype(costs.dtype, np.integer) or np.issubdtype(costs.dtype, np.floating)):
            raise TightpackError(f"pack_costs must be numbers, got dtype {costs.dtype}")
        costs = costs.astype(np.float64)  # a copy: later changes to the caller's array change nothing
        bad = np.flatnonzero(~np.isfinite(costs) | (costs < 0))
        if bad.size:
            raise TightpackError(
                f"pack_costs must be finite and >= 0; index {bad[0]} has cost {costs[bad[0]]} "
                f"({bad.size} bad in all)"
            )
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("data_parallel_size", data_parallel_size),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise TightpackError(f"{name} must be a positive integer, got {value!r}")
        if global_batch_size % data_parallel_size:
            raise TightpackError(
                f"global_batch_size ({global_batch_size}) is not divisible by data_parallel_size "
                f"({data_parallel_size}); every rank takes global_batch_size / data_parallel_size packs "
                "per step, so use a multiple of the data-parallel size"
            )
        self.pack_costs = costs
        self.regroup = bool(regroup)
        self._costs_checksum = array_checksum(costs)
        super().__init__(
            len(costs),
            dataloader_type="batch",
            micro_batch_size=1,
            global_batch_size=global_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            consumed_samples=consumed_samples,
            seed=seed,
            drop_last=drop_last,
        )
        self._by_cost: np.ndarray | None = None  # indices by decreasing cost, sorted when first needed

    def resume_settings(self) -> dict:
        """`PackedBatchSampler`'s, plus what the dealing depends on (the layout, the costs, regrouping)."""
        return {
            **super().resume_settings(),
            "data_parallel_size": self.ranks,
            "regroup": self.regroup,
            "pack_costs_crc32": self._costs_checksum,
        }

    def _batch(self, epoch: int, offset: int) -> Iterator[list[int]]:
        whole_steps = self.total_samples // self.step
        if self.regroup and offset < whole_steps * self.step:
            mine = self._regrouped_steps(epoch)[:, self.rank]  # [steps, GBS / DP]
            for indices in mine[offset // self.step :]:  # offset is a multiple of the global batch
                yield indices.tolist()
            offset = whole_steps * self.step  # what is left is the padded last global batch, if any
        for positions in self._global_batches(epoch, offset):
            # A padding position -1 is `PackedDataset`'s index -1: the last index's tokens with no loss,
            # which cost the same compute, so it is costed as that index.
            costs = self.pack_costs[positions]
            yield positions[deal_balanced(costs, self.ranks)[self.rank]].tolist()

    def _regrouped_steps(self, epoch: int) -> np.ndarray:
        """Every rank's indices for each whole global batch of ``epoch``: int64 ``[steps, DP, GBS / DP]``."""
        order = self._permutation(self.total_samples, epoch)[: self.total_samples // self.step * self.step]
        steps = balanced_steps(
            self.pack_costs[order],
            self.ranks,
            self.step // self.ranks,
            regroup_generator(self.seed, epoch),
            heaviest_first=self._heaviest_first_positions(order),
        )
        return order[steps]

    def _heaviest_first_positions(self, order: np.ndarray) -> np.ndarray:
        """Positions into ``order`` (a subset of the indices) by decreasing cost, ties by index.

        The indices are sorted by cost once, at the first epoch; an epoch's subset is then picked out
        of that order in O(total) instead of sorted again.
        """
        if self._by_cost is None:
            self._by_cost = np.argsort(-self.pack_costs, kind="stable")
        position = np.full(self.total_samples, -1, dtype=np.int64)
        position[order] = np.arange(len(order))
        ordered = position[self._by_cost]
        return ordered[ordered >= 0]
