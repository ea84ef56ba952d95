"""OnlinePacker's cost cap (``cost_model`` and ``max_pack_cost``): bounds, deadlines, counts, resume.

Every check recomputes from the emitted packs, outside the packer: a pack's cost is the exactly
rounded sum (`math.fsum`) of its members' `CostModel.sequence_costs` at their aligned lengths.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker

from .draws import Draws, HypothesisDraws, SeededDraws
from .online_stream import Stream
from .test_online_forcing import check_deadlines, consume

SQUARES = CostModel(linear=0.0, quadratic=1.0, unit="seconds")
"""A pack of sequences ``s`` costs ``sum(s**2)``: easy to work by hand."""


def aligned_lengths(lengths: list[int], config: OnlinePackConfig) -> list[int]:
    """The runtime length of each sample: aligned, and truncated to the pack size."""
    multiple, size = config.pad_to_multiple_of, config.pack_size
    longest = size // multiple * multiple
    return [min(-(-n // multiple) * multiple, longest) for n in lengths]


def pack_costs(keys: list[list[str]], lengths: list[int], config: OnlinePackConfig) -> list[float]:
    costs = CostModel.resolve(config.cost_model).sequence_costs(aligned_lengths(lengths, config))
    return [math.fsum(float(costs[int(key[1:])]) for key in members) for members in keys]


def expected_cost_counts(keys: list[list[str]], stream: Stream, config: OnlinePackConfig) -> dict:
    """The cost counts, recomputed from the packs and the steps at which the stream was read."""
    cap, size = config.max_pack_cost, config.pack_size
    aligned = aligned_lengths(stream.lengths, config)
    costs = CostModel.resolve(config.cost_model).sequence_costs(aligned)
    totals = pack_costs(keys, stream.lengths, config)
    emitted_at = {key: step for step, members in enumerate(keys) for key in members}
    capped = 0
    for step, members in enumerate(keys):
        room = size - sum(aligned[int(key[1:])] for key in members)
        member_costs = [float(costs[int(key[1:])]) for key in members]
        # read by this step and left for a later pack (the rest of the buffer, or later ffd groups)
        waiting = [key for key in emitted_at if stream.arrival[key] <= step < emitted_at[key]]
        capped += any(
            aligned[int(key[1:])] <= room and math.fsum([*member_costs, float(costs[int(key[1:])])]) > cap
            for key in waiting
        )
    total = 0.0
    for cost in totals:  # summed in emission order, as the packer does
        total += cost
    return {
        "cost": total,
        "max_pack_cost": max(totals, default=0.0),
        "capped_packs": capped,
        "over_cap_samples": sum(
            len(members) == 1 and cost > cap for members, cost in zip(keys, totals, strict=True)
        ),
    }


def capped_case(draws: Draws) -> dict:
    """Small packs and buffers, ``max_wait`` near its minimum, caps from a twentieth of a full pack up."""
    multiple = draws.sampled_from([1, 1, 2, 4])
    pack_size = draws.integers(4 * multiple, 64)
    buffer_size = draws.integers(1, 6)
    count = draws.integers(1, 50)
    # As in test_online_forcing: long samples (a few truncated) starve short ones until they are forced.
    short = draws.integers(1, pack_size // 3)
    ranges = [(pack_size - short + 1, pack_size + 8), (1, short)]
    lengths = [draws.integers(*draws.sampled_from(ranges)) for _ in range(count)]
    model = CostModel(
        linear=draws.sampled_from([0.0, 1.0, 0.3]),
        quadratic=draws.sampled_from([0.05, 0.1, 1.0]),
        per_sequence=draws.sampled_from([0.0, 2.5]),
        unit="seconds",
    )
    full_pack = float(model.sequence_costs([pack_size])[0])
    config = OnlinePackConfig(
        pack_size=pack_size,
        packing_buffer_size=buffer_size,
        strategy=draws.sampled_from(["best_fill", "ffd"]),
        max_wait=buffer_size + draws.sampled_from([0, 1, 4]),
        pad_to_multiple_of=multiple,
        cost_model=model,
        max_pack_cost=draws.floats(0.05, 1.2) * full_pack,
    )
    return {"lengths": lengths, "config": config}


@st.composite
def capped_cases(draw: st.DrawFn) -> dict:
    return capped_case(HypothesisDraws(draw))


def check_capped_case(lengths: list[int], config: OnlinePackConfig, draws: Draws) -> dict:
    """Pack ``lengths`` under the cap, check every invariant, resume from a drawn step; the counts."""
    stream = Stream(lengths)
    packer = OnlinePacker(stream, config, restore=stream.restore)
    keys = consume(packer, stream)

    assert sorted(key for members in keys for key in members) == [f"s{i:04d}" for i in range(len(lengths))]
    aligned = aligned_lengths(lengths, config)
    assert all(sum(aligned[int(key[1:])] for key in members) <= config.pack_size for members in keys)
    cap = config.max_pack_cost
    for members, cost in zip(keys, pack_costs(keys, lengths, config), strict=True):
        assert cost <= cap or len(members) == 1, (members, cost, cap)
    if config.strategy == "best_fill":
        check_deadlines(keys, stream.arrival, config.wait_limit)
    expected = expected_cost_counts(keys, stream, config)
    assert {name: packer.counts[name] for name in expected} == expected
    assert packer.counts["packs"] == len(keys)
    assert packer.mean_pack_cost == expected["cost"] / max(len(keys), 1)

    checkpoint = draws.integers(0, len(keys))
    replay = Stream(lengths)
    first = OnlinePacker(replay, config, restore=replay.restore)
    head = consume(first, replay, checkpoint)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able, cost model and cap included
    resumed = OnlinePacker(replay, config, restore=replay.restore)
    resumed.load_state_dict(state)
    assert head + consume(resumed, replay) == keys
    assert resumed.counts == packer.counts
    return packer.counts


@given(case=capped_cases(), data=st.data())
def test_packs_stay_under_the_cap_meet_deadlines_count_and_resume(case: dict, data: st.DataObject):
    """Random search (the profile's settings) for inputs that break an invariant."""
    check_capped_case(case["lengths"], case["config"], HypothesisDraws(data.draw))


FIXED_CASES = 60


def test_fixed_cases_reach_the_cap_and_forcing_under_it():
    """Not vacuous: on fixed examples of the same recipe (seeds 0-59), the invariants hold where caps
    bind, samples lie above the cap and samples are forced (several into one pack) under a cap."""
    totals: Counter = Counter()
    for seed in range(FIXED_CASES):
        draws = SeededDraws(seed)
        case = capped_case(draws)
        counts = check_capped_case(case["lengths"], case["config"], draws)
        totals["examples"] += 1
        totals["over_cap"] += counts["over_cap_samples"] > 0
        totals["capped"] += counts["capped_packs"] > 0
        totals["forced_under_cap"] += counts.get("forced", 0) > 0
        totals["multi_forced_under_cap"] += counts.get("multi_forced_packs", 0) > 0
    # The same floors as over hypothesis's examples; these 60 give 27 capped, 49 over the cap, 8 forced
    # and 5 forcing several, every run.
    assert totals["capped"] >= totals["examples"] // 5, totals
    assert totals["over_cap"] >= totals["examples"] // 10, totals
    assert totals["forced_under_cap"] >= totals["examples"] // 10, totals
    assert totals["multi_forced_under_cap"] >= totals["examples"] // 50, totals


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
def test_sample_above_the_cap_leaves_alone_worked_example(strategy):
    """pack_size 10, cost s**2, cap 50; lengths 8, 2, 2. s0 costs 64: above the cap, alone.

    ffd: 8 opens a pack at 64; the first 2 would make 68 there, so it opens the second; the other 2
    joins it (8). best_fill: the capped fill of the others is [2, 2] (4 tokens, cost 8), s0 alone holds
    8 tokens: it goes first, then [2, 2]. The first pack is capped: 2 tokens of room, and a waiting 2
    fits them but not the cost.
    """
    stream = Stream([8, 2, 2])
    config = OnlinePackConfig(
        pack_size=10, packing_buffer_size=3, strategy=strategy, cost_model=SQUARES, max_pack_cost=50
    )
    packer = OnlinePacker(stream, config)
    assert consume(packer, stream) == [["s0000"], ["s0001", "s0002"]]
    assert {
        name: packer.counts[name] for name in ("cost", "max_pack_cost", "capped_packs", "over_cap_samples")
    } == {
        "cost": 72.0,
        "max_pack_cost": 64.0,
        "capped_packs": 1,
        "over_cap_samples": 1,
    }
    assert packer.mean_pack_cost == 36.0


def test_a_later_tight_sample_is_forced_only_within_the_cap_worked_example():
    """pack_size 10, buffer 3, max_wait 3, cost s**2, cap 6; lengths 2, 9, 9, 2, 9, 8 (s0..s5).

    Without the cap, step 3 forces s0 and s3 together (``test_online_forcing``'s worked example). The
    nines (81) and the eight (64) cost more than the cap: each leaves alone. Two twos cost 8, above it.

    - steps 0-2: the capped fill of the others is one two (2 tokens); a nine alone holds more: s1,
      then s2, then s4.
    - step 3: s0 (slack 0, rank 0) and s3 (1/1) are tight. s0 is forced into the empty pack; s3 fits
      the tokens but not the cost (8 > 6), so it waits; s5 (64) cannot join: [s0], capped.
    - step 4: s3 is due (0/0): [s3]; s5 fits its 8 tokens of room, not its cost: capped.
    - step 5: [s5].
    """
    stream = Stream([2, 9, 9, 2, 9, 8])
    config = OnlinePackConfig(
        pack_size=10, packing_buffer_size=3, max_wait=3, cost_model=SQUARES, max_pack_cost=6
    )
    packer = OnlinePacker(stream, config)
    keys = consume(packer, stream)
    assert keys == [["s0001"], ["s0002"], ["s0004"], ["s0000"], ["s0003"], ["s0005"]]
    check_deadlines(keys, stream.arrival, 3)
    names = ("forced", "forced_packs", "multi_forced_packs", "capped_packs", "over_cap_samples")
    assert {name: packer.counts[name] for name in names} == {
        "forced": 2,
        "forced_packs": 2,
        "multi_forced_packs": 0,
        "capped_packs": 2,
        "over_cap_samples": 4,
    }
    assert packer.counts["cost"] == 3 * 81 + 4 + 4 + 64 and packer.counts["max_pack_cost"] == 81


def heavy_stream(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 300, 400).tolist()


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
def test_a_binding_cap_makes_more_cheaper_packs(strategy):
    lengths = heavy_stream(21)
    model = CostModel(linear=1.0, quadratic=0.01, unit="seconds")
    base = OnlinePackConfig(pack_size=1024, packing_buffer_size=16, strategy=strategy, pad_to_multiple_of=4)
    capped = replace(base, cost_model=model, max_pack_cost=2000.0)
    free_stream, capped_stream = Stream(lengths), Stream(lengths)
    free_keys = consume(OnlinePacker(free_stream, base), free_stream)
    packer = OnlinePacker(capped_stream, capped)
    capped_keys = consume(packer, capped_stream)
    assert max(pack_costs(free_keys, lengths, capped)) > 2000.0  # the cap binds without it
    assert max(pack_costs(capped_keys, lengths, capped)) <= 2000.0  # no sample costs 2000 alone
    assert len(capped_keys) > len(free_keys) * 1.2, (len(capped_keys), len(free_keys))
    assert packer.counts["capped_packs"] > len(capped_keys) // 2
    assert packer.counts["over_cap_samples"] == 0
    if strategy == "best_fill":
        check_deadlines(capped_keys, capped_stream.arrival, capped.wait_limit)


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("seed", [22, 23])
def test_a_cap_that_cannot_bind_changes_nothing(strategy, seed):
    """Without a per-sequence cost, no pack costs more than one sequence of pack_size tokens."""
    lengths = heavy_stream(seed)
    model = CostModel(linear=1.0, quadratic=0.01, unit="seconds")
    base = OnlinePackConfig(pack_size=1024, packing_buffer_size=16, strategy=strategy)
    capped = replace(base, cost_model=model, max_pack_cost=float(model.sequence_costs([1024])[0]))
    free = [(p["keys"], p["input_ids"].tolist()) for p in OnlinePacker(Stream(lengths), base)]
    packer = OnlinePacker(Stream(lengths), capped)
    assert [(p["keys"], p["input_ids"].tolist()) for p in packer] == free
    assert packer.counts["capped_packs"] == 0 and packer.counts["over_cap_samples"] == 0


def test_without_a_cap_there_are_no_cost_counts():
    packer = OnlinePacker(Stream([5, 3]), OnlinePackConfig(pack_size=8, packing_buffer_size=2))
    list(packer)
    assert not {"cost", "max_pack_cost", "capped_packs", "over_cap_samples"} & set(packer.counts)
    assert packer.mean_pack_cost is None


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("checkpoint", [0, 3, 11])
def test_resume_with_a_cap_yields_exactly_the_uninterrupted_packs(strategy, checkpoint):
    lengths = heavy_stream(24)[:150]
    config = OnlinePackConfig(
        pack_size=1024,
        packing_buffer_size=12,
        strategy=strategy,
        pad_to_multiple_of=4,
        cost_model="llama-1b",
        max_pack_cost=float(CostModel.named("llama-1b").sequence_costs([600])[0]),
    )
    uninterrupted = OnlinePacker(Stream(lengths), config)
    expected = [(p["keys"], p["input_ids"].tolist()) for p in uninterrupted]
    stream = Stream(lengths)
    first = OnlinePacker(stream, config, restore=stream.restore)
    iterator = iter(first)
    head = [(p["keys"], p["input_ids"].tolist()) for _, p in zip(range(checkpoint), iterator, strict=False)]
    resumed = OnlinePacker(stream, config, restore=stream.restore)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [(p["keys"], p["input_ids"].tolist()) for p in resumed] == expected
    assert resumed.counts == uninterrupted.counts
    assert uninterrupted.counts["capped_packs"] > 0  # the cap did bind


def test_resume_with_another_cap_or_model_is_refused():
    stream = Stream(heavy_stream(25)[:40])
    config = OnlinePackConfig(pack_size=1024, packing_buffer_size=8, cost_model=SQUARES, max_pack_cost=5000)
    packer = OnlinePacker(stream, config, restore=stream.restore)
    next(iter(packer))
    state = packer.state_dict()

    def resume(other: OnlinePackConfig) -> None:
        OnlinePacker(stream, other, restore=stream.restore).load_state_dict(state)

    resume(replace(config, max_pack_cost=5000.0))  # the same cap, as a float
    with pytest.raises(
        TightpackError, match=re.escape("max_pack_cost saved 5000.0 now 6000.0; resume with the saved")
    ):
        resume(replace(config, max_pack_cost=6000))
    with pytest.raises(
        TightpackError, match=r"cost_model saved \{.*'quadratic': 1\.0.* now \{.*'quadratic': 2\.0"
    ):
        resume(replace(config, cost_model=replace(SQUARES, quadratic=2.0)))
    with pytest.raises(
        TightpackError, match=r"cost_model saved .* now None, max_pack_cost saved 5000\.0 now None"
    ):
        resume(replace(config, cost_model=None, max_pack_cost=None))
    uncapped = OnlinePacker(
        stream, replace(config, cost_model=None, max_pack_cost=None), restore=stream.restore
    )
    with pytest.raises(TightpackError, match=re.escape("max_pack_cost saved None now 5000.0")):
        OnlinePacker(stream, config, restore=stream.restore).load_state_dict(uncapped.state_dict())


def test_settings_hold_the_resolved_model_and_the_cap(tmp_path):
    path = tmp_path / "model.json"
    CostModel.named("llama-8b").save(path)
    by_name = OnlinePackConfig(pack_size=64, packing_buffer_size=8, cost_model="llama-8b", max_pack_cost=1e15)
    by_path = replace(by_name, cost_model=str(path))
    by_value = replace(by_name, cost_model=CostModel.named("llama-8b"))
    assert by_name.settings() == by_path.settings() == by_value.settings()
    saved = by_name.settings()
    assert saved["cost_model"] == CostModel.named("llama-8b").to_dict() and saved["max_pack_cost"] == 1e15
    assert json.loads(json.dumps(saved)) == saved
    assert len({by_name, by_value, replace(by_name)}) == 2  # frozen and hashable, as before


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_pack_cost": 100.0}, "max_pack_cost (100.0) needs a cost_model to measure packs with"),
        ({"cost_model": "llama-8b"}, "cost_model is set ('llama-8b') but max_pack_cost is None"),
        (
            {"cost_model": SQUARES, "max_pack_cost": -1.0},
            "max_pack_cost must be a finite number > 0 (the most a pack may cost, in the cost model's unit), "
            "got -1.0",
        ),
        ({"cost_model": SQUARES, "max_pack_cost": 0}, "max_pack_cost must be a finite number > 0"),
        ({"cost_model": SQUARES, "max_pack_cost": math.inf}, "max_pack_cost must be a finite number > 0"),
        ({"cost_model": SQUARES, "max_pack_cost": True}, "max_pack_cost must be a finite number > 0"),
        ({"cost_model": SQUARES, "max_pack_cost": "1e9"}, "max_pack_cost must be a finite number > 0"),
        (
            {"cost_model": "llama-70b", "max_pack_cost": 1e15},
            "cost_model: cost model 'llama-70b' is neither a preset (llama-1b, llama-8b) nor a cost model "
            "file (no such file)",
        ),
        ({"cost_model": 8, "max_pack_cost": 1e15}, "cost_model: a cost model must be a CostModel"),
    ],
)
def test_the_cost_cap_settings_are_validated(changes, message):
    config = OnlinePackConfig(**({"pack_size": 64, "packing_buffer_size": 8} | changes))
    with pytest.raises(TightpackError, match=re.escape(message)):
        config.validate()
    with pytest.raises(TightpackError, match=re.escape(message)):
        OnlinePacker(Stream([]), config)
