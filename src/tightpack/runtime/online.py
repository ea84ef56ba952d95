"""Online packing: a stream of prepared samples, a buffer of candidates, one pack per step (contract 4).

`OnlinePacker` reads samples from a restartable source into a buffer of ``packing_buffer_size``
candidates and emits one THD pack per step, built by `tightpack.runtime.in_batch.build_thd_from_rows`
and carrying its members' keys. Its settings are an `OnlinePackConfig`. Strategies:

- ``ffd`` (the reference's semantics): when no groups are pending, first-fit-decreasing over the
  whole buffer; the groups are then emitted one per step before any new sample is read.
- ``best_fill`` (default): leftovers stay in the buffer; every step emits the fullest pack the buffer
  allows (an exact subset sum, `tightpack.core.subset_fill.best_subset`). Among the fullest packs it
  takes one holding the oldest sample when there is one, and otherwise the one with the shortest
  samples: old samples leave in arrival order and the buffer keeps enough tokens to fill the next
  packs. A sample that arrived at step ``a`` is emitted by step ``a + max_wait``.

How ``best_fill`` keeps that bound. Rank the buffered samples by deadline (``arrival + max_wait``; rank
0 is the earliest) and call a sample's *slack* the steps left until its deadline. Every selection
starts from the invariant **slack >= rank for every buffered sample**: at most one sample is due now,
at most two within one step, and so on, so emitting one sample per step, earliest deadline first,
meets every deadline, even when no two samples fit one pack. A sample whose slack equals its rank is
*tight*; the pack starts with the tight samples in deadline order, each one taken if it still fits
(these are the *forced* samples), and the fullest fill of what is left tops it up. The invariant
holds again at the next step:

- the first tight sample always leaves: it goes into an empty pack, and every sample fits one;
- a later tight sample left out (it does not fit) is fine: an earlier-ranked sample left, so its rank
  drops by at least one as its slack drops by one;
- a sample that is not tight has a step to spare;
- a sample read at step ``a`` starts with slack ``max_wait`` at a rank below ``packing_buffer_size``,
  which the requirement ``max_wait >= packing_buffer_size`` covers with a step to spare.

A sample with slack 0 therefore has rank 0: it is tight and leaves on time. Several samples can be
tight at once and all that fit are forced, so one step may force several; only the first is needed
for the bound (forcing the others can cost fill: ``tests/test_online_forcing.py`` works an example).
``counts`` reports ``forced`` samples, ``forced_packs`` and ``multi_forced_packs`` (two or more).

Inside a ``DataLoader`` with workers, worker ``w`` of ``W`` on data-parallel rank ``r`` of ``R`` packs
its own shard: the samples at positions ``r * W + w`` modulo ``R * W`` of the stream.

Nothing is dropped (except by the ``drop`` long-sample policy, counted): a finite stream is flushed.
`state_dict` holds keys, lengths, arrival steps and counters, never tensors; `load_state_dict`
restores the buffer through ``restore(key)`` and restarts the source after the samples already read,
so a restored packer yields exactly the packs an uninterrupted one would. It refuses a state saved
with other settings (`OnlinePackConfig.settings`), another shard layout (data-parallel size, worker
count) or other data (a restored sample of another length, or another ``data_id``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tightpack.core.alignment import ceil_to_multiple, length_cap
from tightpack.core.planner import plan_packs
from tightpack.core.subset_fill import best_subset
from tightpack.errors import TightpackError
from tightpack.runtime.in_batch import pack_samples
from tightpack.runtime.online_config import OnlinePackConfig

__all__ = ["OnlinePackConfig", "OnlinePacker"]


@dataclass
class _Candidate:
    key: Any
    sample: dict[str, Any]
    length: int  # aligned length
    arrival: int  # step at which it entered the buffer
    tokens: int  # length as read, before truncation and alignment
    nbytes: int  # host memory held by its tensors


class OnlinePacker(torch.utils.data.IterableDataset):
    """Pack a stream online, one pack per step.

    Args:
        source: ``source(start, stride)`` yields the samples at positions ``start, start + stride, ...``
            of the stream; each sample is a mapping with ``key`` and a 1-D ``input_ids`` tensor
            (optionally ``labels``, ``loss_mask`` and the visual tensors of
            `tightpack.runtime.in_batch.VISUAL_KEYS`). Prepare samples lazily in it: a worker only
            reads its own positions.
        config: the settings (`OnlinePackConfig`), validated here.
        restore: ``restore(key)`` prepares the sample with that key again (for `load_state_dict`).
        rank, world_size: this data-parallel rank and their number; each rank packs its own shard.
        pack_fn: builds a batch from the member samples, with the keyword arguments of
            `tightpack.runtime.in_batch.pack_samples` (the default); for Qwen2-VL positions pass
            ``functools.partial(pack_vlm_samples, image_token_id=...)``.

    Raises:
        TightpackError: a setting is invalid, or ``rank`` is outside ``[0, world_size)``.

    Each pack is a THD batch ``[1, T]`` with ``keys``, its members' keys in order. ``counts`` holds
    ``samples``, ``packs``, ``tokens`` (real ones), ``truncated`` and ``dropped`` samples, ``waited``
    (steps, summed over samples) and ``max_wait``, ``held_bytes`` and ``peak_held_bytes`` (host memory
    of the buffer), and for ``best_fill`` ``forced`` (samples forced in by their deadline),
    ``forced_packs`` (packs holding one) and ``multi_forced_packs`` (packs holding two or more).

    >>> samples = [{"key": i, "input_ids": torch.arange(n)} for i, n in enumerate([5, 3, 4, 2])]
    >>> config = OnlinePackConfig(pack_size=8, packing_buffer_size=4)
    >>> packer = OnlinePacker(lambda start, stride: iter(samples[start::stride]), config)
    >>> [pack["keys"] for pack in packer]
    [[0, 1], [2, 3]]
    """

    def __init__(
        self,
        source: Callable[[int, int], Iterator[dict[str, Any]]],
        config: OnlinePackConfig,
        *,
        restore: Callable[[Any], dict[str, Any]] | None = None,
        rank: int = 0,
        world_size: int = 1,
        pack_fn: Callable[..., dict[str, Any]] = pack_samples,
    ) -> None:
        if not isinstance(config, OnlinePackConfig):
            raise TightpackError(
                f"config must be an OnlinePackConfig, got {type(config).__name__}; build it with "
                "OnlinePackConfig(pack_size=..., packing_buffer_size=...)"
            )
        config.validate()
        if not 0 <= rank < world_size:
            raise TightpackError(f"rank ({rank}) must be in [0, world_size={world_size})")
        self.source, self.restore, self.pack_fn = source, restore, pack_fn
        self.config = config
        self.rank, self.world_size = rank, world_size
        self._resumed_shard: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self.consumed = 0  # samples of this shard read from the source
        self.step = 0  # packs emitted
        self.exhausted = False
        self.buffer: list[_Candidate] = []
        self.pending: list[list[_Candidate]] = []
        self.counts = {
            "samples": 0,
            "packs": 0,
            "truncated": 0,
            "dropped": 0,
            "tokens": 0,
            "waited": 0,
            "max_wait": 0,
            "held_bytes": 0,
            "peak_held_bytes": 0,
            "forced": 0,
            "forced_packs": 0,
            "multi_forced_packs": 0,
        }

    def shard(self) -> tuple[int, int]:
        """``(shard, shards)`` of the calling process: data-parallel rank and DataLoader worker."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    # -- reading ------------------------------------------------------------------------------------

    def _admit(self, sample: dict[str, Any], arrival: int, *, count: bool = True) -> _Candidate | None:
        """The candidate of a sample, after the long-sample policy (counted unless ``count`` is False)."""
        size, multiple = self.config.pack_size, self.config.pad_to_multiple_of
        tokens = length = len(sample["input_ids"])
        if ceil_to_multiple(length, multiple) > size:
            if self.config.long_samples == "error":
                raise TightpackError(
                    f"sample {sample['key']!r} has {length} tokens, above the pack size {size}; "
                    "raise pack_size or choose long_samples='truncate' or 'drop'"
                )
            if self.config.long_samples == "drop":
                self.counts["dropped"] += count
                return None
            self.counts["truncated"] += count
            keep = length_cap(size, multiple)
            sample = {
                k: v[:keep] if isinstance(v, torch.Tensor) and v.dim() == 1 else v for k, v in sample.items()
            }
            length = keep
        nbytes = sum(v.nbytes for v in sample.values() if isinstance(v, torch.Tensor))
        return _Candidate(sample["key"], sample, ceil_to_multiple(length, multiple), arrival, tokens, nbytes)

    def _hold(self, candidate: _Candidate) -> None:
        self.buffer.append(candidate)
        self.counts["held_bytes"] += candidate.nbytes
        self.counts["peak_held_bytes"] = max(self.counts["peak_held_bytes"], self.counts["held_bytes"])

    def _fill(self, stream: Iterator[dict[str, Any]]) -> bool:
        """Top the buffer up; False when the stream is exhausted."""
        while len(self.buffer) < self.config.packing_buffer_size:
            sample = next(stream, None)
            if sample is None:
                return False
            self.consumed += 1
            candidate = self._admit(sample, self.step)
            if candidate is not None:
                self._hold(candidate)
        return True

    # -- selection ----------------------------------------------------------------------------------

    def _ffd_groups(self) -> list[list[_Candidate]]:
        plan = plan_packs([c.length for c in self.buffer], self.config.pack_size, algorithm="ffd")
        groups = [[self.buffer[i] for i in pack.tolist()] for pack in plan]
        self.buffer = []
        return groups

    def _by_deadline(self) -> list[tuple[int, _Candidate]]:
        """``(slack, candidate)`` for the buffer in deadline order: the list index is the rank."""
        by_deadline = sorted(self.buffer, key=lambda c: (c.arrival, str(c.key)))
        return [(c.arrival + self.config.wait_limit - self.step, c) for c in by_deadline]

    def _best_fill(self) -> list[_Candidate]:
        by_deadline = self._by_deadline()
        chosen, room = [], self.config.pack_size
        for rank, (slack, candidate) in enumerate(by_deadline):
            # The invariant of the module docstring, slack >= rank, is what guarantees every deadline;
            # checking it costs one comparison per candidate.
            if slack < rank:
                raise RuntimeError(
                    f"online packer invariant broken at step {self.step}: sample {candidate.key!r} has "
                    f"{slack} steps left before its deadline but {rank} samples due no later ahead of it, "
                    "so its max_wait can no longer be guaranteed; this is a bug in tightpack, please "
                    "report it"
                )
            # Tight (slack == rank): forced if it fits. The first tight one goes into an empty pack, so it
            # always fits; a later one left out is fine: an earlier-ranked one leaves, so its rank drops
            # by at least one as its slack drops by one.
            if slack == rank and candidate.length <= room:
                chosen.append(candidate)
                room -= candidate.length
        if chosen:
            self.counts["forced"] += len(chosen)
            self.counts["forced_packs"] += 1
            self.counts["multi_forced_packs"] += len(chosen) > 1
        taken = {id(c) for c in chosen}
        oldest = next((c for _, c in by_deadline if id(c) not in taken and c.length <= room), None)
        if oldest is not None:
            rest = sorted(
                (c for c in self.buffer if id(c) not in taken and c.length <= room),
                key=lambda c: (c.length, c.arrival, str(c.key)),
            )
            best = best_subset([c.length for c in rest], room, first=rest.index(oldest))
            taken.update(id(rest[i]) for i in best)
        chosen = [c for c in self.buffer if id(c) in taken]  # members in arrival order
        self.buffer = [c for c in self.buffer if id(c) not in taken]
        return chosen

    def _next_group(self, stream_open: bool) -> list[_Candidate] | None:
        full = len(self.buffer) >= self.config.packing_buffer_size
        if self.config.strategy == "ffd":
            if not self.pending and (full or not stream_open) and self.buffer:
                self.pending = self._ffd_groups()
            return self.pending.pop(0) if self.pending else None
        if full or (not stream_open and self.buffer):
            return self._best_fill()
        return None

    # -- emission -----------------------------------------------------------------------------------

    def _pack(self, group: list[_Candidate]) -> dict[str, Any]:
        config = self.config
        samples = [candidate.sample for candidate in group]
        batch = self.pack_fn(
            samples,
            sequence_length=config.pack_size if config.pad_to_max_length else None,
            pad_token_id=config.pad_token_id,
            ignore_index=config.ignore_index,
            pad_to_multiple_of=config.pad_to_multiple_of,
            pad_to_max_length=config.pad_to_max_length,
        )
        batch["keys"] = [c.key for c in group]
        self._record(group, tokens=sum(len(sample["input_ids"]) for sample in samples))
        return batch

    def _record(self, group: list[_Candidate], tokens: int) -> None:
        """Count an emitted pack: its samples, real tokens, the waits of its members, memory released."""
        for candidate in group:
            wait = self.step - candidate.arrival
            self.counts["waited"] += wait
            self.counts["max_wait"] = max(self.counts["max_wait"], wait)
            self.counts["held_bytes"] -= candidate.nbytes
        self.step += 1
        self.counts["packs"] += 1
        self.counts["samples"] += len(group)
        self.counts["tokens"] += tokens

    def __iter__(self) -> Iterator[dict[str, Any]]:
        shard, shards = self.shard()
        if self._resumed_shard not in (None, (shard, shards)):
            saved, saved_shards = self._resumed_shard
            raise TightpackError(
                f"the state was saved by shard {saved} of {saved_shards} (data-parallel ranks x DataLoader "
                f"workers) and is loaded in shard {shard} of {shards}: resume with the same world size and "
                "num_workers"
            )
        if self.exhausted:  # a new pass over a finite stream
            self._reset()
        stream = iter(self.source(shard + self.consumed * shards, shards))
        stream_open = True
        while True:
            if stream_open and not self.pending:
                stream_open = self._fill(stream)
            group = self._next_group(stream_open)
            if group is None:
                if not stream_open and not self.buffer and not self.pending:
                    self.exhausted = True
                    return
                continue
            yield self._pack(group)

    # -- checkpoint ---------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        """The saved settings: the config's, and the data-parallel layout this packer shards by."""
        return self.config.settings() | {"rank": self.rank, "world_size": self.world_size}

    def state_dict(self) -> dict[str, Any]:
        """Keys, lengths, arrival steps and counters: everything needed to continue exactly, and no tensor."""
        return {
            "settings": self._settings(),
            "shard": list(self.shard()),
            "consumed": self.consumed,
            "step": self.step,
            "exhausted": self.exhausted,
            "buffer": [(c.key, c.tokens, c.arrival) for c in self.buffer],
            "pending": [[(c.key, c.tokens, c.arrival) for c in group] for group in self.pending],
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` saved with the same settings, shard layout and data."""
        current = self._settings()
        differences = {
            name: (saved, current.get(name))
            for name, saved in state["settings"].items()
            if current.get(name) != saved
        }
        if differences:
            listed = ", ".join(
                f"{name} saved {old!r} now {new!r}" for name, (old, new) in differences.items()
            )
            raise TightpackError(
                f"cannot resume the online packer with different settings: {listed}; resume with the "
                "saved ones"
            )
        if (state["buffer"] or state["pending"]) and self.restore is None:
            raise TightpackError("load_state_dict needs restore(key) to prepare the buffered samples again")

        def candidate(key: Any, tokens: int, arrival: int) -> _Candidate:
            sample = self.restore(key)
            if len(sample["input_ids"]) != tokens:
                raise TightpackError(
                    f"restored sample {key!r} has {len(sample['input_ids'])} tokens, saved with {tokens}: "
                    "the data or its preparation changed since the checkpoint"
                )
            restored = self._admit(sample, arrival, count=False)  # counted when it first arrived
            if restored is None:
                raise TightpackError(f"restored sample {key!r} would be dropped: the data changed")
            return restored

        self._reset()
        self.consumed, self.step, self.exhausted = state["consumed"], state["step"], state["exhausted"]
        self.counts.update(state["counts"])  # a state saved before a counter existed leaves it at 0
        self.buffer = [candidate(*saved) for saved in state["buffer"]]
        self.pending = [[candidate(*saved) for saved in group] for group in state["pending"]]
        self._resumed_shard = tuple(state["shard"])
        if self.config.strategy == "best_fill":  # what the next selection checks, as an input error here
            for rank, (slack, restored) in enumerate(self._by_deadline()):
                if slack < rank:
                    raise TightpackError(
                        f"the state's buffer cannot be met by max_wait: at step {self.step}, sample "
                        f"{restored.key!r} (read at step {restored.arrival}) has {slack} steps left and "
                        f"{rank} samples due no later; the state was edited or comes from another packer"
                    )

    @property
    def mean_wait(self) -> float:
        """Mean steps between a sample's arrival and its pack."""
        return self.counts["waited"] / max(self.counts["samples"], 1)

    def fill(self) -> float:
        """Real tokens over ``packs * pack_size`` so far."""
        return self.counts["tokens"] / max(self.counts["packs"] * self.config.pack_size, 1)
