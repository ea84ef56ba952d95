"""Online packing of preference units: every unit whole in one preference row, every row once, the
deadline and cost bounds of the online packer, and an exact resume from every step.

Real rows of the demo corpus (pairs as conversations, groups of four with rewards) tokenized by the
built-in GPT-2 tokenizer; each pack is checked against the row built directly from the encoder's units
of its keys, so the packer adds nothing and loses nothing.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from tests.preference_data import conversation_pairs, groups
from tightpack.core.cost_model import CostModel
from tightpack.core.preference_costs import unit_costs
from tightpack.core.preference_units import PreferenceUnits, unit_attention_costs, unit_sizes
from tightpack.errors import TightpackError
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime import masks
from tightpack.runtime.online_config import OnlinePackConfig
from tightpack.runtime.online_preference import OnlinePreferencePacker
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.thd import validate_thd_batch

LAYOUTS = ("pairs", "shared-prefix")
PACK_SIZE, BUFFER = 256, 6


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer()


@pytest.fixture(scope="module")
def pair_rows():
    return conversation_pairs(48)


def encoded(spec, rows, kind="preference") -> PreferenceUnits:
    result = PreferenceEncoder(spec, kind).encode_rows(rows)
    assert not result.bad_rows
    return result.units


def run(packer) -> list[dict]:
    return list(packer)


def counts_of(packer, *names: str) -> list[int]:
    return [packer.counts[name] for name in names]


def assert_packs_hold_every_unit_whole(packs, units, layout, multiple=1):
    """Each pack is the row of its keys' units, every row's unit exactly once."""
    for pack in packs:
        validate_thd_batch(pack)
        assert pack["input_ids"].shape[1] <= PACK_SIZE
        expected = build_preference_row(units.select(pack["keys"]), layout, pad_to_multiple_of=multiple)
        for key in ("input_ids", "labels", "position_ids", "branch_unit", "branch_index", "cu_seqlens_q"):
            assert torch.equal(pack[key], expected[key]), key
    assert Counter(key for pack in packs for key in pack["keys"]) == Counter(range(len(units)))


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_unit_lands_whole_in_one_pack_once(gpt2, pair_rows, layout, strategy):
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER, strategy=strategy,
                              pad_to_multiple_of=4)  # fmt: skip
    packer = OnlinePreferencePacker.from_rows(pair_rows, config, tokenizer=gpt2, layout=layout)
    packs = run(packer)
    units = encoded(gpt2, pair_rows)
    assert_packs_hold_every_unit_whole(packs, units, layout, multiple=4)
    sizes = unit_sizes(units, layout, 4)
    assert all(int(sizes[pack["keys"]].sum()) == pack["input_ids"].shape[1] for pack in packs)
    assert packer.counts["samples"] == len(units) and packer.counts["packs"] == len(packs)
    assert packer.counts["tokens"] == int(unit_sizes(units, layout).sum())
    assert packer.counts["max_wait"] <= config.wait_limit
    # rows of several units (a unit takes 30 to 220 tokens here), fuller with best_fill
    assert packer.fill() >= (0.85 if strategy == "best_fill" else 0.7)


def test_groups_keep_their_rewards_and_the_shared_prompt_saves_tokens(gpt2):
    rows = groups(12, 4)
    config = OnlinePackConfig(pack_size=1024, packing_buffer_size=4)
    packed = {}
    for layout in LAYOUTS:
        packer = OnlinePreferencePacker.from_rows(rows, config, tokenizer=gpt2, kind="groups", layout=layout)
        packed[layout] = run(packer)
    units = encoded(gpt2, rows, "groups")
    for packs in packed.values():
        for pack in packs:
            validate_thd_batch(pack)
            assert pack["branch_group_size"].tolist() == [4] * (4 * len(pack["keys"]))
            assert pack["branch_reward"].tolist() == [1.0, 0.0, 0.0, 0.0] * len(pack["keys"])
        assert Counter(k for pack in packs for k in pack["keys"]) == Counter(range(len(rows)))
    tokens = {layout: sum(p["input_ids"].shape[1] for p in packs) for layout, packs in packed.items()}
    assert tokens["shared-prefix"] == int(unit_sizes(units, "shared-prefix").sum()) < tokens["pairs"]


def saved_states(packer) -> tuple[list[dict], list[dict]]:
    """The packs of an uninterrupted pass and the state saved before each pack and after the last."""
    states, packs = [copy.deepcopy(packer.state_dict())], []
    for pack in packer:
        packs.append(pack)
        states.append(copy.deepcopy(packer.state_dict()))
    return packs, states


def as_lists(packs) -> list[tuple[list[int], list[int]]]:
    return [(pack["keys"], pack["input_ids"].tolist()) for pack in packs]


@pytest.mark.parametrize(
    ("strategy", "layout", "capped"),
    [("best_fill", "shared-prefix", False), ("ffd", "pairs", False), ("best_fill", "pairs", True)],
)
def test_a_resumed_packer_yields_the_packs_of_an_uninterrupted_one(gpt2, pair_rows, strategy, layout, capped):
    model = CostModel(linear=1.0, quadratic=0.5, per_sequence=20.0, unit="seconds")
    cap = {"cost_model": model, "max_pack_cost": 9000.0} if capped else {}
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER, strategy=strategy,
                              data_id="pairs-48", **cap)  # fmt: skip

    def packer():
        return OnlinePreferencePacker.from_rows(pair_rows, config, tokenizer=gpt2, layout=layout)

    packs, states = saved_states(packer())
    uninterrupted = as_lists(packs)
    for cut, state in enumerate(states[:-1]):
        resumed = packer()
        resumed.load_state_dict(state)
        assert uninterrupted[:cut] + as_lists(resumed) == uninterrupted, f"resumed after {cut} packs"
        assert resumed.counts == states[-1]["counts"]
    if capped:  # the cap bites, and a pack's cost is the sum of its units' costs in the layout
        units = encoded(gpt2, pair_rows)
        costs = unit_costs(units, layout, model)
        pack_costs = [float(costs[pack["keys"]].sum()) for pack in packs]
        alone = [len(pack["keys"]) == 1 for pack in packs]
        assert all(cost <= 9000.0 or one for cost, one in zip(pack_costs, alone, strict=True))
        assert states[-1]["counts"]["capped_packs"] > 0
        assert states[-1]["counts"]["cost"] == pytest.approx(sum(pack_costs))


def test_a_state_of_another_layout_or_data_is_refused(gpt2, pair_rows):
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER)
    first = OnlinePreferencePacker.from_rows(pair_rows, config, tokenizer=gpt2, layout="pairs")
    next(iter(first))
    state = first.state_dict()
    other = OnlinePreferencePacker.from_rows(pair_rows, config, tokenizer=gpt2, layout="shared-prefix")
    with pytest.raises(TightpackError, match=r"preference_layout saved 'pairs' now 'shared-prefix'"):
        other.load_state_dict(state)
    shifted = OnlinePreferencePacker.from_rows(pair_rows[1:] + pair_rows[:1], config, tokenizer=gpt2)
    with pytest.raises(TightpackError, match=r"restored sample \d+ has \d+ tokens, saved with \d+"):
        shifted.load_state_dict(state)


def test_resume_through_a_stateful_dataloader_with_two_workers(gpt2, pair_rows):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER, data_id="pairs-48")

    def loader():
        packer = OnlinePreferencePacker.from_rows(pair_rows, config, tokenizer=gpt2, layout="shared-prefix")
        return stateful.StatefulDataLoader(packer, batch_size=None, num_workers=2)

    first, states, uninterrupted = loader(), [], []
    for pack in first:
        states.append(copy.deepcopy(first.state_dict()))
        uninterrupted.append((pack["keys"], pack["input_ids"].tolist()))
    for cut in (1, len(states) // 2):
        resumed = loader()
        resumed.load_state_dict(states[cut - 1])
        assert uninterrupted[:cut] + as_lists(resumed) == uninterrupted, cut


LONG = {"prompt": "Tell me about " + "the sea and the sky, " * 30 + "please.", "chosen": " Blue.",
        "rejected": " Red."}  # fmt: skip
BAD = {"prompt": "Q:", "chosen": " same", "rejected": " same"}


def test_long_units_are_fitted_dropped_or_refused_and_counted(gpt2, pair_rows):
    rows = [pair_rows[0], LONG, pair_rows[1], BAD, pair_rows[2]]
    size = 96
    fitted = OnlinePreferencePacker.from_rows(
        rows, OnlinePackConfig(pack_size=size, packing_buffer_size=2), tokenizer=gpt2, layout="pairs",
        skip_bad_rows=True,
    )  # fmt: skip
    packs = run(fitted)
    assert sorted(k for pack in packs for k in pack["keys"]) == [0, 1, 2, 4]
    assert all(pack["input_ids"].shape[1] <= size for pack in packs)
    assert counts_of(fitted, "truncated", "prompt_trimmed", "bad_rows", "dropped") == [1, 1, 1, 0]
    long_pack = next(pack for pack in packs if 1 in pack["keys"])
    assert long_pack["branch_prompt_length"].max() < encoded(gpt2, [LONG]).prompt_lengths[0]

    dropped = OnlinePreferencePacker.from_rows(
        rows[:3], OnlinePackConfig(pack_size=size, packing_buffer_size=2, long_samples="drop"), tokenizer=gpt2
    )
    assert sorted(k for pack in run(dropped) for k in pack["keys"]) == [0, 2]
    assert dropped.counts["dropped"] == 1 and dropped.counts["truncated"] == 0

    config = OnlinePackConfig(pack_size=size, packing_buffer_size=2, long_samples="error")
    strict = OnlinePreferencePacker.from_rows(rows[:3], config, tokenizer=gpt2)
    with pytest.raises(TightpackError, match=r"unit 1 takes \d+ tokens in the pairs layout, above the pack"):
        run(strict)
    default = OnlinePackConfig(pack_size=size, packing_buffer_size=8)
    unskipped = OnlinePreferencePacker.from_rows(rows, default, tokenizer=gpt2)
    message = r"row 3: 'chosen' and 'rejected' are identical: the pair states no .*skip_bad_rows=True"
    with pytest.raises(TightpackError, match=message):
        run(unskipped)


def prepared(units: PreferenceUnits) -> list[dict]:
    return [{"key": f"u{u}", "units": units.select([u])} for u in range(len(units))]


def test_units_that_cannot_fit_are_left_out_with_their_reasons(caplog):
    units = PreferenceUnits.from_lists(
        [[1, 2], [1, 2, 3, 4], [5, 6]],
        [[7] * 6, [8], [9] * 2, [10] * 2, [11], [12], [13], [14], [15], [16], [17], [18]],
        [2, 2, 8],
        loss_masks=[[0, 0, 0, 0, 0, 1], [1], [1, 1], [1, 1], *[[1]] * 8],
    )  # unit 0: chosen supervised on its last token only; unit 1 fits trimmed; unit 2: 8 branches
    samples = prepared(units)
    config = OnlinePackConfig(pack_size=8, packing_buffer_size=2)
    packer = OnlinePreferencePacker(lambda start, stride: iter(samples[start::stride]), config)
    with caplog.at_level("WARNING", logger="tightpack"):
        packs = run(packer)
    assert [pack["keys"] for pack in packs] == [["u1"]]
    assert packs[0]["input_ids"].tolist() == [[3, 4, 9, 9, 3, 4, 10, 10]]  # the prompt's end kept
    assert counts_of(packer, "dropped", "no_supervised", "truncated", "prompt_trimmed") == [2, 1, 1, 1]
    assert "left out unit 'u0' over pack_size=8: cutting it to the cap of 8 leaves branch 0" in caplog.text
    assert "left out unit 'u2' over pack_size=8: its 8 branches need at least 16 tokens" in caplog.text


def test_rows_padded_to_the_pack_size_stay_valid(gpt2, pair_rows):
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER, pad_to_max_length=True,
                              pad_token_id=gpt2.eos_id)  # fmt: skip
    for layout in LAYOUTS:
        packs = run(OnlinePreferencePacker.from_rows(pair_rows[:12], config, tokenizer=gpt2, layout=layout))
        units = encoded(gpt2, pair_rows[:12])
        for pack in packs:
            validate_thd_batch(pack)
            assert pack["input_ids"].shape == (1, PACK_SIZE)
            plain = build_preference_row(units.select(pack["keys"]), layout)
            width = plain["input_ids"].shape[1]
            assert torch.equal(pack["labels"][:, :width], plain["labels"])
            assert (pack["labels"][0, width:] == -100).all() and pack["padding_mask"][0, width:].all()


def test_a_samples_units_must_be_one_unit():
    units = PreferenceUnits.from_lists([[1, 2], [3, 4]], [[5], [6], [7], [8]], [2, 2])
    samples = [{"key": "two", "units": units}]
    config = OnlinePackConfig(pack_size=64, packing_buffer_size=2)
    packer = OnlinePreferencePacker(lambda start, stride: iter(samples[start::stride]), config)
    with pytest.raises(TightpackError, match=r"sample 'two': 'units' must be a PreferenceUnits of one unit"):
        run(packer)


def test_unit_costs_price_the_layouts_attention():
    units = PreferenceUnits.from_lists([[1] * 7, [2] * 3], [[3] * 4, [4] * 2, [5] * 5, [6], [7] * 2], [2, 3])
    model = CostModel(linear=3.0, quadratic=0.25, per_sequence=7.0, unit="seconds")
    for multiple in (1, 4):
        # pairs: the cost model over the unit's aligned sequences prompt + branch
        lengths = [7 + 4, 7 + 2, 3 + 5, 3 + 1, 3 + 2]
        aligned = -(-np.array(lengths) // multiple) * multiple
        expected = [model.sequence_costs(aligned[:2]).sum(), model.sequence_costs(aligned[2:]).sum()]
        got = unit_costs(units, "pairs", model, pad_to_multiple_of=multiple)
        assert got.tolist() == pytest.approx(expected)
    # shared prefix: quadratic work from the mask itself (twice the allowed pairs less the diagonal)
    batch = build_preference_row(units, "shared-prefix")
    allowed = masks.sdpa_mask(batch)[0, 0]
    bounds = batch["cu_seqlens_q"].tolist()
    work = [2 * int(allowed[a:b, a:b].sum()) - (b - a) for a, b in itertools.pairwise(bounds)]
    assert unit_attention_costs(units, "shared-prefix").tolist() == work
    sizes = np.diff(bounds)
    assert unit_costs(units, "shared-prefix", model).tolist() == pytest.approx(
        (3.0 * sizes + 0.25 * np.array(work) + 7.0).tolist()
    )
