"""benchmarks/bench_balance.py on tiny configurations: structure and consistency, never timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """The benchmark module, with a synthetic demo distribution (tokenizing the corpus takes seconds)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_balance

    demo = np.random.default_rng(0).integers(1, 3000, size=7168)
    monkeypatch.setattr(bench_balance, "demo_runtime_lengths", lambda: demo)
    return bench_balance


TINY = dict(
    dps=[2, 4],
    pack_sizes=[1024, 2048],
    distributions=["demo", "longtail"],
    min_steps=4,
    timing_dp=4,
    timing_gbs=[16],
    timing_pack_size=1024,
    repeats=1,
)


def test_simulation_matches_real_samplers(bench):
    checks = bench.verify_simulation(seed=3)
    assert len(checks) == 18
    assert all(checks.values()), [key for key, passed in checks.items() if not passed]


def test_longtail_has_five_percent_over_half_a_pack(bench):
    lengths = bench.make_lengths("longtail", 10_000, 1000, seed=0)
    assert lengths.min() >= 1 and lengths.max() <= 1000
    assert (lengths > 500).sum() == 500


def test_report_is_consistent(bench):
    report = bench.run_benchmark(**TINY, balanced_plan=False)
    json.dumps(report)  # JSON-ready
    assert all(report["simulation_check"].values())
    assert report["contenders"] == ["baseline", "deal", "regroup"]
    assert [(run["distribution"], run["pack_size"]) for run in report["runs"]] == [
        ("demo", 1024),
        ("demo", 2048),
        ("longtail", 1024),
        ("longtail", 2048),
    ]
    overheads = {name: [] for name in report["contenders"]}
    for run in report["runs"]:
        bfd = run["plans"]["bfd"]
        assert list(run["plans"]) == ["bfd"]
        assert bfd["packs"] >= 4 * 4 * 16  # min_steps x the largest GBS
        assert 0 < bfd["fill"] <= 1 and bfd["valid"]
        assert bfd["cost_spread"]["max_over_mean"] >= 1
        assert [(row["dp"], row["gbs"]) for row in run["rows"]] == [(2, 8), (2, 32), (4, 16), (4, 64)]
        for row in run["rows"]:
            assert set(row["results"]) == set(report["contenders"])
            assert row["steps"] == bfd["packs"] // row["gbs"]
            for name, result in row["results"].items():
                assert result["steps"] == row["steps"]
                assert result["overhead"] >= 0
                overheads[name].append(
                    (result["overhead"], run["distribution"], run["pack_size"], row["gbs"])
                )
            baseline, regroup = row["results"]["baseline"]["overhead"], row["results"]["regroup"]["overhead"]
            assert row["goal"] == bench.goal(baseline, regroup)
    for name, worst in report["worst"].items():
        value, distribution, pack_size, gbs = max(overheads[name])
        assert (worst["overhead"], worst["distribution"], worst["pack_size"], worst["gbs"]) == (
            value,
            distribution,
            pack_size,
            gbs,
        )
    assert sum(report["goal_counts"].values()) == 4 * 4
    assert [(t["distribution"], t["gbs"]) for t in report["timing"]["runs"]] == [
        ("demo", 16),
        ("longtail", 16),
    ]
    for entry in report["timing"]["runs"]:
        assert set(entry["results"]) == {"baseline", "deal", "regroup"}
        assert entry["steps"] == entry["packs"] // entry["gbs"]


def test_goal_column(bench):
    assert bench.goal(0.05, 0.5) == "n.a."  # the baseline must exceed 5%
    assert bench.goal(0.06, 0.02) == "ok"
    assert bench.goal(0.06, 0.021) == "MISS"


def test_balanced_plan_rows_are_the_same_samplers_over_the_rewritten_plan(bench):
    report = bench.run_benchmark(**{**TINY, "distributions": ["longtail"], "pack_sizes": [1024]})
    assert report["contenders"] == ["baseline", "deal", "regroup", "plan+deal", "plan+regroup"]
    assert report["balanced_plan"] == "tightpack.core.balanced_plan.balance_pack_costs"
    run = report["runs"][0]
    plans = run["plans"]
    assert plans["balanced"]["cost_spread"]["cv"] <= plans["bfd"]["cost_spread"]["cv"]
    assert plans["balanced"]["valid"] and plans["bfd"]["valid"]
    for row in run["rows"]:
        assert set(row["results"]) == set(report["contenders"])
        assert "goal_balanced_plan" in row
    tables = bench.result_tables(report)
    assert set(tables) == {"regroup", "deal", "plan_regroup", "plan_spread", "timing"}
    spread = tables["plan_spread"]["rows"]
    assert [row[2] for row in spread] == ["llama-8b (balanced with it)", *bench.SCORERS]
    assert spread[0][3] == f"{plans['bfd']['packs']:,} → {plans['balanced']['packs']:,}"
    assert (
        spread[0][4]
        == f"{plans['bfd']['cost_spread']['cv']:.3f} → {plans['balanced']['cost_spread']['cv']:.3f}"
    )
    first = tables["plan_regroup"]["rows"][0]
    baseline, balanced = (
        run["rows"][0]["results"][name]["overhead"] for name in ("baseline", "plan+regroup")
    )
    assert first[3] == f"{bench.percent(baseline)} → {bench.percent(balanced)}"


def test_cli_quick_writes_json(bench, monkeypatch, tmp_path, capsys):
    out = tmp_path / "balance.json"
    monkeypatch.setattr(
        sys, "argv", ["bench_balance.py", "--quick", "--no-balanced-plan", "--json", str(out)]
    )
    bench.main()
    record = json.loads(out.read_text())
    report = record["report"]
    printed = capsys.readouterr().out
    assert "18/18 identical" in printed and "worst overhead per contender" in printed
    assert report["balanced_plan"] == "left out (--no-balanced-plan)"
    assert report["dps"] == [4, 8] and report["pack_sizes"] == [4096]
    assert report["distributions"] == ["demo", "longtail"]
    assert [(t["dp"], t["gbs"]) for t in report["timing"]["runs"]] == [(8, 32), (8, 128)] * 2
    assert record["benchmark"] == "balance" and record["size"] == "quick"
    assert "--quick" in record["command"] and record["machine"]["cores"] >= 1
    assert set(record["tables"]) == {"regroup", "deal", "timing"}  # no balanced plan: no plan tables
    scored_by = [row[2] for row in record["tables"]["regroup"]["rows"]]
    assert scored_by == ["llama-8b (balanced with it)", *bench.SCORERS] * 2
    assert "the same dealings scored by llama-1b" in printed
    assert any("predicted by tokens only" in label for label in record["figures"])


def test_the_balancing_model_scoring_itself_gives_the_overheads(bench):
    """Scored again by the model that balanced, every dealing gives its own overhead; scored by other
    models, the same dealings give other (non-negative) overheads."""
    same = bench.CostModel.named(bench.COST_MODEL)
    scorers = {"itself": same, **bench.SCORERS}
    report = bench.run_benchmark(**{**TINY, "distributions": ["longtail"]}, scorers=scorers)
    assert set(report["scorers"]) == set(scorers)
    differs = 0
    for run in report["runs"]:
        for plan in run["plans"].values():
            assert plan["cost_spread_scored"]["itself"] == plan["cost_spread"]
        for row in run["rows"]:
            for result in row["results"].values():
                assert set(result["scored"]) == set(scorers)
                assert result["scored"]["itself"] == pytest.approx(result["overhead"], rel=1e-12, abs=1e-15)
                assert all(value >= 0 for value in result["scored"].values())
                differs += result["scored"]["tokens only"] != pytest.approx(result["overhead"])
    assert differs > 0  # another model is another prediction
    worst = report["worst_scored"]["itself"]
    assert worst == pytest.approx({name: w["overhead"] for name, w in report["worst"].items()})


def test_scorers_price_attention_as_documented(bench):
    crossover = {name: model.crossover_length() for name, model in bench.SCORERS.items()}
    assert crossover["tokens only"] == float("inf")
    assert crossover[f"s² above {bench.ATTENTION_FROM:,}"] == 4096
    assert crossover["llama-1b"] < bench.CostModel.named(bench.COST_MODEL).crossover_length()
