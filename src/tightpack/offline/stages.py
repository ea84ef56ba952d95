"""What every offline packing run shares: the progress it reports, its timed stages, and its result."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tightpack.core.stats import PackStats
from tightpack.prepare.tokenize import BadRow


class Progress(Protocol):
    """Receives progress: a stage begins (with a total, or None), advances, ends."""

    def begin(self, stage: str, total: int | None) -> None: ...
    def advance(self, amount: int) -> None: ...
    def end(self) -> None: ...


class NoProgress:
    """A `Progress` that shows nothing."""

    def begin(self, stage: str, total: int | None) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass
class PackResult:
    """What a run produced: the output folder, counts, plan statistics, time per stage (s), whether
    the token store came from the cache instead of tokenizing, and warnings for the user.

    A run of preference, KTO or group rows (``unit_kind`` names which) counts units, and its
    ``stats`` are over the units (their sizes in the layout).
    """

    output: Path
    counts: dict[str, int]
    stats: PackStats
    stage_seconds: dict[str, float]
    files: list[dict]
    bad_rows: list[BadRow]
    reused_store: bool = False
    warnings: list[str] = field(default_factory=list)
    cost_balance: dict[str, Any] | None = None
    """With ``balance_costs``: the pack cost spread (`cost_spread`) and pack count of the planner's plan
    (``before``) and of the balanced one (``after``)."""
    unit_kind: str | None = None
    mixture: dict[str, Any] | None = None
    """With a mixture: the manifest's ``mixture`` section (per-source statistics, the worst global batch)."""


@contextmanager
def stage(name: str, total: int | None, progress: Progress, times: dict[str, float]) -> Iterator[None]:
    """Time a stage into ``times[name]`` and report it to ``progress``."""
    clock = time.perf_counter()
    progress.begin(name, total)
    yield
    progress.end()
    times[name] = time.perf_counter() - clock
