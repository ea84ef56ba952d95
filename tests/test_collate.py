"""The offline collate against the worked examples of the contract (section 2.10) and real packed files."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.runtime.collate import PackedCollate, PackingMetadata
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.samplers import PackedBatchSampler

from .conftest import write_jsonl

F, T = False, True


def row(ids, starts, mask=None, **extra):
    return {"input_ids": ids, "loss_mask": mask or [1] * len(ids), "seq_start_id": starts, **extra}


def test_different_sequence_counts():
    rows = [row([1, 3, 4, 2, 5, 6, 7, 2], [0, 4]), row([1, 3, 4, 5, 6, 7, 8, 2], [0])]
    batch = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1)(rows)
    assert batch["cu_seqlens_q"].tolist() == [[0, 3, 6, 7], [0, 7, 7, 7]]
    assert batch["cu_seqlens_kv"] is batch["cu_seqlens_q"]
    assert batch["max_seqlen_q"].tolist() == [[3], [7]]
    assert batch["padding_mask"].tolist() == [[F] * 6 + [T], [F] * 7]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6]]
    assert batch["tokens"].tolist()[0] == [1, 3, 4, 5, 6, 7, 2]
    assert batch["labels"].tolist()[0] == [3, 4, 2, 6, 7, 2, 2]
    assert "cu_seqlens_q_padded" not in batch
    assert batch["token_count"] == [6, 7]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 2], [0] * 7]
    assert batch["total_tokens"] == 7


def test_default_width_multiple_of_16_caps_at_the_pack_size():
    rows = [row([1, 3, 4, 2, 5, 6, 7, 2], [0, 4]), row([1, 3, 4, 5, 6, 7, 8, 2], [0])]
    batch = PackedCollate(pack_size=8, eos_id=2)(rows)
    assert batch["cu_seqlens_q"].tolist() == [[0, 3, 6, 8], [0, 7, 8, 8]]
    assert batch["padding_mask"].tolist() == [[F] * 6 + [T, T], [F] * 7 + [T]]


def test_aligned_row():
    rows = [row([10, 11, 12, 2, 2, 20, 21, 2, 2, 2], [0, 5])]
    batch = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1, pad_seq_to_mult=4)(rows)
    assert batch["tokens"].tolist() == [[10, 11, 12, 2, 20, 21, 2, 2]]
    assert batch["cu_seqlens_q"].tolist() == [[0, 3, 5]]
    assert batch["cu_seqlens_q_padded"].tolist() == [[0, 4, 8]]
    assert batch["cu_seqlens_kv_padded"] is batch["cu_seqlens_q_padded"]
    assert batch["padding_mask"].tolist() == [[F, F, F, T, F, F, T, T]]
    assert batch["max_seqlen_q"].tolist() == [[4]]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]  # alignment padding stays in its segment


def test_aligned_row_uses_stored_seq_len_over_eos_stripping():
    # The first sample really ends with an EOS token of its own: stripping would undercount it.
    rows = [row([10, 2, 2, 2, 2, 20, 21, 2, 2, 2], [0, 5], seq_len=[2, 2])]
    batch = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1, pad_seq_to_mult=4)(rows)
    assert batch["cu_seqlens_q"].tolist() == [[0, 2, 4]]
    stripped = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1, pad_seq_to_mult=4)(
        [row([10, 2, 2, 2, 2, 20, 21, 2, 2, 2], [0, 5])]
    )
    assert stripped["cu_seqlens_q"].tolist() == [[0, 1, 3]]


def test_fixed_width_without_alignment():
    batch = PackedCollate(pack_size=8, eos_id=2, pad_to_max_length=True)([row([10, 11, 12, 2], [0])])
    assert batch["tokens"].tolist() == [[10, 11, 12, 2, 2, 2, 2, 2]]
    assert batch["cu_seqlens_q"].tolist() == [[0, 3, 8]]
    assert "cu_seqlens_q_padded" not in batch
    assert batch["padding_mask"].tolist() == [[F, F, F, T, T, T, T, T]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]


def test_static_shapes_with_pad_cu_seqlens():
    metadata = PackingMetadata.from_entries(
        [{"max_samples_per_bin": 3, "dataset_max_seqlen": 5, "min_packed_seqlen": 2},
         {"max_samples_per_bin": 2, "dataset_max_seqlen": 4, "min_packed_seqlen": 3}]
    )  # fmt: skip
    collate = PackedCollate(
        pack_size=8, eos_id=2, pad_to_max_length=True, pad_cu_seqlens=True, metadata=metadata
    )
    batch = collate([row([10, 11, 12, 2], [0]), row([5, 2, 6, 7, 2], [0, 2])])
    assert batch["cu_seqlens_q"].tolist() == [[0, 3, 8, 8, 8], [0, 1, 3, 8, 8]]
    assert batch["max_seqlen_q"].tolist() == [6, 6]  # max(5, 8 - 2)


def test_loss_on_every_non_eos_input():
    batch = PackedCollate(pack_size=8, eos_id=2, answer_only_loss=False)(
        [row([5, 2, 6, 7, 2], [0, 2], mask=[0] * 5)]
    )
    assert batch["tokens"].tolist() == [[5, 6, 7, 2, 2, 2, 2, 2]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pad_cu_seqlens": True, "pad_to_max_length": True}, "pad_cu_seqlens needs the packing metadata"),
        (
            {"pad_cu_seqlens": True, "metadata": PackingMetadata(2, 4, 1)},
            "'pad_to_max_length=True' is required",
        ),
        ({"pad_seq_to_mult": 0}, "pad_seq_to_mult must be a positive integer, got 0"),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(TightpackError, match=message):
        PackedCollate(pack_size=8, eos_id=2, **kwargs)


def test_rows_over_the_pack_size_are_refused():
    with pytest.raises(TightpackError, match="holds 9 runtime tokens, more than the pack size 8"):
        PackedCollate(pack_size=8, eos_id=2, pad_to_max_length=True)([row(list(range(3, 13)), [0])])


@pytest.mark.parametrize("multiple", [1, 4])
def test_pipeline_output_collates_to_the_manifest_counts(tmp_path, chat_rows, multiple):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    result = pack_dataset(
        [source], tmp_path / "out", PackConfig(packed_sequence_size=256, pad_seq_to_mult=multiple)
    )
    rows = pq.read_table(next((tmp_path / "out").glob("*.parquet"))).to_pylist()
    metadata = PackingMetadata.from_entries(json.loads((tmp_path / "out" / "metadata.json").read_text()))
    collate = PackedCollate(pack_size=256, eos_id=50256, pad_seq_to_mult=multiple, pad_to_max_length=True,
                            pad_cu_seqlens=True, metadata=metadata)  # fmt: skip
    batch = collate(rows)
    assert int(batch["loss_mask"].sum()) == result.counts["supervised_packed"]
    assert int((~batch["padding_mask"]).sum()) == result.counts["tokens_packed"]
    real = np.diff(batch["cu_seqlens_q"].numpy(), axis=1)
    assert int(real.sum()) == result.counts["tokens_packed"] + (
        0 if multiple > 1 else int(batch["padding_mask"].sum())
    )
    assert batch["cu_seqlens_q"].shape[1] == metadata.max_samples_per_bin + 2


def test_legacy_keys():
    rows = [row([10, 11, 12, 2, 2, 20, 21, 2, 2, 2], [0, 5]), row([30, 31, 2, 2, 2], [0])]
    collate = PackedCollate(
        pack_size=8, eos_id=2, pad_seq_length_to_mult=1, pad_seq_to_mult=4, legacy_keys=True
    )
    batch = collate(rows)
    assert batch["cu_seqlens"].tolist() == [[0, 4, 8, -1], [0, 4, 8, -1]]
    assert batch["cu_seqlens_argmin"].tolist() == [[3], [3]]
    assert batch["cu_seqlens_unpadded"].tolist() == [[0, 3, 5, -1], [0, 2, 2, -1]]
    assert batch["cu_seqlens_unpadded_argmin"].tolist() == [[3], [3]]
    assert batch["max_seqlen"].tolist() == [[4], [4]]
    assert not any(key.startswith("cu_seqlens_q") or key.startswith("max_seqlen_") for key in batch)
    assert (
        batch["tokens"].tolist()
        == PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1, pad_seq_to_mult=4)(rows)[
            "tokens"
        ].tolist()
    )


def test_legacy_keys_without_alignment_have_no_unpadded_boundaries():
    batch = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1, legacy_keys=True)(
        [row([1, 3, 4, 2, 5, 6, 7, 2], [0, 4])]
    )
    assert batch["cu_seqlens"].tolist() == [[0, 3, 6, -1]]
    assert batch["cu_seqlens_argmin"].tolist() == [[3]]
    assert "cu_seqlens_unpadded" not in batch


def test_split_microbatches_gives_one_packed_row_each():
    from tightpack.runtime.adapters import to_packed_seq_params
    from tightpack.runtime.collate import split_microbatches

    rows = [row([1, 3, 4, 2, 5, 6, 7, 2], [0, 4]), row([1, 3, 4, 5, 6, 7, 8, 2], [0]), row([9, 2], [0])]
    batch = PackedCollate(pack_size=8, eos_id=2, pad_seq_length_to_mult=1)(rows)
    parts = split_microbatches(batch, 3)
    assert [part["tokens"].shape for part in parts] == [(1, 7)] * 3
    assert parts[1]["cu_seqlens_q"].tolist() == [[0, 7, 7, 7]] and parts[1]["max_seqlen_q"].tolist() == [[7]]
    assert [part["token_count"] for part in parts] == [[6], [7], [1]]
    assert all(part["total_tokens"] == 7 for part in parts)
    params = to_packed_seq_params(parts[0], megatron=False)
    assert params.cu_seqlens_q.tolist() == [0, 3, 6, 7] and params.max_seqlen_q == 3
    with pytest.raises(ValueError, match="Batch size 3 is not divisible by num_microbatches 2"):
        split_microbatches(batch, 2)


def test_padding_rows_add_no_loss_when_the_mask_is_rebuilt_from_tokens(tmp_path, chat_rows):
    # The sampler pads the last global batch with -1; PackedDataset gives such a row real tokens and a
    # zero mask. With answer_only_loss=False the collate rebuilds the mask from the tokens (as the
    # reference does), so it must know the row is padding instead of reading it off the mask.
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=256, workers=1))
    dataset = PackedDataset(tmp_path / "out", cache_dir=tmp_path / "cache")
    sampler = PackedBatchSampler(len(dataset), dataloader_type="batch", micro_batch_size=1,
                                 global_batch_size=len(dataset) - 1, drop_last=False)  # fmt: skip
    indices = list(sampler)[-1]
    assert indices[0] >= 0 and indices[1:] == [-1] * (len(dataset) - 2)
    rows = [dataset[i] for i in indices]

    every_token = PackedCollate(pack_size=256, eos_id=50256, answer_only_loss=False, pad_to_max_length=True)
    batch = every_token(rows)
    assert not batch["loss_mask"][1:].any()
    real = every_token([dataset[indices[0]], dataset[len(dataset) - 1]])
    assert batch["loss_mask"][0].tolist() == real["loss_mask"][0].tolist()
    assert real["loss_mask"][0].any() and real["loss_mask"][1].any()  # the same tokens, not padding
    assert batch["tokens"][1].tolist() == real["tokens"][1].tolist()

    # answer_only_loss=True already had zero loss there: the reference's rows (no marker) give the same.
    answer_only = PackedCollate(pack_size=256, eos_id=50256, pad_to_max_length=True)
    unmarked = [{key: value for key, value in r.items() if key != "padding_row"} for r in rows]
    ours, reference = answer_only(rows), answer_only(unmarked)
    assert ours.keys() == reference.keys()
    for key, value in ours.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, reference[key]), key
        else:
            assert value == reference[key], key
    assert not ours["loss_mask"][1:].any() and ours["loss_mask"][0].any()


def test_logical_lengths_from_seq_len_where_eos_stripping_cuts_a_supervised_token(tmp_path):
    # A sample whose content ends with the EOS id (a template closing its turn with EOS), then the EOS
    # every sample ends with: stored [10, 11, EOS, EOS] (runtime length 3), aligned to 4 with one more
    # EOS. Its inputs are [10, 11, EOS, EOS(pad)]; the third one (EOS -> EOS) is supervised.
    eos = 50256
    samples = [
        {"input_ids": [10, 11, eos, eos], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [20, 21, 22], "loss_mask": [0, 1, 1]},  # EOS appended: both rules agree
    ]
    config = PackConfig(packed_sequence_size=4, pad_seq_to_mult=4, format=FormatConfig(format="tokens"),
                        workers=1)  # fmt: skip
    pack_dataset(samples, tmp_path / "out", config)
    dataset = PackedDataset(tmp_path / "out", cache_dir=tmp_path / "cache")
    rows = sorted((dataset[i] for i in range(len(dataset))), key=lambda r: int(r["input_ids"][0]))
    assert [r["input_ids"].tolist() for r in rows] == [[10, 11, eos, eos, eos], [20, 21, 22, eos, eos]]
    assert [r["seq_len"].tolist() for r in rows] == [[3], [3]]

    collate = PackedCollate(pack_size=4, eos_id=eos, pad_seq_to_mult=4)
    ours = collate(rows)
    stripped = collate([{key: value for key, value in r.items() if key != "seq_len"} for r in rows])
    assert ours["cu_seqlens_q_padded"].tolist() == stripped["cu_seqlens_q_padded"].tolist() == [[0, 4]] * 2
    assert ours["loss_mask"].tolist() == stripped["loss_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert ours["cu_seqlens_q"].tolist() == [[0, 3], [0, 3]]
    assert ours["padding_mask"].tolist() == [[F, F, F, T], [F, F, F, T]]
    # The reference's rule: the supervised EOS input of the first sample becomes alignment padding.
    assert stripped["cu_seqlens_q"].tolist() == [[0, 2], [0, 3]]
    assert stripped["padding_mask"].tolist() == [[F, F, T, T], [F, F, F, T]]
    assert not (ours["loss_mask"].bool() & ours["padding_mask"]).any()
    assert (stripped["loss_mask"].bool() & stripped["padding_mask"]).tolist()[0] == [F, F, T, F]
