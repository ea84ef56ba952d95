"""Text SFT collators: the worked examples of contract 3.4, real rows, and the dataloader rule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.tokenize import Encoder
from tightpack.runtime.sft_collate import TextSFTCollator, check_in_batch_loader

F, T = False, True
SAMPLES = [
    (np.array([11, 21, 22]), np.array([0, 1, 1])),
    (np.array([11, 12, 21, 22]), np.array([0, 0, 1, 1])),
]


def test_worked_example_packed_without_alignment(gpt2):
    batch = TextSFTCollator(gpt2, enable_in_batch_packing=True, pad_token_id=0).collate_tokenized(SAMPLES)
    assert (
        batch["tokens"].tolist() == [[11, 21, 22, 11, 12, 21, 22]] and batch["tokens"] is batch["input_ids"]
    )
    assert batch["labels"].tolist() == [[21, 22, -100, -100, 21, 22, -100]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert batch["cu_seqlens_q"].tolist() == [0, 3, 7] and int(batch["max_seqlen_q"]) == 4
    assert not any(key.endswith("_padded") or key in ("cu_seqlens", "max_seqlen") for key in batch)
    assert batch["token_count"] == [3, 4]


@pytest.mark.parametrize("fixed", [False, True])
def test_worked_example_packed_with_alignment_four(gpt2, fixed):
    settings = {"enable_in_batch_packing": True, "in_batch_packing_pad_to_multiple_of": 4, "pad_token_id": 0}
    collator = TextSFTCollator(gpt2, pad_to_max_length=fixed, max_length=16 if fixed else None, **settings)
    batch = collator.collate_tokenized(SAMPLES)
    assert batch["tokens"].tolist() == [[11, 21, 22, 0, 11, 12, 21, 22]]
    assert batch["cu_seqlens_q"].tolist() == [0, 3, 7] and batch["cu_seqlens_q_padded"].tolist() == [0, 4, 8]
    assert batch["padding_mask"].tolist() == [[F, F, F, T, F, F, F, F]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch["total_tokens"] == 8  # the packed width is emergent: pad_to_max_length does not apply


@pytest.mark.parametrize(
    ("loss_mode", "loss_on"), [("assistant", "assistant"), ("last_turn", "last-turn"), ("full", "all")]
)
def test_real_chat_rows_keep_the_offline_supervision(gpt2, chat_rows, loss_mode, loss_on):
    rows = chat_rows[:6]
    batch = TextSFTCollator(gpt2, loss_mode=loss_mode, enable_in_batch_packing=True)(rows)
    encoded = Encoder(gpt2, FormatConfig(loss_on=loss_on)).encode_rows(rows)
    bounds = np.concatenate(([0], np.cumsum(encoded.lengths)))
    expected = sum(int(encoded.loss_mask[a + 1 : b].sum()) for a, b in itertools.pairwise(bounds))
    assert int(batch["loss_mask"].sum()) == expected > 0
    assert batch["token_count"] == encoded.lengths.tolist()
    labels, mask = batch["labels"][0], batch["loss_mask"][0]
    assert ((labels == -100) == (mask == 0)).all()
    tokens = batch["tokens"][0]
    supervised = np.flatnonzero(mask.numpy())
    assert (labels[supervised] == tokens[supervised + 1]).all()  # each target is the next token


def test_padded_path(gpt2, prompt_completion_rows):
    rows = prompt_completion_rows[:4]
    batch = TextSFTCollator(gpt2, pad_to_multiple_of=8, max_length=64)(rows)
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width <= 64 and width >= max(batch["token_count"])
    assert (
        batch["attention_mask"].dtype.is_floating_point is False
        and batch["loss_mask"].dtype.is_floating_point
    )
    assert batch["attention_mask"].sum(1).tolist() == batch["token_count"]
    fixed = TextSFTCollator(gpt2, pad_to_max_length=True, max_length=64)(rows)
    assert fixed["input_ids"].shape == (4, 64)


def test_bad_rows_are_refused(gpt2):
    with pytest.raises(TightpackError, match="missing key 'output'"):
        TextSFTCollator(gpt2, format=FormatConfig(format="prompt-completion"))([{"input": "x"}])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataloader_type": "batch", "micro_batch_size": 4}, "needs dataloader_type 'single' or 'cyclic'"),
        ({"dataloader_type": "cyclic", "micro_batch_size": 1}, "micro_batch_size is 1, set it above 1"),
    ],
)
def test_dataloader_rule(kwargs, message):
    with pytest.raises(TightpackError, match=message):
        check_in_batch_loader(enable_in_batch_packing=True, **kwargs)
    check_in_batch_loader(enable_in_batch_packing=False, **kwargs)
    check_in_batch_loader(enable_in_batch_packing=True, dataloader_type="single", micro_batch_size=2)
