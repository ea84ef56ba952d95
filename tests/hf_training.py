"""Whole Hugging Face ``Trainer`` runs, packed and padded, on the same samples in the same steps.

Shared by tests/test_hf_trainer.py and benchmarks/bench_training.py. A step's samples are fixed
beforehand: `micro_batches` groups the rows with `TokenBudgetBatchSampler`, the dataset is the list of
groups and ``per_device_train_batch_size=1``, so both runs see each group whole, in the same order
(``Trainer`` shuffles the groups with the run's seed, the same in both runs).

The padded baseline (`PaddedCollator`) is what ``DataCollatorForSeq2Seq`` gives a causal LM: the
micro-batch right-padded to its longest row, a 2-D ``attention_mask``, labels -100 on padding and on
tokens that are not targets; its tokens and targets are the packed run's (the same formatter and
tokenizer), so both runs optimise the same per-token loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.tokenize import Encoder
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.runtime.samplers import TokenBudgetBatchSampler
from tightpack.runtime.sft_collate import TextSFTCollator, shift_labels


def small_tokenizer(rows: Sequence[dict], vocab_size: int = 1024) -> TokenizerSpec:
    """A byte-level BPE of ``vocab_size`` tokens trained on the rows' text (about a second): a small
    vocabulary keeps the model's output layer, and so the test, cheap."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tightpack.prepare.tokenizer import _spec_from

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = (message["content"] or "" for row in rows for message in row["messages"])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    return _spec_from(backend, {"eos_token": "<|endoftext|>"}, f"byte-level BPE {vocab_size}")


def tiny_llama(vocab_size: int, seed: int = 0, attention: str = "sdpa", hidden: int = 64, layers: int = 2):
    """A small Llama with random weights, float32, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    config._attn_implementation = attention
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def encoded_rows(
    rows: Sequence[dict], spec: TokenizerSpec, max_length: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, unshifted mask)`` of every row, EOS appended, fitted to ``max_length`` stored tokens as
    the collators fit them (`tightpack.runtime.collate_truncation`: long samples cut as ``tightpack
    pack`` cuts them); a row they leave out (no supervised token) is empty."""
    result = Encoder(spec, FormatConfig()).encode_rows(list(rows))
    kept, fitted = TextSFTCollator(spec, max_length=max_length).long_samples.fit(result)
    empty = (np.zeros(0, result.tokens.dtype), np.zeros(0, result.loss_mask.dtype))
    samples = dict(zip(kept, fitted, strict=True))
    return [samples.get(index, empty) for index in range(len(rows))]


def micro_batches(
    rows: Sequence[dict],
    spec: TokenizerSpec,
    token_budget: int,
    max_length: int,
    *,
    shuffled_seed: int | None = None,
) -> list[list[dict]]:
    """The rows that have a target, grouped into micro-batches of at most ``token_budget`` tokens.

    Planned (default): `TokenBudgetBatchSampler`'s bins, which group samples of similar length, in
    its order. ``shuffled_seed``: the rows in a seeded random order, each micro-batch filled with the
    next rows while they fit (what a padded run by token budget over a shuffled dataset sees).
    """
    encoded = encoded_rows(rows, spec, max_length)
    keep = [
        i for i, (_, mask) in enumerate(encoded) if mask[1:].any()
    ]  # as tightpack pack: no target, no sample
    lengths = [len(encoded[i][0]) for i in keep]
    if shuffled_seed is None:
        bins = list(TokenBudgetBatchSampler(lengths, token_budget, shuffle=False))
    else:
        bins, current, used = [], [], 0
        for position in np.random.default_rng(shuffled_seed).permutation(len(keep)).tolist():
            if current and used + lengths[position] > token_budget:
                bins.append(current)
                current, used = [], 0
            current.append(position)
            used += lengths[position]
        bins.append(current)
    return [[rows[keep[i]] for i in batch] for batch in bins]


class PaddedCollator:
    """The padded baseline: one right-padded ``[B, S]`` micro-batch with a 2-D attention mask."""

    def __init__(self, spec: TokenizerSpec, max_length: int) -> None:
        self.spec, self.max_length = spec, max_length

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        rows = features[0] if len(features) == 1 and isinstance(features[0], list) else list(features)
        samples = encoded_rows(rows, self.spec, self.max_length)
        width = max(len(ids) for ids, _ in samples)
        input_ids = torch.full((len(samples), width), self.spec.eos_id, dtype=torch.long)
        labels = torch.full((len(samples), width), -100, dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(samples):
            targets, target_mask = shift_labels(ids, mask)
            input_ids[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            attention[row, : len(ids)] = 1
            # transformers' labels are unshifted: the target of position t sits at t + 1
            labels[row, 1 : len(ids)] = torch.from_numpy(np.where(target_mask[:-1] > 0, targets[:-1], -100))
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def train(
    model,
    groups: list[list[dict]],
    collator,
    *,
    steps: int,
    accumulation: int,
    seed: int = 0,
    lr: float = 2e-3,
    workdir,
):
    """Train with ``Trainer`` for ``steps`` optimizer steps. Returns every step's loss (the sum of its
    micro-batches' losses, each normalized by the step's supervised tokens: unrounded, unlike the
    logged one), the real tokens and padding tokens of the run's micro-batches, and the wall time of
    ``trainer.train()``."""
    import time

    from transformers import Trainer, TrainingArguments

    from tightpack.runtime.hf_trainer import PackingCallback

    record = {"losses": [], "tokens": 0, "padding": 0}

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            real = int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            record["tokens"] += real
            record["padding"] += int(inputs["input_ids"].numel()) - real
            loss = super().training_step(model, inputs, num_items_in_batch)
            record["losses"].append(float(loss))
            return loss

    args = TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=1, gradient_accumulation_steps=accumulation,
        max_steps=steps, learning_rate=lr, warmup_steps=0, lr_scheduler_type="constant", weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed, data_seed=seed,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Recording(
        model=model, args=args, train_dataset=groups, data_collator=collator, callbacks=[PackingCallback()]
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    per_step = np.add.reduceat(np.array(record["losses"]), np.arange(0, len(record["losses"]), accumulation))
    return {
        "losses": per_step.tolist(),
        "tokens": record["tokens"],
        "padding": record["padding"],
        "seconds": seconds,
    }
