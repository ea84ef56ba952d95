"""Long samples: trim the prompt, keep the answer (issue 11 §1). The rule on segments, then whole runs."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.truncation import ANSWER, KEEP, PROMPT, REASONS, ROUNDS_KEPT, keep_ranges
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import MANIFEST_NAME, PackConfig, pack_dataset
from tightpack.prepare.formats import FormatConfig

from .conftest import write_jsonl
from .test_pipeline import expected_sample, read_sequences


def test_fields_share_the_cut_as_the_reference_then_the_end_goes():
    # Two truncation fields of 5 and 4 tokens, a fixed literal of 1, an answer of 3: 13 tokens, limit 8.
    # The reference's shares of 5: 3 for the first field, 2 for the second; both have enough.
    starts, kinds, units = [0, 5, 6, 10], [PROMPT, KEEP, PROMPT, ANSWER], [-1] * 4
    assert keep_ranges(13, starts, kinds, units, 8, "right") == ([(0, 2), (5, 8), (10, 13)], 0)
    assert keep_ranges(13, starts, kinds, units, 8, "left") == ([(3, 6), (8, 13)], 0)
    # Limit 3: both fields are emptied (9 tokens), then the answer loses its end; the literal stays.
    assert keep_ranges(13, starts, kinds, units, 3, "right") == ([(5, 6), (10, 12)], 2)


def test_rounds_go_oldest_first_then_user_text_then_the_answer_end():
    # system 2 | round 0: user 3, answer 2 | round 1: user 3, answer 2 | round 2: user 4, answer 2; EOS 1.
    starts = [0, 2, 5, 7, 10, 12, 16, 18]
    kinds = [KEEP, PROMPT, ANSWER, PROMPT, ANSWER, PROMPT, ANSWER, KEEP]
    units = [-1, 0, 0, 1, 1, 2, 2, -1]
    n = 19
    assert keep_ranges(n, starts, kinds, units, 14, "right") == ([(0, 2), (7, 19)], 1)
    assert keep_ranges(n, starts, kinds, units, 9, "right") == ([(0, 2), (12, 19)], 1)
    # the last round is never dropped: its user text is trimmed (still "turns dropped": rounds went)
    assert keep_ranges(n, starts, kinds, units, 7, "right") == ([(0, 2), (12, 14), (16, 19)], 1)
    # the EOS is the answer's: cutting it is an answer cut, even with the answer's text whole
    assert keep_ranges(n, starts, kinds, units, 4, "right") == ([(0, 2), (16, 18)], 2)
    assert keep_ranges(n, starts, kinds, units, 3, "right") == ([(0, 2), (16, 17)], 2)
    # no structure: the end is cut
    assert keep_ranges(n, [], [], [], 7, "right") == ([(0, 7)], 3)


def test_a_field_shorter_than_its_share_passes_the_rest_to_the_other_fields():
    """The issue's case: fields of 2 and 10 tokens, an answer of 8, a limit of 10. The shares are 5
    and 5; the short field gives its 2 and the long one the other 8: the answer stays whole (it lost 5
    tokens before, and the reason said answer cut)."""
    starts, kinds, units = [0, 2, 12], [PROMPT, PROMPT, ANSWER], [-1] * 3
    assert keep_ranges(20, starts, kinds, units, 10, "right") == ([(2, 4), (12, 20)], 0)
    assert keep_ranges(20, starts, kinds, units, 10, "left") == ([(10, 20)], 0)
    # the same in chat: a round with a user turn of 2 tokens and a tool turn of 10, then the answer
    starts = [0, 1, 3, 4, 14, 15, 23]
    kinds = [KEEP, PROMPT, KEEP, PROMPT, KEEP, ANSWER, KEEP]
    units = [-1, 0, 0, 0, 0, 0, -1]
    assert keep_ranges(24, starts, kinds, units, 14, "right") == ([(0, 1), (3, 6), (14, 24)], 0)


def test_the_answer_named_as_a_truncation_field_is_trimmed_after_the_prompt_fields():
    # input 6, literal 1, output 6 (a truncation field too), EOS 1; limit 8: the input gives 6 first
    starts, kinds, units = [0, 6, 7, 13], [PROMPT, KEEP, PROMPT | ANSWER, KEEP], [-1] * 4
    assert keep_ranges(14, starts, kinds, units, 8, "right") == ([(6, 14)], 0)
    # limit 5: with right the output loses its end, its EOS first (a cut answer is not taught to
    # stop); with left the literal before it goes first (left keeps the end), then the output gives 2
    # at its start and keeps its EOS
    assert keep_ranges(14, starts, kinds, units, 5, "right") == ([(6, 11)], 2)
    assert keep_ranges(14, starts, kinds, units, 5, "left") == ([(9, 14)], 2)


def _oracle(n, starts, kinds, units, limit, method):
    """keep_ranges token by token: whole rounds, oldest first; then one trimmable token at a time
    (prompt-only text, units in order, within a unit from the segment that gave least, the first of
    those); with left, in a prompt-completion sample with prompt text, the first token while it
    precedes the answer; answers that are truncation fields, the same way (with right, not the last
    answer); then the last token, one at a time. Returns the kept positions and the rounds dropped."""
    ends = [*starts[1:], n]
    kept = [set(range(start, end)) for start, end in zip(starts, ends, strict=True)]
    over = n - limit
    rounds = sorted({unit for unit in units if unit >= 0})
    dropped = set()
    for unit in rounds[:-1]:
        if over <= 0:
            break
        for segment in [s for s, u in enumerate(units) if u == unit]:
            over -= len(kept[segment])
            kept[segment] = set()
        dropped.add(unit)
    gave = [0] * len(starts)
    answers = [s for s in range(len(starts)) if kinds[s] & ANSWER and units[s] not in dropped]
    final = max(answers) if answers and method == "right" else -1
    from_start = method == "left" and answers and set(units) == {-1} and any(k & PROMPT for k in kinds)

    def trim(answer):
        nonlocal over
        order = [-1, *rounds]
        while over > 0:
            group = [
                s
                for unit in order
                for s in range(len(starts))
                if units[s] == unit
                and kinds[s] & PROMPT
                and bool(kinds[s] & ANSWER) == answer
                and kept[s]
                and s != final
            ]
            if not group:
                return
            group = [s for s in group if units[s] == units[group[0]]]
            segment = min(group, key=lambda s: (gave[s], s))
            kept[segment].remove(max(kept[segment]) if method == "right" else min(kept[segment]))
            gave[segment] += 1
            over -= 1

    trim(False)
    while over > 0 and from_start:  # left keeps the end: what precedes the answer goes
        before = [p for segment in range(min(answers)) for p in kept[segment]]
        if not before:
            break
        first = min(before)
        next(k for k in kept if first in k).remove(first)
        over -= 1
    trim(True)
    positions = sorted(set().union(*kept))
    while over > 0:
        positions.pop()
        over -= 1
    return positions, dropped


@st.composite
def _samples(draw):
    """A sample's segments: an optional system turn, rounds of (user or tool text, template text,
    answer), or prompt-completion fields; sizes from 0; a final EOS segment."""
    pieces = []  # (size, kind, unit)
    if draw(st.booleans()):  # chat
        if draw(st.booleans()):
            pieces.append((draw(st.integers(0, 4)), KEEP, -1))
        for unit in range(draw(st.integers(1, 3))):
            for _ in range(draw(st.integers(1, 3))):
                pieces.append((draw(st.integers(0, 2)), KEEP, unit))
                pieces.append((draw(st.integers(0, 12)), PROMPT, unit))
            pieces.append((draw(st.integers(0, 2)), KEEP, unit))
            pieces.append((draw(st.integers(0, 12)), ANSWER, unit))
    else:
        for _ in range(draw(st.integers(1, 4))):
            pieces.append((draw(st.integers(0, 3)), KEEP, -1))
            pieces.append((draw(st.integers(0, 12)), draw(st.sampled_from([PROMPT, KEEP])), -1))
        pieces.append((draw(st.integers(0, 12)), draw(st.sampled_from([ANSWER, ANSWER | PROMPT])), -1))
    pieces.append((1, KEEP, -1))  # the EOS
    sizes = [size for size, _, _ in pieces]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    n = sum(sizes)
    limit = draw(st.integers(1, max(1, n - 1)))
    return (
        n,
        starts,
        [k for _, k, _ in pieces],
        [u for _, _, u in pieces],
        limit,
        draw(st.sampled_from(["right", "left"])),
    )


@settings(max_examples=600, deadline=None)
@given(_samples())
def test_the_answer_loses_a_token_only_when_no_prompt_text_is_left(sample):
    n, starts, kinds, units, limit, method = sample
    if n <= limit:
        return
    ranges, reason = keep_ranges(n, starts, kinds, units, limit, method)
    positions, dropped = _oracle(n, starts, kinds, units, limit, method)
    assert [p for a, b in ranges for p in range(a, b)] == positions  # the brute force agrees
    assert all(a < b for a, b in ranges) and all(b < c for (_, b), (c, _) in itertools.pairwise(ranges))
    kept = sum(b - a for a, b in ranges)
    assert kept == limit or (dropped and kept < limit)

    ends = [*starts[1:], n]
    surviving = set(units) - dropped
    kept_set = set(positions)

    def lost(select):
        return any(
            p not in kept_set
            for s, e, k, u in zip(starts, ends, kinds, units, strict=True)
            if u in surviving and select(k)
            for p in range(s, e)
        )

    def left_over(select):
        return any(
            p in kept_set
            for s, e, k in zip(starts, ends, kinds, strict=True)
            if select(k)
            for p in range(s, e)
        )

    def prompt_only(k):
        return k & PROMPT and not k & ANSWER

    answers = [s for s, k, u in zip(starts, kinds, units, strict=True) if k & ANSWER and u in surviving]
    first_answer = min(answers, default=n)
    before_answer = [p for p in positions if p < first_answer]
    if lost(lambda k: k & ANSWER):
        assert not left_over(prompt_only), "an answer cut with prompt text left"
        prompt_completion = set(units) == {-1} and any(k & PROMPT for k in kinds)
        assert method == "right" or not prompt_completion or not before_answer, "left: text before it left"
        assert REASONS[reason] == "answer_cut"
    if lost(lambda k: k == KEEP):
        assert not left_over(prompt_only), "template text cut with trimmable text left"
        assert method == "left" or not left_over(prompt_only), "right: template cut before a field"
    keep_lost_before_answer = any(
        p not in kept_set
        for s, e, k, u in zip(starts, ends, kinds, units, strict=True)
        if k == KEEP and u in surviving
        for p in range(s, min(e, first_answer))
    )
    if method == "right" and keep_lost_before_answer:  # the prompt's template text goes last
        assert not left_over(lambda k: k & ANSWER)
    if n - 1 not in kept_set:  # the EOS went: the answer's end
        assert REASONS[reason] == "answer_cut"
    elif REASONS[reason] == "answer_cut":
        assert lost(lambda k: k & ANSWER)


def _sample(row, spec):
    tokens, mask = expected_sample(row, spec)
    return tokens, mask


def test_a_prompt_longer_than_the_cap_is_trimmed_and_the_answer_kept(tmp_path, gpt2):
    rows = [
        {"input": "context " * 400, "output": "the answer is forty two"},
        {"input": "short", "output": "fine"},
    ]
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    result = pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=64))
    counts = result.counts
    assert (counts["packed"], counts["truncated_prompt_trimmed"], counts["no_supervised"]) == (2, 1, 0)
    sequence = read_sequences(tmp_path / "out")[0]
    tokens, mask = _sample(rows[0], gpt2)
    answer = int(mask.sum())  # the answer's tokens and the EOS, all supervised
    np.testing.assert_array_equal(sequence["tokens"][-answer:], tokens[-answer:])
    np.testing.assert_array_equal(sequence["tokens"][: 65 - answer], tokens[: 65 - answer])
    assert sequence["mask"].sum() == answer and sequence["seq_len"] == 64
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["excluded"]["truncated_by_reason"]["prompt_trimmed"] == [0]


def test_left_keeps_the_end_of_the_prompt_and_none_cuts_the_end(tmp_path, gpt2):
    rows = [{"input": "alpha " + "context " * 400 + "omega", "output": "the answer"}]
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    left = PackConfig(packed_sequence_size=32, format=FormatConfig(truncation_method="left"))
    pack_dataset([source], tmp_path / "left", left)
    tokens, _ = _sample(rows[0], gpt2)
    sequence = read_sequences(tmp_path / "left")[0]
    np.testing.assert_array_equal(sequence["tokens"], tokens[-33:])
    none = PackConfig(packed_sequence_size=32, format=FormatConfig(truncate_fields=()))
    with pytest.raises(TightpackError, match=r"no sample left to pack .* 1 without supervised tokens"):
        pack_dataset([source], tmp_path / "none", none)


def test_chat_keeps_system_and_last_round_and_drops_the_oldest(tmp_path, gpt2):
    def turn(role, words):
        return {"role": role, "content": " ".join(words)}

    messages = [turn("system", ["be", "brief"])]
    for r in range(6):
        messages += [turn("user", [f"question{r}"] * 12), turn("assistant", [f"answer{r}"] * 12)]
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    result = pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=256))
    assert result.counts["truncated_turns_dropped"] == 1
    sequence = read_sequences(tmp_path / "out")[0]
    text = gpt2.backend.decode(sequence["tokens"].tolist(), skip_special_tokens=False)
    assert text.startswith("<|system|>\nbe brief\n<|user|>\n")
    assert text.endswith("answer5 " * 11 + "answer5\n<|endoftext|>")  # the last round whole, its EOS too
    assert "question0" not in text and "answer0" not in text  # the oldest round went first
    kept = [r for r in range(6) if f"question{r}" in text]
    assert kept == list(range(6 - len(kept), 6)) and len(kept) >= 2
    assert text.count("<|user|>") == len(kept) and text.count("<|assistant|>") == len(kept)


def test_chat_with_one_huge_user_turn_trims_it_and_one_huge_answer_is_cut(tmp_path, gpt2):
    rows = [
        {"messages": [{"role": "user", "content": "tell " * 500}, {"role": "assistant", "content": "done"}]},
        {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "word " * 500}]},
    ]
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    result = pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=64))
    counts = result.counts
    assert (counts["truncated_prompt_trimmed"], counts["truncated_answer_cut"]) == (1, 1)
    sequences = read_sequences(tmp_path / "out")
    first = gpt2.backend.decode(sequences[0]["tokens"].tolist(), skip_special_tokens=False)
    assert first.endswith("\n<|assistant|>\ndone\n<|endoftext|>") and first.startswith("<|user|>\ntell tell")
    second = gpt2.backend.decode(sequences[1]["tokens"].tolist(), skip_special_tokens=False)
    # the answer is too long by itself: the user text goes, then the answer loses its end (as the reference)
    assert second.startswith("<|user|>\n\n<|assistant|>\nword word") and "<|endoftext|>" not in second
    end = pack_dataset(
        [source],
        tmp_path / "end",
        PackConfig(packed_sequence_size=64, format=FormatConfig(chat_truncation="end")),
    )
    assert (end.counts["no_supervised_after_truncation"], end.counts["truncated_answer_cut"]) == (1, 1)


def test_long_prompt_corpus_keeps_every_answer(tmp_path):
    """The issue's goal: with truncate, >= 99% of samples that have an answer are packed with at
    least one supervised token, at 8,192 and 4,096. Real conversations (the demo corpus) joined into
    long multilingual prompts, each followed by a short answer."""
    from tightpack.prepare.sources import default_corpus

    conversations = [
        "\n".join(m["content"] for m in row["messages"])
        for chunk in default_corpus().read(0, 512)
        for row in chunk.parsed_rows()
    ]
    rng = np.random.default_rng(0)
    rows = []
    for i in range(200):
        picked = rng.choice(len(conversations), size=int(rng.integers(1, 60)), replace=False)
        prompt = "\n\n".join(conversations[j] for j in picked) + " — résumé 日本語 ответ"
        rows.append({"input": prompt, "output": conversations[i][:200] or "ok"})
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    for size in (8192, 4096):
        result = pack_dataset(
            [source], tmp_path / f"out{size}", PackConfig(packed_sequence_size=size, workers=2)
        )
        counts = result.counts
        assert counts["truncated"] >= 20, "the corpus has many prompts over the cap"
        with_answer = counts["samples_in"] - counts["no_supervised_in_source"]
        assert counts["packed"] >= 0.99 * with_answer
        assert counts["no_supervised_after_truncation"] == 0


def test_a_giant_line_is_cut_before_tokenizing_in_bounded_memory(tmp_path):
    """A 49 MB line costs memory in proportion to the cap, not to the line (issue: 5.3 GB before)."""
    path = tmp_path / "giant.jsonl"
    with open(path, "w") as handle:
        handle.write(json.dumps({"input": "lorem ipsum dolor " * 2_700_000, "output": "short answer"}) + "\n")
        handle.write(json.dumps({"input": "q", "output": "a"}) + "\n")
    assert path.stat().st_size > 48_000_000
    # VmHWM is this process's own peak (ru_maxrss would carry the forking pytest's peak across exec)
    script = (
        "import sys; from tightpack.cli import main; code = main(sys.argv[1:]); "
        "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]); "
        "sys.exit(code)"
    )
    env = {"TIGHTPACK_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "pack",
            str(path),
            "-o",
            str(tmp_path / "out"),
            "--pack-size",
            "4096",
            "--workers",
            "1",
            "--no-reuse",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    peak_kib = int(result.stdout.strip().splitlines()[-1])
    assert peak_kib < 500 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["counts"]["truncated_prompt_trimmed"] == 1
    assert manifest["counts"]["texts_cut_before_tokenizing"] == 1


@pytest.mark.parametrize("flag", ["--truncation-method", "--chat-truncation"])
def test_cli_refuses_an_unknown_truncation_choice(flag):
    result = subprocess.run(
        [sys.executable, "-m", "tightpack.cli", "pack", "--output", "x", "--pack-size", "8", flag, "middle"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "middle" in result.stderr and "Traceback" not in result.stderr


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_rounds_dropped_leave_what_the_template_renders_for_the_rest():
    """With a tokenizer's template, segments are found from the template's own prefixes: dropping
    the oldest round (characters standing for tokens here) leaves exactly the rendering of the
    conversation without that round, system turn kept."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tightpack.prepare.formats import render_row

    def render(messages):
        return render_jinja_template([messages], chat_template=CHATML)[0][0]

    system = {"role": "system", "content": "be brief"}
    rounds = [
        [{"role": "user", "content": f"question {r} " * 5}, {"role": "assistant", "content": f"answer {r}"}]
        for r in range(3)
    ]
    messages = [system, *rounds[0], *rounds[1], *rounds[2]]
    rendered = render_row({"messages": messages}, FormatConfig(format="chat"), CHATML, {})
    assert rendered.text == render(messages)
    starts = [start for start, _, _ in rendered.segments]
    kinds = [kind for _, kind, _ in rendered.segments]
    units = [unit for _, _, unit in rendered.segments]
    assert sorted({u for u in units if u >= 0}) == [0, 1, 2]
    kept_one = len(render([system, *rounds[1], *rounds[2]]))
    ranges, reason = keep_ranges(len(rendered.text), starts, kinds, units, kept_one, "right")
    assert reason == 1
    assert "".join(rendered.text[a:b] for a, b in ranges) == render([system, *rounds[1], *rounds[2]])
    ranges, _ = keep_ranges(len(rendered.text), starts, kinds, units, kept_one - 1, "right")
    assert "".join(rendered.text[a:b] for a, b in ranges) == render([system, *rounds[2]])


def test_pack_keeps_the_answer_when_one_field_is_short_and_names_every_answer_cut(tmp_path, gpt2):
    """Through `pack_dataset`: two truncation fields, one short. The answer is packed whole and the
    reason is prompt trimmed (before: the answer lost tokens, answer cut). A row whose prompt is
    all gone and whose EOS must go too is an answer cut (before: prompt trimmed)."""
    encode = gpt2.backend.encode

    def size(text):
        return len(encode(text).ids)

    answer = "the answer is forty two and no less"
    rows = [
        {"context": "short", "input": "word " * 200, "output": answer},
        {"context": "a", "input": "b", "output": "z" + " yes" * 40},
    ]
    config = FormatConfig(
        prompt_template="{context} | {input} {output}", truncate_fields=("context", "input")
    )
    # the second row: fields of 1 token each, literals " |", " " and the answer + EOS
    second = size("a | b " + rows[1]["output"]) + 1
    cap = second - 4  # over by 3 (limit = cap + 1): the fields give 2 tokens, then the EOS goes
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    result = pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=cap, format=config))
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["excluded"]["truncated_by_reason"]["prompt_trimmed"] == [0]
    assert manifest["excluded"]["truncated_by_reason"]["answer_cut"] == [1]
    assert (result.counts["truncated_prompt_trimmed"], result.counts["truncated_answer_cut"]) == (1, 1)
    sequences = read_sequences(tmp_path / "out")
    first, second_text = (
        gpt2.backend.decode(sequences[row]["tokens"].tolist(), skip_special_tokens=False) for row in (0, 1)
    )
    assert first.endswith(" " + answer + "<|endoftext|>")  # the answer whole, with its EOS
    assert first.startswith(" | word word")  # the short field went whole, the long one gave the rest
    assert second_text.endswith(rows[1]["output"])  # the answer's text whole, its EOS gone


# Megatron-Bridge 0.6.2 cannot run here (it and its megatron-core need Python >= 3.12; see
# docs/truncation.md), so its rule is recorded as facts: the token ranges its
# `GPTSFTDataset._multiple_truncation` keeps, worked out by hand from its code, in tightpack's layout
# (fields, literals, the label, then the EOS it appends; `max_seq_length` = the limit, EOS counted).
# The shares: `over // fields`, the first fields taking the remainder; a field short of its share
# gives what it has and the rest goes to its end cut, which with `right` walks from the label
# backwards, with `left` from the first piece forwards, and never touches the EOS.
MEGATRON_BRIDGE_CASES = {
    # name: (n, starts, kinds, limit, method, Megatron-Bridge keeps, tightpack keeps)
    "two long fields, answer whole (the same)": (
        14,
        [0, 5, 6, 10, 13],
        [PROMPT, KEEP, PROMPT, ANSWER, KEEP],
        9,
        "right",
        [(0, 2), (5, 8), (10, 14)],
        [(0, 2), (5, 8), (10, 14)],
    ),
    "a short field (issue 26)": (  # shares 5 + 5; the field of 2 leaves 3 to the label's end
        20,
        [0, 2, 12, 19],
        [PROMPT, PROMPT, ANSWER, KEEP],
        10,
        "right",
        [(2, 7), (12, 16), (19, 20)],
        [(2, 4), (12, 20)],
    ),
    "the answer alone too long, right": (  # the field gives 3; the label 5 more: it keeps the EOS
        14,
        [0, 3, 13],
        [PROMPT, ANSWER, KEEP],
        6,
        "right",
        [(3, 8), (13, 14)],
        [(3, 9)],
    ),
    "a field outside the truncation fields over the cap, left (the same)": (  # input 2, then context's start
        14,
        [0, 8, 10, 13],
        [KEEP, PROMPT, ANSWER, KEEP],
        8,
        "left",
        [(4, 8), (10, 14)],
        [(4, 8), (10, 14)],
    ),
    "the answer alone too long, left": (  # the end cut walks from the start: the label's start goes
        14,
        [0, 3, 13],
        [PROMPT, ANSWER, KEEP],
        6,
        "left",
        [(8, 14)],
        [(3, 9)],
    ),
    "the label a truncation field": (  # shares 2 + 2: the label loses 2 although the input had 6
        14,
        [0, 6, 7, 13],
        [PROMPT, KEEP, PROMPT | ANSWER, KEEP],
        10,
        "right",
        [(0, 4), (6, 11), (13, 14)],
        [(0, 2), (6, 14)],
    ),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_BRIDGE_CASES))
def test_megatron_bridge_rule_and_where_tightpack_differs(case):
    n, starts, kinds, limit, method, reference, ours = MEGATRON_BRIDGE_CASES[case]
    assert sum(b - a for a, b in reference) == limit  # the facts themselves fit the limit
    assert keep_ranges(n, starts, kinds, [-1] * len(starts), limit, method)[0] == ours
    assert (reference == ours) == case.endswith("(the same)")


def test_chat_a_short_user_turn_passes_its_share_to_the_tool_turn_of_its_round(tmp_path, gpt2):
    """Through `pack_dataset`, a chat row whose last round holds a short user turn and a long tool
    result: the tool text gives what the user turn cannot, and the answer is packed whole (before,
    the rest fell to the end cut: the answer went and the row was excluded as having no supervised
    token)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "tool", "content": "log line " * 300},
                {"role": "assistant", "content": "the build passed"},
            ]
        }
    ]
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    result = pack_dataset([source], tmp_path / "out", PackConfig(packed_sequence_size=64))
    assert (result.counts["packed"], result.counts["truncated_prompt_trimmed"]) == (1, 1)
    text = gpt2.backend.decode(
        read_sequences(tmp_path / "out")[0]["tokens"].tolist(), skip_special_tokens=False
    )
    assert text.startswith("<|user|>\n\n<|tool|>\nlog line log line")  # the user turn gave its 1 token
    assert text.endswith("<|assistant|>\nthe build passed\n<|endoftext|>")


def test_a_conversation_whose_rounds_cannot_be_dropped_is_trimmed_and_says_why():
    """Rounds marked ROUNDS_KEPT - r (a template that merges turns) are not dropped: their user text is
    trimmed, oldest round first, and the reason is turns_kept; the same rounds with their own units
    are dropped."""
    starts, kinds = [0, 1, 3, 5, 7], [KEEP, PROMPT, ANSWER, PROMPT, ANSWER]
    merged = [-1, ROUNDS_KEPT, ROUNDS_KEPT, ROUNDS_KEPT - 1, ROUNDS_KEPT - 1]
    ranges, reason = keep_ranges(9, starts, kinds, merged, 7, "right")
    assert REASONS[reason] == "turns_kept"
    assert ranges == [(0, 1), (3, 9)]  # the oldest user text goes first, both answers stay
    ranges, reason = keep_ranges(9, starts, kinds, merged, 6, "right")
    assert (ranges, REASONS[reason]) == ([(0, 1), (3, 6), (7, 9)], "turns_kept")  # then the next one
    ranges, reason = keep_ranges(9, starts, kinds, [-1, 0, 0, 1, 1], 7, "right")
    assert (ranges, REASONS[reason]) == ([(0, 1), (5, 9)], "turns_dropped")


def test_a_trimmed_answer_field_loses_its_eos_and_none_cuts_at_the_end(tmp_path, gpt2):
    """The tester's cases through ``pack_dataset``: the output named as a truncation field and cut with
    ``right`` keeps its start and no EOS (it kept a supervised EOS after the cut); with ``left`` it
    keeps its end and its EOS; ``truncate_fields=()`` with ``left`` cuts the sample at its end (it
    trimmed the prompt's start)."""
    row = {"input": "one two three four five six seven eight nine ten", "output": "alpha beta gamma delta"}
    source = write_jsonl(tmp_path / "row.jsonl", [row])
    tokens, mask = expected_sample(row, gpt2)
    answer = tokens[mask.astype(bool)].tolist()[:-1]  # the supervised tokens, less the EOS

    def packed(name, fields, method, cap):
        format = FormatConfig(truncate_fields=fields, truncation_method=method)
        config = PackConfig(packed_sequence_size=64, max_seq_length=cap, format=format)
        pack_dataset([source], tmp_path / name, config)
        return read_sequences(tmp_path / name)[0]["tokens"].tolist()

    assert packed("right", ("input", "output"), "right", 2) == answer[:3]
    assert packed("left", ("input", "output"), "left", 2) == [*answer[-2:], gpt2.eos_id]
    assert packed("none", (), "left", 12) == tokens.tolist()[:13]
