"""TRL's DPOTrainer on packed preference rows (`PackedDPOTrainer`) trains as TRL's own padded run: the
same pairs per step, ten optimizer steps, the losses, gradient norms and log-probabilities step by
step, in both layouts, with a reference model and with precomputed reference log-probabilities."""

from __future__ import annotations

import pytest
import torch

from tests.hf_training import small_tokenizer
from tests.preference_data import text_pairs
from tightpack.errors import TightpackError
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.trl_dpo import PackedDPOTrainer, pack_padded_pairs

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

COMPARED = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    rows = [row for chunk in default_corpus().read(0, 256) for row in chunk.parsed_rows()][:200]
    spec = small_tokenizer(rows)
    return PreTrainedTokenizerFast(tokenizer_object=spec.backend, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")  # fmt: skip


@pytest.fixture(scope="module")
def pairs():
    rows = [{key: value[:400] for key, value in row.items()} for row in text_pairs(48)]
    return datasets.Dataset.from_list(rows)


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = LlamaConfig(vocab_size=1024, num_key_value_heads=2, max_position_embeddings=2048, **sizes)
    return LlamaForCausalLM(config).double()


def _run(trainer_class, tokenizer, pairs, tmp_path, steps=10, **options):
    layout = options.pop("preference_layout", None)
    settings = {"per_device_train_batch_size": 4, "max_steps": steps, "learning_rate": 1e-3,
                "logging_steps": 1, "report_to": [], "save_strategy": "no", "seed": 0, "data_seed": 0,
                "use_cpu": True, "max_length": 512}  # fmt: skip
    args = trl.DPOConfig(output_dir=str(tmp_path / (layout or "trl")), **settings, **options)
    extra = {} if layout is None else {"preference_layout": layout}
    ref = None if options.get("precompute_ref_log_probs") else _model(1)
    inputs = {"ref_model": ref, "args": args, "train_dataset": pairs, "processing_class": tokenizer}
    trainer = trainer_class(_model(0), **inputs, **extra)
    trainer.train()
    # TRL trains in bfloat16 autocast on CPU by default: nothing may leave it switched on afterwards
    assert not torch.is_autocast_enabled("cpu")
    return [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]


@pytest.fixture(scope="module")
def unpacked(tokenizer, pairs, tmp_path_factory):
    return _run(trl.DPOTrainer, tokenizer, pairs, tmp_path_factory.mktemp("dpo"))


def _assert_same_steps(packed, unpacked):
    assert len(packed) == len(unpacked) == 10
    for step, (ours, theirs) in enumerate(zip(packed, unpacked, strict=True)):
        for key in COMPARED:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-9), (
                step,
                key,
                ours[key],
                theirs[key],
            )


@pytest.mark.parametrize("layout", ["shared-prefix", "pairs"])
def test_ten_steps_equal_trls_own_padded_run(layout, tokenizer, pairs, unpacked, tmp_path):
    packed = _run(PackedDPOTrainer, tokenizer, pairs, tmp_path, preference_layout=layout)
    _assert_same_steps(packed, unpacked)
    assert unpacked[0]["loss"] != unpacked[-1]["loss"], "the run trains: the loss moves"


def test_precomputed_reference_log_probs_and_the_ipo_loss(tokenizer, pairs, tmp_path):
    options = {"precompute_ref_log_probs": True, "loss_type": ["ipo"]}
    theirs = _run(trl.DPOTrainer, tokenizer, pairs, tmp_path / "trl", **options)
    ours = _run(
        PackedDPOTrainer, tokenizer, pairs, tmp_path / "ours", preference_layout="shared-prefix", **options
    )
    _assert_same_steps(ours, theirs)


def test_pairs_whose_prompts_differ_after_truncation_are_packed_apart():
    """TRL's keep_end truncation can cut chosen and rejected to different prompts: each row is then
    a unit of its own, and every target still goes back to its row and column."""
    ids = torch.tensor([[1, 2, 3, 9, 0], [2, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    completion = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    packed = pack_padded_pairs(ids, mask, completion, "shared-prefix")
    assert packed.row["branch_group_size"].tolist() == [1, 1]
    assert packed.rows.tolist() == [0, 0, 1, 1, 1] and packed.columns.tolist() == [1, 2, 1, 2, 3]
    logits_free = torch.arange(packed.row["input_ids"].shape[1], dtype=torch.float64)[None]
    unpacked = packed.unpack(logits_free)
    assert unpacked.shape == (2, 4) and (unpacked != 0).sum() == 5


def test_a_row_without_a_completion_token_is_refused():
    ids, mask = torch.tensor([[1, 2], [1, 3]]), torch.tensor([[1, 1], [1, 1]])
    with pytest.raises(TightpackError, match="DPO row 0 has no completion token"):
        pack_padded_pairs(ids, mask, torch.tensor([[0, 0], [0, 1]]), "pairs")
