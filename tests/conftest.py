"""Shared fixtures: the built-in tokenizer, and small real JSONL corpora written to tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer


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
