"""The equivalence probe and the static refusals (tightpack.runtime.equivalence), on tiny models of many
families as the user meets them: through `check_packing`, `packed_forward`, `PackingCallback` in a
real ``Trainer`` run and `check_mcore_packing` on a real Megatron-Core ``GPTModel``.

Every family either passes with the packed targets exactly independent of the other sequence (0 in
float32, bfloat16 and float64) or is refused; the families of the static table also go through the
probe with the table bypassed, so an entry transformers has since fixed fails here.
"""

from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch

from tests.hf_training import small_tokenizer
from tests.tiny_families import tiny_model
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.equivalence import (
    LEAK_FRACTION,
    PackingLeakError,
    ProbeSkipped,
    check_packing,
    unpackable_reason,
)
from tightpack.runtime.hf import check_packable, packed_forward
from tightpack.runtime.hf_kwargs import model_kwargs
from tightpack.runtime.hf_trainer import PackingCallback, PackingCollator
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker
from tightpack.runtime.sft_collate import TextSFTCollator
from tightpack.runtime.transformers_releases import FAMILY_FLOORS, installed_release, parse_release

EXACT = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo2", "gpt2"]
# families the installed transformers runs with one causal mask (or one state) over a packed row
LEAKY = {"opt": "layer 0", "bloom": "layer 0", "minimax": "layer 0", "jamba": "layer 0"}
# Mamba-2 takes seq_idx from transformers 5.25 (`FAMILY_FLOORS`): its kernels keep packed sequences
# apart and its torch path raises, as Bamba's does; before, its state runs across the row
MAMBA2_READS_SEQ_IDX = parse_release(installed_release("transformers")) >= FAMILY_FLOORS["mamba2"].release


@pytest.fixture(scope="module")
def rows():
    return [row for chunk in default_corpus().read(0, 256) for row in chunk.parsed_rows()][:48]


@pytest.fixture(scope="module")
def tokenizer(rows):
    return small_tokenizer(rows)


@pytest.fixture(scope="module")
def trainer_batch(rows, tokenizer):
    """One packed row of six chat samples, as ``Trainer`` hands it to the model (rows with an
    answer: the collator leaves out a sample with no supervised token)."""
    answered = [row for row in rows if any(message["role"] == "assistant" for message in row["messages"])]
    return PackingCollator(tokenizer)(answered[:6])


@pytest.mark.parametrize("family", EXACT)
def test_a_family_that_keeps_sequences_apart_passes_exactly(family, trainer_batch, caplog):
    model = tiny_model(family)
    check_packable(model)
    with caplog.at_level(logging.INFO, logger="tightpack"):
        report = check_packing(model, trainer_batch)
    assert report.passed and report.cross_sequence == 0.0, report.summary()
    assert report.unpacked_gap <= 1e-5, "each packed sequence computes as it does alone"
    assert report.leak > 1e-3, "the contaminated run shows what a leak is for this model"
    passed = [record.getMessage() for record in caplog.records if "packing check passed" in record.message]
    assert len(passed) == 1 and "margin infinite" in passed[0] and type(model).__name__ in passed[0]


@pytest.mark.parametrize("family", sorted(LEAKY))
def test_a_family_that_leaks_is_refused_statically_and_by_the_probe(family, trainer_batch):
    model = tiny_model(family)
    assert unpackable_reason(model) is not None
    with pytest.raises(TightpackError, match=f"{type(model).__name__} cannot be trained on packed rows"):
        check_packable(model)
    # the probe, which does not consult the static table, finds the leak on its own
    with pytest.raises(PackingLeakError) as failure:
        check_packing(model, trainer_batch)
    report = failure.value.report
    assert report.cross_sequence > LEAK_FRACTION * report.leak > 0
    message = str(failure.value)
    assert type(model).__name__ in message and "transformers" in message and "TIGHTPACK_PROBE=0" in message
    assert f"it enters at {LEAKY[family]}" in message, message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "opt", "mamba2"])
def test_the_verdict_does_not_depend_on_the_dtype(family, dtype, trainer_batch):
    model = tiny_model(family, dtype=dtype)
    if family in LEAKY or (family == "mamba2" and not MAMBA2_READS_SEQ_IDX):
        with pytest.raises(PackingLeakError):
            check_packing(model, trainer_batch)
    elif family == "mamba2":
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            check_packing(model, trainer_batch)
    else:
        report = check_packing(model, trainer_batch)
        assert report.cross_sequence == 0.0 and report.passed, report.summary()


def test_positions_that_do_not_restart_are_found(trainer_batch):
    """A collator that numbers positions over the whole row (and passes cu_seq_lens that the model's
    attention does not read): no sequence sees another through the mask, but positions run on."""
    model = tiny_model("gpt2")
    inputs = dict(trainer_batch)
    inputs["position_ids"] = torch.arange(inputs["input_ids"].shape[1])[None]
    with pytest.raises(PackingLeakError, match=r"see each other|not computed as alone"):
        check_packing(model, inputs)


def test_a_two_dimensional_mask_from_the_users_collator_is_a_leak(trainer_batch):
    model = tiny_model("llama")
    inputs = dict(trainer_batch, attention_mask=torch.ones_like(trainer_batch["input_ids"]))
    with pytest.raises(PackingLeakError, match="see each other"):
        check_packing(model, inputs)


def test_a_padded_batch_is_not_probed():
    model = tiny_model("llama")
    with pytest.raises(ProbeSkipped, match=re.escape("input_ids of shape (2, 8)")):
        check_packing(model, {"input_ids": torch.ones(2, 8, dtype=torch.long)})


# --- packed_forward: seq_idx reaches the layers that read it, the first row is probed ---


def test_packed_forward_passes_seq_idx_so_a_hybrid_layer_refuses_loudly(trainer_batch, tokenizer, rows):
    """Bamba's Mamba-2 layers keep packed sequences apart only with their kernels; without them
    transformers raises when it sees seq_idx. Dropping seq_idx made that silent corruption."""
    model = tiny_model("bamba")
    batch = TextSFTCollator(tokenizer, enable_in_batch_packing=True)(rows[:4])
    assert "seq_idx" in model_kwargs(model, batch)
    with pytest.raises(ValueError, match="packed sequences"):
        packed_forward(model, batch, probe=False)


def test_mamba2_is_refused_before_it_reads_seq_idx_and_probed_from_then(trainer_batch):
    """Below transformers 5.25 Mamba-2 is refused before any step, and the probe (which does not consult
    the release table) finds its state running across the row on its own. From 5.25 it is not refused:
    with PackingCollator's ``seq_idx`` its kernels keep sequences apart and its torch path (CPU) raises;
    with positions only (what DataCollatorWithFlattening gives) the probe refuses it."""
    model = tiny_model("mamba2")
    with pytest.raises(TightpackError, match=r"gives mamba2's Mamba-2 .*no sequence boundaries"):
        check_packable(model, transformers_release="5.24.0")
    positions_only = {key: trainer_batch[key] for key in ("input_ids", "position_ids", "labels")}
    with pytest.raises(PackingLeakError, match="see each other") as failure:
        check_packing(model, positions_only)
    assert "it enters at layer 0" in str(failure.value)
    if MAMBA2_READS_SEQ_IDX:
        check_packable(model)
        with pytest.raises(ValueError, match="can't keep packed sequences apart without `causal_conv1d`"):
            check_packing(model, trainer_batch)
    else:
        with pytest.raises(TightpackError, match=re.escape("first release that packs mamba2 is 5.25.0")):
            check_packable(model)
        with pytest.raises(PackingLeakError, match="see each other"):
            check_packing(model, trainer_batch)


class PositionDroppingLlama(torch.nn.Module):
    """A user's wrapper that forwards everything but ``position_ids``: transformers then sees one
    sequence and runs one causal mask over the row."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)


def _thd_batches(rows, tokenizer, tmp_path) -> dict[str, dict]:
    """One packed row from each of the three paths: offline packs, collate-time, online."""
    pack_dataset(rows[:16], tmp_path / "packs", PackConfig(packed_sequence_size=1024), tokenizer=tokenizer)
    packs = PackedDataset(tmp_path / "packs")
    offline = PackedCollate(pack_size=1024, eos_id=tokenizer.eos_id, pad_seq_to_mult=1)([packs[0]])
    in_batch = TextSFTCollator(tokenizer, enable_in_batch_packing=True)(rows[:5])
    encoded = TextSFTCollator(tokenizer).encoder.encode_rows(rows[:24])
    bounds = [0, *encoded.lengths.cumsum().tolist()]
    samples = [
        {"key": f"s{i}", "input_ids": torch.as_tensor(encoded.tokens[a:b]),
         "loss_mask": torch.as_tensor(encoded.loss_mask[a:b])}
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]  # fmt: skip
    online = next(iter(OnlinePacker(lambda start, stride: iter(samples[start::stride]),
                                    OnlinePackConfig(pack_size=2048, packing_buffer_size=8))))  # fmt: skip
    return {"offline": offline, "in-batch": in_batch, "online": online}


def test_every_path_is_probed_and_a_leak_stops_packed_forward(rows, tokenizer, tmp_path, caplog):
    batches = _thd_batches(rows, tokenizer, tmp_path)
    for path, batch in batches.items():
        model = tiny_model("llama")
        with caplog.at_level(logging.INFO, logger="tightpack"):
            caplog.clear()
            packed_forward(model, batch)
            packed_forward(model, batch)  # probed once per model
        passed = [record for record in caplog.records if "packing check passed" in record.message]
        assert len(passed) == 1, (path, caplog.text)
        leaky = PositionDroppingLlama(tiny_model("llama"))
        with pytest.raises(PackingLeakError, match="see each other") as failure:
            packed_forward(leaky, batch)
        assert "packed_forward(model, batch, probe=True)" in str(failure.value), path
        packed_forward(leaky, batch, probe=False)  # the off switch of the call


def test_the_environment_switch_turns_the_automatic_probe_off(rows, tokenizer, monkeypatch):
    batch = TextSFTCollator(tokenizer, enable_in_batch_packing=True)(rows[:4])
    leaky = PositionDroppingLlama(tiny_model("llama"))
    monkeypatch.setenv("TIGHTPACK_PROBE", "0")
    packed_forward(leaky, batch)
    with pytest.raises(PackingLeakError):
        packed_forward(leaky, batch, probe=True)  # on demand, whatever the environment says


# --- Trainer: a failed probe stops before the first optimizer step ---


class MaskAddingCollator:
    """A user's collator around `PackingCollator` that adds a 2-D attention mask of ones."""

    def __init__(self, tokenizer) -> None:
        self.inner = PackingCollator(tokenizer)

    def __call__(self, features):
        batch = self.inner(features)
        return batch | {"attention_mask": torch.ones_like(batch["input_ids"])}


def _trainer(model, collator, rows, tmp_path, callback):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, report_to=[], use_cpu=True,
                             per_device_train_batch_size=4, save_strategy="no", learning_rate=1e-2,
                             remove_unused_columns=False)  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=rows[:8], data_collator=collator,
                   callbacks=[callback])  # fmt: skip


def test_a_trainer_run_logs_one_passing_line(rows, tokenizer, tmp_path, caplog):
    callback = PackingCallback()
    trainer = _trainer(tiny_model("qwen3").train(), PackingCollator(tokenizer), rows, tmp_path, callback)
    with caplog.at_level(logging.INFO, logger="tightpack"):
        trainer.train()
    assert callback.report is not None and callback.report.passed and callback.report.cross_sequence == 0
    line = "packing check passed for Qwen3ForCausalLM"
    passed = [record for record in caplog.records if line in record.message]
    assert len(passed) == 1


def test_a_trainer_run_that_would_leak_stops_before_the_first_step(rows, tokenizer, tmp_path):
    model = tiny_model("llama").train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = _trainer(model, MaskAddingCollator(tokenizer), rows, tmp_path, PackingCallback())
    with pytest.raises(PackingLeakError, match="packing check failed for LlamaForCausalLM"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_a_family_that_cannot_be_packed_stops_when_training_starts(rows, tokenizer, tmp_path):
    model = tiny_model("opt").train()
    trainer = _trainer(model, PackingCollator(tokenizer), rows, tmp_path, PackingCallback())
    with pytest.raises(TightpackError, match="OPTForCausalLM cannot be trained on packed rows"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("switch", ["argument", "environment"])
def test_the_trainer_probe_can_be_turned_off(switch, rows, tokenizer, tmp_path, monkeypatch):
    if switch == "environment":
        monkeypatch.setenv("TIGHTPACK_PROBE", "0")
    callback = PackingCallback(probe=switch != "argument")
    trainer = _trainer(tiny_model("llama").train(), MaskAddingCollator(tokenizer), rows, tmp_path, callback)
    trainer.train()  # trains on the leaking batches: the user chose to
    assert trainer.state.global_step == 2 and callback.report is None


# --- what a user's own collator or call can get wrong around the probe ---


def test_labels_that_cross_sequences_are_refused(trainer_batch):
    """A collator that copies input_ids into labels (and gives no shift_labels) makes each sequence's
    last token learn the next sequence's first: attention is right, the targets are not."""
    model = tiny_model("llama")
    naive = {key: value for key, value in trainer_batch.items() if key != "shift_labels"}
    naive["labels"] = trainer_batch["input_ids"].clone()
    with pytest.raises(TightpackError, match=r"labels cross sequences: the first label of 5 of the 5 later"):
        check_packing(model, naive)
    without_shift = {key: value for key, value in trainer_batch.items() if key != "shift_labels"}
    assert check_packing(model, without_shift).passed  # PackingCollator's labels: -100 at every start


def test_packed_forward_refuses_a_two_dimensional_mask_in_the_batch(rows, tokenizer):
    batch = TextSFTCollator(tokenizer, enable_in_batch_packing=True)(rows[:4])
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(TightpackError, match=re.escape("a 2-D attention_mask (batch key) on a packed row")):
        packed_forward(tiny_model("llama"), batch)


def test_packed_forward_on_trainer_inputs_says_where_they_belong(trainer_batch):
    with pytest.raises(TightpackError, match=re.escape("run model(**batch)")):
        packed_forward(tiny_model("llama"), trainer_batch)


def test_an_empty_row_is_skipped_not_crashed():
    empty = {
        "input_ids": torch.zeros(1, 0, dtype=torch.long),
        "position_ids": torch.zeros(1, 0, dtype=torch.long),
    }
    with pytest.raises(ProbeSkipped):
        check_packing(tiny_model("llama"), empty)


def test_an_empty_online_sample_names_its_key():
    samples = [
        {"key": "a", "input_ids": torch.arange(5)},
        {"key": "b", "input_ids": torch.zeros(0, dtype=torch.long)},
    ]
    packer = OnlinePacker(
        lambda start, stride: iter(samples[start::stride]),
        OnlinePackConfig(pack_size=64, packing_buffer_size=4),
    )
    with pytest.raises(TightpackError, match="sample 'b' has no tokens"):
        list(packer)
