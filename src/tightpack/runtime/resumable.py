"""Resume positions of the offline samplers: what the training loop trained, never what a DataLoader drew.

A ``DataLoader`` with workers draws ``prefetch_factor × num_workers`` batches ahead of the training
loop, so a sampler cannot know how much was trained. The loop owns the count, as in Megatron: it
builds the sampler with the count from its checkpoint (``consumed_samples=`` /
``consumed_micro_batches=``) and saves ``sampler.state_dict(<its count>)``. Each ``iter(sampler)``
keeps its own position, so two iterators over one sampler never move each other or the saved state.

`ResumableSampler` is the shared part of `tightpack.runtime.samplers.PackedBatchSampler`,
`tightpack.runtime.balanced_sampler.BalancedPackedBatchSampler` and
`tightpack.runtime.samplers.TokenBudgetBatchSampler`: the position check (a multiple of one step of
all ranks, else a `TightpackError` with the nearest valid positions), the state dicts and the
per-iterator position. The samplers own what they yield.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from tightpack.errors import TightpackError


def array_checksum(*arrays: np.ndarray) -> int:
    """CRC-32 of the arrays' values (as int64/float64 bytes): what a saved state is checked against.

    >>> array_checksum(np.array([1, 2]), np.array([0.5])) == array_checksum(np.array([1, 2]), np.array([0.5]))
    True
    """
    checksum = 0
    for array in arrays:
        array = np.asarray(array)
        dtype = np.float64 if np.issubdtype(array.dtype, np.floating) else np.int64
        checksum = zlib.crc32(np.ascontiguousarray(array, dtype=dtype).tobytes(), checksum)
    return checksum


class ResumableSampler:
    """A sampler whose resume position is a count kept by the training loop (see the module docstring).

    Subclasses set `position_name` (the constructor keyword and state key) and implement
    `position_unit` (a valid position is a multiple of it), `yield_size` (positions one yield
    advances), `epoch_length` (positions per epoch), `describe_unit`, `resume_settings` (what must
    not change between saving and loading) and `epoch_steps`.
    """

    position_name = "consumed_samples"
    _start: int  # where the next iter() begins: the given position, moved only by finished passes

    # -- what a subclass provides ------------------------------------------------------------------
    @property
    def position_unit(self) -> int:
        raise NotImplementedError

    @property
    def yield_size(self) -> int:
        return self.position_unit

    @property
    def epoch_length(self) -> int:
        raise NotImplementedError

    def describe_unit(self) -> str:
        """The unit in words, for the error message, e.g. "the global batch (16 samples)"."""
        raise NotImplementedError

    def resume_settings(self) -> dict[str, Any]:
        """Settings that define the stream: a state saved under others would repeat or skip samples."""
        raise NotImplementedError

    def epoch_steps(self, epoch: int, offset: int) -> Iterator[list[int]]:
        """What this rank yields in ``epoch`` from ``offset`` (a valid position within the epoch)."""
        raise NotImplementedError

    def is_final_position(self, position: int) -> bool:
        """A position off the unit grid that is still valid (the end of a one-pass sampler)."""
        return False

    # -- the shared part ---------------------------------------------------------------------------
    def checked_position(self, value: object, *, within_step: bool = False) -> int:
        """``value`` as a resume position, or a `TightpackError` saying why it is none.

        ``within_step``: the position of a running pass (torchdata's snapshot of the iterator, taken
        when it drew a yield), which may stop inside an optimizer step: any whole yield is exact.

        >>> from tightpack.runtime.samplers import PackedBatchSampler
        >>> PackedBatchSampler(64, dataloader_type="batch", micro_batch_size=1,
        ...                    global_batch_size=16).checked_position(40)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tightpack.errors.TightpackError: consumed_samples=40 is not a multiple of ... resume from 32 or 48
        """
        name = self.position_name
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TightpackError(f"{name} must be an integer, got {value!r}")
        position = int(value)
        if position < 0:
            raise TightpackError(f"{name} must be >= 0, got {position}")
        unit = self.yield_size if within_step else self.position_unit
        if position % unit and not self.is_final_position(position):
            below = position - position % unit
            raise TightpackError(
                f"{name}={position} is not a multiple of {self.describe_unit()}; a training loop saves "
                f"it after whole steps, so resume from {below} or {below + unit}"
            )
        return position

    def _state(self, position: int | None) -> dict[str, Any]:
        value = self._start if position is None else self.checked_position(position)
        return {self.position_name: value, "settings": self.resume_settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict`: the next ``iter()`` starts at its position.

        Raises:
            TightpackError: a state without the position, saved under other settings (named, saved
                and current values), or a position that is not a multiple of one step.
        """
        name = self.position_name
        if not isinstance(state, dict) or name not in state:
            raise TightpackError(
                f"not a {type(self).__name__} state: expected a dict with {name!r}, got {state!r}"
            )
        saved, current = state.get("settings", {}), self.resume_settings()
        for key, value in current.items():
            if key in saved and saved[key] != value:
                raise TightpackError(
                    f"the {type(self).__name__} state was saved with {key}={saved[key]!r}, this sampler "
                    f"has {key}={value!r}: resuming would repeat or skip samples; build the sampler with "
                    "the saved settings"
                )
        self._start = self.checked_position(state[name])

    def __len__(self) -> int:
        """Yields left in the epoch the next ``iter()`` starts in (a whole epoch at a boundary)."""
        offset = self._start % self.epoch_length
        return -(-(self.epoch_length - offset) // self.yield_size)

    def __iter__(self) -> SamplerPass:
        return SamplerPass(self)

    def _pass_finished(self, started_at: int, epoch_end: int) -> None:
        # Only the first pass to finish from the current start moves it (a concurrent pass over the
        # same epoch, or a position set meanwhile, leaves it alone).
        if self._start == started_at:
            self._start = epoch_end


class SamplerPass:
    """One ``iter()`` of a `ResumableSampler`: the rest of one epoch, with its own position.

    Its `state_dict` (the position after the last yield, and the epoch) is what torchdata's
    ``StatefulDataLoader`` saves: it snapshots an iterator when it draws a batch and keeps that
    snapshot until the batch reaches the loop, so the position it saves is the trained one.
    """

    def __init__(self, sampler: ResumableSampler) -> None:
        self._sampler = sampler
        self._started_at = sampler._start
        self._seek(sampler._start, sampler._start // sampler.epoch_length)

    def _seek(self, position: int, epoch: int) -> None:
        length = self._sampler.epoch_length
        self.position, self.epoch = position, epoch
        offset = position - epoch * length
        self._steps = self._sampler.epoch_steps(epoch, offset) if offset < length else iter(())

    def __iter__(self) -> SamplerPass:
        return self

    def __next__(self) -> list[int]:
        try:
            indices = next(self._steps)
        except StopIteration:
            self._sampler._pass_finished(self._started_at, (self.epoch + 1) * self._sampler.epoch_length)
            raise
        self.position += self._sampler.yield_size
        return indices

    def state_dict(self) -> dict[str, int]:
        """``{<position name>: position after the last yield, "epoch": the epoch of this pass}``."""
        return {self._sampler.position_name: self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue this pass from a `state_dict` of a pass over an equal sampler."""
        position = self._sampler.checked_position(state[self._sampler.position_name], within_step=True)
        epoch = state.get("epoch")
        length = self._sampler.epoch_length
        if (
            isinstance(epoch, bool)
            or not isinstance(epoch, int | np.integer)
            or not 0 <= epoch * length <= position
        ):
            raise TightpackError(
                f"a pass state's epoch must be an integer starting at or before {position}, got {epoch!r}"
            )
        self._seek(position, epoch)
