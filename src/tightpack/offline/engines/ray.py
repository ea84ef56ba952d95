"""``--engine ray``: offline packing on a Ray cluster, the local engine's bytes (issue 14).

`start` gives a run its `RayEngine` (the `tightpack.offline.engines.base.Engine` of this module) on a
connected cluster. Two passes over the cluster; the driver holds per-sample tables only (no token, no row):

1. **Tokenize** (Ray Data ``map_batches`` on a pool of actors, the tokenizer loaded once per actor).
   The work is a list of *pieces*: byte ranges of JSONL files and row-group ranges of Parquet files
   (`tightpack.prepare.file_ranges`), which each actor reads itself; inputs that live in the
   driver's memory (a ``datasets.Dataset``, Python rows, the embedded corpus) travel as chunks of
   rows instead. Each actor writes the samples of its piece as a *part*, a token store folder under
   the run's staging folder, and returns a summary: rows, bad rows, cut texts.
2. **Write** (Ray tasks, one per output file). The driver reads each part's lengths, source rows and
   supervised counts (`tightpack.core.parted_store.PartedStore`), applies the long-sample policy,
   and plans with the local engine's planner and settings. Each file of the local engine's layout
   (`tightpack.core.packed_parquet.shard_layout`) is then written by a task that reads its packs'
   tokens straight from the parts; the driver writes the metadata, the manifest and the checksums,
   and publishes the folder with one rename, as the local engine does.

The staging folder sits next to the output, so the output must be on storage every node reaches (a
shared filesystem mount); the parts live there, written once and never tokenized again.

Faults: an actor that dies (a killed process, a lost node) is restarted by Ray Data and its piece
runs again; a write task that dies is retried. Both are pure functions of their input, so a retry
writes the same bytes. A driver killed mid-run leaves the previous output (nothing is published
before the end) and its staging folder, which the next run on that output sweeps.

Ray is an optional dependency (``pip install 'tightpack[ray]'``). Without an address a local cluster
sized to this machine (or to ``workers``) is started and shut down after the run; with ``auto`` or
an address, an existing cluster is joined and left running. A cluster already initialized in this
process (``ray.init`` by the caller) is used as it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tightpack.core.long_samples import cut_long_samples, gathered_cut
from tightpack.core.packed_parquet import Overlay, Shard, shard_layout, write_shard
from tightpack.core.parted_store import PartedStore, write_supervised
from tightpack.core.planner import PackPlan
from tightpack.core.token_store import TokenStoreWriter
from tightpack.core.truncation import TruncationMethod
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.engines.base import CHUNK_ROWS, read_chunks
from tightpack.offline.store_reuse import text_budget
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.file_ranges import FileRange, file_ranges, read_range
from tightpack.prepare.tokenize import BadRow, Encoder, TokenizeReport, bad_row_error, encode_chunk
from tightpack.prepare.tokenizer import TokenizerSpec

_NAMESPACE = "tightpack"
_WRITE_RETRIES = 3
"""Retries of a shard's write task whose worker died."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise TightpackError(
            "engine='ray' needs Ray: pip install 'tightpack[ray]' (or run with engine='local')",
            parameters=("engine='ray'", "engine='local'"),
        ) from None
    return ray


@contextmanager
def start(config: PackConfig) -> Iterator[RayEngine]:
    """The Ray engine of a run: `ray_cluster` at ``config.ray_address`` with ``config.workers`` actors."""
    with ray_cluster(config.ray_address, config.workers) as engine:
        yield engine


@contextmanager
def ray_cluster(address: str | None, workers: int | None) -> Iterator[RayEngine]:
    """A connected Ray cluster for the run, and the run's `RayEngine` (its number of tokenizer actors).

    Already initialized in this process: used as it is. ``address`` (``auto`` or ``host:port``):
    joined, and left running after. Neither: a local cluster of ``workers`` CPUs (default: this
    machine's), shut down after.
    """
    ray = _import_ray()
    # Ray Data asks a Prometheus server for cluster metrics after every execution, for its usage
    # statistics: tightpack sends none and asks for none (a user may opt in by setting the variable).
    # A cluster of our own reports no usage statistics either. Both are set for the run only.
    quiet = {"RAY_DATA_USAGE_DISABLED": "1"}
    if address is None and not ray.is_initialized():
        quiet["RAY_USAGE_STATS_ENABLED"] = "0"
    with _environment_defaults(quiet):
        with _connected(ray, address, workers) as run:
            yield run


@contextmanager
def _connected(ray, address: str | None, workers: int | None) -> Iterator[RayEngine]:
    """`ray_cluster` once its environment is set."""
    started = False
    if not ray.is_initialized():
        options = {
            "namespace": _NAMESPACE,
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": logging.ERROR,
        }
        if address is None:
            options["num_cpus"] = workers or _cpu_count()
        try:
            ray.init(address=address, **options)
        except ConnectionError as error:
            raise TightpackError(
                f"ray_address {address}: cannot join a Ray cluster there ({error}); start one with "
                "`ray start --head` or leave ray_address out for a local cluster",
                parameters=("ray_address",),
            ) from None
        started = True
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        yield RayEngine(max(1, min(workers or cpus, cpus)))
    finally:
        if started:
            ray.shutdown()


@contextmanager
def _environment_defaults(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set where the caller has not set them, as they were again at the end."""
    added = [name for name in values if name not in os.environ]
    os.environ.update({name: values[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextmanager
def _data_settings(ray_data) -> Iterator[None]:
    """Ray Data set for tightpack's pass (input order kept, its own progress bars and log lines held
    back: the run's progress is tightpack's to show), and the caller's settings back at the end,
    whether the pass ends or fails."""
    context = ray_data.DataContext.get_current()
    options = context.execution_options
    logger = logging.getLogger("ray.data")
    saved = (
        options.preserve_order,
        context.enable_progress_bars,
        context.print_on_execution_start,
        logger.level,
    )
    options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        options.preserve_order, context.enable_progress_bars, context.print_on_execution_start, level = saved
        logger.setLevel(level)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pieces(sources, chunks: Callable[[], Iterator[Chunk]]) -> list[FileRange | Chunk]:
    """What the actors read: ranges of the input files, or (inputs in this process's memory) chunks
    of rows, renumbered from 0 as a range's rows are."""
    ranges = file_ranges(sources)
    if ranges is not None:
        return ranges
    return [dataclasses.replace(chunk, first_sample=0) for chunk in chunks()]


@dataclasses.dataclass(frozen=True)
class LongSamples:
    """What a worker does with the samples of its part over the cap: cut them to ``limit`` stored
    tokens (the cap + 1) with ``method``, or nothing (``limit`` None: the run drops them or stops)."""

    limit: int | None
    method: TruncationMethod = "right"


class _Tokenizer:
    """A Ray Data actor: encodes a piece into a part folder, cuts its long samples into the part's
    overlay folder, returns the piece's summary."""

    def __init__(self, encoder: Encoder, parts: str, chunk_rows: int, long_samples: LongSamples) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one actor per CPU already uses the cores
        self.encoder, self.parts, self.chunk_rows = encoder, Path(parts), chunk_rows
        self.long_samples = long_samples

    def __call__(self, batch: dict) -> dict:
        part, piece = int(batch["part"][0]), pickle.loads(batch["piece"][0])
        chunks = read_range(piece, self.chunk_rows) if isinstance(piece, FileRange) else [piece]
        folder = self.parts / _part_name(part)
        writer = TokenStoreWriter(folder)
        rows, texts_cut, bad_rows = 0, 0, []
        for chunk in chunks:
            result = encode_chunk(self.encoder, chunk)
            writer.append(
                result.tokens, result.loss_mask, result.lengths, result.source_index, result.segments
            )
            rows += result.rows
            texts_cut += result.texts_cut
            bad_rows += [dataclasses.astuple(bad) for bad in result.bad_rows]
        store = writer.close()
        write_supervised(store)
        if (limit := self.long_samples.limit) is not None:
            long = np.flatnonzero(store.lengths > limit)
            cut_long_samples(store, long, limit, self.long_samples.method, folder / _OVERLAY)
        summary = {"rows": rows, "texts_cut": texts_cut, "bad_rows": bad_rows}
        return {"part": np.array([part]), "summary": np.array([json.dumps(summary)])}


def _part_name(part: int) -> str:
    return f"part-{part:08d}"


_OVERLAY = "truncated"
"""A part's overlay folder: its long samples as cut (`cut_long_samples`); absent when none is."""


@dataclasses.dataclass(frozen=True)
class ShardWork:
    """What the task writing one file gets: the file (`Shard`, pack numbers from 0), its samples in
    plan order, where each pack starts among them, their aligned lengths and overlay entries (both
    numbered as the samples are: 0, 1, ...)."""

    shard: Shard
    samples: np.ndarray
    offsets: np.ndarray
    aligned: np.ndarray
    overlay: Overlay | None


def shard_work(plan: PackPlan, aligned: np.ndarray, overlay: Overlay | None) -> Iterator[ShardWork]:
    """The work of every output file of ``plan`` (`shard_layout`), one at a time: the driver holds
    one file's arrays beside the plan, whatever the plan's size."""
    for shard in shard_layout(plan, aligned):
        lo, hi = plan.offsets[shard.first], plan.offsets[shard.stop]
        samples = plan.order[lo:hi]
        yield ShardWork(
            shard.shifted(),
            samples,
            plan.offsets[shard.first : shard.stop + 1] - lo,
            aligned[samples],
            None if overlay is None else overlay.renumbered(samples),
        )


def _write_shard_task(store: PartedStore, work: ShardWork, **write) -> dict:
    """A Ray task: one output file, its packs' tokens read from the parts and their overlays
    (`write_shard`)."""
    plan = PackPlan(order=np.arange(len(work.samples)), offsets=work.offsets)
    return write_shard(
        store.select(work.samples), plan, work.aligned, shard=work.shard, overlay=work.overlay, **write
    )


@dataclasses.dataclass
class RayEngine:
    """The Ray engine (an `tightpack.offline.engines.base.Engine`): the two passes of a run on the
    connected cluster, with ``actors`` tokenizer actors."""

    actors: int

    def tokenize(
        self,
        sources,
        spec: TokenizerSpec,
        config: PackConfig,
        staging: Path,
        *,
        on_rows: Callable[[int], None],
        warnings: list[str],
    ) -> TokenizeReport:
        """Pass 1: every piece of the inputs tokenized into a part under ``staging/_parts``, its long
        samples cut there when ``config.long_samples`` is ``truncate``. The cache of token stores, a
        folder of this machine, is not used.

        Summaries are taken in input order, so the first bad row stops the run (unless
        ``config.skip_bad_lines``) with the local engine's message, and rows are numbered as it
        numbers them.
        """
        _import_ray()
        import ray.data

        cut = config.long_samples == "truncate"
        long_samples = LongSamples(config.cap + 1 if cut else None, config.format.truncation_method)
        encoder = Encoder(spec, config.format, text_budget(spec, config))
        with _data_settings(ray.data):
            return self._tokenize(
                ray.data,
                sources,
                lambda: read_chunks(sources),
                encoder,
                staging / "_parts",
                long_samples,
                CHUNK_ROWS,
                config.skip_bad_lines,
                on_rows,
            )

    def _tokenize(
        self, ray_data, sources, chunks, encoder, parts, long_samples, chunk_rows, skip_bad_rows, on_rows
    ) -> TokenizeReport:
        """`tokenize` once Ray Data is set for it."""
        pieces = _pieces(sources, chunks)
        parts.mkdir(parents=True, exist_ok=True)
        work = [{"part": part, "piece": pickle.dumps(piece)} for part, piece in enumerate(pieces)]
        summaries = ray_data.from_items(work, override_num_blocks=max(1, len(work))).map_batches(
            _Tokenizer,
            fn_constructor_args=(encoder, str(parts), chunk_rows, long_samples),
            batch_size=1,
            compute=ray_data.ActorPoolStrategy(size=min(self.actors, max(1, len(work)))),
            num_cpus=1,
        )
        first_row, bad_rows, rows_read, texts_cut = [], [], 0, 0
        for row in summaries.iter_rows() if work else ():
            summary = json.loads(row["summary"])
            found = [BadRow(rows_read + row, where, why) for row, where, why in summary["bad_rows"]]
            if found and not skip_bad_rows:
                raise bad_row_error(found[0])
            bad_rows += found
            first_row.append(rows_read)
            rows_read += summary["rows"]
            texts_cut += summary["texts_cut"]
            on_rows(summary["rows"])
        folders = [parts / _part_name(part) for part in range(len(work))]
        store = PartedStore.from_parts(folders, first_row)
        cut = gathered_cut(store, [folder / _OVERLAY for folder in folders])
        return TokenizeReport(store, rows_read, bad_rows, texts_cut=texts_cut, cut=cut)

    def write_shards(
        self,
        store: PartedStore,
        plan: PackPlan,
        aligned: np.ndarray,
        directory: Path,
        *,
        pad_id: int,
        row_group_size: int,
        overlay: Overlay | None,
        on_packs: Callable[[int], None],
    ) -> list[dict]:
        """Pass 2: the local engine's files (`shard_layout`), each written by a task on the cluster.

        A task gets its file's packs as a plan of their own (samples numbered 0, 1, ... in plan
        order), their samples' aligned lengths and overlay entries, and the parts' small tables.
        """
        ray = _import_ray()
        task = ray.remote(num_cpus=1, max_retries=_WRITE_RETRIES)(_write_shard_task)
        store_reference = ray.put(store)
        pending, files = deque(), []
        for work in shard_work(plan, aligned, overlay):
            pending.append(
                task.remote(
                    store_reference,
                    work,
                    directory=str(directory),
                    pad_id=pad_id,
                    row_group_size=row_group_size,
                )
            )
            if len(pending) >= 2 * self.actors:
                files.append(_finished(ray, pending.popleft(), on_packs))
        while pending:
            files.append(_finished(ray, pending.popleft(), on_packs))
        return files


def _finished(ray, reference, on_packs: Callable[[int], None]) -> dict:
    try:
        entry = ray.get(reference)
    except ray.exceptions.RayTaskError as error:  # a TightpackError (or a bug) raised in the task
        raise error.as_instanceof_cause() from None
    on_packs(entry["rows"])
    return entry
