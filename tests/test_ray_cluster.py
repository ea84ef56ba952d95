"""``--engine ray`` across simulated nodes, and a driver killed mid-run (issue 14).

The killed driver's test runs last in the module: what it leaves behind for a while (Ray's agents,
ended by the test) must not meet the two-node cluster.

A `ray.cluster_utils.Cluster` of two nodes of one CPU each, every node with its own raylet and worker
processes, packs into a folder both can reach; the killed driver is a real ``tightpack pack`` process
with its own local cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare import file_ranges
from tightpack.prepare.sources import default_corpus

from .conftest import write_jsonl

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory) -> Path:
    rows = [row for chunk in default_corpus().read(0, 512) for row in chunk.parsed_rows()][:1024]
    return write_jsonl(tmp_path_factory.mktemp("demo") / "demo.jsonl", rows)


@pytest.fixture
def two_nodes(monkeypatch):
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no usage statistics from test clusters
    monkeypatch.setenv("RAY_DATA_USAGE_DISABLED", "1")

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_two_nodes_pack_the_local_engines_bytes_into_a_shared_folder(
    tmp_path, demo_rows, two_nodes, monkeypatch
):
    assert len(two_nodes.list_all_nodes()) == 2
    settings = {"packed_sequence_size": 1024, "reuse_store": False}
    local = pack_dataset([demo_rows], tmp_path / "local", PackConfig(workers=1, **settings))
    # --ray-address joins the running cluster; two actors of one CPU each on two one-CPU nodes: one
    # actor per node, each in its node's own worker process, taking the 2.5 MB file's 40 pieces of
    # 64 KiB between them; the file's write task reads the parts both wrote.
    monkeypatch.setattr(file_ranges, "RANGE_BYTES", 1 << 16)
    config = PackConfig(engine="ray", workers=None, ray_address=two_nodes.address, **settings)
    distributed = pack_dataset([demo_rows], tmp_path / "shared", config)
    for path in local.output.iterdir():
        if path.name != "manifest.json":
            assert path.read_bytes() == (distributed.output / path.name).read_bytes(), path.name
    assert distributed.counts == local.counts
    assert not ray.is_initialized()  # the run disconnected from the cluster it joined ...
    ray.init(address=two_nodes.address, log_to_driver=False)
    try:  # ... and left it running
        assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    finally:
        ray.shutdown()


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (the Ray cluster a driver started runs as its children)."""
    found, frontier = set(), [pid]
    while frontier:
        listed = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True)
        children = {int(line) for line in listed.stdout.split()}
        frontier.extend(children - found)
        found |= children
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def test_a_driver_killed_mid_run_leaves_the_previous_output_and_no_cluster(tmp_path, demo_rows):
    output = tmp_path / "out"
    pack = [sys.executable, "-m", "tightpack.cli", "pack", str(demo_rows), "-o", str(output)]
    pack += ["--pack-size", "1024", "--no-reuse"]
    subprocess.run([*pack, "--workers", "1"], check=True, capture_output=True)
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    driver = subprocess.Popen(
        [*pack, "--overwrite", "--engine", "ray", "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Mid-run: the work folder exists and the driver's own cluster (a raylet among its children) is up.
    deadline, cluster = time.monotonic() + 120, set()
    while driver.poll() is None and time.monotonic() < deadline:
        cluster = descendants(driver.pid)
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in cluster if alive(pid)]
        if any(tmp_path.glob(".out.partial-*")) and "raylet" in names:
            break
        time.sleep(0.05)
    assert driver.poll() is None, "the run ended before it could be killed mid-run"
    time.sleep(0.5)  # the actors are starting or tokenizing
    cluster |= descendants(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
    # The cluster the driver started goes with it: its GCS, raylet and workers within seconds (Ray's
    # dashboard and runtime-env agents notice later, within about two minutes, and are not waited for).
    for _ in range(200):
        left = {pid: command(pid) for pid in cluster if alive(pid) and not command(pid).endswith("Agent")}
        if not left:
            break
        time.sleep(0.1)
    assert not left, left
    # Ray's slow agents still hold their ports (the dashboard agent's 52365): a cluster started before
    # they notice fails to start its own. They are orphans of the killed run; end them here.
    for pid in cluster:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    subprocess.run([*pack, "--overwrite", "--workers", "1"], check=True, capture_output=True)
    assert not any(tmp_path.glob(".out.partial-*"))  # the next run swept the killed one's folder
