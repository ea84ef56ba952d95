"""Preference packing: padded pairs, TRL's ``padding_free`` and tightpack's two layouts, per step.

A tiny Llama (random init, float32, sdpa, ``--hidden`` 256, ``--layers`` 4) as the policy and another
as the reference. Every layout gets the same pairs (or groups) per step and computes the same thing:
every branch's summed log-probability from the policy (forward and backward) and from the reference
(forward under ``no_grad``), feeding the same loss (sigmoid DPO, beta 0.1, for pairs; an
advantage-weighted loss on ``policy - reference`` for groups). Layouts:

- ``padded pairs`` (TRL's default batching): the step's chosen and rejected sequences along the batch
  dimension, right-padded to the longest, with a 2-D ``attention_mask``; log-probabilities per row;
- ``padding_free`` (TRL's layout, reproduced): the step's ``prompt + chosen`` then ``prompt + rejected``
  sequences flattened into one row, ``position_ids`` restarting per sequence, no mask (transformers
  finds the sequences from the positions). At equal pairs per step these are the tokens of tightpack
  ``pairs`` in another order;
- ``tightpack pairs`` and ``tightpack shared-prefix``: `build_preference_row` and `preference_logps`.

For groups of G completions: ``separate sequences`` (tightpack ``pairs``: every completion its own
sequence with its prompt) against ``shared-prefix``.

Data: (a) the demo corpus's pairs (tests/preference_data.py ``conversation_pairs``); (b) long
prompts: a user message made of demo conversation turns, ``--prompt-min`` to ``--prompt-max`` tokens,
answers of 10 to 60 tokens cut from demo replies (numpy ``default_rng(seed)``); (c) groups of
``--group-size`` completions of the same long prompts. Tokenizer: a 1,024-token byte-level BPE trained
on the corpus (tests/hf_training.py ``small_tokenizer``), rows encoded by `PreferenceEncoder`.

Measured per layout: computed tokens per step (padding included), the floor any layout pays (the
prompt once plus every branch: shared-prefix less G - 1 per unit), step time (the fastest of
``--rounds`` interleaved rounds after a warm-up step), pairs (or groups) per second, ratios against
padded pairs and padding_free, and the largest difference of the per-branch log-probabilities and of
the loss against padded pairs (asserted < 1e-3).

Quick: prompts 512-1k tokens, 1 step, 1 round (about 3 minutes on 2 shared cores); ``--full``: prompts
1k-8k, 2 steps, 3 rounds.

    .venv/bin/python benchmarks/bench_preference.py [--full] [--pairs-per-step 2] [--out bench-out]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_training import small_tokenizer, tiny_llama
from tests.preference_data import conversation_pairs, conversations

from results import add_size_options, choose_size, table, write_result
from tightpack.core.preference_units import PreferenceUnits
from tightpack.prepare.preference_rows import PreferenceEncoder
from tightpack.prepare.sources import default_corpus
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_hf import preference_logps

BETA = 0.1
TOLERANCE = 1e-3


# ---------------------------------------------------------------- data


def long_prompt_rows(count: int, low: int, high: int, seed: int, chars_per_token: float) -> list[dict]:
    """``count`` pairs whose user message is demo turns concatenated to about ``low``-``high`` tokens,
    with answers of 10-60 tokens cut from demo replies (deterministic)."""
    rng = np.random.default_rng(seed)
    talks = conversations(400)
    turns = [m["content"] for talk in talks for m in talk if m["content"]]
    replies = [talk[1]["content"] for talk in talks]
    rows = []
    for _ in range(count):
        target = int(rng.integers(low, high + 1) * chars_per_token)
        parts, size = [], 0
        while size < target:
            text = turns[int(rng.integers(len(turns)))]
            parts.append(text)
            size += len(text) + 2
        message = ("\n\n".join(parts))[:target]

        def answer() -> str:
            length = int(rng.integers(10, 61) * chars_per_token)
            text = replies[int(rng.integers(len(replies)))]
            while len(text) < length:
                text += " " + replies[int(rng.integers(len(replies)))]
            return text[:length]

        chosen, rejected = answer(), answer()
        while rejected == chosen:
            rejected = answer()
        rows.append(
            {
                "prompt": [{"role": "user", "content": message}],
                "chosen": chosen,
                "rejected": rejected,
                "answers": [chosen, rejected],
            }
        )
    return rows


def encode(encoder: PreferenceEncoder, rows: list[dict]) -> PreferenceUnits:
    result = encoder.encode_rows(rows)
    if result.bad_rows:
        raise SystemExit(f"bad rows: {result.bad_rows[:3]}")
    return result.units


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


def trl_order(units: PreferenceUnits) -> np.ndarray:
    """TRL's order of a step's sequences: every chosen, then every rejected (branch indices)."""
    return np.concatenate([np.flatnonzero(units.branch_index == k) for k in range(2)])


def padded_batch(seqs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    attention = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    for row, (tokens, mask) in enumerate(seqs):
        n = len(tokens)
        ids[row, :n] = torch.from_numpy(tokens)
        attention[row, :n] = 1
        target = torch.from_numpy(tokens[1:]).long()
        labels[row, : n - 1] = torch.where(torch.from_numpy(mask[1:] > 0), target, -100)
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def padding_free_batch(seqs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    ids, positions, labels, which = [], [], [], []
    for k, (tokens, mask) in enumerate(seqs):
        n = len(tokens)
        ids.append(tokens)
        positions.append(np.arange(n))
        label = np.full(n, -100, np.int64)
        label[: n - 1] = np.where(mask[1:] > 0, tokens[1:], -100)
        labels.append(label)
        which.append(np.full(n, k))
    return {
        "input_ids": torch.from_numpy(np.concatenate(ids)).long()[None],
        "position_ids": torch.from_numpy(np.concatenate(positions)).long()[None],
        "labels": torch.from_numpy(np.concatenate(labels))[None],
        "sequence": torch.from_numpy(np.concatenate(which)),
    }


def row_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed target log-probabilities per row of ``labels`` ``[B, L]`` (-100 ignored)."""
    trained = labels != -100
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return (logp * trained).sum(-1)


def padded_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return row_logps(out.logits, batch["labels"])


def padding_free_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    labels = batch["labels"][0]
    trained = labels != -100
    logp = torch.log_softmax(out.logits[0].float(), -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    count = int(batch["sequence"].max()) + 1
    return torch.zeros(count, dtype=logp.dtype).index_add(0, batch["sequence"][trained], logp[trained])


def pair_loss(policy: torch.Tensor, reference: torch.Tensor, chosen: np.ndarray, rejected: np.ndarray):
    margin = (policy[chosen] - policy[rejected]) - (reference[chosen] - reference[rejected])
    return -torch.nn.functional.logsigmoid(BETA * margin).mean()


def group_loss(policy: torch.Tensor, reference: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    return -(advantages * (policy - reference)).mean()


class Layout:
    """One layout of one step: its prepared batch, how many tokens it computes, how to run it, and
    where every branch (in unit order) sits in its output."""

    def __init__(self, name: str, batch: dict, tokens: int, run, position: np.ndarray):
        self.name, self.batch, self.tokens, self.run, self.position = name, batch, tokens, run, position


def step_layouts(units: PreferenceUnits, groups: bool) -> list[Layout]:
    seqs = sequences(units)
    identity = np.arange(len(seqs))
    layouts = []
    if not groups:
        order = trl_order(units)
        where = np.argsort(order)  # branch b sits at where[b] in TRL's order
        padded = padded_batch([seqs[i] for i in order])
        layouts.append(Layout("padded pairs", padded, int(padded["input_ids"].numel()), padded_logps, where))
        free = padding_free_batch([seqs[i] for i in order])
        layouts.append(
            Layout("padding_free", free, int(free["input_ids"].numel()), padding_free_logps, where)
        )
    for layout in ("pairs", "shared-prefix"):
        row = build_preference_row(units, layout)
        name = (
            ("separate sequences" if layout == "pairs" else "shared-prefix")
            if groups
            else f"tightpack {layout}"
        )
        layouts.append(
            Layout(
                name, row, int(row["input_ids"].numel()), lambda m, b: preference_logps(m, b).sums, identity
            )
        )
    return layouts


def run_step(layout: Layout, policy, reference, loss_of) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One step: policy forward + backward, reference forward under no_grad. Returns the per-branch
    policy log-probabilities (unit order), the loss and the seconds."""
    policy.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.no_grad():
        ref = layout.run(reference, layout.batch)
    logps = layout.run(policy, layout.batch)
    loss = loss_of(logps[layout.position], ref[layout.position])
    loss.backward()
    seconds = time.perf_counter() - start
    return logps[layout.position].detach(), loss.detach(), seconds


def measure(name: str, steps: list[PreferenceUnits], policy, reference, rounds: int, groups: bool) -> dict:
    """Every layout on the same steps: tokens, floor, fastest round's time, and the agreement."""
    prepared = [step_layouts(units, groups) for units in steps]
    names = [layout.name for layout in prepared[0]]

    def loss_for(units: PreferenceUnits):
        if groups:
            rewards = torch.from_numpy(units.rewards).float()
            size = int(units.branches_per_unit[0])
            advantages = (rewards.view(-1, size) - rewards.view(-1, size).mean(1, keepdim=True)).reshape(-1)
            return lambda p, r: group_loss(p, r, advantages)
        chosen, rejected = np.flatnonzero(units.branch_index == 0), np.flatnonzero(units.branch_index == 1)
        return lambda p, r: pair_loss(p, r, chosen, rejected)

    losses = [loss_for(units) for units in steps]
    for layouts, loss_of in zip(prepared, losses, strict=True):  # warm-up, and the figures to compare
        for layout in layouts:
            layout.logps, layout.loss, _ = run_step(layout, policy, reference, loss_of)
    seconds = {n: float("inf") for n in names}
    for _ in range(rounds):
        for k, n in enumerate(names):
            total = sum(
                run_step(layouts[k], policy, reference, loss_of)[2]
                for layouts, loss_of in zip(prepared, losses, strict=True)
            )
            seconds[n] = min(seconds[n], total / len(steps))
    units_per_step = float(np.mean([len(u) for u in steps]))
    floor = float(np.mean([u.prompt_lengths.sum() + u.branch_lengths.sum() for u in steps]))
    base = names[0]
    rows = {}
    for k, n in enumerate(names):
        logp_diff = max(float((layouts[k].logps - layouts[0].logps).abs().max()) for layouts in prepared)
        loss_diff = max(float((layouts[k].loss - layouts[0].loss).abs()) for layouts in prepared)
        tokens = float(np.mean([layouts[k].tokens for layouts in prepared]))
        rows[n] = {
            "tokens_per_step": tokens,
            "seconds_per_step": seconds[n],
            "units_per_second": units_per_step / seconds[n],
            "max_logp_difference": logp_diff,
            "max_loss_difference": loss_diff,
        }
        if logp_diff >= TOLERANCE or loss_diff >= TOLERANCE:
            raise SystemExit(
                f"{name}: {n} differs from {base}: log-probs {logp_diff:.2e}, loss {loss_diff:.2e}"
            )
    for row in rows.values():
        row["speedup_vs_" + base] = seconds[base] / row["seconds_per_step"]
        row["tokens_vs_" + base] = row["tokens_per_step"] / rows[base]["tokens_per_step"]
        if "padding_free" in rows:
            row["speedup_vs_padding_free"] = seconds["padding_free"] / row["seconds_per_step"]
    prompts = np.concatenate([u.prompt_lengths for u in steps])
    branches = np.concatenate([u.branch_lengths for u in steps])
    return {
        "set": name,
        "steps": len(steps),
        "units_per_step": units_per_step,
        "floor_tokens_per_step": floor,
        "prompt_tokens": [int(prompts.min()), float(prompts.mean()), int(prompts.max())],
        "branch_tokens": [int(branches.min()), float(branches.mean()), int(branches.max())],
        "prompt_plus_branches": int(prompts.sum() + branches.sum()),
        "layouts": rows,
        "base": base,
    }


def print_set(result: dict, unit: str) -> None:
    p, b = result["prompt_tokens"], result["branch_tokens"]
    print(
        f"\n== {result['set']}: {result['steps']} steps x {result['units_per_step']:g} {unit}; prompt tokens "
        f"{p[0]}-{p[2]} (mean {p[1]:.0f}), branch tokens {b[0]}-{b[2]} (mean {b[1]:.0f}); floor "
        f"{result['floor_tokens_per_step']:,.0f} tokens/step"
    )
    print(
        f"{'layout':<24} {'tokens/step':>11} {'vs base':>7} {'s/step':>7} {unit + '/s':>8} {'x base':>6} "
        f"{'x p_free':>8} {'max |dlogp|':>11} {'|dloss|':>8}"
    )
    for n, row in result["layouts"].items():
        free = row.get("speedup_vs_padding_free")
        print(
            f"{n:<24} {row['tokens_per_step']:>11,.0f} {row['tokens_vs_' + result['base']]:>7.3f} "
            f"{row['seconds_per_step']:>7.3f} {row['units_per_second']:>8.2f} "
            f"{row['speedup_vs_' + result['base']]:>6.2f} {'' if free is None else f'{free:.2f}':>8} "
            f"{row['max_logp_difference']:>11.2e} {row['max_loss_difference']:>8.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs-per-step", type=int, default=None, help="pairs per step (quick 2, full 2)")
    parser.add_argument("--groups-per-step", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="steps per set (quick 1, full 2)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up")
    parser.add_argument(
        "--prompt-min", type=int, default=None, help="long prompts' tokens (quick 512, full 1024)"
    )
    parser.add_argument("--prompt-max", type=int, default=None, help="(quick 1024, full 8192)")
    parser.add_argument("--demo-pairs-per-step", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(parser, "preference")
    args = parser.parse_args()
    size = choose_size(
        args,
        quick={"pairs_per_step": 2, "steps": 1, "rounds": 1, "prompt_min": 512, "prompt_max": 1024},
        full={"pairs_per_step": 2, "steps": 2, "rounds": 3, "prompt_min": 1024, "prompt_max": 8192},
    )
    started = time.perf_counter()
    torch.set_num_threads(args.threads)

    rows = [row for chunk in default_corpus().read(0, 4096) for row in chunk.parsed_rows()]
    tokenizer = small_tokenizer(rows)
    pairs_encoder = PreferenceEncoder(tokenizer, "preference")
    groups_encoder = PreferenceEncoder(tokenizer, "groups")
    sample = rows[0]["messages"][0]["content"] * 4
    probe = encode(pairs_encoder, [{"prompt": sample, "chosen": " a", "rejected": " b"}])
    chars_per_token = len(sample) / max(1, int(probe.prompt_lengths[0]) - 2)

    demo = encode(pairs_encoder, conversation_pairs(args.steps * args.demo_pairs_per_step))
    long_rows = long_prompt_rows(
        args.steps * args.pairs_per_step, args.prompt_min, args.prompt_max, args.seed, chars_per_token
    )
    long_units = encode(
        pairs_encoder, [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in long_rows]
    )
    group_rows = long_prompt_rows(
        args.steps * args.groups_per_step, args.prompt_min, args.prompt_max, args.seed + 1, chars_per_token
    )
    rng = np.random.default_rng(args.seed + 2)
    spares = [
        a
        for r in long_prompt_rows(4 * args.group_size, 8, 8, args.seed + 3, chars_per_token)
        for a in r["answers"]
    ]
    grouped_rows = []
    for r in group_rows:
        extra = [spares[int(i)] for i in rng.choice(len(spares), args.group_size - 2, replace=False)]
        completions = r["answers"] + extra
        grouped_rows.append(
            {
                "prompt": r["prompt"],
                "completions": completions,
                "rewards": [float(x) for x in rng.random(args.group_size)],
            }
        )
    group_units = encode(groups_encoder, grouped_rows)

    def split(units: PreferenceUnits, per_step: int) -> list[PreferenceUnits]:
        return [units.select(np.arange(k * per_step, (k + 1) * per_step)) for k in range(args.steps)]

    policy = tiny_llama(tokenizer.vocab_size, seed=args.seed, hidden=args.hidden, layers=args.layers)
    reference = tiny_llama(
        tokenizer.vocab_size, seed=args.seed + 1, hidden=args.hidden, layers=args.layers
    ).eval()
    model_text = (
        f"Llama hidden {args.hidden}, {args.layers} layers, vocab {tokenizer.vocab_size}, float32, "
        f"sdpa; {torch.get_num_threads()} threads"
    )
    print(
        f"tokenizer: {tokenizer.name if hasattr(tokenizer, 'name') else 'byte-level BPE 1024'}; {model_text}"
    )
    results = [
        measure("demo pairs", split(demo, args.demo_pairs_per_step), policy, reference, args.rounds, False),
        measure(
            "long-prompt pairs", split(long_units, args.pairs_per_step), policy, reference, args.rounds, False
        ),
        measure(
            f"long-prompt groups of {args.group_size}",
            split(group_units, args.groups_per_step),
            policy,
            reference,
            args.rounds,
            True,
        ),
    ]
    for result, unit in zip(results, ("pairs", "pairs", "groups"), strict=True):
        print_set(result, unit)
    print(
        "\n(padding_free and tightpack pairs compute the same tokens at equal pairs per step: TRL's "
        "padding_free layout is tightpack's pairs layout in TRL's order)"
    )

    long = results[1]
    lp = long["layouts"]
    bound = (long_units.prompt_lengths.sum() + long_units.branch_lengths.sum()) / (
        2 * long_units.prompt_lengths.sum() + long_units.branch_lengths.sum()
    )
    token_share = lp["tightpack shared-prefix"]["tokens_vs_padded pairs"]
    vs_padded = lp["tightpack shared-prefix"]["speedup_vs_padded pairs"]
    vs_free = lp["tightpack shared-prefix"]["speedup_vs_padding_free"]
    group = results[2]["layouts"]
    vs_separate = group["shared-prefix"]["speedup_vs_separate sequences"]
    goals = {}
    goals[
        f"long prompts: shared-prefix tokens {token_share:.3f} of padded <= (P+C+R)/(2P+C+R) = {bound:.3f}"
    ] = bool(token_share <= bound)
    goals[f"long prompts: shared-prefix pairs/s {vs_padded:.2f}x padded pairs >= 1.6x"] = bool(
        vs_padded >= 1.6
    )
    goals[f"long prompts: shared-prefix pairs/s {vs_free:.2f}x padding_free >= 1.3x"] = bool(vs_free >= 1.3)
    goals[f"G={args.group_size} groups: shared-prefix {vs_separate:.2f}x faster than separate >= 2x"] = bool(
        vs_separate >= 2.0
    )
    print("\ngoals:")
    for text, held in goals.items():
        print(f"  [{'holds' if held else 'MISSED'}] {text}")

    tables = {}
    for result, key in zip(results, ("demo_pairs", "long_pairs", "long_groups"), strict=True):
        base = result["base"]
        columns = [
            "layout",
            "tokens / step",
            f"tokens vs {base}",
            "s / step",
            "units / s",
            f"x {base}",
            "x padding_free",
            "max |d logp|",
            "|d loss|",
        ]
        table_rows = [
            [
                n,
                row["tokens_per_step"],
                row["tokens_vs_" + base],
                row["seconds_per_step"],
                row["units_per_second"],
                row["speedup_vs_" + base],
                row.get("speedup_vs_padding_free"),
                row["max_logp_difference"],
                row["max_loss_difference"],
            ]
            for n, row in result["layouts"].items()
        ]
        p = result["prompt_tokens"]
        title = (
            f"{result['set']}: {result['units_per_step']:g} per step, prompts {p[0]}-{p[2]} tokens, floor "
            f"{result['floor_tokens_per_step']:,.0f} tokens/step"
        )
        tables[key] = table(columns, table_rows, title)
    figures = {
        "tokenizer": "byte-level BPE 1024 trained on the demo corpus",
        "model": model_text,
        "long prompts: shared-prefix tokens / padded pairs tokens": token_share,
        "long prompts: bound (P+C+R)/(2P+C+R)": float(bound),
        "long prompts: shared-prefix pairs/s vs padded pairs": vs_padded,
        "long prompts: shared-prefix pairs/s vs padding_free": vs_free,
        f"G={args.group_size} groups: shared-prefix speedup vs separate sequences": vs_separate,
        "largest per-branch log-prob difference (float32)": max(
            row["max_logp_difference"] for r in results for row in r["layouts"].values()
        ),
    } | {f"goal: {text}": held for text, held in goals.items()}
    write_result(
        "preference",
        args,
        size,
        figures=figures,
        tables=tables,
        report={"sets": results, "goals": goals},
        seconds=time.perf_counter() - started,
    )


if __name__ == "__main__":
    main()
