"""Batch samplers for data-parallel training, mirroring Megatron-Bridge's dataloader types
(docs/contract.md §3.7).

`PackedBatchSampler` yields, for one data-parallel rank, the dataset indices of each step:

- ``single``: sequential; ``micro_batch_size`` indices per rank per step (rank ``d`` takes the d-th
  slice of each ``MBS * DP`` block); the last partial block is dropped, or with ``drop_last=False``
  yielded when DP == 1 (with DP > 1 an uneven tail is an error). Not cycled.
- ``cyclic``: shuffled per epoch from ``(seed, epoch)``; with ``data_sharding`` each rank draws from its
  own contiguous bucket, else ranks interleave over one permutation; the incomplete tail is dropped.
- ``batch``: all ``global_batch_size / DP`` indices of the rank for one global batch (split into
  micro-batches afterwards); shuffled per epoch; within a global batch rank ``d`` takes positions
  ``d, d + DP, ...``; the last global batch is dropped, or with ``drop_last=False`` padded with ``-1``
  (a padding row: `tightpack.runtime.dataset.PackedDataset` gives it a zero loss mask).

Resuming (`tightpack.runtime.resumable`): the training loop owns the position, as in Megatron. Build
the sampler with ``consumed_samples=`` (samples consumed by all ranks together) from the checkpoint
and save ``sampler.state_dict(consumed_samples=<the loop's count>)``; the sampler never counts what a
DataLoader drew ahead. A position must be a multiple of one step of all ranks (the global batch for
``batch``, ``micro_batch_size × DP`` for ``single`` and ``cyclic``). A pass that runs to the end of its
epoch moves the next ``iter()`` to the next epoch. Randomness comes only from
``np.random.default_rng((seed, epoch))``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

from tightpack.core.balance import balanced_steps, regroup_generator
from tightpack.core.balanced_plan import balance_pack_costs
from tightpack.core.cost_model import CostModel
from tightpack.core.planner import plan_packs
from tightpack.errors import TightpackError
from tightpack.runtime.resumable import ResumableSampler, array_checksum

__all__ = ["PackedBatchSampler", "TokenBudgetBatchSampler"]

DataloaderType = Literal["single", "cyclic", "batch"]


class PackedBatchSampler(ResumableSampler):
    """Indices for one data-parallel rank, step by step (use as a DataLoader ``batch_sampler``).

    >>> sampler = PackedBatchSampler(10, dataloader_type="single", micro_batch_size=2,
    ...                              data_parallel_rank=1, data_parallel_size=2)
    >>> list(sampler)
    [[2, 3], [6, 7]]

    Resuming: the loop counts what it trained (here 2 steps of ``MBS × DP = 4`` samples) and saves it:

    >>> state = sampler.state_dict(consumed_samples=4)
    >>> resumed = PackedBatchSampler(10, dataloader_type="single", micro_batch_size=2,
    ...                              data_parallel_rank=1, data_parallel_size=2)
    >>> resumed.load_state_dict(state)
    >>> list(resumed)
    [[6, 7]]
    """

    def __init__(
        self,
        total_samples: int,
        *,
        dataloader_type: DataloaderType,
        micro_batch_size: int,
        global_batch_size: int | None = None,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        consumed_samples: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        data_sharding: bool = True,
    ) -> None:
        if dataloader_type not in ("single", "cyclic", "batch"):
            raise TightpackError(f"dataloader_type must be single, cyclic or batch, got {dataloader_type!r}")
        if total_samples < 1 or micro_batch_size < 1 or data_parallel_size < 1:
            raise TightpackError(
                f"total_samples ({total_samples}), micro_batch_size ({micro_batch_size}) and "
                f"data_parallel_size ({data_parallel_size}) must be positive"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise TightpackError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})"
            )
        step = micro_batch_size * data_parallel_size
        if dataloader_type == "batch":
            if global_batch_size is None:
                raise TightpackError("dataloader_type='batch' needs global_batch_size")
            gbs = global_batch_size
            if isinstance(gbs, bool) or not isinstance(gbs, int | np.integer) or gbs < 1:
                raise TightpackError(f"global_batch_size must be a positive integer, got {gbs!r}")
            if global_batch_size % step:
                raise TightpackError(
                    f"`global_batch_size` ({global_batch_size}) is not divisible by `micro_batch_size "
                    f"({micro_batch_size}) x data_parallel_size ({data_parallel_size})`"
                )
            step = global_batch_size
        elif (
            dataloader_type == "single" and not drop_last and data_parallel_size > 1 and total_samples % step
        ):
            raise TightpackError(
                f"dataloader_type='single' with drop_last=False cannot split the last {total_samples % step} "
                f"samples over {data_parallel_size} data-parallel ranks; use drop_last=True or 'batch'"
            )
        if drop_last and total_samples < step:
            raise TightpackError(
                f"Not enough samples for a single global step: {total_samples} < {step}; lower the batch size"
            )
        self.total_samples = total_samples
        self.dataloader_type = dataloader_type
        self.micro_batch_size = micro_batch_size
        self.rank, self.ranks = data_parallel_rank, data_parallel_size
        self.step = step  # samples consumed by all ranks per yield
        self.seed = seed
        self.drop_last = drop_last
        self.data_sharding = data_sharding
        self._start = self.checked_position(consumed_samples)

    @property
    def consumed_samples(self) -> int:
        """Not readable: a DataLoader with workers draws ahead, so only the training loop knows it.

        Setting it (or ``load_state_dict``) sets where the next ``iter()`` starts.
        """
        raise TightpackError(
            f"{type(self).__name__} does not know what the training loop consumed: a DataLoader with "
            "workers draws batches ahead of it. Count the samples in the loop (global batch per step) "
            "and save sampler.state_dict(consumed_samples=<that count>), or pass it back as "
            "consumed_samples= when building the sampler"
        )

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self._start = self.checked_position(value)

    def state_dict(self, consumed_samples: int | None = None) -> dict:
        """The resume state at ``consumed_samples``, the training loop's count (all ranks together).

        Without it, the position the next ``iter()`` starts from (what torchdata's
        ``StatefulDataLoader`` asks for; it saves the running pass's position next to it): in your own
        checkpoint always pass the loop's count. Raises `TightpackError` for a position that is not a
        multiple of one step (`checked_position`).
        """
        return self._state(consumed_samples)

    @property
    def position_unit(self) -> int:
        return self.step

    @property
    def epoch_length(self) -> int:
        return self.samples_per_epoch

    def describe_unit(self) -> str:
        if self.dataloader_type == "batch":
            return f"the global batch ({self.step} samples, all ranks together)"
        return (
            f"one step of all ranks ({self.step} samples: micro_batch_size {self.micro_batch_size} x "
            f"data_parallel_size {self.ranks})"
        )

    def is_final_position(self, position: int) -> bool:
        return self.dataloader_type == "single" and position >= self.samples_per_epoch

    def resume_settings(self) -> dict:
        settings = {
            "sampler": type(self).__name__,
            "dataloader_type": self.dataloader_type,
            "total_samples": self.total_samples,
            "samples_per_step": self.step,
        }
        if self.dataloader_type == "cyclic":  # each rank's share depends on the layout and the seed
            names = ("micro_batch_size", "data_parallel_size", "seed", "data_sharding")
            values = (self.micro_batch_size, self.ranks, self.seed, self.data_sharding)
        elif self.dataloader_type == "batch":  # rank-independent global batches: DP may change
            names, values = ("seed", "drop_last"), (self.seed, self.drop_last)
        else:
            names, values = ("drop_last",), (self.drop_last,)
        settings.update(zip(names, values, strict=True))
        return settings

    @property
    def samples_per_epoch(self) -> int:
        """Samples consumed by all ranks in one epoch (padding included for ``batch``)."""
        if self.dataloader_type == "batch" and not self.drop_last:
            return math.ceil(self.total_samples / self.step) * self.step
        if self.dataloader_type == "single" and not self.drop_last:
            return self.total_samples
        return self.total_samples // self.step * self.step

    def __len__(self) -> int:
        """Steps left in the epoch the next ``iter()`` starts in (``single`` has one epoch only)."""
        if self.dataloader_type == "single" and self._start >= self.samples_per_epoch:
            return 0
        return super().__len__()

    def epoch_steps(self, epoch: int, offset: int) -> Iterator[list[int]]:
        if self.dataloader_type == "single":
            return iter(()) if epoch else self._single(offset)
        if self.dataloader_type == "cyclic":
            return self._cyclic(epoch, offset)
        return self._batch(epoch, offset)

    def _permutation(self, size: int, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(size)

    def _single(self, offset: int) -> Iterator[list[int]]:
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        for first in range(offset, self.samples_per_epoch, self.step):
            block = list(range(first, min(first + self.step, self.total_samples)))
            yield block[mine] if len(block) == self.step else block  # a partial tail only when DP == 1

    def _cyclic(self, epoch: int, offset: int) -> Iterator[list[int]]:
        if self.data_sharding:  # each rank shuffles its own contiguous bucket
            bucket = self.total_samples // self.step * self.micro_batch_size
            order = self.rank * bucket + self._permutation(bucket, epoch)[offset // self.ranks :]
        else:  # one permutation, ranks interleaved
            order = self._permutation(self.total_samples, epoch)[offset : self.samples_per_epoch]
            order = order[self.rank :: self.ranks]
        for first in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
            yield order[first : first + self.micro_batch_size].tolist()

    def _global_batches(self, epoch: int, offset: int) -> Iterator[np.ndarray]:
        """``batch`` type: every global batch of the epoch from ``offset``, all ranks' indices together
        (int64 ``[global_batch_size]``, ``-1`` for padding); a subclass may deal them otherwise."""
        order = self._permutation(self.total_samples, epoch)
        padded = np.full(self.samples_per_epoch, -1, dtype=np.int64)
        padded[: min(len(order), self.samples_per_epoch)] = order[: self.samples_per_epoch]
        for first in range(offset, self.samples_per_epoch, self.step):
            yield padded[first : first + self.step]

    def _batch(self, epoch: int, offset: int) -> Iterator[list[int]]:
        for batch in self._global_batches(epoch, offset):
            yield batch[self.rank :: self.ranks].tolist()


class TokenBudgetBatchSampler(ResumableSampler):
    """Micro-batches that each carry close to ``token_budget`` tokens, for collate-time packing.

    A fixed micro-batch size gives packed rows of wildly different lengths (a few short samples, or
    one long one). This sampler plans the micro-batches with the packing planner instead: the samples
    are packed once into bins of ``token_budget`` tokens (``algorithm``); every epoch the bins are
    shuffled from ``(seed, epoch)``, cut into optimizer steps of ``DP * micro_batches_per_step`` bins
    (the last bins that make no whole step are dropped, so every rank gets as many) and dealt: rank
    ``d`` takes bins ``d, d + DP, ...`` of each step.

    With a ``cost_model`` the micro-batches are balanced on compute, not only on tokens: the plan is
    rewritten so bin costs spread less (`tightpack.core.balanced_plan.balance_pack_costs`; at most 0.1%
    more bins, the token budget stays a hard limit), and each epoch's bins are grouped into steps and
    dealt by cost (`tightpack.core.balance.balanced_steps`): within a step every rank carries about
    the same cost, so no rank waits on another. The set of bins of an epoch is the same as without a
    cost model (shuffled, whole steps); which step and rank sees each one changes.

    Args:
        lengths: the length each sample will have in the packed row (aligned, if aligning), ``[N]``.
        token_budget: tokens per micro-batch; a longer sample is an error (truncate it first).
        cost_model: a `CostModel`, preset name or JSON path (`CostModel.resolve`); None balances
            tokens only.
        micro_batches_per_step: micro-batches one rank runs per optimizer step (gradient
            accumulation); a step is ``DP`` times this many bins.
        consumed_micro_batches: where to resume: the micro-batches each rank has trained, all
            epochs together (optimizer steps x ``micro_batches_per_step``), as the training loop
            counts them; a multiple of ``micro_batches_per_step``. Or `load_state_dict`.

    >>> sampler = TokenBudgetBatchSampler([5, 3, 2, 7, 4], token_budget=10, shuffle=False)
    >>> [sorted(batch) for batch in sampler]
    [[0, 4], [1, 3], [2]]

    Resuming after the loop trained 2 micro-batches (the next epoch follows the rest of this one):

    >>> resumed = TokenBudgetBatchSampler([5, 3, 2, 7, 4], token_budget=10, shuffle=False,
    ...                                   consumed_micro_batches=2)
    >>> [sorted(batch) for batch in resumed]
    [[2]]
    """

    position_name = "consumed_micro_batches"

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        token_budget: int,
        *,
        algorithm: str = "bfd",
        seed: int = 0,
        shuffle: bool = True,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        cost_model: CostModel | str | os.PathLike | None = None,
        micro_batches_per_step: int = 1,
        consumed_micro_batches: int = 0,
    ) -> None:
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise TightpackError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})"
            )
        per_rank = micro_batches_per_step
        if isinstance(per_rank, bool) or not isinstance(per_rank, (int, np.integer)) or per_rank < 1:
            raise TightpackError(f"micro_batches_per_step must be a positive integer, got {per_rank!r}")
        lengths = np.asarray(lengths)
        self.plan = plan_packs(lengths, token_budget, algorithm=algorithm, seed=seed)
        self.cost_model = None if cost_model is None else CostModel.resolve(cost_model)
        self.costs = None
        if self.cost_model is not None:
            self.plan = balance_pack_costs(self.plan, lengths, token_budget, self.cost_model)
            self.costs = self.cost_model.pack_costs(self.plan, lengths)
        if len(self.plan) < data_parallel_size * per_rank:
            raise TightpackError(
                f"{len(self.plan)} micro-batches cannot make one step of {data_parallel_size} data-parallel "
                f"ranks x {per_rank} micro-batches; lower micro_batches_per_step or the token budget"
            )
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.ranks = data_parallel_rank, data_parallel_size
        self.micro_batches_per_step = int(per_rank)
        self._plan_checksum = array_checksum(self.plan.order, self.plan.offsets)
        self._start = self.checked_position(consumed_micro_batches)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` starts in; setting it starts the next ``iter()`` at its start."""
        return self._start // self.epoch_length

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._start = self.checked_position(value * self.epoch_length)

    def state_dict(self, consumed_micro_batches: int | None = None) -> dict:
        """The resume state at ``consumed_micro_batches``, the training loop's count of one rank.

        Without it, the position the next ``iter()`` starts from (what torchdata's
        ``StatefulDataLoader`` asks for; it saves the running pass's position next to it).
        """
        return self._state(consumed_micro_batches)

    @property
    def position_unit(self) -> int:
        return self.micro_batches_per_step

    @property
    def yield_size(self) -> int:
        return 1

    @property
    def epoch_length(self) -> int:
        """Micro-batches one rank yields per epoch."""
        step = self.ranks * self.micro_batches_per_step
        return len(self.plan) // step * self.micro_batches_per_step

    def describe_unit(self) -> str:
        per_step = self.micro_batches_per_step
        return f"micro_batches_per_step ({per_step} micro-batches per rank: one optimizer step)"

    def resume_settings(self) -> dict:
        return {
            "sampler": type(self).__name__,
            "micro_batches": len(self.plan),
            "plan_crc32": self._plan_checksum,
            "data_parallel_size": self.ranks,
            "micro_batches_per_step": self.micro_batches_per_step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "cost_balanced": self.costs is not None,
        }

    def epoch_steps(self, epoch: int, offset: int) -> Iterator[list[int]]:
        bins = np.arange(len(self.plan))
        if self.shuffle:
            bins = np.random.default_rng((self.seed, epoch)).permutation(bins)
        bins = bins[: self.epoch_length * self.ranks]
        if self.costs is None:
            steps = bins.reshape(-1, self.micro_batches_per_step, self.ranks)
            mine = steps[:, :, self.rank].reshape(-1)  # rank d takes positions d, d + DP, ... of a step
        else:
            rng = regroup_generator(self.seed, epoch)
            dealt = balanced_steps(self.costs[bins], self.ranks, self.micro_batches_per_step, rng)
            mine = bins[dealt[:, self.rank].reshape(-1)]
        for index in mine[offset:].tolist():
            yield self.plan[index].tolist()
