"""benchmarks/bench_mixture.py on small sources: structure and consistency, never timings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_mixture

    return bench_mixture


def synthetic(bench, seed: int = 0):
    """Three sources as unequal as the benchmark's (tokenizing the corpus takes a minute): chat samples
    of any length with many supervised tokens, long prompts with few, short turns with few."""
    rng = np.random.default_rng(seed)
    chat = np.clip(rng.lognormal(np.log(300), 1.2, 600), 8, 6000).astype(np.int64)
    long = rng.integers(1000, 7900, 80)
    short = rng.integers(20, 200, 600)
    real = np.concatenate([chat, long, short])
    supervised = np.concatenate(
        [(chat * rng.uniform(0.2, 0.8, len(chat))).astype(np.int64), rng.integers(10, 120, len(long)),
         rng.integers(5, 60, len(short))]
    )  # fmt: skip
    supervised[0] = 0  # a conversation with no assistant turn: never packed
    source = np.repeat([0, 1, 2], [len(chat), len(long), len(short)])
    return bench.Sources(real, np.maximum(supervised, 0), np.where(supervised > 0, source, -1))


def arguments(**extra) -> argparse.Namespace:
    return argparse.Namespace(
        pack_sizes=[4096, 8192], total_tokens=1_500_000, max_repetitions=50.0, repeats=1, seed=0, **extra
    )


def test_megatron_index_keeps_every_prefix_within_one_sample_of_the_weights(bench):
    weights = [0.5, 0.3, 0.2]
    which, nth = bench.megatron_blend_index(weights, 5000)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[which], axis=0)  # [i, dataset]: taken up to sample i
    expected = np.outer(np.arange(1, 5001), weights)
    assert np.abs(counts - expected).max() <= 1.0
    for d in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert nth[which == d].tolist() == list(range(int((which == d).sum())))
    again, _ = bench.megatron_blend_index([5, 3, 2], 5000)  # unnormalised weights, no seed: the same
    assert np.array_equal(which, again)


def test_every_batch_counted_alike_with_window_deviation(bench):
    """The bench's batches are window_deviation's; its windows from any first pack include them."""
    from tightpack.core.mixture_plan import window_deviation

    composition = np.random.default_rng(1).integers(0, 50, (300, 3)).astype(float)
    composition[5:9] = 0  # batches with nothing of the measure are left out by both
    targets = np.array([0.5, 0.3, 0.2])
    for window in (1, 8, 64, 1000):
        every = bench.batch_points(composition, targets, window)
        assert len(every) == (300 // min(window, 300)) - (4 if window == 1 else 0)
        assert every.max() == pytest.approx(window_deviation(composition, targets, window).points)
        assert bench.sliding_points(composition, targets, window) >= every.max()


def test_every_method_measures_the_same_data(bench):
    data = synthetic(bench)
    configs = bench.run_benchmark(data, arguments())
    assert [c["pack_size"] for c in configs] == [4096, 8192]
    for config in configs:
        methods = config["methods"]
        assert list(methods) == list(bench.METHODS)
        mine = methods[bench.TIGHTPACK]
        assert mine["whole_points"] < 1.0  # supervised-token shares near 50/30/20
        assert methods[bench.MEGATRON_FOLDERS]["packs"] == mine["packs"]  # as many packs
        samples = config["fill"]["samples"]
        for name in (bench.MEGATRON_ROWS, bench.ENERGON):  # as many samples, weighted by samples
            shares = np.asarray(methods[name]["shares"]["samples"])
            assert np.abs(shares - [0.5, 0.3, 0.2]).max() < (
                1.5 / samples if name == bench.MEGATRON_ROWS else 0.05
            )
            assert methods[name]["whole_points"] > 10  # supervised shares far from the targets
        for method in methods.values():
            assert 0 < method["fill"] <= 1
            assert abs(sum(method["shares"]["supervised"]) - 1) < 1e-9
            for figures in method["windows"].values():
                assert figures["median_points"] <= figures["p90_points"] <= figures["points"] + 1e-9
                assert 0 <= figures["within_goal"] <= 1
            # a 64-pack window's shares average those of its 8-pack windows: never further off
            assert method["windows"]["8"]["points"] >= method["windows"]["64"]["points"] - 1e-9
        fill = config["fill"]
        assert fill["floor_volume"] <= fill["floor_l2"] <= min(fill["packs"], fill["packs_unmixed"])
        left_out = config["left_out_longer_than_pack"]
        assert left_out == [0, 0, 0] if config["pack_size"] == 8192 else left_out[1] > 0
        assert len(config["goals"]) == 7 and all(isinstance(g["passed"], bool) for g in config["goals"])
    json.dumps(bench.tables(configs, bench.describe(data)))
    json.dumps(bench.headline(configs))


def test_main_writes_its_result(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "build_sources", lambda args: (synthetic(bench), {"rows": [], "seconds": 0.0}))
    result = tmp_path / "mixture.json"
    argv = ["bench_mixture.py", "--pack-sizes", "8192", "--total-tokens", "1000000", "--result", str(result)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    record = json.loads(result.read_text())
    assert record["benchmark"] == "mixture" and record["size"] == "quick"
    assert record["command"] == "python benchmarks/bench_mixture.py --pack-sizes 8192 --total-tokens 1000000"
    assert set(record["tables"]) == {
        "shares",
        "windows",
        "other_measures",
        "fill_time",
        "selection",
        "sources",
        "goals",
    }
    assert len(record["tables"]["shares"]["rows"]) == len(bench.METHODS)
    assert record["figures"]["goals met"].endswith("of 7")


def test_encoding_counts_runtime_and_supervised_tokens(bench):
    from tightpack.prepare.tokenizer import load_tokenizer

    spec = load_tokenizer(None)
    rows = [
        {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]},
        {"messages": [{"role": "user", "content": "Only a question"}]},
    ]
    real, supervised = bench.encode(spec, rows)
    assert real.tolist()[0] > supervised.tolist()[0] > 0 and supervised.tolist()[1] == 0
    turns = bench.single_turns([{"messages": [*rows[0]["messages"], {"role": "user", "content": "More"}]}])
    assert turns == [rows[0]]
