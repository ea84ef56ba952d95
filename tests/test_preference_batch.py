"""The preference row (`tightpack.runtime.preference_batch`): both layouts against a plain-Python
construction, each corruption of a preference key refused by name (`validate_branches`), the masks
of a shared-prefix row, the consumers that read only boundaries refusing it, per-branch
log-probabilities and losses against hand formulas, and `PreferenceCollator`'s counts."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch

from tightpack.core.preference_units import PreferenceUnits
from tightpack.errors import TightpackError
from tightpack.runtime import masks
from tightpack.runtime.adapters import to_packed_seq_params
from tightpack.runtime.context_parallel import slice_for_cp_rank
from tightpack.runtime.hf_kwargs import hf_packed_kwargs
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_logps import chosen_rejected, dpo_loss, grouped, sequence_logps
from tightpack.runtime.thd import ThdBatchError, validate_thd_batch

IGNORE = -100
PAD = 0
LAYOUTS = ("pairs", "shared-prefix")

# === units ==============================================================================================


def hand_units() -> PreferenceUnits:
    """A pair (prompt 3) and a group of three (prompt 2), one branch token unsupervised."""
    return PreferenceUnits.from_lists(
        [[1, 2, 3], [4, 5]],
        [[7, 8], [9], [10], [11, 12], [13]],
        [2, 3],
        loss_masks=[[1, 1], [1], [1], [0, 1], [1]],
    )


def random_lists(seed: int) -> tuple[list, list, list, list]:
    """Prompts of 1..20 tokens, units of 1..5 branches of 1..15 tokens, random loss masks."""
    rng = np.random.default_rng(seed)
    prompts, branches, sizes, loss_masks = [], [], [], []
    for _ in range(int(rng.integers(1, 6))):
        prompts.append(rng.integers(1, 50, int(rng.integers(1, 21))).tolist())
        size = int(rng.integers(1, 6))
        sizes.append(size)
        for _ in range(size):
            length = int(rng.integers(1, 16))
            branches.append(rng.integers(1, 50, length).tolist())
            loss_masks.append(rng.integers(0, 2, length).tolist())
    return prompts, branches, sizes, loss_masks


def random_units(seed: int) -> PreferenceUnits:
    prompts, branches, sizes, loss_masks = random_lists(seed)
    return PreferenceUnits.from_lists(prompts, branches, sizes, loss_masks=loss_masks)


def reference(units: PreferenceUnits) -> list[dict]:
    """Every branch as plain Python: ``prompt + branch``, positions 0.., labels the next token where
    supervised; its unit, index, group size and prompt length."""
    out = []
    for unit in range(len(units)):
        prompt = units.prompt(unit).tolist()
        first, last = int(units.unit_offsets[unit]), int(units.unit_offsets[unit + 1])
        for index, b in enumerate(range(first, last)):
            tokens = prompt + units.branch(b).tolist()
            start, end = units.branch_offsets[b], units.branch_offsets[b + 1]
            supervised = [0] * len(prompt) + units.branch_loss_mask[start:end].tolist()
            labels = [tokens[i + 1] if i + 1 < len(tokens) and supervised[i + 1] else IGNORE
                      for i in range(len(tokens))]  # fmt: skip
            out.append({"tokens": tokens, "labels": labels, "unit": unit, "index": index,
                        "size": last - first, "prompt": len(prompt)})  # fmt: skip
    return out


def segments(batch: dict) -> tuple[list[int], list[int]]:
    """Physical starts and logical lengths of the row's sequences."""
    logical = batch["cu_seqlens_q"].tolist()
    physical = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    return physical, [b - a for a, b in itertools.pairwise(logical)]


def branch_views(batch: dict, count: int) -> list[dict]:
    """Every branch's sequence as read back from the row (token indices of the row)."""
    physical, lengths = segments(batch)
    views = []
    if batch["preference_layout"] == "pairs":
        for b in range(count):
            views.append(list(range(physical[b], physical[b] + lengths[b])))
        return views
    branch_ids = batch["branch_ids"][0].tolist()
    unit_of = batch["branch_unit"].tolist()
    for b in range(count):
        u = unit_of[b]
        real = range(physical[u], physical[u] + lengths[u])
        views.append([t for t in real if branch_ids[t] == -1] + [t for t in real if branch_ids[t] == b])
    return views


# === 1. layout facts ====================================================================================


def check_layout(units: PreferenceUnits, layout: str, multiple: int) -> None:
    batch = build_preference_row(units, layout, pad_to_multiple_of=multiple, pad_token_id=PAD)
    expected = reference(units)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    positions = batch["position_ids"][0].tolist()
    for b, (view, want) in enumerate(zip(branch_views(batch, len(expected)), expected, strict=True)):
        assert [ids[t] for t in view] == want["tokens"], f"branch {b} tokens"
        assert [positions[t] for t in view] == list(range(len(want["tokens"]))), f"branch {b} positions"
        assert [labels[t] for t in view] == want["labels"], f"branch {b} labels"
    assert batch["branch_unit"].tolist() == [w["unit"] for w in expected]
    assert batch["branch_index"].tolist() == [w["index"] for w in expected]
    assert batch["branch_group_size"].tolist() == [w["size"] for w in expected]
    assert batch["branch_prompt_length"].tolist() == [w["prompt"] for w in expected]
    for key in ("branch_unit", "branch_index", "branch_group_size", "branch_prompt_length"):
        assert batch[key].dtype == torch.int32

    # the sequences: a branch each (pairs) or a unit each (shared prefix), each aligned to the multiple
    if layout == "pairs":
        lengths = [len(w["tokens"]) for w in expected]
    else:
        lengths = [len(units.prompt(u)) - 1 + sum(len(w["tokens"]) - w["prompt"] + 1 for w in expected
                   if w["unit"] == u) for u in range(len(units))]  # fmt: skip
    aligned = [-(-n // multiple) * multiple for n in lengths]
    assert batch["cu_seqlens_q"].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert batch["token_count"] == lengths
    assert batch["total_tokens"] == sum(aligned) == len(ids)
    assert int(batch["max_seqlen_q"]) == max(aligned)
    if aligned == lengths:
        assert "cu_seqlens_q_padded" not in batch and "padding_mask" not in batch
    else:
        assert batch["cu_seqlens_q_padded"].tolist() == np.concatenate([[0], np.cumsum(aligned)]).tolist()
        padding = batch["padding_mask"][0].tolist()
        start = 0
        for n, width in zip(lengths, aligned, strict=True):
            assert padding[start : start + width] == [False] * n + [True] * (width - n)
            tail = range(start + n, start + width)
            assert [ids[t] for t in tail] == [PAD] * (width - n)
            assert [labels[t] for t in tail] == [IGNORE] * (width - n)
            assert [positions[t] for t in tail] == list(
                range(positions[start + n - 1] + 1, positions[start + n - 1] + 1 + width - n)
            )
            start += width
    assert batch["loss_mask"][0].tolist() == [float(label != IGNORE) for label in labels]
    if layout == "shared-prefix":
        assert batch["branch_ids"].dtype == torch.int32 and batch["branch_ids"].shape == (1, len(ids))
    else:
        assert "branch_ids" not in batch
    validate_thd_batch(batch)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("multiple", [1, 3, 8])
def test_hand_units_lay_out_as_their_plain_construction(layout, multiple):
    check_layout(hand_units(), layout, multiple)


def test_the_hand_rows_token_for_token():
    pairs = build_preference_row(hand_units(), "pairs")
    assert pairs["input_ids"].tolist() == [[1, 2, 3, 7, 8, 1, 2, 3, 9, 4, 5, 10, 4, 5, 11, 12, 4, 5, 13]]
    shared = build_preference_row(hand_units(), "shared-prefix", pad_to_multiple_of=4)
    assert shared["input_ids"].tolist() == [[1, 2, 3, 7, 8, 3, 9, 0, 4, 5, 10, 5, 11, 12, 5, 13]]
    assert shared["branch_ids"].tolist() == [[-1, -1, 0, 0, 0, 1, 1, 1, -1, 2, 2, 3, 3, 3, 4, 4]]
    assert shared["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 0, 1, 2, 1, 2, 3, 1, 2]]
    # branch 3's first own token (11) is unsupervised: its predictor, the prompt's last token, has no label
    assert shared["labels"].tolist() == [
        [IGNORE, IGNORE, 7, 8, IGNORE, 9, IGNORE, IGNORE, IGNORE, 10, IGNORE, IGNORE, 12, IGNORE, 13, IGNORE]
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("multiple", [1, 3, 8])
@pytest.mark.parametrize("seed", range(6))
def test_random_units_lay_out_as_their_plain_construction(layout, multiple, seed):
    check_layout(random_units(seed), layout, multiple)


def test_per_branch_values_ride_along():
    units = PreferenceUnits.from_lists(
        [[1, 2], [3]], [[4], [5, 6], [7]], [2, 1], labels=[True, False, True],
        rewards=[0.5, -1.0, 2.0], advantages=[1.0, 0.0, -1.0],
    )  # fmt: skip
    for layout in LAYOUTS:
        batch = build_preference_row(units, layout)
        assert batch["branch_label"].tolist() == [True, False, True]
        assert batch["branch_reward"].tolist() == [0.5, -1.0, 2.0]
        assert batch["branch_advantage"].tolist() == [1.0, 0.0, -1.0]
        validate_thd_batch(batch)


# === 2. corruptions =====================================================================================


def pairs_batch() -> dict:
    return build_preference_row(hand_units(), "pairs")


def shared_batch() -> dict:
    return build_preference_row(hand_units(), "shared-prefix")


def replaced(build, key, value) -> dict:
    batch = build()
    batch[key] = value
    return batch


def tokens_edited(build, key, index, value) -> dict:
    batch = build()
    edited = batch[key].clone()
    edited.view(-1)[index] = value
    batch[key] = edited
    if key == "input_ids":
        batch["tokens"] = edited
    return batch


def with_boundaries(build, cu: list[int]) -> dict:
    """The batch with other (logical = physical) boundaries, token_count and max_seqlen following."""
    batch = build()
    bounds = torch.tensor(cu, dtype=torch.int32)
    batch["cu_seqlens_q"] = batch["cu_seqlens_kv"] = bounds
    lengths = bounds.diff()
    batch["token_count"] = lengths.tolist()
    batch["max_seqlen_q"] = batch["max_seqlen_kv"] = lengths.max().to(torch.int32)
    return batch


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# hand_units in pairs: sequences [0, 5, 9, 12, 16, 19]; shared prefix: units [0, 7, 15],
# branch_ids [-1, -1, 0, 0, 0, 1, 1, -1, 2, 2, 3, 3, 3, 4, 4]
CORRUPTIONS = {
    "branch_unit not adjacent": (
        lambda: replaced(pairs_batch, "branch_unit", int32([0, 1, 0, 1, 1])),
        r"branch_unit must number the units 0, 1, 2, ... with each unit's branches adjacent; branch 2 has "
        r"unit 0 where 2 was expected",
    ),
    "branch_unit out of order": (
        lambda: replaced(pairs_batch, "branch_unit", int32([1, 1, 0, 0, 0])),
        r"branch_unit must number the units .* branch 0 has unit 1 where 0 was expected",
    ),
    "branch_index wrong": (
        lambda: replaced(pairs_batch, "branch_index", int32([0, 1, 0, 2, 1])),
        r"branch_index must count 0, 1, ... within each unit; branch 3 has 2",
    ),
    "branch_group_size says more than the row holds (a unit split)": (
        lambda: replaced(pairs_batch, "branch_group_size", int32([2, 2, 4, 4, 4])),
        r"unit 1 is not whole: branch_group_size says 4 branches but the batch holds 3",
    ),
    "branch_prompt_length differs within a unit": (
        lambda: replaced(pairs_batch, "branch_prompt_length", int32([3, 3, 2, 1, 2])),
        r"branch_prompt_length must be >= 1 and one value for all branches of a unit",
    ),
    "branch_prompt_length below 1": (
        lambda: replaced(shared_batch, "branch_prompt_length", int32([3, 3, 0, 0, 0])),
        r"branch_prompt_length must be >= 1",
    ),
    "per-branch keys of different lengths": (
        lambda: replaced(pairs_batch, "branch_index", int32([0, 1, 0, 1])),
        r"the per-branch keys must hold one value per branch; lengths \[5, 4, 5, 5\]",
    ),
    "branch_label not bool": (
        lambda: replaced(pairs_batch, "branch_label", torch.ones(5, dtype=torch.int32)),
        r"branch_label must be a torch.bool \[5\] tensor",
    ),
    "branch_reward float64": (
        lambda: replaced(pairs_batch, "branch_reward", torch.zeros(5, dtype=torch.float64)),
        r"branch_reward must be a torch.float32 \[5\] tensor",
    ),
    "branch_advantage of the wrong shape": (
        lambda: replaced(shared_batch, "branch_advantage", torch.zeros(1, 5)),
        r"branch_advantage must be a torch.float32 \[5\] tensor",
    ),
    "branch_ids int64": (
        lambda: replaced(shared_batch, "branch_ids", shared_batch()["branch_ids"].long()),
        r"branch_ids must be (torch\.)?int32, got torch.int64",
    ),
    "pairs: fewer sequences than branches": (
        lambda: with_boundaries(pairs_batch, [0, 5, 9, 16, 19]),
        r"a pairs-layout batch has one sequence per branch: 5 branches but cu_seqlens_q has 4 sequences",
    ),
    "pairs: a branch no longer than its prompt": (
        lambda: with_boundaries(pairs_batch, [0, 5, 9, 11, 16, 19]),
        r"branch 2 has 2 tokens, no more than its prompt of 2",
    ),
    "pairs: a sibling that starts with other prompt tokens": (
        lambda: tokens_edited(pairs_batch, "input_ids", 6, 99),
        r"branch 1 does not start with the prompt of its sibling 0 \(unit 0\)",
    ),
    "shared prefix: more sequences than units": (
        lambda: with_boundaries(shared_batch, [0, 4, 7, 15]),
        r"a shared-prefix batch has one sequence per unit: 2 units but the boundaries hold 3 sequences",
    ),
    "shared prefix: a boundary off by one (open-instruct #1466)": (
        lambda: with_boundaries(shared_batch, [0, 6, 15]),
        r"token 6 of branch 1 \(unit 0\) lies in the sequence of unit 1: a branch must lie inside its own "
        r"unit's sequence",
    ),
    "shared prefix: a branch id in another unit": (
        lambda: tokens_edited(shared_batch, "branch_ids", 9, 0),
        r"token 9 of branch 0 \(unit 0\) lies in the sequence of unit 1",
    ),
    "shared prefix: a branch id out of range": (
        lambda: tokens_edited(shared_batch, "branch_ids", 3, 5),
        r"branch_ids must be -1 \(shared prompt\) or a branch 0..4",
    ),
    "shared prefix: interleaved branches": (
        lambda: tokens_edited(shared_batch, "branch_ids", 11, 2),
        r"token 11 of unit 1 has branch_ids 2 after a later branch's tokens",
    ),
    "shared prefix: a shared token after a branch": (
        lambda: tokens_edited(shared_batch, "branch_ids", 6, -1),
        r"token 6 of unit 0 has branch_ids -1 after a later branch's tokens",
    ),
    "shared prefix: one shared token too many": (
        lambda: tokens_edited(shared_batch, "branch_ids", 2, -1),
        r"unit 0 has 3 shared prompt tokens; its branch_prompt_length 3 makes 2",
    ),
    "shared prefix: a branch with no tokens": (
        lambda: replaced(
            shared_batch, "branch_ids", int32([[-1, -1, 1, 1, 1, 1, 1, -1, 2, 2, 3, 3, 3, 4, 4]])
        ),
        r"branch 0 has no token in branch_ids",
    ),
    "shared prefix: branch positions restarting at 0": (
        lambda: replaced(
            shared_batch, "position_ids", torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 1, 2, 3, 1, 2]])
        ),
        r"position_ids\[5\] is 0 in branch 1 of unit 0, expected 2",
    ),
    "preference_layout shared-prefix without branch_ids": (
        lambda: replaced(pairs_batch, "preference_layout", "shared-prefix"),
        r"preference_layout is 'shared-prefix' but the batch has no branch_ids",
    ),
    "preference_layout pairs with branch_ids": (
        lambda: replaced(shared_batch, "preference_layout", "pairs"),
        r"preference_layout is 'pairs' but the batch has branch_ids",
    ),
}
for _key in ("branch_unit", "branch_index", "branch_group_size", "branch_prompt_length"):
    CORRUPTIONS[f"{_key} int64"] = (
        lambda key=_key: replaced(pairs_batch, key, pairs_batch()[key].long()),
        rf"{_key} must be an int32 \[NB\] tensor \(one value per branch\) in a preference batch, got "
        r"torch.int64 \(5,\)",
    )
    CORRUPTIONS[f"{_key} of shape [1, NB]"] = (
        lambda key=_key: replaced(shared_batch, key, shared_batch()[key][None]),
        rf"{_key} must be an int32 \[NB\] tensor .* got torch.int32 \(1, 5\)",
    )
CORRUPTIONS["branch_index missing"] = (
    lambda: {k: v for k, v in shared_batch().items() if k != "branch_index"},
    r"branch_index must be an int32 \[NB\] tensor .* got NoneType",
)


def with_values(build) -> dict:
    batch = build()
    batch["branch_label"] = torch.ones(5, dtype=torch.bool)
    batch["branch_reward"] = batch["branch_advantage"] = torch.zeros(5)
    return batch


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_each_corruption_is_refused_by_name(kind):
    build, message = CORRUPTIONS[kind]
    with pytest.raises(ThdBatchError, match=message):
        validate_thd_batch(build())


def test_the_uncorrupted_bases_are_valid():
    for build in (pairs_batch, shared_batch):
        validate_thd_batch(build())
        validate_thd_batch(with_values(build))


# === 3. masks ===========================================================================================


def plain_mask(batch: dict) -> list[list[bool]]:
    """q sees k iff same sequence, k <= q, and k is shared or in q's branch (pairs: no branch rule)."""
    physical = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).tolist()
    width = physical[-1]
    document = [next(i for i in range(len(physical) - 1) if physical[i] <= t < physical[i + 1])
                for t in range(width)]  # fmt: skip
    branch = batch["branch_ids"][0].tolist() if "branch_ids" in batch else [-1] * width
    return [[document[q] == document[k] and k <= q and branch[k] in (-1, branch[q]) for k in range(width)]
            for q in range(width)]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("multiple", [1, 3])
def test_dense_masks_equal_the_plain_rule(layout, seed, multiple):
    batch = build_preference_row(random_units(seed), layout, pad_to_multiple_of=multiple)
    want = torch.tensor(plain_mask(batch))
    got = masks.sdpa_mask(batch)
    assert got.shape == (1, 1, *want.shape) and got.dtype == torch.bool
    assert torch.equal(got[0, 0], want)
    additive = masks.additive_mask(batch, torch.float32)
    assert torch.equal(additive[0, 0] == 0, want)
    assert torch.all(additive[0, 0][~want] == torch.finfo(torch.float32).min)


# Inductor's CPU flex template fails to compile the shared-prefix mask_mod (torch 2.x: a C++ error,
# "cur_qSplitSize8 was not declared") and takes ~45 s for the pairs one; aot_eager traces the same
# flex_attention graph with the BlockMask and runs it without C++ codegen, in well under a second.
FLEX_BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, backend=FLEX_BACKEND)
    try:  # one small probe: when this CPU cannot compile flex attention, say why
        from torch.nn.attention.flex_attention import create_block_mask

        probe = create_block_mask(lambda b, h, q, k: k <= q, None, None, 16, 16, device="cpu")
        x = torch.randn(1, 1, 16, 8)
        compiled(x, x, x, block_mask=probe)
    except Exception as error:
        pytest.skip(f"flex_attention does not compile on this CPU: {type(error).__name__}: {error}")
    return compiled


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flex_block_mask_computes_as_the_dense_mask(compiled_flex, layout):
    batch = build_preference_row(random_units(3), layout, pad_to_multiple_of=3)
    width = batch["input_ids"].shape[1]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, width, 16, generator=generator) for _ in range(3))
    with torch.no_grad():
        flex = compiled_flex(q, k, v, block_mask=masks.flex_block_mask(batch))
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=masks.sdpa_mask(batch))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)
    if layout == "shared-prefix":  # the branch rule matters: block-diagonal causal alone differs
        plain = {k: v for k, v in batch.items() if not k.startswith(("branch", "preference"))}
        loose = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=masks.sdpa_mask(plain))
        assert not torch.allclose(loose, dense, atol=1e-3)


# === 4. consumers that read only the boundaries ========================================================

BOUNDARY_CONSUMERS = {
    "hf_packed_kwargs": (
        hf_packed_kwargs,
        "hf_packed_kwargs (transformers' packed positions and cu_seq_lens)",
    ),
    "to_packed_seq_params": (
        lambda batch: to_packed_seq_params(batch, megatron=False),
        "PackedSeqParams (Megatron-Core's THD attention)",
    ),
    "slice_for_cp_rank": (
        lambda batch: slice_for_cp_rank(batch, 2, 0),
        "context-parallel slicing (ring attention over cu_seqlens)",
    ),
}


@pytest.mark.parametrize("name", list(BOUNDARY_CONSUMERS))
def test_boundary_consumers_refuse_a_shared_prefix_row_and_take_a_pairs_row(name):
    consume, who = BOUNDARY_CONSUMERS[name]
    shared = build_preference_row(hand_units(), "shared-prefix", pad_to_multiple_of=4)
    with pytest.raises(ThdBatchError, match=re.escape(who) + r" reads only the boundaries .* layout='pairs'"):
        consume(shared)
    consume(build_preference_row(hand_units(), "pairs", pad_to_multiple_of=4))


def test_flash_varlen_attention_refuses_a_shared_prefix_row():
    """The layout is refused before flash-attn is looked for: a CPU user learns it too."""
    shared = build_preference_row(hand_units(), "shared-prefix")
    x = torch.zeros(shared["input_ids"].shape[1], 1, 8)
    with pytest.raises(ThdBatchError, match="flash_varlen_attention reads only the boundaries"):
        masks.flash_varlen_attention(x, x, x, shared)


@pytest.fixture(scope="module")
def llama():
    from tests.tiny_families import tiny_model

    return tiny_model("llama", attention="sdpa")


def test_preference_model_kwargs_by_attention(llama):
    from tightpack.runtime.preference_hf import preference_model_kwargs

    shared = build_preference_row(hand_units(), "shared-prefix")
    pairs = build_preference_row(hand_units(), "pairs")
    original = llama.config._attn_implementation
    try:
        for attention in ("sdpa", "eager"):
            llama.config._attn_implementation = attention
            kwargs = preference_model_kwargs(llama, shared)
            mask = kwargs["attention_mask"]
            assert mask.shape == (1, 1, 15, 15) and mask.dtype == torch.float32
            assert torch.equal(mask, masks.additive_mask(shared, torch.float32))
            assert kwargs["use_cache"] is False and torch.equal(
                kwargs["position_ids"], shared["position_ids"]
            )
        llama.config._attn_implementation = "flash_attention_2"
        with pytest.raises(TightpackError, match="attn_implementation 'flash_attention_2' cannot take"):
            preference_model_kwargs(llama, shared)
        kwargs = preference_model_kwargs(llama, pairs)  # a pairs row runs on the boundaries
        assert kwargs["cu_seq_lens_q"].tolist() == [0, 5, 9, 12, 16, 19]
        assert "attention_mask" not in kwargs or kwargs["attention_mask"] is None
    finally:
        llama.config._attn_implementation = original


# === 5. log-probabilities and losses ===================================================================


def position_logits(batch: dict, table: torch.Tensor) -> torch.Tensor:
    """Logits ``[1, T, V]`` that depend only on each token and its position: ``table[token, position]``."""
    return table[batch["input_ids"][0], batch["position_ids"][0]][None]


def reference_logps(units: PreferenceUnits, table: torch.Tensor) -> tuple[list[float], list[int]]:
    sums, tokens = [], []
    for branch in reference(units):
        total, count = 0.0, 0
        for i, label in enumerate(branch["labels"]):
            if label != IGNORE:
                total += float(torch.log_softmax(table[branch["tokens"][i], i].double(), -1)[label])
                count += 1
        sums.append(total)
        tokens.append(count)
    return sums, tokens


def test_sequence_logps_uniform_by_hand():
    for layout in LAYOUTS:
        batch = build_preference_row(hand_units(), layout, pad_to_multiple_of=3)
        logps = sequence_logps(torch.zeros(1, batch["total_tokens"], 16), batch)
        assert logps.tokens.tolist() == [2, 1, 1, 1, 1]  # branch 3's first token is unsupervised
        torch.testing.assert_close(logps.sums, -math.log(16) * torch.tensor([2.0, 1, 1, 1, 1]))
        torch.testing.assert_close(logps.means, torch.full((5,), -math.log(16)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("multiple", [1, 8])
def test_both_layouts_give_the_hand_formula(seed, multiple):
    units = random_units(seed)
    table = torch.randn(50, 64, 50, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sums, tokens = reference_logps(units, table)
    results = {}
    for layout in LAYOUTS:
        batch = build_preference_row(units, layout, pad_to_multiple_of=multiple)
        results[layout] = sequence_logps(position_logits(batch, table), batch)
        assert results[layout].tokens.tolist() == tokens
        torch.testing.assert_close(results[layout].sums, torch.tensor(sums, dtype=torch.float64))
        means = [s / max(n, 1) for s, n in zip(sums, tokens, strict=True)]
        torch.testing.assert_close(results[layout].means, torch.tensor(means, dtype=torch.float64))
    assert torch.equal(results["pairs"].tokens, results["shared-prefix"].tokens)
    torch.testing.assert_close(results["pairs"].sums, results["shared-prefix"].sums, atol=1e-12, rtol=0)


def test_chosen_rejected_grouped_and_dpo_by_hand():
    pairs_units = PreferenceUnits.from_lists([[1, 2], [3]], [[4], [5, 6], [7], [8]], [2, 2])
    batch = build_preference_row(pairs_units, "shared-prefix")
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    chosen, rejected = chosen_rejected(values, batch)
    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    reference_values = torch.tensor([0.5, 1.5, -1.0, 0.0])
    loss = dpo_loss(values, reference_values, batch, beta=0.5)
    want = [-math.log(1 / (1 + math.exp(-0.5 * ((1 - 2) - (0.5 - 1.5))))),
            -math.log(1 / (1 + math.exp(-0.5 * ((3 - 4) - (-1.0 - 0.0)))))]  # fmt: skip
    torch.testing.assert_close(loss, torch.tensor(want))
    groups = build_preference_row(hand_units().select(np.array([1])), "pairs")
    assert grouped(torch.tensor([1.0, 2.0, 3.0]), groups).tolist() == [[1.0, 2.0, 3.0]]
    with pytest.raises(TightpackError, match="chosen_rejected takes a row of pairs"):
        chosen_rejected(torch.zeros(3), groups)
    with pytest.raises(
        TightpackError, match=r"grouped needs groups of one size; this row has sizes \[2, 3\]"
    ):
        grouped(torch.zeros(5), build_preference_row(hand_units(), "pairs"))


# === 6. the collator ====================================================================================


@pytest.fixture(scope="module")
def gpt2():
    from tightpack.prepare.tokenizer import load_tokenizer

    return load_tokenizer()


GROUP_ROWS = [
    {"prompt": "Q", "completions": [" a", " b"]},  # fits
    {"prompt": "A long question that has many words in it, more than the cap?", "completions": [" a", " b"]},
    {"prompt": "Q", "completions": [" many words in this answer that is long", " and another long answer"]},
    {"prompt": "Q", "completions": [" a", " b", " c", " d", " e"]},  # five branches: at least 10 tokens
]
BAD_ROW = {"prompt": "Q", "completions": [" only one"]}
CAP = 9


def test_collator_counts_trims_cuts_drops_and_bad_rows(gpt2):
    from tightpack.runtime.preference_collate import PreferenceCollator

    collate = PreferenceCollator(gpt2, kind="groups", layout="pairs", max_length=CAP, skip_bad_rows=True)
    units = collate.encoder.encode_rows(GROUP_ROWS).units
    prompts, lengths = units.prompt_lengths.tolist(), units.branch_lengths.tolist()
    # the premises: row 0 fits, row 1 fits only with a trimmed prompt, row 2 only with cut branches
    assert 2 * prompts[0] + sum(lengths[0:2]) <= CAP
    assert 2 * prompts[1] + sum(lengths[2:4]) > CAP and 2 + sum(lengths[2:4]) <= CAP
    assert prompts[2] == 1 and 2 + sum(lengths[4:6]) > CAP
    batch = collate([*GROUP_ROWS, BAD_ROW])
    assert dict(collate.last_batch_counts) == {
        "units": 3, "prompt_trimmed": 1, "branches_cut": 1, "dropped_too_long": 1, "no_supervised": 0,
        "bad_rows": 1,
    }  # fmt: skip
    assert batch["branch_unit"].tolist() == [0, 0, 1, 1, 2, 2]
    lengths_of = batch["cu_seqlens_q"].diff()
    assert all(int(lengths_of[2 * u] + lengths_of[2 * u + 1]) <= CAP for u in range(3))
    validate_thd_batch(batch)
    collate(GROUP_ROWS[:1])
    assert collate.counts["units"] == 4 and collate.counts["bad_rows"] == 1
    assert collate.last_batch_counts["units"] == 1


def test_collator_bad_rows_raise_without_skip_and_an_empty_batch_raises(gpt2):
    from tightpack.runtime.preference_collate import PreferenceCollator

    strict = PreferenceCollator(gpt2, kind="groups", layout="shared-prefix", max_length=CAP)
    with pytest.raises(TightpackError, match=r"a group needs at least 2 completions .* skip_bad_rows=True"):
        strict([*GROUP_ROWS[:1], BAD_ROW])
    with pytest.raises(
        TightpackError, match=r"no unit of the 1 rows is left to collate: 1 units over max_length=9"
    ):
        strict(GROUP_ROWS[3:])
    assert strict.last_batch_counts["dropped_too_long"] == 1


def test_a_batch_of_bad_rows_under_skip_bad_rows_says_so_and_keeps_every_reason(gpt2):
    from tightpack.runtime.preference_collate import PreferenceCollator

    collate = PreferenceCollator(gpt2, kind="groups", skip_bad_rows=True)
    bad = [BAD_ROW, {"prompt": "Q", "completions": [" a", " b"], "rewards": [1.0]}]
    with pytest.raises(TightpackError, match=r"no unit of the 2 rows is left to collate: 2 bad rows"):
        collate(bad)
    reasons = [row.reason for row in collate.last_bad_rows]
    assert len(reasons) == 2 and "at least 2 completions" in reasons[0] and "'rewards' must be" in reasons[1]
    assert [row.location for row in collate.last_bad_rows] == ["batch row 0", "batch row 1"]
