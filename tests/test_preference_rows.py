"""Preference, KTO and group rows -> units (`tightpack.prepare.preference_rows`), and fitting units to a
cap (`tightpack.core.preference_units`), checked against tightpack's own SFT encoder and plain Python."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tightpack.core.preference_units import PreferenceUnits, concatenated_ranges, fit_units, unit_sizes
from tightpack.errors import TightpackError
from tightpack.prepare.format_config import FormatConfig
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.tokenize import Encoder
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.thd import validate_thd_batch

from .chat_templates import template_folders

TEXT = FormatConfig(
    format="prompt-completion",
    input_key="prompt",
    output_key="completion",
    prompt_template="{prompt}{completion}",
    truncate_fields=(),
)
CHAT = FormatConfig(format="chat", loss_on="assistant")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return template_folders(tmp_path_factory.mktemp("templates"))


def sft(spec, config, row) -> tuple[list[int], list[int]]:
    result = Encoder(spec, config).encode_rows([row])
    assert not result.bad_rows, result.bad_rows
    return result.tokens.tolist(), result.loss_mask.tolist()


def check_unit(units, u, spec, config, sft_rows):
    """Unit ``u``: the prompt once, every branch = the SFT rendering of prompt + branch minus the prompt."""
    prompt = units.prompt(u).tolist()
    first = units.unit_offsets[u]
    assert units.branches_per_unit[u] == len(sft_rows)
    for k, row in enumerate(sft_rows):
        tokens, mask = sft(spec, config, row)
        b = first + k
        lo, hi = units.branch_offsets[b], units.branch_offsets[b + 1]
        assert tokens == prompt + units.branch(b).tolist()
        assert mask == [0] * len(prompt) + units.branch_loss_mask[lo:hi].tolist()
        assert units.branch_loss_mask[lo:hi].any()


def test_text_pairs_match_the_sft_rendering(gpt2):
    rows = [
        {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5, I think"},
        {"prompt": "Name a colour:", "chosen": " red", "rejected": " the sea"},
    ]
    result = PreferenceEncoder(gpt2, "preference").encode_rows(rows)
    assert not result.bad_rows and len(result.units) == 2
    assert result.units.source_index.tolist() == [0, 1]
    for u, row in enumerate(rows):
        branches = [{"prompt": row["prompt"], "completion": row[k]} for k in ("chosen", "rejected")]
        check_unit(result.units, u, gpt2, TEXT, branches)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma", "mistral-later"])
def test_conversational_forms_with_real_templates(folders, name):
    from transformers import AutoTokenizer

    spec = load_tokenizer(folders[name])
    hf = AutoTokenizer.from_pretrained(folders[name])
    user = {"role": "user", "content": "What is the capital of France?"}
    system = {"role": "system", "content": "Be brief."}
    good = {"role": "assistant", "content": "Paris."}
    bad = {"role": "assistant", "content": "Lyon, I believe."}
    history = [
        user,
        {"role": "assistant", "content": "Do you mean today?"},
        {"role": "user", "content": "Yes."},
    ]
    rows = [
        {"prompt": [user], "chosen": [good], "rejected": [bad]},
        {"prompt": [user], "chosen": "Paris.", "rejected": "Lyon, I believe."},  # a string = one message
        {"chosen": [system, user, good], "rejected": [system, user, bad]},  # implicit prompt
        {"prompt": history, "chosen": [good], "rejected": [bad]},  # multi-turn prompt
    ]
    prompts = [[user], [user], [system, user], history]
    result = PreferenceEncoder(spec, "preference").encode_rows(rows)
    assert not result.bad_rows, result.bad_rows
    units = result.units
    for u, prompt in enumerate(prompts):
        weighted = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in prompt]
        check_unit(units, u, spec, CHAT, [{"messages": [*weighted, b]} for b in (good, bad)])
        # the chat template's generation prompt decides where the prompt ends
        text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        assert units.prompt(u).tolist() == hf(text, add_special_tokens=False)["input_ids"]
    assert units.prompt(0).tolist() == units.prompt(1).tolist()


def test_kto_and_groups_carry_labels_and_rewards(gpt2):
    kto = PreferenceEncoder(gpt2, "kto").encode_rows(
        [
            {"prompt": "Hi.", "completion": " Hello!", "label": True},
            {"prompt": "Hi.", "completion": " Go away.", "label": False},
        ]
    )
    assert not kto.bad_rows and kto.units.labels.tolist() == [True, False]
    assert kto.units.branches_per_unit.tolist() == [1, 1]
    check_unit(kto.units, 1, gpt2, TEXT, [{"prompt": "Hi.", "completion": " Go away."}])
    completions = [" one", " two two", " three three three"]
    groups = PreferenceEncoder(gpt2, "groups").encode_rows(
        [
            {"prompt": "Count:", "completions": completions, "rewards": [0.5, -1, 2.25]},
            {"prompt": "Say:", "completions": [" a", " b"], "rewards": [1.0, -1.0]},
        ]
    )
    assert not groups.bad_rows
    units = groups.units
    assert units.branches_per_unit.tolist() == [3, 2]
    assert units.rewards.dtype == np.float32
    assert units.rewards.tolist() == [0.5, -1.0, 2.25, 1.0, -1.0]
    # advantages for one group only: a loss weighted by them would be NaN for the other, so refused
    with pytest.raises(
        TightpackError, match=r"^advantages are given for some groups and not for source row 0 "
    ):
        PreferenceEncoder(gpt2, "groups").encode_rows(
            [{"prompt": "Count:", "completions": completions}, {"prompt": "Say:", "completions": [" a", " b"],
             "advantages": [1.0, -1.0]}]
        )  # fmt: skip
    check_unit(units, 0, gpt2, TEXT, [{"prompt": "Count:", "completion": c} for c in completions])


BAD = [
    ({"prompt": "p", "chosen": " a"}, "preference", "missing key 'rejected'"),
    ({"prompt": "p", "chosen": None, "rejected": " a"}, "preference", "missing key 'chosen', or it is null"),
    ({"prompt": "p", "completion": " a", "label": True}, "preference", "is a KTO row: pack it as format kto"),
    ({"prompt": "p", "completions": [" a", " b"]}, "preference", "is a group: pack it as format groups"),
    ({"chosen": [], "rejected": []}, "preference", "'chosen' is empty: a whole conversation"),
    ({"prompt": "p", "completion": " a"}, "kto", "missing key 'label', or it is null"),
    ({"prompt": "p", "rejected": " a"}, "preference", "missing key 'chosen'"),
    ({"prompt": "p", "chosen": "", "rejected": " a"}, "preference", "'chosen' is empty"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": "a"}, "preference", "is empty"),
    ({"prompt": "p", "chosen": " a", "rejected": " a"}, "preference", "identical"),
    (
        {
            "chosen": [{"role": "user", "content": "q"}],
            "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        },
        "preference",
        "'chosen' has no message after the prompt it shares with the other branch",
    ),
    (
        {
            "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "r"}, {"role": "assistant", "content": "b"}],
        },
        "preference",
        "share no prompt",
    ),
    ({"prompt": "p", "completions": [" a"]}, "groups", "at least 2 completions"),
    ({"prompt": "p", "completions": [" a", None]}, "groups", "'completions[1]' is null"),
    ({"prompt": "p"}, "groups", "missing key 'completions', or it is null"),
    ({"prompt": "p", "completions": [" a", " b"], "rewards": [1.0]}, "groups", "list of 2 numbers"),
    ({"prompt": "p", "completions": [" a", " b"], "rewards": [1.0, "x"]}, "groups", "list of 2 numbers"),
    ({"prompt": "p", "completions": [" a", " b"], "advantages": [1.0, math.nan]}, "groups", "not finite"),
    ({"prompt": "p", "completion": " a", "label": 1}, "kto", "'label' must be true or false"),
    (
        {"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": " b"},
        "preference",
        "the prompt is text",
    ),
    (["not", "an", "object"], "preference", "expected a JSON object"),
    ({"completion": " a", "label": True}, "kto", "missing key 'prompt'"),
    ({"prompt": "p", "label": True}, "kto", "missing key 'completion'"),
]


@pytest.mark.parametrize(("row", "kind", "reason"), BAD, ids=[reason for *_, reason in BAD])
def test_bad_rows_are_reported_and_others_kept(gpt2, row, kind, reason):
    good = {
        "preference": {"prompt": "Q:", "chosen": " yes", "rejected": " no"},
        "kto": {"prompt": "Q:", "completion": " yes", "label": True},
        "groups": {"prompt": "Q:", "completions": [" yes", " no"]},
    }[kind]
    result = PreferenceEncoder(gpt2, kind).encode_rows([good, row, good], first_sample=10)
    assert len(result.bad_rows) == 1 and result.rows == 3
    assert reason in result.bad_rows[0].reason, result.bad_rows[0].reason
    assert result.bad_rows[0].sample_index == 11
    assert result.units.source_index.tolist() == [10, 12]


def reference_size(prompt: int, lengths: list[int], layout: str, m: int) -> int:
    if layout == "pairs":
        return sum(-(-(prompt + b) // m) * m for b in lengths)
    return -(-(prompt + sum(lengths) + len(lengths) - 1) // m) * m


def test_fit_trims_the_prompt_start_then_cuts_longest_branches():
    units = PreferenceUnits.from_lists(
        [list(range(100, 120)), [1, 2], [3]],
        [[7] * 5, [8] * 3, [9] * 30, [10] * 2, [11] * 2, [12] * 2],
        [2, 2, 2],
    )
    fit = fit_units(units, 20, "shared-prefix")
    # unit 0: 20 + 8 + 1 = 29 > 20; trimming the prompt alone fits: keep its last 11 tokens
    assert fit.units.prompt(0).tolist() == list(range(109, 120))
    assert fit.units.branch_lengths[:2].tolist() == [5, 3]
    # unit 1: prompt 2 -> 1 is not enough for 30 + 2 + 1; the long branch is cut at its end
    # (1 + 16 + 2 + 1 = 20)
    assert fit.units.prompt(1).tolist() == [2]
    assert fit.units.branch_lengths[2:4].tolist() == [16, 2]
    assert fit.units.branch(2).tolist() == [9] * 16
    assert (fit.prompt_trimmed, fit.branches_cut, fit.dropped) == (2, 1, {})
    assert (unit_sizes(fit.units, "shared-prefix") <= 20).all()
    many = PreferenceUnits.from_lists([[1]], [[2]] * 12, [12])  # a group too large for the cap
    dropped = fit_units(many, 8, "pairs")
    assert len(dropped.units) == 0 and list(dropped.dropped) == [0]
    assert "12 branches need at least 24 tokens" in dropped.dropped[0]


@pytest.mark.parametrize("layout", ["pairs", "shared-prefix"])
@pytest.mark.parametrize("multiple", [1, 8])
def test_fit_units_random(layout, multiple):
    rng = np.random.default_rng(7)
    counts = rng.integers(1, 6, size=60).tolist()
    prompts = [rng.integers(0, 50, size=rng.integers(1, 40)).tolist() for _ in counts]
    branches = [rng.integers(0, 50, size=rng.integers(1, 60)).tolist() for _ in range(sum(counts))]
    units = PreferenceUnits.from_lists(prompts, branches, counts, rewards=rng.random(sum(counts)).tolist())
    cap = 96
    fit = fit_units(units, cap, layout, pad_to_multiple_of=multiple)
    assert (unit_sizes(fit.units, layout, multiple) <= cap).all()
    sizes = unit_sizes(units, layout, multiple)
    assert sizes.tolist() == [
        reference_size(
            len(p), [len(branches[b]) for b in range(sum(counts[:u]), sum(counts[: u + 1]))], layout, multiple
        )
        for u, p in enumerate(prompts)
    ]
    assert sorted(fit.kept.tolist() + list(fit.dropped)) == list(range(len(units)))
    trimmed = cut = 0
    for k, u in enumerate(fit.kept.tolist()):
        p, first = prompts[u], sum(counts[:u])
        kept_prompt = fit.units.prompt(k).tolist()
        assert kept_prompt == p[len(p) - len(kept_prompt) :] and kept_prompt  # the END kept
        trimmed += len(kept_prompt) < len(p)
        cut_here = False
        for j in range(counts[u]):
            got = fit.units.branch(fit.units.unit_offsets[k] + j).tolist()
            assert got and got == branches[first + j][: len(got)]  # the start kept
            cut_here |= len(got) < len(branches[first + j])
            assert fit.units.rewards[fit.units.unit_offsets[k] + j] == np.float32(units.rewards[first + j])
        if cut_here:
            assert len(kept_prompt) == 1  # branches are cut only once the prompt is down to one token
        cut += cut_here
        if sizes[u] <= cap:
            assert kept_prompt == p and not cut_here
    assert (fit.prompt_trimmed, fit.branches_cut) == (trimmed, cut)
    for u, reason in fit.dropped.items():
        assert reference_size(1, [1] * counts[u], layout, multiple) > cap and "over the cap" in reason


def test_select_with_lengths_and_branch_indices_vs_python():
    rng = np.random.default_rng(3)
    counts = rng.integers(1, 5, size=30).tolist()
    prompts = [rng.integers(0, 99, size=rng.integers(1, 9)).tolist() for _ in counts]
    branches = [rng.integers(0, 99, size=rng.integers(1, 9)).tolist() for _ in range(sum(counts))]
    masks = [rng.integers(0, 2, size=len(b)).tolist() for b in branches]
    units = PreferenceUnits.from_lists(
        prompts, branches, counts, loss_masks=masks, labels=[True] * len(branches)
    )
    assert units.branch_unit.tolist() == [u for u, c in enumerate(counts) for _ in range(c)]
    assert units.branch_index.tolist() == [j for c in counts for j in range(c)]
    owned = [list(range(sum(counts[:u]), sum(counts[: u + 1]))) for u in range(len(counts))]
    pick = rng.permutation(len(counts))[:12]
    chosen = units.select(pick)
    assert chosen.source_index.tolist() == pick.tolist()
    flat = [b for u in pick for b in owned[u]]
    assert chosen.branch_tokens.tolist() == [t for b in flat for t in branches[b]]
    assert chosen.branch_loss_mask.tolist() == [t for b in flat for t in masks[b]]
    assert chosen.prompt_tokens.tolist() == [t for u in pick for t in prompts[u]]
    assert chosen.branches_per_unit.tolist() == [counts[u] for u in pick]
    assert len(chosen.labels) == len(flat)
    pk = [int(rng.integers(1, len(p) + 1)) for p in prompts]
    bk = [int(rng.integers(0, len(b) + 1)) for b in branches]
    cut = units.with_lengths(np.array(pk), np.array(bk))
    assert cut.prompt_tokens.tolist() == [
        t for p, k in zip(prompts, pk, strict=True) for t in p[len(p) - k :]
    ]
    assert cut.branch_tokens.tolist() == [t for b, k in zip(branches, bk, strict=True) for t in b[:k]]
    assert cut.branch_loss_mask.tolist() == [t for m, k in zip(masks, bk, strict=True) for t in m[:k]]
    starts, lengths = rng.integers(0, 50, size=20), rng.integers(0, 5, size=20)
    ranges = concatenated_ranges(starts, lengths).tolist()
    assert ranges == [s + i for s, n in zip(starts.tolist(), lengths.tolist(), strict=True) for i in range(n)]


@pytest.mark.parametrize("layout", ["pairs", "shared-prefix"])
def test_a_prompt_whose_end_merges_with_a_branch_keeps_each_branch_its_own_tokens(gpt2, layout):
    """GPT-2's BPE merges the prompt's trailing space with the branch ``"yes"`` (``" yes"``) but not
    with ``" no"``: the renderings part before the prompt ends. The prompt kept is what they share;
    each branch keeps the rest of its own rendering, the merged token supervised as the SFT path
    supervises it."""
    from tightpack.prepare.format_config import FormatConfig
    from tightpack.prepare.tokenize import Encoder
    from tightpack.runtime.preference_batch import build_preference_row

    row = {"prompt": "Answer with a space ", "chosen": "yes", "rejected": " no"}
    encoded = PreferenceEncoder(gpt2, "preference").encode_rows([row])
    assert not encoded.bad_rows
    units = encoded.units
    sft = Encoder(gpt2, FormatConfig(format="prompt-completion", input_key="prompt", output_key="completion",
                                     prompt_template="{prompt}{completion}", truncate_fields=()))  # fmt: skip
    alone = sft.encode_rows(
        [{"prompt": row["prompt"], "completion": b} for b in (row["chosen"], row["rejected"])]
    )
    bounds = np.concatenate([[0], np.cumsum(alone.lengths)])
    prompt = units.prompt(0).tolist()
    for b in range(2):
        own = alone.tokens[bounds[b] : bounds[b + 1]].tolist()
        assert prompt + units.branch(b).tolist() == own
        mask = units.branch_loss_mask[units.branch_offsets[b] : units.branch_offsets[b + 1]].tolist()
        assert [0] * len(prompt) + mask == alone.loss_mask[bounds[b] : bounds[b + 1]].tolist()
    prompt_alone = gpt2.backend.encode(row["prompt"], add_special_tokens=False).ids
    assert len(prompt) < len(prompt_alone), "the renderings part inside the prompt's own tokens"
    validate_thd_batch(build_preference_row(units, layout))
