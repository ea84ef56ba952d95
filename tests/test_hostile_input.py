"""Hostile input (issue 7 section 2): a corpus of bad inputs, each with the answer it must get.

Every bad input is refused by the real command line (``main``, the console script's entry: the
tables of cases in processes of their own, the other tests in this process) with exit status 2 and
one ``error:`` line on stderr that names the problem and its location (file and line, or Parquet
row), with no traceback and nothing written. With ``--skip-bad-lines`` every skipped row is counted
in the summary and listed in the manifest with its location and reason, and every row read ends up
packed, skipped or excluded: nothing is lost silently.

Faults that ``inspect`` does not look for (metadata or manifest counts that disagree with the data)
are `tightpack verify`'s job: those cases run both commands. Inputs are built in ``tmp_path``.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from numpy.lib import format as npy_format

from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.tokenize import parse_chunk

from .conftest import CliRun, run_main

VOCAB = 50257  # the built-in GPT-2
GOOD = {"input": "question one", "output": "answer one"}
CHAT = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}
FIX = r" \(fix the row, or pass --skip-bad-lines\)$"
LIST = pa.list_(pa.int64())


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def run_cli(*args, cwd: Path) -> CliRun:
    """``tightpack ARGS`` in ``cwd``, in this process (`run_main`: no interpreter start-up per run)."""
    return run_main(args, cwd=cwd)


def assert_one_error_line(result: CliRun | subprocess.CompletedProcess) -> str:
    """Exit 2, no traceback, nothing on stdout, and stderr exactly one ``error:`` line."""
    both = result.stdout + result.stderr
    assert "Traceback" not in both, both
    assert result.returncode == 2, f"exit status {result.returncode}\n{both}"
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (
        f"stderr is not one error line:\n{result.stderr}"
    )
    return lines[0]


def summary_value(stdout: str, label: str) -> str:
    match = re.search(rf"│ {re.escape(label)}\s*│\s*(.+?)\s*│", stdout)
    assert match, f"{label!r} not in the summary:\n{stdout}"
    return match.group(1)


def jsonl(*items) -> bytes:
    """JSON lines: dicts, lists and numbers are dumped; str and bytes are written as they are."""
    lines = []
    for item in items:
        if isinstance(item, bytes):
            lines.append(item)
        elif isinstance(item, str):
            lines.append(item.encode("utf-8"))
        else:
            lines.append(json.dumps(item).encode("utf-8"))
    return b"\n".join(lines) + b"\n"


def parquet(table: pa.Table) -> Callable[[Path], None]:
    return lambda path: pq.write_table(table, path)


def garbage(size: int = 4096) -> bytes:
    return np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def corrupt_pages(path: Path) -> None:
    """Overwrite everything between the leading magic and the footer: a readable footer, bad pages."""
    data = bytearray(path.read_bytes())
    footer = struct.unpack("<i", data[-8:-4])[0]
    data[4 : len(data) - 8 - footer] = b"\x5a" * (len(data) - 12 - footer)
    path.write_bytes(bytes(data))


def prompt_completion_table(rows: int = 1200) -> pa.Table:
    return pa.table({"input": [f"q {i}" for i in range(rows)], "output": [f"a {i}" for i in range(rows)]})


def parquet_bytes(table: pa.Table, tmp_path: Path) -> bytes:
    scratch = tmp_path / "_scratch.parquet"
    pq.write_table(table, scratch, row_group_size=400)
    data = scratch.read_bytes()
    scratch.unlink()
    return data


def build(tmp_path: Path, files: dict) -> None:
    for name, content in files.items():
        path = tmp_path / name
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


# Runs the cases of a table in one interpreter: ``tightpack.cli`` and what it imports lazily are
# imported once (no tokenizer is loaded), then each case runs ``main(argv)`` -- what the ``tightpack``
# console script runs -- in a fork, in its own folder, with its own stdout and stderr files (file
# descriptors 1 and 2) and its own exit status; one case per CPU at a time. An uncaught exception
# prints its traceback to the case's stderr, as the interpreter would. This saves the imports, most
# of the cost of a separate ``python -m tightpack.cli`` per case.
FORK_DRIVER = r"""
import contextlib, io, json, os, sys, traceback
import pyarrow.parquet, tokenizers, tightpack.cli, tightpack.reports.summary, tightpack.offline.pipeline
with contextlib.redirect_stdout(io.StringIO()):  # typer imports its parameter machinery on first use
    tightpack.cli.main(["pack", "--help"])
jobs = json.load(sys.stdin)
codes, running = [None] * len(jobs), {}
def reap():
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
for number, job in enumerate(jobs):
    if len(running) >= int(sys.argv[1]):
        reap()
    pid = os.fork()
    if pid:
        running[pid] = number
        continue
    code = 1
    try:
        os.chdir(job["cwd"])
        for fd, name in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = ["tightpack", *job["argv"]]
        code = tightpack.cli.main(job["argv"])
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
while running:
    reap()
print(json.dumps(codes))
"""


def run_forked(jobs: list[tuple[list[str], Path]], logs: Path) -> list[subprocess.CompletedProcess]:
    """``tightpack *argv`` in folder ``cwd`` for each job, in forks of one interpreter (see above)."""
    if not hasattr(os, "fork"):
        return [run_cli(*argv, cwd=cwd) for argv, cwd in jobs]
    specs = [
        {"argv": argv, "cwd": str(cwd), "stdout": str(logs / f"{i}.out"), "stderr": str(logs / f"{i}.err")}
        for i, (argv, cwd) in enumerate(jobs)
    ]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
    command = [sys.executable, "-c", FORK_DRIVER, str(os.cpu_count() or 1)]
    driver = subprocess.run(
        command, input=json.dumps(specs), env=env, capture_output=True, text=True, timeout=600
    )
    assert driver.returncode == 0, driver.stderr
    codes = json.loads(driver.stdout)
    return [
        subprocess.CompletedProcess(
            spec["argv"],
            code,
            Path(spec["stdout"]).read_text(encoding="utf-8"),
            Path(spec["stderr"]).read_text(encoding="utf-8"),
        )
        for spec, code in zip(specs, codes, strict=True)
    ]


def run_table(request, tmp_path_factory, test_name, cases, command, prepare=None):
    """Build the inputs of the selected cases of a table, each in its own folder, and run them.

    Returns ``{case id: (folder, result)}``.
    """
    selected = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "originalname", None) == test_name and item.module.__name__ == __name__
    }
    folders = {}
    for param in cases:
        if param.id in selected:
            folder = tmp_path_factory.mktemp(param.id)
            if prepare is not None:
                prepare(folder)
            build(folder, param.values[0])
            folders[param.id] = folder
    jobs = [([command, *map(str, case.values[1])], folders[case.id]) for case in cases if case.id in folders]
    results = run_forked(jobs, tmp_path_factory.mktemp(f"{command}-logs"))
    return {case_id: (folders[case_id], result) for case_id, result in zip(folders, results, strict=True)}


def case(name, files, args, pattern, *marks):
    """One bad input: files to create, command arguments, a regex the error line must match."""
    return pytest.param(files, args, pattern, id=name, marks=marks)


# ------------------------------------------------------------------------------------------------
# tightpack pack: each bad input stops the run with one located error line
# ------------------------------------------------------------------------------------------------

PACK = ["-o", "out", "--pack-size", "64", "--workers", "1"]
TOKENS = [*PACK, "--format", "tokens"]

PACK_CASES = [
    # --- JSON lines: syntax and encoding ------------------------------------------------------
    case(
        "malformed-json",
        {"bad.jsonl": jsonl(GOOD, GOOD, '{"input": "x", "output": ', GOOD)},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:3: malformed JSON: Expecting value at column \d+" + FIX,
    ),
    case(
        "truncated-line",
        {"bad.jsonl": jsonl(GOOD, '{"input": "question", "outp')},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:2: malformed JSON: ",
    ),
    case(
        "json-array-file",
        {"rows.json": json.dumps([GOOD, GOOD], indent=2)},
        ["rows.json", *PACK],
        r"^error: rows\.json:1: malformed JSON: ",
    ),
    case(
        "nul-byte-in-string",
        {"nul.jsonl": jsonl(GOOD, b'{"input": "a\x00b", "output": "c"}')},
        ["nul.jsonl", *PACK],
        r"^error: nul\.jsonl:2: malformed JSON: Invalid control character",
    ),
    case(
        "nul-byte-after-object",
        {"nul.jsonl": jsonl(GOOD, GOOD, json.dumps(GOOD).encode() + b"\x00\x00")},
        ["nul.jsonl", *PACK],
        r"^error: nul\.jsonl:3: malformed JSON: Extra data",
    ),
    case(
        "invalid-utf8",
        {"latin1.jsonl": jsonl(GOOD, GOOD, b'{"input": "caf\xe9", "output": "ok"}')},
        ["latin1.jsonl", *PACK],
        r"^error: latin1\.jsonl:3: invalid UTF-8 at byte 14 of the line" + FIX,
    ),
    case(
        "utf16-file",
        {"wide.jsonl": jsonl(GOOD).decode().encode("utf-16")},
        ["wide.jsonl", *PACK],
        r"^error: wide\.jsonl:1: invalid UTF-8 at byte 0 of the line",
    ),
    case(
        "bad-row-in-second-file",
        {"a.jsonl": jsonl(GOOD, GOOD, GOOD), "b.jsonl": jsonl(GOOD, "{oops}")},
        ["a.jsonl", "b.jsonl", *PACK],
        r"^error: b\.jsonl:2: malformed JSON: ",
    ),
    case(
        "deeply-nested-json",
        {"deep.jsonl": jsonl(GOOD, "[" * 5000 + "]" * 5000)},
        ["deep.jsonl", *PACK],
        r"^error: deep\.jsonl:2: .*(nest|deep|recursion)",
    ),
    case(
        "lone-surrogate",
        {"surrogate.jsonl": jsonl(GOOD, r'{"input": "a\ud800b", "output": "c"}')},
        ["surrogate.jsonl", *PACK],
        r"^error: surrogate\.jsonl:2: .*(surrogate|Unicode)",
    ),
    # --- JSON lines: wrong shapes and types -----------------------------------------------------
    case(
        "row-is-a-list",
        {"bad.jsonl": jsonl(GOOD, [1, 2])},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:2: expected a JSON object, got list" + FIX,
    ),
    case(
        "row-is-a-number",
        {"bad.jsonl": jsonl(42)},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: expected a JSON object, got int" + FIX,
    ),
    case(
        "row-is-null",
        {"bad.jsonl": jsonl(GOOD, GOOD, None)},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:3: expected a JSON object, got NoneType" + FIX,
    ),
    case(
        "messages-not-a-list",
        {"bad.jsonl": jsonl(CHAT, {"messages": "hello"})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:2: 'messages' must be a non-empty list of \{role, content\} objects" + FIX,
    ),
    case(
        "messages-empty",
        {"bad.jsonl": jsonl({"messages": []})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: 'messages' must be a non-empty list",
    ),
    case(
        "message-not-an-object",
        {"bad.jsonl": jsonl({"messages": ["hello"]})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: message 0 must be an object, got str" + FIX,
    ),
    case(
        "message-without-content",
        {"bad.jsonl": jsonl(CHAT, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:2: message 1 \(assistant\) must have a string 'content', got NoneType" + FIX,
    ),
    case(
        "message-content-image-part",
        {"bad.jsonl": jsonl({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: message 0 \(user\) content part 0 has type 'image_url'; text-only "
        r"packing accepts only 'text' parts: remove the non-text parts from the row" + FIX,
    ),
    case(
        "message-without-role",
        {"bad.jsonl": jsonl({"messages": [{"content": "q"}]})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: message 0 has unknown role None",
    ),
    case(
        "unknown-role",
        {"bad.jsonl": jsonl(CHAT, CHAT, {"messages": [{"role": "robot", "content": "beep"}]})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:3: message 0 has unknown role 'robot'; expected one of \[",
    ),
    case(
        "tools-not-a-list",
        {"bad.jsonl": jsonl({**CHAT, "tools": "search"})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: 'tools' must be a list of tool schemas, got str" + FIX,
    ),
    case(
        "prompt-wrong-type",
        {"bad.jsonl": jsonl(GOOD, {"input": 5, "output": "x"})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:2: key 'input' must be a string, got int" + FIX,
    ),
    case(
        "completion-wrong-type",
        {"bad.jsonl": jsonl(GOOD, {"input": "x", "output": ["y"]})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:2: key 'output' must be a string, got list" + FIX,
    ),
    case(
        "completion-missing",
        {"bad.jsonl": jsonl({"input": "x"})},
        ["bad.jsonl", *PACK],
        r"^error: bad\.jsonl:1: missing key 'output' \(keys found: input\)",
    ),
    # --- nothing to pack --------------------------------------------------------------------------
    case(
        "empty-file",
        {"empty.jsonl": b""},
        ["empty.jsonl", *PACK],
        r"^error: no sample to pack: \S*empty\.jsonl held no rows \(empty, or blank lines only\)$",
    ),
    case(
        "only-blank-lines",
        {"blank.jsonl": b"\n\n   \n\t\n"},
        ["blank.jsonl", *PACK],
        r"^error: no sample to pack: \S*blank\.jsonl held no rows",
    ),
    case(
        "no-assistant-turn-only",
        {"chat.jsonl": jsonl({"messages": [{"role": "user", "content": "hello"}]})},
        ["chat.jsonl", *PACK],
        r"^error: no sample left to pack \(1 rows in, 0 bad, 0 too long, 1 without supervised tokens\)$",
    ),
    # --- Parquet input ----------------------------------------------------------------------------
    case(
        "parquet-garbage",
        {"garbage.parquet": garbage()},
        ["garbage.parquet", *PACK],
        r"^error: garbage\.parquet: not a readable Parquet file \(.*magic bytes",
    ),
    case(
        "parquet-garbage-with-skip",
        {"garbage.parquet": garbage()},
        ["garbage.parquet", *PACK, "--skip-bad-lines"],
        r"^error: garbage\.parquet: not a readable Parquet file",
    ),
    case(
        "parquet-zero-bytes",
        {"empty.parquet": b""},
        ["empty.parquet", *PACK],
        r"^error: empty\.parquet: not a readable Parquet file \(.*0 bytes",
    ),
    case(
        "parquet-truncated",
        {
            "cut.parquet": lambda p: p.write_bytes(
                truncated(parquet_bytes(prompt_completion_table(), p.parent))
            )
        },
        ["cut.parquet", *PACK],
        r"^error: cut\.parquet: not a readable Parquet file",
    ),
    case(
        "parquet-corrupt-pages",
        {"pages.parquet": lambda p: (parquet(prompt_completion_table())(p), corrupt_pages(p))},
        ["pages.parquet", *PACK],
        r"^error: pages\.parquet: cannot read row 0 onwards \(",
    ),
    case(
        "parquet-wrong-schema",
        {"schema.parquet": parquet(pa.table({"foo": [1, 2], "bar": ["x", "y"]}))},
        ["schema.parquet", *PACK],
        r"^error: schema\.parquet row 0: missing key 'input' \(keys found: bar, foo\)",
    ),
    case(
        "parquet-wrong-schema-with-skip",
        {"schema.parquet": parquet(pa.table({"foo": [1, 2], "bar": ["x", "y"]}))},
        ["schema.parquet", *PACK, "--skip-bad-lines"],
        r"^error: no sample left to pack \(2 rows in, 2 bad, ",
    ),
    case(
        "parquet-wrong-column-types",
        {"types.parquet": parquet(pa.table({"input": [1, 2], "output": [3, 4]}))},
        ["types.parquet", *PACK],
        r"^error: types\.parquet row 0: key 'input' must be a string, got int" + FIX,
    ),
    case(
        "parquet-null-value",
        {"nulls.parquet": parquet(pa.table({"input": ["a", "b", None], "output": ["c", "d", "e"]}))},
        ["nulls.parquet", *PACK],
        r"^error: nulls\.parquet row 2: missing key 'input' \(keys found: output\)",  # null is absent
    ),
    case(
        "parquet-messages-wrong-type",
        {"chat.parquet": parquet(pa.table({"messages": ["hello", "bye"]}))},
        ["chat.parquet", *PACK],
        r"^error: chat\.parquet row 0: 'messages' must be a non-empty list",
    ),
    case(
        "parquet-zero-rows",
        {"zero.parquet": parquet(prompt_completion_table(0))},
        ["zero.parquet", *PACK],
        r"^error: no sample to pack: \S*zero\.parquet held no rows",
    ),
    # --- --format tokens, JSON lines --------------------------------------------------------------
    case(
        "tokens-out-of-vocabulary",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, VOCAB]})},
        ["ids.jsonl", *TOKENS],
        rf"^error: ids\.jsonl:2: token id outside the vocabulary \[0, {VOCAB}\)" + FIX,
    ),
    case(
        "tokens-negative",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, -5]})},
        ["ids.jsonl", *TOKENS],
        rf"^error: ids\.jsonl:2: token id outside the vocabulary \[0, {VOCAB}\)" + FIX,
    ),
    case(
        "tokens-float",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, 2.5]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:2: 'input_ids' must be a list of integers" + FIX,
    ),
    case(
        "tokens-strings",
        {"ids.jsonl": jsonl({"input_ids": ["a", "b"]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:1: 'input_ids' must be a list of integers" + FIX,
    ),
    case(
        "tokens-beyond-int64",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, '{"input_ids": [1, 99999999999999999999999]}')},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:2: 'input_ids' holds an integer beyond int64" + FIX,
    ),
    case(
        "tokens-not-a-list",
        {"ids.jsonl": jsonl({"input_ids": 7})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:1: 'input_ids' must be a list of integers" + FIX,
    ),
    case(
        "tokens-missing-key",
        {"ids.jsonl": jsonl({"ids": [1, 2]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:1: missing key 'input_ids' \(keys found: ids\)" + FIX,
    ),
    case(
        "tokens-nested-list",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, [2], 3]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:2: 'input_ids' must be a list of integers" + FIX,
    ),
    case(
        "tokens-booleans",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, True, 3]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:2: 'input_ids' must be a list of integers" + FIX,
    ),
    case(
        "tokens-loss-mask-length",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3], "loss_mask": [1, 1]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:2: loss_mask has a different length than input_ids" + FIX,
    ),
    case(
        "tokens-loss-mask-values",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:1: loss_mask values must be 0 or 1" + FIX,
    ),
    case(
        "tokens-loss-mask-float",
        {"ids.jsonl": jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [1, 2], "loss_mask": [0.5, 1]})},
        ["ids.jsonl", *TOKENS],
        r"^error: ids\.jsonl:2: .*loss_mask",
    ),
    # --- --format tokens, Parquet -----------------------------------------------------------------
    case(
        "tokens-parquet-out-of-vocabulary",
        {"ids.parquet": parquet(pa.table({"input_ids": pa.array([[1, 2], [3, 60000]], LIST)}))},
        ["ids.parquet", *TOKENS],
        rf"^error: ids\.parquet row 1: token id outside the vocabulary \[0, {VOCAB}\)" + FIX,
    ),
    case(
        "tokens-parquet-negative",
        {"ids.parquet": parquet(pa.table({"input_ids": pa.array([[1, 2], [3, -1]], LIST)}))},
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet row 1: token id outside the vocabulary",
    ),
    case(
        "tokens-parquet-loss-mask-length",
        {
            "ids.parquet": parquet(
                pa.table(
                    {
                        "input_ids": pa.array([[1, 2], [3, 4]], LIST),
                        "loss_mask": pa.array([[1, 1], [1]], LIST),
                    }
                )
            )
        },
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet row 1: loss_mask has a different length than input_ids" + FIX,
    ),
    case(
        "tokens-parquet-null-list",
        {"ids.parquet": parquet(pa.table({"input_ids": pa.array([[1, 2], None], LIST)}))},
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet row 1: input_ids is null" + FIX,
    ),
    case(
        "tokens-parquet-float-values",
        {"ids.parquet": parquet(pa.table({"input_ids": pa.array([[1.0, 2.0]], pa.list_(pa.float64()))}))},
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet: input_ids values of type double are not integers$",
    ),
    case(
        "tokens-parquet-string-column",
        {"ids.parquet": parquet(pa.table({"input_ids": ["1 2 3"]}))},
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet: column of type string is not a list of integers$",
    ),
    case(
        "tokens-parquet-no-column",
        {"ids.parquet": parquet(pa.table({"tokens": pa.array([[1, 2]], LIST)}))},
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet: no 'input_ids' column for --format tokens \(columns: \['tokens'\]\)$",
    ),
    case(
        "tokens-parquet-null-element",
        {"ids.parquet": parquet(pa.table({"input_ids": pa.array([[1, 2], [3, None, 4]], LIST)}))},
        ["ids.parquet", *TOKENS],
        r"^error: ids\.parquet row 1: .*null",
    ),
]


@pytest.fixture(scope="module")
def pack_runs(request, tmp_path_factory):
    return run_table(request, tmp_path_factory, "test_pack_refuses_bad_input", PACK_CASES, "pack")


@pytest.mark.parametrize(("files", "args", "pattern"), PACK_CASES)
def test_pack_refuses_bad_input(request, pack_runs, files, args, pattern):
    folder, result = pack_runs[request.node.callspec.id]
    line = assert_one_error_line(result)
    assert re.search(pattern, line), line
    assert not (folder / "out").exists(), "nothing is written on an error"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [], "a staging folder was left"


def test_bom_is_accepted(tmp_path):
    """A UTF-8 byte order mark (Windows editors write one) is ignored, not a malformed first line."""
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl(GOOD, GOOD))
    result = run_cli("pack", "bom.jsonl", *PACK, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert (counts["samples_in"], counts["packed"], counts["bad_rows"]) == (2, 2, 0)


def test_malformed_json_messages_read_cleanly():
    """The reason of a malformed line, as `tokenize.parse_chunk` gives it for lines read from a file
    (with their newline): the right column, the right diagnosis, readable wording."""
    lines = [b'{"input": "x", "output": \n', b'{"input": "quest\n', b'{"input": "a\x00b"}\n']
    reasons = [str(row) for _, row in parse_chunk(Chunk(0, "x.jsonl", lines=lines, positions=[1, 2, 3]))]
    assert reasons[0] == "malformed JSON: Expecting value at column 26", reasons  # not "column 1"
    assert reasons[1].startswith("malformed JSON: Unterminated string starting at"), reasons
    assert reasons[2].startswith("malformed JSON: Invalid control character"), reasons
    assert not any(" at at " in reason for reason in reasons), reasons


# ------------------------------------------------------------------------------------------------
# --skip-bad-lines: every row read is packed, skipped or excluded, and accounted for
# ------------------------------------------------------------------------------------------------


def packed_sample_indexes(folder: Path) -> list[int]:
    indexes = []
    for shard in sorted(folder.glob("*.parquet")):
        for row in pq.read_table(shard, columns=["sample_index"]).column("sample_index").to_pylist():
            indexes.extend(row)
    return sorted(indexes)


def assert_nothing_lost(out: Path, samples_in: int) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    counts, excluded = manifest["counts"], manifest["excluded"]
    assert counts["samples_in"] == samples_in
    assert (
        counts["packed"] + counts["bad_rows"] + counts["dropped_long"] + counts["no_supervised"] == samples_in
    )
    assert counts["bad_rows"] == len(manifest["bad_rows"])
    packed = packed_sample_indexes(out)
    skipped = [row["sample_index"] for row in manifest["bad_rows"]]
    dropped = excluded["dropped_long"] + excluded["no_supervised"]
    assert len(packed) == counts["packed"]
    assert sorted(packed + skipped + dropped) == list(range(samples_in)), "each row in exactly one place"
    assert set(excluded["truncated"]) <= set(packed)
    return manifest


def test_skip_bad_lines_accounts_for_every_row(tmp_path):
    long_words = "word " * 200
    lines = {  # line number -> content; the expected fate of each row is in the asserts below
        1: GOOD,
        2: '{"input": "x", "output": ',
        3: [1, 2],
        4: 42,
        5: {"messages": "hello"},
        6: {"messages": [{"role": "user"}]},
        7: {"messages": [{"role": "user", "content": 5}]},
        8: {"input": 5, "output": "x"},
        9: {"input": "x", "output": ["y"]},
        10: {"messages": [{"role": "robot", "content": "beep"}]},
        11: "",
        12: {"messages": [{"role": "user", "content": "hello"}]},  # no assistant turn
        13: b'{"input": "a\x00b", "output": "c"}',
        14: b'{"input": "caf\xe9", "output": "ok"}',
        15: CHAT,
        16: {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_words}]},
        17: {"input": long_words, "output": "end"},  # the prompt is trimmed: the completion is kept
        18: GOOD,
    }
    (tmp_path / "mixed.jsonl").write_bytes(jsonl(*lines.values()))
    result = run_cli("pack", "mixed.jsonl", *PACK, "--skip-bad-lines", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr

    index = {line: line - 1 if line < 11 else line - 2 for line in lines if line != 11}  # blank line 11
    expected_bad = {
        2: "malformed JSON",
        3: "expected a JSON object, got list",
        4: "expected a JSON object, got int",
        5: "'messages' must be a non-empty list",
        6: "message 0 (user) must have a string 'content'",
        7: "message 0 (user) must have a string 'content', got int",
        8: "key 'input' must be a string, got int",
        9: "key 'output' must be a string, got list",
        10: "message 0 has unknown role 'robot'",
        13: "malformed JSON: Invalid control character",
        14: "invalid UTF-8 at byte 14 of the line",
    }
    manifest = assert_nothing_lost(tmp_path / "out", samples_in=17)
    bad_rows = manifest["bad_rows"]
    assert [row["location"] for row in bad_rows] == [f"mixed.jsonl:{line}" for line in expected_bad]
    assert [row["sample_index"] for row in bad_rows] == [index[line] for line in expected_bad]
    for row, reason in zip(bad_rows, expected_bad.values(), strict=True):
        assert row["reason"].startswith(reason), row
    assert manifest["excluded"]["no_supervised"] == [index[12]]
    assert manifest["excluded"]["truncated"] == [index[16], index[17]]
    assert packed_sample_indexes(tmp_path / "out") == [index[1], index[15], index[16], index[17], index[18]]

    for label, value in [
        ("samples in", "17"),
        ("packed", "5"),
        ("  of which truncated", "2"),
        ("    prompt trimmed", "1"),
        ("    answer cut", "1"),
        ("dropped (no supervised token)", "1"),
        ("bad rows skipped", "11"),
    ]:
        assert summary_value(result.stdout, label) == value
    stderr = result.stderr.splitlines()
    assert stderr[:5] == [
        f"skipped mixed.jsonl:{line}: {bad_rows[i]['reason']}" for i, line in enumerate([2, 3, 4, 5, 6])
    ]
    assert stderr[5:] == ["... and 6 more bad rows (listed in the manifest)"]


def test_skip_bad_lines_with_pretokenized_rows(tmp_path):
    rows = [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [1, VOCAB]},
        {"input_ids": [-1, 4]},
        {"input_ids": [1.5]},
        {"input_ids": ["a"]},
        {"input_ids": [1, 2, 3], "loss_mask": [1, 1]},
        {"input_ids": [1, 2, 3], "loss_mask": [1, 2, 1]},
        {"ids": [1]},
        {"input_ids": [5, 6], "loss_mask": [0, 0]},  # nothing supervised
        {"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
    ]
    (tmp_path / "ids.jsonl").write_bytes(jsonl(*rows))
    result = run_cli("pack", "ids.jsonl", *TOKENS, "--skip-bad-lines", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = assert_nothing_lost(tmp_path / "out", samples_in=10)
    assert [row["location"] for row in manifest["bad_rows"]] == [f"ids.jsonl:{n}" for n in range(2, 9)]
    assert [row["reason"] for row in manifest["bad_rows"]] == [
        f"token id outside the vocabulary [0, {VOCAB})",
        f"token id outside the vocabulary [0, {VOCAB})",
        "'input_ids' must be a list of integers",
        "'input_ids' must be a list of integers",
        "loss_mask has a different length than input_ids",
        "loss_mask values must be 0 or 1",
        "missing key 'input_ids' (keys found: ids)",
    ]
    assert manifest["excluded"]["no_supervised"] == [8]
    # 1, 2, 3 + EOS all supervised: 3 labels; 7, 8, 9 with mask 0, 1, 1 + EOS: labels 8, 9, EOS
    assert manifest["counts"]["supervised_packed"] == 3 + 3
    assert summary_value(result.stdout, "bad rows skipped") == "7"


def test_skip_bad_lines_keeps_the_loss_mask_of_good_parquet_rows(tmp_path):
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2, 3, 4], [3, 4]], LIST),
            "loss_mask": pa.array([[0, 0, 1, 1], [1]], LIST),
        }
    )
    pq.write_table(table, tmp_path / "ids.parquet")
    result = run_cli("pack", "ids.parquet", *TOKENS, "--skip-bad-lines", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = assert_nothing_lost(tmp_path / "out", samples_in=2)
    assert [row["location"] for row in manifest["bad_rows"]] == ["ids.parquet row 1"]
    assert manifest["counts"]["supervised_packed"] == 3  # labels 2, 3, 4 -> mask 0, 1, 1 and EOS 1


def test_huge_line_is_truncated_and_counted(tmp_path):
    """An 8 MB row (1.6M tokens) in one line: no crash, truncated to the cap, counted as truncated."""
    huge = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 1_600_000}]
    }
    (tmp_path / "huge.jsonl").write_bytes(jsonl(GOOD, huge, GOOD))
    result = run_cli("pack", "huge.jsonl", *PACK, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    manifest = assert_nothing_lost(tmp_path / "out", samples_in=3)
    counts = manifest["counts"]
    assert (counts["packed"], counts["truncated"]) == (3, 1)
    assert manifest["excluded"]["truncated"] == [1]
    # the answer lost its middle before tokenizing (it is far beyond any cap): tokens are counted after that
    assert counts["texts_cut_before_tokenizing"] == 1 and counts["truncated_answer_cut"] == 1
    assert counts["tokens_lost"] > 0
    assert summary_value(result.stdout, "  of which truncated") == "1"


# ------------------------------------------------------------------------------------------------
# tightpack inspect: hostile packed data
# ------------------------------------------------------------------------------------------------


class _Call:
    """Pickles as a call of ``function(*args)``: the shape of every pickle exploit."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _npy_with_payload(path: Path, payload: bytes) -> None:
    with open(path, "wb") as handle:
        npy_format.write_array_header_1_0(handle, {"descr": "|O", "fortran_order": False, "shape": (1,)})
        handle.write(payload)


def _npy_rows(path: Path, rows: list) -> None:
    array = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        array[i] = row
    np.save(path, array, allow_pickle=True)


ROW = {"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1], "seq_start_id": [0]}


@pytest.mark.parametrize(
    "write",
    [
        lambda path, s: _npy_with_payload(path, pickle.dumps(_Call(os.system, f"touch {s}"), protocol=4)),
        lambda path, s: _npy_rows(path, [{**ROW, "sample_index": _Call(os.system, f"touch {s}")}]),
        lambda path, s: _npy_rows(path, [ROW, _Call(builtins.exec, f"open({str(s)!r}, 'w').close()")]),
    ],
    ids=["os.system-as-payload", "os.system-in-a-row", "exec-as-a-row"],
)
def test_inspect_refuses_a_pickled_exploit_without_running_it(tmp_path, write):
    sentinel = tmp_path / "SENTINEL"
    write(tmp_path / "evil.npy", sentinel)
    line = assert_one_error_line(run_cli("inspect", "evil.npy", cwd=tmp_path))
    assert re.search(r"^error: evil\.npy: unsafe or unsupported pickle payload, refused to load ", line), line
    assert "Nothing in it was executed" in line
    assert not sentinel.exists(), "the payload ran"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A real tightpack output (Parquet) and a legacy .npy one, packed once for the inspect cases."""
    folder = tmp_path_factory.mktemp("packed")
    rows = [{"input": f"question {i} " * (1 + i % 5), "output": f"answer {i}"} for i in range(60)]
    for output_format in ("parquet", "npy"):
        config = PackConfig(packed_sequence_size=64, workers=1, output_format=output_format)
        pack_dataset(rows, folder / output_format, config)
    return folder


SHARD = "packs-00000.idx.parquet"


def _edit_json(path: Path, change: Callable) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


INSPECT_CASES = [
    case(
        "npy-garbage",
        {"npy/packs.npy": garbage(1000)},
        ["npy/packs.npy"],
        r"^error: npy/packs\.npy is not a readable \.npy file \(.*magic string",
    ),
    case(
        "npy-truncated",
        {"npy/packs.npy": lambda p: p.write_bytes(truncated(p.read_bytes()))},
        ["npy/packs.npy"],
        r"^error: npy/packs\.npy: cannot unpickle the payload \(UnpicklingError: pickle data was truncated\)",
    ),
    case(
        "npy-header-only",
        {"npy/packs.npy": lambda p: p.write_bytes(p.read_bytes()[:60])},
        ["npy/packs.npy"],
        r"^error: npy/packs\.npy is not a readable \.npy file \(truncated",
    ),
    case(
        "parquet-garbage",
        {f"parquet/{SHARD}": garbage()},
        ["parquet"],
        rf"^error: parquet/{re.escape(SHARD)}: not a readable Parquet file \(.*magic bytes",
    ),
    case(
        "parquet-truncated",
        {f"parquet/{SHARD}": lambda p: p.write_bytes(truncated(p.read_bytes()))},
        ["parquet"],
        rf"^error: parquet/{re.escape(SHARD)}: not a readable Parquet file",
    ),
    case(
        "parquet-corrupt-pages",
        {f"parquet/{SHARD}": corrupt_pages},
        ["parquet"],
        rf"^error: parquet/{re.escape(SHARD)}: cannot read row group 0 \(",
    ),
    case(
        "parquet-wrong-schema",
        {f"parquet/{SHARD}": parquet(pa.table({"input_ids": pa.array([[1, 2]], LIST)}))},
        ["parquet"],
        r"is missing required columns: loss_mask, seq_start_id$",
    ),
    case(
        "manifest-malformed",
        {"parquet/manifest.json": '{"settings": '},
        ["parquet"],
        r"^error: parquet/manifest\.json: ",
    ),
    case(
        "manifest-missing-keys",
        {"parquet/manifest.json": "{}"},
        ["parquet"],
        r"^error: parquet/manifest\.json: ",
    ),
]


@pytest.fixture(scope="module")
def inspect_runs(request, tmp_path_factory, packed):
    def copy_packed(folder: Path) -> None:
        for output_format in ("parquet", "npy"):
            shutil.copytree(packed / output_format, folder / output_format)

    test = "test_inspect_refuses_bad_packed_data"
    return run_table(request, tmp_path_factory, test, INSPECT_CASES, "inspect", prepare=copy_packed)


@pytest.mark.parametrize(("files", "args", "pattern"), INSPECT_CASES)
def test_inspect_refuses_bad_packed_data(request, inspect_runs, files, args, pattern):
    _, result = inspect_runs[request.node.callspec.id]
    line = assert_one_error_line(result)
    assert re.search(pattern, line), line


DISAGREEING = {
    "metadata-disagrees": (
        "metadata.json",
        lambda m: m[0].update(pack_size=32, max_samples_per_bin=99),
        "metadata",
        "metadata.json says",
    ),
    "manifest-counts-disagree": (
        "manifest.json",
        lambda m: m["counts"].update(packed=999),
        "manifest",
        "the manifest counts 999 packed sequences",
    ),
}


@pytest.mark.parametrize("case_name", DISAGREEING)
def test_verify_names_metadata_and_manifest_that_disagree_with_the_data(tmp_path, packed, case_name):
    """`inspect` summarizes and does not compare; `verify` names both faults."""
    name, change, check, fragment = DISAGREEING[case_name]
    folder = tmp_path / "parquet"
    shutil.copytree(packed / "parquet", folder)
    _edit_json(folder / name, change)
    result = run_cli("verify", folder, "--json", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert check in report["counts"] and any(fragment in v["message"] for v in report["violations"]), report
