"""Energon adapter: the reference's selection and batch contract, and real Energon loaders end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.energon")
webdataset = pytest.importorskip("webdataset")

from megatron.energon import (  # noqa: E402
    SkipSample,
    TaskEncoder,
    TextSample,
    stateless,
)

from tests.energon_data import savable_loaders, write_text_dataset  # noqa: E402
from tightpack.errors import TightpackError  # noqa: E402
from tightpack.runtime.energon import PackedSample, PackingTaskEncoderMixin, PreparedSample  # noqa: E402
from tightpack.runtime.mrope import QwenVLRope  # noqa: E402
from tightpack.runtime.vlm import pack_vlm_samples  # noqa: E402

# Energon asks the torch DataLoader to pin memory; this machine has no accelerator.
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")

PACK_SIZE, MULTIPLE, BUFFER = 64, 4, 8


class Encoder(PackingTaskEncoderMixin, TaskEncoder):
    """Unit-test encoder: the reference example's settings."""

    pack_size = 12
    pad_to_multiple_of = 4


class TextEncoder(PackingTaskEncoderMixin, TaskEncoder):
    """Tokens are stored as space-separated ids in the ``txt`` part of each sample."""

    pack_size = PACK_SIZE
    pad_to_multiple_of = MULTIPLE

    def __init__(self, strategy: str = "fullest_first", skip_long: bool = False) -> None:
        super().__init__()
        self.packing_strategy = strategy
        self.skip_long = skip_long

    @stateless
    def encode_sample(self, sample: TextSample) -> PreparedSample:
        ids = torch.tensor([int(token) for token in sample.text.split()])
        prepared = PreparedSample.derive_from(
            sample, input_ids=ids, labels=ids + 1, loss_mask=torch.ones(len(ids))
        )
        if self.skip_long:
            try:
                self.packing_length(prepared)
            except TightpackError as error:
                raise SkipSample() from error
        return prepared


def sample(key: str, length: int, **fields) -> PreparedSample:
    ids = torch.arange(1, length + 1)
    return PreparedSample(__key__=key, __restore_key__=(), input_ids=ids, **fields)


def keys(groups) -> list[list[str]]:
    return [[member.__key__ for member in group] for group in groups]


# -- selection ---------------------------------------------------------------------------------------


def test_ffd_gives_the_reference_groups():
    encoder = Encoder()
    encoder.packing_strategy = "ffd"
    buffer = [sample("five", 5), sample("four-a", 4), sample("four-b", 4)]
    assert keys(encoder.select_samples_to_pack(buffer)) == [["five", "four-a"], ["four-b"]]


def test_fullest_first_on_the_reference_example():
    # Aligned to 4: five 8, four-a 4, four-b 4; pack 12. The fullest group is 12 (8 + 4), holding the
    # longest sample, with the earlier of the two 4s; the other 4 is what is left.
    buffer = [sample("five", 5), sample("four-a", 4), sample("four-b", 4)]
    assert keys(Encoder().select_samples_to_pack(buffer)) == [["five", "four-a"], ["four-b"]]


@pytest.mark.parametrize("strategy", ["fullest_first", "ffd"])
def test_every_sample_in_exactly_one_group_within_the_pack_size(strategy):
    encoder = Encoder()
    encoder.pack_size, encoder.packing_strategy = 64, strategy
    lengths = np.random.default_rng(0).integers(1, 65, 40)
    buffer = [sample(f"s{i}", int(n)) for i, n in enumerate(lengths)]
    groups = encoder.select_samples_to_pack(buffer)
    assert sorted(key for group in keys(groups) for key in group) == sorted(s.__key__ for s in buffer)
    assert all(sum(-(-len(s.input_ids) // 4) * 4 for s in group) <= 64 for group in groups)


def test_fullest_first_needs_fewer_packs_than_ffd_here():
    encoder = Encoder()
    encoder.pack_size, encoder.pad_to_multiple_of = 10, 1
    buffer = [sample(key, int(key[1])) for key in ("s5", "s4", "s3a", "s3b", "s3c", "s2")]
    encoder.packing_strategy = "ffd"
    assert keys(encoder.select_samples_to_pack(buffer)) == [["s5", "s4"], ["s3a", "s3b", "s3c"], ["s2"]]
    encoder.packing_strategy = "fullest_first"
    assert keys(encoder.select_samples_to_pack(buffer)) == [["s5", "s3a", "s2"], ["s4", "s3b", "s3c"]]


def test_best_fill_is_a_deprecated_alias_of_fullest_first():
    encoder = Encoder()
    encoder.pack_size, encoder.pad_to_multiple_of = 10, 1
    buffer = [sample(key, int(key[1])) for key in ("s5", "s4", "s3a", "s3b", "s3c", "s2")]
    encoder.packing_strategy = "best_fill"
    with pytest.warns(FutureWarning, match="packing_strategy = 'best_fill' is deprecated.*'fullest_first'"):
        groups = keys(encoder.select_samples_to_pack(buffer))
    assert groups == [["s5", "s3a", "s2"], ["s4", "s3b", "s3c"]]


def test_a_sample_longer_than_the_pack_is_refused_under_long_samples_error():
    encoder = Encoder()
    encoder.pack_size, encoder.long_samples = 8, "error"
    with pytest.raises(ValueError, match=r"Sample long aligned sequence length 12 exceeds seq_length=8\."):
        encoder.select_samples_to_pack([sample("ok", 4), sample("long", 9)])


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"pack_size": None}, "pack_size must be a positive int"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be an int between 1 and pack_size"),
        ({"packing_strategy": "bfd"}, "packing_strategy must be one of fullest_first, ffd; got 'bfd'"),
    ],
)
def test_bad_settings_are_refused(attributes, message):
    encoder = Encoder()
    for name, value in attributes.items():
        setattr(encoder, name, value)
    with pytest.raises(TightpackError, match=message):
        encoder.select_samples_to_pack([sample("a", 3)])


def test_input_ids_must_be_a_1d_tensor():
    bad = PreparedSample(__key__="bad", __restore_key__=(), input_ids=torch.ones(2, 3))
    with pytest.raises(TightpackError, match=r"Sample bad needs a non-empty 1-D input_ids tensor.*\(2, 3\)"):
        Encoder().select_samples_to_pack([bad])


# -- packing and batching ----------------------------------------------------------------------------


def test_pack_selected_samples_wraps_the_group():
    packed = Encoder().pack_selected_samples([sample("a", 3), sample("b", 2)])
    assert isinstance(packed, PackedSample)
    assert packed.__key__ == "a,b" and packed.__restore_key__ == () and packed.__subflavors__ == {}
    assert [member.__key__ for member in packed.samples] == ["a", "b"]
    with pytest.raises(ValueError, match=r"Cannot pack an empty sample group\."):
        Encoder().pack_selected_samples([])


def test_the_hooks_are_stateless():
    assert Encoder.pack_selected_samples.__stateless__ and Encoder.batch.__stateless__
    assert TextEncoder.encode_sample.__stateless__


def test_batch_errors():
    encoder = Encoder()
    packed = encoder.pack_selected_samples([sample("a", 3)])
    with pytest.raises(ValueError, match=r"requires physical micro_batch_size=1\."):
        encoder.batch([packed, packed])
    with pytest.raises(TypeError, match="cannot mix packed and unpacked samples"):
        encoder.batch([packed, sample("b", 2)])
    with pytest.raises(ValueError, match="expects packed samples: pass packing_buffer_size"):
        encoder.batch([sample("b", 2)])
    too_long = PackedSample(
        __key__="x", __restore_key__=(), samples=[sample("a", 5), sample("b", 4), sample("c", 1)]
    )
    with pytest.raises(ValueError, match=r"Packed group length 16 exceeds seq_length=12\."):
        encoder.batch([too_long])


def test_batch_worked_example():
    encoder = Encoder()
    five = sample("five", 5, labels=torch.arange(11, 16), loss_mask=torch.ones(5))
    four = sample("four", 4, labels=torch.arange(21, 25), loss_mask=torch.ones(4))
    batch = encoder.batch([encoder.pack_selected_samples([five, four])])
    assert batch["keys"] == ["five", "four"]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[11, 12, 13, 14, 15, -100, -100, -100, 21, 22, 23, 24]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert batch["padding_mask"].tolist() == [[False] * 5 + [True] * 3 + [False] * 4]
    assert batch["cu_seqlens_q"].tolist() == batch["cu_seqlens_kv"].tolist() == [0, 5, 9]
    assert batch["cu_seqlens_q_padded"].tolist() == batch["cu_seqlens_kv_padded"].tolist() == [0, 8, 12]
    assert batch["cu_seqlens_q"].dtype == torch.int32
    assert int(batch["max_seqlen_q"]) == int(batch["max_seqlen_kv"]) == 8 and batch["total_tokens"] == 12


def test_batch_fixed_width():
    encoder = Encoder()
    encoder.pad_to_max_length = True
    batch = encoder.batch([encoder.pack_selected_samples([sample("four", 4)])])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4] + [0] * 8]
    assert batch["cu_seqlens_q"].tolist() == [0, 4] and batch["cu_seqlens_q_padded"].tolist() == [0, 12]
    assert int(batch["max_seqlen_q"]) == 12 and batch["total_tokens"] == 12


def test_batch_concatenates_visual_tensors_in_member_order():
    encoder = Encoder()
    members = [
        sample("a", 3, pixel_values=torch.zeros(2, 5), image_grid_thw=torch.tensor([[1, 1, 2]])),
        sample("b", 2),
        sample("c", 4, pixel_values=torch.ones(3, 5), image_grid_thw=torch.tensor([[1, 3, 1]])),
    ]
    batch = encoder.batch([encoder.pack_selected_samples(members)])
    assert batch["pixel_values"].sum(dim=1).tolist() == [0, 0, 5, 5, 5]
    assert batch["image_grid_thw"].tolist() == [[1, 1, 2], [1, 3, 1]]
    assert "pixel_values_videos" not in batch


# -- end to end with real Energon loaders ------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, dict[str, list[int]]]:
    """60 samples of 1-40 tokens in 4 WebDataset shards, prepared by ``energon prepare``."""
    root = tmp_path_factory.mktemp("energon")
    rng = np.random.default_rng(0)
    tokens = {f"s{i:03d}": rng.integers(1, 1000, int(rng.integers(1, 41))).tolist() for i in range(60)}
    return write_text_dataset(root, tokens, shard_size=15), tokens


@pytest.fixture
def loader():
    """``loader(path, workers, encoder, repeat=...)``: a savable Energon loader, closed at teardown."""
    yield from savable_loaders(BUFFER, repeat=True)


def check_pack(batch: dict, tokens: dict[str, list[int]]) -> None:
    lengths = [len(tokens[key]) for key in batch["keys"]]
    aligned = [-(-n // MULTIPLE) * MULTIPLE for n in lengths]
    assert batch["input_ids"].shape == (1, sum(aligned)) and sum(aligned) <= PACK_SIZE
    assert batch["cu_seqlens_q"].tolist() == np.cumsum([0, *lengths]).tolist()
    offsets = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    for key, start in zip(batch["keys"], offsets, strict=False):
        ids = torch.tensor(tokens[key])
        assert torch.equal(batch["input_ids"][0, start : start + len(ids)], ids)
        assert torch.equal(batch["labels"][0, start : start + len(ids)], ids + 1)


@pytest.mark.parametrize("strategy", ["fullest_first", "ffd"])
@pytest.mark.parametrize("workers", [0, 2])
def test_one_epoch_packs_every_sample_once(dataset, loader, workers, strategy):
    path, tokens = dataset
    packs = list(loader(path, workers, TextEncoder(strategy), repeat=False))
    assert sorted(key for batch in packs for key in batch["keys"]) == sorted(tokens)
    for batch in packs:
        check_pack(batch, tokens)


@pytest.mark.parametrize(("workers", "before"), [(0, 1), (0, 5), (2, 5)])
def test_resume_yields_the_uninterrupted_packs(dataset, loader, workers, before):
    path, tokens = dataset
    first = loader(path, workers, TextEncoder())
    stream = iter(first)
    for _ in range(before):
        next(stream)
    state = first.save_state_rank()
    expected = [next(stream) for _ in range(12)]
    resumed = loader(path, workers, TextEncoder())
    resumed.restore_state_rank(state)
    got = [batch for batch, _ in zip(iter(resumed), range(12), strict=False)]
    assert [batch["keys"] for batch in got] == [batch["keys"] for batch in expected]
    for mine, theirs in zip(got, expected, strict=True):
        check_pack(mine, tokens)
        for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_q"):
            assert torch.equal(mine[name], theirs[name])
    # Energon's restore key of a pack rebuilds it through encode_sample and pack_selected_samples.
    again = resumed.restore_sample(expected[3]["__restore_key__"])
    assert again["keys"] == expected[3]["keys"] and torch.equal(again["input_ids"], expected[3]["input_ids"])


def test_checking_lengths_in_encode_sample_skips_only_the_long_samples(dataset, loader):
    path, tokens = dataset
    encoder = TextEncoder(skip_long=True)
    encoder.pack_size = 24
    packs = list(loader(path, 0, encoder, repeat=False))
    fitting = [key for key, ids in tokens.items() if -(-len(ids) // MULTIPLE) * MULTIPLE <= 24]
    assert sorted(key for batch in packs for key in batch["keys"]) == sorted(fitting) != sorted(tokens)


# -- Qwen-VL packs ------------------------------------------------------------------------------------

IMAGE, START, END = 90, 92, 93


class VisionEncoder(TextEncoder):
    """Every third sample ends with an image of ``[1, 4, 4]`` patches (4 tokens); its pixels hold the
    sample's number."""

    vlm_rope = QwenVLRope("qwen2_vl", image_token_id=IMAGE, rule="spatial_extent")

    @stateless
    def encode_sample(self, sample: TextSample) -> PreparedSample:
        number = int(sample.__key__[1:])
        ids = [int(token) % 80 + 1 for token in sample.text.split()]
        visual = {}
        if number % 3 == 0:
            ids += [START, *[IMAGE] * 4, END]
            visual = {
                "pixel_values": torch.full((16, 6), float(number)),
                "image_grid_thw": torch.tensor([[1, 4, 4]]),
            }
        ids = torch.tensor(ids)
        return PreparedSample.derive_from(sample, input_ids=ids, labels=ids + 1, **visual)


def test_qwen_vl_packs_through_a_real_loader(dataset, loader):
    path, tokens = dataset
    encoder = VisionEncoder()
    packs = list(loader(path, 0, encoder, repeat=False))
    assert sorted(key for batch in packs for key in batch["keys"]) == sorted(tokens)
    with_images = 0
    for batch in packs:
        fields = ("input_ids", "labels", "pixel_values", "image_grid_thw")
        rows = []
        for key in batch["keys"]:
            text = " ".join(map(str, tokens[key]))
            member = encoder.encode_sample(TextSample(__key__=key, __restore_key__=(), text=text))
            rows.append(
                {field: getattr(member, field) for field in fields if getattr(member, field) is not None}
            )
        expected = pack_vlm_samples(rows, encoder.vlm_rope, pad_to_multiple_of=MULTIPLE)
        assert torch.equal(batch["mrope_position_ids"], expected["mrope_position_ids"])
        numbers = [int(key[1:]) for key in batch["keys"] if int(key[1:]) % 3 == 0]
        if numbers:
            with_images += 1
            assert batch["pixel_values"][::16, 0].tolist() == [float(n) for n in numbers]  # member order
            assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * len(numbers)
    assert with_images > 1
