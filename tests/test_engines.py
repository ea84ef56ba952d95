"""The seam between the offline pipeline and its engines (`tightpack.offline.engines`): the pipeline
runs the engine the table names, through the two methods of the interface only, and an engine
written against the interface alone packs to the local engine's bytes."""

from __future__ import annotations

from contextlib import contextmanager

from tightpack.offline import pipeline
from tightpack.offline.config import PackConfig
from tightpack.offline.engines import ENGINES, local
from tightpack.offline.engines.base import Engine
from tightpack.offline.pipeline import pack_dataset


class Recording:
    """An engine that forwards to another and records each call by name; it has nothing else."""

    def __init__(self, inner: Engine, calls: list[str]) -> None:
        self._inner, self._calls = inner, calls

    def tokenize(self, *args, **kwargs):
        self._calls.append("tokenize")
        return self._inner.tokenize(*args, **kwargs)

    def write_shards(self, *args, **kwargs):
        self._calls.append("write_shards")
        return self._inner.write_shards(*args, **kwargs)


def recording_start(calls: list[str]):
    @contextmanager
    def start(config: PackConfig):
        calls.append("start")
        with local.start(config) as inner:
            yield Recording(inner, calls)
        calls.append("end")

    return start


def test_the_pipeline_runs_the_engine_of_the_table_through_the_interface(
    tmp_path, prompt_completion_rows, monkeypatch
):
    config = PackConfig(packed_sequence_size=256, reuse_store=False)
    expected = pack_dataset(prompt_completion_rows, tmp_path / "local", config)
    calls: list[str] = []
    monkeypatch.setitem(ENGINES, "local", recording_start(calls))
    got = pack_dataset(prompt_completion_rows, tmp_path / "recorded", config)
    assert calls == ["start", "tokenize", "write_shards", "end"]
    assert got.files == expected.files  # names, rows, bytes and sha256 of every shard
    assert got.counts == expected.counts


def test_the_plan_command_tokenizes_with_the_local_engine(tmp_path, prompt_completion_rows, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(ENGINES, "local", recording_start(calls))
    config = PackConfig(packed_sequence_size=256, reuse_store=False)
    tokenized = pipeline.tokenize_inputs(prompt_completion_rows, config, tmp_path)
    assert calls == ["start", "tokenize", "end"]
    assert tokenized.report.rows_read == len(prompt_completion_rows)
