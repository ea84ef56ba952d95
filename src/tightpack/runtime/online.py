"""Online packing: a stream of prepared samples, a buffer of candidates, one pack per step (contract 4).

`OnlinePacker` reads samples from a restartable source into a buffer of ``packing_buffer_size``
candidates and emits one THD pack per step, built by `tightpack.runtime.in_batch.build_thd_from_rows`
and carrying its members' keys. Strategies:

- ``ffd`` (the reference's semantics): when no groups are pending, first-fit-decreasing over the
  whole buffer; the groups are then emitted one per step before any new sample is read.
- ``best_fill`` (default): leftovers stay in the buffer; every step emits the fullest pack the buffer
  allows (an exact subset sum, `tightpack.core.subset_fill.best_subset`). Among the fullest packs it
  takes one holding the oldest sample when there is one, and otherwise the one with the shortest
  samples: old samples leave in arrival order and the buffer keeps enough tokens to fill the next
  packs. A sample that arrived at step ``a`` is emitted by step ``a + max_wait``: samples are forced
  into packs earliest deadline first as soon as their slack reaches their rank among the deadlines,
  and with ``max_wait >= packing_buffer_size`` that always leaves room (at most one forced sample per
  step is ever needed, and any sample fits a pack).

Inside a ``DataLoader`` with workers, worker ``w`` of ``W`` on data-parallel rank ``r`` of ``R`` packs
its own shard: the samples at positions ``r * W + w`` modulo ``R * W`` of the stream.

Nothing is dropped (except by the ``drop`` long-sample policy, counted): a finite stream is flushed.
`state_dict` holds keys, lengths, arrival steps and counters, never tensors; `load_state_dict`
restores the buffer through ``restore(key)`` and restarts the source after the samples already read,
so a restored packer yields exactly the packs an uninterrupted one would. It refuses a state saved
with other settings, another shard layout (data-parallel size, worker count) or other data (a
restored sample of another length, or another ``data_id``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tightpack.core.alignment import ceil_to_multiple, length_cap
from tightpack.core.planner import plan_packs
from tightpack.core.subset_fill import best_subset
from tightpack.errors import TightpackError
from tightpack.runtime.in_batch import pack_samples

__all__ = ["OnlinePacker"]

Strategy = Literal["best_fill", "ffd"]


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
        restore: ``restore(key)`` prepares the sample with that key again (for `load_state_dict`).
        pack_size: tokens per pack.
        packing_buffer_size: candidates kept (per worker).
        strategy: ``best_fill`` or ``ffd``.
        max_wait: steps a sample may wait (``best_fill``); default ``4 * packing_buffer_size``.
        pad_to_multiple_of, pad_to_max_length: alignment of every sample, and a fixed pack width.
        long_samples: samples whose aligned length exceeds the pack size: ``truncate``, ``drop``, ``error``.
        rank, world_size: this data-parallel rank and their number; each rank packs its own shard.
        data_id: names the stream (dataset, split, shuffle seed); a state saved under another is refused.
        pack_fn: builds a batch from the member samples, with the keyword arguments of
            `tightpack.runtime.in_batch.pack_samples` (the default); for Qwen2-VL positions pass
            ``functools.partial(pack_vlm_samples, image_token_id=...)``.

    Each pack is a THD batch ``[1, T]`` with ``keys``, its members' keys in order.

    >>> samples = [{"key": i, "input_ids": torch.arange(n)} for i, n in enumerate([5, 3, 4, 2])]
    >>> packer = OnlinePacker(lambda start, stride: iter(samples[start::stride]), pack_size=8,
    ...                       packing_buffer_size=4)
    >>> [pack["keys"] for pack in packer]
    [[0, 1], [2, 3]]
    """

    def __init__(
        self,
        source: Callable[[int, int], Iterator[dict[str, Any]]],
        *,
        restore: Callable[[Any], dict[str, Any]] | None = None,
        pack_size: int,
        packing_buffer_size: int,
        strategy: Strategy = "best_fill",
        max_wait: int | None = None,
        pad_to_multiple_of: int = 1,
        pad_to_max_length: bool = False,
        long_samples: Literal["truncate", "drop", "error"] = "truncate",
        pad_token_id: int = 0,
        ignore_index: int = -100,
        rank: int = 0,
        world_size: int = 1,
        data_id: str | None = None,
        pack_fn: Callable[..., dict[str, Any]] = pack_samples,
    ) -> None:
        if strategy not in ("best_fill", "ffd"):
            raise TightpackError(f"strategy must be best_fill or ffd, got {strategy!r}")
        if packing_buffer_size < 1 or pack_size < pad_to_multiple_of:
            raise TightpackError(
                f"packing_buffer_size ({packing_buffer_size}) must be >= 1 and pack_size ({pack_size}) at "
                f"least the alignment multiple ({pad_to_multiple_of})"
            )
        max_wait = 4 * packing_buffer_size if max_wait is None else max_wait
        if strategy == "best_fill" and max_wait < packing_buffer_size:
            raise TightpackError(
                f"max_wait ({max_wait}) must be at least packing_buffer_size ({packing_buffer_size}): a full "
                "buffer can hold that many samples due at once, and one pack per step takes them in turn"
            )
        if long_samples not in ("truncate", "drop", "error"):
            raise TightpackError(f"long_samples must be truncate, drop or error, got {long_samples!r}")
        if not 0 <= rank < world_size:
            raise TightpackError(f"rank ({rank}) must be in [0, world_size={world_size})")
        self.source, self.restore, self.pack_fn = source, restore, pack_fn
        self.pack_size, self.buffer_size = pack_size, packing_buffer_size
        self.strategy, self.max_wait = strategy, max_wait
        self.multiple, self.pad_to_max_length = pad_to_multiple_of, pad_to_max_length
        self.long_samples = long_samples
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index
        self.rank, self.world_size, self.data_id = rank, world_size, data_id
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
        }

    def shard(self) -> tuple[int, int]:
        """``(shard, shards)`` of the calling process: data-parallel rank and DataLoader worker."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    # -- reading ------------------------------------------------------------------------------------

    def _admit(self, sample: dict[str, Any], arrival: int, *, count: bool = True) -> _Candidate | None:
        """The candidate of a sample, after the long-sample policy (counted unless ``count`` is False)."""
        tokens = length = len(sample["input_ids"])
        if ceil_to_multiple(length, self.multiple) > self.pack_size:
            if self.long_samples == "error":
                raise TightpackError(
                    f"sample {sample['key']!r} has {length} tokens, above the pack size {self.pack_size}; "
                    "raise pack_size or choose long_samples='truncate' or 'drop'"
                )
            if self.long_samples == "drop":
                self.counts["dropped"] += count
                return None
            self.counts["truncated"] += count
            keep = length_cap(self.pack_size, self.multiple)
            sample = {
                k: v[:keep] if isinstance(v, torch.Tensor) and v.dim() == 1 else v for k, v in sample.items()
            }
            length = keep
        nbytes = sum(v.nbytes for v in sample.values() if isinstance(v, torch.Tensor))
        return _Candidate(
            sample["key"], sample, ceil_to_multiple(length, self.multiple), arrival, tokens, nbytes
        )

    def _hold(self, candidate: _Candidate) -> None:
        self.buffer.append(candidate)
        self.counts["held_bytes"] += candidate.nbytes
        self.counts["peak_held_bytes"] = max(self.counts["peak_held_bytes"], self.counts["held_bytes"])

    def _fill(self, stream: Iterator[dict[str, Any]]) -> bool:
        """Top the buffer up; False when the stream is exhausted."""
        while len(self.buffer) < self.buffer_size:
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
        plan = plan_packs([c.length for c in self.buffer], self.pack_size, algorithm="ffd")
        groups = [[self.buffer[i] for i in pack.tolist()] for pack in plan]
        self.buffer = []
        return groups

    def _best_fill(self) -> list[_Candidate]:
        by_deadline = sorted(self.buffer, key=lambda c: (c.arrival, str(c.key)))
        chosen, room = [], self.pack_size
        for rank, candidate in enumerate(by_deadline):  # earliest deadline first
            # Due when fewer steps are left than samples due no later: the first due one always fits.
            if candidate.arrival + self.max_wait - self.step <= rank and candidate.length <= room:
                chosen.append(candidate)
                room -= candidate.length
        taken = {id(c) for c in chosen}
        oldest = next((c for c in by_deadline if id(c) not in taken and c.length <= room), None)
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
        if self.strategy == "ffd":
            if not self.pending and (len(self.buffer) >= self.buffer_size or not stream_open) and self.buffer:
                self.pending = self._ffd_groups()
            return self.pending.pop(0) if self.pending else None
        if len(self.buffer) >= self.buffer_size or (not stream_open and self.buffer):
            return self._best_fill()
        return None

    # -- emission -----------------------------------------------------------------------------------

    def _pack(self, group: list[_Candidate]) -> dict[str, Any]:
        samples = [candidate.sample for candidate in group]
        batch = self.pack_fn(
            samples,
            sequence_length=self.pack_size if self.pad_to_max_length else None,
            pad_token_id=self.pad_token_id,
            ignore_index=self.ignore_index,
            pad_to_multiple_of=self.multiple,
            pad_to_max_length=self.pad_to_max_length,
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
        return {
            "pack_size": self.pack_size,
            "packing_buffer_size": self.buffer_size,
            "strategy": self.strategy,
            "max_wait": self.max_wait,
            "pad_to_multiple_of": self.multiple,
            "pad_to_max_length": self.pad_to_max_length,
            "long_samples": self.long_samples,
            "rank": self.rank,
            "world_size": self.world_size,
            "data_id": self.data_id,
        }

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
        differences = {
            name: (saved, self._settings().get(name))
            for name, saved in state["settings"].items()
            if self._settings().get(name) != saved
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
        self.counts = dict(state["counts"])
        self.buffer = [candidate(*saved) for saved in state["buffer"]]
        self.pending = [[candidate(*saved) for saved in group] for group in state["pending"]]
        self._resumed_shard = tuple(state["shard"])

    @property
    def mean_wait(self) -> float:
        """Mean steps between a sample's arrival and its pack."""
        return self.counts["waited"] / max(self.counts["samples"], 1)

    def fill(self) -> float:
        """Real tokens over ``packs * pack_size`` so far."""
        return self.counts["tokens"] / max(self.counts["packs"] * self.pack_size, 1)
