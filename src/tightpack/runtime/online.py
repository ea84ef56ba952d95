"""Online packing: a stream of prepared samples, a buffer of candidates, one pack per step (contract 4).

`OnlinePacker` reads samples from a restartable source into a buffer of ``packing_buffer_size``
candidates and emits one THD pack per step, built by `tightpack.runtime.in_batch.build_thd_from_rows`
and carrying its members' keys. Strategies:

- ``ffd`` (the reference's semantics): when no groups are pending, first-fit-decreasing over the
  whole buffer; the groups are then emitted one per step before any new sample is read.
- ``best_fill`` (default): leftovers stay in the buffer; every step emits one pack filled as well as
  the buffer allows (largest samples first), after the samples whose deadline is near. A sample that
  arrived at step ``a`` is emitted by step ``a + max_wait``: samples are forced into packs earliest
  deadline first as soon as their slack reaches their rank among the deadlines, and with
  ``max_wait >= packing_buffer_size`` that always leaves room (at most one forced sample per step is
  ever needed, and any sample fits a pack).

Nothing is dropped (except by the ``drop`` long-sample policy, counted): a finite stream is flushed.
`state_dict` holds keys, arrival steps and counters, never tensors; `load_state_dict` restores the
buffer through ``restore(key)`` and restarts the source after the samples already read, so a
restored packer yields exactly the packs an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from tightpack.core.planner import plan_packs
from tightpack.errors import TightpackError
from tightpack.runtime.in_batch import build_thd_from_rows

__all__ = ["OnlinePacker"]

Strategy = Literal["best_fill", "ffd"]


@dataclass
class _Candidate:
    key: Any
    sample: dict[str, Any]
    length: int  # aligned length
    arrival: int  # step at which it entered the buffer


class OnlinePacker(torch.utils.data.IterableDataset):
    """Pack a stream online, one pack per step.

    Args:
        source: ``source(start)`` yields the samples of the stream from position ``start`` on; each
            sample is a mapping with ``key`` and a 1-D ``input_ids`` tensor (optionally ``labels``,
            ``loss_mask``).
        restore: ``restore(key)`` prepares the sample with that key again (for `load_state_dict`).
        pack_size: tokens per pack.
        packing_buffer_size: candidates kept.
        strategy: ``best_fill`` or ``ffd``.
        max_wait: steps a sample may wait (``best_fill``); default ``4 * packing_buffer_size``.
        pad_to_multiple_of, pad_to_max_length: alignment of every sample, and a fixed pack width.
        long_samples: samples whose aligned length exceeds the pack size: ``truncate``, ``drop``, ``error``.
    """

    def __init__(
        self,
        source: Callable[[int], Iterator[dict[str, Any]]],
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
        self.source, self.restore = source, restore
        self.pack_size, self.buffer_size = pack_size, packing_buffer_size
        self.strategy, self.max_wait = strategy, max_wait
        self.multiple, self.pad_to_max_length = pad_to_multiple_of, pad_to_max_length
        self.long_samples = long_samples
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index
        self._reset()

    def _reset(self) -> None:
        self.consumed = 0  # samples read from the source
        self.step = 0  # packs emitted
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
        }

    # -- reading ------------------------------------------------------------------------------------

    def _aligned(self, length: int) -> int:
        return -(-length // self.multiple) * self.multiple

    def _admit(self, sample: dict[str, Any], arrival: int, *, count: bool = True) -> _Candidate | None:
        """The candidate of a sample, after the long-sample policy (counted unless ``count`` is False)."""
        length = len(sample["input_ids"])
        if self._aligned(length) > self.pack_size:
            if self.long_samples == "error":
                raise TightpackError(
                    f"sample {sample['key']!r} has {length} tokens, above the pack size {self.pack_size}"
                )
            if self.long_samples == "drop":
                self.counts["dropped"] += count
                return None
            self.counts["truncated"] += count
            keep = self.pack_size // self.multiple * self.multiple
            sample = {
                k: v[:keep] if isinstance(v, torch.Tensor) and v.dim() == 1 else v for k, v in sample.items()
            }
            length = keep
        return _Candidate(sample["key"], sample, self._aligned(length), arrival)

    def _fill(self, stream: Iterator[dict[str, Any]]) -> bool:
        """Top the buffer up; False when the stream is exhausted."""
        while len(self.buffer) < self.buffer_size:
            sample = next(stream, None)
            if sample is None:
                return False
            self.consumed += 1
            candidate = self._admit(sample, self.step)
            if candidate is not None:
                self.buffer.append(candidate)
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
        rest = [c for c in self.buffer if id(c) not in taken and c.length <= room]
        if rest and room:
            # Pack the rest into bins of the room left, best fit, and take the fullest bin: big samples
            # leave with small ones, so the buffer keeps a mix and stays able to fill the next packs.
            plan = plan_packs([c.length for c in rest], room, algorithm="bfd")
            loads = plan.pack_loads(np.array([c.length for c in rest]))
            best = plan[int(np.argmax(loads))]
            chosen.extend(rest[i] for i in best.tolist())
            taken.update(id(rest[i]) for i in best.tolist())
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
        rows = []
        for candidate in group:
            sample = candidate.sample
            row = {"input_ids": sample["input_ids"], "position_ids": torch.arange(len(sample["input_ids"]))}
            row |= {k: sample[k] for k in ("labels", "loss_mask") if sample.get(k) is not None}
            rows.append(row)
        batch = build_thd_from_rows(
            rows,
            sequence_length=self.pack_size if self.pad_to_max_length else None,
            pad_token_id=self.pad_token_id,
            ignore_index=self.ignore_index,
            pad_to_multiple_of=self.multiple,
            pad_to_max_length=self.pad_to_max_length,
            emit_padding_mask=True,
        )
        batch["keys"] = [c.key for c in group]
        self._record(group, tokens=sum(len(row["input_ids"]) for row in rows))
        return batch

    def _record(self, group: list[_Candidate], tokens: int) -> None:
        """Count an emitted pack: its samples, real tokens and the waits of its members."""
        for candidate in group:
            wait = self.step - candidate.arrival
            self.counts["waited"] += wait
            self.counts["max_wait"] = max(self.counts["max_wait"], wait)
        self.step += 1
        self.counts["packs"] += 1
        self.counts["samples"] += len(group)
        self.counts["tokens"] += tokens

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stream = iter(self.source(self.consumed))
        stream_open = True
        while True:
            if stream_open and not self.pending:
                stream_open = self._fill(stream)
            group = self._next_group(stream_open)
            if group is None:
                if not stream_open and not self.buffer and not self.pending:
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
        }

    def state_dict(self) -> dict[str, Any]:
        """Keys, arrival steps and counters: everything needed to continue exactly, and no tensor."""
        return {
            "settings": self._settings(),
            "consumed": self.consumed,
            "step": self.step,
            "buffer": [(c.key, c.arrival) for c in self.buffer],
            "pending": [[(c.key, c.arrival) for c in group] for group in self.pending],
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict`; the settings must be the ones it was saved with."""
        differences = {
            name: (saved, self._settings()[name])
            for name, saved in state["settings"].items()
            if self._settings().get(name) != saved
        }
        if differences:
            listed = ", ".join(
                f"{name} saved {old!r} now {new!r}" for name, (old, new) in differences.items()
            )
            raise TightpackError(f"cannot resume the online packer with different settings: {listed}")
        if (state["buffer"] or state["pending"]) and self.restore is None:
            raise TightpackError("load_state_dict needs restore(key) to prepare the buffered samples again")

        def candidate(key: Any, arrival: int) -> _Candidate:
            restored = self._admit(self.restore(key), arrival, count=False)  # counted when it first arrived
            if restored is None:
                raise TightpackError(f"restored sample {key!r} would be dropped: the data changed")
            return restored

        self._reset()
        self.consumed, self.step = state["consumed"], state["step"]
        self.counts = dict(state["counts"])
        self.buffer = [candidate(key, arrival) for key, arrival in state["buffer"]]
        self.pending = [[candidate(key, arrival) for key, arrival in group] for group in state["pending"]]

    @property
    def mean_wait(self) -> float:
        return self.counts["waited"] / max(self.counts["samples"], 1)

    def fill(self) -> float:
        """Real tokens over ``packs * pack_size`` so far."""
        return self.counts["tokens"] / max(self.counts["packs"] * self.pack_size, 1)
