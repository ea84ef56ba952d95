"""The legacy Megatron-Bridge ``.npy`` packed format: a safe reader and a compatible writer.

Deprecated: new artefacts should be packed Parquet (docs/contract.md §2.7; spec resolution lives in
``tightpack.core.paths``). This module exists so old artefacts can be read and so a Megatron-Bridge
version that only reads ``.npy`` can still be fed.

The format (docs/contract.md §2.8) is ``np.save`` of a 1-D **object** ndarray, one element per packed row::

    {"input_ids": [...], "loss_mask": [...], "seq_start_id": [0, ...]}   # values lists or ndarrays

Extra keys (``sample_index``, ...) may ride along. Because the elements are Python objects the payload
after the ``.npy`` header is a pickle stream: it cannot be memory-mapped, and loading it with
``np.load(allow_pickle=True)`` runs whatever the file's author put in it.

Reading therefore never uses pickle's general machinery. The header is parsed with ``numpy.lib.format``;
the payload goes through a restricted unpickler whose allow-list is what ``np.save`` writes for such an
array under numpy 1 (``numpy.core.*``, pickle protocol 2 or 3) and numpy 2 (``numpy._core.*``, protocol 4):

* ``numpy.ndarray``, ``numpy.dtype``, ``numpy[._]core.multiarray._reconstruct`` and ``.scalar``;
* ``_codecs.encode`` (protocol 2 spells raw bytes ``encode(text, "latin1")``);
* the builtins ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``, ``int``, ``float``, ``complex``,
  ``bool``, ``str``, and ``collections.OrderedDict``.

Even the numpy names are not handed out raw: each is a guarded stand-in that accepts only the arguments
and state numpy itself writes and rebuilds the object from checked parts. This matters beyond code
execution: ``ndarray.__setstate__`` on an object array whose element list is shorter than its shape
leaves uninitialised pointers and crashes the interpreter (seen with numpy 2.4), and a crafted ``dtype``
state reaches C code that was never meant for untrusted input. Anything else -- another global
(``os.system``, ``builtins.eval``, ``subprocess.Popen``), a structured or datetime dtype, a malformed
state, a truncated stream -- raises :class:`~tightpack.errors.TightpackError` naming the file.

A plain (non-object) ``.npy`` array is refused as well: fixed-width rows cannot hold a per-row number
of sequence starts, and Megatron-Bridge's reader computes ``seq_start_id + [len(input_ids)]``, which
for an ndarray field silently adds instead of appending. For the same reason the writer stores the
three required values as Python lists.

Row contents are checked for shape and type only (1-D integer arrays, a 0/1 ``loss_mask``); the row
invariants of docs/contract.md §2.7 (``seq_start_id`` starts at 0, increases, stays inside the row) are not.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from tightpack.errors import TightpackError

__all__ = ["read_legacy_npy"]

_REQUIRED_KEYS = ("input_ids", "loss_mask", "seq_start_id")
_FIX_HINT = "regenerate it with tightpack, preferably as packed Parquet"

# dtype kinds a row value may have after unpickling: bool, integers, floats, complex, bytes, str, object.
# Datetimes, voids and structured dtypes never occur in packed rows and are refused.
_ALLOWED_KINDS = frozenset("biufcSUO")


# --------------------------------------------------------------------------------------------------
# Restricted unpickling
# --------------------------------------------------------------------------------------------------


class _Refused(pickle.UnpicklingError):
    """The payload asked for something outside the allow-list; the message says what."""


class _Guarded:
    """A callable handed to the unpickler in place of a numpy function; inert to pickle's BUILD."""

    __slots__ = ("_function", "_name")

    def __init__(self, name: str, function: Any) -> None:
        self._name = name
        self._function = function

    def __call__(self, *args: Any) -> Any:
        return self._function(*args)

    def __setstate__(self, state: object) -> None:
        raise _Refused(f"the payload tries to modify {self._name}")


class _NdarrayMarker:
    """Stands for ``numpy.ndarray``: only our ``_reconstruct`` accepts it, and it cannot be called."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise _Refused("the payload tries to modify numpy.ndarray")


_NDARRAY = _NdarrayMarker()


class _PickledDtype:
    """A checked dtype under construction: ``numpy.dtype(obj, align, copy)`` then an optional BUILD."""

    __slots__ = ("built", "dtype")

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.built = False

    def __setstate__(self, state: object) -> None:
        # numpy writes (3, byteorder, None, None, None, elsize, alignment, flags) for a simple dtype.
        if self.built or type(state) is not tuple or len(state) != 8 or type(state[0]) is not int:
            raise _Refused(f"unexpected pickled state for dtype {self.dtype}")
        version, byteorder, subarray, names, fields, elsize, alignment, flags = state
        if (
            version != 3
            or type(byteorder) is not str
            or byteorder not in ("<", ">", "|", "=")
            or subarray is not None
            or names is not None
            or fields is not None
            or type(elsize) is not int
            or elsize not in (-1, self.dtype.itemsize)
            or type(alignment) is not int
            or type(flags) is not int
        ):
            raise _Refused(f"unexpected pickled state for dtype {self.dtype}")
        if byteorder in ("<", ">") and self.dtype.byteorder != "|":
            self.dtype = self.dtype.newbyteorder(byteorder)
        self.built = True


class _CheckedArray(np.ndarray):
    """The array class our ``_reconstruct`` builds; its ``__setstate__`` validates before numpy's runs."""

    def __setstate__(self, state: object) -> None:
        if self.shape != (0,) or type(state) is not tuple or len(state) != 5:
            raise _Refused("unexpected pickled state for an ndarray")
        version, shape, dtype, fortran_order, data = state
        if (
            type(version) is not int
            or version != 1
            or type(shape) is not tuple
            or not all(type(n) is int and n >= 0 for n in shape)
            or type(dtype) is not _PickledDtype
            or type(fortran_order) is not bool
        ):
            raise _Refused("unexpected pickled state for an ndarray")
        real = dtype.dtype
        count = math.prod(shape)
        if real.hasobject:
            # numpy does not check this itself: a short list leaves NULL elements and crashes later.
            if type(data) is not list or len(data) != count:
                raise _Refused(f"an object array of shape {shape} whose element list does not match it")
        elif type(data) is not bytes or len(data) != count * real.itemsize or (count and not real.itemsize):
            raise _Refused(f"an array of shape {shape} and dtype {real} whose data does not match it")
        np.ndarray.__setstate__(self, (version, shape, real, fortran_order, data))


def _checked_dtype(obj: object, align: object = False, copy: object = False) -> _PickledDtype:
    if type(obj) is not str or type(align) is not bool or type(copy) is not bool:
        raise _Refused("numpy.dtype called with arguments numpy never writes")
    try:
        dtype = np.dtype(obj)
    except TypeError as exc:
        raise _Refused(f"unknown dtype {obj!r}") from exc
    if dtype.kind not in _ALLOWED_KINDS or dtype.names is not None or dtype.subdtype is not None:
        raise _Refused(f"unsupported dtype {dtype} (only plain bool, number, string and object dtypes)")
    return _PickledDtype(dtype)


@functools.cache
def _numpy_rebuilders() -> tuple[Any, Any]:
    """numpy's own ``_reconstruct`` and ``scalar``, taken from what it pickles (works for numpy 1 and 2)."""
    return np.empty(0).__reduce__()[0], np.int64(0).__reduce__()[0]


def _checked_reconstruct(subtype: object, shape: object, typecode: object) -> _CheckedArray:
    if subtype is not _NDARRAY or type(shape) is not tuple or shape != (0,) or typecode not in (b"b", "b"):
        raise _Refused("numpy _reconstruct called with arguments numpy never writes")
    reconstruct, _ = _numpy_rebuilders()
    return reconstruct(_CheckedArray, (0,), b"b")


def _checked_scalar(dtype: object, data: object = None) -> Any:
    if type(dtype) is not _PickledDtype:
        raise _Refused("numpy scalar called without a dtype")
    real = dtype.dtype
    if real.hasobject or type(data) is not bytes or len(data) != real.itemsize:
        raise _Refused(f"a numpy scalar of dtype {real} whose data does not match it")
    _, scalar = _numpy_rebuilders()
    return scalar(real, data)


def _latin1_bytes(text: object, encoding: object) -> bytes:
    if type(text) is not str or type(encoding) is not str or encoding != "latin1":
        raise _Refused("_codecs.encode called with arguments numpy never writes")
    return text.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _Guarded("numpy.dtype", _checked_dtype),
        ("_codecs", "encode"): _Guarded("_codecs.encode", _latin1_bytes),
        ("collections", "OrderedDict"): OrderedDict,
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1, numpy 2
        allowed[(module, "_reconstruct")] = _Guarded(f"{module}._reconstruct", _checked_reconstruct)
        allowed[(module, "scalar")] = _Guarded(f"{module}.scalar", _checked_scalar)
    # `bytes` and `bytearray` are left out on purpose: called with an int they allocate that many bytes.
    for builtin in (dict, list, tuple, set, frozenset, int, float, complex, bool, str):
        allowed[("builtins", builtin.__name__)] = builtin
    return allowed


_ALLOWED_GLOBALS = _allowed_globals()


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves globals only through ``_ALLOWED_GLOBALS``; nothing is imported."""

    def find_class(self, module: str, name: str) -> object:
        if module == "__builtin__":  # protocol 2 spells builtins the Python 2 way
            module = "builtins"
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"refused to load {module}.{name}: not needed to rebuild packed rows") from None

    def persistent_load(self, pid: object) -> object:
        raise _Refused("refused a persistent id: np.save never writes one")


# --------------------------------------------------------------------------------------------------
# Row checks, shared by reader and writer
# --------------------------------------------------------------------------------------------------


def _as_array(value: object, key: str, where: str) -> np.ndarray:
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise TightpackError(f"{where}: {key!r} cannot be read as an array ({exc})") from exc


def _integer_vector(value: object, key: str, where: str, *, bool_ok: bool = False) -> np.ndarray:
    array = _as_array(value, key, where)
    if array.ndim != 1:
        raise TightpackError(f"{where}: {key!r} must be a 1-D sequence, got shape {array.shape}")
    if array.size == 0 and not isinstance(value, np.ndarray):
        return np.empty(0, dtype=np.int64)  # np.asarray([]) is float64
    kinds = "biu" if bool_ok else "iu"
    if array.dtype.kind not in kinds:
        raise TightpackError(f"{where}: {key!r} must hold integers, got dtype {array.dtype}")
    return array


def _to_int64(array: np.ndarray, key: str, where: str) -> np.ndarray:
    limit = np.iinfo(np.int64).max
    if array.dtype == np.uint64 and array.size and int(array.max()) > limit:
        raise TightpackError(f"{where}: {key!r} holds {int(array.max())}, beyond the int64 range")
    return array.astype(np.int64, copy=False)


def _normalize_row(row: object, where: str) -> dict[str, np.ndarray]:
    """Check one row and return its values as arrays (input_ids int64 or its integer dtype,
    loss_mask int8, seq_start_id int64, extras as ``np.asarray`` gives them)."""
    if not isinstance(row, Mapping):
        raise TightpackError(
            f"{where} is a {type(row).__name__}, not a dict with keys {', '.join(_REQUIRED_KEYS)}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in row]
    if missing:
        raise TightpackError(
            f"{where} is missing {', '.join(map(repr, missing))}; every packed row needs "
            f"{', '.join(_REQUIRED_KEYS)} (it has {', '.join(map(repr, row))})"
        )
    values: dict[str, np.ndarray] = {}
    for key, value in row.items():
        if not isinstance(key, str):
            raise TightpackError(
                f"{where} has a key of type {type(key).__name__} ({key!r}); keys must be str"
            )
        if key == "input_ids":
            array = _integer_vector(value, key, where)
            values[key] = array if isinstance(value, np.ndarray) else _to_int64(array, key, where)
        elif key == "seq_start_id":
            values[key] = _to_int64(_integer_vector(value, key, where), key, where)
        elif key == "loss_mask":
            array = _integer_vector(value, key, where, bool_ok=True)
            bad = array[(array != 0) & (array != 1)]
            if bad.size:
                raise TightpackError(f"{where}: 'loss_mask' must hold only 0 and 1, found {bad[0]}")
            values[key] = array.astype(np.int8)
        else:
            array = _as_array(value, key, where)
            if array.dtype.kind not in _ALLOWED_KINDS or array.dtype.hasobject:
                raise TightpackError(
                    f"{where}: extra key {key!r} holds a {type(value).__name__} that is not a plain "
                    f"numeric or string array (dtype {array.dtype})"
                )
            values[key] = array
    return values


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _read_header(handle: Any, where: str) -> tuple[tuple[int, ...], np.dtype]:
    readers = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}
    try:
        version = npy_format.read_magic(handle)
        if version in readers:
            shape, _, dtype = readers[version](handle)
    except ValueError as exc:
        raise TightpackError(
            f"{where} is not a readable .npy file (truncated or not np.save output: {exc})"
        ) from exc
    if version not in readers:
        raise TightpackError(
            f"{where}: .npy format version {version[0]}.{version[1]} is not used for legacy packed files "
            f"(np.save writes 1.0 or 2.0 for object arrays); {_FIX_HINT}"
        )
    return shape, dtype


def read_legacy_npy(path: str | os.PathLike) -> list[dict[str, np.ndarray]]:
    """Read a legacy packed ``.npy`` file without executing anything it contains.

    Args:
        path: A file written by ``np.save`` of a 1-D object array of row dicts (Megatron-Bridge's
            legacy packed format, or :func:`write_legacy_npy`).

    Returns:
        One dict per row, in file order: ``input_ids`` (int64, or the integer dtype it was stored
        with), ``loss_mask`` (int8, 0/1), ``seq_start_id`` (int64), and any extra keys as arrays
        (a stored scalar becomes a 0-d array).

    Raises:
        TightpackError: when the file is missing, is not an ``.npy`` file, is truncated, holds a plain
            (non-object) array, references anything outside the allow-list in the module docstring,
            or has a row that is not a dict, lacks a required key, or holds values of the wrong kind.

    Example::

        write_legacy_npy("train.npy", [{"input_ids": [5, 6, 2], "loss_mask": [0, 1, 1], "seq_start_id": [0]}])
        read_legacy_npy("train.npy")[0]["loss_mask"]   # array([0, 1, 1], dtype=int8)
    """
    where = os.fspath(path)
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise TightpackError(f"Legacy .npy file not found: {where}") from None
    except OSError as exc:
        raise TightpackError(f"Cannot open legacy .npy file {where}: {exc.strerror}") from exc
    with handle:
        shape, dtype = _read_header(handle, where)
        if dtype != np.dtype(object):
            raise TightpackError(
                f"{where} holds a plain {dtype} array of shape {shape}, not the legacy packed format (a 1-D "
                "object array of row dicts, as written by np.save(path, list_of_rows, allow_pickle=True)); "
                f"{_FIX_HINT}"
            )
        if len(shape) != 1:
            raise TightpackError(
                f"{where} holds an object array of shape {shape}; the legacy packed format is 1-D, one "
                f"element per row; {_FIX_HINT}"
            )
        try:
            array = _RestrictedUnpickler(handle).load()
        except _Refused as exc:
            raise TightpackError(
                f"{where}: unsafe or unsupported pickle payload, {exc}. Nothing in it was executed; "
                f"only trust legacy .npy files you produced, or {_FIX_HINT}"
            ) from None
        except EOFError as exc:
            raise TightpackError(f"{where} is truncated: the pickle payload ends early ({exc})") from None
        except Exception as exc:  # any failure of the pickle machinery on malformed input
            raise TightpackError(
                f"{where}: cannot unpickle the payload ({type(exc).__name__}: {exc}); the file is damaged "
                f"or not a legacy packed file; {_FIX_HINT}"
            ) from None
    if not isinstance(array, np.ndarray) or array.dtype != np.dtype(object) or array.shape != shape:
        raise TightpackError(
            f"{where}: the payload is a {type(array).__name__}, not the object array of shape {shape} "
            f"that the header announces; {_FIX_HINT}"
        )
    return [_normalize_row(array[i], f"{where}: row {i}") for i in range(len(array))]


def write_legacy_npy(path: str | os.PathLike, rows: Iterable[Mapping[str, np.ndarray | list]]) -> None:
    """Write rows in the legacy Megatron-Bridge ``.npy`` packed format (deprecated: prefer packed Parquet).

    Every row is checked before anything is written (a mapping with 1-D integer ``input_ids`` and
    ``seq_start_id`` and a 0/1 ``loss_mask``); extra keys are kept. The required values are stored
    as Python lists, as Megatron-Bridge's own writer does, because its reader appends to
    ``seq_start_id`` with ``+``; extra values are stored as numpy arrays. The file is written to a
    temporary name in the same directory and renamed into place, so a failed write leaves no partial
    file behind.

    Args:
        path: Output file; must end in ``.npy`` (any case), the suffix Megatron-Bridge routes to its
            legacy reader. Its directory must exist.
        rows: Packed rows, e.g. ``{"input_ids": [...], "loss_mask": [...], "seq_start_id": [0, ...]}``.

    Raises:
        TightpackError: on a bad path or a bad row (the message names the row index).

    Example::

        write_legacy_npy("out/train.npy", [
            {"input_ids": [5, 6, 2, 7, 2], "loss_mask": [0, 1, 1, 1, 1], "seq_start_id": [0, 3]},
        ])
    """
    target = os.fspath(path)
    if not isinstance(target, str) or not target.lower().endswith(".npy"):
        raise TightpackError(
            f"Legacy packed output path must end in .npy, got {target!r}; Megatron-Bridge only reads "
            ".npy paths as the legacy format (use packed Parquet for anything new)"
        )
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise TightpackError(f"Cannot write {target}: directory {directory} does not exist; create it first")

    stored: list[dict[str, object]] = []
    for index, row in enumerate(rows):
        values = _normalize_row(row, f"row {index} for {target}")
        stored.append(
            {key: (array.tolist() if key in _REQUIRED_KEYS else array) for key, array in values.items()}
        )
    payload = np.empty(len(stored), dtype=object)
    for index, row in enumerate(stored):
        payload[index] = row

    temporary = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temporary, "xb") as handle:
            np.save(handle, payload, allow_pickle=True)
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
