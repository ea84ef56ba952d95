"""Energon: a sample longer than the pack costs no other sample, under each long-sample policy.

Before, the selector raised on the whole buffer; Energon's error handler logged it and dropped the
buffer, and the epoch ended normally with every sample of that buffer lost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.energon")
webdataset = pytest.importorskip("webdataset")

from megatron.energon import (  # noqa: E402
    TaskEncoder,
    TextSample,
    stateless,
)
from megatron.energon.errors import FatalSampleError  # noqa: E402

from tests.energon_data import savable_loaders, write_text_dataset  # noqa: E402
from tightpack.runtime.energon import LongSampleError, PackingTaskEncoderMixin, PreparedSample  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")

PACK_SIZE, MULTIPLE, BUFFER = 64, 4, 8
CAP = 64  # the longest aligned prefix that fits: floor(64 / 4) * 4
LONG = {"s005": 90, "s017": 130, "s018": 65, "s031": 200, "s044": 77}  # two in one buffer of 8


class TextEncoder(PackingTaskEncoderMixin, TaskEncoder):
    """Tokens are stored as space-separated ids in the ``txt`` part; the encoder does not truncate."""

    pack_size = PACK_SIZE
    pad_to_multiple_of = MULTIPLE

    def __init__(self, long_samples: str) -> None:
        super().__init__()
        self.long_samples = long_samples

    @stateless
    def encode_sample(self, sample: TextSample) -> PreparedSample:
        ids = torch.tensor([int(token) for token in sample.text.split()])
        return PreparedSample.derive_from(
            sample, input_ids=ids, labels=ids + 1, loss_mask=torch.ones(len(ids))
        )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, dict[str, list[int]]]:
    """48 samples of 1-40 tokens, 5 of them made longer than the pack, in 3 shards (``energon prepare``)."""
    root = tmp_path_factory.mktemp("energon-long")
    rng = np.random.default_rng(25)
    tokens = {}
    for i in range(48):
        key = f"s{i:03d}"
        tokens[key] = rng.integers(1, 1000, LONG.get(key, int(rng.integers(1, 41)))).tolist()
    return write_text_dataset(root, tokens, shard_size=16), tokens


@pytest.fixture
def loader():
    """``loader(path, workers, encoder, repeat=False, **config)``: a savable loader, closed at teardown."""
    yield from savable_loaders(BUFFER, repeat=False)


def members(batch: dict) -> dict[str, list[int]]:
    """Each member's tokens in a pack, read from the row at its ``cu_seqlens`` offsets."""
    offsets = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    lengths = np.diff(batch["cu_seqlens_q"].tolist())
    row = batch["input_ids"][0]
    return {
        key: row[start : start + n].tolist()
        for key, start, n in zip(batch["keys"], offsets, lengths, strict=False)
    }


@pytest.mark.parametrize("workers", [0, 2])
def test_truncate_cuts_each_long_sample_to_the_pack_and_keeps_every_other(dataset, loader, workers):
    path, tokens = dataset
    encoder = TextEncoder("truncate")
    packs = list(loader(path, workers, encoder))
    packed = {key: ids for batch in packs for key, ids in members(batch).items()}
    assert sum(len(batch["keys"]) for batch in packs) == len(tokens) == len(packed)
    for key, ids in tokens.items():
        assert packed[key] == ids[:CAP], key  # the long ones cut to their first 64 tokens
    assert sorted(key for batch in packs for key in batch.get("truncated_keys", [])) == sorted(LONG)
    assert all(batch["input_ids"].shape[1] <= PACK_SIZE for batch in packs)
    if workers == 0:  # the counts live in the process that ran the selector
        assert encoder.long_sample_counts == {"truncated": len(LONG), "dropped": 0}


def test_drop_leaves_out_only_the_long_samples_and_lists_them(dataset, loader):
    path, tokens = dataset
    encoder = TextEncoder("drop")
    packs = list(loader(path, 0, encoder))
    packed = {key: ids for batch in packs for key, ids in members(batch).items()}
    assert sorted(packed) == sorted(set(tokens) - set(LONG))
    assert all(packed[key] == tokens[key] for key in packed)
    assert sorted(key for batch in packs for key in batch.get("dropped_keys", [])) == sorted(LONG)
    assert encoder.long_sample_counts == {"truncated": 0, "dropped": len(LONG)}


def test_error_stops_the_run_even_when_energons_handler_ignores_errors(dataset, loader):
    # No workers: after an error torch waits 5 s for each worker to shut down (with 2 workers the
    # worker's FatalSampleError reaches the loop the same way).
    path, _ = dataset
    ignore = loader(path, 0, TextEncoder("error"), global_error_handler=lambda error, sample, sources: None)
    long_key = "|".join(LONG)  # Energon interleaves the shards: whichever long sample comes first
    message = rf"Sample ({long_key}) aligned sequence length \d+ exceeds seq_length=64\. long_samples='error'"
    with pytest.raises(FatalSampleError, match=message):
        list(ignore)


def test_packs_with_truncated_or_dropped_members_are_rebuilt_from_their_restore_keys(dataset, loader):
    path, _ = dataset
    for policy, listed in (("truncate", "truncated_keys"), ("drop", "dropped_keys")):
        source = loader(path, 0, TextEncoder(policy))
        packs = [batch for batch in source if listed in batch]
        assert packs
        for batch in packs:
            again = source.restore_sample(batch["__restore_key__"])
            assert again["keys"] == batch["keys"] and again[listed] == batch[listed]
            assert torch.equal(again["input_ids"], batch["input_ids"])


def test_resume_next_to_each_truncated_pack_is_exact(dataset, loader):
    # Cut just before and just after each pack holding a cut member: the restored state holds it
    # in a pending group or not. (repeat=True: what Energon resumes exactly at the end of an epoch.)
    path, _ = dataset
    first = loader(path, 0, TextEncoder("truncate"), repeat=True)
    stream = iter(first)
    states, uninterrupted, truncated_at = [], [], []
    for index in range(40):
        states.append(first.save_state_rank())
        batch = next(stream)
        uninterrupted.append(members(batch))
        if "truncated_keys" in batch and index < 32:
            truncated_at.append(index)
    assert len(truncated_at) >= 4
    for cut in sorted({cut for index in truncated_at for cut in (index, index + 1)}):
        resumed = loader(path, 0, TextEncoder("truncate"), repeat=True)
        resumed.restore_state_rank(states[cut])
        tail = [members(batch) for batch, _ in zip(iter(resumed), range(40 - cut), strict=False)]
        assert uninterrupted[:cut] + tail == uninterrupted, cut


def test_the_selector_applies_the_policy_without_a_loader(caplog):
    encoder = TextEncoder("truncate")
    buffer = [
        PreparedSample(__key__=key, __restore_key__=(), input_ids=torch.arange(1, n + 1))
        for key, n in (("a", 30), ("long", 70), ("b", 20))
    ]
    groups = encoder.select_samples_to_pack(buffer)
    assert sorted(s.__key__ for group in groups for s in group) == ["a", "b", "long"]
    packed = [encoder.pack_selected_samples(group) for group in groups]
    cut = next(p for p in packed if p.truncated)
    assert cut.truncated == ["long"] and len(cut.samples[0].input_ids) == CAP
    image = PreparedSample(
        __key__="image",
        __restore_key__=(),
        input_ids=torch.arange(1, 81),
        pixel_values=torch.zeros(16, 6),
        image_grid_thw=torch.tensor([[1, 4, 4]]),
    )  # a cut could split its image: dropped even under truncate
    groups = encoder.select_samples_to_pack([*buffer, image])
    assert [p.dropped for p in map(encoder.pack_selected_samples, groups) if p.dropped] == [["image"]]
    assert encoder.long_sample_counts == {"truncated": 2, "dropped": 1}
    logged = [record.getMessage() for record in caplog.records if record.name == "tightpack"]
    assert logged[-2:] == [
        "sample long is 72 aligned tokens, above pack_size=64: truncated by long_samples='truncate' "
        "(2 truncated in this process)",
        "sample image is 80 aligned tokens, above pack_size=64: dropped (it has visual tensors, which a "
        "cut could split) by long_samples='truncate' (1 dropped in this process)",
    ]
    encoder.long_samples = "error"
    with pytest.raises(LongSampleError, match="Sample long aligned sequence length 72 exceeds seq_length=64"):
        encoder.select_samples_to_pack(buffer)
    encoder.long_samples = "cut"
    with pytest.raises(ValueError, match="long_samples must be one of truncate, drop, error; got 'cut'"):
        encoder.select_samples_to_pack(buffer)
