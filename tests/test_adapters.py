"""THD batches to Megatron-Core's PackedSeqParams, with the real megatron-core."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams as MegatronPackedSeqParams

from tightpack.errors import TightpackError
from tightpack.runtime import adapters, thd
from tightpack.runtime.adapters import to_packed_seq_params
from tightpack.runtime.collate import PackedCollate


def row(ids, starts):
    return {"input_ids": ids, "loss_mask": [1] * len(ids), "seq_start_id": starts}


ALIGNED = [row([10, 11, 12, 2, 2, 20, 21, 2, 2, 2], [0, 5])]


def collate(**kwargs):
    return PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1, **kwargs)


def test_current_keys_with_alignment():
    params = to_packed_seq_params(collate(pad_seq_to_mult=4)(ALIGNED))
    assert isinstance(params, MegatronPackedSeqParams)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 5]
    assert params.cu_seqlens_kv.tolist() == [0, 3, 5]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert params.cu_seqlens_kv_padded.tolist() == [0, 4, 8]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (4, 4)
    assert type(params.max_seqlen_q) is int


def test_legacy_keys_convert_to_the_same_params():
    current = to_packed_seq_params(collate(pad_seq_to_mult=4)(ALIGNED))
    legacy = to_packed_seq_params(collate(pad_seq_to_mult=4, legacy_keys=True)(ALIGNED))
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(legacy, field).tolist() == getattr(current, field).tolist()
    assert legacy.max_seqlen_q == current.max_seqlen_q


def test_unaligned_batches_have_no_padded_boundaries():
    batch = collate()([row([1, 3, 4, 2, 5, 6, 7, 2], [0, 4])])
    params = to_packed_seq_params(batch)
    assert params.cu_seqlens_q.tolist() == [0, 3, 6]
    assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
    legacy = to_packed_seq_params(collate(legacy_keys=True)([row([1, 3, 4, 2, 5, 6, 7, 2], [0, 4])]))
    assert legacy.cu_seqlens_q.tolist() == [0, 3, 6] and legacy.cu_seqlens_q_padded is None


def test_padded_boundaries_equal_to_the_logical_ones_are_dropped():
    cu = torch.tensor([[0, 4, 8]], dtype=torch.int32)
    longest = torch.tensor([[4]], dtype=torch.int32)
    batch = {"cu_seqlens_q": cu, "cu_seqlens_q_padded": cu.clone(), "max_seqlen_q": longest}
    params = to_packed_seq_params(batch)
    assert params.cu_seqlens_q_padded is None


def test_kv_defaults_to_q():
    batch = {"cu_seqlens_q": torch.tensor([0, 2, 5], dtype=torch.int32), "max_seqlen_q": 3}
    params = to_packed_seq_params(batch)
    assert params.cu_seqlens_kv.tolist() == [0, 2, 5] and params.max_seqlen_kv == 3


def test_legacy_trimming_without_argmin():
    longest = torch.tensor([[4]], dtype=torch.int32)
    with_sentinel = {"cu_seqlens": torch.tensor([[0, 4, 6, 8, -1, -1]]).int(), "max_seqlen": longest}
    assert to_packed_seq_params(with_sentinel).cu_seqlens_q.tolist() == [0, 4, 6, 8]
    # No -1 at all: the reference's argmin slice would be empty; the whole row is kept here.
    without_sentinel = {"cu_seqlens": torch.tensor([[0, 4, 6, 8]]).int(), "max_seqlen": longest}
    assert to_packed_seq_params(without_sentinel).cu_seqlens_q.tolist() == [0, 4, 6, 8]


def test_legacy_trimming_uses_argmin_when_given():
    batch = {
        "cu_seqlens": torch.tensor([[0, 4, 6, 8, -1]]).int(),
        "cu_seqlens_argmin": torch.tensor([[3]]),
        "max_seqlen": torch.tensor([[4]]).int(),
    }
    with thd.checking(False):  # an argmin short of the first -1 breaks the contract: it shows argmin decides
        assert to_packed_seq_params(batch).cu_seqlens_q.tolist() == [0, 4, 6]


def test_without_megatron_core_the_tightpack_dataclass_carries_the_same_fields():
    params = to_packed_seq_params(collate(pad_seq_to_mult=4)(ALIGNED), megatron=False)
    assert isinstance(params, adapters.PackedSeqParams)
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert params.total_tokens == 8
    megatron_fields = {f.name for f in adapters.dataclasses.fields(MegatronPackedSeqParams)}
    ours = {f.name for f in adapters.dataclasses.fields(adapters.PackedSeqParams)}
    assert {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
            "max_seqlen_q", "max_seqlen_kv"} <= ours & megatron_fields  # fmt: skip


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        ({"cu_seqlens_q": torch.tensor([[0, 3], [0, 4]]), "max_seqlen_q": 4}, TightpackError,
         "micro-batch size 1"),
        ({"cu_seqlens_q": torch.tensor([0, 3]), "max_seqlen_q": torch.tensor([[3], [4]])}, ValueError,
         "max_seqlen_q must contain exactly one value"),
        ({"tokens": torch.zeros(1, 4)}, TightpackError, "no packed boundaries"),
    ],
)  # fmt: skip
def test_errors(batch, error, message):
    # The adapter's own errors: these batches break the contract on purpose, so the validator is off.
    with thd.checking(False), pytest.raises(error, match=message):
        to_packed_seq_params(batch)
