"""Blend weights for Megatron-Bridge's run-time blend of separately packed folders (issue 30):
`tightpack.core.blend_weights`, ``tightpack blend`` and rule D11 of ``tightpack validate``.

Two real packed folders: short samples (about 40 tokens, mostly answer) and long ones (about 400 tokens,
mostly prompt) at a pack size of 512, so a pack of the first holds a dozen samples and one of the second
a single sample. Shares are checked against the folders' own rows (`read_pack_arrays`), and against a
replica of Megatron's sample-level selection.
"""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest
import yaml

from tightpack.config import load_config
from tightpack.core.blend_weights import (
    FolderStats,
    blend_counts,
    blend_shares,
    blend_weights,
    plan_blend,
    written_weights,
)
from tightpack.core.mixture import MIX_BY
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.reports.summary import read_pack_arrays
from tightpack.stale_packs import check_packed_data

from .conftest import random_words, run_main, write_jsonl

PACK_SIZE = 512
BLEND = "dataset.offline_packing_specs.packed_train_data_blend"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``short`` and ``long`` packed folders, the working directory they sit in, and their rows' stats."""
    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(7)
    short = [
        {"input": random_words(rng, 4), "output": random_words(rng, int(rng.integers(10, 20)))}
        for _ in range(240)
    ]
    long = [
        {"input": random_words(rng, int(rng.integers(120, 180))), "output": random_words(rng, 10)}
        for _ in range(40)
    ]
    for name, rows in (("short", short), ("long", long)):
        pack_dataset(
            [write_jsonl(root / f"{name}.jsonl", rows)],
            root / name,
            PackConfig(packed_sequence_size=PACK_SIZE),
        )
    arrays = {name: read_pack_arrays(root / name) for name in ("short", "long")}
    return root, arrays


def per_pack(arrays, by: str) -> np.ndarray:
    """The measure of every pack, from the rows (not the manifest)."""
    return {"tokens": arrays.runtime, "supervised-tokens": arrays.supervised, "samples": arrays.sequences}[by]


def manifest_stats(root, name: str) -> FolderStats:
    return FolderStats.from_manifest(json.loads((root / name / "manifest.json").read_text()))


def test_the_manifest_records_what_the_rows_hold(folders):
    root, arrays = folders
    for name in ("short", "long"):
        stats, rows = manifest_stats(root, name), arrays[name]
        assert (stats.packs, stats.samples, stats.tokens, stats.supervised_tokens) == (
            len(rows.runtime), rows.sequences.sum(), rows.runtime.sum(), rows.supervised.sum()
        )  # fmt: skip
    short, long = manifest_stats(root, "short"), manifest_stats(root, "long")
    assert short.per_pack("samples") > 8 * long.per_pack("samples")  # the folders the test needs
    assert short.supervised_tokens / short.tokens > 2 * long.supervised_tokens / long.tokens


@pytest.mark.parametrize("by", MIX_BY)
@pytest.mark.parametrize("targets", [(0.5, 0.5), (0.2, 0.8), (3, 1)])
def test_the_weights_give_the_targets_in_expectation(folders, by, targets):
    root, arrays = folders
    stats = [manifest_stats(root, "short"), manifest_stats(root, "long")]
    weights = blend_weights(targets, stats, by=by)
    assert weights.sum() == pytest.approx(1.0)
    # a pack drawn from folder f is a uniform draw of its packs: its expected measure is the mean per pack
    expected = weights * [per_pack(arrays["short"], by).mean(), per_pack(arrays["long"], by).mean()]
    target = np.asarray(targets, dtype=float) / sum(targets)
    np.testing.assert_allclose(expected / expected.sum(), target, rtol=1e-12)
    np.testing.assert_allclose(blend_shares(weights, stats, by=by), target, rtol=1e-12)


def megatron_selection(weights, size: int) -> np.ndarray:
    """The folder of every row of a blend: Megatron's deterministic greedy, which picks the folder with the
    largest error ``weight * max(i, 1) - count`` (first on ties). Replicated from Megatron-Core's
    ``build_blending_indices`` (megatron/core/datasets/helpers.cpp), which Megatron-Bridge's
    ``GPTSFTPackedParquetBlendDataset._build_indices`` repeats in numpy (PR #5289)."""
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.zeros(len(weights), dtype=np.int64)
    chosen = np.empty(size, dtype=np.int64)
    for index in range(size):
        folder = int(np.argmax(weights * max(index, 1) - counts))
        chosen[index] = folder
        counts[folder] += 1
    return chosen


def drawn_packs(chosen: np.ndarray, folder: int, packs: int, seed: int = 1234) -> np.ndarray:
    """The packs of ``folder`` a blend reads: passes over it, each a new permutation (PR #5289's
    ``_build_indices``: one generator per source, seeded ``seed + source``)."""
    needed = int((chosen == folder).sum())
    rng = np.random.default_rng(seed + folder)
    passes = [rng.permutation(packs) for _ in range(-(-needed // packs))]
    return np.concatenate(passes)[:needed] if passes else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("by", ["tokens", "supervised-tokens", "samples"])
def test_megatrons_selection_with_the_weights_reaches_the_targets(folders, by):
    root, arrays = folders
    stats = [manifest_stats(root, "short"), manifest_stats(root, "long")]
    targets = [0.3, 0.7]
    size = 4000
    plan = plan_blend(targets, stats, by=by, samples=size)
    chosen = megatron_selection(written_weights(plan.weights), size)  # the weights as configured
    counts = np.bincount(chosen, minlength=2)
    assert counts.tolist() == plan.drawn.tolist()  # the packs each folder supplies, as the plan says
    achieved = {}
    for measure in MIX_BY:
        totals = [per_pack(arrays[name], measure)[drawn_packs(chosen, f, len(arrays[name].runtime))].sum()
                  for f, name in enumerate(("short", "long"))]  # fmt: skip
        achieved[measure] = np.array(totals) / sum(totals)
    np.testing.assert_allclose(achieved[by], targets, atol=0.01)
    for measure in MIX_BY:  # the other measures' shares are the plan's too
        np.testing.assert_allclose(achieved[measure], plan.shares[measure], atol=0.01)
    naive = megatron_selection(targets, size)  # the targets written as weights: pack shares
    np.testing.assert_allclose(np.bincount(naive, minlength=2) / size, targets, atol=1e-3)


def test_the_targets_as_weights_miss_by_supervised_tokens_and_samples(folders):
    root, _ = folders
    stats = [manifest_stats(root, "short"), manifest_stats(root, "long")]
    plan = plan_blend([1, 1], stats, by="samples")
    assert plan.naive["samples"][0] > 0.85  # a pack of short samples holds a dozen of them
    assert plan.naive["supervised-tokens"][0] > 0.6
    np.testing.assert_allclose(plan.shares["samples"], [0.5, 0.5])


def test_plan_blend_sizes_the_blend_as_megatron_bridge_does(folders):
    root, _ = folders
    stats = [manifest_stats(root, "short"), manifest_stats(root, "long")]
    default = plan_blend([1, 1], stats)
    assert default.samples == stats[0].packs + stats[1].packs  # without max_train_samples
    assert default.drawn.sum() == default.samples
    assert np.abs(default.drawn - default.weights * default.samples).max() <= 1
    np.testing.assert_allclose(default.passes, default.drawn / [stats[0].packs, stats[1].packs])
    assert default.passes[0] > 1 > default.passes[1]  # the short folder is read several times over
    assert plan_blend([1, 1], stats, samples=10).samples == 10
    with pytest.raises(TightpackError, match=r"^samples must be a positive integer, got 0$"):
        plan_blend([1, 1], stats, samples=0)


@pytest.mark.parametrize(
    ("targets", "stats", "by", "match"),
    [
        ([1, 0], [FolderStats(1, 1, 10, 5)] * 2, "tokens", r"mixture weight 0 of b must be a positive"),
        ([1], [FolderStats(1, 1, 10, 5)] * 2, "tokens", r"1 mixture weights for 2 sources"),
        ([1, 1], [FolderStats(1, 1, 10, 5), FolderStats(2, 3, 10, 0)], "supervised-tokens",
         r"^b holds no supervised tokens, so no weight gives it a share of them"),
        ([1, 1], [FolderStats(1, 1, 10, 5), FolderStats(0, 0, 0, 0)], "tokens", r"^b holds no packs"),
        ([1, 1], [FolderStats(1, 1, 10, 5)] * 2, "packs", r"^unknown mix_by 'packs'; choose one of tokens"),
    ],
)  # fmt: skip
def test_errors_name_the_folder(targets, stats, by, match):
    with pytest.raises(TightpackError, match=match):
        blend_weights(targets, stats, by=by, names=["a", "b"])


def megatron_counts(weights, size: int) -> np.ndarray | None:
    """Megatron-Core's own ``helpers_cpp.build_blending_indices`` counts; None without megatron-core."""
    try:
        from megatron.core.datasets import helpers_cpp
        from megatron.core.datasets.utils import normalize
    except ImportError:
        return None
    index = np.zeros(size, dtype=np.int16)
    helpers_cpp.build_blending_indices(
        index, np.zeros(size, dtype=np.int64), np.array(normalize(list(weights))), len(weights), size, False
    )
    return np.bincount(index, minlength=len(weights))


def test_blend_counts_are_megatron_cores():
    # the page's blend (docs/megatron-bridge.md): round(0.402297 * 32,000) = 12,873, Megatron draws 12,874
    assert blend_counts([0.402297, 0.597703], 32_000).tolist() == [12874, 19126]
    rng = np.random.default_rng(11)
    cases = [([1, 1, 1], 7), ([0.402297, 0.597703], 32_000), ([3, 1], 0), ([2.5], 5)]
    for _ in range(200):
        sources = int(rng.integers(2, 7))
        weights = rng.random(sources) + 1e-3 if rng.random() < 0.5 else rng.integers(1, 4, sources) * 1.0
        cases.append((weights.tolist(), int(rng.integers(1, 3000))))
    for weights, size in cases:
        counts = blend_counts(weights, size)
        assert counts.sum() == size
        replayed = np.bincount(megatron_selection(weights, size), minlength=len(weights))
        assert counts.tolist() == replayed.tolist()
        reference = megatron_counts(weights, size)
        if reference is not None:
            assert counts.tolist() == reference.tolist(), (weights, size)
    with pytest.raises(TightpackError, match=r"mixture weight 0 of source 1 must be a positive"):
        blend_counts([1, 0], 10)


def test_a_manifest_without_the_counts_is_an_error():
    with pytest.raises(
        TightpackError, match=r"^m.json records no tokens, supervised_tokens .*pack the folder"
    ):
        FolderStats.from_manifest({"stats": {"packs": 3, "samples": 9}, "counts": {}}, "m.json")


# --- tightpack blend ----------------------------------------------------------------------------------


def test_cli_prints_the_weights_in_megatron_bridge_syntax(folders):
    root, _ = folders
    stats = [manifest_stats(root, "short"), manifest_stats(root, "long")]
    expected = blend_weights([1, 1], stats, by="supervised-tokens")
    args = ["blend", "short=1", "long=1", "--mix-by", "supervised-tokens"]
    pasted = run_main([*args, "--samples", "800", "--yaml"], cwd=root)
    assert pasted.returncode == 0, pasted.stderr
    dataset = yaml.safe_load(pasted.stdout)["dataset"]
    assert dataset["max_train_samples"] == 800 and dataset["enable_offline_packing"] is True
    sources, weights = dataset["offline_packing_specs"]["packed_train_data_blend"]
    assert sources == ["short", "long"]
    np.testing.assert_allclose(weights, expected, rtol=1e-5)
    shown = run_main(args, cwd=root)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"shares these weights give: tokens .*, supervised tokens 50\.0% / 50\.0%", shown.stdout)
    assert re.search(
        r"^note: only \d+% of short is read \(a seeded subset of its packs\)$", shown.stdout, re.M
    )
    override = re.search(rf"^override: '({re.escape(BLEND)}=.*)'$", shown.stdout, re.M).group(1)
    assert override == f"{BLEND}=[[short,long],[{weights[0]!r},{weights[1]!r}]]"
    as_json = json.loads(run_main([*args, "--json"], cwd=root).stdout)
    assert [folder["weight"] for folder in as_json["folders"]] == pytest.approx(expected.tolist())
    assert as_json["samples"] == stats[0].packs + stats[1].packs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["short=1", "missing=1"], r"^error: missing: no such packed folder or Parquet file$"),
        (["short=1", "short.jsonl=1"], r"^error: short.jsonl is not packed data: Not a packed Parquet spec"),
        (["short=1", "no/*.parquet=1"], r"^error: no/\*.parquet is not packed data: No Parquet files found"),
        (["short=1", "long=0"], r"^error: the share of long must be a positive number, got '0' \(leave"),
        (["short=1", "long=x"], r"^error: the share of long must be a positive number, got 'x'$"),
        (["short=1", "long"], r"^error: 'long' is not FOLDER=SHARE"),
        (["short=1"], r"^error: a blend needs two or more folders"),
        (["short=1", "short=2"], r"^error: short is given twice"),
        (["short=1", "./short=2"], r"^error: ./short names the same packs as short: give each folder one"),
        (["short/*.parquet=1", "long=1", "short=2"], r"^error: short names the same packs as short/\*"),
        (["short=1", "long=1", "short/../short=1"], r"^error: short/../short names the same packs as short:"),
        (["short=1", "long=1", "--mix-by", "packs"], r"^error: Invalid value for '--mix-by'"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(folders, args, message):
    root, _ = folders
    result = run_main(["blend", *args], cwd=root)
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(message, result.stderr.strip()), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


# --- tightpack validate: rule D11 ---------------------------------------------------------------------


def blend_config(weights, **dataset) -> dict:
    return {
        "train": {"micro_batch_size": 1, "global_batch_size": 8},
        "model": {"seq_length": PACK_SIZE},
        "dataset": {
            "type": "GPTSFTDatasetConfig",
            "seq_length": PACK_SIZE,
            "do_validation": False,
            "do_test": False,
            "enable_offline_packing": True,
            "offline_packing_specs": {
                "packed_sequence_size": PACK_SIZE,
                "packed_train_data_blend": [["short", "long"], list(weights)],
            },
            "dataset_kwargs": {"pad_to_max_length": True},
            **dataset,
        },
    }


def d11(config: dict, mix_by: str = "tokens", targets=None):
    checked = check_packed_data(load_config(config), raw=config, mix_by=mix_by, blend_targets=targets)
    return [finding for finding in checked.findings if finding.rule == "D11"], checked


def test_validate_warns_with_the_weights_that_give_the_mix(folders, monkeypatch):
    root, _ = folders
    monkeypatch.chdir(root)  # the configuration's relative paths, as the training job reads them
    (finding,), checked = d11(blend_config([0.5, 0.5]), "supervised-tokens")
    assert finding.severity == "warning"
    assert re.search(
        r"weights 0\.5, 0\.5 give \d+\.\d%/\d+\.\d% of the supervised tokens of short, long, not "
        r"50\.0%/50\.0% \(the weights\): Megatron-Bridge's blend weights count packs",
        finding.reason,
    )
    fixed = re.search(
        r"packed_train_data_blend: \[\[short, long\], \[([\d.e-]+), ([\d.e-]+)\]\]", finding.fix
    )
    weights = [float(fixed.group(1)), float(fixed.group(2))]
    stats = [manifest_stats(root, "short"), manifest_stats(root, "long")]
    np.testing.assert_allclose(weights, blend_weights([1, 1], stats, by="supervised-tokens"), rtol=1e-5)
    assert "`tightpack blend short=0.5 long=0.5 --mix-by supervised-tokens`" in finding.fix
    assert [split.split for split in checked.splits] == ["train[0]", "train[1]"]  # D1-D10 read each source
    assert any(note.startswith("blend of ") and "passes" in note for note in checked.notes)
    # the corrected weights, with the shares they are meant to give: no warning
    assert d11(blend_config(weights), "supervised-tokens", [0.5, 0.5])[0] == []
    (again,), _ = d11(blend_config(weights), "supervised-tokens")  # read as shares themselves, they are not
    assert "(the weights)" in again.reason and "--blend-targets" in again.fix
    (other,), _ = d11(blend_config(weights), "samples", [0.5, 0.5])  # nor shares of samples
    assert "of the samples of short, long, not 50.0%/50.0% (the --blend-targets)" in other.reason
    with pytest.raises(TightpackError, match=r"^3 blend targets for the 2 sources of dataset\.offline_pack"):
        d11(blend_config(weights), "tokens", [1, 1, 1])


def test_weights_that_give_their_own_shares_pass(tmp_path, monkeypatch):
    """Folders of the same kind of samples: a pack holds about the same tokens whatever the folder."""
    rng = np.random.default_rng(3)
    rows = [{"input": random_words(rng, 20), "output": random_words(rng, 20)} for _ in range(200)]
    for name in ("short", "long"):
        pack_dataset(
            [write_jsonl(tmp_path / f"{name}.jsonl", rows)],
            tmp_path / name,
            PackConfig(packed_sequence_size=PACK_SIZE),
        )
    monkeypatch.chdir(tmp_path)
    found, checked = d11(blend_config([0.3, 0.7]))
    assert found == [], found
    assert any(note.startswith("blend shares of short, long: tokens 30.0%/70.0%") for note in checked.notes)


def test_validate_cli_takes_the_measure_meant(folders):
    root, _ = folders
    path = root / "blend.yaml"
    path.write_text(yaml.safe_dump(blend_config([0.5, 0.5])))
    by_samples = run_main(["validate", path, "--mix-by", "samples"], cwd=root)
    assert by_samples.returncode == 0, by_samples.stdout + by_samples.stderr  # a warning, not an error
    assert re.search(r"^  D11 .* of the samples of short, long", by_samples.stdout, re.M)
    assert by_samples.stdout.splitlines()[-1] == "result: ok (0 errors, 1 warning)"
    fix = re.search(r"set \S+: \[\[short, long\], \[([\d.e-]+), ([\d.e-]+)\]\]", by_samples.stdout)
    path.write_text(yaml.safe_dump(blend_config([float(fix.group(1)), float(fix.group(2))])))
    clean = run_main(["validate", path, "--mix-by", "samples", "--blend-targets", "1,1"], cwd=root)
    assert clean.stdout.splitlines()[-1] == "result: ok (0 errors, 0 warnings)", clean.stdout
    bad = run_main(["validate", path, "--blend-targets", "1,x"], cwd=root)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --blend-targets must be positive numbers")


def pasted_blend(printed: str) -> list:
    """``packed_train_data_blend`` of the YAML ``tightpack blend --yaml`` prints."""
    return yaml.safe_load(printed)["dataset"]["offline_packing_specs"]["packed_train_data_blend"]


def test_the_blend_command_validate_prints_runs_on_a_glob(folders):
    """docs/megatron-bridge.md: a source is a packed folder, Parquet file or glob; validate's D11 fix
    prints ``tightpack blend SOURCE=SHARE ...`` with the configuration's sources, and it runs."""
    root, _ = folders
    path = root / "glob.yaml"
    config = blend_config([0.5, 0.5])
    shard = next((root / "long").glob("*.parquet")).name
    config["dataset"]["offline_packing_specs"]["packed_train_data_blend"][0] = [
        "short/*.parquet",
        f"long/{shard}",
    ]
    path.write_text(yaml.safe_dump(config))
    checked = run_main(["validate", path, "--mix-by", "supervised-tokens"], cwd=root)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    command = re.search(r"\(`(tightpack blend [^`]*)` prints them\)", checked.stdout).group(1)
    assert command.startswith("tightpack blend 'short/*.parquet=0.5' ")  # quoted: zsh refuses a bare glob
    words = shlex.split(command)  # as a shell reads it: the glob reaches blend, which expands it
    assert words[:3] == ["tightpack", "blend", "short/*.parquet=0.5"]
    printed = run_main([*words[1:], "--yaml"], cwd=root)
    assert printed.returncode == 0, printed.stderr
    sources, weights = pasted_blend(printed.stdout)
    assert sources == ["short/*.parquet", f"long/{shard}"]
    fix = re.search(
        r"set \S+: \[\[short/\*\.parquet, long/\S+\], \[([\d.e-]+), ([\d.e-]+)\]\]", checked.stdout
    )
    assert weights == [float(fix.group(1)), float(fix.group(2))]  # the weights validate says to set
    folder = run_main(["blend", "short=0.5", "long=0.5", "--mix-by", "supervised-tokens", "--yaml"], cwd=root)
    assert pasted_blend(folder.stdout)[1] == weights


@pytest.mark.parametrize("samples", [800, 4000, 32_000])
def test_blend_and_validate_print_megatrons_packs_drawn(folders, samples):
    root, _ = folders
    args = ["blend", "short=1", "long=1", "--mix-by", "supervised-tokens", "--samples", samples]
    planned = json.loads(run_main([*args, "--json"], cwd=root).stdout)
    weights = [folder["weight"] for folder in planned["folders"]]
    written = pasted_blend(run_main([*args, "--yaml"], cwd=root).stdout)[1]
    selected = np.bincount(megatron_selection(written, samples), minlength=2).tolist()
    assert [folder["drawn"] for folder in planned["folders"]] == selected  # what the run draws, exactly
    assert written == written_weights(weights)
    shown = run_main(args, cwd=root).stdout
    for name, count in zip(("short", "long"), selected, strict=True):
        assert re.search(rf"^│ {name} .*│ +{count:,} │ +[\d.]+ │$", shown, re.M), shown
    path = root / f"drawn-{samples}.yaml"
    path.write_text(yaml.safe_dump(blend_config(written, max_train_samples=samples)))
    args = ["validate", path, "--mix-by", "supervised-tokens", "--blend-targets", "1,1"]
    checked = run_main(args, cwd=root)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"short {selected[0]:,} of " in checked.stdout and f"long {selected[1]:,} of " in checked.stdout


def test_a_pretraining_blend_of_packed_folders_is_an_error(folders, monkeypatch):
    root, _ = folders
    monkeypatch.chdir(root)
    config = {
        "train": {"micro_batch_size": 1, "global_batch_size": 8},
        "model": {"seq_length": PACK_SIZE},
        "dataset": {"type": "GPTDatasetConfig", "seq_length": PACK_SIZE,
                    "blend": [["short", "long"], [0.5, 0.5]], "data_path": "30 prefix_a 70 long"},
    }  # fmt: skip
    found, _ = d11(config)
    assert [(finding.severity, finding.reason.split(":")[0]) for finding in found] == [
        ("error", "dataset.blend names tightpack packed folders (packed Parquet)"),
        ("error", "dataset.data_path names tightpack packed folders (packed Parquet)"),
    ]
    assert "short, long; GPTDatasetConfig's blends read Megatron-Core indexed datasets" in found[0].reason
    assert "packed_train_data_blend" in found[0].fix
