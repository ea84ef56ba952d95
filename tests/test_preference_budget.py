"""Collating preference rows under a token budget: ``max_tokens`` rows with every unit whole, the
token-budget sampler over unit sizes, and the reasons of the units left out.

Real rows of the demo corpus and the built-in GPT-2 tokenizer. Every row is read back unit by unit
from its own keys (the prompt and branches each branch's tokens say), and the units of all rows must
be the encoder's units exactly once.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tests.preference_data import conversation_pairs, groups
from tightpack.core.preference_units import PreferenceUnits, fit_units, unit_sizes
from tightpack.errors import TightpackError
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.preference_collate import DroppedUnit, PreferenceCollator
from tightpack.runtime.samplers import TokenBudgetBatchSampler
from tightpack.runtime.thd import validate_thd_batch

LAYOUTS = ("pairs", "shared-prefix")


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer()


Unit = tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]


def units_of(units: PreferenceUnits) -> list[Unit]:
    return [
        (
            tuple(units.prompt(u).tolist()),
            tuple(
                tuple(units.branch(b).tolist())
                for b in range(units.unit_offsets[u], units.unit_offsets[u + 1])
            ),
        )
        for u in range(len(units))
    ]


def units_of_row(batch) -> list[Unit]:
    """The ``(prompt, branches)`` of every unit of a preference row, read back from its keys."""
    tokens = batch["input_ids"][0]
    real = ~batch["padding_mask"][0] if "padding_mask" in batch else torch.ones(len(tokens), dtype=torch.bool)
    unit, prompt_length = batch["branch_unit"].tolist(), batch["branch_prompt_length"].tolist()
    found: dict[int, tuple[list[int], list[tuple[int, ...]]]] = {}
    physical = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    if "branch_ids" in batch:  # shared prefix: the shared prompt, then each branch from its last token
        branch_of, document = batch["branch_ids"][0], physical
        for b, u in enumerate(unit):
            own = tokens[(branch_of == b) & real].tolist()
            start, stop = document[u], document[u + 1]
            in_unit = torch.zeros(len(tokens), dtype=torch.bool)
            in_unit[start:stop] = True
            shared = tokens[in_unit & (branch_of == -1)].tolist()
            assert len(shared) + 1 == prompt_length[b]
            found.setdefault(u, (shared + own[:1], []))[1].append(tuple(own[1:]))
    else:  # pairs: every branch its own sequence prompt + branch
        lengths = batch["cu_seqlens_q"].diff().tolist()
        for b, u in enumerate(unit):
            sequence = tokens[physical[b] : physical[b] + lengths[b]].tolist()
            prompt = sequence[: prompt_length[b]]
            entry = found.setdefault(u, (prompt, []))
            assert entry[0] == prompt  # siblings share the prompt
            entry[1].append(tuple(sequence[prompt_length[b] :]))
    return [(tuple(prompt), tuple(branches)) for prompt, branches in found.values()]


@pytest.mark.parametrize("multiple", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_max_tokens_lays_a_micro_batch_out_in_rows_of_whole_units(gpt2, layout, multiple):
    rows = conversation_pairs(24)
    budget = 320
    collate = PreferenceCollator(gpt2, layout=layout, max_tokens=budget, pad_to_multiple_of=multiple)
    packed = collate(rows)
    units = fit_units(
        collate.encoder.encode_rows(rows).units, budget, layout, pad_to_multiple_of=multiple
    ).units
    assert isinstance(packed, list) and len(packed) > 1
    for row in packed:
        validate_thd_batch(row)
        assert row["input_ids"].shape[1] <= budget
    assert Counter(u for row in packed for u in units_of_row(row)) == Counter(units_of(units))
    # as full as whole units allow: no two rows whose units would fit one
    widths = sorted(row["input_ids"].shape[1] for row in packed)
    assert widths[0] + widths[1] > budget
    assert sum(widths) == int(unit_sizes(units, layout, multiple).sum())
    assert collate.last_batch_counts["units"] == len(units) == 24


def test_the_token_budget_sampler_plans_micro_batches_of_whole_units(gpt2):
    rows = [*conversation_pairs(20), *groups(6, 3)]  # one kind of row per collator: two collators
    collate = PreferenceCollator(gpt2, layout="shared-prefix", max_length=200, pad_to_multiple_of=8)
    units = collate.encode(rows[:20])
    sampler = TokenBudgetBatchSampler(collate.unit_sizes(units), 512, seed=3)
    loader = torch.utils.data.DataLoader(
        range(len(units)),
        batch_sampler=sampler,
        collate_fn=lambda index: collate.collate_units(units.select(index)),
    )
    seen = Counter()
    for batch in loader:
        validate_thd_batch(batch)
        assert batch["input_ids"].shape[1] <= 512
        seen.update(units_of_row(batch))
    assert seen == Counter(units_of(units))
    groups_collate = PreferenceCollator(gpt2, kind="groups", layout="pairs", max_length=1024)
    group_units = groups_collate.encode(rows[20:])
    sizes = groups_collate.unit_sizes(group_units)
    assert sizes.tolist() == unit_sizes(group_units, "pairs").tolist()
    for index in TokenBudgetBatchSampler(sizes, 1024, shuffle=False):
        batch = groups_collate.collate_units(group_units.select(index))
        assert batch["input_ids"].shape[1] == int(sizes[index].sum()) <= 1024
        assert batch["branch_group_size"].tolist() == [3] * (3 * len(index))


UNSUPERVISED_START = {  # chosen opens with a user turn: its loss starts only at its last assistant turn
    "prompt": [{"role": "user", "content": "Is it?"}],
    "chosen": [
        {"role": "user", "content": "Really, tell me whether it is or not, with all the details you know."},
        {"role": "assistant", "content": "Yes."},
    ],
    "rejected": [{"role": "assistant", "content": "No."}],
}
MANY_TURNS = {"prompt": "Q:", "completions": [" a", " b", " c", " d", " e", " f", " g", " h"]}


def test_left_out_units_keep_their_row_and_reason(gpt2, caplog):
    pairs = conversation_pairs(3)
    collate = PreferenceCollator(gpt2, layout="pairs", max_length=32)
    with caplog.at_level("WARNING", logger="tightpack"):
        batch = collate([pairs[0], UNSUPERVISED_START, pairs[1]])
    assert collate.last_dropped == [
        DroppedUnit(1, "cutting it to the cap of 32 leaves branch 0 without a supervised token")
    ]
    assert "left out the unit of batch row 1 (max_length=32): cutting it" in caplog.text
    counts = collate.last_batch_counts
    assert (counts["units"], counts["no_supervised"], counts["dropped_too_long"]) == (2, 1, 0)
    assert batch["branch_unit"].tolist() == [0, 0, 1, 1]

    groups_collate = PreferenceCollator(gpt2, kind="groups", layout="pairs", max_tokens=12)
    rows = groups_collate([{"prompt": "Q:", "completions": [" a", " b"]}, MANY_TURNS])
    assert len(rows) == 1 and groups_collate.last_dropped[0].row == 1
    assert "its 8 branches need at least 16 tokens" in groups_collate.last_dropped[0].reason
    assert groups_collate.counts["dropped_too_long"] == 1
    message = (
        r"no unit of the 1 rows is left to collate: 1 units that max_length=32 would leave with a branch"
    )
    with pytest.raises(TightpackError, match=message):
        collate([UNSUPERVISED_START])


def test_budget_settings_are_checked(gpt2):
    with pytest.raises(
        TightpackError, match=r"max_length \(300\) is above max_tokens \(200\): .* leave it None"
    ):
        PreferenceCollator(gpt2, max_length=300, max_tokens=200)
    with pytest.raises(TightpackError, match=r"max_tokens must be an integer of at least 2 .* got 1"):
        PreferenceCollator(gpt2, max_tokens=1)
    unfitted = PreferenceCollator(gpt2).encode(conversation_pairs(2))
    with pytest.raises(
        TightpackError, match=r"unit 0 takes \d+ tokens in the pairs layout, above max_tokens=16"
    ):
        PreferenceCollator(gpt2, max_tokens=16).collate_units(unfitted)
    one_row = PreferenceCollator(gpt2, max_tokens=4096)(conversation_pairs(2))
    assert len(one_row) == 1 and np.array_equal(
        one_row[0]["input_ids"], PreferenceCollator(gpt2)(conversation_pairs(2))["input_ids"]
    )
