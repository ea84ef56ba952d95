"""`tightpack plan` (tightpack.reports.pack_sizes): every candidate pack size planned on one tokenization.

Each row must be what ``tightpack pack`` at that size writes into its manifest (the same accounting and
planner, not a second implementation); the straggler simulation must be what the offline samplers deal;
the recommendation must follow its rule on data whose losses are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tightpack.core.balance import epoch_rank_costs
from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.reports.pack_sizes import compare_pack_sizes
from tightpack.runtime.balanced_sampler import BalancedPackedBatchSampler
from tightpack.runtime.samplers import PackedBatchSampler

from .conftest import run_main, write_jsonl

SIZES = [1024, 2048]
TOPOLOGY = dict(tp=2, cp=2, sp=True)  # alignment multiple 4


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory):
    """The first 1,024 conversations of the demo corpus as JSONL: its length mix, at a seventh the time."""
    from tightpack.prepare.sources import default_corpus

    rows = []
    for chunk in default_corpus().read(0, 512):
        rows += chunk.rows
        if len(rows) >= 1024:
            break
    return write_jsonl(tmp_path_factory.mktemp("plan") / "demo.jsonl", rows[:1024])


@pytest.fixture(scope="module")
def demo_comparison(demo_rows):
    """The demo rows at two sizes, DP 2, with the alignment of TP 2, CP 2 and SP."""
    return compare_pack_sizes(
        [demo_rows],
        SIZES,
        token_slots=8192,
        config=PackConfig(packed_sequence_size=max(SIZES), **TOPOLOGY),
        data_parallel_size=2,
    )


@pytest.fixture(scope="module")
def demo_packed(demo_rows, tmp_path_factory):
    """``tightpack pack`` of the demo rows at 1024 with the same topology: the manifest to agree with."""
    output = tmp_path_factory.mktemp("plan") / "packed-1024"
    pack_dataset([demo_rows], output, PackConfig(packed_sequence_size=1024, **TOPOLOGY))
    return json.loads((output / "manifest.json").read_text())


def test_a_row_is_what_packing_at_that_size_writes(demo_comparison, demo_packed):
    row, counts, stats = demo_comparison.row(1024), demo_packed["counts"], demo_packed["stats"]
    assert row.truncated > 0 and row.supervised_lost > 0  # the demo corpus has chats longer than 1024
    for field in ("packs", "lower_bound", "lower_bound_l2", "gap"):
        assert getattr(row, field) == stats[field], field
    assert row.fill == pytest.approx(stats["efficiency"], abs=0)
    assert row.samples_packed == counts["packed"]
    assert row.truncated == counts["truncated"]
    assert row.dropped_long == counts["dropped_long"]
    assert row.no_supervised == counts["no_supervised"]
    assert row.lost_after_truncation == counts["no_supervised_after_truncation"]
    assert (row.tokens_lost, row.supervised_lost) == (counts["tokens_lost"], counts["supervised_lost"])
    assert row.supervised_lost_share == counts["supervised_lost"] / counts["supervised_in"]
    assert row.alignment_padding == counts["alignment_padding"]
    assert row.attention_cost == pytest.approx(stats["attention_cost_mean"] * stats["packs"], rel=1e-12)
    assert demo_comparison.samples_in == counts["samples_in"]
    assert demo_comparison.supervised_in == counts["supervised_in"]


def test_equal_token_slots_and_the_relative_measures(demo_comparison):
    rows = demo_comparison.rows
    assert [row.pack_size for row in rows] == SIZES
    assert [row.global_batch_size for row in rows] == [8, 4]  # 8192 token slots each
    for row in rows:
        assert row.steps_per_epoch == row.packs // row.global_batch_size
        assert row.step_cost == pytest.approx(row.epoch_cost * row.global_batch_size / row.packs)
    # a larger size truncates less, keeps more tokens, and so costs more attention
    small, large = rows
    assert large.truncated < small.truncated and large.supervised_lost < small.supervised_lost
    assert large.attention_cost > small.attention_cost
    assert min(row.attention_cost_relative for row in rows) == 1.0
    assert large.attention_cost_relative == large.attention_cost / small.attention_cost
    assert min(row.epoch_time_relative for row in rows) == 1.0


def test_the_straggler_figures_are_the_samplers_dealing(demo_comparison):
    """Deal costs through the real samplers of every rank: `epoch_rank_costs`, which the rows' overheads
    and epoch times come from, is their dealing, in order and balanced."""
    row = demo_comparison.row(2048)
    costs = np.random.default_rng(0).lognormal(0, 1, size=row.packs)  # any costs: the dealing is checked
    ranks, gbs = demo_comparison.data_parallel_size, row.global_batch_size
    for balanced in (False, True):
        simulated = epoch_rank_costs(costs, ranks, gbs, balanced=balanced, seed=3, epoch=1)
        real = []
        for rank in range(ranks):
            common = dict(global_batch_size=gbs, data_parallel_rank=rank, data_parallel_size=ranks, seed=3)
            if balanced:
                sampler = BalancedPackedBatchSampler(costs, **common)
            else:
                sampler = PackedBatchSampler(row.packs, dataloader_type="batch", micro_batch_size=1, **common)
            sampler.consumed_samples = sampler.samples_per_epoch  # epoch 1
            real.append([costs[indices].sum() for indices in sampler])
        np.testing.assert_allclose(simulated, np.array(real).T, rtol=1e-12)
    assert 0 <= row.overhead_balanced <= row.overhead_in_order
    assert row.epoch_time_balanced <= row.epoch_time_in_order


def known_lengths(path, lengths: list[int]):
    """Pre-tokenized rows of the given stored lengths (EOS included), every token supervised."""
    rows = [{"input_ids": [7] * (length - 1) + [50256]} for length in lengths]
    return write_jsonl(path, rows)


def _tokens_format():
    from tightpack.prepare.formats import FormatConfig

    return FormatConfig(format="tokens")


def test_sizes_that_cannot_run_are_named_not_recommended(tmp_path):
    inputs = known_lengths(tmp_path / "rows.jsonl", [100] * 50)
    config = PackConfig(packed_sequence_size=512, format=_tokens_format())
    comparison = compare_pack_sizes(
        [inputs], [256, 512], token_slots=1024, config=config, data_parallel_size=4
    )
    cannot = comparison.row(512)  # GBS 2 over DP 4
    assert cannot.note == "GBS 2 is not a multiple of DP 4" and cannot.epoch_time_balanced is None
    assert (
        comparison.recommended == 256
        and "512 cannot run (GBS 2 is not a multiple of DP 4)" in comparison.reason
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pack_sizes=[1000], token_slots=4096), "--token-slots 4096 is not a multiple of pack size 1000"),
        (dict(pack_sizes=[], token_slots=4096), "--pack-sizes is empty"),
        (dict(pack_sizes=[512], token_slots=4096, data_parallel_size=0), "--dp must be a positive"),
        (dict(pack_sizes=[512], token_slots=4096, max_supervised_loss=1.0), "--max-supervised-loss"),
        (dict(pack_sizes=[2], token_slots=4096, config=PackConfig(packed_sequence_size=2, cp=2)), "at least"),
    ],
)
def test_bad_settings_fail_before_tokenizing(kwargs, message):
    with pytest.raises(TightpackError, match=message.replace("(", r"\(")):
        compare_pack_sizes(["/does/not/exist.jsonl"], **kwargs)


def test_the_command_prints_the_table_and_json(demo_rows, demo_comparison):
    args = ["plan", str(demo_rows), "--pack-sizes", "1024,2048", "--token-slots", "8192", "--dp", "2"]
    args += ["--tp", "2", "--cp", "2", "--sp"]
    as_json = run_main([*args, "--json"])
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    same_run = {key: data[key] for key in ("seconds", "reused_store")}  # of this run: the cache may evict
    assert data == json.loads(json.dumps(demo_comparison.to_dict() | same_run))
    assert data["recommended"] == demo_comparison.recommended
    text = run_main(args)
    assert text.returncode == 0, text.stderr
    for name, *cells in demo_comparison.table()[1:]:
        assert name in text.stdout and all(cell in text.stdout for cell in cells)
    assert f"recommended: {demo_comparison.recommended}" in text.stdout
    bad = run_main(["plan", "--pack-sizes", "2048,x"])
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: --pack-sizes must be integers separated by commas, got '2048,x'"
    )


# Last in the module: the stores of these cases would push the demo rows' store out of the cache
# (it keeps four), which the command above reuses.
#
# Every sample stores 300 tokens (299 runtime tokens, all supervised), priced one per runtime token, at
# DP 1: an epoch's time is the tokens of the packs in its full steps (the last ``packs % GBS`` are
# dropped), so each figure below is counted by hand. At 4,096 token slots a step holds 16 packs of one
# sample truncated to 256 tokens (43 supervised tokens lost each), 8 packs of one sample at 512, or 4
# packs of three at 1024 (12 samples).
TOKENS = CostModel(linear=1.0, quadratic=0.0, unit="tokens")


@pytest.mark.parametrize(
    "samples, sizes, max_loss, epoch_times, recommended, rule",
    [
        # 256: 3 steps x 16 x 256; 512: 7 x 8 x 299; 1024: 5 x 12 x 299 (1.071x 512's): 256 loses
        # 14.4% of the supervised tokens, 1024 is too slow: 512.
        (60, [256, 512, 1024], 0.01, [12288, 16744, 17940], 512, "the largest size within 1%"),
        # the same with 14.4% allowed: 256 is the fastest by far
        (60, [256, 512, 1024], 0.5, [12288, 16744, 17940], 256, "the largest size within 1%"),
        # 512: 37 x 8 x 299, 1024: 25 x 12 x 299 = 1.0135x: just outside the margin
        (300, [512, 1024], 0.01, [88504, 89700], 512, "the largest size within 1%"),
        # 512: 151 x 8 x 299, 1024: 101 x 12 x 299 = 1.0033x: within the margin, the larger wins
        (1212, [512, 1024], 0.01, [361192, 362388], 1024, "the largest size within 1%"),
        # nothing loses at most 0: the least lossy
        (60, [256], 0.0, [12288], 256, "every size loses more than 0.00%"),
    ],
)
def test_the_recommendation_follows_its_rule(
    tmp_path, samples, sizes, max_loss, epoch_times, recommended, rule
):
    inputs = known_lengths(tmp_path / "rows.jsonl", [300] * samples)
    config = PackConfig(packed_sequence_size=1024, format=_tokens_format())
    comparison = compare_pack_sizes(
        [inputs], sizes, token_slots=4096, config=config, cost_model=TOKENS, max_supervised_loss=max_loss
    )
    assert [row.epoch_time_balanced for row in comparison.rows] == epoch_times
    assert [row.supervised_lost for row in comparison.rows] == [43 * samples * (s == 256) for s in sizes]
    assert comparison.recommended == recommended
    assert comparison.reason.startswith(f"{recommended} ({rule}")
    chosen = comparison.row(recommended)
    for row in comparison.rows:
        if row is not chosen:  # each other size is named with what it loses and its epoch time
            time = row.epoch_time_balanced / chosen.epoch_time_balanced
            assert (
                f"{row.pack_size} loses {row.supervised_lost_share:.2%} of the supervised tokens"
                in comparison.reason
                and f"at {time:.3f}x the epoch time" in comparison.reason
            )
    assert "points" not in comparison.reason
