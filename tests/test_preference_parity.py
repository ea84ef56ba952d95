"""Preference rows packed in both layouts compute every branch as it computes alone.

Tiny Llama and Qwen2 models from configs, float64 on CPU, real preference pairs and groups of the
demo corpus tokenized by `PreferenceEncoder`: per-branch log-probabilities (`sequence_logps`) of a
packed row against each ``prompt + branch`` run alone, the DPO loss and its gradients against the
unpacked computation, and negative controls (a mask that lets a branch see its sibling, branch
positions that restart at 0, a pair split across two packs) that must fail by far more than the
tolerance.

Tolerances: 1e-10 with sdpa. transformers' eager attention takes its softmax in float32 whatever the
model's dtype (``softmax(..., dtype=torch.float32)`` in every family's ``eager_attention_forward``), so
rows of other lengths round differently there: 1e-8 of a branch's summed log-probability (relative;
float32's resolution is 1.2e-7).
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.hf_training import small_tokenizer
from tests.preference_data import conversation_pairs, groups, text_pairs
from tests.tiny_families import tiny_model
from tightpack.core.preference_units import PreferenceUnits
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.sources import default_corpus
from tightpack.runtime import masks
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_hf import preference_logps, preference_model_kwargs
from tightpack.runtime.preference_logps import chosen_rejected, dpo_loss, grouped, sequence_logps
from tightpack.runtime.thd import ThdBatchError, validate_thd_batch

TOLERANCE = {"sdpa": 1e-10, "eager": 1e-8}
"""Of a branch's summed log-probability: absolute with sdpa, relative with eager."""


def within(got, expected, attention: str) -> bool:
    scale = expected.abs() if attention == "eager" else torch.ones_like(expected)
    return bool(((got - expected).abs() <= TOLERANCE[attention] * scale + 1e-10).all())


LAYOUTS = ("pairs", "shared-prefix")


@pytest.fixture(scope="module")
def tokenizer():
    rows = [row for chunk in default_corpus().read(0, 256) for row in chunk.parsed_rows()][:200]
    return small_tokenizer(rows)


def _units(tokenizer, rows, kind="preference", limit=96) -> PreferenceUnits:
    encoded = PreferenceEncoder(tokenizer, kind).encode_rows(rows)
    assert not encoded.bad_rows, encoded.bad_rows
    units = encoded.units
    short = [u for u in range(len(units)) if units.prompt_lengths[u] <= limit]
    return units.select(torch.tensor(short).numpy())


@pytest.fixture(scope="module")
def pairs(tokenizer) -> PreferenceUnits:
    """Six pairs: four conversational, two as text."""
    conversational = _units(tokenizer, conversation_pairs(8)).select([0, 1, 2, 3])
    text = _units(tokenizer, text_pairs(8)).select([4, 5])
    return _concat(conversational, text)


def _concat(a: PreferenceUnits, b: PreferenceUnits) -> PreferenceUnits:
    prompts = [a.prompt(u).tolist() for u in range(len(a))] + [b.prompt(u).tolist() for u in range(len(b))]
    branches = [x.branch(i).tolist() for x in (a, b) for i in range(len(x.branch_lengths))]
    masks_ = [
        x.branch_loss_mask[x.branch_offsets[i] : x.branch_offsets[i + 1]].tolist()
        for x in (a, b)
        for i in range(len(x.branch_lengths))
    ]
    counts = a.branches_per_unit.tolist() + b.branches_per_unit.tolist()
    return PreferenceUnits.from_lists(prompts, branches, counts, loss_masks=masks_)


def alone(model, units: PreferenceUnits) -> torch.Tensor:
    """Every branch's summed target log-probability, ``prompt + branch`` run by itself."""
    sums = []
    for b, u in enumerate(units.branch_unit.tolist()):
        prompt, branch = units.prompt(u), units.branch(b)
        mask = torch.from_numpy(units.branch_loss_mask[units.branch_offsets[b] : units.branch_offsets[b + 1]])
        ids = torch.tensor([[*prompt.tolist(), *branch.tolist()]])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        logps = torch.log_softmax(logits, -1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(branch) - 1)
        picked = logps[positions, torch.from_numpy(branch)]
        sums.append((picked * mask.to(picked.dtype)).sum())
    return torch.stack(sums)


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_branch_computes_as_alone(family, attention, layout, multiple, pairs):
    model = tiny_model(family, dtype=torch.float64, attention=attention)
    batch = build_preference_row(pairs, layout, pad_to_multiple_of=multiple)
    validate_thd_batch(batch)
    with torch.no_grad():
        expected = alone(model, pairs)
        got = preference_logps(model, batch)
    assert got.sums.dtype == torch.float64
    supervised = torch.from_numpy(pairs.branch_loss_mask).split(pairs.branch_lengths.tolist())
    assert got.tokens.tolist() == [int(mask.sum()) for mask in supervised]
    assert within(got.sums, expected, attention), (got.sums - expected).abs().max()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_branch_computes_as_alone_with_flex_attention(layout, pairs, monkeypatch):
    """transformers' flex_attention path with tightpack's ``BlockMask``, float64. transformers compiles
    the kernel; on CPU Inductor's code generator fails on the shared-prefix ``mask_mod`` (torch 2.13)
    and compiling costs tens of seconds, so the kernel runs as torch's uncompiled FlexAttention (the
    same ``BlockMask`` and ``mask_mod``, its reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as integration

    def uncompiled(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(integration, "compile_friendly_flex_attention", uncompiled)
    model = tiny_model("llama", dtype=torch.float64, attention="flex_attention")
    batch = build_preference_row(pairs, layout, pad_to_multiple_of=8)
    with torch.no_grad():  # each branch alone with sdpa and the same weights (transformers would
        expected = alone(tiny_model("llama", dtype=torch.float64), pairs)  # compile a mask per length)
        got = preference_logps(model, batch)
    assert within(got.sums, expected, "sdpa"), (got.sums - expected).abs().max()


def norms_in_model_dtype(model):
    """Make every RMSNorm of ``model`` compute in the model's dtype. transformers' Llama and Qwen2
    norms compute in float32 whatever the dtype, so in the shared-prefix layout, where the prompt's
    gradient is the sum of its branches' before it goes back through the norm (float32) and not
    after, the gradients below the last layer round differently (1.7e-8 of their norm, measured)."""

    def forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return model


def _dpo_gradients(policy, reference_sums, pairs, batch):
    """(unpacked loss, its gradients), (packed loss, its gradients) of the mean DPO loss."""

    def gradients(loss):
        policy.zero_grad()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in policy.parameters()]

    sums = alone(policy, pairs)
    margin = (sums[0::2] - sums[1::2]) - (reference_sums[0::2] - reference_sums[1::2])
    unpacked = gradients(-torch.nn.functional.logsigmoid(0.1 * margin).mean())
    packed = gradients(dpo_loss(preference_logps(policy, batch), reference_sums, batch, beta=0.1).mean())
    return unpacked, packed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpo_loss_and_gradients_equal_the_unpacked_computation(layout, pairs):
    policy = norms_in_model_dtype(tiny_model("llama", dtype=torch.float64))
    with torch.no_grad():
        reference_sums = alone(tiny_model("llama", dtype=torch.float64, seed=1), pairs)
    batch = build_preference_row(pairs, layout)
    (loss, grads), (packed_loss, packed_grads) = _dpo_gradients(policy, reference_sums, pairs, batch)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-8, atol=0)
    for packed, expected in zip(packed_grads, grads, strict=True):
        torch.testing.assert_close(packed, expected, rtol=1e-8, atol=1e-13)


def test_shared_prefix_gradients_with_float32_norms_differ_by_float32_rounding_only(pairs):
    """With transformers' own norms (float32 inside a float64 model) the shared-prefix gradients stay
    within float32's resolution of the unpacked ones; the loss is still exact."""
    policy = tiny_model("llama", dtype=torch.float64)
    with torch.no_grad():
        reference_sums = alone(tiny_model("llama", dtype=torch.float64, seed=1), pairs)
    batch = build_preference_row(pairs, "shared-prefix")
    (loss, grads), (packed_loss, packed_grads) = _dpo_gradients(policy, reference_sums, pairs, batch)
    torch.testing.assert_close(packed_loss, loss, rtol=1e-8, atol=0)
    difference = torch.cat([(a - b).reshape(-1) for a, b in zip(packed_grads, grads, strict=True)])
    norm = torch.cat([g.reshape(-1) for g in grads]).norm()
    assert 0 < difference.norm() / norm < 1e-7, float(difference.norm() / norm)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_group_of_four_computes_as_alone_and_trains_alike(layout, tokenizer):
    units = _units(tokenizer, groups(3, 4), "groups")
    model = norms_in_model_dtype(tiny_model("qwen2", dtype=torch.float64))
    batch = build_preference_row(units, layout)
    assert batch["branch_reward"].tolist() == [1.0, 0.0, 0.0, 0.0] * len(units)
    logps = preference_logps(model, batch)
    expected = alone(model, units)
    assert (logps.sums - expected).abs().max() <= 1e-10
    # a GRPO-style objective: advantage-weighted mean log-probabilities, per group
    rewards = grouped(batch["branch_reward"].double(), batch)
    advantages = (rewards - rewards.mean(1, keepdim=True)).reshape(-1)
    loss = -(advantages * logps.means).sum()
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    tokens = logps.tokens.double()
    (-(advantages * alone(model, units) / tokens).sum()).backward()
    for parameter, grad in zip(model.parameters(), packed_grads, strict=True):
        torch.testing.assert_close(grad, parameter.grad, rtol=1e-8, atol=1e-12)


def test_chosen_and_rejected_pair_by_unit(pairs):
    batch = build_preference_row(pairs, "shared-prefix")
    values = torch.arange(12.0)
    chosen, rejected = chosen_rejected(values, batch)
    assert chosen.tolist() == [0, 2, 4, 6, 8, 10] and rejected.tolist() == [1, 3, 5, 7, 9, 11]


# --- negative controls: each breaks parity by far more than the tolerance ---


def _deviation(model, batch, units, **kwargs) -> float:
    with torch.no_grad():
        got = sequence_logps(model(**kwargs, use_cache=False).logits, batch).sums
        return float((got - alone(model, units)).abs().max())


def test_a_mask_that_lets_a_branch_see_its_sibling_breaks_parity(pairs):
    model = tiny_model("llama", dtype=torch.float64)
    batch = build_preference_row(pairs, "shared-prefix")
    mask = masks.additive_mask({"cu_seqlens_q": batch["cu_seqlens_q"]}, torch.float64)  # causal per unit
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": mask}
    deviation = _deviation(model, batch, pairs, **inputs)
    assert deviation > 1e6 * TOLERANCE["sdpa"], deviation
    assert _deviation(model, batch, pairs, **_without_cache(preference_model_kwargs(model, batch))) <= 1e-10


def _without_cache(kwargs):
    return {key: value for key, value in kwargs.items() if key != "use_cache"}


def test_branch_positions_that_restart_at_zero_break_parity_and_are_refused(pairs):
    model = tiny_model("llama", dtype=torch.float64)
    batch = build_preference_row(pairs, "shared-prefix")
    branches = batch["branch_ids"][0]
    restarted = batch["position_ids"].clone()
    for b in range(len(batch["branch_unit"])):  # every branch counts 0, 1, ... instead of going on
        where = torch.nonzero(branches == b).reshape(-1)
        restarted[0, where] = torch.arange(len(where))
    kwargs = _without_cache(preference_model_kwargs(model, batch)) | {"position_ids": restarted}
    deviation = _deviation(model, batch, pairs, **kwargs)
    assert deviation > 1e6 * TOLERANCE["sdpa"], deviation
    with pytest.raises(ThdBatchError, match=r"position_ids\[\d+\] is 0 in branch 0 .* continues it"):
        validate_thd_batch({**batch, "position_ids": restarted})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pair_split_across_two_packs_breaks_parity_and_is_refused(layout, pairs):
    """The first pair's branches go to two packs (what a packer that splits units writes): the pack
    with ``chosen`` holds a unit that says it has two branches and is refused; ``rejected``, packed
    without the prompt it shares, computes otherwise than alone by far more than the tolerance."""
    model = tiny_model("llama", dtype=torch.float64)
    prompt, chosen, rejected = pairs.prompt(0).tolist(), pairs.branch(0).tolist(), pairs.branch(1).tolist()
    chosen_pack = build_preference_row(PreferenceUnits.from_lists([prompt], [chosen], [1]), layout)
    chosen_pack["branch_group_size"] = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ThdBatchError, match="unit 0 is not whole: branch_group_size says 2"):
        validate_thd_batch(chosen_pack)
    rejected_pack = build_preference_row(PreferenceUnits.from_lists([prompt[-1:]], [rejected], [1]), layout)
    with torch.no_grad():
        moved = preference_logps(model, rejected_pack).sums[0]
        assert abs(float(moved - alone(model, pairs)[1])) > 1e6 * TOLERANCE["sdpa"]


@pytest.mark.parametrize(("family", "attention"), [("mistral", "sdpa"), ("gemma2", "eager")])
def test_sliding_windows_hold_in_the_shared_prefix_mask(family, attention, pairs):
    """Mistral (a window of 24 on every layer) and Gemma 2 (on every other layer) over prompts longer
    than the window: the mask given replaces transformers' own, so it carries the window; without it
    the branches see further back than alone."""
    model = tiny_model(family, dtype=torch.float64, attention=attention)
    assert int(pairs.prompt_lengths.max()) > model.config.sliding_window
    batch = build_preference_row(pairs, "shared-prefix")
    with torch.no_grad():
        expected = alone(model, pairs)
        got = preference_logps(model, batch)
        assert within(got.sums, expected, attention), (got.sums - expected).abs().max()
        unwindowed = masks.additive_mask(batch, torch.float64)
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        deviation = _deviation(model, batch, pairs, **inputs, attention_mask=unwindowed)
    assert deviation > 1e6 * TOLERANCE["sdpa"], deviation
