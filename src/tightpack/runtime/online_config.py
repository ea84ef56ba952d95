"""`OnlinePackConfig`: the settings of an `OnlinePacker`, checked before any sample is read."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from numbers import Integral, Real
from typing import Any, Literal, get_args

from tightpack.core.cost_model import COST_MODELS, CostModel
from tightpack.errors import TightpackError, check_choice

__all__ = ["OnlinePackConfig"]

Strategy = Literal["best_fill", "ffd"]
LongSamples = Literal["truncate", "drop", "error"]


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class OnlinePackConfig:
    """Settings of an `OnlinePacker`; the same on every data-parallel rank and DataLoader worker.

    Attributes:
        pack_size: tokens per pack.
        packing_buffer_size: candidates kept, per DataLoader worker.
        strategy: ``best_fill`` (default: the fullest pack the buffer allows, leftovers stay) or
            ``ffd`` (the reference's: first-fit decreasing over the whole buffer).
        max_wait: steps a sample may wait under ``best_fill``; None means ``4 * packing_buffer_size``.
            Must be at least ``packing_buffer_size`` (`tightpack.runtime.online` says why).
        pad_to_multiple_of: alignment of every sample (``pad_seq_to_mult`` for context parallelism).
        pad_to_max_length: every pack exactly ``pack_size`` wide.
        long_samples: samples whose aligned length exceeds ``pack_size``: ``truncate`` keeps the
            longest aligned prefix that fits, ``drop`` leaves them out (counted), ``error`` stops.
        pad_token_id, ignore_index: the padding of ``input_ids`` and of ``labels``.
        data_id: names the stream (dataset, split, shuffle seed); a state saved under another is refused.
        cost_model: what a pack costs (`tightpack.core.cost_model.CostModel`, a preset name such as
            ``"llama-8b"``, or the path of a cost model JSON file); set with ``max_pack_cost``.
        max_pack_cost: the most a pack may cost, in ``cost_model``'s unit (e.g. training FLOPs): the
            cost of a pack is the sum of its members' costs at their aligned lengths. Only a sample
            whose cost alone exceeds it makes a pack above it, alone. None (default, with
            ``cost_model`` None): no cost cap, packs are bounded by ``pack_size`` only.

    >>> OnlinePackConfig(pack_size=4096, packing_buffer_size=64).settings()["max_wait"]
    256
    """

    pack_size: int
    packing_buffer_size: int
    strategy: Strategy = "best_fill"
    max_wait: int | None = None
    pad_to_multiple_of: int = 1
    pad_to_max_length: bool = False
    long_samples: LongSamples = "truncate"
    pad_token_id: int = 0
    ignore_index: int = -100
    data_id: str | None = None
    cost_model: CostModel | str | None = None
    max_pack_cost: float | None = None

    @property
    def wait_limit(self) -> int:
        """``max_wait``, with None resolved to ``4 * packing_buffer_size``."""
        return 4 * self.packing_buffer_size if self.max_wait is None else self.max_wait

    def validate(self) -> None:
        """Check every setting; raises `TightpackError` naming the setting, the value and the fix."""
        size, buffer, multiple = self.pack_size, self.packing_buffer_size, self.pad_to_multiple_of
        if not _is_int(size) or size < 1:
            raise TightpackError(f"pack_size must be a positive integer (tokens per pack), got {size!r}")
        if not _is_int(multiple) or not 1 <= multiple <= size:
            raise TightpackError(
                f"pad_to_multiple_of must be an integer between 1 and pack_size ({size}), got {multiple!r}; "
                "lower it or raise pack_size"
            )
        if not _is_int(buffer) or buffer < 1:
            raise TightpackError(
                f"packing_buffer_size must be a positive integer (candidates kept per worker), got {buffer!r}"
            )
        check_choice("strategy", self.strategy, get_args(Strategy))
        check_choice("long_samples", self.long_samples, get_args(LongSamples))
        if self.max_wait is not None and not _is_int(self.max_wait):
            raise TightpackError(
                f"max_wait must be an integer number of steps or None, got {self.max_wait!r}"
            )
        self._validate_cost_cap()
        if self.strategy == "best_fill" and self.wait_limit < buffer:
            raise TightpackError(
                f"max_wait ({self.wait_limit}) must be at least packing_buffer_size ({buffer}): a sample "
                "can arrive behind packing_buffer_size - 1 samples due no later than it, and when no two "
                "share a pack they leave one per step; raise max_wait, or leave it None for 4 x "
                "packing_buffer_size"
            )

    def _validate_cost_cap(self) -> None:
        """Both ``cost_model`` and ``max_pack_cost`` or neither, a cap finite and > 0, a known model."""
        spec, cap = self.cost_model, self.max_pack_cost
        if spec is not None and cap is None:
            raise TightpackError(
                f"cost_model is set ({spec!r}) but max_pack_cost is None: set max_pack_cost, the most a "
                "pack may cost in the cost model's unit (e.g. flops), or leave cost_model None"
            )
        if cap is None:
            return
        if spec is None:
            raise TightpackError(
                f"max_pack_cost ({cap!r}) needs a cost_model to measure packs with: set cost_model to a "
                f"preset ({', '.join(sorted(COST_MODELS))}), a CostModel or the path of a cost model JSON "
                "file, or leave max_pack_cost None"
            )
        if isinstance(cap, bool) or not isinstance(cap, Real) or not math.isfinite(cap) or cap <= 0:
            raise TightpackError(
                f"max_pack_cost must be a finite number > 0 (the most a pack may cost, in the cost "
                f"model's unit), got {cap!r}"
            )
        try:
            self.resolved_cost_model  # noqa: B018 (resolving is the check)
        except TightpackError as error:
            raise TightpackError(f"cost_model: {error}") from None

    @cached_property
    def resolved_cost_model(self) -> CostModel | None:
        """``cost_model`` as a `CostModel` (a preset or a file read once), or None without a cost cap."""
        return None if self.cost_model is None else CostModel.resolve(self.cost_model)

    def settings(self) -> dict[str, Any]:
        """What a resumed packer must share with the saved one: every field, ``max_wait`` resolved.

        Not ``pad_token_id`` and ``ignore_index``: they fill the padding only, never decide which
        samples go where, so a checkpoint stays valid when they change. ``cost_model`` (its
        `CostModel.to_dict` form: the coefficients, not the name or path) and ``max_pack_cost`` only
        with a cost cap, so that a checkpoint saved without one keeps its settings.
        """
        values = asdict(self)
        for name in ("pad_token_id", "ignore_index", "cost_model", "max_pack_cost"):
            values.pop(name)
        values["max_wait"] = self.wait_limit
        if self.max_pack_cost is not None:
            values["cost_model"] = self.resolved_cost_model.to_dict()
            values["max_pack_cost"] = float(self.max_pack_cost)
        return values
