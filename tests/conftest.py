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

import os

if "PYTEST_XDIST_WORKER" in os.environ:
    # `make test` runs two workers on two cores: one thread each (and in the processes they start),
    # where torch's default of a thread per core would have them take the cores from each other.
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")
    try:  # torch may be loaded already (by a plugin), its pool sized: the variable alone came too late
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass

import importlib
import io
import json
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
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
    from tightpack.offline.pipeline import PackConfig, pack_dataset

    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows * 3)
    config = PackConfig(packed_sequence_size=128, row_group_size=4, workers=1)
    pack_dataset([source], tmp_path / "out", config)
    return tmp_path / "out"


# --- the command line in this process -----------------------------------------------------------------


@dataclass(frozen=True)
class CliRun:
    """What `run_main` returns: the fields of `subprocess.CompletedProcess` the tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


#: Python's own warning filters, as a fresh process without ``-W`` has them (pytest's are stricter).
_PROCESS_WARNING_IGNORES = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def run_main(args, *, cwd: Path | None = None, env: dict[str, str] | None = None) -> CliRun:
    """``tightpack ARGS`` in this process: `tightpack.cli.main`, which the console script calls and whose
    result is its exit status, with stdout and stderr captured, and ``env`` (plus ``COLUMNS=200`` and
    ``NO_COLOR=1``), ``cwd`` and ``sys.argv`` set for the call only.

    A subprocess costs a second or two of interpreter start-up and imports; this costs none. It shows
    what a process with its output piped would: the rich consoles of `tightpack.cli.app` (made once, at
    import) are 200 columns wide, colourless and not a terminal for the call, and Python warnings are
    written to stderr under a fresh process's filters rather than collected by pytest. An exception
    that would end the process with a traceback fails the test with it.

    Not for what needs a process of its own: signals, worker pools (``--workers`` above 1 forks this
    process), a changed interpreter start-up, or output that C code writes to the file descriptors.
    """
    from tightpack.cli import main

    consoles = importlib.import_module("tightpack.cli.app")  # the module: the package's `app` is the Typer
    argv = [str(arg) for arg in args]
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        for name, value in {"COLUMNS": "200", "NO_COLOR": "1", **(env or {})}.items():
            patch.setenv(name, value)
        if cwd is not None:
            patch.chdir(cwd)
        patch.setattr(sys, "argv", ["tightpack", *argv])
        for console in (consoles.stdout, consoles.stderr):
            patch.setattr(console, "_width", 200)
            patch.setattr(console, "_color_system", None)
            patch.setattr(console, "_force_terminal", False)
        warnings.simplefilter("default")
        for category in _PROCESS_WARNING_IGNORES:
            warnings.simplefilter("ignore", category)
        with redirect_stdout(stdout), redirect_stderr(stderr):
            code = main(argv)
    for shown in caught:
        stderr.write(warnings.formatwarning(shown.message, shown.category, shown.filename, shown.lineno))
    return CliRun(argv, code, stdout.getvalue(), stderr.getvalue())
