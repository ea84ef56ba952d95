"""Collate-time packing keeps what ``tightpack pack`` keeps: long samples cut by the same rules,
``long_samples`` truncate|drop|error, no sample fed without a supervised token, and the counts, per
batch, in running totals and in the Trainer's logs (issue 26, section 2)."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from tests.conftest import run_main, write_jsonl
from tests.hf_training import small_tokenizer, tiny_llama
from tests.long_chat_rows import long_chat_rows
from tightpack.core.truncation import REASONS
from tightpack.errors import TightpackError
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.hf_trainer import PackingCallback, PackingCollator

CAP = 1024  # tightpack pack --max-seq-length; the collator's max_length is CAP + 1 (its rows hold the EOS)


@pytest.fixture(scope="module")
def rows():
    return long_chat_rows(48, seed=3)


def supervised_targets(batch) -> list[tuple[int, ...]]:
    """The supervised target ids of every sequence of a `PackingCollator` batch."""
    bounds = batch["cu_seq_lens_q"].tolist()
    targets = batch["shift_labels"][0]
    return [tuple(t for t in targets[a:b].tolist() if t != -100) for a, b in itertools.pairwise(bounds)]


def offline(rows, tmp_path, *options) -> tuple[list[tuple[int, ...]], dict]:
    """``tightpack pack --max-seq-length CAP`` of ``rows``: every packed sample's supervised targets
    (read back through `PackingCollator`) and the manifest's counts."""
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "packs"
    run = run_main(
        ["pack", source, "--output", out, "--pack-size", 4 * CAP, "--max-seq-length", CAP, *options]
    )
    assert run.returncode == 0, run.stderr
    packs = PackedDataset(out)
    reader = PackingCollator(packs=packs)
    targets = [seq for i in range(len(packs)) for seq in supervised_targets(reader([packs[i]]))]
    return targets, json.loads((out / "manifest.json").read_text())["counts"]


def collate(collator, rows, size: int = 8) -> list[tuple[int, ...]]:
    batches = (collator(rows[i : i + size]) for i in range(0, len(rows), size))
    return [seq for batch in batches for seq in supervised_targets(batch)]


@pytest.mark.parametrize("method", ["right", "left"])
def test_the_collator_keeps_every_supervised_token_tightpack_pack_keeps(rows, tmp_path, method):
    """Long multilingual chat rows, many over the cap: the collator's samples have exactly the
    supervised targets of the offline packs' samples, and its counts are the manifest's."""
    from tightpack.prepare.formats import FormatConfig

    theirs, counts = offline(rows, tmp_path, "--truncation-method", method)
    collator = PackingCollator(max_length=CAP + 1, format=FormatConfig(truncation_method=method))
    ours = collate(collator, rows)
    assert counts["truncated"] >= 20, "the rows are mostly over the cap"
    assert sorted(ours) == sorted(theirs)
    totals = collator.long_sample_counts
    assert totals["fed"] == counts["packed"] and totals["truncated"] == counts["truncated"]
    for reason in REASONS:
        assert totals[reason] == counts[f"truncated_{reason}"], reason
    assert totals["no_supervised"] == counts["no_supervised"]
    assert totals["supervised_in"] == counts["supervised_in"]
    assert totals["supervised_lost"] == counts["supervised_lost"]
    assert totals["supervised_fed"] == sum(map(len, ours)) == counts["supervised_packed"]
    assert totals["samples"] == len(rows) and collator.last_batch_counts["samples"] == 8


def test_drop_leaves_out_what_tightpack_pack_drops(rows, tmp_path):
    theirs, counts = offline(rows, tmp_path, "--long-samples", "drop")
    collator = PackingCollator(max_length=CAP + 1, long_samples="drop")
    ours = collate(collator, rows, size=len(rows))  # one batch: batches of 8 long rows would be empty
    assert sorted(ours) == sorted(theirs)
    assert collator.long_sample_counts["dropped_long"] == counts["dropped_long"] > 0
    assert collator.long_sample_counts["truncated"] == 0


def test_error_names_the_row_and_the_fix(rows):
    collator = PackingCollator(max_length=CAP + 1, long_samples="error")
    with pytest.raises(TightpackError, match=r"longer than max_length=1025 \(first: row \d+ of the batch"):
        collate(collator, rows)
    with pytest.raises(TightpackError, match="long_samples must be one of"):
        PackingCollator(max_length=CAP, long_samples="cut")


def test_a_sample_without_supervised_token_is_left_out_and_a_batch_of_them_refused(caplog):
    """A row with no assistant turn (nothing to learn under ``loss_mode="assistant"``) is left out and
    counted; a micro-batch of such rows raises instead of a loss-0 step; the first loss warns once."""
    answered = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    silent = {"messages": [{"role": "user", "content": "anyone there?"}]}
    collator = PackingCollator()
    with caplog.at_level(logging.WARNING, logger="tightpack"):
        batch = collator([answered, silent, answered])
        collator([answered, silent])
    assert len(supervised_targets(batch)) == 2 and all(supervised_targets(batch))
    assert collator.last_batch_counts["no_supervised"] == 1
    assert collator.long_sample_counts["no_supervised"] == 2
    assert collator.long_sample_counts["no_supervised_after_truncation"] == 0
    assert sum("left out with no supervised token" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(TightpackError, match=r"no sample of this batch of 2 has a supervised token.*loss 0"):
        collator([silent, silent])


def test_an_answer_cut_to_nothing_is_left_out(rows):
    """At a cap below the template and system turn, the answer goes (an end cut): left out, counted as
    lost to truncation, never fed."""
    collator = PackingCollator(max_length=12)
    with pytest.raises(TightpackError, match="no supervised token left after the cut to max_length=12"):
        collator(rows[:3])
    assert collator.last_batch_counts["no_supervised_after_truncation"] == 3


def test_a_trainer_run_logs_the_counts_and_never_a_step_without_targets(rows, tmp_path):
    """transformers' Trainer with PackingCallback on long rows at max_length=512 (where an end cut
    made steps of loss 0): every logged step has a loss, the logs carry the collator's totals, and a
    micro-batch with no supervised token stops the run with the reason."""
    from transformers import Trainer, TrainingArguments

    spec = small_tokenizer(rows)
    groups = [rows[i : i + 2] for i in range(0, 12, 2)]
    collator = PackingCollator(spec, max_length=512)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=1, max_steps=len(groups),
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, remove_unused_columns=False,
        disable_tqdm=True, learning_rate=1e-3,
    )  # fmt: skip
    trainer = Trainer(
        model=tiny_llama(spec.vocab_size, hidden=32), args=args, train_dataset=groups,
        data_collator=collator, callbacks=[PackingCallback()],
    )  # fmt: skip
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == len(groups)
    assert all(entry["loss"] > 0 and entry["grad_norm"] > 0 for entry in steps)
    last = steps[-1]
    totals = collator.long_sample_counts
    assert (
        last["tightpack/prompt_trimmed"] + last["tightpack/turns_dropped"]
        == (totals["prompt_trimmed"] + totals["turns_dropped"])
        > 0
    )
    assert last["tightpack/supervised_lost"] == totals["supervised_lost"]
    assert last["tightpack/no_supervised"] == 0

    silent = [{"messages": [{"role": "user", "content": "anyone there?"}]}] * 2
    trainer = Trainer(
        model=tiny_llama(spec.vocab_size, hidden=32), args=args, train_dataset=[silent],
        data_collator=PackingCollator(spec, max_length=512), callbacks=[PackingCallback()],
    )  # fmt: skip
    with pytest.raises(TightpackError, match="loss 0"):
        trainer.train()
