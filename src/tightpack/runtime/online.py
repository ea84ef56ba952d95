"""Online packing: a stream of prepared samples, a buffer of candidates, one pack per step
(docs/contract.md §4).

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

The cost cap (``OnlinePackConfig.cost_model`` and ``max_pack_cost``). A pack's cost is the sum of its
members' costs at their aligned lengths (the lengths the token limit counts); with a cap, no pack
costs more than it, except a pack of one sample whose cost alone exceeds it. Both strategies take a
candidate only where its tokens and its cost fit: ``ffd`` is first-fit decreasing under both limits;
``best_fill`` forces tight samples and tops up under both (`tightpack.core.capped_fill.capped_subset`:
the fullest fill when the fullest token fill fits the cap, a repair-and-refill heuristic otherwise).
The deadline bound needs only the first rule above, and the cap keeps it: the first tight sample
enters the empty pack whatever its cost, later tight ones and the top-up must fit both limits, and
every other step of the argument is about samples left out. A sample above the cap leaves alone:
under ``ffd`` in a group of its own; under ``best_fill`` when forced, or earlier when it alone holds
more tokens than the best capped pack of the others. The selection of both strategies lives in
`tightpack.runtime.online_select`.

Inside a ``DataLoader`` with workers, worker ``w`` of ``W`` on data-parallel rank ``r`` of ``R`` packs
its own shard: the samples at positions ``r * W + w`` modulo ``R * W`` of the stream.

Preference pairs, KTO samples and groups are packed by the subclass
`tightpack.runtime.online_preference.OnlinePreferencePacker`: each unit (a prompt and its branches) is
one candidate, of its size and cost in the chosen layout, and every pack is one preference row.

Weighted sources (`tightpack.runtime.online_mixture.WeightedSources`) take the place of ``source``:
the packer picks each sample's source when it reads it, by a weighted fair queue over what the
admitted samples count (``tokens``, ``supervised-tokens`` or ``samples``); each pack then carries
``sources``, its members' source names, and `OnlinePacker.mixture_stats` counts them.

Nothing is dropped (except by the ``drop`` long-sample policy, counted): a finite stream is flushed.
`state_dict` holds keys, lengths, arrival steps and counters, never tensors; `load_state_dict`
restores the buffer through ``restore(key)`` (weighted sources: from each sample's source and index)
and restarts the source after the samples already read,
so a restored packer yields exactly the packs an uninterrupted one would. It refuses a state saved
with other settings (`OnlinePackConfig.settings`), another shard layout (data-parallel size, worker
count) or other data (a restored sample of another length, or another ``data_id``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from tightpack.core.alignment import ceil_to_multiple, length_cap
from tightpack.errors import TightpackError
from tightpack.runtime.in_batch import pack_samples
from tightpack.runtime.mixture_stats import MixtureStats
from tightpack.runtime.online_config import OnlinePackConfig
from tightpack.runtime.online_mixture import MixtureCursor, MixtureReader, WeightedSources
from tightpack.runtime.online_select import (
    Candidate,
    best_fill,
    by_deadline,
    closed_by_cost,
    ffd_groups,
    group_cost,
)

__all__ = ["OnlinePackConfig", "OnlinePacker"]


class OnlinePacker(torch.utils.data.IterableDataset):
    """Pack a stream online, one pack per step.

    Args:
        source: ``source(start, stride)`` yields the samples at positions ``start, start + stride, ...``
            of the stream; each sample is a mapping with ``key`` and a 1-D ``input_ids`` tensor
            (optionally ``labels``, ``loss_mask`` and the visual tensors of
            `tightpack.runtime.in_batch.VISUAL_KEYS`). Prepare samples lazily in it: a worker only
            reads its own positions. Or a `tightpack.runtime.online_mixture.WeightedSources`: several
            sources mixed by weight (each pack then has ``sources``, its members' source names).
        config: the settings (`OnlinePackConfig`), validated here.
        restore: ``restore(key)`` prepares the sample with that key again (for `load_state_dict`); not
            with `WeightedSources`, which restores samples from their sources.
        rank: this data-parallel rank; each rank packs its own shard.
        world_size: the number of data-parallel ranks.
        pack_fn: builds a batch from the member samples, with the keyword arguments of
            `tightpack.runtime.in_batch.pack_samples` (the default); for Qwen-VL models pass
            ``functools.partial(pack_vlm_samples, rope=QwenVLRope.from_config(model.config))``,
            which adds the multimodal positions (`tightpack.runtime.vlm.pack_vlm_samples`).

    Raises:
        TightpackError: a setting is invalid, ``rank`` is outside ``[0, world_size)``, or ``restore``
            is given with `WeightedSources`.

    Each pack is a THD batch ``[1, T]`` with ``keys``, its members' keys in order. ``counts`` holds
    ``samples``, ``packs``, ``tokens`` (real ones), ``truncated`` and ``dropped`` samples, ``waited``
    (steps, summed over samples) and ``max_wait``, ``held_bytes`` and ``peak_held_bytes`` (host memory
    of the buffer), and for ``best_fill`` ``forced`` (samples forced in by their deadline),
    ``forced_packs`` (packs holding one) and ``multi_forced_packs`` (packs holding two or more).
    With a cost cap (``config.max_pack_cost``) also, in the cost model's unit, ``cost`` (summed over
    packs; ``mean_pack_cost`` is its mean, as ``mean_wait`` is for waits) and ``max_pack_cost`` (the
    costliest pack), and ``over_cap_samples`` (samples whose cost alone exceeds the cap: each left
    alone) and ``capped_packs``: packs the cap closed, i.e. when the pack was formed, a sample left
    waiting for a later pack (in the buffer, or in a later ``ffd`` group of the same buffer) would have
    fit its remaining tokens but not its remaining cost. Without a cap no such sample exists: both
    strategies fill every pack until nothing waiting fits its tokens.

    >>> samples = [{"key": i, "input_ids": torch.arange(n)} for i, n in enumerate([5, 3, 4, 2])]
    >>> config = OnlinePackConfig(pack_size=8, packing_buffer_size=4)
    >>> packer = OnlinePacker(lambda start, stride: iter(samples[start::stride]), config)
    >>> [pack["keys"] for pack in packer]
    [[0, 1], [2, 3]]
    """

    def __init__(
        self,
        source: Callable[[int, int], Iterator[dict[str, Any]]] | WeightedSources,
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
        self.mixture = source if isinstance(source, WeightedSources) else None
        if self.mixture is not None and restore is not None:
            raise TightpackError(
                "restore is not used with WeightedSources: a buffered sample is restored from its source "
                "and index (or stream position); leave restore out"
            )
        self.source, self.restore, self.pack_fn = source, restore, pack_fn
        self.config = config
        self.cost_model = config.resolved_cost_model  # None without a cost cap
        self.rank, self.world_size = rank, world_size
        self._resumed_shard: tuple[int, int] | None = None
        self._resumed_after_pass = False  # loaded from a state saved once this shard's pass had ended
        self._reset()

    def _reset(self) -> None:
        self.consumed = 0  # samples of this shard read from the source
        self.step = 0  # packs emitted
        self.exhausted = False
        self.buffer: list[Candidate] = []
        self.pending: list[list[Candidate]] = []
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
        if self.cost_model is not None:
            self.counts |= {"cost": 0.0, "max_pack_cost": 0.0, "capped_packs": 0, "over_cap_samples": 0}
        if self.mixture is not None:
            self._cursor = MixtureCursor.start(len(self.mixture.sources))
            self._mixed = self.mixture.new_stats(self.config.ignore_index)

    def shard(self) -> tuple[int, int]:
        """``(shard, shards)`` of the calling process: data-parallel rank and DataLoader worker."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    # -- reading ------------------------------------------------------------------------------------

    def _admit(self, sample: dict[str, Any], arrival: int, *, count: bool = True) -> Candidate | None:
        """The candidate of a sample, after the long-sample policy (counted unless ``count`` is False)."""
        size, multiple = self.config.pack_size, self.config.pad_to_multiple_of
        tokens = length = len(sample["input_ids"])
        if length == 0:
            raise TightpackError(
                f"sample {sample.get('key')!r} has no tokens (input_ids is empty): an empty sequence cannot "
                "be packed; leave it out in the source"
            )
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
        aligned = ceil_to_multiple(length, multiple)
        cost = 0.0 if self.cost_model is None else float(self.cost_model.sequence_costs([aligned])[0])
        return Candidate(sample["key"], sample, aligned, arrival, tokens, nbytes, cost)

    def _sample_tokens(self, sample: dict[str, Any]) -> int:
        """The tokens of a sample as read (`Candidate.tokens`, saved in `state_dict` to check a restore)."""
        return len(sample["input_ids"])

    def _hold(self, candidate: Candidate) -> None:
        self.buffer.append(candidate)
        self.counts["held_bytes"] += candidate.nbytes
        self.counts["peak_held_bytes"] = max(self.counts["peak_held_bytes"], self.counts["held_bytes"])

    def _fill(self, stream: Iterator[Any]) -> bool:
        """Top the buffer up; False when the stream is exhausted."""
        while len(self.buffer) < self.config.packing_buffer_size:
            item = next(stream, None)
            if item is None:
                return False
            self.consumed += 1
            if isinstance(stream, MixtureReader):
                candidate = self._admit_mixed(stream, *item)
            else:
                candidate = self._admit(item, self.step)
            if candidate is not None:
                self._hold(candidate)
        return True

    def _admit_mixed(self, reader: MixtureReader, origin: tuple[int, int], sample: dict[str, Any]):
        """A sample of weighted sources admitted, its measure (0 if dropped) told to the queue."""
        candidate = self._admit(sample, self.step)
        source = origin[0]
        measure = self.mixture.measure(
            None if candidate is None else candidate.sample, self.config.ignore_index
        )
        reader.count(source, measure)
        if candidate is None:
            self._mixed.dropped[source] += 1
        else:
            candidate.origin = origin
        return candidate

    # -- selection ----------------------------------------------------------------------------------

    def _best_fill(self) -> list[Candidate]:
        config = self.config
        chosen, forced = best_fill(
            self.buffer, self.step, config.wait_limit, config.pack_size, config.max_pack_cost
        )
        if forced:
            self.counts["forced"] += forced
            self.counts["forced_packs"] += 1
            self.counts["multi_forced_packs"] += forced > 1
        taken = {id(c) for c in chosen}
        self.buffer = [c for c in self.buffer if id(c) not in taken]
        return chosen

    def _next_group(self, stream_open: bool) -> list[Candidate] | None:
        full = len(self.buffer) >= self.config.packing_buffer_size
        if self.config.strategy == "ffd":
            if not self.pending and (full or not stream_open) and self.buffer:
                self.pending = ffd_groups(self.buffer, self.config.pack_size, self.config.max_pack_cost)
                self.buffer = []
            return self.pending.pop(0) if self.pending else None
        if full or (not stream_open and self.buffer):
            return self._best_fill()
        return None

    # -- emission -----------------------------------------------------------------------------------

    def _pack(self, group: list[Candidate]) -> dict[str, Any]:
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
        if self.mixture is not None:
            batch["sources"] = [self.mixture.names[c.origin[0]] for c in group]
            for candidate in group:
                self._mixed.add_sample(candidate.origin[0], candidate.sample)
        self._record(group, tokens=sum(len(sample["input_ids"]) for sample in samples))
        return batch

    def _record(self, group: list[Candidate], tokens: int) -> None:
        """Count an emitted pack: its samples, real tokens, member waits, memory released, and its cost.

        With a cost cap, whether the cap closed it is judged against the candidates still waiting: the
        rest of the buffer and the pending ``ffd`` groups (the group itself is already out of both).
        """
        cap = self.config.max_pack_cost
        if cap is not None:
            cost = group_cost(group)
            waiting = self.buffer + [c for pending in self.pending for c in pending]
            self.counts["cost"] += cost
            self.counts["max_pack_cost"] = max(self.counts["max_pack_cost"], cost)
            self.counts["capped_packs"] += closed_by_cost(group, waiting, self.config.pack_size, cap)
            self.counts["over_cap_samples"] += len(group) == 1 and cost > cap
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
        """The packs of this shard, to the end of its pass over the stream.

        A state saved once this shard's pass had ended (a DataLoader worker whose shard ran out while
        the others went on) resumes to an empty pass: the pass it was in is over. The next ``iter()``
        starts a new pass. Both that and the shard layout are decided at ``iter()``, not at the first
        pack: a ``StatefulDataLoader`` calls ``iter()`` once when it loads a state (in each worker,
        where a wrong layout then stops the loader before torchdata's own checks) and again when it
        starts the next epoch.

        Raises:
            TightpackError: the state loaded was saved by another shard (`load_state_dict`).
        """
        shard, shards = self.shard()
        if self._resumed_shard not in (None, (shard, shards)):
            raise TightpackError(self._layout_message(self._resumed_shard, (shard, shards)))
        if self._resumed_after_pass:
            self._resumed_after_pass = False
            return iter(())
        if self.exhausted:  # a new pass over a finite stream
            self._reset()
        return self._packs(shard, shards)

    def _packs(self, shard: int, shards: int) -> Iterator[dict[str, Any]]:
        if self.mixture is not None:
            stream = self.mixture.reader(self._cursor, shard, shards)
        else:
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
        """The saved settings: the config's, the data-parallel layout this packer shards by, and the
        mixture's with weighted sources."""
        settings = self.config.settings() | {"rank": self.rank, "world_size": self.world_size}
        if self.mixture is not None:
            settings |= {f"mixture.{name}": value for name, value in self.mixture.settings().items()}
        return settings

    def _saved(self, candidate: Candidate) -> tuple:
        """A buffered candidate in the state: key, tokens, arrival, and its origin in a mixture."""
        if self.mixture is None:
            return (candidate.key, candidate.tokens, candidate.arrival)
        return (candidate.key, candidate.tokens, candidate.arrival, list(candidate.origin))

    def state_dict(self) -> dict[str, Any]:
        """Keys, lengths, arrival steps and counters: everything needed to continue exactly, and no tensor.

        With weighted sources also ``mixture``: the queue (each source's repetition, position and
        measure read) and the per-source statistics of the packs emitted.
        """
        state = {
            "settings": self._settings(),
            "shard": list(self.shard()),
            "consumed": self.consumed,
            "step": self.step,
            "exhausted": self.exhausted,
            "buffer": [self._saved(c) for c in self.buffer],
            "pending": [[self._saved(c) for c in group] for group in self.pending],
            "counts": dict(self.counts),
        }
        if self.mixture is not None:
            state["mixture"] = {"cursor": self._cursor.state(), "stats": self._mixed.to_dict()}
        return state

    def _layout_message(self, saved: tuple[int, int], current: tuple[int, int]) -> str:
        """Why a state saved by shard ``saved`` cannot continue in shard ``current`` (``(shard, shards)``)."""
        workers_then, workers_now = saved[1] // self.world_size, current[1] // self.world_size
        return (
            f"the state was saved by shard {saved[0]} of {saved[1]} (DataLoader worker "
            f"{saved[0] % workers_then} of {workers_then} on data-parallel rank {self.rank} of "
            f"{self.world_size}) and is loaded in shard {current[0]} of {current[1]} (worker "
            f"{current[0] % workers_now} of {workers_now}): each shard packs its own positions of the "
            "stream, so another layout would repeat or skip samples; resume with the saved number of "
            "DataLoader workers and data-parallel ranks, or start the epoch again without the state"
        )

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse (`TightpackError`) a `state_dict` saved with other settings or data-parallel layout.

        `load_state_dict` runs it; `tightpack.runtime.online_loader.OnlineLoader` runs it in the main
        process for every worker's state, before any worker starts.
        """
        current, saved_settings = self._settings(), state["settings"]
        differences = {  # a setting absent on one side (the cost cap) is None there
            name: (saved_settings.get(name), current.get(name))
            for name in [*saved_settings, *(name for name in current if name not in saved_settings)]
            if current.get(name) != saved_settings.get(name)
        }
        if differences:
            listed = ", ".join(
                f"{name} saved {old!r} now {new!r}" for name, (old, new) in differences.items()
            )
            raise TightpackError(
                f"cannot resume the online packer with different settings: {listed}; resume with the "
                "saved ones"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` saved with the same settings, shard layout and data.

        A state saved once this shard's pass had ended (``exhausted``) continues that pass, which
        has nothing left: the next ``iter()`` yields nothing, the one after starts a new pass.
        """
        self.check_state(state)
        if (state["buffer"] or state["pending"]) and self.restore is None and self.mixture is None:
            raise TightpackError("load_state_dict needs restore(key) to prepare the buffered samples again")

        def candidate(key: Any, tokens: int, arrival: int, origin: list[int] | None = None) -> Candidate:
            sample = self.restore(key) if origin is None else self.mixture.restore(origin)
            restored_tokens = self._sample_tokens(sample)
            if restored_tokens != tokens:
                raise TightpackError(
                    f"restored sample {key!r} has {restored_tokens} tokens, saved with {tokens}: "
                    "the data or its preparation changed since the checkpoint"
                )
            restored = self._admit(sample, arrival, count=False)  # counted when it first arrived
            if restored is None:
                raise TightpackError(f"restored sample {key!r} would be dropped: the data changed")
            if origin is not None:
                restored.origin = (int(origin[0]), int(origin[1]))
            return restored

        self._reset()
        self.consumed, self.step, self.exhausted = state["consumed"], state["step"], state["exhausted"]
        self.counts.update(state["counts"])  # a state saved before a counter existed leaves it at 0
        self.buffer = [candidate(*saved) for saved in state["buffer"]]
        self.pending = [[candidate(*saved) for saved in group] for group in state["pending"]]
        if self.mixture is not None:
            self._cursor = MixtureCursor.from_state(state["mixture"]["cursor"])
            self._mixed.load(state["mixture"]["stats"])
        self._resumed_shard = tuple(state["shard"])
        self._resumed_after_pass = self.exhausted
        if self.config.strategy == "best_fill":  # what the next selection checks, as an input error here
            ordered = by_deadline(self.buffer, self.step, self.config.wait_limit)
            for rank, (slack, restored) in enumerate(ordered):
                if slack < rank:
                    raise TightpackError(
                        f"the state's buffer cannot be met by max_wait: at step {self.step}, sample "
                        f"{restored.key!r} (read at step {restored.arrival}) has {slack} steps left and "
                        f"{rank} samples due no later; the state was edited or comes from another packer"
                    )

    def mixture_stats(self) -> MixtureStats:
        """Per source of the weighted sources: rows, tokens and supervised tokens of the packs this
        packer emitted (in this process: with DataLoader workers, tally the packs received with
        `tightpack.runtime.online_mixture.MixtureStats.add`), samples dropped, achieved and target
        shares, and the sources past their repetition cap.

        Raises:
            TightpackError: the packer reads one source, not `WeightedSources`.
        """
        if self.mixture is None:
            raise TightpackError(
                "mixture_stats counts the sources of WeightedSources; this packer reads one source"
            )
        stats = self.mixture.new_stats(self.config.ignore_index)
        stats.load(self._mixed.to_dict())
        stats.exhausted = tuple(
            name for name, done in zip(self.mixture.names, self._cursor.exhausted, strict=True) if done
        )
        return stats

    @property
    def mean_wait(self) -> float:
        """Mean steps between a sample's arrival and its pack."""
        return self.counts["waited"] / max(self.counts["samples"], 1)

    @property
    def mean_pack_cost(self) -> float | None:
        """Mean cost of the packs emitted, in the cost model's unit; None without a cost cap."""
        if self.cost_model is None:
            return None
        return self.counts["cost"] / max(self.counts["packs"], 1)

    def fill(self) -> float:
        """Real tokens over ``packs * pack_size`` so far."""
        return self.counts["tokens"] / max(self.counts["packs"] * self.config.pack_size, 1)
