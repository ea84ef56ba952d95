"""Preference packing: padded pairs, TRL's ``padding_free`` and tightpack's two layouts, per step.

A tiny Llama built from a config (random init, float32, 4 heads, 2 key-value heads, vocabulary 1,024;
quick: hidden 64, 2 layers; ``--full``: hidden 128, 2 layers) as the policy and another as the
reference. Every layout gets the same pairs (or groups) per step and computes the same thing: every
branch's summed log-probability from the policy (forward and backward) and from the reference
(forward under ``no_grad``), feeding the same loss (sigmoid DPO, beta 0.1, for pairs; an
advantage-weighted loss on ``policy - reference`` for groups).

Attention follows each layout's block structure, as a varlen kernel on a GPU would
(``preference_attention.py``: torch SDPA per sequence, and per shared-prefix unit the prompt's causal
triangle plus every branch's rows against the prompt and itself), so no layout pays a packed row's
length squared. Layouts:

- ``padded pairs`` (TRL's default batching): the step's chosen then rejected sequences along the batch
  dimension, right-padded to the longest; attention causal over each padded row (its real tokens
  never see the padding after them);
- ``padding_free`` (TRL's layout, reproduced): the step's sequences in TRL's order in one row,
  ``position_ids`` restarting per sequence, attention per sequence;
- ``tightpack pairs`` and ``tightpack shared-prefix``: `build_preference_row` and `sequence_logps`;
- with ``--sdpa-mask``, ``padded pairs, sdpa mask``: the padded batch through transformers' own
  ``sdpa`` with the 2-D padding mask, as TRL runs it (a dense mask: no causal skipping).

For groups of G completions: ``separate sequences`` (tightpack ``pairs``: every completion its own
sequence with its prompt) against ``shared-prefix``.

Data (the demo corpus, tightpack's embedded default; a 1,024-token byte-level BPE trained on it):
(a) demo pairs: a conversation's history as the prompt, its last assistant turn as ``chosen``, and as
``rejected`` an assistant turn of another conversation of about its length (one of the five nearest,
at random); prompts trimmed at their start so that every sequence fits ``--demo-max-length`` (1,024:
TRL's default ``max_length``); (b) long prompts: a user message cut from demo text to a length
log-uniform in ``--prompt-min``-``--prompt-max`` (1k-8k tokens, the chat template included), answered
by a demo pair with a short ``chosen`` (at most 128 tokens); (c) groups of ``--group-size``
completions on such prompts: a conversation's last assistant turn and the turns of other
conversations of the nearest lengths, reward 1 for the first and 0 for the others.

Before timing, every layout's per-branch log-probabilities, loss and policy gradient are compared with
each sequence run alone through transformers' own ``sdpa`` (nothing packed or padded); the run stops
when one differs by more than float32 allows. Then ``--rounds`` rounds, each running every layout on
the same steps in a rotated order; a layout's step time is its median round (the best beside it). At
``--threads 1`` (the default) a step's time is the CPU time of the thread that runs it, which other
jobs on a shared machine do not inflate (the wall time is kept beside it); with more threads, wall
time. A scaling check times rows of 1-8 sequences of 1,024 tokens: equal times per token say a step
is compute-bound.

The planner check packs each set's units whole (`plan_units`: best-fit decreasing over `unit_sizes`,
then packs drained into others, `tightpack.core.unit_fill`; bfd alone beside it, with both planning
times) and the same tokens as free sequences aligned alike (every aligned ``prompt + branch`` for
``pairs``; the shared prompt and every branch piece for ``shared-prefix``, the unit's alignment tail
on its last piece), at pack sizes a user of the set would pick (demo pairs 2k-8k, long prompts 16k-64k), units
drawn at random until they fill about ``--plan-packs`` packs. Beside the fill gap: the least gap any
plan of whole units could reach (`least_packs`: Martello and Toth's lower bound L2 on the packs).

    .venv/bin/python benchmarks/bench_preference.py [--full] [--rounds 5] [--sdpa-mask]

``--only-planner`` runs the planner check alone (no model, seconds instead of minutes) and writes no
result.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_training import small_tokenizer, tiny_llama

from preference_attention import ATTENTION, blocks, row_blocks, sequence_blocks
from results import add_size_options, choose_size, table, write_result
from tightpack.core.planner import plan_packs
from tightpack.core.preference_units import (
    PreferenceUnits,
    concatenated_ranges,
    fit_units,
    plan_units,
    unit_sizes,
)
from tightpack.core.unit_fill import least_packs
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_logps import sequence_logps

BETA = 0.1
LOGP_TOLERANCE = 1e-5  # relative, per branch (float32 sums over thousands of positions)
LOSS_TOLERANCE = 1e-3  # relative (a group's loss sums terms of both signs)
GRAD_TOLERANCE = 1e-3  # largest gradient difference over the largest gradient
SHORT_ANSWER = 128  # tokens: the long-prompt sets' answers
PACK_SIZES = {"demo pairs": (2048, 4096, 8192), "long": (16384, 32768, 65536)}


# ---------------------------------------------------------------- data


def demo_conversations(rows: list[dict]) -> list[list[dict]]:
    """Conversations that open with a user turn and have an assistant turn."""
    return [
        m
        for m in (row["messages"] for row in rows)
        if len(m) >= 2 and m[0]["role"] == "user" and any(x["role"] == "assistant" for x in m)
    ]


class Replies:
    """Every assistant turn of the demo conversations, by length, to draw a plausible other answer:
    one of the ``k`` turns of other conversations whose length is nearest."""

    def __init__(self, talks: list[list[dict]]):
        self.turns = sorted(
            {(len(m["content"]), c, m["content"]) for c, talk in enumerate(talks) for m in talk
             if m["role"] == "assistant" and m["content"]}
        )  # fmt: skip
        self.lengths = np.array([n for n, _, _ in self.turns])

    def near(self, text: str, talk: int, count: int, rng: np.random.Generator, k: int = 5) -> list[str]:
        """``count`` distinct assistant turns of conversations other than ``talk``, each one of the
        ``k`` nearest in length to ``text`` not taken yet."""
        at = int(np.searchsorted(self.lengths, len(text)))
        lo, hi, found, taken = at - 1, at, [], {text}
        while len(found) < count:
            candidates = []
            while len(candidates) < k and (lo >= 0 or hi < len(self.turns)):
                below = lo >= 0 and (
                    hi >= len(self.turns) or len(text) - self.lengths[lo] <= self.lengths[hi] - len(text)
                )
                index = lo if below else hi
                lo, hi = (lo - 1, hi) if below else (lo, hi + 1)
                _, c, other = self.turns[index]
                if c != talk and other not in taken:
                    candidates.append(other)
            pick = candidates[int(rng.integers(len(candidates)))]
            found.append(pick)
            taken.add(pick)
        return found


def last_turn(talk: list[dict]) -> int:
    return max(i for i, m in enumerate(talk) if m["role"] == "assistant")


def demo_pairs(talks, replies: Replies, indices, rng) -> list[dict]:
    """(a): the history as the prompt, the last assistant turn ``chosen``, a turn of another
    conversation of about its length ``rejected``."""
    out = []
    for c in indices:
        talk, j = talks[c], last_turn(talks[c])
        (rejected,) = replies.near(talk[j]["content"], c, 1, rng)
        out.append(
            {
                "prompt": talk[:j],
                "chosen": [talk[j]],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return out


class LongText:
    """User messages of a given number of tokens, cut from demo text in token space."""

    def __init__(self, tokenizer, rows: list[dict], encoder: PreferenceEncoder):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(tokenizer.backend_json)
        text = "\n".join(m["content"] for row in rows[:600] for m in row["messages"] if m["content"])
        self.ids = self.backend.encode(text).ids
        probe = encoder.encode_rows(
            [{"prompt": [{"role": "user", "content": "x"}], "chosen": "a", "rejected": "b"}]
        )
        self.overhead = int(probe.units.prompt_lengths[0]) - len(self.backend.encode("x").ids)

    def message(self, tokens: int, rng: np.random.Generator) -> str:
        body = max(1, tokens - self.overhead)
        start = int(rng.integers(len(self.ids) - body))
        return self.backend.decode(self.ids[start : start + body])


def log_uniform(rng, low: int, high: int) -> int:
    return round(float(np.exp(rng.uniform(np.log(low), np.log(high)))))


def long_rows(count, args, talks, replies, short, text: LongText, rng, group: int = 0) -> list[dict]:
    """(b) pairs (``group == 0``) or (c) groups of ``group`` completions on long prompts."""
    out = []
    for _ in range(count):
        message = text.message(log_uniform(rng, args.prompt_min, args.prompt_max), rng)
        c = short[int(rng.integers(len(short)))]
        answer = talks[c][last_turn(talks[c])]["content"]
        others = replies.near(answer, c, max(1, group - 1), rng)
        prompt = [{"role": "user", "content": message}]
        if group:
            completions = [answer, *others]
            out.append({"prompt": prompt, "completions": completions, "rewards": [1.0] + [0.0] * (group - 1)})
        else:
            out.append({"prompt": prompt, "chosen": answer, "rejected": others[0]})
    return out


def encode(encoder: PreferenceEncoder, rows: list[dict]) -> PreferenceUnits:
    result = encoder.encode_rows(rows)
    if result.bad_rows:
        raise SystemExit(f"bad rows: {result.bad_rows[:3]}")
    return result.units


def cap_sequences(units: PreferenceUnits, max_length: int) -> tuple[PreferenceUnits, int]:
    """Every ``prompt + branch`` within ``max_length``: prompts trimmed at their start (at least one
    token kept), then branches cut at their end. Returns the units and how many were trimmed."""
    longest = np.maximum.reduceat(units.branch_lengths, units.unit_offsets[:-1])
    prompt_keep = np.clip(max_length - longest, 1, units.prompt_lengths)
    branch_keep = np.minimum(
        units.branch_lengths, max_length - np.repeat(prompt_keep, units.branches_per_unit)
    )
    trimmed = int((prompt_keep < units.prompt_lengths).sum())
    return units.with_lengths(prompt_keep, branch_keep), trimmed


# ---------------------------------------------------------------- layouts


def sequences(units: PreferenceUnits) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per branch (unit order): ``prompt + branch`` and its unshifted loss mask."""
    out = []
    for b, u in enumerate(units.branch_unit):
        prompt = units.prompt(int(u))
        lo, hi = units.branch_offsets[b], units.branch_offsets[b + 1]
        mask = np.concatenate([np.zeros(len(prompt), np.int8), units.branch_loss_mask[lo:hi]])
        out.append((np.concatenate([prompt, units.branch(b)]), mask))
    return out


def shifted_labels(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    label = np.full(len(tokens), -100, np.int64)
    label[:-1] = np.where(mask[1:] > 0, tokens[1:], -100)
    return label


def trl_order(units: PreferenceUnits) -> np.ndarray:
    """TRL's order of a step's sequences: every chosen, then every rejected (branch indices)."""
    return np.concatenate([np.flatnonzero(units.branch_index == k) for k in range(2)])


def padded_batch(seqs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    longest = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    attention = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for row, (tokens, mask) in enumerate(seqs):
        n = len(tokens)
        ids[row, :n] = torch.from_numpy(tokens)
        attention[row, :n] = 1
        labels[row, :n] = torch.from_numpy(shifted_labels(tokens, mask))
    return {"input_ids": ids, "attention_mask": attention, "labels": labels, "blocks": [(0, longest, 0, 0)]}


def padding_free_batch(seqs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    lengths = [len(s) for s, _ in seqs]
    return {
        "input_ids": torch.from_numpy(np.concatenate([s for s, _ in seqs])).long()[None],
        "position_ids": torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).long()[None],
        "labels": torch.from_numpy(np.concatenate([shifted_labels(s, m) for s, m in seqs]))[None],
        "sequence": torch.from_numpy(np.repeat(np.arange(len(seqs)), lengths)),
        "blocks": sequence_blocks(lengths),
    }


def target_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per position: the target's log-probability (0 where the label is -100)."""
    trained = labels != -100
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return logp * trained


def padded_logps(model, batch: dict, stock: bool) -> torch.Tensor:
    if stock:  # transformers' sdpa with the 2-D padding mask, as TRL runs it
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    else:
        with blocks(batch["blocks"]):
            out = model(input_ids=batch["input_ids"], use_cache=False)
    return target_logps(out.logits, batch["labels"]).sum(-1)


def padding_free_logps(model, batch: dict) -> torch.Tensor:
    with blocks(batch["blocks"]):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    logp = target_logps(out.logits[0], batch["labels"][0])
    count = int(batch["sequence"].max()) + 1
    return torch.zeros(count, dtype=logp.dtype).index_add(0, batch["sequence"], logp)


def row_logps(model, batch: dict) -> torch.Tensor:
    with blocks(batch["blocks"]):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return sequence_logps(out.logits, batch).sums


def alone_logps(model, seqs: list[tuple[np.ndarray, np.ndarray]]) -> torch.Tensor:
    """The reference: every sequence alone, transformers' own sdpa, nothing packed or padded."""
    values = []
    for tokens, mask in seqs:
        out = model(input_ids=torch.from_numpy(tokens).long()[None], use_cache=False)
        values.append(target_logps(out.logits[0], torch.from_numpy(shifted_labels(tokens, mask))).sum())
    return torch.stack(values)


class Layout:
    """One layout of one step: its batch, the tokens it computes, how to run a model on it (``stock``:
    transformers' sdpa, else the block-structured attention) and where every branch (in unit order)
    sits in its output."""

    def __init__(self, name: str, batch: dict, run, position: np.ndarray, stock: bool = False):
        self.name, self.batch, self.run, self.position, self.stock = name, batch, run, position, stock
        self.tokens = int(batch["input_ids"].numel())


def step_layouts(units: PreferenceUnits, groups: bool, sdpa_mask: bool) -> list[Layout]:
    seqs = sequences(units)
    identity = np.arange(len(seqs))
    layouts = []
    if not groups:
        order = trl_order(units)
        where = np.argsort(order)  # branch b sits at where[b] in TRL's order
        padded = padded_batch([seqs[i] for i in order])
        layouts.append(Layout("padded pairs", padded, lambda m, b: padded_logps(m, b, False), where))
        if sdpa_mask:
            layouts.append(
                Layout("padded pairs, sdpa mask", padded, lambda m, b: padded_logps(m, b, True), where, True)
            )
        free = padding_free_batch([seqs[i] for i in order])
        layouts.append(Layout("padding_free", free, padding_free_logps, where))
    for layout in ("pairs", "shared-prefix"):
        row = build_preference_row(units, layout)
        row["blocks"] = row_blocks(row)
        name = (
            ("separate sequences" if layout == "pairs" else "shared-prefix")
            if groups
            else f"tightpack {layout}"
        )
        layouts.append(Layout(name, row, row_logps, identity))
    return layouts


def set_attention(models, stock: bool) -> None:
    for model in models:
        model.config._attn_implementation = "sdpa" if stock else ATTENTION


def pair_loss(policy, reference, chosen: np.ndarray, rejected: np.ndarray) -> torch.Tensor:
    margin = (policy[chosen] - policy[rejected]) - (reference[chosen] - reference[rejected])
    return -torch.nn.functional.logsigmoid(BETA * margin).mean()


def loss_for(units: PreferenceUnits, groups: bool):
    if groups:
        rewards = torch.from_numpy(units.rewards).float()
        size = int(units.branches_per_unit[0])
        by_group = rewards.view(-1, size)
        advantages = (by_group - by_group.mean(1, keepdim=True)).reshape(-1)
        return lambda p, r: -(advantages * (p - r)).mean()
    chosen, rejected = np.flatnonzero(units.branch_index == 0), np.flatnonzero(units.branch_index == 1)
    return lambda p, r: pair_loss(p, r, chosen, rejected)


def gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}
"""The step clocks: ``cpu``, the CPU time of the one thread that runs the step (torch's intra-op
work runs on the calling thread at ``--threads 1``, and so does the CPU backward), which other jobs on
a shared machine do not inflate by taking the core away; ``wall``, the elapsed time."""


def run_step(layout: Layout, policy, reference, loss_of) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One step: the reference's forward under no_grad, the policy's forward and backward. Returns the
    per-branch policy log-probabilities (unit order), the loss and the seconds by each clock."""
    set_attention((policy, reference), layout.stock)
    policy.zero_grad(set_to_none=True)
    start = {name: clock() for name, clock in CLOCK.items()}
    with torch.no_grad():
        ref = layout.run(reference, layout.batch)
    logps = layout.run(policy, layout.batch)
    loss = loss_of(logps[layout.position], ref[layout.position])
    loss.backward()
    seconds = {name: clock() - start[name] for name, clock in CLOCK.items()}
    return logps[layout.position].detach(), loss.detach(), seconds


def check_step(units: PreferenceUnits, layouts: list[Layout], policy, reference, loss_of) -> dict:
    """Every layout against every sequence run alone (transformers' sdpa): per-branch log-probability,
    loss and policy gradient, as relative differences."""
    seqs = sequences(units)
    set_attention((policy, reference), True)
    policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref = alone_logps(reference, seqs)
    logps = alone_logps(policy, seqs)
    loss = loss_of(logps, ref)
    loss.backward()
    base_logps, base_loss, base_grad = logps.detach(), loss.item(), gradient(policy).clone()
    out = {}
    for layout in layouts:
        got, got_loss, _ = run_step(layout, policy, reference, loss_of)
        grad = gradient(policy)
        out[layout.name] = {
            "logp": float(((got - base_logps).abs() / base_logps.abs()).max()),
            "loss": abs(float(got_loss) - base_loss) / max(abs(base_loss), 1e-30),
            "grad": float((grad - base_grad).abs().max() / base_grad.abs().max()),
        }
    return out


def measure(
    name: str, steps: list[PreferenceUnits], models, rounds: int, groups: bool, sdpa_mask: bool, clock: str
) -> dict:
    """Every layout on the same steps: the equality check, then ``rounds`` timed rounds, each running
    every layout once in a rotated order; a layout's step time is its median round by ``clock``."""
    policy, reference = models
    prepared = [step_layouts(units, groups, sdpa_mask) for units in steps]
    losses = [loss_for(units, groups) for units in steps]
    names = [layout.name for layout in prepared[0]]
    check: dict[str, dict[str, float]] = {n: {"logp": 0.0, "loss": 0.0, "grad": 0.0} for n in names}
    for units, layouts, loss_of in zip(steps, prepared, losses, strict=True):  # also the warm-up
        for n, diffs in check_step(units, layouts, policy, reference, loss_of).items():
            check[n] = {k: max(check[n][k], v) for k, v in diffs.items()}
    for n, diffs in check.items():
        if diffs["logp"] > LOGP_TOLERANCE or diffs["loss"] > LOSS_TOLERANCE or diffs["grad"] > GRAD_TOLERANCE:
            raise SystemExit(f"{name}: {n} differs from the sequences run alone: {diffs}")
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CLOCK} for n in names}
    for r in range(rounds):
        for k in np.roll(np.arange(len(names)), -r).tolist():  # a rotated order every round
            spent = [
                run_step(layouts[k], policy, reference, loss_of)[2]
                for layouts, loss_of in zip(prepared, losses, strict=True)
            ]
            for c in CLOCK:
                times[names[k]][c].append(sum(s[c] for s in spent) / len(steps))
    units_per_step = float(np.mean([len(u) for u in steps]))
    prompts = np.concatenate([u.prompt_lengths for u in steps])
    branches = np.concatenate([u.branch_lengths for u in steps])
    base = names[0]
    rows = {}
    for k, n in enumerate(names):
        rows[n] = {
            "tokens_per_step": float(np.mean([layouts[k].tokens for layouts in prepared])),
            "seconds_per_step": statistics.median(times[n][clock]),
            "best_seconds_per_step": min(times[n][clock]),
            "wall_seconds_per_step": statistics.median(times[n]["wall"]),
            "round_seconds": times[n],
            "check": check[n],
        }
        rows[n]["units_per_second"] = units_per_step / rows[n]["seconds_per_step"]
    for n, row in rows.items():
        row["tokens_vs_" + base] = row["tokens_per_step"] / rows[base]["tokens_per_step"]
        for other in (base, "padding_free"):
            if other in rows:
                row["speedup_vs_" + other] = rows[other]["seconds_per_step"] / row["seconds_per_step"]
                row["round_speedups_vs_" + other] = [
                    b / t for b, t in zip(times[other][clock], times[n][clock], strict=True)
                ]
    prompt_total = float(np.sum([u.prompt_lengths.sum() for u in steps]))
    branch_total = float(branches.sum())
    return {
        "set": name,
        "steps": len(steps),
        "units_per_step": units_per_step,
        "prompt_tokens": [int(prompts.min()), float(np.median(prompts)), int(prompts.max())],
        "branch_tokens": [int(branches.min()), float(np.median(branches)), int(branches.max())],
        # the issue's bound (P + C + R) / (2P + C + R): every prompt once against once per branch
        "bound": (prompt_total + branch_total) / (float((prompts * 2).sum()) + branch_total)
        if not groups
        else None,
        "layouts": rows,
        "base": base,
    }


# ---------------------------------------------------------------- compute-bound check


def scaling(models, vocab: int, rounds: int, seed: int, clock: str) -> dict:
    """One step (as `run_step`) on rows of 1, 2, 4 and 8 sequences of 1,024 tokens, whose attention
    per token is the same: milliseconds per token, best of ``rounds`` interleaved rounds after a
    warm-up of each. Equal figures say a step's time follows its tokens (compute-bound)."""
    rng = np.random.default_rng(seed)
    policy, reference = models
    set_attention(models, False)
    counts = (1, 2, 4, 8)
    batches = {
        n: {
            "input_ids": torch.from_numpy(rng.integers(0, vocab, (1, 1024 * n))).long(),
            "position_ids": torch.from_numpy(np.tile(np.arange(1024), n)).long()[None],
            "blocks": sequence_blocks([1024] * n),
        }
        for n in counts
    }

    def step(batch: dict) -> float:
        policy.zero_grad(set_to_none=True)
        start = CLOCK[clock]()
        with blocks(batch["blocks"]):
            with torch.no_grad():
                reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            out = policy(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            torch.log_softmax(out.logits, -1)[..., 0].mean().backward()
        return CLOCK[clock]() - start

    for n in counts:
        step(batches[n])
    best = {n: float("inf") for n in counts}
    for r in range(rounds):
        for n in np.roll(np.array(counts), -r).tolist():
            best[n] = min(best[n], step(batches[n]))
    return {str(1024 * n): 1000 * best[n] / (1024 * n) for n in counts}


# ---------------------------------------------------------------- planner fill


def free_pieces(units: PreferenceUnits, layout: str, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """The same tokens as free sequences, aligned as the units' sequences are: every ``prompt + branch``
    aligned (``pairs``, which sum to the unit); or the shared prompt and every branch piece
    (``shared-prefix``), the unit's alignment tail on its last piece. Returns the pieces and each
    one's unit."""
    sizes = unit_sizes(units, layout, multiple)
    if layout == "pairs":
        prompts = np.repeat(units.prompt_lengths, units.branches_per_unit)
        pieces = -(-(prompts + units.branch_lengths) // multiple) * multiple
        return pieces, units.branch_unit
    count = len(units)
    per_unit = units.branches_per_unit + 1
    offsets = np.concatenate([[0], np.cumsum(per_unit)])
    pieces = np.zeros(offsets[-1], np.int64)
    pieces[offsets[:-1]] = units.prompt_lengths - 1
    branch_slots = np.setdiff1d(np.arange(offsets[-1]), offsets[:-1])
    pieces[branch_slots] = units.branch_lengths + 1
    pieces[offsets[1:] - 1] += sizes - unit_sizes(units, layout, 1)
    return pieces, np.repeat(np.arange(count), per_unit)


def planner_fill(name: str, units: PreferenceUnits, pack_sizes, packs: int, seed: int) -> list[dict]:
    """Fill of the units packed whole (`plan_units`: bfd, then packs drained; and bfd alone) and of
    the same tokens as free sequences, aligned alike, at every pack size, layout and alignment; the
    units drawn at random (with replacement) until they fill about ``packs`` packs. Planning times
    are the best of three."""
    out = []
    for pack_size in pack_sizes:
        for layout in ("pairs", "shared-prefix"):
            for multiple in (1, 8):
                rng = np.random.default_rng(seed)
                fit = fit_units(units, pack_size, layout, pad_to_multiple_of=multiple)
                fitted = fit.units
                sizes = unit_sizes(fitted, layout, multiple)
                real = unit_sizes(fitted, layout, 1)
                pieces, piece_unit = free_pieces(fitted, layout, multiple)
                draw = rng.integers(0, len(fitted), int(np.ceil(packs * pack_size / sizes.mean())))
                first = np.searchsorted(piece_unit, np.arange(len(fitted)))
                count = np.bincount(piece_unit, minlength=len(fitted))
                drawn_pieces = pieces[concatenated_ranges(first[draw], count[draw])]
                drawn = fitted.select(draw)
                plan = functools.partial(plan_units, drawn, pack_size, layout, pad_to_multiple_of=multiple)
                unit_plan, unit_seconds = best_time(plan)
                bfd_plan, bfd_seconds = best_time(functools.partial(plan, algorithm="bfd"))
                free_plan = plan_packs(drawn_pieces, pack_size)
                tokens = int(real[draw].sum())
                unit_fill = tokens / (len(unit_plan) * pack_size)
                bfd_fill = tokens / (len(bfd_plan) * pack_size)
                floor = least_packs(sizes[draw], pack_size)
                free_fill = tokens / (len(free_plan) * pack_size)
                out.append(
                    {
                        "set": name,
                        "layout": layout,
                        "pack_size": pack_size,
                        "multiple": multiple,
                        "units": len(draw),
                        "unit_tokens_mean": float(sizes[draw].mean()),
                        "over_half": float((sizes[draw] > pack_size / 2).mean()),
                        "trimmed_to_fit": fit.prompt_trimmed + fit.branches_cut,
                        "dropped": len(fit.dropped),
                        "packs_units": len(unit_plan),
                        "packs_units_bfd": len(bfd_plan),
                        "packs_free": len(free_plan),
                        "fill_units": unit_fill,
                        "fill_units_bfd": bfd_fill,
                        "fill_free": free_fill,
                        "gap_points": 100 * (free_fill - unit_fill),
                        "gap_points_bfd": 100 * (free_fill - bfd_fill),
                        "packs_floor": floor,
                        "fill_floor": tokens / (floor * pack_size),
                        # no plan of whole units gets closer to this free plan
                        "least_gap_points": max(0.0, 100 * (free_fill - tokens / (floor * pack_size))),
                        "plan_seconds": unit_seconds,
                        "plan_seconds_bfd": bfd_seconds,
                    }
                )
    return out


def best_time(plan, repeats: int = 3):
    """``plan()``'s result and its best time over ``repeats`` calls (it is deterministic), in CPU
    seconds of the thread: other jobs on a shared machine do not inflate it."""
    seconds = []
    for _ in range(repeats):
        started = time.thread_time()
        result = plan()
        seconds.append(time.thread_time() - started)
    return result, min(seconds)


# ---------------------------------------------------------------- report


def print_set(result: dict, unit: str) -> None:
    p, b = result["prompt_tokens"], result["branch_tokens"]
    print(
        f"\n== {result['set']}: {result['steps']} steps x {result['units_per_step']:g} {unit}; prompt tokens "
        f"{p[0]}-{p[2]} (median {p[1]:.0f}), branch tokens {b[0]}-{b[2]} (median {b[1]:.0f})"
        + (f"; bound (P+C+R)/(2P+C+R) {result['bound']:.3f}" if result["bound"] else "")
    )
    print(
        f"{'layout':<24} {'tokens/step':>11} {'vs base':>7} {'s/step':>7} {'best':>7} {'wall':>7} "
        f"{unit + '/s':>8} {'x base':>6} {'x p_free':>8} {'logp rel':>9} {'loss rel':>9} {'grad rel':>9}"
    )
    for n, row in result["layouts"].items():
        free = row.get("speedup_vs_padding_free")
        c = row["check"]
        print(
            f"{n:<24} {row['tokens_per_step']:>11,.0f} {row['tokens_vs_' + result['base']]:>7.3f} "
            f"{row['seconds_per_step']:>7.3f} {row['best_seconds_per_step']:>7.3f} "
            f"{row['wall_seconds_per_step']:>7.3f} {row['units_per_second']:>8.3f} "
            f"{row['speedup_vs_' + result['base']]:>6.2f} {'' if free is None else f'{free:.2f}':>8} "
            f"{c['logp']:>9.1e} {c['loss']:>9.1e} {c['grad']:>9.1e}"
        )


def planner_goal(fill: list[dict]) -> tuple[str, bool]:
    """The planner's goal (every case within 0.5 points of free sequences) as a line, and whether it held."""
    worst = max(fill, key=lambda f: f["gap_points"])
    misses = [f for f in fill if f["gap_points"] > 0.5]
    beyond_bound = [f for f in misses if f["gap_points"] > f["least_gap_points"] + 0.3]
    text = (
        f"planner: units packed whole within 0.5 points of the fill of free sequences "
        f"({len(fill) - len(misses)} of {len(fill)} cases; worst {worst['gap_points']:.2f} points: "
        f"{worst['set']}, {worst['layout']}, pack size {worst['pack_size']}; "
        f"{len(beyond_bound)} cases more than 0.3 points over the least possible gap)"
    )
    return text, not misses


def fill_table(fill: list[dict], packs: int) -> dict:
    return table(
        ["set", "layout", "pack size", "alignment", "units", "unit tokens (mean)", "units over half a pack",
         "units trimmed to fit", "fill, whole units", "fill, whole units (bfd alone)", "fill, free sequences",
         "gap (points)", "gap, bfd alone (points)", "least possible gap (points)", "planning ms (CPU)",
         "planning ms, bfd alone (CPU)"],
        [[f["set"], f["layout"], f["pack_size"], f["multiple"], f["units"], f["unit_tokens_mean"],
          f["over_half"], f["trimmed_to_fit"], f["fill_units"], f["fill_units_bfd"], f["fill_free"],
          f["gap_points"], f["gap_points_bfd"], f["least_gap_points"], 1000 * f["plan_seconds"],
          1000 * f["plan_seconds_bfd"]]
         for f in fill],
        f"planner: units packed whole (plan_units: bfd, then packs drained; bfd alone beside it) vs the "
        f"same tokens as free sequences aligned alike, about {packs} packs each",
    )  # fmt: skip


def set_table(result: dict, rounds: int, clock: str) -> dict:
    base = result["base"]
    columns = [
        "layout",
        "tokens / step",
        f"tokens vs {base}",
        f"s / step ({clock}, median)",
        f"s / step ({clock}, best)",
        "units / s",
        f"x {base}",
        "x padding_free",
        "logp rel. diff",
        "loss rel. diff",
        "grad rel. diff",
    ]
    rows = [
        [
            n,
            row["tokens_per_step"],
            row["tokens_vs_" + base],
            row["seconds_per_step"],
            row["best_seconds_per_step"],
            row["units_per_second"],
            row["speedup_vs_" + base],
            row.get("speedup_vs_padding_free"),
            row["check"]["logp"],
            row["check"]["loss"],
            row["check"]["grad"],
        ]
        for n, row in result["layouts"].items()
    ]
    p, b = result["prompt_tokens"], result["branch_tokens"]
    title = (
        f"{result['set']}: {result['steps']} steps of {result['units_per_step']:g}, prompts {p[0]}-{p[2]} "
        f"tokens (median {p[1]:.0f}), branches {b[0]}-{b[2]} (median {b[1]:.0f})"
        + (f"; (P+C+R)/(2P+C+R) = {result['bound']:.3f}" if result["bound"] else "")
        + f"; {rounds} interleaved rounds"
    )
    return table(columns, rows, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-pairs-per-step", type=int, default=8)
    parser.add_argument("--demo-max-length", type=int, default=1024, help="TRL's default max_length")
    parser.add_argument("--pairs-per-step", type=int, default=2, help="long-prompt pairs per step")
    parser.add_argument("--groups-per-step", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per set (quick 3, full 8)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (quick 3, full 5)")
    parser.add_argument("--prompt-min", type=int, default=1024)
    parser.add_argument("--prompt-max", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=None, help="(quick 64, full 128)")
    parser.add_argument("--layers", type=int, default=None, help="(quick 2, full 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 times steps in CPU time")
    parser.add_argument("--plan-units", type=int, default=None, help="demo pairs for the planner check")
    parser.add_argument("--plan-packs", type=int, default=None, help="packs the planner check fills")
    parser.add_argument("--sdpa-mask", action="store_true", help="time 'padded pairs, sdpa mask' too")
    parser.add_argument(
        "--only-planner", action="store_true", help="the planner fill check only: no model, no result written"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "preference")
    args = parser.parse_args()
    size = choose_size(
        args,
        quick={"steps": 3, "rounds": 3, "hidden": 64, "layers": 2, "plan_units": 512, "plan_packs": 300},
        full={"steps": 8, "rounds": 5, "hidden": 128, "layers": 2, "plan_units": 2048, "plan_packs": 1000},
    )
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    clock = "cpu" if args.threads == 1 else "wall"
    rng = np.random.default_rng(args.seed)

    rows = [row for chunk in default_corpus().read(0, 8192) for row in chunk.parsed_rows()]
    tokenizer = small_tokenizer(rows[:4096])
    pairs_encoder = PreferenceEncoder(tokenizer, "preference")
    groups_encoder = PreferenceEncoder(tokenizer, "groups")
    talks = demo_conversations(rows)
    replies = Replies(talks)

    # (a) demo pairs; the timed steps take the first ones
    picked = rng.permutation(len(talks))[: max(args.plan_units, args.steps * args.demo_pairs_per_step)]
    demo, demo_trimmed = cap_sequences(
        encode(pairs_encoder, demo_pairs(talks, replies, picked, rng)), args.demo_max_length
    )
    # (b), (c): long prompts answered by short demo pairs
    answer_tokens = demo.branch_lengths[demo.branch_index == 0]
    short = [int(c) for c, n in zip(picked, answer_tokens, strict=True) if n <= SHORT_ANSWER]
    text = LongText(tokenizer, rows, pairs_encoder)
    long_count = max(args.plan_units // 4, args.steps * args.pairs_per_step)
    group_count = max(args.plan_units // 8, args.steps * args.groups_per_step)
    long_units = encode(pairs_encoder, long_rows(long_count, args, talks, replies, short, text, rng))
    group_rows = long_rows(group_count, args, talks, replies, short, text, rng, group=args.group_size)
    group_units = encode(groups_encoder, group_rows)
    data = {
        "demo pairs": demo,
        "long-prompt pairs": long_units,
        f"long-prompt groups of {args.group_size}": group_units,
    }
    print(f"data ({time.perf_counter() - started:.0f} s; {demo_trimmed} demo prompts trimmed to fit "
          f"{args.demo_max_length}-token sequences):")  # fmt: skip
    for name, units in data.items():
        p, b = units.prompt_lengths, units.branch_lengths
        print(f"  {name}: {len(units)} units, prompts {p.min()}-{p.max()} tokens (median "
              f"{np.median(p):.0f}), branches {b.min()}-{b.max()} (median {np.median(b):.0f})")  # fmt: skip

    # the planner: units whole against free sequences
    fill = []
    for name, units in data.items():
        sizes = PACK_SIZES["demo pairs" if name == "demo pairs" else "long"]
        fill += planner_fill(name, units, sizes, args.plan_packs, args.seed)
    print("\n== planner: fill of the units packed whole (plan_units; bfd alone beside it) vs the same tokens "
          "as free sequences, aligned alike; planning ms (CPU, best of 3)")  # fmt: skip
    print(f"{'set':<26} {'layout':<14} {'pack':>6} {'align':>5} {'units':>6} {'unit':>7} {'>half':>6} "
          f"{'trim':>5} {'whole':>7} {'bfd':>7} {'free':>7} {'gap':>6} {'bfd':>6} {'least':>6} {'ms':>6} "
          f"{'bfd ms':>6}")  # fmt: skip
    for f in fill:
        print(f"{f['set']:<26} {f['layout']:<14} {f['pack_size']:>6} {f['multiple']:>5} {f['units']:>6} "
              f"{f['unit_tokens_mean']:>7.0f} {f['over_half']:>6.1%} {f['trimmed_to_fit']:>5} "
              f"{f['fill_units']:>7.2%} {f['fill_units_bfd']:>7.2%} {f['fill_free']:>7.2%} "
              f"{f['gap_points']:>6.2f} {f['gap_points_bfd']:>6.2f} {f['least_gap_points']:>6.2f} "
              f"{1000 * f['plan_seconds']:>6.1f} {1000 * f['plan_seconds_bfd']:>6.1f}")  # fmt: skip
    fill_goal, fill_held = planner_goal(fill)
    if args.only_planner:
        print(f"\ngoal:\n  [{'PASS' if fill_held else 'FAIL'}] {fill_goal}")
        print(f"({time.perf_counter() - started:.0f} s; --only-planner writes no result)")
        return

    # the models and the steps
    policy = tiny_llama(tokenizer.vocab_size, seed=args.seed, hidden=args.hidden, layers=args.layers)
    reference = tiny_llama(tokenizer.vocab_size, seed=args.seed + 1, hidden=args.hidden, layers=args.layers)
    models = (policy, reference.eval())
    model_text = (
        f"Llama hidden {args.hidden}, {args.layers} layers, 4 heads (2 key-value), vocab "
        f"{tokenizer.vocab_size}, float32, block-structured SDPA, {torch.get_num_threads()} thread(s); "
        f"step time in {'CPU seconds of the thread' if clock == 'cpu' else 'wall seconds'}"
    )
    print(f"\nmodel: {model_text}")
    per_token = scaling(models, tokenizer.vocab_size, 3, args.seed, clock)
    print("compute-bound check, ms per token on rows of 1,024-token sequences: "
          + ", ".join(f"{k} tokens {v:.3f}" for k, v in per_token.items()))  # fmt: skip

    def split(units: PreferenceUnits, per_step: int) -> list[PreferenceUnits]:
        return [units.select(np.arange(k * per_step, (k + 1) * per_step)) for k in range(args.steps)]

    per_step = (args.demo_pairs_per_step, args.pairs_per_step, args.groups_per_step)
    results = [
        measure(name, split(units, n), models, args.rounds, name.startswith("long-prompt groups"),
                args.sdpa_mask, clock)
        for (name, units), n in zip(data.items(), per_step, strict=True)
    ]  # fmt: skip
    for result, unit in zip(results, ("pairs", "pairs", "groups"), strict=True):
        print_set(result, unit)

    long, groups = results[1], results[2]
    shared = long["layouts"]["tightpack shared-prefix"]
    bound = long["bound"]
    token_share = shared["tokens_vs_padded pairs"]
    vs_padded, vs_free = shared["speedup_vs_padded pairs"], shared["speedup_vs_padding_free"]
    worst_padded = min(shared["round_speedups_vs_padded pairs"])
    worst_free = min(shared["round_speedups_vs_padding_free"])
    group = groups["layouts"]["shared-prefix"]
    vs_separate = group["speedup_vs_separate sequences"]
    worst_separate = min(group["round_speedups_vs_separate sequences"])
    largest = {
        k: max(row["check"][k] for r in results for row in r["layouts"].values())
        for k in ("logp", "loss", "grad")
    }
    worst_gap = max(fill, key=lambda f: f["gap_points"])
    goals = {
        f"long prompts: shared-prefix computes {token_share:.3f} of padded pairs' tokens, <= "
        f"(P+C+R)/(2P+C+R) = {bound:.3f}": bool(token_share <= bound),
        f"long prompts: shared-prefix pairs/s {vs_padded:.2f}x padded pairs (median round; worst round "
        f"{worst_padded:.2f}x) >= 1.6x": bool(vs_padded >= 1.6),
        f"long prompts: shared-prefix pairs/s {vs_free:.2f}x padding_free (worst round {worst_free:.2f}x) "
        ">= 1.3x": bool(vs_free >= 1.3),
        f"G={args.group_size} groups: shared-prefix steps {vs_separate:.2f}x as fast as separate sequences "
        f"(worst round {worst_separate:.2f}x) >= 2x": bool(vs_separate >= 2.0),
        f"equal loss: every layout within float32 of the sequences run alone (relative: per-branch "
        f"log-prob {largest['logp']:.1e}, loss {largest['loss']:.1e}, gradient {largest['grad']:.1e})": True,
        fill_goal: fill_held,
    }
    print("\ngoals:")
    for goal, held in goals.items():
        print(f"  [{'PASS' if held else 'FAIL'}] {goal}")

    keys = ("demo_pairs", "long_pairs", "long_groups")
    tables = {key: set_table(result, args.rounds, clock) for key, result in zip(keys, results, strict=True)}
    tables["planner_fill"] = fill_table(fill, args.plan_packs)
    tables["compute_bound"] = table(
        ["row tokens", f"ms / token ({clock}, best of 3)"],
        [[int(k), v] for k, v in per_token.items()],
        "compute-bound check: one step on rows of 1,024-token sequences",
    )
    lp = long["prompt_tokens"]
    figures = {
        "model": model_text,
        "long prompts (timed steps)": f"{lp[0]}-{lp[2]} tokens, median {lp[1]:.0f}",
        "long prompts: shared-prefix tokens / padded pairs tokens": token_share,
        "long prompts: bound (P+C+R)/(2P+C+R)": bound,
        "long prompts: shared-prefix pairs/s vs padded pairs": vs_padded,
        "long prompts: shared-prefix pairs/s vs padding_free": vs_free,
        f"G={args.group_size} groups: shared-prefix step-time ratio vs separate sequences": vs_separate,
        "largest relative difference from the sequences run alone (log-prob / loss / gradient)": (
            f"{largest['logp']:.1e} / {largest['loss']:.1e} / {largest['grad']:.1e}"
        ),
        "largest planner fill gap (points)": worst_gap["gap_points"],
    } | {f"goal: {goal}": held for goal, held in goals.items()}
    write_result(
        "preference",
        args,
        size,
        figures=figures,
        tables=tables,
        report={
            "sets": results,
            "planner_fill": fill,
            "ms_per_token": per_token,
            "clock": clock,
            "goals": goals,
        },
        seconds=time.perf_counter() - started,
    )


if __name__ == "__main__":
    main()
