"""The ``tightpack`` command line, as a person runs it.

Every user error must exit with status 2 and say what is wrong in one ``error:`` line, with no
traceback. Runs use ``--workers 1`` (one with 2) and small inputs to stay quick on 2 cores.

Most runs call its entry point in this process (`run_main`: the exit status and output of the command,
without a second of interpreter start-up each); a subprocess runs what needs a process of its own: the
console script and ``python -m tightpack.cli``, worker processes, Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tightpack
from tightpack.core.cost_model import CostModel

from .conftest import CliRun, run_main, write_jsonl

PROGRESS_LINE = re.compile(r"^\s*(tokenize|plan|write)\b")


def run_cli(*args, cwd: Path) -> CliRun:
    """``tightpack ARGS`` in ``cwd``, in this process."""
    return run_main(args, cwd=cwd)


def run_process(*args, cwd: Path, executable: list[str] | None = None) -> subprocess.CompletedProcess:
    """``tightpack ARGS`` in ``cwd``, in a subprocess (default: ``python -m tightpack.cli``)."""
    command = (executable or [sys.executable, "-m", "tightpack.cli"]) + [str(a) for a in args]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def error_line(result: CliRun) -> str:
    """The single ``error:`` line of a user error; other stderr lines may only be progress bars."""
    assert result.returncode == 2, f"exit status {result.returncode}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0], "the error is the last thing printed"
    noise = [line for line in lines[:-1] if line.strip() and not PROGRESS_LINE.match(line)]
    assert noise == [], f"unexpected stderr lines: {noise}"
    assert result.stdout == ""
    return errors[0]


def summary_value(stdout: str, label: str) -> str:
    """A value of the summary table (``│ label │ value │``)."""
    match = re.search(rf"│ {re.escape(label)}\s*│\s*(.+?)\s*│", stdout)
    assert match, f"{label!r} not in the summary:\n{stdout}"
    return match.group(1)


@pytest.fixture
def corpus(tmp_path, prompt_completion_rows) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows[:40])


@pytest.fixture
def bad_inputs(tmp_path) -> Path:
    """Small JSONL files, each with one bad line (line 3 or 2), in tmp_path/inputs."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    good = [json.dumps({"input": "question one", "output": "answer one"})] * 2
    (folder / "malformed.jsonl").write_text("\n".join([*good, '{"input": "x", "output": ', good[0]]) + "\n")
    (folder / "missing_key.jsonl").write_text(
        "\n".join([good[0], json.dumps({"prompt": "x", "output": "y"}), good[0]]) + "\n"
    )
    (folder / "utf8.jsonl").write_bytes(
        good[0].encode() + b'\n{"input": "caf\xe9", "output": "ok"}\n' + good[0].encode() + b"\n"
    )
    write_jsonl(folder / "role.jsonl", [{"messages": [{"role": "robot", "content": "beep"}]}])
    write_jsonl(
        folder / "long.jsonl", [{"input": "a", "output": "b"}, {"input": "word " * 80, "output": "z"}]
    )
    write_jsonl(folder / "good.jsonl", [{"input": "a b", "output": "c d"}])
    write_jsonl(folder / "ids.jsonl", [{"input_ids": [5, 6, 7]}])
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "manifest.json").write_text("{}")
    return folder


class TestPack:
    def test_pack_prints_the_summary_and_writes_the_output(self, tmp_path, corpus):
        result = run_cli(
            "pack", corpus, "--output", tmp_path / "out", "--pack-size", 256, "--pad-seq-to-mult", 4,
            "--workers", 1, cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr and "error:" not in result.stderr
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        counts = manifest["counts"]
        assert counts["samples_in"] == counts["packed"] == 40
        assert summary_value(result.stdout, "samples in") == "40"
        assert summary_value(result.stdout, "packed") == "40"
        assert summary_value(result.stdout, "bad rows skipped") == "0"
        assert summary_value(result.stdout, "tokens packed / in") == (
            f"{counts['tokens_packed']:,} / {counts['tokens_in']:,}"
        )
        efficiency = summary_value(result.stdout, "efficiency")
        assert efficiency.startswith(f"{manifest['stats']['efficiency']:.2%}")
        packs = summary_value(result.stdout, "packs (lower bound)")
        assert packs == f"{manifest['stats']['packs']} ({manifest['stats']['lower_bound']})"
        assert manifest["settings"]["pad_seq_to_mult"] == 4
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
            "manifest.json",
            "metadata.json",
            "packs-00000.idx.parquet",
        ]

    def test_docs_formats_names_every_key_of_a_mixture_manifest(self, tmp_path, prompt_completion_rows):
        """docs/formats.md's manifest table has a row for the mixture's keys and counts (`--weights`),
        present only when the run mixes its inputs."""
        first = write_jsonl(tmp_path / "a.jsonl", prompt_completion_rows[:60])
        second = write_jsonl(tmp_path / "b.jsonl", prompt_completion_rows[60:80])
        result = run_cli(
            "pack", first, second, "-o", tmp_path / "mixed", "--pack-size", 256, "--weights", "1,1",
            "--max-repetitions", 3, "--mix-window", 4, cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        manifest = json.loads((tmp_path / "mixed" / "manifest.json").read_text())
        mixture = manifest["mixture"]
        assert manifest["counts"]["mixture_repeats"] > 0 and manifest["counts"]["mixture_left_out"] > 0
        page = (Path(__file__).parents[1] / "docs" / "formats.md").read_text(encoding="utf-8")
        table = page[page.index("## manifest.json") :].split("\n\n")[2]
        rows = {
            row.split(" | ")[0].strip("| "): row.split(" | ", 1)[1]
            for row in table.splitlines()
            if row.startswith("| `")
        }
        documented = lambda key: next(  # noqa: E731
            (text for names, text in rows.items() if f"`{key}`" in names.split(", ")), None
        )
        described = {
            "counts.mixture_left_out": documented("counts.mixture_left_out"),
            "counts.mixture_repeats": documented("counts.mixture_repeats"),
            "excluded.mixture_left_out": documented("excluded.mixture_left_out"),
            "mixture": documented("mixture"),
            "mixture.sources": documented("mixture.sources"),
            "mixture.windows": documented("mixture.windows"),
            "mixture.window_shares": documented("mixture.window_shares"),
        }
        assert None not in described.values(), described
        for key in ("counts.mixture_left_out", "excluded.mixture_left_out", "mixture"):
            assert described[key].startswith("only when the run mixes its inputs"), key
        for key in mixture:
            assert f"`{key}`" in described["mixture"], key
        for key in mixture["sources"][0]:
            assert f"`{key}`" in described["mixture.sources"], key
        for key in mixture["windows"]:
            assert f"`{key}`" in described["mixture.windows"] + described["mixture.sources"], key
        plain = run_cli("pack", first, "-o", tmp_path / "plain", "--pack-size", 256, cwd=tmp_path)
        assert plain.returncode == 0, plain.stderr
        unmixed = json.loads((tmp_path / "plain" / "manifest.json").read_text())
        assert "mixture" not in unmixed and "mixture_left_out" not in unmixed["excluded"]
        assert not {"mixture_left_out", "mixture_repeats"} & unmixed["counts"].keys()

    def test_two_workers_write_the_same_files_as_one(self, tmp_path, corpus):
        digests = []
        for workers in (1, 2):
            out = tmp_path / f"out{workers}"
            args = ("pack", corpus, "-o", out, "--pack-size", 128, "--workers", workers, "--no-reuse")
            # two workers are two processes forked from the command's: not from this one
            result = (run_cli if workers == 1 else run_process)(*args, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            assert "token store reused" not in result.stdout  # both runs tokenized
            digests.append(json.loads((out / "manifest.json").read_text())["files"])
        assert digests[0] == digests[1]
        for name in ("first", "again"):  # the first run with reuse caches the store, the second reuses it
            again = run_cli("pack", corpus, "-o", tmp_path / name, "--pack-size", 128, "--workers", 1,
                            cwd=tmp_path)  # fmt: skip
        assert "(token store reused)" in summary_value(again.stdout, "time tokenize")

    def test_skip_bad_lines_counts_and_lists_them(self, tmp_path, bad_inputs):
        result = run_cli(
            "pack", bad_inputs / "malformed.jsonl", "-o", tmp_path / "out", "--pack-size", 64,
            "--workers", 1, "--skip-bad-lines", cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert summary_value(result.stdout, "samples in") == "4"
        assert summary_value(result.stdout, "packed") == "3"
        assert summary_value(result.stdout, "bad rows skipped") == "1"
        assert re.search(r"skipped .*malformed\.jsonl:3: malformed JSON", result.stderr)
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert manifest["counts"]["bad_rows"] == 1
        [bad] = manifest["bad_rows"]
        assert bad["sample_index"] == 2
        assert bad["location"].endswith("malformed.jsonl:3")
        assert bad["reason"].startswith("malformed JSON")

    def test_overwrite_replaces_an_existing_output(self, tmp_path, corpus):
        out = tmp_path / "out"
        for pack_size in (128, 256):
            result = run_cli(
                "pack", corpus, "-o", out, "--pack-size", pack_size, "--workers", 1, "--overwrite",
                cwd=tmp_path,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
        assert json.loads((out / "manifest.json").read_text())["settings"]["packed_sequence_size"] == 256

    def test_pack_help(self, tmp_path):
        result = run_cli("pack", "--help", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        for option in ("--output", "--pack-size", "--tokenizer", "--format", "--skip-bad-lines"):
            assert option in result.stdout
        assert not (tmp_path / "packed-demo").exists(), "--help must not run the demo"
        seed = re.search(r"--seed\s.*?\[default: 0\]", result.stdout, re.S).group(0)
        text = " ".join(seed.replace("│", " ").split())  # --seed seeds the mixture too (docs/mixtures.md)
        said = "Seed of first_fit_shuffle and, with --weights, of the mixture's subsampling and of the order"
        assert f"{said} of each pass over a source (docs/mixtures.md)." in text, text


class TestUserErrors:
    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (
                ["{inputs}/malformed.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: .*malformed\.jsonl:3: malformed JSON: .*pass --skip-bad-lines\)$",
            ),
            (
                ["{inputs}/missing_key.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: .*missing_key\.jsonl:2: missing key 'input' \(keys found: output, prompt\)",
            ),
            (
                ["{inputs}/utf8.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: .*utf8\.jsonl:2: invalid UTF-8 at byte 14 of the line",
            ),
            (
                ["{inputs}/role.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: .*role\.jsonl:1: message 0 has unknown role 'robot'",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "64", "--tokenizer", "no/such/tok"],
                r"^error: tokenizer path 'no/such/tok' does not exist",
            ),
            (  # pre-tokenized rows after text rows, and the other way round: they do not mix
                ["{inputs}/good.jsonl", "{inputs}/ids.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: .*ids\.jsonl:1: missing key 'input' \(keys found: input_ids\): a pre-tokenized row "
                r"does not mix with text rows in one run",
            ),
            (
                ["{inputs}/ids.jsonl", "{inputs}/good.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: .*good\.jsonl:1: missing key 'input_ids' \(keys found: input, output\); this run "
                r"reads pre-tokenized rows, as its first row is one: text rows do not mix with them",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "1"],
                r"^error: --pack-size must be an integer of at least 2, got 1$",
            ),
            (
                [
                    "{inputs}/good.jsonl",
                    "-o",
                    "out",
                    "--pack-size",
                    "64",
                    "--max-seq-length",
                    "7",
                    "--pad-seq-to-mult",
                    "8",
                ],
                r"^error: --max-seq-length \(7\) must be at least the effective padding multiple \(8\); "
                r"raise the length or lower --pad-seq-to-mult / the parallel sizes$",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "8", "--cp", "8"],
                r"^error: --max-seq-length \(8\) must be at least the effective padding multiple \(16\)",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "64", "--tp", "0"],
                r"^error: --tp must be a positive integer, got 0$",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "64", "--workers", "-1"],
                r"^error: --workers must be at least 1, got -1$",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "64", "--workers", "0"],
                r"^error: --workers must be at least 1, got 0$",
                id="zero-workers",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "0"],
                r"^error: --pack-size must be an integer of at least 2, got 0$",
                id="zero-pack-size",
            ),
            (
                ["{inputs}/long.jsonl", "-o", "out", "--pack-size", "32", "--long-samples", "error"],
                r"^error: 1 samples are longer than the cap of 32 tokens \(first: \S*long\.jsonl row 2 "
                r"\(source row 1\), \d+ tokens\)",
            ),
            (
                ["{inputs}/good.jsonl", "--pack-size", "64"],
                r"^error: --output is required when inputs are given$",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "out"],
                r"^error: --pack-size is required when inputs are given",
            ),
            (
                ["{inputs}/good.jsonl", "-o", "existing", "--pack-size", "64"],
                r"^error: output 'existing' already exists; pass --overwrite to replace it$",
            ),
            (
                ["{inputs}/absent.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: input '.*absent\.jsonl' does not exist or is not a file$",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "{inputs}/good.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: input '.*good\.jsonl' is given twice as '.*good\.jsonl': it would be packed "
                r"twice; give each input once; to up-sample a dataset on purpose, give it a larger share "
                r"with --weights \.\.\. --max-repetitions \(docs/mixtures\.md\)$",
                id="same-input-twice",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "{inputs}/g*.jsonl", "-o", "out", "--pack-size", "64"],
                r"^error: input '.*good\.jsonl' is given by both '.*inputs/good\.jsonl' and "
                r"'.*inputs/g\*\.jsonl': it would be packed twice",
                id="path-and-pattern",
            ),
            pytest.param(
                ["existing", "-o", "out", "--pack-size", "64"],
                r"^error: input 'existing' is a packed folder \(tightpack's manifest\.json, or "
                r"Megatron-Bridge's metadata\), not rows: inputs are JSONL or Parquet rows; to see the "
                r"packs run `tightpack inspect existing`, to re-pack give the rows they were packed from$",
                id="packed-folder-input",
            ),
            pytest.param(
                ["{inputs}", "-o", "out", "--pack-size", "64"],
                r"^error: input '.*inputs' is a folder: give its files, or a pattern such as "
                r"'.*inputs/\*\.jsonl'$",
                id="folder-input",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "64", "--format", "xml"],
                r"^error: .*'xml' is not one of",
                id="unknown-format",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "many"],
                r"^error: .*valid integer",
                id="non-integer-pack-size",
            ),
            pytest.param(
                ["{inputs}/good.jsonl", "-o", "out", "--pack-size", "64", "--bogus"],
                r"^error: No such option: --bogus",
                id="unknown-option",
            ),
        ],
    )
    def test_exits_2_with_one_error_line(self, tmp_path, bad_inputs, args, message):
        args = [arg.format(inputs=bad_inputs) for arg in args]
        if "--workers" not in args:
            args += ["--workers", "1"]
        line = error_line(run_cli("pack", *args, cwd=tmp_path))
        assert re.search(message, line), line
        assert not (tmp_path / "out").exists(), "nothing is written on an error"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging folder left"

    @pytest.mark.parametrize(
        "args",
        [["--pack-size", "1"], ["--pack-size", "64", "--tokenizer", "no/such/tok"]],
        ids=["impossible-size", "unknown-tokenizer"],
    )
    def test_stderr_is_exactly_the_error_line(self, tmp_path, bad_inputs, args):
        result = run_cli("pack", bad_inputs / "good.jsonl", "-o", "out", "--workers", 1, *args, cwd=tmp_path)
        assert result.returncode == 2
        assert len(result.stderr.splitlines()) == 1, repr(result.stderr)

    def test_tokenizer_folder_without_tokenizer(self, tmp_path, bad_inputs):
        (tmp_path / "notok").mkdir()
        result = run_cli(
            "pack", bad_inputs / "good.jsonl", "-o", "out", "--pack-size", 64, "--workers", 1,
            "--tokenizer", tmp_path / "notok", cwd=tmp_path,
        )  # fmt: skip
        line = error_line(result)
        assert re.search(r"^error: cannot load a tokenizer from '.*notok'", line)

    def test_no_command_prints_help_without_traceback(self, tmp_path):
        result = run_cli(cwd=tmp_path)
        assert "Traceback" not in result.stderr
        assert "pack" in result.stdout + result.stderr


def write_megatron_bridge_folder(folder: Path) -> Path:
    """Two packs as Megatron-Bridge writes them (no manifest, no sample_index).

    Pack 0: sequences of 5 and 3 stored tokens (runtime 4 + 2 = 6), 5 supervised labels.
    Pack 1: one sequence of 4 stored tokens (runtime 3), 3 supervised labels.
    """
    folder.mkdir()
    table = pa.table(
        {
            "input_ids": pa.array([[11, 12, 13, 14, 15, 21, 22, 23], [31, 32, 33, 34]], pa.list_(pa.int64())),
            "loss_mask": pa.array([[0, 1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 0]], pa.list_(pa.int8())),
            "seq_start_id": pa.array([[0, 5], [0]], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, folder / "training.idx.parquet")
    return folder


class TestInspect:
    def test_our_output(self, tmp_path, corpus):
        out = tmp_path / "out"
        packed = run_cli(
            "pack",
            corpus,
            "-o",
            out,
            "--pack-size",
            128,
            "--pad-seq-to-mult",
            8,
            "--workers",
            1,
            cwd=tmp_path,
        )
        assert packed.returncode == 0, packed.stderr
        manifest = json.loads((out / "manifest.json").read_text())
        counts, stats = manifest["counts"], manifest["stats"]

        result = run_cli("inspect", out, "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["packs"] == stats["packs"]
        assert summary["sequences"] == counts["packed"] == 40
        assert summary["runtime_tokens"] == counts["tokens_packed"] + counts["alignment_padding"]
        assert summary["supervised_tokens"] == counts["supervised_packed"]
        assert summary["max_samples_per_pack"] == stats["max_samples_per_pack"]
        assert summary["min_packed_length"] == stats["min_packed_length"]
        assert summary["pack_size"] == 128
        assert summary["efficiency"] == pytest.approx(stats["efficiency"])
        assert summary["over_pack_size"] == 0
        assert summary["manifest"]["counts"] == counts

        table = run_cli("inspect", out, cwd=tmp_path)
        assert table.returncode == 0, table.stderr
        assert summary_value(table.stdout, "packs") == f"{stats['packs']:,}"
        assert summary_value(table.stdout, "sequences") == "40"
        assert summary_value(table.stdout, "tokenizer") == "gpt2 (built-in)"
        assert summary_value(table.stdout, "alignment multiple") == "8"
        assert summary_value(table.stdout, "count packed") == "40"

    def test_megatron_bridge_folder(self, tmp_path):
        folder = write_megatron_bridge_folder(tmp_path / "mb")
        result = run_cli("inspect", folder, "--pack-size", 8, "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary == {
            "path": str(folder),
            "files": 1,
            "packs": 2,
            "sequences": 3,
            "runtime_tokens": 9,  # (8 - 2) + (4 - 1)
            "supervised_tokens": 8,  # 5 + 3
            "max_samples_per_pack": 2,
            "min_packed_length": 3,
            "max_packed_length": 6,
            "mean_packed_length": 4.5,
            "packing_factor": 1.5,
            "pack_size": 8,
            "efficiency": 9 / 16,
            "over_pack_size": 0,
        }
        table = run_cli("inspect", folder, "--pack-size", 5, cwd=tmp_path)
        assert table.returncode == 0, table.stderr
        assert summary_value(table.stdout, "efficiency") == "90.00%"  # 9 / (2 * 5), as pack prints it
        assert summary_value(table.stdout, "over pack size") == "1"  # pack 0 holds 6 > 5

    def test_cost_spread_under_a_cost_model(self, tmp_path):
        """Pack 0 holds sequences of 4 and 2 runtime tokens, pack 1 one of 3: with cost s + s^2 + 10 per
        sequence, 6 + 20 + 20 = 46 and 3 + 9 + 10 = 22."""
        folder = write_megatron_bridge_folder(tmp_path / "mb")
        model = tmp_path / "cost.json"
        CostModel(linear=1, quadratic=1, per_sequence=10, unit="seconds").save(model)
        summary = json.loads(run_cli("inspect", folder, "--cost-model", model, "--json", cwd=tmp_path).stdout)
        cost = summary["cost"]
        assert cost["model"]["unit"] == "seconds"
        assert (cost["mean"], cost["max_over_mean"]) == (34.0, pytest.approx(46 / 34))
        assert cost["cv"] == pytest.approx(12 / 34)  # population std of [46, 22]
        llama = CostModel.named("llama-8b")
        costs = [llama.linear * 6 + llama.quadratic * 20, llama.linear * 3 + llama.quadratic * 9]
        table = run_cli("inspect", folder, "--cost-model", "llama-8b", cwd=tmp_path)
        assert table.returncode == 0, table.stderr
        assert summary_value(table.stdout, "pack cost, max / mean") == f"{max(costs) / (sum(costs) / 2):.3f}"
        line = error_line(run_cli("inspect", folder, "--cost-model", "llama-9b", cwd=tmp_path))
        assert re.search(r"^error: .*llama-9b.*llama-1b, llama-8b", line), line

    def test_megatron_bridge_folder_without_pack_size(self, tmp_path):
        folder = write_megatron_bridge_folder(tmp_path / "mb")
        summary = json.loads(run_cli("inspect", folder, "--json", cwd=tmp_path).stdout)
        assert summary["pack_size"] is None
        assert "efficiency" not in summary

    def test_megatron_bridge_folder_gives_the_pack_size_of_its_metadata(self, tmp_path):
        """Megatron-Bridge writes ``<P>_metadata.jsonl`` next to its packs: its ``pack_size`` is used."""
        folder = write_megatron_bridge_folder(tmp_path / "mb")
        metadata = [{"dataset_max_seqlen": 4, "max_samples_per_bin": 2, "pack_size": 8}]
        (folder / "8_metadata.jsonl").write_text(json.dumps(metadata))
        summary = json.loads(run_cli("inspect", folder, "--json", cwd=tmp_path).stdout)
        assert (summary["pack_size"], summary["efficiency"]) == (8, 9 / 16)
        table = run_cli("inspect", folder, cwd=tmp_path)
        assert summary_value(table.stdout, "pack size") == "8"
        assert summary_value(table.stdout, "efficiency") == "56.25%"
        given = json.loads(run_cli("inspect", folder, "--pack-size", 5, "--json", cwd=tmp_path).stdout)
        assert given["pack_size"] == 5, "--pack-size wins over the metadata"

    @pytest.mark.parametrize(
        ("make", "message"),
        [
            (lambda tmp: tmp / "nowhere", r"^error: Packed Parquet spec not found: .*nowhere"),
            (lambda tmp: tmp / "empty", r"^error: No Parquet files found in directory: .*empty"),
            (lambda tmp: tmp / "empty" / "x.parquet", r"^error: Packed Parquet file not found"),
            (lambda tmp: tmp / "zero", r"^error: packed dataset '.*zero' is empty \(0 rows\)$"),
            (lambda tmp: tmp / "cols", r"^error: .* is missing required columns: seq_start_id$"),
        ],
        ids=["missing", "empty-folder", "missing-file", "zero-rows", "missing-column"],
    )
    def test_bad_paths(self, tmp_path, make, message):
        (tmp_path / "empty").mkdir()
        (tmp_path / "zero").mkdir()
        schema = pa.schema(
            [(name, pa.list_(pa.int64())) for name in ("input_ids", "loss_mask", "seq_start_id")]
        )
        pq.write_table(schema.empty_table(), tmp_path / "zero" / "a.parquet")
        (tmp_path / "cols").mkdir()
        pq.write_table(
            pa.table({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}), tmp_path / "cols" / "a.parquet"
        )
        line = error_line(run_cli("inspect", make(tmp_path), cwd=tmp_path))
        assert re.search(message, line), line


class TestVersion:
    def test_module(self, tmp_path):
        result = run_process("--version", cwd=tmp_path)
        assert (result.returncode, result.stdout) == (0, f"tightpack {tightpack.__version__}\n")

    def test_console_script(self, tmp_path):
        script = Path(sys.executable).parent / "tightpack"
        assert script.is_file(), f"console script missing next to {sys.executable}"
        result = run_process("--version", cwd=tmp_path, executable=[str(script)])
        assert (result.returncode, result.stdout) == (0, f"tightpack {tightpack.__version__}\n")


# --- issue 11: data fidelity through the command line ------------------------------------------------


def test_no_input_with_an_output_is_an_error_not_the_demo(tmp_path):
    """A shell pattern that matched nothing (nullglob) leaves no input: never pack the demo instead."""
    line = error_line(run_cli("pack", "-o", tmp_path / "out", "--pack-size", "64", cwd=tmp_path))
    assert "no input given" in line and "pattern" in line and "--demo" in line
    assert not (tmp_path / "out").exists()


def test_pack_refuses_up_front_what_verify_rejects(tmp_path, corpus):
    fixed_width = ["--cp", "2", "--pad-to-max-length", "--workers", "1"]
    line = error_line(
        run_cli("pack", corpus, "-o", tmp_path / "out", "--pack-size", "65", *fixed_width, cwd=tmp_path)
    )
    assert "not a multiple of the alignment multiple 4" in line and "--pack-size 64 or 68" in line
    done = run_cli("pack", corpus, "-o", tmp_path / "out", "--pack-size", "64", *fixed_width, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    checked = run_cli("verify", tmp_path / "out", "--cp", "2", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout


def test_summary_says_why_samples_were_cut_and_what_to_run_next(tmp_path):
    rows = [{"input": "context " * 300, "output": "the answer"}, {"input": "q", "output": "a"}]
    source = write_jsonl(tmp_path / "long.jsonl", rows)
    result = run_cli(
        "pack", source, "-o", tmp_path / "out", "--pack-size", "64", "--workers", "1", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert summary_value(result.stdout, "    prompt trimmed") == "1"
    assert f"next:   tightpack verify {tmp_path / 'out'}" in result.stdout
    assert "packed_metadata_path=" in result.stdout
    inspected = run_cli("inspect", tmp_path / "out", cwd=tmp_path)
    assert re.fullmatch(r"\d+\.\d\d%", summary_value(inspected.stdout, "efficiency"))


@pytest.mark.parametrize(
    ("split", "named", "absent"),
    [
        ("train", "packed_train_data_path={out}, packed_metadata_path=", "packed_val_data_path"),
        ("validation", "packed_val_data_path={out},", "packed_train_data_path"),
        ("test", "packed_train_data_path or packed_val_data_path={out},", "packed_metadata_path"),
    ],
)
def test_the_megatron_bridge_hint_names_the_key_of_the_split_packed(
    tmp_path, prompt_completion_rows, split, named, absent
):
    from datasets import Dataset, DatasetDict

    rows = prompt_completion_rows[:20]
    folder = tmp_path / "saved"
    splits = {name: Dataset.from_list(rows) for name in ("train", "validation", "test")}
    DatasetDict(splits).save_to_disk(folder)
    out = tmp_path / "out"
    result = run_cli(
        "pack", folder, "-o", out, "--pack-size", "256", "--workers", "1", "--split", split, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    [hint] = [line for line in result.stdout.splitlines() if line.startswith("Megatron-Bridge:")]
    assert named.format(out=out) in hint and absent not in hint, hint
    assert ("packs no test split" in hint) == (split == "test"), hint


def test_split_role_reads_the_words_of_a_split_name():
    from tightpack.cli.pack_summary import split_role

    roles = {
        None: "train", "train": "train", "train_sft": "train", "validation": "val",
        "validation_matched": "val", "val": "val", "dev": "val", "eval": "val", "test": "test",
        "test_prefs": "test", "holdout": "other",
    }  # fmt: skip
    assert {name: split_role(name) for name in roles} == roles


def test_ctrl_c_says_the_run_was_interrupted_and_stops_at_once(tmp_path, prompt_completion_rows):
    import signal
    import time

    source = write_jsonl(tmp_path / "big.jsonl", prompt_completion_rows * 1600)
    command = [
        sys.executable,
        "-m",
        "tightpack.cli",
        "pack",
        str(source),
        "-o",
        str(tmp_path / "out"),
        "--pack-size",
        "256",
        "--workers",
        "1",
        "--no-reuse",
    ]
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)  # no wall-clock assertion: the run stops, not how fast
    assert process.returncode == 130
    assert stderr.strip().splitlines()[-1].startswith("interrupted: nothing was published")
    assert not (tmp_path / "out").exists()


def test_summary_gives_the_tight_lower_bound_when_samples_exceed_half_a_pack(tmp_path):
    rows = [{"input": "word " * 30, "output": f"answer {i}"} for i in range(5)]  # ~36 tokens, pack of 64
    source = write_jsonl(tmp_path / "half.jsonl", rows)
    result = run_cli(
        "pack", source, "-o", tmp_path / "out", "--pack-size", "64", "--workers", "1", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    # no two samples share a pack: the volume bound (3) is not reachable, L2 (5) is, and is reached
    assert summary_value(result.stdout, "packs (lower bound)") == "5 (volume 3, L2 5; gap 0)"
    efficiency, at_bound = re.fullmatch(
        r"(\d+\.\d\d%) \(at the lower bound: (\d+\.\d\d%)\)", summary_value(result.stdout, "efficiency")
    ).groups()
    assert at_bound == efficiency, "the bound the packs row gives (L2: 5 packs), not the volume bound (3)"


# --- issue 26: rows and tools ------------------------------------------------------------------------


def packed_texts(folder: Path) -> list[str]:
    """The text of every packed row of ``folder`` (built-in GPT-2 tokenizer)."""
    from tightpack.prepare.tokenizer import load_tokenizer

    backend = load_tokenizer(None).backend
    rows = pq.read_table(folder / "packs-00000.idx.parquet").column("input_ids").to_pylist()
    return [backend.decode(row, skip_special_tokens=False) for row in rows]


def test_a_prompt_template_typed_with_backslash_n_gets_a_newline(tmp_path):
    """A shell passes ``"Q: {input}\\nA: {output}"`` as a backslash and an n: decoded, not trained on."""
    source = write_jsonl(tmp_path / "one.jsonl", [{"input": "hi", "output": "yo"}])
    template = r"Q: {input}\nA:\t{output}"
    result = run_cli(
        "pack", source, "-o", tmp_path / "out", "--pack-size", "64", "--workers", "1",
        "--prompt-template", template, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert packed_texts(tmp_path / "out") == ["Q: hi\nA:\tyo<|endoftext|>"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["settings"]["format"]["prompt_template"] == "Q: {input}\nA:\t{output}"


def test_a_pack_smaller_than_the_fixed_template_text_names_the_cause(tmp_path):
    """A system turn the template always keeps, longer than the cap: no answer token can stay."""
    system = {"role": "system", "content": "You are a careful assistant who answers every question in detail"}
    rows = [
        {"messages": [system, {"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "ok"}]}
        for i in range(3)
    ]
    source = write_jsonl(tmp_path / "chat.jsonl", rows)

    def pack(size: int, name: str):
        out = tmp_path / name
        return run_cli("pack", source, "-o", out, "--pack-size", str(size), "--workers", "1", cwd=tmp_path)

    line = error_line(pack(16, "out"))
    match = re.fullmatch(
        r"error: no sample left to pack \(3 rows in, 0 bad, 0 too long, 3 without supervised tokens\): "
        r"3 samples lost every supervised token to truncation: the text truncation never trims \(the chat "
        r"template's fixed tokens such as the system turn and role headers, or a prompt template's text and "
        r"its fields that are not truncation fields\) is (\d+) tokens or more before the answer in each, "
        r"over the cap of 16 tokens; raise the pack size \(and the per-sample cap\) above that, or shorten "
        r"that fixed text",
        line,
    )
    assert match, line
    fixed = int(match.group(1))
    # exact: a cap of fixed - 1 (fixed stored tokens) keeps no answer token, a cap of fixed keeps one
    assert pack(fixed - 1, "below").returncode == 2
    at = pack(fixed, "at")
    assert at.returncode == 0, at.stderr
    assert summary_value(at.stdout, "dropped (no supervised token)") == "0"
    # with a sample that fits, the run packs it and the note is a warning
    short = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}]
    write_jsonl(source, rows + short)
    some = pack(16, "some")
    assert some.returncode == 0, some.stderr
    assert summary_value(some.stdout, "  none left after truncation") == "3"
    assert "warning: 3 samples lost every supervised token to truncation: the text" in some.stderr


def test_format_auto_reads_pre_tokenized_rows_as_tokens(tmp_path):
    """Rows of ``input_ids`` (and ``loss_mask``) are packed by ``--format auto`` as by ``--format tokens``,
    from a file or from a generator (whose first row is looked at without being lost)."""
    from tightpack.offline.pipeline import PackConfig, pack_dataset

    rows = [{"input_ids": [10 + i, 20, 30, 40], "loss_mask": [0, 0, 1, 1]} for i in range(6)]
    source = write_jsonl(tmp_path / "ids.jsonl", rows)
    outputs = {}
    for name in ("auto", "tokens"):
        run = run_cli(
            "pack", source, "-o", tmp_path / name, "--pack-size", "16", "--format", name, "--workers", "1",
            "--no-reuse", cwd=tmp_path,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        outputs[name] = (tmp_path / name / "packs-00000.idx.parquet").read_bytes()
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["settings"]["format"]["format"] == "tokens"
    assert outputs["auto"] == outputs["tokens"]
    ids = pq.read_table(tmp_path / "auto" / "packs-00000.idx.parquet").column("input_ids").to_pylist()
    assert sorted(id_ for pack in ids for id_ in pack) == sorted(
        [id_ for row in rows for id_ in row["input_ids"]] + [50256] * 6  # the ids as they are, + EOS each
    )
    result = pack_dataset((row for row in rows), tmp_path / "generator", PackConfig(packed_sequence_size=16))
    assert result.counts["packed"] == 6
    assert (tmp_path / "generator" / "packs-00000.idx.parquet").read_bytes() == outputs["tokens"]
