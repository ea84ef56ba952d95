"""``--engine ray``: the local engine's bytes, counts and errors, on a real Ray cluster (issue 14).

One local Ray cluster of two CPUs for the module (start-up takes seconds). Every test compares a Ray
run with a local run of the same inputs and settings, output file by output file.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare import file_ranges
from tightpack.prepare.sources import default_corpus, open_sources

from .conftest import run_main, write_jsonl

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The module's cluster; files are cut into ranges of 64 KiB, so that every input file here is
    several pieces of work (the default, 32 MiB, would make each one piece)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no usage statistics from test clusters
        patch.setenv("RAY_DATA_USAGE_DISABLED", "1")
        ray.init(num_cpus=2, include_dashboard=False, namespace="tightpack", log_to_driver=False)
        patch.setattr(file_ranges, "RANGE_BYTES", 1 << 16)
        yield
    ray.shutdown()


def pack_both(inputs, tmp_path: Path, name: str, workers: int = 2, **settings):
    """The same inputs packed by the local engine and by Ray; returns both results."""
    results = {}
    for engine in ("local", "ray"):
        # The local engine runs in-process here: in a Ray-connected process it would spawn its workers
        # (no fork), seconds of start-up, and its output is the same for any worker count.
        config = PackConfig(
            engine=engine, workers=workers if engine == "ray" else 1, reuse_store=False, **settings
        )
        results[engine] = pack_dataset(inputs, tmp_path / f"{name}-{engine}", config)
    return results["local"], results["ray"]


def assert_same_output(local, ray_result) -> None:
    """Every file byte-identical, except the manifest's ``engine``."""
    local_files = sorted(p.name for p in local.output.iterdir())
    assert local_files == sorted(p.name for p in ray_result.output.iterdir())
    assert any(name.endswith(".parquet") for name in local_files)
    for name in local_files:
        if name == "manifest.json":
            continue
        assert (local.output / name).read_bytes() == (ray_result.output / name).read_bytes(), name
    manifests = [json.loads((r.output / "manifest.json").read_text()) for r in (local, ray_result)]
    assert [m.pop("engine") for m in manifests] == ["local", "ray"]
    assert manifests[0] == manifests[1]


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory) -> Path:
    """The first 1,024 conversations of the demo corpus as a JSONL file (2.5 MB: about 40 pieces of
    the module's 64 KiB ranges)."""
    chunks = itertools.islice(default_corpus().read(0, 512), 2)
    rows = [row for chunk in chunks for row in chunk.parsed_rows()]
    return write_jsonl(tmp_path_factory.mktemp("demo") / "demo.jsonl", rows)


@pytest.fixture(scope="module")
def local_demo(tmp_path_factory, demo_rows):
    """The local engine's output of ``demo_rows``, which every Ray run of them must equal."""
    config = PackConfig(packed_sequence_size=1024, workers=1, reuse_store=False)
    return pack_dataset([demo_rows], tmp_path_factory.mktemp("local") / "demo", config)


def test_the_demo_corpus_packs_to_the_same_bytes(tmp_path, demo_rows, local_demo):
    """Two workers (one worker: the tests below)."""
    config = PackConfig(packed_sequence_size=1024, engine="ray", workers=2, reuse_store=False)
    ray_result = pack_dataset([demo_rows], tmp_path / "ray", config)
    assert local_demo.counts["samples_in"] == 1024
    assert_same_output(local_demo, ray_result)


def test_rows_in_the_drivers_memory_travel_as_chunks_and_pack_to_the_same_bytes(tmp_path):
    """Python rows (as a ``datasets.Dataset`` or the embedded corpus) live in the driver's memory:
    their chunks of rows are the pieces of work, shipped to the actors."""
    rows = next(default_corpus().read(0, 512)).parsed_rows()
    local, ray_result = pack_both(rows, tmp_path, "rows", workers=1, packed_sequence_size=2048)
    assert local.counts["samples_in"] == 512
    assert_same_output(local, ray_result)


def mixed_inputs(folder: Path, chat_rows: list[dict]) -> list[Path]:
    """Two JSONL files and a Parquet file: chat and prompt-completion rows, bad lines, a sample far
    over the cap, and rows with nothing to supervise."""
    first = write_jsonl(folder / "a.jsonl", chat_rows[:40])
    with first.open("a", encoding="utf-8") as handle:
        handle.write("{not json\n")
        handle.write(json.dumps({"input": "long " * 900, "output": "answer"}) + "\n")
        handle.write(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    second = write_jsonl(folder / "b.jsonl", [{"input": f"q {i}", "output": f"a {i}"} for i in range(300)])
    table = pa.Table.from_pylist(
        [{"input": f"p {i} " * (i % 50), "output": "x" * (i % 7)} for i in range(700)]
    )
    third = folder / "c.parquet"
    pq.write_table(table, third, row_group_size=100)
    return [first, second, third]


@pytest.mark.parametrize("workers", [1, 2])
def test_files_with_bad_rows_long_samples_and_no_supervision_give_the_same_bytes_and_counts(
    tmp_path, chat_rows, workers, monkeypatch
):
    monkeypatch.setattr(file_ranges, "RANGE_BYTES", 4096)  # the bad and the long rows in later ranges
    inputs = mixed_inputs(tmp_path, chat_rows)
    pieces = file_ranges.file_ranges(open_sources(inputs))
    assert [piece.source for piece in pieces].count(str(inputs[0])) > 2
    assert [piece.source for piece in pieces].count(str(inputs[2])) == 7  # a row group each
    settings = {"packed_sequence_size": 256, "skip_bad_lines": True, "long_samples": "truncate"}
    local, ray_result = pack_both(inputs, tmp_path, "mixed", workers=workers, **settings)
    assert local.counts["bad_rows"] == 1 and local.counts["truncated"] >= 1
    assert local.counts["no_supervised"] >= 1
    assert [row.location for row in local.bad_rows] == [row.location for row in ray_result.bad_rows]
    assert local.counts == ray_result.counts
    assert_same_output(local, ray_result)


def test_the_legacy_npy_is_written_by_the_driver_from_the_parts(tmp_path, chat_rows, monkeypatch):
    """``--output-format npy`` on Ray: the driver gathers the packs from the workers' parts and their
    cuts (one file, the legacy format), the local engine's bytes."""
    monkeypatch.setattr(file_ranges, "RANGE_BYTES", 4096)
    inputs = mixed_inputs(tmp_path, chat_rows)
    settings = {"packed_sequence_size": 256, "skip_bad_lines": True, "output_format": "npy"}
    local, ray_result = pack_both(inputs, tmp_path, "npy", **settings)
    assert local.counts["truncated"] >= 1
    assert (local.output / "packs.npy").read_bytes() == (ray_result.output / "packs.npy").read_bytes()


def test_the_first_bad_row_stops_the_run_with_the_local_message(tmp_path, chat_rows, monkeypatch):
    monkeypatch.setattr(file_ranges, "RANGE_BYTES", 4096)
    inputs = mixed_inputs(tmp_path, chat_rows)
    messages = []
    for engine in ("local", "ray"):
        workers = 2 if engine == "ray" else 1  # no fork in a Ray-connected process (see pack_both)
        config = PackConfig(packed_sequence_size=256, engine=engine, workers=workers, reuse_store=False)
        with pytest.raises(TightpackError) as raised:
            pack_dataset(inputs, tmp_path / f"out-{engine}", config)
        messages.append(str(raised.value))
        assert not (tmp_path / f"out-{engine}").exists()
    assert messages[0] == messages[1]
    assert "a.jsonl:41" in messages[0]


class KillATokenizer:
    """A progress display that kills a tokenizer actor's process (as the OOM killer would) when the
    first piece is done."""

    def __init__(self) -> None:
        self.stage, self.killed = None, []

    def begin(self, stage, total) -> None:
        self.stage = stage

    def advance(self, amount) -> None:
        if self.stage != "tokenize" or self.killed:
            return
        found = subprocess.run(["pgrep", "-f", r"MapWorker\(MapBatches\(_Tokenizer\)\)"], capture_output=True)
        pids = [int(pid) for pid in found.stdout.split()]
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            self.killed.append(pids[0])

    def end(self) -> None:
        pass


def test_a_killed_tokenizer_is_restarted_and_the_output_does_not_change(tmp_path, demo_rows, local_demo):
    progress = KillATokenizer()
    config = PackConfig(packed_sequence_size=1024, engine="ray", workers=2, reuse_store=False)
    ray_result = pack_dataset([demo_rows], tmp_path / "ray", config, progress=progress)
    assert progress.killed  # a tokenizer did die mid-run
    assert_same_output(local_demo, ray_result)


def test_the_cli_runs_on_ray_and_refuses_a_ray_address_without_it(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [{"input": f"q {i}", "output": f"a {i}"} for i in range(50)])
    run = ["pack", str(source), "--pack-size", "64", "--no-reuse"]
    # in this process: the settings are refused before anything runs (`PackConfig.validate`)
    refused = run_main([*run, "-o", str(tmp_path / "x"), "--ray-address", "auto"])
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--ray-address needs --engine ray" in refused.stderr


def test_without_ray_installed_the_engine_is_one_line_naming_the_extra(tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", [{"input": "q", "output": "a"}])
    code = (
        "import sys; sys.modules['ray'] = None; from tightpack.cli import main; "
        f"sys.exit(main(['pack', {str(source)!r}, '-o', {str(tmp_path / 'o')!r}, '--pack-size', '64', "
        "'--engine', 'ray', '--no-reuse']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "pip install 'tightpack[ray]'" in done.stderr
    assert not (tmp_path / "o").exists()


def test_runs_in_a_process_with_a_cluster_leave_it_running(tmp_path):
    """The module's cluster is the caller's: a run neither shuts it down nor starts another."""
    source = write_jsonl(tmp_path / "s.jsonl", [{"input": f"q {i}", "output": f"a {i}"} for i in range(200)])
    config = PackConfig(packed_sequence_size=256, engine="ray", workers=1, reuse_store=False)
    address = ray.get_runtime_context().gcs_address
    for name in ("one", "two"):
        pack_dataset([source], tmp_path / name, config)
        assert ray.is_initialized() and ray.get_runtime_context().gcs_address == address


def test_a_run_leaves_the_callers_data_context_and_environment_as_it_found_them(tmp_path, monkeypatch):
    """Ended or failed, a run gives back the caller's Ray Data settings, logger level and environment."""
    import logging

    import ray.data

    monkeypatch.delenv("RAY_DATA_USAGE_DISABLED")  # the caller has not set it: the run sets it for itself
    context = ray.data.DataContext.get_current()
    monkeypatch.setattr(context.execution_options, "preserve_order", False)
    monkeypatch.setattr(context, "enable_progress_bars", True)
    monkeypatch.setattr(context, "print_on_execution_start", True)
    logger = logging.getLogger("ray.data")
    monkeypatch.setattr(logger, "level", logging.INFO)

    def found() -> tuple:
        options = ray.data.DataContext.get_current().execution_options
        return (
            dict(os.environ),
            options.preserve_order,
            context.enable_progress_bars,
            (context.print_on_execution_start),
            logger.level,
        )

    before = found()
    good = write_jsonl(tmp_path / "good.jsonl", [{"input": f"q {i}", "output": f"a {i}"} for i in range(20)])
    config = PackConfig(packed_sequence_size=64, engine="ray", workers=1, reuse_store=False)
    pack_dataset([good], tmp_path / "out", config)
    assert found() == before
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "q", "output": "a"}\n{not json\n')
    with pytest.raises(TightpackError, match=r"bad\.jsonl:2: malformed JSON"):
        pack_dataset([bad], tmp_path / "failed", config)
    assert found() == before
