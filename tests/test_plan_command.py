"""``tightpack plan`` tells the truth, through the command line: every column is what ``tightpack pack``
at that size writes (fields cut before tokenizing included), every lost token is shown, the
recommendation says what it is, no runnable size is a failure, skipped rows are reported, vision rows
are sized by the processor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import random_words, run_main, write_jsonl
from tests.vision_corpus import chat_row, processor_folder, vision_tokenizer


def _plan(args: list) -> dict:
    done = run_main(["plan", *map(str, args), "--json"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _pack(args: list, output: Path) -> dict:
    done = run_main(["pack", *map(str, args), "--output", str(output)])
    assert done.returncode == 0, done.stderr
    return json.loads((output / "manifest.json").read_text())


def assert_row_is_pack(row: dict, manifest: dict) -> None:
    """Every column of a plan row against the manifest ``tightpack pack`` wrote at that size."""
    counts, stats = manifest["counts"], manifest["stats"]
    assert row["pack_size"] == manifest["settings"]["packed_sequence_size"]
    for column in ("packs", "lower_bound", "lower_bound_l2", "gap"):
        assert row[column] == stats[column], column
    assert row["fill"] == stats["efficiency"]
    assert row["attention_cost"] == pytest.approx(stats["attention_cost_mean"] * stats["packs"], rel=1e-12)
    for column, count in [
        ("samples_packed", "packed"), ("truncated", "truncated"), ("dropped_long", "dropped_long"),
        ("no_supervised", "no_supervised"), ("lost_after_truncation", "no_supervised_after_truncation"),
        ("tokens_in", "tokens_in"),
        ("supervised_in", "supervised_in"), ("tokens_lost", "tokens_lost"),
        ("supervised_lost", "supervised_lost"), ("alignment_padding", "alignment_padding"),
    ]:  # fmt: skip
        assert row[column] == counts[count], column
    assert row["tokens_lost_share"] == counts["tokens_lost"] / counts["tokens_in"]
    assert row["supervised_lost_share"] == counts["supervised_lost"] / counts["supervised_in"]


def test_every_column_is_pack_at_that_size_when_a_field_is_cut_before_tokenizing(tmp_path):
    """Two fields over twice the text budget of pack size 256 (36,992 characters with GPT-2) and under
    that of 1024: ``pack`` at 256 cuts their middle before tokenizing, at 1024 it does not. Each plan
    column equals ``pack`` at its size, cold and with the token store cache warm."""
    rng = np.random.default_rng(5)
    giant = " ".join(random_words(rng, 40) for _ in range(400))  # about 100,000 characters
    assert 2 * 36_992 < len(giant) < 2 * 135_296
    rows = [
        {"input": random_words(rng, 5 + i % 60), "output": random_words(rng, 1 + i % 30)} for i in range(300)
    ]
    rows[7] = {"input": giant, "output": "short answer"}
    rows[90] = {"input": "a question", "output": giant}
    inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
    common = [inputs, "--format", "prompt-completion"]
    cold = _plan([*common, "--pack-sizes", "256,1024", "--token-slots", 1024, "--no-reuse"])
    for row in cold["rows"]:
        size = row["pack_size"]
        manifest = _pack([*common, "--pack-size", size, "--no-reuse"], tmp_path / f"packed-{size}")
        assert manifest["counts"]["texts_cut_before_tokenizing"] == (2 if size == 256 else 0)
        assert_row_is_pack(row, manifest)
    for _ in range(2):  # the first run fills the cache, the second reuses it
        warm = _plan([*common, "--pack-sizes", "256,1024", "--token-slots", 1024])
        assert warm["rows"] == cold["rows"]
    # and pack at 256 with the cache warm from the plan (whose 1024 store holds the whole fields)
    again = _pack([*common, "--pack-size", 256], tmp_path / "packed-256-warm")
    assert_row_is_pack(cold["rows"][0], again)


def test_all_lost_tokens_are_shown_and_the_recommendation_says_what_it_is(tmp_path):
    """Long prompts, short answers: at 128 the prompts are trimmed (a third of all tokens and more),
    no supervised token is lost. The table and the reason say both."""
    rng = np.random.default_rng(1)
    rows = [{"input": random_words(rng, 150 + i % 100), "output": random_words(rng, 3)} for i in range(200)]
    inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
    args = ["plan", inputs, "--pack-sizes", "128,256", "--token-slots", 1024, "--max-supervised-loss", 0.01]
    data = _plan(args[1:])
    small = data["rows"][0]
    assert small["supervised_lost"] == 0 and small["tokens_lost_share"] > 1 / 3
    text = run_main(list(map(str, args)))
    assert text.returncode == 0, text.stderr
    (line,) = [line for line in text.stdout.splitlines() if line.startswith("│ tokens lost, all")]
    assert f"{small['tokens_lost']:,} ({small['tokens_lost_share']:.2%})" in line
    (prompt,) = [line for line in text.stdout.splitlines() if "prompt (unsupervised)" in line]
    assert f"{small['tokens_lost'] - small['supervised_lost']:,}" in prompt
    reason = data["reason"]
    assert f"{small['tokens_lost_share']:.2%} of all tokens" in reason
    assert "points" not in reason and "keeps" not in reason
    assert reason.startswith(f"{data['recommended']} (the largest size within 1% of the fastest epoch")


def test_no_size_that_can_run_exits_1(tmp_path):
    rows = [{"input": f"question {i}", "output": f"answer {i}"} for i in range(40)]
    inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
    args = ["plan", str(inputs), "--pack-sizes", "256,512", "--token-slots", "1024", "--dp", "8"]
    done = run_main(args)
    assert done.returncode == 1, done.stderr
    assert "recommended: no pack size can run: 256: GBS 4 is not a multiple of DP 8" in done.stdout
    as_json = run_main([*args, "--json"])
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["recommended"] is None


def test_every_skipped_row_is_reported(tmp_path):
    """16 lines, 15 of them bad: the plan says it read 16 rows, skipped 15 and planned 1 sample."""
    lines = [json.dumps({"input": "the one good row", "output": "yes"})] + [
        f"not json {i}" for i in range(15)
    ]
    inputs = tmp_path / "rows.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    args = ["plan", str(inputs), "--pack-sizes", "256", "--token-slots", "256", "--skip-bad-lines"]
    done = run_main(args)
    assert done.returncode == 0, done.stderr
    assert "16 rows read, 15 bad rows skipped, 1 samples planned" in " ".join(done.stdout.split())
    skipped = [line for line in done.stderr.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 5 and skipped[0].startswith(f"skipped {inputs}:2")
    assert "... and 10 more bad rows" in done.stderr
    data = json.loads(run_main([*args, "--json"]).stdout)
    assert (data["samples_in"], data["samples_tokenized"], len(data["bad_rows"])) == (16, 1, 15)


def test_vision_rows_are_sized_by_the_processor(tmp_path):
    """With --vision-processor, the plan's row at a size is ``pack``'s at that size with it."""
    from PIL import Image

    from tests.qwen_vl_models import drawn_frame

    (tmp_path / "media").mkdir()
    rows = []
    for i in range(12):
        height, width = [(56, 84), (112, 56), (84, 84)][i % 3]
        Image.fromarray(drawn_frame(height, width, i)).save(tmp_path / "media" / f"p{i}.png")
        rows.append(chat_row(f"Question {i}?", "A drawing. " * (1 + i % 4), f"media/p{i}.png"))
    inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
    vision = ["--tokenizer", vision_tokenizer(tmp_path / "tokenizer.json"), "--vision-processor",
              processor_folder(tmp_path / "processor")]  # fmt: skip
    data = _plan([inputs, *vision, "--pack-sizes", "256", "--token-slots", 256])
    manifest = _pack([inputs, *vision, "--pack-size", 256], tmp_path / "packed")
    assert manifest["counts"]["packed"] == 12
    assert_row_is_pack(data["rows"][0], manifest)
    text_only = run_main(["plan", str(inputs), "--pack-sizes", "256", "--token-slots", "256"])
    assert text_only.returncode == 2  # image parts without --vision-processor: refused, as by pack


def _cell(stdout: str, label: str) -> list[str]:
    """The cells of one measure of the plan table (``│ label │ cell │ cell │``), one per pack size."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(f"│ {label} ")]
    return [cell.strip() for cell in line.strip("│ ").split("│")[1:]]


def _summary(stdout: str, label: str) -> str:
    """A value of ``pack``'s summary table (``│ label │ value │``)."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(f"│ {label} ")]
    return line.strip("│ ").split("│")[1].strip()


def test_a_size_pack_refuses_is_a_column_that_cannot_run_and_the_others_are_planned(tmp_path, chat_rows):
    """At 8 tokens no chat sample keeps a supervised token: ``pack --pack-size 8`` stops; the plan says
    so in that column, plans 2048 and recommends it (it exited 2 on the whole plan before)."""
    inputs = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    refused = run_main(["pack", str(inputs), "--pack-size", "8", "--output", str(tmp_path / "packed")])
    assert refused.returncode == 2
    args = ["plan", str(inputs), "--pack-sizes", "8,2048", "--token-slots", "4096"]
    done = run_main(args)
    assert done.returncode == 0, done.stderr
    assert "recommended: 2048 " in done.stdout and "8 cannot run (no sample left to pack" in done.stdout
    assert f"note: 8: {refused.stderr.removeprefix('error: ').strip()}" in " ".join(done.stderr.split())
    assert _cell(done.stdout, "packs (lower bound)")[0] == "n/a"
    data = json.loads(run_main([*args, "--json"]).stdout)
    small, large = data["rows"]
    assert (data["recommended"], small["packs"], large["note"]) == (2048, None, "")
    assert small["note"].startswith("no sample left to pack (80 rows in, 0 bad, 0 too long, 80 without")
    assert data["samples_in"] == 80 and data["supervised_in"] == large["supervised_in"]


def test_long_samples_error_stops_only_the_sizes_with_a_long_sample(tmp_path):
    """``--long-samples error``: at 128 some samples are longer, at 2048 none. The 128 column says what
    ``pack`` says, in plan's options; 2048 is planned. When every size has one, plan exits 1."""
    rng = np.random.default_rng(3)
    rows = [{"input": random_words(rng, 10 + i % 200), "output": random_words(rng, 5)} for i in range(60)]
    inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
    args = ["plan", str(inputs), "--pack-sizes", "128,2048", "--token-slots", "4096"]
    args += ["--long-samples", "error"]
    done = run_main(args)
    assert done.returncode == 0, done.stderr
    (note,) = [line for line in done.stderr.splitlines() if line.startswith("note: 128: ")]
    assert "samples are longer than the cap of 128 tokens (first: source row" in note
    assert "--long-samples truncate or drop" in note and "--pack-sizes" in note
    assert "--pack-size/" not in note and "max-seq-length" not in note and "long_samples" not in note
    assert "recommended: 2048 " in done.stdout
    none_runs = run_main(["plan", str(inputs), "--pack-sizes", "64,128", "--token-slots", "1024",
                          "--long-samples", "error"])  # fmt: skip
    assert none_runs.returncode == 1, none_runs.stderr
    assert "recommended: no pack size can run: 64: " in none_runs.stdout


def test_skipped_rows_name_plans_options_as_pack_does(tmp_path):
    lines = [json.dumps({"input": "a good row", "output": "yes"}), json.dumps({"question": "no keys"})]
    inputs = tmp_path / "rows.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    common = [str(inputs), "--format", "prompt-completion", "--skip-bad-lines"]
    planned = run_main(["plan", *common, "--pack-sizes", "256", "--token-slots", "256"])
    packed = run_main(["pack", *common, "--pack-size", "256", "--output", str(tmp_path / "packed")])
    assert planned.returncode == packed.returncode == 0, planned.stderr + packed.stderr
    (line,) = [line for line in planned.stderr.splitlines() if line.startswith("skipped ")]
    assert "--input-key/--output-key or --format" in line and "input_key" not in line
    assert line in packed.stderr.splitlines()


def test_bound_and_dropped_rows_say_what_they_count_in_packs_words(tmp_path):
    """Five samples over half a pack of 64 (volume bound 3, L2 5) and one too long (dropped): plan's
    rows are labelled and filled as ``pack``'s summary at 64 is."""
    rows = [{"input": "word " * 30, "output": f"answer {i}"} for i in range(5)]
    rows.append({"input": "word " * 100, "output": "too long"})
    inputs = write_jsonl(tmp_path / "rows.jsonl", rows)
    common = [str(inputs), "--long-samples", "drop"]
    planned = run_main(["plan", *common, "--pack-sizes", "64", "--token-slots", "64"])
    packed = run_main(["pack", *common, "--pack-size", "64", "--output", str(tmp_path / "packed")])
    assert planned.returncode == packed.returncode == 0, planned.stderr + packed.stderr
    assert _summary(packed.stdout, "packs (lower bound)") == "5 (volume 3, L2 5; gap 0)"
    for label in ("packs (lower bound)", "dropped (too long)", "dropped (no supervised token)"):
        assert _cell(planned.stdout, label) == [_summary(packed.stdout, label)], label
    assert _cell(planned.stdout, "dropped (too long)") == ["1"]
    assert "samples dropped" not in planned.stdout and "lower bound (gap)" not in planned.stdout


def test_the_plot_of_a_plan_where_pack_refuses_every_size_is_drawn(tmp_path):
    """Every size refused (a chat template longer than both): the plot and report still come, with
    gaps, and no warning; the plan exits 1."""
    pytest.importorskip("matplotlib")
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 8
    inputs = write_jsonl(tmp_path / "chat.jsonl", rows)
    args = ["plan", str(inputs), "--pack-sizes", "4,8", "--token-slots", "64"]
    done = run_main([*args, "--plot", str(tmp_path / "plan.png"), "--html", str(tmp_path / "plan.html")])
    assert done.returncode == 1, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    assert (tmp_path / "plan.png").stat().st_size > 0 and (tmp_path / "plan.html").stat().st_size > 0
    assert "recommended: no pack size can run: 4: no sample left to pack" in done.stdout
