"""Shared fixtures: the built-in tokenizer, and small real JSONL corpora written to tmp_path.

Also the hypothesis profiles, chosen by the environment variable ``HYPOTHESIS_PROFILE``:

- ``default`` (what ``make test`` runs): 100 examples per property test unless the test says otherwise.
- ``fuzz`` (``make fuzz``): every example count times ``FUZZ_MULTIPLIER`` (30), for deeper runs.

A per-test ``max_examples`` overrides the profile, so it must scale with it: write
``@settings(max_examples=examples(n), deadline=None)`` (``n`` in ``default``, 30n in ``fuzz``), or, without
importing this module, ``max_examples=k * settings.default.max_examples`` (``settings.default`` is the
loaded profile: 100k, or 3000k). A test without its own ``max_examples`` runs the profile's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer

# Debug mode of the THD contract (`tightpack.runtime.thd`) for the whole suite and the processes it starts:
# every batch a builder emits or a consumer receives is validated. A test that hands a consumer a broken
# batch on purpose, to reach the consumer's own error, turns it off with ``thd.checking(False)``.
os.environ["TIGHTPACK_CHECK_BATCHES"] = "1"

# --- hypothesis profiles -----------------------------------------------------------------------------

FUZZ_MULTIPLIER = 30
EXAMPLE_MULTIPLIERS = {"default": 1, "fuzz": FUZZ_MULTIPLIER}
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
if HYPOTHESIS_PROFILE not in EXAMPLE_MULTIPLIERS:
    raise pytest.UsageError(
        f"HYPOTHESIS_PROFILE={HYPOTHESIS_PROFILE!r}: the profiles are {sorted(EXAMPLE_MULTIPLIERS)}"
    )

settings.register_profile("default", deadline=None, max_examples=100, print_blob=True)
settings.register_profile(
    "fuzz",
    deadline=None,
    max_examples=100 * FUZZ_MULTIPLIER,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(HYPOTHESIS_PROFILE)


def examples(count: int) -> int:
    """``count`` examples scaled to the active profile (``count`` in ``default``, 30x in ``fuzz``)."""
    return count * EXAMPLE_MULTIPLIERS[HYPOTHESIS_PROFILE]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """Indexes and token stores of the tests (and of the CLI runs they start) stay out of ~/.cache."""
    folder = tmp_path_factory.mktemp("tightpack-cache")
    os.environ["TIGHTPACK_CACHE"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def gpt2() -> TokenizerSpec:
    return load_tokenizer(None)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def random_words(rng: np.random.Generator, count: int) -> str:
    vocabulary = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "pack",
        "token",
        "sequence",
        "loss",
        "mask",
        "THD",
        "über",
        "日本",
    ]
    return " ".join(rng.choice(vocabulary, size=count))


@pytest.fixture
def prompt_completion_rows() -> list[dict]:
    rng = np.random.default_rng(7)
    return [
        {
            "input": random_words(rng, int(rng.integers(1, 40))),
            "output": random_words(rng, int(rng.integers(1, 30))),
        }
        for _ in range(120)
    ]


@pytest.fixture
def chat_rows() -> list[dict]:
    rng = np.random.default_rng(11)
    rows = []
    for _ in range(80):
        messages = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for _turn in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": random_words(rng, int(rng.integers(1, 20)))})
            messages.append({"role": "assistant", "content": random_words(rng, int(rng.integers(1, 20)))})
        rows.append({"messages": messages})
    return rows


@pytest.fixture
def packed_chat(tmp_path, chat_rows) -> Path:
    """A small real packed dataset: 240 chat rows packed at 128 tokens, row groups of 4 packs."""
    from tightpack.pipeline import PackConfig, pack_dataset

    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows * 3)
    config = PackConfig(packed_sequence_size=128, row_group_size=4, workers=1)
    pack_dataset([source], tmp_path / "out", config)
    return tmp_path / "out"
