"""A test case's recipe written once and drawn two ways: by hypothesis (random search, shrinking) for
the invariants, or by a seeded numpy generator for fixed examples, the same on every machine and
hypothesis version, on which coverage floors (how many cases reach a branch) can be asserted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np
from hypothesis import strategies as st

T = TypeVar("T")


class Draws(Protocol):
    """What a recipe draws: an integer in ``[low, high]`` (both included), one of ``values``, a float."""

    def integers(self, low: int, high: int) -> int: ...

    def sampled_from(self, values: Sequence[T]) -> T: ...

    def floats(self, low: float, high: float) -> float: ...


class HypothesisDraws:
    """Draws of a `hypothesis.strategies.composite` strategy (``draw``)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self._draw = draw

    def integers(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))

    def sampled_from(self, values: Sequence[T]) -> T:
        return self._draw(st.sampled_from(values))

    def floats(self, low: float, high: float) -> float:
        return self._draw(st.floats(low, high))


class SeededDraws:
    """Uniform draws of ``np.random.default_rng(seed)``: a fixed example per seed."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def integers(self, low: int, high: int) -> int:
        return int(self._rng.integers(low, high, endpoint=True))

    def sampled_from(self, values: Sequence[T]) -> T:
        return values[int(self._rng.integers(len(values)))]

    def floats(self, low: float, high: float) -> float:
        return float(self._rng.uniform(low, high))
