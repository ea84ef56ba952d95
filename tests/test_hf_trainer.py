"""Hugging Face Trainer on tightpack packs: the loss curve of a whole run equals the padded run's."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.hf_training import PaddedCollator, encoded_rows, micro_batches, small_tokenizer, tiny_llama, train
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.hf_trainer import PackingCallback, PackingCollator

BUDGET = 512


@pytest.fixture(scope="module")
def rows():
    return [row for chunk in default_corpus().read(0, 256) for row in chunk.parsed_rows()][:96]


@pytest.fixture(scope="module")
def tokenizer(rows):
    return small_tokenizer(rows)


def test_a_run_packed_equals_the_padded_run_step_by_step(rows, tokenizer, tmp_path):
    """10 optimizer steps of 2 micro-batches each, the same samples in the same steps: the packed run
    (one [1, T] row per micro-batch) and the padded run ([B, S] with an attention mask) have equal
    losses at every step and equal final weights. The model keeps ``use_cache=True`` in its config
    (transformers' default, which would make packed attention cross sequences), and the loss of a
    step is normalized by its supervised tokens (``num_items_in_batch``), in both runs."""
    groups = micro_batches(rows, tokenizer, BUDGET, max_length=BUDGET)
    runs, weights = {}, {}
    for name, collator in (
        ("packed", PackingCollator(tokenizer, max_length=BUDGET)),
        ("padded", PaddedCollator(tokenizer, BUDGET)),
    ):
        model = tiny_llama(tokenizer.vocab_size, hidden=32)
        assert model.config.use_cache
        runs[name] = train(model, groups, collator, steps=10, accumulation=2, workdir=tmp_path / name)
        weights[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    packed, padded = runs["packed"], runs["padded"]
    assert len(packed["losses"]) == len(padded["losses"]) == 10
    np.testing.assert_allclose(packed["losses"], padded["losses"], rtol=1e-4, atol=0)
    assert packed["losses"][-1] < packed["losses"][0] - 0.1  # it learns
    torch.testing.assert_close(weights["packed"], weights["padded"], rtol=0, atol=1e-4)
    assert packed["tokens"] == padded["tokens"] and packed["padding"] == 0 < padded["padding"]


def test_offline_packs_and_raw_rows_give_the_model_the_same_targets(rows, tokenizer, tmp_path):
    """Both inputs of the collator: packs from ``tightpack pack`` and the raw rows they came from."""
    short = [
        row
        for row, (ids, _) in zip(rows, encoded_rows(rows, tokenizer, 10**6), strict=True)
        if len(ids) < BUDGET
    ]
    rows = short[:12]  # none truncated: truncation is a policy of its own, tested elsewhere
    result = pack_dataset(
        rows, tmp_path / "packs", PackConfig(packed_sequence_size=BUDGET), tokenizer=tokenizer
    )
    packs = PackedDataset(tmp_path / "packs")
    collator = PackingCollator(tokenizer, max_length=BUDGET)
    batch = collator([packs[i] for i in range(len(packs))])
    boundaries = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
    assert set(batch) == {"input_ids", "position_ids", "labels", "shift_labels", "use_cache", *boundaries}
    assert batch["use_cache"] is False and "attention_mask" not in batch
    starts = batch["cu_seq_lens_q"][:-1].long()
    assert len(starts) == result.counts["packed"] > 4 and (batch["position_ids"][0, starts] == 0).all()
    assert (batch["labels"][0, starts] == -100).all(), "no sequence learns to predict the next one"
    follows = torch.ones(batch["labels"].shape[1], dtype=torch.bool)
    follows[starts] = False
    assert torch.equal(batch["labels"][0, follows], batch["shift_labels"][0, :-1][follows[1:]])
    # the same targets, sequence by sequence, as collate-time packing of the raw rows
    files = sorted((tmp_path / "packs").glob("*.parquet"))
    order = [
        i for file in files for pack in pq.read_table(file).column("sample_index").to_pylist() for i in pack
    ]
    raw = collator([rows[i] for i in order])
    ours = [batch["shift_labels"][0, a:b] for a, b in zip(starts, batch["cu_seq_lens_q"][1:], strict=True)]
    theirs = [
        raw["shift_labels"][0, a:b]
        for a, b in zip(raw["cu_seq_lens_q"][:-1], raw["cu_seq_lens_q"][1:], strict=True)
    ]
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine[mine != -100], other[other != -100])


def test_dropped_columns_stop_the_first_batch(rows, tokenizer, tmp_path):
    """Trainer drops the columns its model does not take from a datasets.Dataset
    (``remove_unused_columns=True``): the packs lose their loss mask and boundaries."""
    datasets = pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments

    pack_dataset(rows[:8], tmp_path / "packs", PackConfig(packed_sequence_size=BUDGET), tokenizer=tokenizer)
    files = sorted(str(path) for path in (tmp_path / "packs").glob("*.parquet"))
    table = datasets.Dataset.from_parquet(files)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, report_to=[], use_cpu=True,
                             per_device_train_batch_size=2)  # fmt: skip
    trainer = Trainer(model=tiny_llama(tokenizer.vocab_size, hidden=32), args=args, train_dataset=table,
                      data_collator=PackingCollator(tokenizer))  # fmt: skip
    with pytest.raises(TightpackError, match=re.escape("set TrainingArguments(remove_unused_columns=False)")):
        trainer.train()


def test_an_attention_that_crosses_sequences_stops_training(tokenizer):
    model = tiny_llama(tokenizer.vocab_size, hidden=32)
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(TightpackError, match="does not keep packed sequences apart"):
        PackingCallback().on_train_begin(None, None, None, model=model)
    model.config._attn_implementation = "sdpa"
    PackingCallback().on_train_begin(None, None, None, model=model)


# TRL's SFTConfig passes transformers a deprecated argument name of its own
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_trl_sft_trainer_on_tightpack_packs_equals_the_trainer_run(rows, tokenizer, tmp_path):
    """TRL's SFTTrainer (its own dataset preparation skipped) trains on tightpack's packs through the
    collator with the losses of transformers' Trainer on the same packs."""
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from tightpack import to_hf_dataset

    pack_dataset(rows, tmp_path / "packs", PackConfig(packed_sequence_size=BUDGET), tokenizer=tokenizer)
    table, collator = to_hf_dataset(tmp_path / "packs"), PackingCollator(tokenizer)
    reference = train(tiny_llama(tokenizer.vocab_size, hidden=32), table, collator, steps=4, accumulation=2,
                      workdir=tmp_path / "trainer")  # fmt: skip
    losses = []

    class Recording(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            losses.append(float(loss := super().training_step(model, inputs, num_items_in_batch)))
            return loss

    args = SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=2e-3, warmup_steps=0, lr_scheduler_type="constant", weight_decay=0.0,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, remove_unused_columns=False,
        disable_tqdm=True, dataset_kwargs={"skip_prepare_dataset": True},
    )  # fmt: skip
    processing = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, eos_token=tokenizer.eos_token, pad_token=tokenizer.eos_token
    )
    model = tiny_llama(tokenizer.vocab_size, hidden=32)
    trainer = Recording(model=model, args=args, train_dataset=table, data_collator=collator,
                        processing_class=processing, callbacks=[PackingCallback()])  # fmt: skip
    trainer.train()
    per_step = np.add.reduceat(np.array(losses), np.arange(0, len(losses), 2))
    np.testing.assert_allclose(per_step, reference["losses"], rtol=1e-4, atol=0)
