"""A packing run over weighted inputs, end to end on real files: what the packed Parquet holds per
source, counted here from its rows, against the weights and the manifest's statistics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tightpack.core.mixture import InfeasibleMixtureError
from tightpack.core.mixture_plan import window_deviation
from tightpack.errors import TightpackError
from tightpack.offline.mixture import MixtureConfig
from tightpack.offline.pipeline import MANIFEST_NAME, PackConfig, pack_dataset
from tightpack.verify import verify_packed

from .conftest import write_jsonl

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def words(rng: np.random.Generator, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(low, high))))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    """Three inputs as unequal as real ones: chat-like rows, long prompts with short answers, short
    rows; the short ones split over two files matched by one pattern (one input)."""
    folder = tmp_path_factory.mktemp("mixture-inputs")
    rng = np.random.default_rng(0)
    write_jsonl(
        folder / "demo.jsonl",
        [{"input": words(rng, 20, 120), "output": words(rng, 20, 120)} for _ in range(120)],
    )
    write_jsonl(
        folder / "long.jsonl",
        [{"input": words(rng, 300, 900), "output": words(rng, 3, 15)} for _ in range(60)],
    )
    for part in range(2):
        rows = [{"input": words(rng, 2, 12), "output": words(rng, 3, 25)} for _ in range(200)]
        write_jsonl(folder / f"short-{part}.jsonl", rows)
    return [folder / "demo.jsonl", folder / "long.jsonl", folder / "short-*.jsonl"]


def rows_by_input(output: Path, row_starts: list[int]) -> tuple[np.ndarray, ...]:
    """Every packed sequence's pack, input (by its source row), runtime tokens, supervised tokens and
    source row, read from the Parquet files."""
    table = pq.read_table(sorted(output.glob("*.parquet")))
    pack, source, tokens, supervised, rows = [], [], [], [], []
    for number, row in enumerate(table.to_pylist()):
        bounds = [*row["seq_start_id"], len(row["input_ids"])]
        mask = np.asarray(row["loss_mask"])
        for j, sample in enumerate(row["sample_index"]):
            pack.append(number)
            rows.append(sample)
            source.append(int(np.searchsorted(row_starts, sample, side="right") - 1))
            tokens.append(row["seq_len"][j] if "seq_len" in row else bounds[j + 1] - bounds[j])
            supervised.append(int(mask[bounds[j] : bounds[j + 1]].sum()))
    return tuple(np.asarray(values) for values in (pack, source, tokens, supervised, rows))


@pytest.mark.parametrize("by", ["supervised-tokens", "tokens", "samples"])
def test_the_packed_rows_hold_the_weights_and_the_manifest_counts_them(sources, tmp_path, by):
    mixture = MixtureConfig(weights=(5, 3, 2), mix_by=by, max_repetitions=3, window_packs=4)
    result = pack_dataset(sources, tmp_path / "out", PackConfig(packed_sequence_size=1024, mixture=mixture))
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    report = manifest["mixture"]
    assert report == result.mixture
    # rows per input: 120, 60, and the two short files as one input
    assert [source["rows"] for source in report["sources"]] == [120, 60, 400]
    assert [source["name"] for source in report["sources"]] == [str(path) for path in sources]
    pack, source, tokens, supervised, rows = rows_by_input(tmp_path / "out", [0, 120, 180])
    measure = {"tokens": tokens, "supervised-tokens": supervised, "samples": np.ones_like(tokens)}[by]
    per_source = np.bincount(source, measure, minlength=3)
    shares = per_source / per_source.sum()
    largest = max(measure[source == s].max() for s in range(3))
    assert np.abs(shares - [0.5, 0.3, 0.2]).max() <= largest / per_source.sum()  # half a sample each, at most
    for s, entry in enumerate(report["sources"]):
        assert entry["share"] == pytest.approx(shares[s])
        assert entry["sequences"] == int((source == s).sum())
        assert entry["tokens"] == int(tokens[source == s].sum())
        assert entry["supervised_tokens"] == int(supervised[source == s].sum())
        assert entry["repetitions"] <= 3 + 1e-9
    assert max(entry["repetitions"] for entry in report["sources"]) == pytest.approx(
        3, rel=0.02
    )  # the tightest at the cap
    composition = np.zeros((pack.max() + 1, 3))
    np.add.at(composition, (pack, source), measure)
    assert report["windows"]["worst_points"] == pytest.approx(
        window_deviation(composition, np.array([0.5, 0.3, 0.2]), 4).points
    )
    counts = manifest["counts"]
    assert counts["packed"] == len(source) and counts["supervised_packed"] == int(supervised.sum())
    assert counts["mixture_repeats"] == len(rows) - len(set(rows.tolist()))
    assert counts["mixture_left_out"] == 580 - len(set(rows.tolist()))
    verified = verify_packed(tmp_path / "out")
    assert verified.ok, verified.to_dict()


def test_a_repeated_or_left_out_row_is_accounted_for(sources, tmp_path):
    mixture = MixtureConfig(weights=(1, 1, 1), mix_by="samples", max_repetitions=2)
    pack_dataset(sources, tmp_path / "out", PackConfig(packed_sequence_size=1024, mixture=mixture))
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    table = pq.read_table(sorted((tmp_path / "out").glob("*.parquet")))
    rows = np.concatenate([np.asarray(row) for row in table.column("sample_index").to_pylist()])
    copies = np.bincount(rows, minlength=580)
    left_out = manifest["excluded"]["mixture_left_out"]
    # samples: 60 long rows twice over (the cap), so 120 of each of the others: every demo row once,
    # 120 of the 400 short rows
    assert copies[120:180].tolist() == [2] * 60
    assert copies[:120].tolist() == [1] * 120
    assert int((copies[180:] == 1).sum()) == 120 and copies[180:].max() == 1
    assert sorted(left_out) == np.flatnonzero(copies == 0).tolist()
    assert manifest["counts"]["mixture_repeats"] == 60 and manifest["counts"]["mixture_left_out"] == 280


def test_the_same_seed_gives_the_same_bytes_and_a_reused_store_the_same_output(sources, tmp_path):
    config = PackConfig(packed_sequence_size=1024, mixture=MixtureConfig(weights=(1, 1, 1), mix_by="tokens"))
    first = pack_dataset(sources, tmp_path / "a", config)
    again = pack_dataset(sources, tmp_path / "b", config)
    assert again.reused_store  # the second run takes the cached store, with each source's rows
    files = lambda folder: {p.name: p.read_bytes() for p in folder.glob("*.parquet")}  # noqa: E731
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert first.mixture == again.mixture
    pack_dataset(
        sources, tmp_path / "c", PackConfig(packed_sequence_size=1024, seed=1, mixture=config.mixture)
    )
    assert files(tmp_path / "c") != files(tmp_path / "a")


def test_a_pack_count_is_exact_and_a_total_past_the_cap_says_what_is_possible(sources, tmp_path):
    mixture = MixtureConfig(weights=(5, 3, 2), total_packs=20)
    result = pack_dataset(sources, tmp_path / "out", PackConfig(packed_sequence_size=1024, mixture=mixture))
    assert result.stats.packs == 20
    with pytest.raises(InfeasibleMixtureError, match=r"long-prompt|times over.*max_repetitions"):
        pack_dataset(
            sources,
            tmp_path / "big",
            PackConfig(
                packed_sequence_size=1024, mixture=MixtureConfig(weights=(1, 1, 1), total_tokens=10**7)
            ),
        )
    with pytest.raises(TightpackError, match="2 weights for 3 inputs"):
        pack_dataset(
            sources,
            tmp_path / "two",
            PackConfig(packed_sequence_size=1024, mixture=MixtureConfig(weights=(1, 1))),
        )


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"engine": "ray", "workers": None}, "engine='ray'"),
        ({"balance_costs": "llama-8b"}, "balance_costs"),
        ({"algorithm": "ffd"}, "algorithm"),
    ],
)
def test_settings_a_mixture_would_ignore_are_refused(setting, named):
    config = PackConfig(packed_sequence_size=1024, mixture=MixtureConfig(weights=(1, 1)), **setting)
    with pytest.raises(TightpackError, match=f"cannot take {named}"):
        config.validate()


def test_the_command_line_mixes_reports_and_refuses_with_one_line(sources, tmp_path, capsys, monkeypatch):
    """``tightpack`` in this process (`tightpack.cli.main`, the console script's entry): the summary's
    mixture, inspect's table and plot, and one line on stderr with exit 2 for each user error."""
    from tightpack.cli import main

    monkeypatch.chdir(tmp_path)

    def tightpack(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(arg) for arg in args])
        out, err = capsys.readouterr()
        return code, out, err

    inputs = [str(path) for path in sources]
    mix = [
        "--weights",
        "5,3,2",
        "--mix-by",
        "supervised-tokens",
        "--max-repetitions",
        "3",
        "--mix-window",
        "4",
    ]
    code, out, err = tightpack("pack", *inputs, "-o", "out", "--pack-size", "1024", *mix)
    assert code == 0, err
    assert "mixture by supervised-tokens (target -> achieved; repetitions):" in out
    assert "worst window of 4 packs" in out
    assert re.search(r"of which repeats \(mixture\)\W+[\d,]+", out) and re.search(
        r"left out by the mixture\W+\d", out
    )
    code, out, err = tightpack("inspect", "out", "--plot", "plot.png")
    assert code == 0, err
    assert "mixture by supervised-tokens: worst window of 4 packs" in " ".join(out.split())
    assert (tmp_path / "plot.mixture.png").stat().st_size > 10_000
    for args, message in (
        (("--weights", "5,3"), "error: the mixture has 2 weights for 3 inputs"),
        (("--weights", "5,x,2"), "error: --weights '5,x,2': give one number per input"),
        (("--weights", "5,0,2"), "error: the weight of input 2 is 0: give a positive number"),
        (("--weights", "1,1,1", "--mix-tokens", "1B"), "error: the mixture of 1,000,000,000 tokens needs"),
        (("--mix-by", "samples"), "error: --mix-by sets the mixture of --weights"),
        (("--weights", "1,1,1", "--mix-tokens", "lots"), "error: --mix-tokens 'lots'"),
        (("--mix-window", "3"), "error: --mix-window sets the mixture of --weights"),
        (("--weights", "1,1,1", "--mix-tokens", "1,000,000,000"), "error: the mixture of 1,000,000,000"),
    ):
        code, out, err = tightpack("pack", *inputs, "-o", "bad", "--pack-size", "1024", *args)
        assert code == 2, (args, out, err)
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
