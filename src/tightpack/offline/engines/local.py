"""``--engine local``: the offline path in this process and its worker processes.

Tokenizing is `tightpack.offline.store_reuse.tokenize_reusing_store`: a finished token store of the
same inputs is taken from the cache, else ``config.workers`` processes tokenize the inputs (into the
cache with ``config.reuse_store``). The shards are written here, one after the other
(`tightpack.core.packed_parquet.write_packed_parquet`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tightpack.core.packed_parquet import Overlay, write_packed_parquet
from tightpack.core.planner import PackPlan
from tightpack.offline.config import PackConfig
from tightpack.offline.engines.base import read_chunks
from tightpack.offline.store_reuse import text_budget, tokenize_reusing_store
from tightpack.prepare.sources import Source
from tightpack.prepare.tokenize import TokenizeReport
from tightpack.prepare.tokenizer import TokenizerSpec


class LocalEngine:
    """The local engine: an `tightpack.offline.engines.base.Engine` with nothing to set up."""

    def tokenize(
        self,
        sources: Sequence[Source],
        spec: TokenizerSpec,
        config: PackConfig,
        staging: Path,
        *,
        on_rows: Callable[[int], None],
        warnings: list[str],
    ) -> TokenizeReport:
        """The token store of the inputs: reused from the cache when it holds one, else tokenized
        (`tightpack.offline.store_reuse`), into ``staging`` when it is not kept in the cache."""
        return tokenize_reusing_store(
            sources,
            lambda starts: read_chunks(sources, starts),
            spec,
            config,
            staging,
            on_rows,
            warnings,
            text_budget(spec, config),
        )

    def write_shards(
        self,
        store,
        plan: PackPlan,
        aligned: np.ndarray,
        directory: Path,
        *,
        pad_id: int,
        row_group_size: int,
        overlay: Overlay | None,
        on_packs: Callable[[int], None],
    ) -> list[dict]:
        """The shards of ``plan``, written here one after the other (`write_packed_parquet`)."""
        return write_packed_parquet(
            store,
            plan,
            aligned,
            directory,
            pad_id=pad_id,
            row_group_size=row_group_size,
            on_packs=on_packs,
            overlay=overlay,
        )


@contextmanager
def start(config: PackConfig) -> Iterator[LocalEngine]:
    """The local engine of a run (the workers are started and ended by each pass)."""
    yield LocalEngine()
