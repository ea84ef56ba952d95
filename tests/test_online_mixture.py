"""WeightedSources in the OnlinePacker: shares by tokens, supervised tokens or samples, the queue's bound
on every prefix of the samples read and on windows of packs, the repetition cap, exact resume (also
through OnlineLoader with 2 workers), and the errors.

The sources are tokenized text rows of very different lengths (the built-in GPT-2 tokenizer): short
rows of about 30 tokens mostly supervised, long rows of about 600 tokens with a short answer, and
medium rows between them.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from functools import cache

import numpy as np
import pytest
import torch

from tightpack.errors import TightpackError
from tightpack.prepare.tokenizer import load_tokenizer
from tightpack.runtime.mixture_stats import MixtureStats
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker
from tightpack.runtime.online_mixture import WeightedSources
from tightpack.runtime.online_preference import OnlinePreferencePacker

WORDS = (
    "the a of to and in is it that for on with as was by at from this model data pack token sequence "
    "length batch loss mask row file run step rank train test answer question short long each every"
).split()
PACK_SIZE, BUFFER = 4096, 32
NAMES = ("short", "long", "medium")
SIZES = {"short": 900, "long": 60, "medium": 240}
WORDS_PER_ROW = {"short": (12, 8), "long": (380, 60), "medium": (60, 60)}  # (prompt, answer) words, about


@cache
def prepared(name: str) -> tuple[tuple[list[int], int], ...]:
    """``(token ids, prompt length)`` of every row of a source, tokenized once per test session."""
    rng = np.random.default_rng(len(name) + SIZES[name])
    prompt_words, answer_words = WORDS_PER_ROW[name]
    texts = []
    for _ in range(SIZES[name]):
        prompt = " ".join(rng.choice(WORDS, int(rng.integers(prompt_words // 2, prompt_words * 3 // 2))))
        answer = " ".join(rng.choice(WORDS, int(rng.integers(answer_words // 2, answer_words * 3 // 2))))
        texts.append((prompt, answer))
    tokenizer = load_tokenizer().backend
    prompts = tokenizer.encode_batch([p for p, _ in texts])
    answers = tokenizer.encode_batch([" " + a for _, a in texts])
    return tuple((p.ids + a.ids, len(p.ids)) for p, a in zip(prompts, answers, strict=True))


def sample(name: str, index: int) -> dict:
    ids, prompt = prepared(name)[index]
    loss_mask = torch.zeros(len(ids))
    loss_mask[prompt - 1 : -1] = 1  # label-aligned: the next token is the answer
    return {"key": f"{name}-{index}", "input_ids": torch.tensor(ids), "loss_mask": loss_mask}


class Rows:
    """A map-style source; logs each read: (key, packs the consumer had received then). ``unique``:
    each read's key is ``name-index-read`` (a repeated row keeps apart)."""

    def __init__(self, name: str, log=None, clock: list[int] | None = None, size=None, unique=False):
        self.name, self.log, self.clock, self.unique = name, log, clock, unique
        self.size = SIZES[name] if size is None else size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        prepared = sample(self.name, index)
        if self.unique:
            prepared["key"] += f"-{len(self.log)}"
        if self.log is not None:
            self.log.append((prepared["key"], self.clock[0] if self.clock else 0))
        return prepared


def measure_of(keys, measures: dict[str, list[int]]) -> np.ndarray:
    """The measure of each source in a collection of keys ``name-index[-read]``."""
    taken = np.zeros(len(NAMES))
    for key in keys:
        name, index = key.split("-")[:2]
        taken[NAMES.index(name)] += measures[name][int(index)]
    return taken


def stream(name: str, size: int | None = None):
    """A stream source of the same rows (the first ``size``), in order."""

    def source(start: int, stride: int):
        for index in range(start, SIZES[name] if size is None else size, stride):
            yield sample(name, index)

    return source


def counts(name: str, index: int) -> dict[str, int]:
    ids, prompt = prepared(name)[index]
    return {"tokens": len(ids), "supervised-tokens": len(ids) - prompt, "samples": 1}


def bounds(measures: dict[str, list[int]], shares: np.ndarray) -> np.ndarray:
    """``[low, high]`` deviation of each source from ``share * total`` on any prefix of the read order:
    ``-w_s * sum(M_j, j != s)`` and ``(1 - w_s) * M_s`` (the online_mixture docstring's proof)."""
    largest = np.array([max(measures[name]) for name in NAMES[: len(shares)]], dtype=float)
    return np.stack([-shares * (largest.sum() - largest), (1 - shares) * largest], axis=1)


def source_measures(by: str, sizes: dict[str, int] = SIZES) -> dict[str, list[int]]:
    return {name: [counts(name, i)[by] for i in range(sizes[name])] for name in NAMES}


def as_lists(packs) -> list[tuple[list[str], list[str], list[int]]]:
    return [(pack["keys"], pack["sources"], pack["input_ids"].tolist()) for pack in packs]


def config(**settings) -> OnlinePackConfig:
    return OnlinePackConfig(**{"pack_size": PACK_SIZE, "packing_buffer_size": BUFFER, **settings})


WEIGHTS = (0.5, 0.3, 0.2)


@pytest.mark.parametrize("by", ["tokens", "supervised-tokens", "samples"])
def test_shares_hold_on_every_prefix_of_the_read_order_and_over_the_stream(by):
    log, clock = [], [0]
    sources = [Rows(name, log, clock) for name in NAMES]
    mixture = WeightedSources(sources, WEIGHTS, names=NAMES, mix_by=by, max_repetitions=3, seed=5)
    packer = OnlinePacker(mixture, config())
    packs = []
    for pack in packer:
        packs.append(pack)
        clock[0] += 1
    measures = source_measures(by)
    shares = np.array(WEIGHTS)
    low_high = bounds(measures, shares)
    taken = np.zeros(3)
    for key, _ in log:  # every prefix of the read order
        taken += measure_of([key], measures)
        deviation = taken - shares * taken.sum()
        assert np.all(deviation >= low_high[:, 0] - 1e-6) and np.all(deviation <= low_high[:, 1] + 1e-6)

    stats = packer.mixture_stats()  # the stream stopped when one source ran out; the buffer flushed
    assert len(stats.exhausted) == 1 and stats.dropped.sum() == 0
    assert stats.measure.tolist() == taken.astype(int).tolist()
    assert stats.rows.sum() == packer.counts["samples"] == len(log)
    assert stats.tokens.sum() == packer.counts["tokens"]
    assert np.abs(stats.shares - shares).max() < 0.005  # targets held to half a point
    tally = mixture.new_stats()  # what a training loop counts from the packs it receives
    for pack in packs:
        tally.add(pack)
    assert tally.to_dict() | {"exhausted": list(stats.exhausted)} == stats.to_dict()
    if by != "samples":  # samples weighting would put the long rows far from their token share
        rows_share = stats.rows / stats.rows.sum()
        assert np.abs(rows_share - shares).max() > 0.1


def test_a_window_of_packs_is_a_window_of_the_read_order_give_or_take_max_wait():
    # Packs hold samples read within max_wait steps of them: the samples of packs [p, p + N) include
    # those read at steps [p, p + N - max_wait) and lie within those read at [p - max_wait, p + N).
    # Both are windows of the read order, where the queue's bound holds (twice: a window is the
    # difference of two prefixes): so the window of packs is bounded too.
    log, clock = [], [0]
    by, max_wait, window = "tokens", 24, 64
    sources = [Rows(name, log, clock, unique=True) for name in NAMES]
    mixture = WeightedSources(sources, WEIGHTS, names=NAMES, mix_by=by, max_repetitions=3, seed=1)
    packer = OnlinePacker(mixture, config(pack_size=1024, packing_buffer_size=16, max_wait=max_wait))
    packs = []
    for pack in packer:
        packs.append(pack)
        clock[0] += 1
    assert len(packs) > 2 * window
    measures, shares = source_measures(by), np.array(WEIGHTS)
    low, high = bounds(measures, shares).T
    worst = 0.0
    for start in range(len(packs) - window + 1):
        inside = [key for pack in packs[start : start + window] for key in pack["keys"]]
        surely = {key for key, step in log if start <= step < start + window - max_wait}
        maybe = {key for key, step in log if start - max_wait <= step < start + window}
        assert surely <= set(inside) <= maybe
        for keys in (surely, maybe):
            deviation = measure_of(keys, measures) - shares * measure_of(keys, measures).sum()
            assert np.all(deviation >= low - high - 1e-6) and np.all(deviation <= high - low + 1e-6)
        taken = measure_of(inside, measures)
        worst = max(worst, float(np.abs(taken / taken.sum() - shares).max()))
    assert worst < 0.02  # measured: 1.1 points at most over any 64 packs of up to 1,024 tokens


def test_the_repetition_cap_stops_the_stream_when_a_source_runs_out():
    log = []
    sources = [Rows("short", log, size=40), Rows("long", log)]
    mixture = WeightedSources(sources, [0.5, 0.5], names=NAMES[:2], max_repetitions=2, seed=3)
    packer = OnlinePacker(mixture, config())
    keys = [key for pack in packer for key in pack["keys"]]
    short = [key for key in keys if key.startswith("short")]
    assert sorted(short) == sorted(f"short-{i}" for i in range(40) for _ in range(2))  # each twice
    first_pass = [key for key, _ in log if key.startswith("short")][:40]
    assert sorted(first_pass) == sorted(f"short-{i}" for i in range(40))  # a pass before the second
    stats = packer.mixture_stats()
    assert stats.exhausted == ("short",) and stats.rows[1] < SIZES["long"]  # long never ran out
    assert abs(stats.shares[0] - 0.5) < 0.02
    assert as_lists(packer) == as_lists(packer)  # a new pass reads the same mixture again


def test_a_fraction_of_a_repetition_is_a_seeded_subsample():
    sources = [Rows("short", size=40), Rows("long")]
    mixture = WeightedSources(sources, [0.5, 0.5], names=NAMES[:2], max_repetitions=1.5)
    keys = [key for pack in OnlinePacker(mixture, config()) for key in pack["keys"]]
    short = [key for key in keys if key.startswith("short")]
    assert len(short) == 60 and len(set(short)) == 40


@pytest.mark.parametrize("rows, cap, reads", [(3, 2.9, 8), (10, 1.05, 10), (7, 2.5, 17)])
def test_a_fraction_of_a_repetition_never_reads_past_the_cap(rows, cap, reads):
    sources = [Rows("short", size=rows), Rows("long")]
    mixture = WeightedSources(sources, [0.5, 0.5], names=NAMES[:2], max_repetitions=cap)
    keys = [key for pack in OnlinePacker(mixture, config()) for key in pack["keys"]]
    assert sum(key.startswith("short") for key in keys) == reads  # floor(cap * rows), not the rounding


def test_continue_goes_on_with_the_other_sources_until_every_one_ran_out():
    sources = [Rows("short", size=40), Rows("medium", size=30), stream("long")]
    mixture = WeightedSources(
        sources, [1, 1, 1], names=("short", "medium", "long"), max_repetitions=2, on_exhausted="continue"
    )
    packer = OnlinePacker(mixture, config())
    keys = [key for pack in packer for key in pack["keys"]]
    assert len(keys) == 2 * (40 + 30 + SIZES["long"]) and len(set(keys)) == 40 + 30 + SIZES["long"]
    assert packer.mixture_stats().exhausted == ("short", "medium", "long")


MIXED = {"short": 300, "long": 30, "medium": 40}  # the sizes of `mixed`


def mixed(by: str = "supervised-tokens", **settings) -> WeightedSources:
    """A map-style source, a stream and a small map-style source repeated twice."""
    sources = [
        Rows(name, size=MIXED[name]) if name != "long" else stream(name, MIXED[name]) for name in NAMES
    ]
    settings = {"max_repetitions": 2, "seed": 7, **settings}
    return WeightedSources(sources, WEIGHTS, names=NAMES, mix_by=by, **settings)


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
def test_resume_from_a_state_dict_is_exact(strategy):
    settings = config(strategy=strategy, pad_to_multiple_of=8, pad_to_max_length=strategy == "ffd")
    packer = OnlinePacker(mixed(), settings)
    states, uninterrupted = [packer.state_dict()], []
    for pack in packer:
        uninterrupted.append(pack)
        states.append(copy.deepcopy(packer.state_dict()))
    expected = as_lists(uninterrupted)
    final = packer.mixture_stats().to_dict()
    assert len(final["exhausted"]) == 1 and len(expected) > 15
    tally = packer.mixture.new_stats()
    for pack in uninterrupted:
        tally.add(pack)
    assert tally.to_dict() | {"exhausted": final["exhausted"]} == final
    for cut in sorted({0, 1, len(expected) // 3, 2 * len(expected) // 3, len(expected) - 1, len(expected)}):
        resumed = OnlinePacker(mixed(), settings)
        resumed.load_state_dict(states[cut])
        assert expected[:cut] + as_lists(resumed) == expected, f"resumed after {cut} packs"
        assert resumed.mixture_stats().to_dict() == final


def test_resume_through_the_online_loader_with_two_workers_is_exact():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from tightpack.runtime.online_loader import OnlineLoader

    def loader() -> OnlineLoader:
        return OnlineLoader(OnlinePacker(mixed(by="tokens"), config(data_id="mix")), num_workers=2)

    first = loader()
    states, uninterrupted = [], []
    for pack in first:
        states.append(copy.deepcopy(first.state_dict()))
        uninterrupted.append(pack)
    expected = as_lists(uninterrupted)
    assert isinstance(first, stateful.StatefulDataLoader)
    for cut in (3, len(expected) // 2, len(expected) - 2):
        resumed = loader()
        resumed.load_state_dict(states[cut - 1])
        assert expected[:cut] + as_lists(resumed) == expected, f"resumed after {cut} packs"

    tally = mixed(by="tokens").new_stats()  # both workers' packs: each holds the queue's bound
    for pack in uninterrupted:
        tally.add(pack)
    low, high = 2 * bounds(source_measures("tokens", MIXED), np.array(WEIGHTS)).T
    deviation = tally.measure - np.array(WEIGHTS) * tally.measure.sum()
    assert np.all(low <= deviation) and np.all(deviation <= high)
    assert np.abs(tally.shares - np.array(WEIGHTS)).max() < 0.02
    keys = Counter(key for pack in uninterrupted for key in pack["keys"])
    assert max(keys.values()) == 2  # the shards read disjoint rows of each of the 2 repetitions

    other = OnlineLoader(OnlinePacker(mixed(by="tokens", seed=8), config(data_id="mix")), num_workers=2)
    with pytest.raises(TightpackError, match=r"mixture\.seed saved 7 now 8"):
        other.load_state_dict(states[3])


def test_the_mixture_does_not_depend_on_ambient_random_state_and_follows_its_seed():
    def keys(seed: int) -> list[str]:
        packer = OnlinePacker(mixed(seed=seed), config())
        return [key for pack in packer for key in pack["keys"]]

    np.random.seed(0)  # noqa: NPY002 (the ambient state the mixture must ignore)
    torch.manual_seed(0)
    first = keys(7)
    np.random.seed(1)  # noqa: NPY002
    torch.manual_seed(1)
    assert keys(7) == first
    assert keys(8) != first


def test_measures_count_what_the_packs_hold_after_truncation():
    # Long rows cut to a 128-token pack count 128 tokens; dropped rows count nothing (14 of the first
    # 30 medium rows are longer than 128 tokens; a source with every row dropped is refused, below).
    for policy, other, size in (("truncate", "long", 20), ("drop", "medium", 30)):
        sources = [Rows("short", size=200), Rows(other, size=size)]
        mixture = WeightedSources(sources, [1, 1], names=("short", other), max_repetitions=1)
        packer = OnlinePacker(
            mixture, OnlinePackConfig(pack_size=128, packing_buffer_size=8, long_samples=policy)
        )
        packs = list(packer)
        stats = packer.mixture_stats()
        assert stats.tokens.sum() == packer.counts["tokens"] == sum(int(p["cu_seqlens_q"][-1]) for p in packs)
        assert stats.exhausted == (other,)
        if policy == "truncate":
            assert stats.tokens[1] == 128 * stats.rows[1]
        else:
            assert stats.rows[1] == 16 and stats.dropped[1] == 14 == packer.counts["dropped"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"weights": [1, 1]}, "2 mixture weights for 3 sources: give one weight per input"),
        ({"weights": [1, 0, 1]}, "mixture weight 0 of long must be a positive number"),
        ({"weights": [1, -2, 1]}, "mixture weight -2 of long must be a positive number"),
        ({"weights": [1, True, 1]}, "mixture weight True of long must be a positive number"),
        ({"mix_by": "words"}, "unknown mix_by 'words'; choose one of tokens, supervised-tokens, samples"),
        ({"on_exhausted": "wrap"}, "on_exhausted must be one of stop, continue; got 'wrap'"),
        ({"max_repetitions": 0.5}, "max_repetitions must be a number >= 1"),
        ({"max_repetitions": 1.5}, "long is a stream; give a whole number, or make it map-style"),
        ({"names": ["a", "a", "b"]}, "source names must differ; repeated: a"),
        ({"seed": -1}, "seed must be an integer >= 0"),
    ],
)
def test_invalid_mixtures_are_refused_with_the_fix(arguments, message):
    settings = {"weights": WEIGHTS, "names": NAMES} | arguments
    with pytest.raises(TightpackError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WeightedSources([Rows("short"), stream("long"), Rows("medium")], **settings)


def test_sources_and_uses_that_cannot_work_are_refused():
    with pytest.raises(TightpackError, match="is a generator: a source is map-style"):
        WeightedSources([Rows("short"), (sample("long", i) for i in range(3))], [1, 1])
    with pytest.raises(TightpackError, match="source 1 is empty: leave it out"):
        WeightedSources([Rows("short"), []], [1, 1])
    with pytest.raises(TightpackError, match="restore is not used with WeightedSources"):
        OnlinePacker(mixed(), config(), restore=lambda key: None)
    bare = [{"key": i, "input_ids": torch.ones(4, dtype=torch.long)} for i in range(4)]
    packer = OnlinePacker(WeightedSources([bare], [1], mix_by="supervised-tokens"), config())
    with pytest.raises(TightpackError, match=r"sample \d+ has neither loss_mask nor labels"):
        list(packer)
    with pytest.raises(TightpackError, match="reads one source of preference units"):
        OnlinePreferencePacker(mixed(), config())
    with pytest.raises(TightpackError, match="mixture_stats counts the sources of WeightedSources"):
        OnlinePacker(stream("short"), config()).mixture_stats()
    with pytest.raises(TightpackError, match="the pack has no 'sources'"):
        MixtureStats(["a"], [1.0], mix_by="tokens").add({"cu_seqlens_q": torch.tensor([0, 4])})


EMPTY_STREAM = (
    "long yielded no sample on its first pass: the stream source(start, stride) is empty, so it can hold "
    "no share of the mixture; leave it out of the mixture, or check what it reads (its path, its split, "
    "its filter)"
)
NOT_REITERABLE = (
    "a source read more than once (max_repetitions > 1, or another epoch) must be re-iterable: each call "
    "source(start, stride) must return a new iterator from position start (a generator function, not one "
    "generator handed back again); make it so, or set max_repetitions=1 and read it for one epoch"
)


@pytest.mark.parametrize("on_exhausted", ["stop", "continue"])
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_an_empty_stream_is_refused_where_its_first_pass_ends(first, on_exhausted, rank):
    # Before: under "stop" the mixture yielded nothing (or one sample), under "continue" the empty
    # source's weight was dropped; both without a word. Rank 1 of 2 reads positions 1, 3, ...: it asks
    # for position 0 to tell an empty stream from a short one.
    sources, names = [stream("long", size=0), Rows("short", size=40)], ["long", "short"]
    if not first:
        sources, names = sources[::-1], names[::-1]
    mixture = WeightedSources(sources, [1, 1], names=names, max_repetitions=2, on_exhausted=on_exhausted)
    packer = OnlinePacker(mixture, config(), rank=rank, world_size=2)
    with pytest.raises(TightpackError, match=f"^{re.escape(EMPTY_STREAM)}$"):
        list(packer)


def test_a_stream_shorter_than_the_shards_is_spent_in_the_shards_past_its_end_like_a_list():
    # One sample, two ranks: rank 1 has no part of it, in every pass, as with a map-style source of one
    # row (no error: the stream is not empty); rank 0 reads it once per repetition.
    def packs(long, rank: int) -> tuple[list, tuple[str, ...]]:
        mixture = WeightedSources(
            [Rows("short", size=40), long],
            [1, 1],
            names=NAMES[:2],
            max_repetitions=2,
            on_exhausted="continue",
        )
        packer = OnlinePacker(mixture, config(), rank=rank, world_size=2)
        return as_lists(packer), packer.mixture_stats().exhausted

    for rank in (0, 1):
        assert packs(stream("long", size=1), rank) == packs(Rows("long", size=1), rank)
    keys = [key for pack in packs(stream("long", size=1), 0)[0] for key in pack[0]]
    assert keys.count("long-0") == 2
    keys = [key for pack in packs(stream("long", size=1), 1)[0] for key in pack[0]]
    assert len(keys) == 40 and not any(key.startswith("long") for key in keys)


def one_shot(name: str, size: int):
    """A stream that hands back one generator on every call: right on its first pass, empty after."""
    rows = stream(name, size)(0, 1)
    return lambda start, stride: rows


@pytest.mark.parametrize("on_exhausted", ["stop", "continue"])
def test_a_one_shot_stream_repeated_is_refused_not_counted_as_spent(on_exhausted):
    # Before: its second pass was empty, so it counted as spent after 10 of its 30 capped reads: the
    # epoch ended early ("stop") or the source lost its weight ("continue").
    mixture = WeightedSources(
        [one_shot("long", 10), Rows("short")],
        [1, 1],
        names=["long", "short"],
        max_repetitions=3,
        on_exhausted=on_exhausted,
    )
    message = "long yielded no sample on its pass 2 of max_repetitions=3 although its first pass did: "
    message += NOT_REITERABLE
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(OnlinePacker(mixture, config()))


def test_a_one_shot_stream_read_for_a_second_epoch_is_refused():
    mixture = WeightedSources([one_shot("long", 10), Rows("short")], [1, 1], names=["long", "short"])
    packer = OnlinePacker(mixture, config())
    first = [key for pack in packer for key in pack["keys"]]
    assert sorted(key for key in first if key.startswith("long")) == sorted(f"long-{i}" for i in range(10))
    message = (
        "long yielded no sample on its first pass although it yielded samples before (an earlier epoch "
        f"or packer): {NOT_REITERABLE}"
    )
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(packer)


def labelled(row: dict) -> dict:
    """The row with ``labels`` (the next token where its loss_mask is 1, else -100) for its loss_mask."""
    mask = row.pop("loss_mask")
    labels = torch.cat([row["input_ids"][1:], torch.tensor([-100])])
    return row | {"labels": torch.where(mask > 0, labels, -100)}


def unsupervised(row: dict) -> dict:
    """The row with no supervised token: its loss_mask all 0, or its labels all -100."""
    if "loss_mask" in row:
        return row | {"loss_mask": torch.zeros_like(row["loss_mask"])}
    return row | {"labels": torch.full_like(row["labels"], -100)}


def listed(rows: list[dict]):
    """A stream source of ``rows``, in order."""
    return lambda start, stride: iter(rows[start::stride])


NO_SUPERVISED = (
    "{name} has no supervised tokens to mix: a whole pass of its {count} samples{where} held none (no "
    "loss_mask above 0 nor label other than ignore_index, after long_samples: 'truncate' keeps the first "
    "pack_size tokens and can cut every answer away, 'drop' leaves samples out), so no weight gives it a "
    "share and the mixture would read nothing but it until it ran out; leave it out of the mixture, or "
    "mix by tokens or samples, or check its loss_mask or labels and the truncation"
)


@pytest.mark.parametrize("on_exhausted", ["stop", "continue"])
@pytest.mark.parametrize("kind", ["map-style", "stream"])
@pytest.mark.parametrize("why", ["loss_mask", "labels", "truncated"])
def test_a_source_with_no_supervised_tokens_is_refused_where_its_first_pass_ends(why, kind, on_exhausted):
    # Before: its measure stayed 0, so the queue read nothing but it until its cap, then the mixture
    # stopped ("stop": 1 sample of short, shares 100%/0%) or went on without it ("continue"), with
    # only mixture_stats().exhausted naming it. Now the end of its first pass raises, also resumed.
    prepare = labelled if why == "labels" else dict
    short = [prepare(sample("short", i)) for i in range(40)]
    if why == "truncated":  # the 128 tokens kept hold no answer: the prompts are 197 tokens or more
        name, rows = "long", [sample("long", i) for i in range(10)]
    else:
        name, rows = "medium", [unsupervised(prepare(sample("medium", i))) for i in range(10)]
    zero = rows if kind == "map-style" else listed(rows)
    mixture = WeightedSources(
        [short, zero],
        [1, 1],
        names=["short", name],
        mix_by="supervised-tokens",
        max_repetitions=2,
        on_exhausted=on_exhausted,
    )
    packer = OnlinePacker(mixture, config(pack_size=128, packing_buffer_size=4))
    message = NO_SUPERVISED.format(name=name, count=10, where="")
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(packer)
    assert packer.consumed == 1 + 10  # the first sample of short, then the whole pass of the other
    resumed = OnlinePacker(mixture, config(pack_size=128, packing_buffer_size=4))
    resumed.load_state_dict(packer.state_dict())  # saved within the pass: the resumed pass raises too
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(resumed)


@pytest.mark.parametrize("by", ["tokens", "samples"])
def test_a_source_whose_every_sample_is_dropped_is_refused(by):
    mixture = WeightedSources(
        [Rows("short", size=40), Rows("long", size=10)], [1, 1], names=NAMES[:2], mix_by=by
    )
    packer = OnlinePacker(mixture, config(pack_size=128, packing_buffer_size=4, long_samples="drop"))
    message = (
        f"long has no {by} to mix: a whole pass of its 10 samples held none (long_samples='drop' left out "
        "every one: each is longer than pack_size), so no weight gives it a share and the mixture would "
        "read nothing but it until it ran out; leave it out of the mixture, or raise pack_size, or choose "
        "long_samples='truncate'"
    )
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(packer)


def test_a_source_with_supervised_tokens_in_some_samples_only_is_checked_per_shard():
    # The stream's even positions have answers, its odd ones none. One shard reads all of it: it holds
    # its share. Two ranks: rank 0 reads only answers; rank 1 reads only rows without one, so its queue
    # can give the source no share (it would read nothing but it): rank 1 raises, naming its shard.
    rows = [sample("medium", i) if i % 2 == 0 else unsupervised(sample("medium", i)) for i in range(8)]

    def packer(rank: int, world_size: int) -> OnlinePacker:
        mixture = WeightedSources(
            [Rows("short", size=40), listed(rows)],
            [1, 1],
            names=("short", "medium"),
            mix_by="supervised-tokens",
            on_exhausted="continue",
        )
        return OnlinePacker(mixture, config(), rank=rank, world_size=world_size)

    for rank, world_size in ((0, 1), (0, 2)):
        whole = packer(rank, world_size)
        keys = [key for pack in whole for key in pack["keys"]]
        assert sum(key.startswith("medium") for key in keys) == 8 // world_size
        assert whole.mixture_stats().supervised[1] > 0
    message = NO_SUPERVISED.format(name="medium", count=4, where=" in shard 1 of 2") + (
        "; each shard (a DataLoader worker of a data-parallel rank) reads its own positions 1, 3, ... of "
        "every source, and this shard's part holds none even if another's holds some: with few samples "
        "that do, use fewer workers or ranks"
    )
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(packer(1, 2))


def tagged(name: str, keys: tuple[str, ...], count: int = 6) -> list[dict]:
    """``count`` rows ``name0, name1, ...`` carrying the optional ``keys`` (and their visual keys)."""
    rows = []
    for i in range(count):
        row = {"key": f"{name}{i}", "input_ids": torch.arange(1, 5)}
        row |= {"labels": torch.arange(2, 6)} if "labels" in keys else {}
        row |= {"loss_mask": torch.ones(4)} if "loss_mask" in keys else {}
        row |= {"pixel_values": torch.ones(2, 3)} if "pixel_values" in keys else {}
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (
            ("labels",),
            ("loss_mask",),
            "sample 'b0' of b carries loss_mask, but sample 'a0' of a, the first the mixture read, carries "
            "labels: a pack needs labels and loss_mask in all of its samples or in none",
        ),
        (
            ("labels", "loss_mask"),
            ("loss_mask",),
            "sample 'b0' of b carries loss_mask, but sample 'a0' of a, the first the mixture read, carries "
            "labels and loss_mask: a pack needs labels in all of its samples or in none",
        ),
        (
            (),
            ("labels",),
            "sample 'b0' of b carries labels, but sample 'a0' of a, the first the mixture read, carries "
            "neither labels nor loss_mask: a pack needs labels in all of its samples or in none",
        ),
    ],
)
def test_sources_with_other_optional_keys_are_refused_naming_both(first, second, message):
    # Before: ValueError("'labels' must be present for every sequence row or omitted from all rows.")
    # from pack_samples, naming neither source.
    mixture = WeightedSources(
        [listed(tagged("a", first)), listed(tagged("b", second))], [1, 1], names=["a", "b"]
    )
    message += ", so every source must carry the same optional keys; prepare the samples of a and b with "
    message += "the same ones"
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(OnlinePacker(mixture, config(pack_size=16, packing_buffer_size=4)))


def test_optional_keys_are_checked_within_a_source_and_against_a_restored_buffer_and_visual_keys_may_differ():
    rows = tagged("a", ("loss_mask",))
    rows[3] = tagged("x", ())[0]
    mixture = WeightedSources([listed(rows)], [1], names=["a"])
    message = "sample 'x0' of a carries neither labels nor loss_mask, but sample 'a0' of a, the first the "
    message += "mixture read, carries loss_mask: a pack needs loss_mask in all of its samples or in none, so "
    message += "every source must carry the same optional keys; prepare every sample of a with the same ones"
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}$"):
        list(OnlinePacker(mixture, config(pack_size=16, packing_buffer_size=4)))

    def packer(second: list[dict]) -> OnlinePacker:
        mixture = WeightedSources([tagged("a", ("labels",), 40), listed(second)], [3, 1], names=["a", "b"])
        return OnlinePacker(mixture, config(pack_size=16, packing_buffer_size=8))

    saved = packer(tagged("b", ("labels",)))  # b's rows read after the first pack are another kind
    next(iter(saved))
    state = saved.state_dict()
    read = state["mixture"]["cursor"]["position"][1]
    changed = tagged("b", ("labels",))[:read] + tagged("b", ("loss_mask",))[read:]
    resumed = packer(changed)
    resumed.load_state_dict(state)  # the restored buffer holds the first samples the mixture read
    first, origin = state["buffer"][0][0], state["buffer"][0][3]
    message = f"sample 'b{read}' of b carries loss_mask, but sample {first!r} of {'ab'[origin[0]]}, the first"
    with pytest.raises(TightpackError, match=f"^{re.escape(message)}"):
        list(resumed)

    text_and_images = WeightedSources(
        [tagged("a", ("loss_mask",)), tagged("b", ("loss_mask", "pixel_values"))], [1, 1], names=["a", "b"]
    )
    packs = list(OnlinePacker(text_and_images, config(pack_size=16, packing_buffer_size=4)))
    assert sum(len(pack["keys"]) for pack in packs) == 12 and "pixel_values" in packs[0]
