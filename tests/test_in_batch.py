"""In-batch THD packing (contract 3.1, 3.2) against the reference's own test cases (contract 8.3)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.runtime.in_batch import build_thd_from_rows, pack_right_padded_batch

F, T = False, True


def rows_of(*lengths, labels=True, start=1):
    rows, value = [], start
    for length in lengths:
        ids = torch.arange(value, value + length)
        row = {"input_ids": ids, "position_ids": torch.arange(length)}
        if labels:
            row |= {"labels": ids + 100, "loss_mask": torch.ones(length)}
        rows.append(row)
        value += length
    return rows


def right_padded(lengths, width, pad=0):
    tokens = torch.full((len(lengths), width), pad)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.arange(1, n + 1) + 10 * i
    positions = torch.arange(width).repeat(len(lengths), 1)
    labels = torch.where(tokens != pad, tokens + 1, -100)
    loss = (tokens != pad).float()
    return {"input_ids": tokens, "position_ids": positions, "labels": labels, "loss_mask": loss}


def test_basic_packing():
    packed = build_thd_from_rows(rows_of(3, 4))
    assert packed["input_ids"].shape == (1, 7)
    assert packed["cu_seqlens_q"].tolist() == [0, 3, 7] and packed["cu_seqlens_kv"] is packed["cu_seqlens_q"]
    assert int(packed["max_seqlen_q"]) == 4 and packed["attention_mask"] is None
    assert "cu_seqlens_q_padded" not in packed and packed["total_tokens"] == 7
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]


def test_fixed_width_pads_the_final_segment():
    batch = right_padded([3, 2], 4)
    batch["input_ids"][:, :3] = torch.tensor([[1, 2, 3], [4, 5, 0]])
    batch["labels"] = torch.tensor([[2, 3, -100, -100], [5, -100, -100, -100]])
    batch["loss_mask"] = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    rows = [{key: batch[key][i, :n] for key in ("input_ids", "position_ids", "labels", "loss_mask")}
            for i, n in enumerate([3, 2])]  # fmt: skip
    packed = build_thd_from_rows(rows, sequence_length=8, pad_to_max_length=True)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert packed["labels"].tolist() == [[2, 3, -100, 5, -100, -100, -100, -100]]
    assert packed["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert packed["cu_seqlens_q"].tolist() == [0, 3, 5] and packed["cu_seqlens_q_padded"].tolist() == [
        0,
        3,
        8,
    ]
    assert int(packed["max_seqlen_q"]) == 5 and packed["total_tokens"] == 8
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


def test_fixed_width_rejects_an_aggregate_over_the_sequence_length():
    with pytest.raises(ValueError, match="Packed sequence length 9 exceeds configured sequence_length 8"):
        build_thd_from_rows(rows_of(5, 4), sequence_length=8, pad_to_max_length=True)


@pytest.mark.parametrize(
    ("lengths", "multiple", "physical", "longest"),
    [((3, 5), 2, [0, 4, 10], 6), ((2, 3), 4, [0, 4, 8], 4), ((3, 5), 4, [0, 4, 12], 8), ((4, 4), 4, None, 4)],
)
def test_alignment_to_a_multiple(lengths, multiple, physical, longest):
    packed = build_thd_from_rows(rows_of(*lengths), pad_to_multiple_of=multiple)
    if physical is None:
        assert "cu_seqlens_q_padded" not in packed
    else:
        assert (
            packed["cu_seqlens_q_padded"].tolist() == physical
            and packed["input_ids"].shape[1] == physical[-1]
        )
    assert int(packed["max_seqlen_q"]) == longest and packed["max_seqlen_q"].device.type == "cpu"


def test_padding_mask_marks_only_the_alignment_gaps():
    packed = build_thd_from_rows(rows_of(3, 2), pad_to_multiple_of=4, emit_padding_mask=True)
    assert packed["padding_mask"].tolist() == [[F, F, F, T, F, F, T, T]]
    assert packed["cu_seqlens_q"].tolist() == [0, 3, 5] and packed["cu_seqlens_q_padded"].tolist() == [
        0,
        4,
        8,
    ]
    assert packed["labels"][0, 3].item() == -100 and packed["loss_mask"][0, 3].item() == 0
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]  # tails continue last+1, ...


def test_labels_and_loss_mask_may_be_absent_from_every_row():
    packed = build_thd_from_rows(rows_of(3, 5, labels=False), pad_to_multiple_of=4)
    assert "labels" not in packed and "loss_mask" not in packed
    assert packed["cu_seqlens_q_padded"].tolist() == [0, 4, 12] and int(packed["max_seqlen_q"]) == 8


def test_extra_keys_get_their_own_pad_value_and_dtypes_are_kept():
    rows = rows_of(3, 2)
    for row in rows:
        row["token_type"] = torch.full((len(row["input_ids"]),), 7, dtype=torch.int8)
    packed = build_thd_from_rows(rows, pad_to_multiple_of=4, sequence_tensor_pad_values={"token_type": -1})
    assert (
        packed["token_type"].tolist() == [[7, 7, 7, -1, 7, 7, -1, -1]]
        and packed["token_type"].dtype == torch.int8
    )
    assert packed["loss_mask"].dtype == torch.float32 and packed["cu_seqlens_q"].dtype == torch.int32


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([], {}, "Cannot pack an empty sequence row list."),
        (rows_of(3), {"pad_to_multiple_of": 0}, "pad_to_multiple_of must be >= 1."),
        (rows_of(3), {"sequence_length": 0}, "sequence_length must be >= 1."),
        (rows_of(3), {"pad_to_max_length": True}, "sequence_length must be set when pad_to_max_length=True."),
        (
            rows_of(3),
            {"sequence_tensor_pad_values": {"labels": 0}},
            "must not replace standard sequence tensors",
        ),
        (
            [{"input_ids": torch.ones(2, 2), "position_ids": torch.arange(2)}],
            {},
            "'input_ids' must be a 1D tensor",
        ),
        (
            [{"input_ids": torch.ones(0), "position_ids": torch.ones(0)}],
            {},
            "Cannot pack an empty sequence row.",
        ),
        (
            rows_of(5),
            {"sequence_length": 4},
            "Packed sequence row length 5 exceeds configured sequence_length 4.",
        ),
        ([{"input_ids": torch.ones(2)}], {}, "requires a position_ids row"),
        (
            [{"input_ids": torch.ones(2), "position_ids": torch.arange(3)}],
            {},
            "'position_ids' must be a 1D tensor matching",
        ),
        (
            [
                {
                    "input_ids": torch.ones(2),
                    "position_ids": torch.arange(2),
                    "attention_mask": torch.tensor([1, 0]),
                }
            ],
            {},
            "requires unpadded input rows",
        ),
        (
            [*rows_of(2), *rows_of(2, labels=False)],
            {},
            "'labels' must be present for every sequence row or omitted",
        ),
    ],
)
def test_validation_errors(rows, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_thd_from_rows(rows, **kwargs)


def test_right_padded_batch_is_packed_in_place():
    batch = right_padded([3, 2], 4)
    batch["tokens"] = batch["input_ids"]
    batch["padding_mask"] = torch.zeros(2, 4, dtype=torch.bool)  # stale: must go
    pack_right_padded_batch(batch)
    assert batch["tokens"] is batch["input_ids"]
    assert batch["tokens"].tolist() == [[1, 2, 3, 11, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seqlens_q"].tolist() == [0, 3, 5]
    assert (
        "padding_mask" not in batch and "cu_seqlens_q_padded" not in batch and batch["attention_mask"] is None
    )


def test_right_padded_lengths_from_the_attention_mask():
    batch = right_padded([3, 2], 4)
    batch["attention_mask"] = (batch["input_ids"] != 0).long()
    batch["input_ids"][0, 1] = 0  # a real token equal to the pad id: the mask, not the ids, decides
    pack_right_padded_batch(batch, pad_to_multiple_of=4, emit_padding_mask=True)
    assert batch["cu_seqlens_q"].tolist() == [0, 3, 5] and batch["cu_seqlens_q_padded"].tolist() == [0, 4, 8]
    assert batch["padding_mask"].tolist() == [[F, F, F, T, F, F, T, T]]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda b: b.update(input_ids=torch.tensor([[0, 1, 2, 0], [1, 2, 0, 0]])),
            "requires right-padded input rows",
        ),
        (
            lambda b: b.update(input_ids=torch.tensor([[1, 2, 3, 0], [0, 0, 0, 0]])),
            "Cannot pack a batch containing an empty sequence row",
        ),
        (lambda b: b.pop("input_ids"), "must contain a 2D 'input_ids' or 'tokens' tensor"),
        (lambda b: b.update(input_ids=torch.ones(4)), "expects a 2D token tensor"),
        (lambda b: b.update(position_ids=torch.arange(4)), "expects 2D 'position_ids' matching token shape"),
        (lambda b: b.update(labels=torch.ones(2, 3)), "'labels' must match token shape"),
    ],
)
def test_right_padded_errors(edit, message):
    batch = right_padded([3, 2], 4)
    edit(batch)
    with pytest.raises(ValueError, match=message):
        pack_right_padded_batch(batch)


def test_non_packed_policy_pads_to_a_multiple_and_continues_positions():
    from tightpack.runtime.in_batch import prepare_sequence_batch

    batch = right_padded([3, 2], 5)
    batch["attention_mask"] = (batch["input_ids"] != 0).long()
    prepare_sequence_batch(batch, sequence_length=16, pad_to_multiple_of=4)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert batch["labels"][0, 5:].tolist() == [-100] * 3 and batch["loss_mask"][0, 5:].tolist() == [0.0] * 3
    assert batch["attention_mask"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch["position_ids"][0].tolist() == list(range(8))
    fixed = right_padded([3, 2], 5)
    prepare_sequence_batch(fixed, sequence_length=12, pad_to_max_length=True)
    assert fixed["input_ids"].shape == (2, 12)


def test_non_packed_policy_truncates_and_refuses_to_lose_all_supervision():
    from tightpack.runtime.in_batch import pad_or_truncate_batch

    batch = right_padded([6, 2], 6)
    pad_or_truncate_batch(batch, sequence_length=4)
    assert batch["input_ids"].shape == (2, 4)
    lossy = right_padded([6, 2], 6)
    lossy["loss_mask"][0, :4] = 0  # row 0 is supervised only at positions 4 and 5
    with pytest.raises(
        ValueError, match=r"from 6 to 4 tokens removed every supervised token from rows \[0\]"
    ):
        pad_or_truncate_batch(lossy, sequence_length=4)
    with pytest.raises(ValueError, match="sequence_length must be >= 1"):
        pad_or_truncate_batch(right_padded([2], 2), sequence_length=0)


def test_packing_path_of_the_policy():
    from tightpack.runtime.in_batch import prepare_sequence_batch

    batch = right_padded([3, 2], 4)
    settings = {"enable_in_batch_packing": True, "in_batch_packing_pad_to_multiple_of": 4}
    prepare_sequence_batch(batch, sequence_length=8, emit_packed_padding_mask=True, **settings)
    assert batch["cu_seqlens_q_padded"].tolist() == [0, 4, 8] and batch["padding_mask"].shape == (1, 8)


@settings(max_examples=3 * settings.default.max_examples, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    multiple=st.integers(1, 8),
    fixed=st.booleans(),
    labels=st.booleans(),
)
def test_property_every_token_appears_once_at_its_physical_offset(lengths, multiple, fixed, labels):
    rows = rows_of(*lengths, labels=labels)
    aligned = [-(-n // multiple) * multiple for n in lengths]
    width = sum(aligned) + 3 if fixed else None
    packed = build_thd_from_rows(
        rows,
        pad_to_multiple_of=multiple,
        sequence_length=width,
        pad_to_max_length=fixed,
        emit_padding_mask=True,
    )
    logical = packed["cu_seqlens_q"].tolist()
    physical = packed.get("cu_seqlens_q_padded", packed["cu_seqlens_q"]).tolist()
    assert logical == [0, *itertools.accumulate(lengths)]
    assert physical[-1] == packed["total_tokens"] == packed["input_ids"].shape[1] == (width or sum(aligned))
    assert ("cu_seqlens_q_padded" in packed) == (physical != logical)
    assert int(packed["max_seqlen_q"]) == max(b - a for a, b in itertools.pairwise(physical))
    tokens, positions = packed["input_ids"][0], packed["position_ids"][0]
    padding = packed["padding_mask"][0]
    for row, start, stop in zip(rows, physical[:-1], physical[1:], strict=True):
        n = len(row["input_ids"])
        assert torch.equal(tokens[start : start + n], row["input_ids"])
        assert positions[start:stop].tolist() == list(range(stop - start))  # tails continue last+1
        assert not padding[start : start + n].any() and padding[start + n : stop].all()
        assert (tokens[start + n : stop] == 0).all()
        if labels:
            assert torch.equal(packed["labels"][0, start : start + n], row["labels"])
            assert (packed["labels"][0, start + n : stop] == -100).all()
            assert (packed["loss_mask"][0, start + n : stop] == 0).all()
    assert int((~padding).sum()) == sum(lengths)
