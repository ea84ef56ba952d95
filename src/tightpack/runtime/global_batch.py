"""Global-batch online packing: every step, all data-parallel ranks draw balanced micro-batches from one
global pool of samples (`GlobalBatchPacker`).

The online packer (`tightpack.runtime.online.OnlinePacker`) packs each rank's shard on its own, so a
rank that drew long samples runs longer than the others. Here a step's candidates are pooled across
ranks and planned together by `tightpack.core.step_planner.plan_step`:

1. each rank reads its share of the step's candidates from its shard of the stream (positions
   ``rank, rank + DP, ...``: the step's pool is ``samples_per_step`` consecutive positions);
2. the ranks share what the planner needs, every candidate's key, length and supervised tokens, with
   one ``all_gather_object`` (a few numbers per sample, not the tokens);
3. every rank plans the whole pool alike (the plan is deterministic) and takes its micro-batches;
4. a rank gets the samples of other ranks it was dealt: by ``restore(key)`` when the source can prepare
   any sample by its key (no tokens cross the network), else the ranks exchange their candidates with a
   second ``all_gather_object`` (every rank then holds the step's whole pool for a moment).

Each step yields the rank's micro-batches (THD rows of `tightpack.runtime.in_batch.pack_samples`, or
``pack_fn``'s), all ranks the same number, every one with a ``loss_mask``, and the step's loss
denominators (`tightpack.runtime.step_loss`). When the stream ends, a short last step is planned and
yielded like the others (a rank may hold fewer candidates in it, or none); with ``drop_last`` it is
left out, with a warning and its count in ``left_out``. The state is the number of steps done: a
resumed packer reads on from the same positions, so the steps after a resume are those of an
uninterrupted run.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tightpack.core.cost_model import CostModel
from tightpack.core.step_planner import LossDenominators, StepPlan, check_budget, plan_step
from tightpack.errors import TightpackError
from tightpack.runtime.in_batch import pack_samples

__all__ = ["GlobalBatchPacker", "GlobalStep"]


@dataclass
class GlobalStep:
    """One step of a rank: its micro-batches, the step's loss denominators, and the step's plan."""

    micro_batches: list[dict[str, Any]]
    denominators: LossDenominators
    plan: StepPlan
    keys: list[list[Any]]
    """The keys of each micro-batch's samples, in order (an empty micro-batch has none)."""


def _mask(sample: Mapping[str, Any]) -> torch.Tensor:
    """The tokens a sample trains: its ``loss_mask``; else its ``labels != -100``; else every token."""
    if sample.get("loss_mask") is not None:
        return torch.as_tensor(sample["loss_mask"])
    if sample.get("labels") is not None:
        return (torch.as_tensor(sample["labels"]) != -100).long()
    return torch.ones(len(sample["input_ids"]), dtype=torch.long)


def _masked(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample with its ``loss_mask`` (a new dict when it had none: the caller's is left alone)."""
    return sample if sample.get("loss_mask") is not None else {**sample, "loss_mask": _mask(sample)}


class GlobalBatchPacker:
    """Every step, ``samples_per_step`` samples pooled across the data-parallel ranks and dealt back to
    them in balanced micro-batches (`plan_step`).

    Args:
        source: ``source(start, stride)`` yields samples ``{"key", "input_ids"[, "labels", "loss_mask"]}``
            at positions ``start, start + stride, ...``, as for `tightpack.runtime.online.OnlinePacker`.
        samples_per_step: the step's pool, all ranks together; a multiple of the world size.
        max_tokens: the token budget of a micro-batch; or give ``micro_batches`` per rank.
        cost_model: what balances the ranks (`tightpack.core.cost_model.CostModel` or a preset name);
            None: tokens.
        restore: ``restore(key)`` prepares any sample by its key; without it the ranks exchange samples.
        group: the data-parallel process group (None: the default group; without torch.distributed
            initialized, one rank).
        pad_to_multiple_of: the alignment of every sequence, as for `tightpack.core.step_planner.plan_step`
            (the budget counts aligned tokens) and for ``pack_fn``.
        allow_oversize: a sample above ``max_tokens`` gets a micro-batch of its own, as there.
        pack_fn: builds a micro-batch, called as ``pack_fn(samples, pad_to_multiple_of=k)`` with samples
            that all carry a ``loss_mask`` (`tightpack.runtime.in_batch.pack_samples`).
        pad_token_id: the token of a padding micro-batch.
        drop_last: leave out a short last step (fewer than ``samples_per_step`` samples left), with a
            warning and its count in ``left_out``; False (default): plan and yield it like the others.

    Every micro-batch has a ``loss_mask``: a sample's own; else ``labels != -100``; else all ones (the
    supervised tokens the plan's loss denominators count). A rank dealt fewer samples than the step's
    micro-batch count (the plan says how many, ``StepPlan.empty_micro_batches``) gets padding
    micro-batches: one ``pad_token_id`` token aligned to ``pad_to_multiple_of``, nothing to learn (an
    all-zero ``loss_mask``), so that every rank runs as many forwards as the others (FSDP and tensor
    parallelism gather inside the forward). Their keys are empty.

    Example (every rank runs it)::

        packer = GlobalBatchPacker(source, samples_per_step=512, max_tokens=16384, cost_model="llama-8b")
        for step in packer:
            for batch in step.micro_batches:
                loss = packed_step_loss(per_token_loss(model, batch), batch, step.denominators,
                                        data_parallel_size=packer.world_size)
                loss.backward()
            optimizer.step()
    """

    def __init__(
        self,
        source: Callable[[int, int], Iterator[dict[str, Any]]],
        *,
        samples_per_step: int,
        max_tokens: int | None = None,
        micro_batches: int | None = None,
        cost_model: CostModel | str | None = None,
        restore: Callable[[Any], dict[str, Any]] | None = None,
        group: dist.ProcessGroup | None = None,
        pad_to_multiple_of: int = 1,
        allow_oversize: bool = False,
        pack_fn: Callable[..., dict[str, Any]] = pack_samples,
        pad_token_id: int = 0,
        drop_last: bool = False,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        if (
            not isinstance(samples_per_step, int)
            or samples_per_step < 1
            or samples_per_step % self.world_size
        ):
            raise TightpackError(
                f"samples_per_step must be a positive multiple of the {self.world_size} data-parallel ranks, "
                f"got {samples_per_step!r}"
            )
        self.source, self.restore, self.pack_fn = source, restore, pack_fn
        self.padding = {
            "key": None,
            "input_ids": torch.tensor([pad_token_id]),
            "loss_mask": torch.tensor([0]),
        }
        self.samples_per_step, self.drop_last = samples_per_step, drop_last
        self.planning = dict(
            max_tokens=max_tokens,
            micro_batches=micro_batches,
            cost_model=cost_model,
            pad_to_multiple_of=pad_to_multiple_of,
            allow_oversize=allow_oversize,
        )
        plan_step([1], 1, **self.planning)  # the settings' errors now, not at the first step
        self.steps = 0
        self.left_out = 0
        """Samples of the stream left out so far (a short last step with ``drop_last``), every rank's."""

    def state_dict(self) -> dict[str, Any]:
        """What resumes the packer: the steps done, the samples left out, and the settings."""
        done = {"steps": self.steps, "left_out": self.left_out}
        return done | {"samples_per_step": self.samples_per_step, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["samples_per_step"], state["world_size"])
        if saved != (self.samples_per_step, self.world_size):
            raise TightpackError(
                f"the state was saved with samples_per_step={saved[0]} over {saved[1]} ranks, this packer "
                f"has {self.samples_per_step} over {self.world_size}: the steps would read other positions"
            )
        self.steps, self.left_out = int(state["steps"]), int(state.get("left_out", 0))

    def _gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def __iter__(self) -> Iterator[GlobalStep]:
        per_rank = self.samples_per_step // self.world_size
        multiple = self.planning["pad_to_multiple_of"]
        stream = self.source(self.rank + self.steps * self.samples_per_step, self.world_size)
        while True:
            mine = list(itertools.islice(stream, per_rank))
            pools = self._gather(self._describe(mine))
            if problems := [pool for pool in pools if isinstance(pool, str)]:
                raise TightpackError(problems[0])
            sizes = [len(rank_pool) for rank_pool in pools]
            count = sum(sizes)
            short = count < self.samples_per_step  # the stream ends in this step, on every rank alike
            if short and (self.drop_last or not count):
                if count:
                    self.left_out = count  # only the last step of a stream is short: set, not added
                    warnings.warn(
                        f"GlobalBatchPacker left out the stream's last {count} samples, a step short of "
                        f"samples_per_step={self.samples_per_step} (drop_last=True); pass drop_last=False "
                        "to train on them",
                        stacklevel=2,
                    )
                return
            pool = [entry for rank_pool in pools for entry in rank_pool]  # rank 0's, then rank 1's, ...
            lengths, supervised = np.array([entry[1:] for entry in pool], dtype=np.int64).reshape(-1, 2).T
            self._check_sizes([key for key, _, _ in pool], lengths)
            plan = plan_step(lengths, self.world_size, supervised=supervised, **self.planning)
            samples = self._samples(mine, pool, plan, sum(sizes[: self.rank]))
            batches, keys = [], []
            for indices in plan.rank_batches(self.rank):
                members = [samples[int(index)] for index in indices]
                keys.append([member["key"] for member in members])
                rows = [_masked(member) for member in members] or [self.padding]
                batches.append(self.pack_fn(rows, pad_to_multiple_of=multiple))
            self.steps += 1
            yield GlobalStep(batches, plan.loss_denominators, plan, keys)
            if short:
                return

    def _describe(self, mine: list[dict]) -> list[tuple] | str:
        """What the planner needs of this rank's candidates (key, tokens, supervised tokens), or what is
        wrong with one of them (every rank then raises it)."""
        described = []
        for index, sample in enumerate(mine):
            position = self.steps * self.samples_per_step + self.rank + index * self.world_size
            if not isinstance(sample, Mapping) or "key" not in sample or sample.get("input_ids") is None:
                return (
                    f"the sample at position {position} of the stream (rank {self.rank}) has no 'key' or no "
                    "'input_ids': samples need both, 'key' naming the sample (restore(key), GlobalStep.keys) "
                    "and 'input_ids' its tokens; make the source yield them"
                )
            described.append((sample["key"], len(sample["input_ids"]), int(_mask(sample).count_nonzero())))
        return described

    def _check_sizes(self, keys: list[Any], lengths: np.ndarray) -> None:
        """Raise naming the first sample above ``max_tokens`` (every rank sees the same pool)."""
        if self.planning["max_tokens"] and not self.planning["allow_oversize"]:
            check_budget(lengths, self.planning["pad_to_multiple_of"], self.planning["max_tokens"], keys)

    def _samples(self, mine: list[dict], pool: list[tuple], plan: StepPlan, first: int) -> dict[int, dict]:
        """This rank's samples of the step, by their place in the pool (this rank's start at ``first``)."""
        wanted = np.concatenate(plan.rank_batches(self.rank)).tolist()
        if self.restore is None:
            everyone = [sample for rank_samples in self._gather(mine) for sample in rank_samples]
            return {index: everyone[index] for index in wanted}
        ours = range(first, first + len(mine))
        return {
            index: mine[index - first] if index in ours else self.restore(pool[index][0]) for index in wanted
        }
