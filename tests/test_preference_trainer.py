"""Hugging Face ``Trainer`` on raw preference rows through `PreferencePackingCollator`: a custom loss on
`sequence_logps` sees, at every step, each branch's log-probability exactly as the branch run alone.

A tiny Llama in float64 built from a config, the built-in GPT-2 tokenizer, pairs of the demo corpus
(conversations and text) and groups of three with rewards; both layouts, with ``PackingCallback``
probing the first packed forward. The unpacked reference runs inside ``compute_loss``, on the model
of that step, one ``prompt + branch`` at a time.
"""

from __future__ import annotations

import pytest
import torch

from tests.preference_data import conversation_pairs, groups, text_pairs
from tightpack.core.preference_units import PreferenceUnits
from tightpack.errors import TightpackError
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.hf_trainer import PackingCallback
from tightpack.runtime.preference_logps import chosen_rejected, grouped, sequence_logps
from tightpack.runtime.preference_trainer import (
    PreferencePackingCollator,
    preference_trainer_inputs,
    split_preference_inputs,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYOUTS = ("pairs", "shared-prefix")
TOLERANCE = 1e-10  # float64, sdpa: the parity tests' bound


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer()


def tiny_llama(vocab_size: int, attention: str = "sdpa"):
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def alone(model, units: PreferenceUnits) -> torch.Tensor:
    """Every branch's summed target log-probability, ``prompt + branch`` run by itself."""
    sums = []
    for b, u in enumerate(units.branch_unit.tolist()):
        prompt, branch = units.prompt(u), units.branch(b)
        mask = torch.from_numpy(units.branch_loss_mask[units.branch_offsets[b] : units.branch_offsets[b + 1]])
        ids = torch.tensor([[*prompt.tolist(), *branch.tolist()]])
        logps = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0], -1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(branch) - 1)
        sums.append((logps[positions, torch.from_numpy(branch)] * mask.to(logps.dtype)).sum())
    return torch.stack(sums)


def run(model, micro_batches, collator, kind, workdir, steps=3):
    """Train ``steps`` steps of one micro-batch each, in order; per step the packed and the unpacked
    per-branch sums, and the losses."""
    encoder = PreferenceEncoder(collator.rows.encoder.spec, kind)
    record = {"packed": [], "alone": [], "losses": []}

    class PreferenceTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            model_inputs, branches = split_preference_inputs(inputs)
            logits = model(**model_inputs).logits
            logps = sequence_logps(logits, branches)
            with torch.no_grad():  # the same model, each branch alone
                units = encoder.encode_rows(micro_batches[self.state.global_step]).units
                record["alone"].append(alone(model, units))
            record["packed"].append(logps.sums.detach())
            if kind == "groups":  # advantage-weighted, GRPO-style: rewards centred per group
                rewards = grouped(branches["branch_reward"].to(logps.means.dtype), branches)
                advantages = rewards - rewards.mean(1, keepdim=True)
                loss = -(advantages * grouped(logps.means, branches)).mean()
            else:  # SimPO-style: length-normalised margins, no reference model
                chosen, rejected = chosen_rejected(logps.means, branches)
                loss = -torch.nn.functional.logsigmoid(2.0 * (chosen - rejected) - 0.5).mean()
            record["losses"].append(float(loss))
            return loss

    args = transformers.TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, save_strategy="no", report_to=[], use_cpu=True,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    callback = PackingCallback()
    trainer = PreferenceTrainer(
        model=model, args=args, train_dataset=micro_batches, data_collator=collator, callbacks=[callback]
    )
    trainer.train()
    return record, callback, trainer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_branch_logps_equal_each_branch_alone(gpt2, layout, tmp_path):
    rows = [*conversation_pairs(6), *text_pairs(3)]
    micro_batches = [rows[0:3], rows[3:6], rows[6:9]]
    model = tiny_llama(gpt2.vocab_size)
    collator = PreferencePackingCollator(
        gpt2, layout=layout, model=model if layout == "shared-prefix" else None
    )
    before = [p.detach().clone() for p in model.parameters()]
    record, callback, trainer = run(model, micro_batches, collator, "preference", tmp_path)
    assert len(record["packed"]) == 3
    for packed, expected in zip(record["packed"], record["alone"], strict=True):
        assert packed.dtype == torch.float64 and packed.shape == expected.shape == (6,)
        assert (packed - expected).abs().max() <= TOLERANCE
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained
    assert record["losses"][-1] < record["losses"][0]
    assert callback.report is not None and callback.report.passed and callback.report.leak > 0
    assert trainer.state.log_history[0]["tightpack/units"] >= 3
    assert collator.last_row["preference_layout"] == layout


def test_groups_train_under_an_advantage_weighted_loss_in_the_shared_prefix_layout(gpt2, tmp_path):
    rows = groups(4, 3)
    model = tiny_llama(gpt2.vocab_size, attention="eager")
    collator = PreferencePackingCollator(gpt2, kind="groups", layout="shared-prefix", model=model)
    record, callback, _ = run(model, [rows[0:2], rows[2:4]], collator, "groups", tmp_path, steps=2)
    for packed, expected in zip(record["packed"], record["alone"], strict=True):
        # eager attention takes its softmax in float32 whatever the dtype (test_preference_parity.py)
        assert ((packed - expected).abs() <= 1e-8 * expected.abs() + 1e-10).all()
    assert callback.report is not None and callback.report.passed


def test_the_model_inputs_of_each_layout(gpt2):
    rows = conversation_pairs(2)
    model = tiny_llama(gpt2.vocab_size)
    pairs = PreferencePackingCollator(gpt2, layout="pairs")(rows)
    shared = PreferencePackingCollator(gpt2, layout="shared-prefix", model=model)(rows)
    assert "attention_mask" not in pairs and pairs["cu_seq_lens_q"].tolist()[0] == 0
    assert shared["attention_mask"].shape == (
        1,
        1,
        shared["input_ids"].shape[1],
        shared["input_ids"].shape[1],
    )
    assert shared["attention_mask"].dtype == torch.float64 and "cu_seq_lens_q" not in shared
    for inputs in (pairs, shared):  # labels are shift_labels shifted, as transformers' loss expects
        assert torch.equal(inputs["labels"][0, 1:], inputs["shift_labels"][0, :-1])
        assert inputs["use_cache"] is False and inputs["branch_index"].tolist() == [0, 1, 0, 1]
    model_inputs, branches = split_preference_inputs(shared)
    assert "branch_ids" not in model_inputs and "labels" not in model_inputs
    assert torch.equal(branches["labels"], shared["shift_labels"]) and "branch_ids" in branches
    # the collator's inputs are the function's on its last row
    again = preference_trainer_inputs(PreferencePackingCollator(gpt2, layout="pairs").rows(rows))
    assert all(torch.equal(again[key], pairs[key]) for key in ("input_ids", "position_ids", "labels"))


def test_a_shared_prefix_collator_needs_a_model_that_takes_its_mask(gpt2):
    with pytest.raises(
        TightpackError, match=r"layout='shared-prefix' needs model=: .* or use layout='pairs'"
    ):
        PreferencePackingCollator(gpt2, layout="shared-prefix")
    flash = tiny_llama(gpt2.vocab_size)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TightpackError, match=r"attn_implementation 'flash_attention_2' cannot take"):
        PreferencePackingCollator(gpt2, layout="shared-prefix", model=flash)
    with pytest.raises(TightpackError, match=r"these lack branch_unit, .* shift_labels"):
        split_preference_inputs({"input_ids": torch.zeros(1, 3, dtype=torch.long)})


def test_the_callback_skips_a_masked_forward_it_has_no_row_for(gpt2, caplog):
    model = tiny_llama(gpt2.vocab_size)
    inputs = PreferencePackingCollator(gpt2, layout="shared-prefix", model=model)(conversation_pairs(2))
    callback = PackingCallback()
    callback.on_train_begin(None, None, None, model=model, train_dataloader=None)
    model_inputs, _ = split_preference_inputs(inputs)
    with caplog.at_level("WARNING", logger="tightpack"), torch.no_grad():
        model(**model_inputs)
    assert callback.report is None
    assert "no collated preference row is at hand to probe with" in caplog.text


def test_a_flex_attention_model_takes_the_collators_block_mask(gpt2, monkeypatch):
    """The collator builds a ``BlockMask`` for a flex-attention model; the split inputs run it and every
    branch computes as alone. The kernel runs uncompiled, as in tests/test_preference_parity.py (on CPU
    Inductor fails on the shared-prefix ``mask_mod``)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from transformers.integrations import flex_attention as integration

    def uncompiled(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(integration, "compile_friendly_flex_attention", uncompiled)
    rows = conversation_pairs(2)
    model = tiny_llama(gpt2.vocab_size, attention="flex_attention")
    collator = PreferencePackingCollator(gpt2, layout="shared-prefix", model=model)
    model_inputs, branches = split_preference_inputs(collator(rows))
    assert isinstance(model_inputs["attention_mask"], BlockMask)
    with torch.no_grad():
        got = sequence_logps(model(**model_inputs).logits, branches).sums
        expected = alone(tiny_llama(gpt2.vocab_size), PreferenceEncoder(gpt2).encode_rows(rows).units)
    assert (got - expected).abs().max() <= TOLERANCE
