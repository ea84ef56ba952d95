"""The THD batch contract: every batch the builders emit passes `validate_thd_batch`, each kind of
corruption is refused with a message naming it, and the accessors read both layouts alike."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.alignment import ceil_to_multiple
from tightpack.runtime import thd
from tightpack.runtime.adapters import to_packed_seq_params
from tightpack.runtime.collate import PackedCollate, PackingMetadata, split_microbatches
from tightpack.runtime.context_parallel import slice_for_cp_rank, thd_partition_indices
from tightpack.runtime.hf import hf_packed_kwargs
from tightpack.runtime.in_batch import build_thd_from_rows, pack_right_padded_batch, pack_samples
from tightpack.runtime.masks import document_ids
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.thd import ThdBatchError, validate_thd_batch
from tightpack.runtime.vlm import pack_vlm_samples

from .conftest import examples

EOS = 2


def content(lengths: list[int]) -> list[list[int]]:
    """Token ids of samples with these runtime lengths; never EOS, so EOS stripping finds them whole."""
    start = 10
    samples = []
    for n in lengths:
        samples.append(list(range(start, start + n)))
        start += n
    return samples


def stored_row(lengths: list[int], multiple: int, *, seq_len: bool = True) -> dict:
    """One offline packed row as tightpack stores it: each sample's tokens, its EOS, then EOS alignment
    padding up to a runtime length that is a multiple of ``multiple``."""
    ids, starts, mask = [], [], []
    for tokens in content(lengths):
        aligned = ceil_to_multiple(len(tokens), multiple)
        starts.append(len(ids))
        ids += tokens + [EOS] * (aligned - len(tokens) + 1)
        mask += [0] + [1] * len(tokens) + [0] * (aligned - len(tokens))
    row = {"input_ids": ids, "loss_mask": mask, "seq_start_id": starts}
    return row | ({"seq_len": list(lengths)} if seq_len else {})


def stream_rows(lengths: list[int]) -> list[dict]:
    """The same samples as unpadded collate-time rows (inputs, next-token labels, positions)."""
    rows = []
    for tokens in content(lengths):
        ids = torch.tensor(tokens)
        rows.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([EOS])]),
                     "loss_mask": torch.ones(len(ids)), "position_ids": torch.arange(len(ids))})  # fmt: skip
    return rows


def metadata_of(packs: list[list[int]], multiple: int) -> PackingMetadata:
    """The metadata the pipeline writes for these packs (runtime lengths are aligned)."""
    aligned = [[ceil_to_multiple(n, multiple) for n in pack] for pack in packs]
    return PackingMetadata(
        max_samples_per_bin=max(len(pack) for pack in packs),
        dataset_max_seqlen=max(max(pack) for pack in aligned),
        min_packed_seqlen=min(sum(pack) for pack in aligned),
    )


PACKS = [[3, 5, 1], [7], [2, 2, 2, 2], [6, 4]]


# === every batch the builders emit is valid ===========================================================


@pytest.mark.parametrize("multiple", [1, 2, 4])
@pytest.mark.parametrize(("fixed", "static"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("legacy_keys", [False, True])
@pytest.mark.parametrize("seq_len", [False, True])
def test_offline_batches_and_their_micro_batches_are_valid(multiple, fixed, static, legacy_keys, seq_len):
    collate = PackedCollate(
        pack_size=32, eos_id=EOS, pad_to_max_length=fixed, pad_seq_length_to_mult=8, pad_seq_to_mult=multiple,
        pad_cu_seqlens=static, metadata=metadata_of(PACKS, multiple) if static else None,
        legacy_keys=legacy_keys,
    )  # fmt: skip
    batch = collate([stored_row(pack, multiple, seq_len=seq_len) for pack in PACKS])
    validate_thd_batch(batch)
    for micro_batches in (1, 2, 4):
        for part in split_microbatches(batch, micro_batches):
            validate_thd_batch(part)


def test_real_packed_files_with_static_shapes_are_valid(tmp_path, chat_rows):
    import json

    import pyarrow.parquet as pq

    from tightpack.offline.pipeline import PackConfig, pack_dataset

    from .conftest import write_jsonl

    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=256, pad_seq_to_mult=4))
    rows = pq.read_table(next((tmp_path / "out").glob("*.parquet"))).to_pylist()
    metadata = PackingMetadata.from_entries(json.loads((tmp_path / "out" / "metadata.json").read_text()))
    for legacy_keys in (False, True):
        collate = PackedCollate(pack_size=256, eos_id=50256, pad_seq_to_mult=4, pad_to_max_length=True,
                                pad_cu_seqlens=True, metadata=metadata, legacy_keys=legacy_keys)  # fmt: skip
        batch = collate(rows)
        validate_thd_batch(batch)  # max_seqlen is the metadata's fill, never below the longest segment
        assert thd.max_seqlen(batch, row=0) >= int(thd.physical_boundaries(batch, row=0).diff().max())


@settings(max_examples=examples(100), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    multiple=st.integers(1, 8),
    slack=st.none() | st.integers(0, 9),
    labels=st.booleans(),
    padding_mask=st.booleans(),
    extra=st.booleans(),
)
def test_collate_time_batches_are_valid(lengths, multiple, slack, labels, padding_mask, extra):
    rows = stream_rows(lengths)
    for row in rows:
        if not labels:
            del row["labels"], row["loss_mask"]
        if extra:
            row["token_type"] = torch.ones(len(row["input_ids"]), dtype=torch.int8)
    width = None if slack is None else sum(ceil_to_multiple(n, multiple) for n in lengths) + slack
    packed = build_thd_from_rows(
        rows, pad_to_multiple_of=multiple, sequence_length=width, pad_to_max_length=width is not None,
        emit_padding_mask=padding_mask, sequence_tensor_pad_values={"token_type": 0} if extra else None,
    )  # fmt: skip
    validate_thd_batch(packed)
    validate_thd_batch(packed | {"tokens": packed["input_ids"], "token_count": lengths})  # text collators


@pytest.mark.parametrize("multiple", [1, 3, 4])
@pytest.mark.parametrize("token_key", ["input_ids", "tokens"])
def test_right_padded_batches_packed_in_place_are_valid(multiple, token_key):
    lengths = [5, 2, 7]
    batch = {key: torch.zeros(3, 8, dtype=torch.long) for key in (token_key, "labels", "position_ids")}
    batch["loss_mask"] = torch.zeros(3, 8)
    for i, row in enumerate(stream_rows(lengths)):
        n = lengths[i]
        batch[token_key][i, :n], batch["labels"][i, :n] = row["input_ids"], row["labels"]
        batch["loss_mask"][i, :n], batch["position_ids"][i, :n] = 1, torch.arange(n)
    pack_right_padded_batch(batch, pad_to_multiple_of=multiple, emit_padding_mask=True)
    validate_thd_batch(batch)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("fixed", [False, True])
def test_context_parallel_shards_are_valid_for_their_cp_size(cp_size, fixed):
    multiple = 2 * cp_size
    samples = [{"input_ids": torch.arange(n) + 10, "loss_mask": torch.ones(n)} for n in (5, 9, 2)]
    width = sum(ceil_to_multiple(n, multiple) for n in (5, 9, 2)) + multiple if fixed else None
    stream = pack_samples(
        samples, pad_to_multiple_of=multiple, sequence_length=width, pad_to_max_length=fixed
    )
    collate = PackedCollate(pack_size=8 * multiple, eos_id=EOS, pad_to_max_length=fixed,
                            pad_seq_length_to_mult=multiple, pad_seq_to_mult=multiple)  # fmt: skip
    offline = split_microbatches(collate([stored_row(pack, multiple) for pack in PACKS]), len(PACKS))
    for batch in [stream, *offline]:
        validate_thd_batch(batch)
        for rank in range(cp_size):
            shard = slice_for_cp_rank(batch, cp_size, rank)
            validate_thd_batch(shard, cp_size=cp_size)
            validate_thd_batch(shard, cp_size=None)
            if cp_size > 1:
                with pytest.raises(ThdBatchError, match="the last boundary must be the token count"):
                    validate_thd_batch(shard)
                with pytest.raises(ThdBatchError, match=f"cp_size {cp_size} x the token count"):
                    validate_thd_batch(batch, cp_size=cp_size)


def test_text_and_vision_language_collators_emit_valid_batches(gpt2, chat_rows):
    from tightpack.runtime.sft_collate import TextSFTCollator

    for multiple in (1, 4):
        collator = TextSFTCollator(
            gpt2, enable_in_batch_packing=True, in_batch_packing_pad_to_multiple_of=multiple
        )
        validate_thd_batch(collator(chat_rows[:5]))
    samples = []
    for n, image in ((6, True), (9, False), (5, True)):
        ids = torch.arange(100, 100 + n)
        sample = {"input_ids": ids, "labels": ids + 1, "loss_mask": torch.ones(n)}
        if image:
            ids[1:5] = 7  # one image of 4 merged patches
            sample |= {"pixel_values": torch.randn(16, 3), "image_grid_thw": torch.tensor([[1, 4, 4]])}
        samples.append(sample)
    for multiple in (1, 4):
        validate_thd_batch(
            pack_vlm_samples(samples, QwenVLRope("qwen2_vl", image_token_id=7), pad_to_multiple_of=multiple)
        )


# === each kind of corruption is refused by name ========================================================


def offline_batch() -> dict:
    """Two aligned rows, fixed width 16: physical [0,4,12,16,16] / [0,8,16,16,16]."""
    collate = PackedCollate(pack_size=16, eos_id=EOS, pad_to_max_length=True, pad_seq_to_mult=4)
    return collate([stored_row([3, 5], 4), stored_row([7], 4)])


def stream_batch() -> dict:
    """One stream of sequences 3 and 5 aligned to 4: logical [0, 3, 8], physical [0, 4, 12]."""
    packed = build_thd_from_rows(stream_rows([3, 5]), pad_to_multiple_of=4, emit_padding_mask=True)
    return packed | {"tokens": packed["input_ids"], "token_count": [3, 5]}


def with_both(batch: dict, key: str, value) -> dict:
    """``batch`` with ``cu_seqlens_q*`` and its ``kv`` twin replaced together, as the builders alias them."""
    return batch | {key: value, key.replace("_q", "_kv"): value}


def edited(base, key: str, change) -> dict:
    """``base()`` with ``change`` applied in place to a copy of ``batch[key]`` (and its ``kv`` twin)."""
    batch = base()
    value = batch[key].clone()
    change(value)
    return with_both(batch, key, value) if key.startswith("cu_seqlens_q") else batch | {key: value}


def without(batch: dict, key: str) -> dict:
    return {k: v for k, v in batch.items() if k != key}


def setitem(index, value):
    return lambda tensor: tensor.__setitem__(index, value)


CORRUPTIONS = {
    "no boundaries": (
        lambda: {"tokens": torch.zeros(1, 4)},
        "the batch has no packed boundaries: expected cu_seqlens_q or legacy cu_seqlens",
    ),
    "boundaries not starting at 0": (
        lambda: edited(offline_batch, "cu_seqlens_q", setitem((1, 0), 1)),
        r"cu_seqlens_q\[1\] must start at 0, got 1",
    ),
    "decreasing boundaries": (
        lambda: edited(stream_batch, "cu_seqlens_q", setitem(1, 9)),
        "cu_seqlens_q must never decrease: entry 2 is 8 after 9",
    ),
    "last boundary short of the token count": (
        lambda: without(edited(stream_batch, "cu_seqlens_q_padded", setitem(2, 11)), "total_tokens"),
        "cu_seqlens_q_padded ends at 11 but tokens holds 12 tokens per row: the last boundary must be the "
        "token count",
    ),
    "total_tokens off": (
        lambda: stream_batch() | {"total_tokens": 16},
        "total_tokens is 16 but cu_seqlens_q_padded ends at 12",
    ),
    "total_tokens not an int": (
        lambda: stream_batch() | {"total_tokens": torch.tensor(12)},
        "total_tokens must be a python int",
    ),
    "int64 boundaries": (
        lambda: with_both(stream_batch(), "cu_seqlens_q", torch.tensor([0, 3, 8])),
        "cu_seqlens_q must be torch.int32, got torch.int64",
    ),
    "padded segment shorter than its sequence": (
        lambda: edited(stream_batch, "cu_seqlens_q", setitem(1, 5)),
        "segment 0 of cu_seqlens_q_padded spans 4 tokens, fewer than the 5 real tokens cu_seqlens_q gives it",
    ),
    "padded boundaries of another shape": (
        lambda: with_both(
            offline_batch(), "cu_seqlens_q_padded", torch.tensor([[0, 4, 16], [0, 8, 16]]).int()
        ),
        r"cu_seqlens_q_padded\[0\] has 3 boundaries but cu_seqlens_q\[0\] has 4: padded and unpadded",
    ),
    "kv boundaries unlike q": (
        lambda: stream_batch() | {"cu_seqlens_kv": torch.tensor([0, 4, 8], dtype=torch.int32)},
        "cu_seqlens_kv must equal cu_seqlens_q",
    ),
    "kv padded without q padded": (
        lambda: (
            {k: v for k, v in build_thd_from_rows(stream_rows([4])).items()}
            | {"cu_seqlens_kv_padded": torch.tensor([0, 4], dtype=torch.int32)}
        ),
        "cu_seqlens_kv_padded without cu_seqlens_q_padded",
    ),
    "labels of another shape": (
        lambda: stream_batch() | {"labels": torch.zeros(1, 11, dtype=torch.long)},
        r"labels has shape \(1, 11\) but tokens has \(1, 12\)",
    ),
    "loss_mask of another shape": (
        lambda: offline_batch() | {"loss_mask": torch.zeros(2, 15, dtype=torch.long)},
        r"loss_mask has shape \(2, 15\) but tokens has \(2, 16\)",
    ),
    "position_ids of another shape": (
        lambda: stream_batch() | {"position_ids": torch.arange(12)},
        r"position_ids has shape \(12,\) but tokens has \(1, 12\)",
    ),
    "tokens of several rows for one stream": (
        lambda: (
            {**stream_batch(), "tokens": torch.zeros(2, 12), "input_ids": torch.zeros(2, 12)}
            | {k: torch.zeros(2, 12) for k in ("labels", "loss_mask", "position_ids")}
        ),
        r"tokens must be \[1, T\] for 1-D boundaries, got shape \(2, 12\)",
    ),
    "max_seqlen below the longest segment": (
        lambda: offline_batch() | {"max_seqlen_q": torch.tensor([[8], [7]], dtype=torch.int32)},
        r"max_seqlen_q\[1\] is 7, less than the longest segment of cu_seqlens_q_padded\[1\] \(8 tokens\)",
    ),
    "max_seqlen of the other layout": (
        lambda: stream_batch() | {"max_seqlen_q": torch.tensor([[8]], dtype=torch.int32)},
        r"max_seqlen_q must have shape \[\] \(one value per row\), got \[1, 1\]",
    ),
    "attention mask in a THD batch": (
        lambda: stream_batch() | {"attention_mask": torch.ones(1, 12)},
        "attention_mask must be None in a THD batch",
    ),
    "padding mask of another dtype": (
        lambda: stream_batch() | {"padding_mask": torch.zeros(1, 12, dtype=torch.long)},
        "padding_mask must be torch.bool, got torch.int64",
    ),
    "padding mask off the alignment padding": (
        lambda: edited(stream_batch, "padding_mask", setitem((0, 3), False)),
        "padding_mask is False at token 3: it must be True exactly on the alignment padding",
    ),
    "seq_idx off the physical segments": (
        lambda: edited(offline_batch, "seq_idx", setitem((0, 4), 0)),
        r"seq_idx\[0\] at token 4 is 0, but the physical boundaries put that token in segment 1",
    ),
    "token_count of the wrong rows": (
        lambda: offline_batch() | {"token_count": [12]},
        "token_count has 1 entries for 2 rows",
    ),
    "token_count unlike the sequences": (
        lambda: stream_batch() | {"token_count": [4, 4]},
        r"token_count is \[4, 4\] but cu_seqlens_q gives the sequences \[3, 5\] tokens",
    ),
    "mixed key schemas": (
        lambda: stream_batch() | {"cu_seqlens": torch.tensor([[0, 4, 12, -1]], dtype=torch.int32)},
        r"the batch mixes key schemas: cu_seqlens in a current \(cu_seqlens_q\) batch",
    ),
    "legacy argmin off the first -1": (
        lambda: edited(lambda: legacy_batch(), "cu_seqlens_argmin", setitem((0, 0), 2)),
        r"cu_seqlens_argmin\[0\] is 2 but the first -1 of cu_seqlens\[0\] is at 3",
    ),
    "legacy boundaries with values after the -1": (
        lambda: edited(lambda: legacy_batch(), "cu_seqlens", setitem((1, 1), -1)),
        r"cu_seqlens\[1\] must be right-padded with -1 after its boundaries",
    ),
    "context-parallel shard with an uneven segment": (
        lambda: {
            key: value[:, :5] if key in ("input_ids", "labels", "loss_mask", "position_ids") else value
            for key, value in build_thd_from_rows(stream_rows([3, 5]), pad_to_multiple_of=2).items()
        },
        "a 2-way context-parallel shard, but segment 1 of cu_seqlens_q_padded has 6 tokens, not a multiple "
        r"of 2 \* cp_size = 4",
    ),
}


def legacy_batch() -> dict:
    collate = PackedCollate(
        pack_size=16, eos_id=EOS, pad_seq_length_to_mult=1, pad_seq_to_mult=4, legacy_keys=True
    )
    return collate([stored_row([3, 5], 4), stored_row([7, 1], 4)])


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_each_corruption_is_refused_by_name(kind):
    build, message = CORRUPTIONS[kind]
    batch = build()
    cp_size = 2 if "context-parallel" in kind else 1
    with pytest.raises(ThdBatchError, match=message):
        validate_thd_batch(batch, cp_size=cp_size)


def test_the_uncorrupted_bases_are_valid():
    for build in (offline_batch, stream_batch, legacy_batch):
        validate_thd_batch(build())


# === the accessors read both layouts alike =============================================================


@pytest.mark.parametrize("pack", [[3, 5, 1], [7], [4, 4], [2, 6, 3, 1]])
@pytest.mark.parametrize("multiple", [1, 4])
def test_accessors_agree_between_layouts_for_the_same_pack(pack, multiple):
    width = sum(ceil_to_multiple(n, multiple) for n in pack)
    offline = PackedCollate(pack_size=width, eos_id=EOS, pad_seq_length_to_mult=1, pad_seq_to_mult=multiple)
    row = stored_row(pack, multiple)
    batches = {
        "offline": offline([row]),
        "legacy": PackedCollate(
            pack_size=width, eos_id=EOS, pad_seq_length_to_mult=1, pad_seq_to_mult=multiple, legacy_keys=True
        )([row]),
        "stream": build_thd_from_rows(stream_rows(pack), pad_to_multiple_of=multiple, pad_token_id=EOS),
    }
    logical = [0, *torch.tensor(pack).cumsum(0).tolist()]
    physical = [0, *torch.tensor([ceil_to_multiple(n, multiple) for n in pack]).cumsum(0).tolist()]
    reference = batches["stream"]
    for name, batch in batches.items():
        validate_thd_batch(batch)
        assert thd.logical_boundaries(batch).tolist() == logical, name
        assert thd.physical_boundaries(batch).tolist() == physical, name
        assert thd.physical_boundaries(batch).dtype == torch.int32, name
        assert thd.max_seqlen(batch) == max(b - a for a, b in itertools.pairwise(physical)), name
        assert torch.equal(thd.token_tensor(batch), thd.token_tensor(reference)), name
        assert torch.equal(batch["position_ids"], reference["position_ids"]), name
        assert torch.equal(document_ids(batch), document_ids(reference)), name
        kwargs, expected = hf_packed_kwargs(batch), hf_packed_kwargs(reference)
        assert torch.equal(kwargs["cu_seq_lens_q"], expected["cu_seq_lens_q"]), name
        params, want = (
            to_packed_seq_params(batch, megatron=False),
            to_packed_seq_params(reference, megatron=False),
        )
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"):
            assert str(getattr(params, field)) == str(getattr(want, field)), (name, field)
        assert (params.cu_seqlens_q_padded is None) == (physical == logical), name
    if multiple > 1:  # every segment a multiple of 2 * cp_size: the shards agree as well
        for rank in range(2):
            shards = {name: slice_for_cp_rank(batch, 2, rank) for name, batch in batches.items()}
            for name, shard in shards.items():
                assert torch.equal(thd.token_tensor(shard), thd.token_tensor(shards["stream"])), name


def test_row_access_of_a_batch_equals_its_micro_batches():
    batch = PackedCollate(pack_size=32, eos_id=EOS, pad_seq_to_mult=4)([stored_row(p, 4) for p in PACKS])
    for row, part in enumerate(split_microbatches(batch, len(PACKS))):
        for accessor in (thd.logical_boundaries, thd.physical_boundaries, thd.padded_boundaries):
            assert torch.equal(accessor(batch, row=row), accessor(part)), (accessor.__name__, row)
        assert thd.max_seqlen(batch, row=row) == thd.max_seqlen(part)
    with pytest.raises(ValueError, match="micro-batch size 1"):
        thd.physical_boundaries(batch)
    with pytest.raises(ValueError, match="max_seqlen_q must contain exactly one value"):
        thd.max_seqlen(batch)


def test_accessors_without_optional_keys():
    bounds = torch.tensor([0, 3, 8], dtype=torch.int32)
    batch = {"cu_seqlens_q": bounds}
    assert thd.padded_boundaries(batch) is None and thd.physical_boundaries(batch) is bounds
    assert thd.logical_boundaries(batch, side="kv") is bounds and thd.max_seqlen(batch) is None
    assert thd.token_tensor(batch) is None and thd.is_packed(batch) and not thd.is_packed({"tokens": bounds})
    legacy = {"cu_seqlens": torch.tensor([[0, 4, 8]], dtype=torch.int32)}  # no -1 and no argmin: whole row
    assert thd.logical_boundaries(legacy).tolist() == [0, 4, 8] and thd.padded_boundaries(legacy) is None


def test_partition_indices_agree_on_the_physical_boundaries_of_both_layouts():
    stream = pack_samples([{"input_ids": torch.arange(n)} for n in (3, 5)], pad_to_multiple_of=4)
    offline = PackedCollate(pack_size=12, eos_id=EOS, pad_seq_length_to_mult=1, pad_seq_to_mult=4)(
        [stored_row([3, 5], 4)]
    )
    for rank in range(2):
        assert torch.equal(
            thd_partition_indices(thd.physical_boundaries(stream), 2, rank),
            thd_partition_indices(thd.physical_boundaries(offline), 2, rank),
        )


# === the debug mode ===================================================================================


def test_debug_mode_makes_consumers_validate_what_they_receive():
    bad = stream_batch() | {"max_seqlen_q": torch.tensor(2, dtype=torch.int32)}
    with thd.checking(False):
        assert to_packed_seq_params(bad, megatron=False).max_seqlen_q == 2  # off: one flag test, no check
        with thd.checking():
            assert thd.checking_enabled()
            for consume in (lambda b: to_packed_seq_params(b, megatron=False), hf_packed_kwargs, document_ids,
                            lambda b: slice_for_cp_rank(b, 2, 0)):  # fmt: skip
                with pytest.raises(ThdBatchError, match="max_seqlen_q is 2, less than the longest segment"):
                    consume(bad)
        assert not thd.checking_enabled()  # restored


def test_debug_mode_makes_builders_validate_what_they_emit(monkeypatch):
    calls = []
    monkeypatch.setattr(
        thd.validate, "validate_thd_batch", lambda batch, cp_size=1: calls.append(sorted(batch))
    )
    with thd.checking():
        PackedCollate(pack_size=8, eos_id=EOS, pad_seq_length_to_mult=1)([stored_row([3, 2], 1)])
        build_thd_from_rows(stream_rows([3]))
    with thd.checking(False):
        build_thd_from_rows(stream_rows([3]))
    assert len(calls) == 2 and "seq_idx" in calls[0] and "seq_idx" not in calls[1]


@pytest.mark.parametrize(("value", "enabled"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_environment_variable_is_read_at_import(value, enabled):
    code = "from tightpack.runtime import thd; print(thd.checking_enabled())"
    env = {**os.environ, thd.CHECK_ENV: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(enabled)
