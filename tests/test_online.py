"""OnlinePacker: nothing lost or duplicated, the reference's ffd semantics, max_wait, exact resume.

The deadline invariant under inputs that force samples is proved in ``test_online_forcing.py``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from tightpack.core.planner import plan_packs
from tightpack.errors import TightpackError
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker
from tightpack.runtime.vlm import pack_vlm_samples


def make_stream(count: int, seed: int, high: int = 300):
    lengths = np.random.default_rng(seed).integers(1, high, count)
    samples = [
        {"key": f"s{i}", "input_ids": torch.arange(n) + i, "loss_mask": torch.ones(n)}
        for i, n in enumerate(lengths)
    ]
    by_key = {s["key"]: s for s in samples}
    return samples, (lambda start, stride: iter(samples[start::stride])), by_key.__getitem__


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("multiple", [1, 4])
def test_every_sample_once_and_packs_within_size(strategy, multiple):
    samples, source, restore = make_stream(300, seed=1)
    config = OnlinePackConfig(
        pack_size=1024, packing_buffer_size=16, strategy=strategy, pad_to_multiple_of=multiple
    )
    packer = OnlinePacker(source, config, restore=restore)
    packs = list(packer)
    keys = [key for pack in packs for key in pack["keys"]]
    assert sorted(keys) == sorted(s["key"] for s in samples)
    assert all(pack["total_tokens"] <= 1024 for pack in packs)
    for pack in packs:
        offsets = pack.get("cu_seqlens_q_padded", pack["cu_seqlens_q"]).tolist()
        for key, start in zip(pack["keys"], offsets, strict=False):
            ids = samples[int(key[1:])]["input_ids"]
            assert torch.equal(pack["input_ids"][0, start : start + len(ids)], ids)


def test_ffd_groups_the_whole_buffer_first():
    samples, source, restore = make_stream(40, seed=2)
    config = OnlinePackConfig(pack_size=1024, packing_buffer_size=16, strategy="ffd")
    packer = OnlinePacker(source, config, restore=restore)
    packs = list(packer)
    plan = plan_packs([len(s["input_ids"]) for s in samples[:16]], 1024, algorithm="ffd")
    assert [pack["keys"] for pack in packs[: len(plan)]] == [
        [f"s{i}" for i in group.tolist()] for group in plan
    ]


@pytest.mark.parametrize(("high", "max_wait"), [(1500, 32), (1500, 40), (900, 32), (2048, 32)])
def test_best_fill_keeps_waits_within_max_wait(high, max_wait):
    _, source, restore = make_stream(2000, seed=3, high=high)  # long samples: leftovers accumulate
    config = OnlinePackConfig(pack_size=2048, packing_buffer_size=32, max_wait=max_wait)
    packer = OnlinePacker(source, config, restore=restore)
    list(packer)
    assert packer.counts["samples"] == 2000 and packer.counts["max_wait"] <= max_wait
    assert packer.counts["max_wait"] > packer.mean_wait > 1  # samples did wait, none beyond the bound


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("checkpoint", [0, 1, 5, 17])
def test_resume_yields_exactly_the_uninterrupted_packs(strategy, checkpoint):
    config = OnlinePackConfig(pack_size=1024, packing_buffer_size=12, strategy=strategy, pad_to_multiple_of=4)
    _, source, restore = make_stream(150, seed=4)
    uninterrupted = [
        (p["keys"], p["input_ids"].tolist()) for p in OnlinePacker(source, config, restore=restore)
    ]
    first = OnlinePacker(source, config, restore=restore)
    iterator = iter(first)
    head = [(p["keys"], p["input_ids"].tolist()) for _, p in zip(range(checkpoint), iterator, strict=False)]
    state = first.state_dict()
    assert all(isinstance(key, str) for key, *_ in state["buffer"])  # keys, not tensors
    resumed = OnlinePacker(source, config, restore=restore)
    resumed.load_state_dict(state)
    assert head + [(p["keys"], p["input_ids"].tolist()) for p in resumed] == uninterrupted


def test_resume_with_other_settings_is_refused():
    _, source, restore = make_stream(20, seed=5)
    state = OnlinePacker(source, OnlinePackConfig(pack_size=1024, packing_buffer_size=8)).state_dict()
    other = OnlinePacker(source, OnlinePackConfig(pack_size=2048, packing_buffer_size=8), restore=restore)
    with pytest.raises(TightpackError, match="different settings: pack_size saved 1024 now 2048"):
        other.load_state_dict(state)


def test_long_samples_are_counted():
    samples = [{"key": "a", "input_ids": torch.arange(50)}, {"key": "b", "input_ids": torch.arange(10)}]

    def packer(long_samples: str) -> OnlinePacker:
        config = OnlinePackConfig(pack_size=32, packing_buffer_size=2, long_samples=long_samples)
        return OnlinePacker(lambda start, stride: iter(samples[start::stride]), config)

    truncate = packer("truncate")
    packs = list(truncate)
    assert truncate.counts["truncated"] == 1 and sum(len(p["keys"]) for p in packs) == 2
    drop = packer("drop")
    assert [p["keys"] for p in drop] == [["b"]] and drop.counts["dropped"] == 1
    error = packer("error")
    with pytest.raises(TightpackError, match="sample 'a' has 50 tokens, above the pack size 32"):
        list(error)


def test_max_wait_below_the_buffer_is_refused():
    with pytest.raises(TightpackError, match=r"max_wait \(4\) must be at least packing_buffer_size \(8\)"):
        OnlinePacker(
            lambda start, stride: iter([]), OnlinePackConfig(pack_size=64, packing_buffer_size=8, max_wait=4)
        )
    # ffd never forces a sample, so its max_wait is not checked
    OnlinePackConfig(pack_size=64, packing_buffer_size=8, max_wait=4, strategy="ffd").validate()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pack_size": 0}, "pack_size must be a positive integer (tokens per pack), got 0"),
        ({"pack_size": 8.0}, "pack_size must be a positive integer (tokens per pack), got 8.0"),
        (
            {"pad_to_multiple_of": 0},
            "pad_to_multiple_of must be an integer between 1 and pack_size (64), got 0",
        ),
        (
            {"pad_to_multiple_of": 128},
            "pad_to_multiple_of must be an integer between 1 and pack_size (64), got 128",
        ),
        (
            {"packing_buffer_size": 0},
            "packing_buffer_size must be a positive integer (candidates kept per worker)",
        ),
        ({"packing_buffer_size": True}, "packing_buffer_size must be a positive integer"),
        ({"strategy": "bfd"}, "strategy must be one of best_fill, ffd; got 'bfd'"),
        ({"long_samples": "cut"}, "long_samples must be one of truncate, drop, error; got 'cut'"),
        ({"max_wait": 8.5}, "max_wait must be an integer number of steps or None, got 8.5"),
        ({"max_wait": 7}, "max_wait (7) must be at least packing_buffer_size (8)"),
    ],
)
def test_every_setting_is_validated_with_the_value_and_the_fix(changes, message):
    config = OnlinePackConfig(**({"pack_size": 64, "packing_buffer_size": 8} | changes))
    with pytest.raises(TightpackError, match=re.escape(message)):
        config.validate()
    with pytest.raises(TightpackError, match=re.escape(message)):
        OnlinePacker(lambda start, stride: iter([]), config)


def test_the_packer_takes_a_config_and_checks_its_rank():
    with pytest.raises(TightpackError, match="config must be an OnlinePackConfig, got dict"):
        OnlinePacker(lambda start, stride: iter([]), {"pack_size": 64, "packing_buffer_size": 8})
    config = OnlinePackConfig(pack_size=64, packing_buffer_size=8)
    with pytest.raises(TightpackError, match=re.escape("rank (2) must be in [0, world_size=2)")):
        OnlinePacker(lambda start, stride: iter([]), config, rank=2, world_size=2)


def test_saved_settings_come_from_the_config_and_the_data_parallel_layout():
    config = OnlinePackConfig(pack_size=64, packing_buffer_size=8, pad_token_id=7, data_id="d")
    packer = OnlinePacker(lambda start, stride: iter([]), config, rank=1, world_size=2)
    assert packer.state_dict()["settings"] == {
        "pack_size": 64,
        "packing_buffer_size": 8,
        "strategy": "best_fill",
        "max_wait": 32,  # resolved: 4 x packing_buffer_size
        "pad_to_multiple_of": 1,
        "pad_to_max_length": False,
        "long_samples": "truncate",
        "data_id": "d",
        "rank": 1,
        "world_size": 2,
    }
    # padding values change no selection: a checkpoint resumes under other ones
    other = OnlinePacker(lambda start, stride: iter([]), replace(config, pad_token_id=0, ignore_index=-1),
                         rank=1, world_size=2)  # fmt: skip
    other.load_state_dict(packer.state_dict())


def test_a_state_saved_before_the_forcing_counters_still_resumes():
    _, source, restore = make_stream(60, seed=13, high=512)  # long samples: some are forced
    config = OnlinePackConfig(pack_size=512, packing_buffer_size=6, max_wait=6)
    first = OnlinePacker(source, config, restore=restore)
    iterator = iter(first)
    head = [p["keys"] for _, p in zip(range(15), iterator, strict=False)]
    state = first.state_dict()
    for name in ("forced", "forced_packs", "multi_forced_packs"):
        del state["counts"][name]
    resumed = OnlinePacker(source, config, restore=restore)
    resumed.load_state_dict(state)
    uninterrupted = OnlinePacker(source, config)
    assert head + [p["keys"] for p in resumed] == [p["keys"] for p in uninterrupted]
    assert first.counts["forced"] > 0  # the dropped counters did carry something
    for name in ("forced", "forced_packs", "multi_forced_packs"):  # counted from the resume on
        assert resumed.counts[name] == uninterrupted.counts[name] - first.counts[name]


class Stream:
    """A picklable stream of ``count`` samples of random lengths, with an image tensor on every third."""

    def __init__(self, count: int, seed: int, high: int = 300) -> None:
        self.lengths = np.random.default_rng(seed).integers(1, high, count)

    def sample(self, index: int) -> dict:
        n = int(self.lengths[index])
        sample = {"key": f"s{index}", "input_ids": torch.arange(n) + index, "loss_mask": torch.ones(n)}
        if index % 3 == 0:
            sample["pixel_values"] = torch.full((index % 7 + 1, 4), float(index))
        return sample

    def __call__(self, start: int, stride: int):
        return (self.sample(i) for i in range(start, len(self.lengths), stride))

    def restore(self, key: str) -> dict:
        return self.sample(int(key[1:]))


def loader_packs(loader) -> list[tuple[list[str], list[int]]]:
    return [(pack["keys"], pack["input_ids"].tolist()) for pack in loader]


def test_dataloader_workers_and_ranks_pack_their_own_shards():
    stream = Stream(240, seed=6)
    keys_by_rank = []
    for rank in range(2):
        config = OnlinePackConfig(pack_size=1024, packing_buffer_size=8)
        packer = OnlinePacker(stream, config, restore=stream.restore, rank=rank, world_size=2)
        loader = torch.utils.data.DataLoader(packer, batch_size=None, num_workers=2)
        packs = loader_packs(loader)
        for keys, _ in packs:  # shard of rank r, worker w: positions r * 2 + w modulo 4
            assert len({int(key[1:]) % 4 for key in keys}) == 1
            assert {int(key[1:]) % 4 for key in keys} <= {rank * 2, rank * 2 + 1}
        keys_by_rank.append([key for keys, _ in packs for key in keys])
    assert sorted(keys_by_rank[0] + keys_by_rank[1]) == sorted(f"s{i}" for i in range(240))


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
def test_stateful_dataloader_with_workers_resumes_exactly(strategy):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    stream = Stream(300, seed=7)

    def loader():
        config = OnlinePackConfig(
            pack_size=1024,
            packing_buffer_size=10,
            strategy=strategy,
            pad_to_multiple_of=4,
            data_id="stream-7",
        )
        packer = OnlinePacker(stream, config, restore=stream.restore)
        return stateful.StatefulDataLoader(packer, batch_size=None, num_workers=2)

    uninterrupted = loader_packs(loader())
    for checkpoint in (3, 20):
        first = loader()
        iterator = iter(first)
        head = [
            (p["keys"], p["input_ids"].tolist()) for _, p in zip(range(checkpoint), iterator, strict=False)
        ]
        state = first.state_dict()
        del iterator
        resumed = loader()
        resumed.load_state_dict(state)
        assert head + loader_packs(resumed) == uninterrupted


def test_resume_checks_the_shard_layout_and_the_data():
    stream = Stream(100, seed=8)
    config = OnlinePackConfig(pack_size=1024, packing_buffer_size=8, data_id="a")
    packer = OnlinePacker(stream, config, restore=stream.restore)
    next(iter(packer))
    state = packer.state_dict()

    other_layout = dict(state, shard=[1, 2])  # as saved by worker 1 of 2
    resumed = OnlinePacker(stream, config, restore=stream.restore)
    resumed.load_state_dict(other_layout)
    with pytest.raises(TightpackError, match=r"saved by shard 1 of 2 .* loaded in shard 0 of 1"):
        next(iter(resumed))

    with pytest.raises(TightpackError, match="data_id saved 'a' now 'b'"):
        OnlinePacker(stream, replace(config, data_id="b"), restore=stream.restore).load_state_dict(state)

    changed = Stream(100, seed=9)  # same keys, other lengths
    with pytest.raises(TightpackError, match=r"restored sample 's\d+' has \d+ tokens, saved with \d+"):
        OnlinePacker(changed, config, restore=changed.restore).load_state_dict(state)


def test_visual_tensors_travel_with_their_sample_and_memory_is_reported():
    stream = Stream(60, seed=10)
    packer = OnlinePacker(stream, OnlinePackConfig(pack_size=512, packing_buffer_size=6))
    for pack in packer:
        members = [stream.sample(int(key[1:])) for key in pack["keys"]]
        images = [m["pixel_values"] for m in members if "pixel_values" in m]
        if images:
            assert torch.equal(pack["pixel_values"], torch.cat(images))
        else:
            assert "pixel_values" not in pack
    largest = max(
        sum(v.nbytes for v in stream.sample(i).values() if isinstance(v, torch.Tensor)) for i in range(60)
    )
    assert packer.counts["held_bytes"] == 0  # everything emitted
    assert 0 < packer.counts["peak_held_bytes"] <= 6 * largest


def test_best_fill_fills_better_than_ffd_on_a_heavy_tailed_stream():
    lengths = np.minimum(np.random.default_rng(11).lognormal(4.5, 1.3, 3000).astype(int) + 1, 2048)
    samples = [{"key": i, "input_ids": torch.zeros(int(n), dtype=torch.long)} for i, n in enumerate(lengths)]
    fills = {}
    for strategy in ("ffd", "best_fill"):
        config = OnlinePackConfig(pack_size=2048, packing_buffer_size=32, strategy=strategy)
        packer = OnlinePacker(lambda start, stride: iter(samples[start::stride]), config)
        assert sum(len(pack["keys"]) for pack in packer) == len(samples)
        fills[strategy] = packer.fill()
    assert fills["best_fill"] > fills["ffd"] + 0.03, fills
    assert packer.counts["max_wait"] <= 4 * 32


def test_a_second_pass_over_a_finite_stream_starts_again():
    _, source, restore = make_stream(30, seed=12)
    packer = OnlinePacker(source, OnlinePackConfig(pack_size=512, packing_buffer_size=4), restore=restore)
    assert [p["keys"] for p in packer] == [p["keys"] for p in packer]


def test_qwen_vl_packs_carry_positions_and_visual_tensors_in_member_order():
    """``pack_fn=partial(pack_vlm_samples, rope=...)``: each pack is the Qwen-VL batch of its members."""
    image, start, end = 90, 92, 93
    rope = QwenVLRope("qwen2_5_vl", image_token_id=image, video_token_id=91, tokens_per_second=2)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(40):
        ids, visual = torch.arange(int(rng.integers(1, 30))) % 80 + 1, {}
        if i % 2:
            side = int(rng.choice([2, 4]))
            ids = torch.cat([ids, torch.tensor([start, *[image] * (side * side // 4), end])])
            visual = {
                "pixel_values": torch.full((side * side, 3), float(i)),
                "image_grid_thw": torch.tensor([[1, side, side]]),
            }
        samples.append({"key": i, "input_ids": ids, **visual})
    config = OnlinePackConfig(pack_size=64, packing_buffer_size=8, pad_to_multiple_of=4)
    packer = OnlinePacker(
        lambda first, stride: iter(samples[first::stride]),
        config,
        pack_fn=partial(pack_vlm_samples, rope=rope),
    )
    packs = list(packer)
    assert sorted(key for pack in packs for key in pack["keys"]) == list(range(40))
    for pack in packs:
        members = [samples[key] for key in pack["keys"]]
        expected = pack_vlm_samples(members, rope, pad_to_multiple_of=4)
        assert torch.equal(pack["mrope_position_ids"], expected["mrope_position_ids"])
        if "pixel_values" in pack:
            assert pack["pixel_values"][:, 0].unique_consecutive().tolist() == [
                float(k) for k in pack["keys"] if k % 2
            ]
