"""``--engine ray``: tokenization on a Ray cluster, the same token store as the local engine (issue 14).

The local engine encodes the chunks of its inputs (`tightpack.prepare.sources`, fixed row and byte
sizes) in a pool of worker processes and appends their results, in input order, to the token store.
This engine encodes the same chunks on a pool of Ray actors, each holding the tokenizer loaded once,
on as many machines as the cluster has; the driver keeps a bounded number of chunks in flight and
appends the results in input order. The store, and so the plan, the packs and every count of the
manifest, are the local engine's byte for byte (``tests/test_ray_engine.py``).

Faults: an actor that dies (a killed process, a lost node) is restarted and its unfinished chunks
run again (``max_restarts`` / ``max_task_retries``); encoding is a pure function of the chunk, so a
retried chunk gives the same result. A driver killed mid-run leaves the previous output, as the local
engine does (the output is published by one rename at the end).

Ray is an optional dependency (``pip install 'tightpack[ray]'``). Without an address a local cluster
sized to this machine (or to ``workers``) is started and shut down after the run; with ``auto`` or
an address, an existing cluster is joined and left running. A cluster already initialized in this
process (``ray.init`` by the caller) is used as it is.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from tightpack.errors import TightpackError
from tightpack.prepare.sources import Chunk
from tightpack.prepare.tokenize import ChunkResult, Encoder, encode_chunk

__all__ = ["ACTOR_NAME_PREFIX", "RayEncoder", "ray_cluster"]

ACTOR_NAME_PREFIX = "tightpack-tokenizer"
"""Actors are named ``{prefix}-{run}-{index}`` in the namespace ``tightpack`` (to find them in the
dashboard, or to kill one in a fault test)."""

_NAMESPACE = "tightpack"
_RETRIES = 3
"""Restarts of a dead actor, and retries of a chunk it was encoding."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise TightpackError(
            "--engine ray needs Ray: pip install 'tightpack[ray]' (or run with --engine local)"
        ) from None
    return ray


@contextmanager
def ray_cluster(address: str | None, workers: int | None) -> Iterator[int]:
    """A connected Ray cluster for the run; yields the number of tokenizer actors to start.

    Already initialized in this process: used as it is. ``address`` (``auto`` or ``host:port``):
    joined, and left running after. Neither: a local cluster of ``workers`` CPUs (default: this
    machine's), shut down after.
    """
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        options = {"namespace": _NAMESPACE, "include_dashboard": False, "log_to_driver": False}
        if address is None:
            options["num_cpus"] = workers or _cpu_count()
        try:
            ray.init(address=address, **options)
        except ConnectionError as error:
            raise TightpackError(
                f"--ray-address {address}: cannot join a Ray cluster there ({error}); start one with "
                "`ray start --head` or leave --ray-address out for a local cluster"
            ) from None
        started = True
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        yield max(1, min(workers or cpus, cpus))
    finally:
        if started:
            ray.shutdown()


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class RayEncoder:
    """``encode_chunks(encoder, chunks)`` for `tightpack.prepare.tokenize.tokenize_to_store` on Ray.

    Starts ``actors`` tokenizer actors (one CPU each), sends them the chunks round robin with at most
    two per actor in flight, and yields the results in input order. ``run`` names this run's actors.
    """

    def __init__(self, actors: int, run: str) -> None:
        self.actors, self.run = actors, run

    def __call__(self, encoder: Encoder, chunks: Iterator[Chunk]) -> Iterator[ChunkResult]:
        ray = _import_ray()
        actor_class = ray.remote(num_cpus=1, max_restarts=_RETRIES, max_task_retries=_RETRIES)(_Tokenizer)
        # A restarted actor needs its constructor argument again: put once and held here until every
        # actor is done (an argument passed by value is released after the first construction,
        # and a restart then fails: ray issue 53727).
        encoder_reference = ray.put(encoder)
        pool = [
            actor_class.options(name=f"{ACTOR_NAME_PREFIX}-{self.run}-{index}", namespace=_NAMESPACE).remote(
                encoder_reference
            )
            for index in range(self.actors)
        ]
        try:
            pending: deque = deque()
            for index, chunk in enumerate(chunks):
                pending.append(pool[index % len(pool)].encode.remote(chunk))
                if len(pending) >= 2 * len(pool):
                    yield _result(ray, pending.popleft())
            while pending:
                yield _result(ray, pending.popleft())
        finally:
            for actor in pool:
                ray.kill(actor, no_restart=True)


def _result(ray, reference) -> ChunkResult:
    try:
        return ray.get(reference)
    except ray.exceptions.RayTaskError as error:  # a TightpackError (or a bug) raised in the actor
        raise error.as_instanceof_cause() from None


class _Tokenizer:
    """A Ray actor: the encoder (tokenizer, format, text budget) loaded once, chunks encoded on call."""

    def __init__(self, encoder: Encoder) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one actor per CPU already uses the cores
        self.encoder = encoder

    def encode(self, chunk: Chunk) -> ChunkResult:
        return encode_chunk(self.encoder, chunk)
