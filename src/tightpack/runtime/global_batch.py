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
``pack_fn``'s), all ranks the same number, and the step's loss denominators
(`tightpack.runtime.step_loss`). The state is the number of steps done: a resumed packer reads on
from the same positions, so the steps after a resume are those of an uninterrupted run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tightpack.core.cost_model import CostModel
from tightpack.core.step_planner import LossDenominators, StepPlan, plan_step
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


def _supervised(sample: dict[str, Any]) -> int:
    if sample.get("loss_mask") is not None:
        return int(torch.as_tensor(sample["loss_mask"]).count_nonzero())
    if sample.get("labels") is not None:
        return int((torch.as_tensor(sample["labels"]) != -100).sum())
    return len(sample["input_ids"])


class GlobalBatchPacker:
    """Every step, ``samples_per_step`` samples pooled across the data-parallel ranks and dealt back to
    them in balanced micro-batches (module docstring).

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
        pad_to_multiple_of: the alignment of every sequence, as for `tightpack.core.step_planner.plan_step`.
        allow_oversize: a sample above ``max_tokens`` gets a micro-batch of its own, as there.
        pack_fn: builds a micro-batch from its samples (`tightpack.runtime.in_batch.pack_samples`).
        pad_token_id: the token of a padding micro-batch.

    A rank dealt fewer samples than the step's micro-batch count (the plan says how many,
    ``StepPlan.empty_micro_batches``) gets padding micro-batches: one ``pad_token_id`` token, nothing
    to learn (an all-zero ``loss_mask``), so that every rank runs as many forwards as the others (FSDP
    and tensor parallelism gather inside the forward). Their keys are empty.

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
        self.samples_per_step = samples_per_step
        self.planning = dict(
            max_tokens=max_tokens,
            micro_batches=micro_batches,
            cost_model=cost_model,
            pad_to_multiple_of=pad_to_multiple_of,
            allow_oversize=allow_oversize,
        )
        plan_step([1], 1, **self.planning)  # the settings' errors now, not at the first step
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        """What resumes the packer: the steps done, and the settings they were done with."""
        return {"steps": self.steps, "samples_per_step": self.samples_per_step, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["samples_per_step"], state["world_size"])
        if saved != (self.samples_per_step, self.world_size):
            raise TightpackError(
                f"the state was saved with samples_per_step={saved[0]} over {saved[1]} ranks, this packer "
                f"has {self.samples_per_step} over {self.world_size}: the steps would read other positions"
            )
        self.steps = int(state["steps"])

    def _gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def __iter__(self) -> Iterator[GlobalStep]:
        per_rank = self.samples_per_step // self.world_size
        start = self.rank + self.steps * self.samples_per_step  # this rank's next position
        stream = self.source(start, self.world_size)
        while True:
            mine = list(itertools.islice(stream, per_rank))
            described = [(s["key"], len(s["input_ids"]), _supervised(s)) for s in mine]
            pools = self._gather(described)
            if any(len(pool) < per_rank for pool in pools):
                return  # the stream ends: a short last step is left out on every rank alike
            pool = [entry for rank_pool in pools for entry in rank_pool]  # rank 0's, then rank 1's, ...
            plan = plan_step(
                np.array([length for _, length, _ in pool]),
                self.world_size,
                supervised=np.array([supervised for _, _, supervised in pool]),
                **self.planning,
            )
            samples = self._samples(mine, pool, plan, per_rank)
            batches, keys = [], []
            for indices in plan.rank_batches(self.rank):
                members = [samples[int(index)] for index in indices]
                keys.append([member["key"] for member in members])
                batches.append(self.pack_fn(members or [self.padding]))
            self.steps += 1
            yield GlobalStep(batches, plan.loss_denominators, plan, keys)

    def _samples(self, mine: list[dict], pool: list[tuple], plan: StepPlan, per_rank: int) -> dict[int, dict]:
        """This rank's samples of the step, by their place in the pool."""
        wanted = np.concatenate(plan.rank_batches(self.rank)) if plan.micro_batches else np.zeros(0, int)
        first = self.rank * per_rank
        if self.restore is not None:
            return {
                int(index): mine[index - first]
                if first <= index < first + per_rank
                else self.restore(pool[index][0])
                for index in wanted.tolist()
            }
        everyone = self._gather(mine)
        return {int(index): everyone[index // per_rank][index % per_rank] for index in wanted.tolist()}
