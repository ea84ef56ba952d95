"""The engines of the offline path, by name: where a packing run tokenizes and writes its shards.

`tightpack.offline.engines.base` says what an engine does; `local` (worker processes on this machine)
and `ray` (a Ray cluster) are the two there are. `tightpack.offline.pipeline` starts the engine of
``PackConfig.engine`` with `start_engine` and does not know which one it runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from tightpack.offline.config import PackConfig
from tightpack.offline.engines import local, ray
from tightpack.offline.engines.base import Engine, StartEngine

ENGINES: dict[str, StartEngine] = {"local": local.start, "ray": ray.start}
"""Each engine's ``start``, by the name ``PackConfig.engine`` gives it."""


def start_engine(config: PackConfig) -> AbstractContextManager[Engine]:
    """The engine ``config.engine`` names, started for one run (a context manager)."""
    return ENGINES[config.engine](config)
