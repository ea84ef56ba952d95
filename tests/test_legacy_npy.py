"""Legacy Megatron-Bridge ``.npy`` packed files (contract section 2.8): round trips and hostile input."""

from __future__ import annotations

import builtins
import fractions
import os
import pickle
import subprocess
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format

from tightpack.core.legacy_npy import read_legacy_npy, write_legacy_npy
from tightpack.errors import TightpackError

# Two packs: sequences of stored lengths [3, 2] and [4].
ROWS = [
    {"input_ids": [5, 6, 2, 7, 2], "loss_mask": [0, 1, 1, 1, 1], "seq_start_id": [0, 3]},
    {"input_ids": [8, 9, 10, 2], "loss_mask": [0, 0, 1, 1], "seq_start_id": [0]},
]

# What Megatron-Bridge's restricted unpickler (utils/safe_pickle.py) lets through.
MB_ALLOWED_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("list", "dict", "tuple", "set", "frozenset", "bytes", "str", "int", "float")),
}


def _object_array(items: list) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        array[i] = item
    return array


def _save_raw(path: Path, items: list) -> Path:
    """What Megatron-Bridge's writer does: np.save of an object array of whatever the rows are."""
    np.save(path, _object_array(items), allow_pickle=True)
    return path


def _write_with_payload(path: Path, payload: bytes, shape: tuple[int, ...] = (1,)) -> Path:
    """An object-array .npy header followed by an arbitrary pickle payload."""
    with open(path, "wb") as handle:
        npy_format.write_array_header_1_0(handle, {"descr": "|O", "fortran_order": False, "shape": shape})
        handle.write(payload)
    return path


class _RecordingUnpickler(pickle.Unpickler):
    """Plain unpickling (only for files this test wrote itself) that notes every global it resolves."""

    def __init__(self, file) -> None:
        super().__init__(file)
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.globals.add((module, name))
        return super().find_class(module, name)


def _pickle_globals(path: Path) -> set[tuple[str, str]]:
    with open(path, "rb") as handle:
        npy_format.read_magic(handle)
        npy_format.read_array_header_1_0(handle)
        unpickler = _RecordingUnpickler(handle)
        unpickler.load()
    return unpickler.globals


def _assert_rows_equal(actual: list[dict[str, np.ndarray]], expected: list[dict]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], np.asarray(value))


class _Call:
    """Pickles as a call of ``function(*args)``: the shape of every pickle exploit."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


class TestRoundTrip:
    def test_lists(self, tmp_path: Path) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, ROWS)
        rows = read_legacy_npy(path)
        _assert_rows_equal(rows, ROWS)
        assert [{k: v.dtype for k, v in row.items()} for row in rows] == [
            {"input_ids": np.int64, "loss_mask": np.int8, "seq_start_id": np.int64}
        ] * 2

    def test_arrays_bools_and_extra_keys(self, tmp_path: Path) -> None:
        path = tmp_path / "train.NPY"
        rows = [
            {
                "input_ids": np.array([5, 6, 2], dtype=np.int32),
                "loss_mask": np.array([False, True, True]),
                "seq_start_id": np.array([0], dtype=np.int32),
                "sample_index": np.int64(7),
                "weights": np.array([0.5, 1.0], dtype=np.float32),
                "source": "chat",
            }
        ]
        write_legacy_npy(path, rows)
        (row,) = read_legacy_npy(path)
        _assert_rows_equal([row], [{**rows[0], "loss_mask": [0, 1, 1]}])
        assert row["loss_mask"].dtype == np.int8
        assert row["sample_index"].shape == () and row["sample_index"].dtype == np.int64
        assert row["weights"].dtype == np.float32

    def test_generator_and_ordered_dict_rows(self, tmp_path: Path) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, (OrderedDict(row) for row in ROWS))
        _assert_rows_equal(read_legacy_npy(path), ROWS)

    def test_no_rows(self, tmp_path: Path) -> None:
        path = tmp_path / "empty.npy"
        write_legacy_npy(path, [])
        assert read_legacy_npy(path) == []

    def test_empty_sequences_are_int64(self, tmp_path: Path) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, [{"input_ids": [], "loss_mask": [], "seq_start_id": []}])
        (row,) = read_legacy_npy(path)
        assert [row[k].dtype for k in ("input_ids", "loss_mask", "seq_start_id")] == [
            np.int64,
            np.int8,
            np.int64,
        ]

    def test_returned_arrays_are_writeable(self, tmp_path: Path) -> None:
        path = _save_raw(tmp_path / "train.npy", [{k: np.asarray(v) for k, v in ROWS[0].items()}])
        (row,) = read_legacy_npy(path)
        assert all(value.flags.writeable for value in row.values())


class TestMegatronBridgeCompatibility:
    def test_reads_files_written_by_np_save_keeping_integer_dtype(self, tmp_path: Path) -> None:
        rows = [
            {"input_ids": np.array([1, 2, 3], dtype=np.int32), "loss_mask": [1, 1, 0], "seq_start_id": [0]},
            {"input_ids": [4, 5], "loss_mask": np.array([True, False]), "seq_start_id": np.array([0])},
        ]
        (first, second) = read_legacy_npy(_save_raw(tmp_path / "mb.npy", rows))
        assert first["input_ids"].dtype == np.int32  # an array keeps its integer dtype
        assert second["input_ids"].dtype == np.int64  # a list becomes int64
        assert {type(v) for row in (first, second) for v in row.values()} == {np.ndarray}
        np.testing.assert_array_equal(second["loss_mask"], [1, 0])

    @pytest.mark.parametrize("protocol", [2, 3])
    @pytest.mark.parametrize("module", ["numpy.core.multiarray", "numpy._core.multiarray"])
    def test_reads_numpy1_and_numpy2_pickles(self, tmp_path: Path, protocol: int, module: str) -> None:
        # numpy 1 wrote protocol 2/3 with numpy.core names; GLOBAL opcodes spell "module\nname\n".
        rows = [{**ROWS[0], "input_ids": np.array(ROWS[0]["input_ids"]), "sample_index": np.int64(3)}]
        payload = pickle.dumps(_object_array(rows), protocol=protocol)
        payload = payload.replace(b"numpy._core.multiarray\n", module.encode() + b"\n")
        assert module.encode() in payload
        (row,) = read_legacy_npy(_write_with_payload(tmp_path / "old.npy", payload))
        _assert_rows_equal([row], rows)

    def test_written_file_loads_with_numpy_and_mb_row_arithmetic_works(self, tmp_path: Path) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, ROWS)
        loaded = np.load(path, allow_pickle=True)
        assert loaded.dtype == object and loaded.shape == (2,)
        # Megatron-Bridge's __getitem__: seq_start_id + [len(input_ids)] must append, not broadcast-add.
        row = loaded[0]
        assert row["seq_start_id"] + [len(row["input_ids"])] == [0, 3, 5]

    def test_written_file_uses_only_globals_mb_allows(self, tmp_path: Path) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, [{**ROWS[0], "sample_index": np.int64(1), "weights": np.ones(2, np.float32)}])
        assert _pickle_globals(path) <= MB_ALLOWED_GLOBALS


class TestHostilePayloads:
    def test_control_plain_np_load_would_execute_the_payload(self, tmp_path: Path) -> None:
        # Proves the payload used below is live: numpy's own loader runs it.
        marker = tmp_path / "pwned"
        path = _save_raw(tmp_path / "evil.npy", [_Call(builtins.exec, f"open({str(marker)!r}, 'w').close()")])
        np.load(path, allow_pickle=True)
        assert marker.exists()

    @pytest.mark.parametrize(
        ("make_call", "global_name"),
        [
            (lambda m: _Call(os.system, f"touch {m}"), r"(posix|nt)\.system"),
            (lambda m: _Call(builtins.exec, f"open({str(m)!r}, 'w').close()"), r"builtins\.exec"),
            (lambda m: _Call(builtins.eval, f"open({str(m)!r}, 'w').close()"), r"builtins\.eval"),
            (lambda m: _Call(subprocess.Popen, ["touch", str(m)]), r"subprocess\.Popen"),
        ],
        ids=["os.system", "exec", "eval", "subprocess"],
    )
    @pytest.mark.parametrize("where", ["in_a_row", "as_the_payload"])
    def test_code_execution_is_refused(self, tmp_path: Path, make_call, global_name: str, where: str) -> None:
        marker = tmp_path / "pwned"
        call = make_call(marker)
        if where == "in_a_row":
            path = _save_raw(tmp_path / "evil.npy", [{**ROWS[0], "sample_index": call}])
        else:
            path = _write_with_payload(tmp_path / "evil.npy", pickle.dumps(call, protocol=4))
        with pytest.raises(
            TightpackError, match=rf"evil\.npy: unsafe .*refused to load {global_name}.*Nothing"
        ):
            read_legacy_npy(path)
        assert not marker.exists()

    def test_unknown_class_is_refused(self, tmp_path: Path) -> None:
        path = _save_raw(tmp_path / "odd.npy", [{**ROWS[0], "weight": fractions.Fraction(1, 3)}])
        with pytest.raises(TightpackError, match=r"odd\.npy: .*refused to load fractions\.Fraction"):
            read_legacy_npy(path)

    def test_numpy_subclass_is_refused(self, tmp_path: Path) -> None:
        path = _save_raw(tmp_path / "masked.npy", [{**ROWS[0], "input_ids": np.ma.masked_array([1, 2])}])
        with pytest.raises(TightpackError, match=r"masked\.npy: .*refused to load numpy\.ma\.core\."):
            read_legacy_npy(path)

    def test_object_array_shorter_than_its_shape_is_refused(self, tmp_path: Path) -> None:
        # numpy's own __setstate__ accepts this and leaves NULL elements, which crashes the interpreter.
        reconstruct = np.empty(0).__reduce__()[0]
        state = (1, (3,), np.dtype(object), False, [ROWS[0]])
        payload = pickle.dumps(_Rebuild(reconstruct, state), protocol=4)
        path = _write_with_payload(tmp_path / "short.npy", payload, shape=(3,))
        with pytest.raises(TightpackError, match=r"short\.npy: .*element list does not match"):
            read_legacy_npy(path)

    def test_raw_data_shorter_than_its_shape_is_refused(self, tmp_path: Path) -> None:
        reconstruct = np.empty(0).__reduce__()[0]
        state = (1, (4,), np.dtype(np.int64), False, b"\x00" * 8)
        path = _save_raw(tmp_path / "short.npy", [{**ROWS[0], "input_ids": _Rebuild(reconstruct, state)}])
        with pytest.raises(TightpackError, match=r"short\.npy: .*data does not match"):
            read_legacy_npy(path)

    def test_structured_dtype_is_refused(self, tmp_path: Path) -> None:
        value = np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])
        path = _save_raw(tmp_path / "rec.npy", [{**ROWS[0], "extra": value}])
        with pytest.raises(TightpackError, match=r"rec\.npy: .*unsupported dtype"):
            read_legacy_npy(path)


class _Rebuild:
    """Pickles as numpy's ``_reconstruct`` followed by a chosen (possibly inconsistent) ndarray state."""

    def __init__(self, reconstruct, state) -> None:
        self.reconstruct, self.state = reconstruct, state

    def __reduce__(self):
        return self.reconstruct, (np.ndarray, (0,), b"b"), self.state


class TestDamagedFiles:
    def test_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(TightpackError, match=r"Legacy \.npy file not found: .*nope\.npy"):
            read_legacy_npy(tmp_path / "nope.npy")

    @pytest.mark.parametrize("keep", [0, 5, 20])
    def test_truncated_header(self, tmp_path: Path, keep: int) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, ROWS)
        path.write_bytes(path.read_bytes()[:keep])
        with pytest.raises(TightpackError, match=r"train\.npy is not a readable \.npy file \(truncated"):
            read_legacy_npy(path)

    @pytest.mark.parametrize("fraction", [0.0, 0.5, 0.99])
    def test_truncated_payload(self, tmp_path: Path, fraction: float) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, ROWS)
        data = path.read_bytes()
        with open(path, "rb") as handle:
            npy_format.read_magic(handle)
            npy_format.read_array_header_1_0(handle)
            start = handle.tell()
        path.write_bytes(data[: start + int((len(data) - start) * fraction)])
        with pytest.raises(TightpackError, match=r"train\.npy.*truncated"):
            read_legacy_npy(path)

    def test_raw_pickle_is_not_an_npy_file(self, tmp_path: Path) -> None:
        path = tmp_path / "rows.npy"
        path.write_bytes(pickle.dumps(ROWS))
        with pytest.raises(TightpackError, match=r"rows\.npy is not a readable \.npy file"):
            read_legacy_npy(path)

    @pytest.mark.parametrize(
        "array", [np.arange(6), np.zeros(2, dtype=[("input_ids", "i8", (3,)), ("seq_start_id", "i8", (1,))])]
    )
    def test_plain_array_is_refused(self, tmp_path: Path, array: np.ndarray) -> None:
        path = tmp_path / "plain.npy"
        np.save(path, array)
        with pytest.raises(
            TightpackError, match=r"plain\.npy holds a plain .* array of shape \(\d+,\), not the legacy"
        ):
            read_legacy_npy(path)

    def test_two_dimensional_object_array_is_refused(self, tmp_path: Path) -> None:
        array = np.empty((2, 1), dtype=object)
        array[0, 0], array[1, 0] = ROWS
        path = tmp_path / "grid.npy"
        np.save(path, array, allow_pickle=True)
        with pytest.raises(TightpackError, match=r"grid\.npy holds an object array of shape \(2, 1\)"):
            read_legacy_npy(path)

    def test_payload_that_is_not_the_announced_array(self, tmp_path: Path) -> None:
        path = _write_with_payload(tmp_path / "list.npy", pickle.dumps(ROWS, protocol=4), shape=(2,))
        with pytest.raises(TightpackError, match=r"list\.npy: the payload is a list, not the object array"):
            read_legacy_npy(path)


class TestBadRows:
    @pytest.mark.parametrize(
        ("element", "kind"), [([1, 2, 3], "list"), ("text", "str"), (7, "int"), (None, "NoneType")]
    )
    def test_non_dict_element(self, tmp_path: Path, element: object, kind: str) -> None:
        path = _save_raw(tmp_path / "rows.npy", [ROWS[0], element])
        with pytest.raises(TightpackError, match=rf"rows\.npy: row 1 is a {kind}, not a dict with keys"):
            read_legacy_npy(path)

    @pytest.mark.parametrize("missing", ["input_ids", "loss_mask", "seq_start_id"])
    def test_missing_key(self, tmp_path: Path, missing: str) -> None:
        row = {k: v for k, v in ROWS[1].items() if k != missing}
        path = _save_raw(tmp_path / "rows.npy", [ROWS[0], row])
        with pytest.raises(
            TightpackError, match=rf"rows\.npy: row 1 is missing '{missing}'; every packed row needs"
        ):
            read_legacy_npy(path)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"loss_mask": [0, 2, 1, 1, 1]}, r"'loss_mask' must hold only 0 and 1, found 2"),
            ({"input_ids": [5.0, 6.5, 2.0, 7.0, 2.0]}, r"'input_ids' must hold integers, got dtype float64"),
            ({"seq_start_id": [[0], [3]]}, r"'seq_start_id' must be a 1-D sequence, got shape \(2, 1\)"),
            ({"input_ids": [1, [2, 3]]}, r"'input_ids' cannot be read as an array"),
            ({"seq_start_id": [2**64]}, r"'seq_start_id' must hold integers, got dtype object"),
            (
                {"seq_start_id": np.array([2**63], dtype=np.uint64)},
                r"'seq_start_id' holds 9223372036854775808",
            ),
            ({"sample_index": {"nested": 1}}, r"extra key 'sample_index' holds a dict"),
        ],
    )
    def test_bad_values(self, tmp_path: Path, change: dict, message: str) -> None:
        path = _save_raw(tmp_path / "rows.npy", [{**ROWS[0], **change}])
        with pytest.raises(TightpackError, match=rf"rows\.npy: row 0: {message}"):
            read_legacy_npy(path)

    def test_non_str_key(self, tmp_path: Path) -> None:
        path = _save_raw(tmp_path / "rows.npy", [{**ROWS[0], 3: [1]}])
        with pytest.raises(TightpackError, match=r"row 0 has a key of type int \(3\); keys must be str"):
            read_legacy_npy(path)


class TestWriterErrors:
    def test_path_must_end_in_npy(self, tmp_path: Path) -> None:
        with pytest.raises(TightpackError, match=r"must end in \.npy, got .*train\.bin"):
            write_legacy_npy(tmp_path / "train.bin", ROWS)
        assert list(tmp_path.iterdir()) == []

    def test_missing_directory(self, tmp_path: Path) -> None:
        with pytest.raises(TightpackError, match=r"directory .*absent does not exist; create it first"):
            write_legacy_npy(tmp_path / "absent" / "train.npy", ROWS)

    def test_bad_row_writes_nothing(self, tmp_path: Path) -> None:
        rows = [ROWS[0], {"input_ids": [1], "loss_mask": [1]}]
        with pytest.raises(TightpackError, match=r"row 1 for .*train\.npy is missing 'seq_start_id'"):
            write_legacy_npy(tmp_path / "train.npy", rows)
        assert list(tmp_path.iterdir()) == []

    def test_non_mapping_row(self, tmp_path: Path) -> None:
        with pytest.raises(TightpackError, match=r"row 0 for .*train\.npy is a str, not a dict"):
            write_legacy_npy(tmp_path / "train.npy", ROWS[0])  # a dict iterates over its keys

    def test_overwrite_replaces_existing_file(self, tmp_path: Path) -> None:
        path = tmp_path / "train.npy"
        write_legacy_npy(path, ROWS)
        write_legacy_npy(path, ROWS[:1])
        _assert_rows_equal(read_legacy_npy(path), ROWS[:1])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["train.npy"]
