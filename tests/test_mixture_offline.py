"""A packing run over weighted inputs, end to end on real files: what the packed Parquet holds per
source, counted here from its rows, against the weights and the manifest's statistics."""

from __future__ import annotations

import json
import re
import shutil
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
from .test_verify import rewrite

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
    assert "algorithm" not in manifest["settings"]  # the mixture's own order made the packs, not bfd
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


def test_a_pack_count_of_full_packs_is_met_not_one_short(tmp_path):
    """Every sample cut to the pack (so every pack is one sample, full): the quotas round down by up
    to half a sample per source, and asking for just the packs' tokens left the count a pack short
    (7, 17, 31 of these); the run asks for a pack and a sample per source more, then cuts."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = np.random.default_rng(1)
    paths = []
    for name, prompt, answer in (("a", 100, 300), ("b", 200, 300), ("c", 50, 400)):
        rows = [
            {"input": " ".join(rng.choice(words, prompt)), "output": " ".join(rng.choice(words, answer))}
            for _ in range(60)
        ]
        paths.append(write_jsonl(tmp_path / f"{name}.jsonl", rows))
    for packs in (7, 17, 31):
        mixture = MixtureConfig(
            weights=(5, 3, 2), mix_by="supervised-tokens", max_repetitions=5, total_packs=packs
        )
        result = pack_dataset(
            paths, tmp_path / f"out{packs}", PackConfig(packed_sequence_size=256, mixture=mixture)
        )
        assert result.stats.packs == packs
        assert result.counts["truncated"] == 180


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
    assert "worst global batch of 4 packs" in out
    assert re.search(r"of which repeats \(mixture\)\W+[\d,]+", out) and re.search(
        r"left out by the mixture\W+\d", out
    )
    code, out, err = tightpack("inspect", "out", "--plot", "plot.png")
    assert code == 0, err
    assert "mixture by supervised-tokens: worst global batch of 4 packs" in " ".join(out.split())
    assert (tmp_path / "plot.mixture.png").stat().st_size > 10_000
    code, out, err = tightpack("verify", "out")
    assert code == 0 and "3 mixture sources" in out, out + err
    shutil.copytree(tmp_path / "out", tmp_path / "edited")
    manifest = json.loads((tmp_path / "edited" / MANIFEST_NAME).read_text())
    manifest["mixture"]["sources"][2]["supervised_tokens"] += 10
    (tmp_path / "edited" / MANIFEST_NAME).write_text(json.dumps(manifest))
    code, out, err = tightpack("verify", "edited")
    assert code == 1, out + err
    named = r"^\[mixture\] mixture\.sources\[2\] \(\S+\): supervised_tokens is \d+ in the manifest"
    assert re.search(named, out, re.M), out
    for args, message in (
        (("--weights", "5,3"), "error: the mixture has 2 weights for 3 inputs"),
        (("--weights", "5,x,2"), "error: --weights '5,x,2': give one number per input"),
        (("--weights", "5,0,2"), "error: the weight of input 2 is 0: give a positive number"),
        (("--weights", "1,1,1", "--mix-tokens", "1B"), "error: the mixture of 1,000,000,000 tokens needs"),
        (("--mix-by", "samples"), "error: --mix-by sets the mixture of --weights"),
        (("--weights", "1,1,1", "--mix-tokens", "lots"), "error: --mix-tokens 'lots'"),
        (("--mix-window", "3"), "error: --mix-window sets the mixture of --weights"),
        (("--weights", "1,1,1", "--mix-tokens", "1,000,000,000"), "error: the mixture of 1,000,000,000"),
        # the default algorithm named outright is refused as any other: the mixture would not use it
        (
            ("--weights", "1,1,1", "--algorithm", "bfd"),
            "error: a mixture (--weights) cannot take --algorithm:",
        ),
        (
            ("--weights", "1,1,1", "--algorithm", "ffd"),
            "error: a mixture (--weights) cannot take --algorithm:",
        ),
    ):
        code, out, err = tightpack("pack", *inputs, "-o", "bad", "--pack-size", "1024", *args)
        assert code == 2, (args, out, err)
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_the_summary_counts_truncation_before_the_mixture_and_among_its_packs(
    sources, tmp_path, capsys, monkeypatch
):
    """A mixture truncates every sample before it chooses some: the summary lists those apart, and
    under ``packed`` only the sequences the mixture packed from truncated samples (the manifest's
    per-source ``truncated_packed``, every copy), recounted from the packs."""
    from tightpack.cli import main

    from .test_cli import summary_value

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    args = [
        "pack",
        *map(str, sources[:2]),
        "-o",
        "out",
        "--pack-size",
        "256",
        "--weights",
        "1,3",
        "--mix-packs",
        "100",
        "--max-repetitions",
        "3",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    packed_truncated = sum(source["truncated_packed"] for source in manifest["mixture"]["sources"])
    read = summary_value(out, "truncated (before the mixture chose)")
    assert read == f"{manifest['counts']['truncated']:,}"
    assert summary_value(out, "  of which truncated") == f"{packed_truncated:,}"
    assert 0 < packed_truncated < manifest["counts"]["truncated"]  # the long rows left out were cut too
    cut = set(manifest["excluded"]["truncated"])
    rows = np.concatenate(
        [
            np.asarray(r)
            for r in pq.read_table(sorted((tmp_path / "out").glob("*.parquet")))["sample_index"].to_pylist()
        ]
    )
    assert packed_truncated == sum(row in cut for row in rows.tolist())
    assert packed_truncated > len(cut & set(rows.tolist()))  # copies of truncated samples count each


def test_inspect_draws_the_batches_a_run_reads_and_its_html_holds_the_mixture_table(
    sources, tmp_path, capsys, monkeypatch
):
    """18 packs in global batches of 4: four full batches and a last one of 2 packs. The plot's steps
    are the shares of each batch counted here from the Parquet rows, the last one drawn as partial
    across its 2 packs (its deviation, counted here, in its label); the manifest's worst batch is the
    worst full one counted here; the HTML report holds the table ``inspect`` prints, its figures those
    of the rows."""
    from tightpack.cli import main
    from tightpack.reports.mixture import mixture_figure, mixture_table, mixture_title

    from .test_plots import Page

    monkeypatch.chdir(tmp_path)
    inputs = [str(path) for path in sources]
    mix = ["--weights", "5,3,2", "--mix-by", "tokens", "--max-repetitions", "3", "--mix-packs", "18"]
    assert main(["pack", *inputs, "-o", "out", "--pack-size", "1024", *mix, "--mix-window", "4"]) == 0
    capsys.readouterr()
    assert main(["inspect", "out", "--html", "report.html", "--plot", "plot.png"]) == 0
    out = capsys.readouterr().out
    mixture = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["mixture"]

    pack, source, tokens, supervised, _ = rows_by_input(tmp_path / "out", [0, 120, 180])
    assert pack.max() + 1 == 18
    composition = np.zeros((18, 3))
    np.add.at(composition, (pack, source), tokens)
    edges = [0, 4, 8, 12, 16, 18]
    windows = np.add.reduceat(composition, edges[:-1], axis=0)
    shares = windows / windows.sum(axis=1, keepdims=True)

    axes = mixture_figure(mixture, packs=18).axes[0]
    lines = {line.get_label(): line for line in axes.lines}
    for s, entry in enumerate(mixture["sources"]):
        full, partial = lines[entry["name"]], lines[f"{entry['name']}, partial last batch"]
        np.testing.assert_array_equal(full.get_xdata(), edges[:-1])
        np.testing.assert_allclose(full.get_ydata(), [*shares[:4, s], shares[3, s]], atol=1e-6)
        np.testing.assert_array_equal(partial.get_xdata(), [16, 18])
        np.testing.assert_allclose(partial.get_ydata(), [shares[4, s]] * 2, atol=1e-6)
    off = 100 * np.abs(shares - [0.5, 0.3, 0.2]).max(axis=1)
    assert mixture["windows"]["worst_points"] == pytest.approx(off[:4].max())
    assert mixture["windows"]["worst_first_pack"] == 4 * int(np.argmax(off[:4]))
    assert mixture["windows"]["last_batch_packs"] == 2
    partial_label = f"partial last batch: 2 of 4 packs (dotted), {off[4]:.2f} points off"
    assert partial_label in [patch.get_label() for patch in axes.patches]
    assert (tmp_path / "plot.mixture.png").stat().st_size > 10_000

    page = Page((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert page.captions == [mixture_title(mixture)]
    assert f"last batch (2 of 4 packs) {off[4]:.2f} points off" in mixture_title(mixture)
    names = ["demo.jsonl", "long.jsonl", "short-*.jsonl"]  # the inputs' file names, not their folders
    start = page.rows.index(["source", *names])
    table = {row[0]: row[1:] for row in page.rows[start:]}
    assert page.rows[start:] == [list(row) for row in mixture_table(mixture)]
    assert table["tokens"] == [f"{int(tokens[source == s].sum()):,}" for s in range(3)]
    assert table["supervised tokens"] == [f"{int(supervised[source == s].sum()):,}" for s in range(3)]
    assert table["sequences written"] == [f"{int((source == s).sum()):,}" for s in range(3)]
    achieved = np.bincount(source, tokens, minlength=3) / tokens.sum()
    assert table["achieved share"] == [f"{share:.2%}" for share in achieved]
    assert table["target share"] == ["50.00%", "30.00%", "20.00%"]
    assert table["rows"] == ["120", "60", "400"]
    for name, *cells in mixture_table(mixture)[1:]:  # the printed table (wrapped to the terminal)
        assert all(f" {cell} " in out for cell in cells), (name, cells)


@pytest.fixture(scope="module")
def mixed(sources, tmp_path_factory) -> Path:
    """A mixture's output: supervised tokens 5:3:2, at most 3 times over, windows of 4 packs. The long
    rows, the tightest source, are packed whole three times (every kept sample packed, so their
    ``repetitions`` is the packs' to count); the other two are subsampled."""
    folder = tmp_path_factory.mktemp("mixed") / "out"
    mixture = MixtureConfig(weights=(5, 3, 2), mix_by="supervised-tokens", max_repetitions=3, window_packs=4)
    pack_dataset(sources, folder, PackConfig(packed_sequence_size=1024, mixture=mixture))
    return folder


def tampered(mixed: Path, tmp_path: Path, change) -> Path:
    """A copy of ``mixed`` whose manifest is ``change(manifest)``d."""
    folder = tmp_path / "tampered"
    shutil.copytree(mixed, folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    change(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder


def test_verify_counts_every_mixture_figure_again(mixed):
    manifest = json.loads((mixed / MANIFEST_NAME).read_text())
    long, demo = manifest["mixture"]["sources"][1], manifest["mixture"]["sources"][0]
    assert long["samples_packed"] == long["samples"] and long["repetitions"] == pytest.approx(3)
    assert demo["samples_packed"] < demo["samples"]  # subsampled: repetitions only bounded by the packs
    report = verify_packed(mixed)
    assert report.ok, [str(v) for v in report.violations]
    assert report.checked["mixture_sources"] == 3


def shown(value) -> str:
    return f"{value:.10g}" if isinstance(value, float) else str(value)


EXACT = "the packs give {wrote}"


SOURCE_CHANGES = [
    (1, "supervised_tokens", lambda v: v + 1, EXACT),
    (2, "tokens", lambda v: v - 7, EXACT),
    (0, "sequences", lambda v: v + 1, EXACT),
    (2, "samples_packed", lambda v: v - 1, EXACT),
    (0, "share", lambda v: v + 0.01, EXACT),
    (1, "token_share", lambda v: v / 2, EXACT),
    (2, "supervised_share", lambda v: v + 1e-6, EXACT),
    (1, "worst_window_points", lambda v: v + 1, EXACT),
    (0, "target_share", lambda v: 0.6, "the weights give {wrote}"),
    # every kept long row packed: counted exactly; the demo rows subsampled: bounded by the packs
    (1, "repetitions", lambda v: 2.5, "the packs (every kept sample packed) give {wrote}"),
    (0, "repetitions", lambda v: 1.5, "above the 1 its packs allow"),
    (0, "samples", lambda v: 3, "fewer than the {packed} distinct samples of it the packs hold"),
]
"""(source, field, its new value, what verify counts instead): one change of the manifest each."""


@pytest.mark.parametrize(
    ("s", "key", "value", "counted"),
    SOURCE_CHANGES,
    ids=[f"{key}-{s}" for s, key, *_ in SOURCE_CHANGES],
)
def test_a_changed_figure_of_a_source_fails_naming_source_field_and_both_values(
    mixed, tmp_path, s, key, value, counted
):
    source = json.loads((mixed / MANIFEST_NAME).read_text())["mixture"]["sources"][s]
    wrote = source[key]

    def change(manifest):
        manifest["mixture"]["sources"][s][key] = value(wrote)

    report = verify_packed(tampered(mixed, tmp_path, change))
    assert report.counts == {"mixture": 1}, [str(v) for v in report.violations]
    expected = counted.format(wrote=shown(wrote), packed=source["samples_packed"])
    assert report.violations[0].message.startswith(
        f"mixture.sources[{s}] ({source['name']}): {key} is {shown(value(wrote))} in the manifest, {expected}"
    ), report.violations[0].message


def test_changed_windows_shares_and_counts_fail_naming_the_field(mixed, tmp_path):
    manifest = json.loads((mixed / MANIFEST_NAME).read_text())
    worst = manifest["mixture"]["windows"]["worst_points"]

    def worst_points(m):
        m["mixture"]["windows"]["worst_points"] = worst / 2

    def window_share(m):
        m["mixture"]["window_shares"][2][0] += 0.05

    def repeats(m):
        m["counts"]["mixture_repeats"] += 1

    def rows(m):
        m["mixture"]["sources"][0]["rows"] += 1

    def window_setting(m):  # the run's settings changed alike: only the count of the windows tells
        m["mixture"]["window_packs"] *= 2
        m["settings"]["mixture"]["window_packs"] *= 2

    def tolerance(m):
        m["mixture"]["tolerance_points"] = m["settings"]["mixture"]["tolerance"] = worst / 2

    def text_tolerance(m):
        m["mixture"]["tolerance_points"] = m["settings"]["mixture"]["tolerance"] = "2"

    def cap(m):  # below the long rows' three repetitions, above two copies (the coverage check's bound)
        m["mixture"]["max_repetitions"] = m["settings"]["mixture"]["max_repetitions"] = 2.5

    def setting(m):
        m["settings"]["mixture"]["mix_by"] = "tokens"

    def weights(m):
        m["settings"]["mixture"]["weights"][0] = 4

    def samples(m):
        m["mixture"]["sources"][2]["samples"] = m["mixture"]["sources"][2]["rows"] + 1

    window = manifest["mixture"]["windows"]["window_packs"]
    long, third = manifest["mixture"]["sources"][1], manifest["mixture"]["sources"][2]
    for change, message in (
        (
            window_setting,
            f"mixture.window_packs is {2 * window} in the manifest but its windows count batches of ",
        ),
        (
            tolerance,
            f"mixture.tolerance_points is {worst / 2:g} in the manifest, but the packs in order hold a ",
        ),
        (
            samples,
            f"mixture.sources[2] ({third['name']}): samples is {third['rows'] + 1} in the manifest, "
            "more than ",
        ),
        (text_tolerance, "mixture.tolerance_points is '2' in the manifest, not a number of points"),
        (
            cap,
            f"mixture.sources[1] ({long['name']}): repetitions is {long['repetitions']:.10g}, past the "
            "max_repetitions of 2.5 in the manifest",
        ),
        (
            setting,
            "the mixture section disagrees with the run's settings in the manifest: mixture.mix_by is "
            "'supervised-tokens', settings.mixture.mix_by 'tokens' ",
        ),
        (
            weights,
            "the mixture section disagrees with the run's settings in the manifest: the weights of "
            "mixture.sources are [5, 3, 2], settings.mixture.weights [4, 3, 2] ",
        ),
        (
            worst_points,
            f"mixture.windows.worst_points is {worst / 2:.10g} in the manifest, the packs in order give "
            f"{worst:.10g}",
        ),
        (window_share, "mixture.window_shares[2] (the first of 1 windows that differ) is ["),
        (repeats, f"counts.mixture_repeats is {manifest['counts']['mixture_repeats'] + 1} in the manifest"),
        (rows, "the rows of mixture.sources add up to 581, counts.samples_in is 580"),
    ):
        folder = tampered(mixed, tmp_path / change.__name__, change)
        report = verify_packed(folder)
        assert report.counts == {"mixture": 1}, [str(v) for v in report.violations]
        assert report.violations[0].message.startswith(message), report.violations[0].message


MALFORMED = [
    ("cap-text", lambda m: m["mixture"].update(max_repetitions="4"), "mixture.max_repetitions is '4' in the"),
    (
        "cap-missing",
        lambda m: m["mixture"].update(max_repetitions=None),
        "mixture.max_repetitions is missing",
    ),
    ("cap-zero", lambda m: m["mixture"].update(max_repetitions=0), "mixture.max_repetitions is 0 in the"),
    ("windows-list", lambda m: m["mixture"].update(windows=[]), "mixture.windows is [] in the manifest, not"),
    ("source-null", lambda m: m["mixture"]["sources"].__setitem__(0, None), "mixture.sources[0] is missing"),
    ("samples-text", lambda m: m["mixture"]["sources"][0].update(samples="300"), "samples is '300' in the"),
    ("section-gone", lambda m: m.pop("mixture"), "the manifest has no mixture section, but its settings"),
    (  # text that reads as the right number is still not what a run writes
        "share-text",
        lambda m: m["mixture"]["window_shares"][0].__setitem__(0, str(m["mixture"]["window_shares"][0][0])),
        "mixture.window_shares holds no table of shares in the manifest",
    ),
    ("section-list", lambda m: m.update(mixture=[]), "the manifest has no mixture section, but its settings"),
]
"""(name, an edit of the manifest no run writes, the start of what verify says): one each."""


@pytest.mark.parametrize(("name", "change", "message"), MALFORMED, ids=[name for name, *_ in MALFORMED])
def test_a_malformed_mixture_section_is_named_not_a_traceback(mixed, tmp_path, name, change, message):
    """Values of the wrong type, or the section gone while the settings say a mixture run wrote it:
    a line of the mixture check naming the field (and no flood of coverage faults: the copies a sample
    may have come from the settings when the section is gone), never an exception."""
    report = verify_packed(tampered(mixed, tmp_path, change))
    faults = [v.message for v in report.violations if v.check == "mixture"]
    assert any(message in fault for fault in faults), [str(v) for v in report.violations]
    assert set(report.counts) == {"mixture"}, [str(v) for v in report.violations]


def test_a_deleted_count_of_the_rows_left_out_is_named(mixed, tmp_path):
    """The count beside a list of excluded rows, deleted while the list stays: named, with the list's
    length (a count edited to another number was caught already)."""
    report = verify_packed(tampered(mixed, tmp_path, lambda m: m["counts"].pop("mixture_left_out")))
    assert set(report.counts) == {"excluded"}, [str(v) for v in report.violations]
    assert report.violations[0].message.startswith(
        "counts.mixture_left_out is missing, excluded.mixture_left_out lists "
    ), report.violations[0].message


def test_an_unreadable_manifest_or_a_deleted_excluded_section_is_one_line_not_a_flood(mixed, tmp_path):
    """A mixture's packs repeat samples up to its cap and leave rows out. With the manifest truncated
    (unreadable: the cap unknown) repeats are not counted as faults; with its excluded section deleted
    the rows it listed are one line, not one line each."""
    truncated = tmp_path / "truncated"
    shutil.copytree(mixed, truncated)
    text = (truncated / MANIFEST_NAME).read_text()
    (truncated / MANIFEST_NAME).write_text(text[: len(text) // 2])
    report = verify_packed(truncated)
    assert [v.check for v in report.violations] == ["manifest"], [str(v) for v in report.violations]

    report = verify_packed(tampered(mixed, tmp_path / "no-excluded", lambda m: m.pop("excluded")))
    coverage = [v.message for v in report.violations if v.check == "coverage"]
    assert len(coverage) == 1 and "the manifest has no excluded section" in coverage[0], coverage


INSPECT_MALFORMED = [
    (lambda m: m.update(mixture=5), "mixture is 5, not a section"),
    (lambda m: m["mixture"].update(windows="x"), "mixture.windows is 'x', not a table"),
    (lambda m: m["mixture"].update(sources=5), "mixture.sources is 5, not a list"),
    (lambda m: m["mixture"]["sources"][0].update(share="x"), "mixture.sources[0].share is 'x'"),
    (lambda m: m["mixture"]["windows"].update(worst_points=None), "mixture.windows.worst_points is None"),
    (lambda m: m["mixture"]["window_shares"].append([1]), "mixture.window_shares is not a list of 3"),
    (lambda m: m["mixture"].update(mix_by="bogus"), "mixture.mix_by is 'bogus', not one of tokens"),
    (lambda m: m["mixture"]["windows"].update(worst_source=99), "mixture.windows.worst_source is 99"),
    (lambda m: m["mixture"]["windows"].update(worst_first_pack=10**9), "mixture.windows.worst_first_pack is"),
    (lambda m: m["mixture"]["windows"].update(last_batch_packs=5000), "mixture.windows.last_batch_packs is"),
    (lambda m: m["mixture"]["window_shares"].pop(), "mixture.window_shares has"),  # one batch fewer
]


@pytest.mark.parametrize(("change", "message"), INSPECT_MALFORMED, ids=[m for _, m in INSPECT_MALFORMED])
def test_inspect_shows_the_rest_of_a_malformed_mixture_section_and_names_the_field(
    mixed, tmp_path, capsys, change, message
):
    """``tightpack inspect`` (and its plot) on a manifest whose mixture section no run writes: the
    summary, one warning line naming the field, no traceback, no mixture table or plot."""
    from tightpack.cli import main

    folder = tampered(mixed, tmp_path, change)
    capsys.readouterr()
    code = main(["inspect", str(folder), "--plot", str(tmp_path / "plot.png")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "packed dataset" in out and "source" not in out.split("packed dataset", 1)[1].split("\n", 2)[0]
    assert err.startswith("warning: the manifest's mixture section is not shown: " + message), err
    assert (tmp_path / "plot.png").is_file() and not (tmp_path / "plot.mixture.png").exists()


def test_inspect_labels_the_sources_by_their_file_names():
    from tightpack.reports.mixture import source_labels

    names = ["/runs/x/data/train.jsonl", "/runs/y/data/train.jsonl", "/runs/x/long.jsonl", "short-*.jsonl"]
    assert source_labels(names) == ["x/data/train.jsonl", "y/data/train.jsonl", "long.jsonl", "short-*.jsonl"]


def test_changed_packs_fail_on_the_figures_they_change(mixed, tmp_path):
    """Packs rewritten with the manifest's checksums refreshed (as a buggy writer would leave them): the
    same sequences in another order break the windows; two sequences' sources swapped, the tokens."""
    reordered = tmp_path / "reordered"
    shutil.copytree(mixed, reordered)
    rewrite(reordered, lambda columns: [columns[name].reverse() for name in columns])
    report = verify_packed(reordered)
    assert set(report.counts) == {"mixture"}, [str(v) for v in report.violations]
    assert any(v.message.startswith("mixture.window_shares[0]") for v in report.violations)

    swapped = tmp_path / "swapped"
    shutil.copytree(mixed, swapped)

    def swap(columns):
        """A long row's sample_index with a short row's (the same samples, other sources): the first
        pair whose sequences differ in tokens and in supervised tokens, so both sources' counts move."""
        found = {"long": [], "short": []}
        for row, indices in enumerate(columns["sample_index"]):
            starts = [*columns["seq_start_id"][row], len(columns["input_ids"][row])]
            for j, index in enumerate(indices):
                mask = columns["loss_mask"][row][starts[j] : starts[j + 1]]
                kind = "long" if 120 <= index < 180 else "short" if index >= 180 else "demo"
                found.setdefault(kind, []).append((row, j, starts[j + 1] - starts[j], sum(mask)))
        (a, i, *_), (b, j, *_) = next(
            (long, short)
            for long in found["long"]
            for short in found["short"]
            if long[2] != short[2] and long[3] != short[3]
        )
        index = columns["sample_index"]
        index[a][i], index[b][j] = index[b][j], index[a][i]

    rewrite(swapped, swap)
    report = verify_packed(swapped)
    assert set(report.counts) == {"mixture"}, [str(v) for v in report.violations]
    messages = " ".join(v.message for v in report.violations)
    for field in (
        "mixture.sources[1] (",
        ": tokens is ",
        ": supervised_tokens is ",
        "in the manifest, the packs give",
    ):
        assert field in messages, messages


def test_a_pack_count_keeps_whole_passes_first_and_reaches_the_default_runs_count(sources, tmp_path):
    """--mix-packs meets the count by the mixture's total, not by cutting packs off a larger one: a
    source repeated keeps every sample once before any twice (a cut left some out while others were
    twice), and the count the default run fills (the largest the cap allows) can be asked for; one
    more is an error naming that count."""
    config = lambda **mix: PackConfig(  # noqa: E731
        packed_sequence_size=1024,
        mixture=MixtureConfig(weights=(1, 1, 1), mix_by="supervised-tokens", max_repetitions=4, **mix),
    )
    largest = pack_dataset(sources, tmp_path / "largest", config()).stats.packs
    for packs in (1, 2, largest // 3, largest // 2, largest * 2 // 3, largest * 3 // 4, largest - 1, largest):
        result = pack_dataset(sources, tmp_path / f"p{packs}", config(total_packs=packs))
        assert result.stats.packs == packs
        table = pq.read_table(sorted((tmp_path / f"p{packs}").glob("*.parquet")))
        rows = np.concatenate([np.asarray(row) for row in table.column("sample_index").to_pylist()])
        copies = np.bincount(rows, minlength=580)
        for first, stop in ((0, 120), (120, 180), (180, 580)):  # each input's rows
            mine = copies[first:stop]
            if mine.max() > 1:  # repeated: whole passes first
                assert mine.max() - mine.min() <= 1, (packs, first, np.bincount(mine).tolist())
    with pytest.raises(
        InfeasibleMixtureError, match=rf"fills {largest:,} packs, fewer than the {largest + 1:,}"
    ):
        pack_dataset(sources, tmp_path / "more", config(total_packs=largest + 1))


def test_the_command_line_names_a_closest_mixture_that_packs_given_back(
    sources, tmp_path, capsys, monkeypatch
):
    """A total past the cap, from ``tightpack pack``: past what the inputs hold at the cap, no mixture
    is named; short of it, the closest mixture named, given back as --weights with the same
    --mix-tokens, packs; the largest total printed packs as printed (thousands separators and all)."""
    from tightpack.cli import main

    monkeypatch.chdir(tmp_path)

    def pack(output: str, weights: str, total: str) -> tuple[int, str, str]:
        capsys.readouterr()
        args = [*map(str, sources), "-o", output, "--pack-size", "1024", "--mix-by", "supervised-tokens"]
        code = main(["pack", *args, "--weights", weights, "--mix-tokens", total])
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = pack("none", "5,3,2", "1B")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    found = re.search(
        r"no mixture of 1,000,000,000 tokens exists at this cap \(the inputs hold ([\d,]+) tokens at the "
        r"cap\)\. Ask for a total of at most \1 tokens in --mix-tokens \(at most about ([\d,]+) tokens with "
        r"these --weights\), or allow this one with --max-repetitions [\d.]+$",
        err.strip(),
    )
    assert found and "closest" not in err, err
    held, largest = (int(number.replace(",", "")) for number in found.groups())
    assert largest < held
    code, _, err = pack("largest", "5,3,2", found[2])
    assert code == 0, err
    code, _, err = pack("past", "5,3,2", str(largest + 1))
    assert code == 2 and "1.00 times over" not in err and "past the repetition cap of 1" in err, err
    total = (largest + held) // 2
    code, _, err = pack("mid", "5,3,2", str(total))
    assert code == 2 and "no mixture" not in err, err
    named = re.search(rf"the closest mixture of {total:,} tokens is (.*) of the supervised tokens", err)
    assert named and err.strip().endswith("(give these as --weights)"), err
    shares = [part.rsplit(" ", 1)[1].rstrip("%") for part in named[1].split(", ")]
    assert len(shares) == 3 and shares != ["50.0", "30.0", "20.0"]
    code, out, err = pack("closest", ",".join(shares), str(total))
    assert code == 0, err
    printed = " ".join(out.split())  # the summary wraps at the terminal's width
    assert all(f"{float(share):.2f}% -> " in printed for share in shares), out
    manifest = json.loads((tmp_path / "closest" / MANIFEST_NAME).read_text())
    packed = sum(source["tokens"] for source in manifest["mixture"]["sources"])
    assert abs(packed - total) <= 3 * 1024, (packed, total)
    assert max(source["repetitions"] for source in manifest["mixture"]["sources"]) <= 1


def test_verify_checks_the_rows_the_mixture_left_out_against_the_packs_and_counts(mixed, tmp_path):
    manifest = json.loads((mixed / MANIFEST_NAME).read_text())
    left_out = manifest["excluded"]["mixture_left_out"]
    assert left_out and manifest["counts"]["mixture_left_out"] == len(left_out)
    table = pq.read_table(sorted(mixed.glob("*.parquet")))
    packed = sorted({row for rows in table.column("sample_index").to_pylist() for row in rows})
    assert not set(left_out) & set(packed)
    assert verify_packed(mixed).ok

    def packed_row_left_out(m):
        m["excluded"]["mixture_left_out"].append(packed[0])
        m["counts"]["mixture_left_out"] += 1

    def count(m):
        m["counts"]["mixture_left_out"] += 1

    def dropped_and_left_out(m):
        m["excluded"]["dropped_long"].append(left_out[0])
        m["counts"]["dropped_long"] += 1

    for change, message in (
        (
            packed_row_left_out,
            f"excluded.mixture_left_out lists 1 row ({packed[0]}) that the packs hold (source row "
            f"{packed[0]} in pack row ",
        ),
        (
            count,
            f"counts.mixture_left_out is {len(left_out) + 1}, excluded.mixture_left_out lists "
            f"{len(left_out)} rows: the count is the list's length",
        ),
        (
            dropped_and_left_out,
            f"excluded.mixture_left_out and excluded.dropped_long both list 1 row ({left_out[0]}): a run "
            "puts a row in one of them at most",
        ),
    ):
        report = verify_packed(tampered(mixed, tmp_path / change.__name__, change))
        assert report.counts == {"excluded": 1}, [str(v) for v in report.violations]
        assert report.violations[0].message.startswith(message), report.violations[0].message


def test_a_truncated_row_is_packed_unless_the_mixture_left_it_out(sources, tmp_path):
    """The mixture may leave out a truncated sample (it is kept, then not chosen): verify accepts it in
    both lists, and fails when such a row is in neither the packs nor ``mixture_left_out``."""
    mixture = MixtureConfig(weights=(3, 1), mix_by="tokens")  # the long rows, truncated, subsampled
    pack_dataset(sources[:2], tmp_path / "out", PackConfig(packed_sequence_size=1024, mixture=mixture))
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    both = sorted(set(manifest["excluded"]["truncated"]) & set(manifest["excluded"]["mixture_left_out"]))
    assert both, "no truncated row left out: the test needs one"
    assert verify_packed(tmp_path / "out").ok

    def forgotten(m):
        m["excluded"]["mixture_left_out"].remove(both[0])
        m["counts"]["mixture_left_out"] -= 1

    report = verify_packed(tampered(tmp_path / "out", tmp_path, forgotten))
    assert set(report.counts) == {"excluded", "coverage"}, [str(v) for v in report.violations]
    assert [v.message for v in report.violations if v.check == "excluded"] == [
        f"excluded.truncated lists 1 row ({both[0]}) that the packs do not hold: a truncated sample is kept, "
        "so packed unless the mixture left it out (excluded.mixture_left_out) (the manifest or the packs "
        "changed after packing)"
    ]


def test_a_mixture_without_its_manifest_says_why_its_repeats_count_as_faults(mixed, tmp_path):
    folder = tmp_path / "bare"
    shutil.copytree(mixed, folder)
    (folder / MANIFEST_NAME).unlink()
    repeats = [v.message for v in verify_packed(folder).violations if "is packed twice" in v.message]
    assert repeats and all("with no manifest.json no repeat is allowed" in message for message in repeats)
