"""``--engine ray`` across simulated nodes, and a driver killed mid-run (issue 14).

A `ray.cluster_utils.Cluster` of two nodes of one CPU each, every node with its own raylet and worker
processes, packs into a folder both can reach; the killed driver is a real ``tightpack pack`` process
with its own local cluster.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tightpack.pipeline import PackConfig, pack_dataset
from tightpack.prepare.sources import default_corpus

from .conftest import write_jsonl

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory) -> Path:
    rows = [row for chunk in default_corpus().read(0, 512) for row in chunk.parsed_rows()][:2048]
    return write_jsonl(tmp_path_factory.mktemp("demo") / "demo.jsonl", rows)


def ray_processes() -> int:
    return len(subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout.split())


def test_a_driver_killed_mid_run_leaves_the_previous_output_and_no_cluster(tmp_path, demo_rows):
    output = tmp_path / "out"
    pack = [sys.executable, "-m", "tightpack.cli", "pack", str(demo_rows), "-o", str(output)]
    pack += ["--pack-size", "1024", "--no-reuse"]
    subprocess.run([*pack, "--workers", "1"], check=True, capture_output=True)
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    raylets = ray_processes()
    driver = subprocess.Popen(
        [*pack, "--overwrite", "--engine", "ray", "--workers", "2"], stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not (any(tmp_path.glob(".out.partial-*")) and ray_processes() > raylets):
        assert time.monotonic() < deadline, "the run never started its work folder and its cluster"
        time.sleep(0.05)
    time.sleep(0.5)  # the actors are starting or tokenizing
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
    for _ in range(100):  # the cluster the driver started goes with it
        if ray_processes() <= raylets:
            break
        time.sleep(0.1)
    assert ray_processes() <= raylets
    subprocess.run([*pack, "--overwrite", "--workers", "1"], check=True, capture_output=True)
    assert not any(tmp_path.glob(".out.partial-*"))  # the next run swept the killed one's folder


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="tightpack", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_pack_the_local_engines_bytes_into_a_shared_folder(tmp_path, demo_rows, two_nodes):
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    settings = {"packed_sequence_size": 1024, "reuse_store": False}
    local = pack_dataset([demo_rows], tmp_path / "local", PackConfig(workers=2, **settings))
    # Two actors of one CPU each on a cluster of two one-CPU nodes: one actor per node.
    distributed = pack_dataset(
        [demo_rows], tmp_path / "shared", PackConfig(engine="ray", workers=None, **settings)
    )
    for path in local.output.iterdir():
        if path.name != "manifest.json":
            assert path.read_bytes() == (distributed.output / path.name).read_bytes(), path.name
    assert distributed.counts == local.counts
