"""Packed Parquet spec resolution (contract section 2.7), on real files in tmp_path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tightpack.core.paths import is_packed_parquet_spec, resolve_parquet_spec
from tightpack.errors import TightpackError


def _write_parquet(path: Path) -> Path:
    """A one-row packed table: two sequences of lengths 3 and 2."""
    table = pa.table(
        {
            "input_ids": pa.array([[5, 6, 2, 7, 2]], type=pa.list_(pa.int64())),
            "loss_mask": pa.array([[0, 1, 1, 1, 1]], type=pa.list_(pa.int8())),
            "seq_start_id": pa.array([[0, 3]], type=pa.list_(pa.int64())),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


class TestSingleFile:
    @pytest.mark.parametrize(
        "name",
        ["train.parquet", "train.idx.parquet", "train.PARQUET", "train.pq", "train.Pq", "TRAIN.IDX.PQ"],
    )
    def test_parquet_extension_in_any_case(self, tmp_path: Path, name: str) -> None:
        path = _write_parquet(tmp_path / name)
        assert resolve_parquet_spec(str(path)) == [str(path)]

    def test_pathlike_is_accepted_and_returned_as_str(self, tmp_path: Path) -> None:
        path = _write_parquet(tmp_path / "train.parquet")
        assert resolve_parquet_spec(path) == [str(path)]

    def test_missing_parquet_file(self, tmp_path: Path) -> None:
        with pytest.raises(TightpackError, match=r"Packed Parquet file not found: .*missing\.parquet"):
            resolve_parquet_spec(tmp_path / "missing.parquet")

    def test_existing_file_without_parquet_extension_raises(self, tmp_path: Path) -> None:
        # Deliberate difference: the reference resolves this to [] without an error.
        path = tmp_path / "train.npy"
        path.write_bytes(b"not parquet")
        with pytest.raises(
            TightpackError, match=r"train\.npy is a file without a Parquet extension.*\.parquet or \.pq"
        ):
            resolve_parquet_spec(path)

    def test_missing_path_without_parquet_extension_raises(self, tmp_path: Path) -> None:
        with pytest.raises(TightpackError, match=r"Packed Parquet spec not found: .*nowhere"):
            resolve_parquet_spec(tmp_path / "nowhere")

    @pytest.mark.parametrize("spec", [b"train.parquet", 3, None])
    def test_non_path_spec_raises(self, spec: object) -> None:
        with pytest.raises(TightpackError, match=r"must be a str or os\.PathLike path"):
            resolve_parquet_spec(spec)  # type: ignore[arg-type]


class TestGlob:
    def test_star_filters_to_parquet_extensions_and_sorts(self, tmp_path: Path) -> None:
        # Created out of order; the result is lexicographic, so shard_10 sorts before shard_2.
        for name in [
            "shard_2.parquet",
            "shard_10.pq",
            "shard_1.PARQUET",
            "shard_3.json",
            "shard_4.parquet.tmp",
        ]:
            _write_parquet(tmp_path / name)
        expected = [str(tmp_path / n) for n in ["shard_1.PARQUET", "shard_10.pq", "shard_2.parquet"]]
        assert resolve_parquet_spec(str(tmp_path / "shard_*")) == expected

    def test_question_mark(self, tmp_path: Path) -> None:
        for name in ["shard_1.parquet", "shard_2.parquet", "shard_10.parquet"]:
            _write_parquet(tmp_path / name)
        assert resolve_parquet_spec(str(tmp_path / "shard_?.parquet")) == [
            str(tmp_path / "shard_1.parquet"),
            str(tmp_path / "shard_2.parquet"),
        ]

    def test_character_class(self, tmp_path: Path) -> None:
        for i in range(3):
            _write_parquet(tmp_path / f"shard_{i}.idx.parquet")
        assert resolve_parquet_spec(str(tmp_path / "shard_[01].idx.parquet")) == [
            str(tmp_path / "shard_0.idx.parquet"),
            str(tmp_path / "shard_1.idx.parquet"),
        ]

    def test_existing_literal_bracket_file_is_returned_as_is(self, tmp_path: Path) -> None:
        # shard_0 would match the character class; the literal file wins because it exists.
        literal = _write_parquet(tmp_path / "shard_[01].idx.parquet")
        _write_parquet(tmp_path / "shard_0.idx.parquet")
        assert resolve_parquet_spec(str(literal)) == [str(literal)]

    def test_directory_named_like_parquet_is_not_a_match(self, tmp_path: Path) -> None:
        _write_parquet(tmp_path / "a.parquet")
        (tmp_path / "b.parquet").mkdir()  # a Spark-style dataset directory, not a shard
        assert resolve_parquet_spec(str(tmp_path / "*.parquet")) == [str(tmp_path / "a.parquet")]

    def test_no_match(self, tmp_path: Path) -> None:
        with pytest.raises(
            TightpackError, match=r"No Parquet files found matching pattern: .*shard_\*\.parquet"
        ):
            resolve_parquet_spec(str(tmp_path / "shard_*.parquet"))

    def test_only_non_parquet_matches(self, tmp_path: Path) -> None:
        (tmp_path / "shard_0.json").write_text("{}")
        with pytest.raises(TightpackError, match=r"No Parquet files found matching pattern: .*shard_\*"):
            resolve_parquet_spec(str(tmp_path / "shard_*"))


class TestDirectory:
    def test_lists_parquet_and_pq_sorted_not_recursive(self, tmp_path: Path) -> None:
        for name in ["b.parquet", "a.pq", "c.idx.parquet"]:
            _write_parquet(tmp_path / name)
        (tmp_path / "notes.txt").write_text("not a shard")
        _write_parquet(tmp_path / "nested" / "d.parquet")
        (tmp_path / "e.parquet").mkdir()
        result = resolve_parquet_spec(tmp_path)
        assert result == [str(tmp_path / n) for n in ["a.pq", "b.parquet", "c.idx.parquet"]]
        assert len(result) == len(set(result))

    def test_trailing_separator(self, tmp_path: Path) -> None:
        _write_parquet(tmp_path / "a.parquet")
        assert resolve_parquet_spec(str(tmp_path) + os.sep) == [
            os.path.join(str(tmp_path) + os.sep, "a.parquet")
        ]

    def test_brackets_in_directory_name_are_literal(self, tmp_path: Path) -> None:
        directory = tmp_path / "run[1]"
        _write_parquet(directory / "a.parquet")
        _write_parquet(tmp_path / "run1" / "b.parquet")  # what `run[1]` would match as a character class
        assert resolve_parquet_spec(directory) == [str(directory / "a.parquet")]

    @pytest.mark.skipif(sys.platform == "win32", reason="glob ignores case on Windows")
    def test_directory_patterns_are_case_sensitive_like_the_reference(self, tmp_path: Path) -> None:
        _write_parquet(tmp_path / "a.parquet")
        _write_parquet(tmp_path / "B.PARQUET")
        assert resolve_parquet_spec(tmp_path) == [str(tmp_path / "a.parquet")]

    def test_empty_directory(self, tmp_path: Path) -> None:
        (tmp_path / "notes.txt").write_text("not a shard")
        with pytest.raises(TightpackError, match=r"No Parquet files found in directory: "):
            resolve_parquet_spec(tmp_path)


class TestIsPackedParquetSpec:
    @pytest.mark.parametrize("name", ["missing.parquet", "MISSING.PQ", "shard_*.idx.parquet", "shard_?.pq"])
    def test_parquet_names_need_not_exist(self, tmp_path: Path, name: str) -> None:
        assert is_packed_parquet_spec(str(tmp_path / name))

    def test_glob_that_resolves_without_extension_in_spec(self, tmp_path: Path) -> None:
        _write_parquet(tmp_path / "shard_0.parquet")
        assert is_packed_parquet_spec(str(tmp_path / "shard_*"))

    def test_glob_that_resolves_to_nothing(self, tmp_path: Path) -> None:
        assert not is_packed_parquet_spec(str(tmp_path / "shard_*"))

    def test_directory_with_shards(self, tmp_path: Path) -> None:
        _write_parquet(tmp_path / "a.parquet")
        assert is_packed_parquet_spec(tmp_path)

    def test_existing_directory_without_shards(self, tmp_path: Path) -> None:
        assert is_packed_parquet_spec(tmp_path)

    def test_npy_and_other_files(self, tmp_path: Path) -> None:
        (tmp_path / "train.npy").write_bytes(b"")
        assert not is_packed_parquet_spec(tmp_path / "train.npy")
        assert not is_packed_parquet_spec(tmp_path / "missing_dir")

    def test_non_path_spec_raises(self) -> None:
        with pytest.raises(TightpackError, match=r"must be a str or os\.PathLike path, got int"):
            is_packed_parquet_spec(3)  # type: ignore[arg-type]
