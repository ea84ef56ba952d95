"""What an engine of the offline path does: the seam between `tightpack.offline.pipeline` and the
place where the heavy work runs.

An engine does the two passes over the data of a packing run, and nothing else:

1. `Engine.tokenize`: the rows of the inputs into a token store (one store, or parts read as one),
   samples numbered in input order;
2. `Engine.write_shards`: the packs of a plan into packed Parquet shards, in the file layout of
   `tightpack.core.packed_parquet.shard_layout`, the very bytes the local engine writes.

The pipeline does the rest the same way whatever the engine: the long-sample policy and the counts
(`tightpack.offline.accounting`), the plan, the metadata, the manifest, and the publish of the folder.

An engine is started for one run by its module's ``start(config)``, a context manager that yields the
`Engine` (the Ray engine joins or starts a cluster there, and leaves it at the end). The engines are
listed by name in `tightpack.offline.engines.ENGINES`; a new one is a module of this package with a
``start``, its name added there and to `tightpack.offline.config.Engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import numpy as np

from tightpack.core.packed_parquet import Overlay
from tightpack.core.planner import PackPlan
from tightpack.offline.config import PackConfig
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.sources import Source
from tightpack.prepare.tokenize import TokenizeReport
from tightpack.prepare.tokenizer import TokenizerSpec

CHUNK_ROWS = 512
"""Rows per tokenization chunk; fixed, so the output does not depend on the number of workers."""


class Engine(Protocol):
    """The two passes of a packing run over its data (see the module's docstring)."""

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
        """Tokenize every row of ``sources`` with ``spec`` as ``config.format`` says.

        Work files go into ``staging`` (the run's folder, next to the output), in folders whose
        names start with ``_`` (the pipeline removes them before it publishes). ``on_rows`` is
        called with the number of rows read as they are read; a problem that does not stop the run
        is one line appended to ``warnings``. Bad rows stop the run with
        `tightpack.prepare.tokenize.bad_row_error` unless ``config.skip_bad_lines``.
        """
        ...

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
        """Write the packs of ``plan`` as packed Parquet shards into ``directory``.

        ``store`` is what `tokenize` returned (``report.store``), ``aligned`` the aligned length of
        each of its samples, ``overlay`` the samples cut to the cap (or None). ``on_packs`` is called
        with the number of packs written as they are written. Returns one entry per file, in file
        order: ``{"name", "rows", "bytes", "sha256"}`` (the manifest's ``files``).
        """
        ...


StartEngine = Callable[[PackConfig], AbstractContextManager[Engine]]
"""An engine module's ``start``: the `Engine` of one run, set up for ``config`` and torn down after."""


def read_chunks(sources: Sequence[Source], starts: list[int] | None = None) -> Iterator[Chunk]:
    """The rows of ``sources`` in chunks of `CHUNK_ROWS`, samples numbered from 0 across the sources;
    ``starts`` (when given) receives the first row number of each source as it is reached."""
    first = 0
    for source in sources:
        if starts is not None:
            starts.append(first)
        for chunk in source.read(first, CHUNK_ROWS):
            first = chunk.first_sample + len(chunk)
            yield chunk
