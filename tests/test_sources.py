"""Input sources: every kind of input packs as the same rows in a JSONL file; empty input is an error,
not the demo corpus; glob patterns; the split of a DatasetDict; nulls of columnar rows are absent keys."""

from __future__ import annotations

import itertools
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.sources import DEFAULT_CORPUS_NAME, open_sources

from .conftest import random_words, write_jsonl

datasets = pytest.importorskip("datasets")

PACKED_COLUMNS = ("input_ids", "loss_mask", "sample_index")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIGHTPACK_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """More rows than one tokenization chunk (512), all different, so a lost row shifts every index."""
    rng = np.random.default_rng(5)
    return [
        {
            "input": f"{number} " + random_words(rng, int(rng.integers(1, 30))),
            "output": random_words(rng, int(rng.integers(1, 20))),
        }
        for number in range(700)
    ]


def mixed_rows() -> list[dict]:
    """Chat and prompt-completion rows interleaved, each with its own keys only."""
    rng = np.random.default_rng(9)
    result = []
    for number in range(60):
        if number % 3 == 0:
            turns = [
                {"role": role, "content": random_words(rng, int(rng.integers(1, 15)))}
                for role in ("user", "assistant")
            ]
            result.append({"messages": turns})
        else:
            result.append({"input": random_words(rng, 10), "output": random_words(rng, 5)})
    return result


def columnar(rows: list[dict]) -> pa.Table:
    """The rows as one table: every key a column, null where a row does not have it."""
    keys = sorted({key for row in rows for key in row})
    return pa.table({key: [row.get(key) for row in rows] for key in keys})


def packed(inputs, folder: Path, *, workers: int = 1, reuse: bool = False, split=None) -> dict[str, list]:
    """The packed columns of ``inputs`` (format auto, packs of 256 tokens)."""
    config = PackConfig(packed_sequence_size=256, workers=workers, reuse_store=reuse)
    pack_dataset(inputs, folder, config, split=split)
    table = pq.read_table(sorted(folder.glob("packs-*.idx.parquet")), columns=list(PACKED_COLUMNS))
    return table.to_pydict()


def source_rows(source) -> list:
    return [row for chunk in source.read(0, 7) for row in chunk.parsed_rows()]


def as_dataset(rows: list[dict]):
    return datasets.Dataset.from_list(rows)


def generated(rows: list[dict]):
    return datasets.IterableDataset.from_generator(lambda: iter(rows))


def streamed_jsonl(path: Path, **options):
    return datasets.load_dataset(
        "json", data_files=str(path), streaming=True, cache_dir=str(path.parent / "hf"), **options
    )


# (inputs, split) from the rows and the JSONL file holding them
INPUT_KINDS = {
    "list": lambda rows, path: (rows, None),
    "generator": lambda rows, path: ((row for row in rows), None),
    "iterator": lambda rows, path: (iter(rows), None),
    "map of a range": lambda rows, path: (map(rows.__getitem__, range(len(rows))), None),
    "parquet": lambda rows, path: (_parquet(rows, path.with_suffix(".parquet")), None),
    "Dataset": lambda rows, path: (as_dataset(rows), None),
    "Dataset, numpy format": lambda rows, path: (as_dataset(rows).with_format("numpy"), None),
    "Dataset, reversed twice": lambda rows, path: (
        as_dataset(rows[::-1]).select(range(len(rows) - 1, -1, -1)),
        None,
    ),
    "Dataset, transform": lambda rows, path: (as_dataset(rows).with_transform(lambda batch: batch), None),
    "IterableDataset": lambda rows, path: (generated(rows), None),
    "streaming IterableDataset": lambda rows, path: (streamed_jsonl(path, split="train"), None),
    "DatasetDict": lambda rows, path: (
        datasets.DatasetDict(train=as_dataset(rows), test=as_dataset(rows[:3])),
        "train",
    ),
    "IterableDatasetDict, one split": lambda rows, path: (streamed_jsonl(path), None),
    "IterableDatasetDict": lambda rows, path: (
        datasets.IterableDatasetDict(train=generated(rows), test=generated(rows[:3])),
        "train",
    ),
}


def _parquet(rows: list[dict], path: Path) -> Path:
    pq.write_table(columnar(rows), path, row_group_size=100)
    return path


@pytest.fixture(scope="module")
def reference(rows, tmp_path_factory) -> tuple[Path, dict[str, list]]:
    """The rows as a JSONL file, and that file packed."""
    folder = tmp_path_factory.mktemp("reference")
    path = write_jsonl(folder / "rows.jsonl", rows)
    return path, packed([path], folder / "packed")


@pytest.mark.parametrize("kind", list(INPUT_KINDS))
def test_every_input_kind_packs_as_the_same_rows_in_a_jsonl_file(kind, rows, reference, tmp_path):
    path, expected = reference
    inputs, split = INPUT_KINDS[kind](rows, path)
    got = packed(inputs, tmp_path / "packed", split=split)
    assert len(got["sample_index"]) == len(expected["sample_index"])
    assert sorted(itertools.chain(*got["sample_index"])) == list(range(len(rows)))
    for column in PACKED_COLUMNS:
        assert got[column] == expected[column], column


def test_dataset_batches_go_to_worker_processes_compact(rows, reference, tmp_path):
    """With workers, a Dataset's Arrow batches are pickled: a view on its table would carry it whole."""
    got = packed(as_dataset(rows), tmp_path / "packed", workers=2)
    assert got == reference[1]
    [source] = open_sources(as_dataset(rows))
    chunk = next(source.read(0, 10))
    assert chunk.batch.num_rows == 10
    assert len(pickle.dumps(chunk)) < 4_000, "10 rows of a 700-row table travel alone"


def test_a_generator_is_read_lazily_in_chunks_and_once():
    pulled = []

    def rows():
        for number in range(10):
            pulled.append(number)
            yield {"input": str(number), "output": "x"}

    [source] = open_sources(rows())
    assert source.estimated_rows is None
    assert len(pulled) == 1, "only the first row is looked at to see what the input is"
    chunks = source.read(0, 4)
    first = next(chunks)
    assert [row["input"] for row in first.rows] == ["0", "1", "2", "3"]
    assert len(pulled) == 4
    assert [(chunk.first_sample, chunk.first_position, len(chunk)) for chunk in chunks] == [
        (4, 4, 4),
        (8, 8, 2),
    ]
    with pytest.raises(TightpackError, match=r"rows: a generator or iterator can be read only once"):
        next(source.read(0, 4))


def test_a_list_of_rows_can_be_read_again():
    rows = [{"input": str(number), "output": "x"} for number in range(5)]
    [source] = open_sources(rows)
    assert source.estimated_rows == 5
    assert source_rows(source) == source_rows(source) == rows


def test_no_input_is_an_error_not_the_demo_corpus(tmp_path):
    for empty in ([], ()):
        with pytest.raises(TightpackError, match=r"^no input given: pass paths, a dataset or rows"):
            open_sources(empty)
    with pytest.raises(TightpackError, match=r"^no input given"):
        pack_dataset([], tmp_path / "packed", PackConfig(packed_sequence_size=256))
    assert not (tmp_path / "packed").exists()
    assert [source.name for source in open_sources(None)] == [DEFAULT_CORPUS_NAME]


@pytest.mark.parametrize(
    "empty", [lambda: iter([]), lambda: (row for row in [])], ids=["iterator", "generator"]
)
def test_rows_that_yield_nothing_are_a_source_without_rows(empty, tmp_path):
    [source] = open_sources(empty())
    assert (source.name, source.estimated_rows, list(source.read(0, 8))) == ("rows", 0, [])
    with pytest.raises(TightpackError, match=r"^no sample to pack: rows held no rows"):
        pack_dataset(empty(), tmp_path / "packed", PackConfig(packed_sequence_size=256))


def test_glob_patterns_expand_to_their_files_sorted(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "sub/d.jsonl", "x[1].jsonl", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        write_jsonl(tmp_path / name, [{"input": name, "output": "x"}])
    _parquet([{"input": "c", "output": "x"}], tmp_path / "c.parquet")

    def names(inputs) -> list[str]:
        return [Path(source.name).relative_to(tmp_path).as_posix() for source in open_sources(inputs)]

    assert names(str(tmp_path / "[ab].jsonl")) == ["a.jsonl", "b.jsonl"]
    assert names([tmp_path / "c.parquet", f"{tmp_path}/?.jsonl"]) == ["c.parquet", "a.jsonl", "b.jsonl"]
    assert names(str(tmp_path / "**" / "*.jsonl")) == ["a.jsonl", "b.jsonl", "sub/d.jsonl", "x[1].jsonl"]
    assert names(str(tmp_path / "x[1].jsonl")) == ["x[1].jsonl"], "an existing file is taken literally"


def test_a_glob_pattern_matching_no_file_is_an_error(tmp_path):
    (tmp_path / "folder.jsonl").mkdir()
    for pattern in (f"{tmp_path}/*.parquet", f"{tmp_path}/*.jsonl"):
        with pytest.raises(TightpackError, match=rf"^input pattern '{re.escape(pattern)}' matched no file$"):
            open_sources([pattern])


def splits_of(kind: str):
    train, test = [{"input": "train", "output": "x"}], [{"input": "test", "output": "x"}]
    if kind == "DatasetDict":
        return datasets.DatasetDict(train=as_dataset(train), test=as_dataset(test))
    return datasets.IterableDatasetDict(train=generated(train), test=generated(test))


@pytest.mark.parametrize("kind", ["DatasetDict", "IterableDatasetDict"])
def test_a_dataset_dict_needs_its_split(kind):
    splits = splits_of(kind)
    with pytest.raises(
        TightpackError,
        match=rf"^the input is a {kind} with the splits 'train', 'test': choose one with --split "
        r"\(command line\) or split= \(Python\)$",
    ):
        open_sources(splits)
    with pytest.raises(
        TightpackError, match=rf"^split 'valid' is not in the {kind}; its splits: 'train', 'test'$"
    ):
        open_sources([splits], split="valid")
    [source] = open_sources(splits, split="test")
    assert source.name.startswith("dataset ") and source.name.endswith(" split 'test'")
    assert source_rows(source) == [{"input": "test", "output": "x"}]


def test_a_dataset_dict_with_one_split_needs_no_split():
    [source] = open_sources(datasets.DatasetDict(only=as_dataset([{"input": "q", "output": "a"}])))
    assert source.name == "dataset in memory split 'only'", "the name says which split was taken"
    assert source_rows(source) == [{"input": "q", "output": "a"}]


def test_a_split_with_no_dataset_dict_to_apply_to_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "q", "output": "a"}])
    for inputs in (
        [path],
        [{"input": "q", "output": "a"}],
        as_dataset([{"input": "q", "output": "a"}]),
        None,
    ):
        with pytest.raises(TightpackError, match=r"^split 'train' given, but no input is a DatasetDict"):
            open_sources(inputs, split="train")


def test_wrong_inputs_are_named(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "q", "output": "a"}])
    with pytest.raises(
        TightpackError, match=r"^a single row \(a dict\) is not an input: pass a list of rows"
    ):
        open_sources({"input": "q", "output": "a"})
    with pytest.raises(TightpackError, match=r"^the inputs mix paths or datasets with rows"):
        open_sources([path, {"input": "q", "output": "a"}])
    with pytest.raises(TightpackError, match=r"^unsupported input int: give paths"):
        open_sources(3)


def test_the_same_dataset_given_twice_is_an_error(tmp_path):
    """As a file given twice (tests/test_cli.py), a dataset is packed once: the same content (its
    fingerprint), whether as the same object or loaded again from the folder it was saved to."""
    dataset = datasets.Dataset.from_list([{"input": "q", "output": "a"}])
    with pytest.raises(
        TightpackError,
        match=r"^input 'dataset in memory' is given twice as 'dataset in memory': it would be packed twice; "
        r"give each input once; to up-sample a dataset on purpose, give it a larger share with "
        r"MixtureConfig\(weights=\.\.\., max_repetitions=\.\.\.\) \(docs/mixtures\.md\)$",
    ):
        open_sources([dataset, dataset])
    dataset.save_to_disk(str(tmp_path / "saved"))
    twice = r"^input 'dataset in memory' is given twice as '.*saved': it would be packed twice"
    with pytest.raises(TightpackError, match=twice):
        open_sources([tmp_path / "saved", str(tmp_path / "saved")])
    assert len(open_sources([dataset, dataset.map(lambda row: {"output": "b"})])) == 2


MIXED_KINDS = {
    "parquet": lambda path: path,
    "Dataset": lambda path: datasets.Dataset(pq.read_table(path)),
    "streaming parquet": lambda path: datasets.load_dataset(
        "parquet", data_files=str(path), split="train", streaming=True, cache_dir=str(path.parent / "hf")
    ),
}


@pytest.mark.parametrize("kind", list(MIXED_KINDS))
def test_nulls_of_mixed_format_columnar_rows_are_absent_keys(kind, tmp_path):
    """A null ``messages`` on a prompt-completion row (and null ``input``/``output`` on a chat row)
    would make ``--format auto`` take the row for the other format."""
    rows = mixed_rows()
    path = tmp_path / "mixed.parquet"
    pq.write_table(columnar(rows), path, row_group_size=16)
    assert pq.read_table(path).column("messages").null_count == 40
    expected = packed([write_jsonl(tmp_path / "mixed.jsonl", rows)], tmp_path / "from-jsonl")
    got = packed(MIXED_KINDS[kind](path), tmp_path / "from-columns")
    assert got == expected


def test_python_rows_keep_their_nulls_and_are_not_mutated():
    row = {"messages": None, "input": "q", "output": "a"}
    assert Chunk(0, "rows", rows=[row]).parsed_rows() == [row], "a JSONL null stays, so do Python rows'"
    assert Chunk(0, "stream", rows=[row], nulls_absent=True).parsed_rows() == [{"input": "q", "output": "a"}]
    assert row == {"messages": None, "input": "q", "output": "a"}


def test_a_stream_is_never_taken_from_the_store_cache_for_another(tmp_path):
    """An IterableDataset has no content fingerprint, so its token store is not reused: two streams
    of other rows never share one."""
    first = [{"input": f"first {n}", "output": "x"} for n in range(20)]
    second = [{"input": f"second {n}", "output": "y"} for n in range(30)]
    [source] = open_sources(generated(first))
    assert "fingerprint" not in source.identity and "sha256" not in source.identity
    packed(generated(first), tmp_path / "first", reuse=True)
    got = packed(generated(second), tmp_path / "second", reuse=True)
    assert got == packed(second, tmp_path / "reference")


def test_a_saved_dataset_dict_folder_through_the_cli_needs_its_split(rows, reference, tmp_path):
    from datasets import Dataset, DatasetDict

    _, expected = reference
    folder = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:3])}).save_to_disk(folder)
    command = [
        sys.executable,
        "-m",
        "tightpack.cli",
        "pack",
        str(folder),
        "-o",
        str(tmp_path / "out"),
        "--pack-size",
        "256",
        "--workers",
        "1",
    ]
    refused = subprocess.run(command, capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "--split" in refused.stderr and "'train', 'test'" in refused.stderr
    done = subprocess.run([*command, "--split", "train"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(
        sorted((tmp_path / "out").glob("packs-*.idx.parquet")), columns=list(PACKED_COLUMNS)
    )
    assert table.to_pydict() == expected


class _Recorder:
    """A `tightpack.offline.pipeline.Progress` that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin(self, stage, total):
        self.events.append(("begin", stage, total))

    def advance(self, amount):
        self.events.append(("advance", amount))

    def end(self):
        self.events.append(("end",))


def test_progress_totals_the_rows_and_advances_every_quarter_megabyte(tmp_path):
    rows = [{"input": "word " * 20_000, "output": f"answer {i}"} for i in range(12)]  # 100 kB each
    path = write_jsonl(tmp_path / "long.jsonl", rows)  # ends with a newline: 12 lines, not 13
    progress = _Recorder()
    pack_dataset([path], tmp_path / "out", PackConfig(packed_sequence_size=256, workers=1), progress=progress)
    start = progress.events.index(("begin", "tokenize", 12))
    steps = []
    for event in progress.events[start + 1 :]:
        if event[0] != "advance":
            break
        steps.append(event[1])
    assert sum(steps) == 12 and max(steps) <= 3  # chunks of at most 256 KiB of input, not 512 rows
