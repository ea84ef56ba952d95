"""Weighted sources for the online packer: several sources interleaved so that each holds its share.

`WeightedSources` gives every source a weight, and ``mix_by`` says what the weights count, with the
meanings of `tightpack.core.mixture` (`tightpack.core.mixture.MIX_BY`): runtime ``tokens``,
``supervised-tokens`` or ``samples``. `tightpack.runtime.online.OnlinePacker` takes it in place of its
``source`` and picks the source of every sample it reads where that sample's counts are known: after it
is prepared and admitted by the long-sample policy (truncated to the pack, or dropped and counted as 0),
so a weight counts what the packs hold. This module owns the interleave, its state and the per-source
statistics (`MixtureStats`); the buffer, the packs and the checkpoints are the packer's.

**The interleave** is a weighted fair queue: the next sample comes from the source whose measure so far
divided by its share is smallest (ties: the source listed first). Over the samples read, after any
prefix of total measure ``T``, a source ``s`` of share ``w_s`` whose largest sample measures ``M_s``
holds

    w_s * (T - sum(M_j for j != s))  <=  measure_s  <=  w_s * T + (1 - w_s) * M_s

Upper bound: when ``s`` is picked its ratio ``measure_s / w_s`` is the smallest, so at most the
share-weighted mean of the ratios, ``T``; its sample adds at most ``M_s`` to ``measure_s`` and as much to
``T``; until it is picked again ``T`` only grows. Lower bound: ratios only grow, and every other source
``j`` was last picked at a ratio no larger than ``s``'s ratio now, so ``measure_j <= w_j * ratio_s +
M_j``; summing, ``T <= ratio_s + sum(M_j for j != s)``. With two sources both bounds are within one
sample of the largest measure. A pack holds samples read within ``max_wait`` steps of it (the buffer
reorders them), so a window of packs is the read order's window give or take the buffer.

**Sources.** A *map-style* source (``len(source)`` and ``source[index]``: a list, a torch ``Dataset``,
a ``datasets.Dataset`` with a transform) is read in a seeded shuffled order, a new one per repetition
(``numpy.random.default_rng([seed, source, repetition])``); ``source[index]`` is a prepared sample,
prepared when read. A *stream* source is a callable ``source(start, stride)`` as `OnlinePacker` takes
one, read in order; a repetition (and a new epoch) calls it again and reads it from the start, so
every call must return a new iterator. A stream that yields nothing on its first pass is refused where
the reader finds it empty (an empty map-style source is refused by `WeightedSources`), and so is one
that yielded before and then yields nothing (one iterator handed back again), rather than counted as
spent: either would quietly take the source's share away. A shard whose positions all lie past the
end of a short, non-empty stream has no part of it, as with a map-style source shorter than the
number of shards: the source is spent in that shard. Prepared samples are the packer's: ``key``, a
1-D ``input_ids`` and the same optional keys in every source (a pack needs ``labels`` in all of its
samples or none): a sample carrying ``labels`` or ``loss_mask`` where the first the mixture read (or
restored) does not, or the other way round, is refused, naming both sources. Supervised tokens are
those with ``loss_mask > 0``, else those whose ``labels`` are not ``ignore_index``. A source must
hold some of the measure: a shard that ends a whole pass of its part of one with none (no supervised
tokens, or every sample dropped) raises there, since the queue would read nothing but it; the check
is per shard (another shard's part may hold some) and exact, a pass being the earliest point the
reader can know it.

**The repetition cap.** A source is read at most ``max_repetitions`` times (a fraction: the last
repetition of a map-style source is the first part of its shuffled order, a seeded subsample). A source
past its cap is *exhausted* when the queue next picks it. Then the mixture can no longer hold its
shares, and ``on_exhausted`` decides: ``stop`` (default) ends the stream: the end of the mixture's
epoch, the buffer flushed; ``continue`` goes on with the other sources, their weights renormalised
(their shares of each other held, the exhausted one's share falling), until all are exhausted.

**Workers and ranks.** Every shard of the packer (a DataLoader worker of a data-parallel rank,
`tightpack.runtime.online.OnlinePacker.shard`) reads its own positions of every source (positions
``shard, shard + shards, ...`` of each repetition's order) and runs its own queue: each shard holds the
bound above, and the whole run, the sum of the shards, holds it with the largest measures times the
number of shards. Under ``stop`` each shard ends when its own part of a source is exhausted.

**Resume.** The packer's ``state_dict`` holds the queue (each source's repetition, position and measure
so far) and the origin of every buffered sample (its source and index or stream position), so the
buffer is restored from the sources themselves (no ``restore`` function) and a resumed packer yields
exactly the packs an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Literal, get_args

import numpy as np

from tightpack.core.mixture import check_weights, sample_measure
from tightpack.errors import TightpackError, check_choice
from tightpack.runtime.mixture_stats import MixtureStats, sample_counts
from tightpack.runtime.online_mixture_checks import FirstSample, check_optional_keys, no_measure_error

__all__ = ["WeightedSources"]

OnExhausted = Literal["stop", "continue"]
Origin = tuple[int, int]  # (source, index of a map-style source or position of a stream)


class WeightedSources:
    """Several sources of prepared samples with weights, for `tightpack.runtime.online.OnlinePacker`.

    Args:
        sources: map-style sources (``len`` and ``[index]``, read in a seeded shuffled order) or
            streams (callables ``source(start, stride)``, read in order); see the module docstring.
        weights: one positive weight per source (normalised to shares).
        mix_by: what the weights count: ``tokens`` (runtime tokens), ``supervised-tokens`` or
            ``samples`` (`tightpack.core.mixture.MIX_BY`).
        names: the sources' names, in messages, statistics and each pack's ``sources`` (default
            ``source 0``, ...).
        max_repetitions: R >= 1: a source is read at most R times; a fraction only for map-style
            sources (the last repetition a seeded subsample).
        seed: seeds the shuffled orders of map-style sources.
        on_exhausted: when the queue picks a source past its cap: ``stop`` (default) ends the stream,
            ``continue`` goes on with the other sources, renormalised.

    Raises:
        TightpackError: a weight per source missing or not positive, an unknown ``mix_by`` or
            ``on_exhausted``, R below 1 (or a fraction for a stream), a source neither map-style nor a
            callable, an empty map-style source, or names repeated. While reading (from the packer): a
            stream that yields no sample on its first pass, or none on a later pass (or a later epoch)
            after it yielded some; a sample whose optional keys (``labels``, ``loss_mask``) differ
            from the mixture's first; a source whose whole pass in a shard held none of the measure.

    >>> import torch
    >>> from tightpack.runtime.online import OnlinePackConfig, OnlinePacker
    >>> short = [{"key": f"s{i}", "input_ids": torch.ones(2)} for i in range(3)]
    >>> long = [{"key": f"l{i}", "input_ids": torch.ones(6)} for i in range(2)]
    >>> mixture = WeightedSources([short, long], [1, 1], names=["short", "long"], mix_by="tokens")
    >>> packer = OnlinePacker(mixture, OnlinePackConfig(pack_size=8, packing_buffer_size=2))
    >>> [(pack["keys"], pack["sources"]) for pack in packer]  # short runs out: l1 is never read
    [(['s2', 'l0'], ['short', 'long']), (['s0', 's1'], ['short', 'short'])]
    >>> stats = packer.mixture_stats()
    >>> stats.tokens.tolist(), stats.shares.tolist(), stats.exhausted
    ([6, 6], [0.5, 0.5], ('short',))
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        *,
        mix_by: str = "tokens",
        names: Sequence[str] | None = None,
        max_repetitions: float = 1,
        seed: int = 0,
        on_exhausted: OnExhausted = "stop",
    ) -> None:
        sources = list(sources)
        names = [f"source {i}" for i in range(len(sources))] if names is None else [str(n) for n in names]
        if len(names) != len(sources):
            raise TightpackError(
                f"{len(names)} names for {len(sources)} sources: give one name per source",
                parameters=("names",),
            )
        if len(set(names)) != len(names):
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise TightpackError(f"source names must differ; repeated: {', '.join(repeated)}")
        if not sources:
            raise TightpackError("WeightedSources needs at least one source")
        self.shares = check_weights(list(weights), names)
        sample_measure(mix_by, np.zeros(0), np.zeros(0))  # an unknown mix_by: the core's message
        check_choice("on_exhausted", on_exhausted, get_args(OnExhausted))
        if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
            raise TightpackError(f"seed must be an integer >= 0, got {seed!r}", parameters=("seed",))
        self.sources, self.names = sources, tuple(names)
        self.weights = [float(w) for w in weights]
        self.mix_by, self.seed, self.on_exhausted = mix_by, int(seed), on_exhausted
        self.lengths: list[int | None] = [
            self._length(s, name) for s, name in zip(sources, names, strict=True)
        ]
        self.max_repetitions = self._check_repetitions(max_repetitions)
        # Streams that yielded a sample in this process (any packer, any epoch): an empty first pass
        # of one of these is one iterator handed back again, not an empty source; only the message
        # differs, so a worker process that never saw the first epoch still raises, in other words.
        self._streamed: set[int] = set()
        self._first: FirstSample | None = None  # the first sample read or restored, for its keys

    @staticmethod
    def _length(source: Any, name: str) -> int | None:
        """A map-style source's length; None for a stream."""
        if callable(source):
            return None
        if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
            length = len(source)
            if length == 0:
                raise TightpackError(f"{name} is empty: leave it out of the mixture")
            return length
        raise TightpackError(
            f"{name} is a {type(source).__name__}: a source is map-style (len() and [index], e.g. a list "
            "or a torch Dataset) or a stream source(start, stride) yielding the samples at positions "
            "start, start + stride, ...; wrap a plain iterable in such a function so that a repetition "
            "and a resume can restart it"
        )

    def _check_repetitions(self, value: float) -> float:
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 1:
            raise TightpackError(
                f"max_repetitions must be a number >= 1 (times a source may be read), got {value!r}",
                parameters=("max_repetitions",),
            )
        if value != int(value):
            streams = [name for name, n in zip(self.names, self.lengths, strict=True) if n is None]
            if streams:
                raise TightpackError(
                    f"max_repetitions={value:g} repeats a fraction of a source, which needs its length: "
                    f"{', '.join(streams)} is a stream; give a whole number, or make it map-style",
                    parameters=("max_repetitions",),
                )
        return float(value)

    def settings(self) -> dict[str, Any]:
        """What a resumed packer must share with the saved one: the sources' names, kinds and lengths,
        the weights and every setting."""
        return {
            "names": list(self.names),
            "lengths": list(self.lengths),
            "weights": self.weights,
            "mix_by": self.mix_by,
            "max_repetitions": self.max_repetitions,
            "seed": self.seed,
            "on_exhausted": self.on_exhausted,
        }

    def new_stats(self, ignore_index: int = -100) -> MixtureStats:
        """Empty statistics of this mixture, to tally packs with `MixtureStats.add`."""
        return MixtureStats(self.names, self.shares, mix_by=self.mix_by, ignore_index=ignore_index)

    def measure(self, sample: Mapping[str, Any] | None, ignore_index: int = -100) -> int:
        """What an admitted sample counts for under ``mix_by``; 0 for one left out (None).

        Raises:
            TightpackError: ``mix_by="supervised-tokens"`` and the sample has neither ``loss_mask``
                nor ``labels``.
        """
        if sample is None:
            return 0
        tokens, supervised = sample_counts(sample, ignore_index)
        if supervised is None:
            if self.mix_by == "supervised-tokens":
                raise TightpackError(
                    f"sample {sample.get('key')!r} has neither loss_mask nor labels: "
                    "mix_by='supervised-tokens' counts the tokens with a loss; prepare samples with one, "
                    "or mix by tokens"
                )
            supervised = 0
        return int(sample_measure(self.mix_by, np.array([tokens]), np.array([supervised]))[0])

    def restore(self, origin: Sequence[int]) -> dict[str, Any]:
        """The sample at ``origin`` (``(source, index)`` of a map-style source, ``(source, position)``
        of a stream), prepared again.

        Raises:
            TightpackError: the origin is outside the source (the data changed).
        """
        source, where = int(origin[0]), int(origin[1])
        if not 0 <= source < len(self.sources):
            raise TightpackError(f"the state names source {source}, the mixture has {len(self.sources)}")
        if self.lengths[source] is not None:
            return self._checked(source, self.sources[source][where])
        sample = self._stream_sample(source, where)
        if sample is None:
            raise TightpackError(
                f"{self.names[source]} has no sample at position {where}: the stream changed since the "
                "checkpoint"
            )
        return self._checked(source, sample)

    def _checked(self, source: int, sample: dict[str, Any]) -> dict[str, Any]:
        """``sample`` of ``source``, its optional keys checked against the first sample's."""
        self._first = check_optional_keys(self._first, self.names[source], sample)
        return sample

    def _stream_sample(self, source: int, position: int) -> dict[str, Any] | None:
        """The sample at ``position`` of stream ``source``; None past its end."""
        return next(iter(self.sources[source](position, 1)), None)

    def _empty_pass_error(self, source: int, repetition: int) -> TightpackError:
        """Why stream ``source`` yielding nothing on repetition ``repetition`` (from 0) cannot go on."""
        name, cap = self.names[source], self.max_repetitions
        if repetition > 0 or source in self._streamed:
            when = (
                f"on its pass {repetition + 1} of max_repetitions={cap:g} although its first pass did"
                if repetition > 0
                else "on its first pass although it yielded samples before (an earlier epoch or packer)"
            )
            return TightpackError(
                f"{name} yielded no sample {when}: a source read more than once (max_repetitions > 1, "
                "or another epoch) must be re-iterable: each call source(start, stride) must return a "
                "new iterator from position start (a generator function, not one generator handed back "
                "again); make it so, or set max_repetitions=1 and read it for one epoch"
            )
        return TightpackError(
            f"{name} yielded no sample on its first pass: the stream source(start, stride) is empty, so "
            "it can hold no share of the mixture; leave it out of the mixture, or check what it reads "
            "(its path, its split, its filter)"
        )

    def reader(self, cursor: MixtureCursor, shard: int, shards: int) -> MixtureReader:
        """The samples of shard ``shard`` of ``shards`` from ``cursor`` on (it advances the cursor)."""
        return MixtureReader(self, cursor, shard, shards)

    def _passes(self, source: int) -> int:
        """How many repetitions source ``source`` may begin (the last one partial with a fraction)."""
        whole = math.floor(self.max_repetitions)
        return whole + (self._partial_limit(source) > 0)

    def _partial_limit(self, source: int) -> int:
        """Positions of the fractional last repetition of a map-style source (0: none)."""
        length = self.lengths[source]
        fraction = self.max_repetitions - math.floor(self.max_repetitions)
        return 0 if length is None or fraction == 0 else math.floor(fraction * length + 1e-9)  # never past R

    def _order(self, source: int, repetition: int) -> np.ndarray:
        """The shuffled indices of repetition ``repetition`` of map-style source ``source``."""
        rng = np.random.default_rng([self.seed, source, repetition])
        order = rng.permutation(self.lengths[source])
        if repetition == math.floor(self.max_repetitions):
            order = order[: self._partial_limit(source)]
        return order


@dataclass
class MixtureCursor:
    """Where a shard's queue stands: per source, the repetition, the position in it (the shard's
    samples read of it) and the measure taken; whether the stream stopped."""

    repetition: list[int]
    position: list[int]
    measure: list[int]
    exhausted: list[bool]
    stopped: bool = False

    @classmethod
    def start(cls, count: int) -> MixtureCursor:
        return cls([0] * count, [0] * count, [0] * count, [False] * count)

    def state(self) -> dict[str, Any]:
        return {
            "repetition": list(self.repetition),
            "position": list(self.position),
            "measure": list(self.measure),
            "exhausted": list(self.exhausted),
            "stopped": self.stopped,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> MixtureCursor:
        return cls(
            list(state["repetition"]),
            list(state["position"]),
            list(state["measure"]),
            list(state["exhausted"]),
            bool(state["stopped"]),
        )


class MixtureReader:
    """One shard's samples of a `WeightedSources`, by the weighted fair queue.

    Iterating gives ``(origin, sample)``; the reader of the samples tells the measure of each with
    `count` before asking for the next (the packer: after the long-sample policy), since it decides
    which source comes next.
    """

    def __init__(self, mixture: WeightedSources, cursor: MixtureCursor, shard: int, shards: int) -> None:
        self.mixture, self.cursor, self.shard, self.shards = mixture, cursor, shard, shards
        self._streams: dict[int, Iterator[dict[str, Any]]] = {}
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (repetition, order)

    def __iter__(self) -> MixtureReader:
        return self

    def __next__(self) -> tuple[Origin, dict[str, Any]]:
        cursor, shares = self.cursor, self.mixture.shares
        while not cursor.stopped:
            active = [s for s, done in enumerate(cursor.exhausted) if not done]
            if not active:
                cursor.stopped = True
                break
            source = min(active, key=lambda s: (cursor.measure[s] / shares[s], s))
            read = self._read(source)
            if read is not None:
                return read
            cursor.exhausted[source] = True
            cursor.stopped = self.mixture.on_exhausted == "stop"
        raise StopIteration

    def count(self, source: int, measure: int) -> None:
        """Add the measure of the sample just read from ``source``."""
        self.cursor.measure[source] += measure

    def _read(self, source: int) -> tuple[Origin, dict[str, Any]] | None:
        """The next sample of ``source`` in this shard, beginning its next repetition when one ends;
        None when it is past its cap.

        Raises:
            TightpackError: a stream yields no sample on a pass (`WeightedSources._empty_pass_error`),
                unless this shard's positions only lie past the end of a non-empty stream; a pass of
                this shard's part of the source held none of the measure (`no_measure_error`: counted
                so far, so only a first pass can); a sample's optional keys differ from the first's.
        """
        mixture, cursor = self.mixture, self.cursor
        while cursor.repetition[source] < mixture._passes(source):
            position = self.shard + cursor.position[source] * self.shards
            if mixture.lengths[source] is None:
                sample = next(self._stream(source, position), None)
                if sample is not None:
                    cursor.position[source] += 1
                    mixture._streamed.add(source)
                    return (source, position), mixture._checked(source, sample)
                self._streams.pop(source, None)
                if cursor.position[source] == 0:  # the pass gave this shard nothing
                    self._empty_pass(source)
                    return None
            else:
                order = self._order(source, cursor.repetition[source])
                if position < len(order):
                    index = int(order[position])
                    cursor.position[source] += 1
                    return (source, index), mixture._checked(source, mixture.sources[source][index])
            if cursor.position[source] and not cursor.measure[source]:  # the pass held none of it
                name, read = mixture.names[source], cursor.position[source]
                raise no_measure_error(name, mixture.mix_by, read, self.shard, self.shards)
            cursor.repetition[source] += 1
            cursor.position[source] = 0
        return None

    def _empty_pass(self, source: int) -> None:
        """Stream ``source`` gave this shard nothing on its pass: an error, or, when the stream holds
        samples but none at this shard's positions (fewer than the shards), this shard's part is spent
        (every pass alike, as with a short map-style source)."""
        mixture, cursor = self.mixture, self.cursor
        repetition = cursor.repetition[source]
        # Shard 0 reads position 0, the stream's first sample; another shard asks for it to tell an
        # empty stream from one shorter than the shards (only here, once per shard and source).
        if repetition > 0 or self.shard == 0 or mixture._stream_sample(source, 0) is None:
            raise mixture._empty_pass_error(source, repetition)
        cursor.repetition[source] = mixture._passes(source)

    def _stream(self, source: int, position: int) -> Iterator[dict[str, Any]]:
        if source not in self._streams:
            stream: Callable[[int, int], Iterator[dict[str, Any]]] = self.mixture.sources[source]
            self._streams[source] = iter(stream(position, self.shards))
        return self._streams[source]

    def _order(self, source: int, repetition: int) -> np.ndarray:
        cached = self._orders.get(source)
        if cached is None or cached[0] != repetition:
            cached = (repetition, self.mixture._order(source, repetition))
            self._orders[source] = cached
        return cached[1]
