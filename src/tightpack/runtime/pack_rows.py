"""One stored packed row, checked before it is collated: `read_pack_row` and its `PackRowError`.

A stored row (docs/contract.md §2.7) is ``input_ids`` (the sequences one after another),
``loss_mask`` (label-aligned, one value per token), ``seq_start_id`` (where each sequence starts)
and, in tightpack's files, ``seq_len`` (the real runtime length of each sequence). A row that breaks
this (a start past the end, a mask of another length, ids outside the vocabulary) would otherwise
surface as a bare ``IndexError`` deep in numpy or as a device-side assert in the embedding. Each
check is a few numpy operations on the row (no Python loop per token or sequence).

The alignment multiple m is checked against the rows too: every segment of an aligned pack holds a
multiple of m runtime tokens, and less than m of them are padding (``seq_len`` says how many are
real). So m = 8 on packs aligned to 4 fails on the first segment of 4 or 12 tokens, and m = 1 on
them on the first segment with padding; only the manifest (`tightpack.core.pack_manifest`) tells
every wrong m apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tightpack.errors import TightpackError

_SHOWN = 5  # source samples named in a message


class PackRowError(TightpackError):
    """A stored packed row that breaks the row contract; the message names the row and the key.

    Attributes:
        row: the row's position in the batch.
        key: the offending key (``input_ids``, ``loss_mask``, ``seq_start_id``, ``seq_len``).
        problem: what is wrong with it.
        identity: what else identifies the row (its source samples), or "".
    """

    def __init__(self, row: int, key: str, problem: str, identity: str = "") -> None:
        self.row, self.key, self.problem, self.identity = row, key, problem, identity
        super().__init__(f"packed row {row} of the batch{identity}: {key} {problem}")

    def at(self, row: int) -> PackRowError:
        """The same error for the row at position ``row`` of a larger batch."""
        return PackRowError(row, self.key, self.problem, self.identity)


@dataclass(frozen=True)
class StoredRow:
    """The arrays of one checked row (int64; ``loss_mask`` and ``seq_len`` None when absent)."""

    ids: np.ndarray
    starts: np.ndarray
    stored: np.ndarray  # stored tokens per sequence
    loss_mask: np.ndarray | None
    seq_len: np.ndarray | None

    @property
    def runtime(self) -> np.ndarray:
        """Runtime tokens per sequence (stored - 1: the last stored token is only a label)."""
        return self.stored - 1


def _identity(row: Mapping[str, Any]) -> str:
    samples = row.get("sample_index")
    if samples is None:
        return ""
    try:
        values = np.asarray(samples).ravel().tolist()
    except (TypeError, ValueError):
        return ""
    shown = ", ".join(str(value) for value in values[:_SHOWN]) + (", ..." if len(values) > _SHOWN else "")
    return f" (source samples {shown})"


def _integers(row: Mapping[str, Any], key: str, fail, *, flags: bool = False) -> np.ndarray:
    if key not in row or row[key] is None:
        fail(key, f"is missing (the row has {', '.join(sorted(map(str, row))) or 'no keys'})")
    value = row[key]
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        fail(key, f"is not an array of integers ({error})")
    kinds = "iub" if flags else "iu"
    if array.ndim != 1 or array.dtype.kind not in kinds:
        what = f"a {array.ndim}-D array" if array.ndim != 1 else f"of dtype {array.dtype}"
        fail(key, f"must be a 1-D list of integers, got {what}: {_preview(array)}")
    return array.astype(np.int64, copy=False)


def _preview(array: np.ndarray) -> str:
    flat = array.ravel().tolist() if array.dtype != object else list(array.ravel())
    return repr(flat[:_SHOWN])[:-1] + (", ...]" if len(flat) > _SHOWN else "]")


def read_pack_row(
    row: Mapping[str, Any],
    position: int,
    *,
    multiple: int = 1,
    multiple_source: str = "argument",
    vocab_size: int | None = None,
    vocab_source: str = "argument",
    need_loss_mask: bool = True,
) -> StoredRow:
    """Check a stored packed row and return its arrays.

    Args:
        row: ``{input_ids, loss_mask, seq_start_id[, seq_len]}`` as `PackedDataset` returns it (or a
            ``datasets`` row of packed Parquet).
        position: the row's position in its batch, for messages.
        multiple, multiple_source: the alignment multiple the caller assumes, and where it came from.
        vocab_size, vocab_source: ids must lie in ``[0, vocab_size)`` (None: only ``>= 0``).
        need_loss_mask: whether ``loss_mask`` is read (padding rows and ``answer_only_loss=False``
            do not read it).

    Raises:
        PackRowError: naming the row, the key, and the value that breaks the contract.

    >>> read_pack_row({"input_ids": [5, 6, 2, 7, 2], "loss_mask": [0, 1, 0, 1, 0],
    ...                "seq_start_id": [0, 3]}, 0).runtime.tolist()
    [2, 1]
    >>> read_pack_row({"input_ids": [5, 6, 2], "loss_mask": [0, 1, 0], "seq_start_id": [0, 3]}, 1)
    Traceback (most recent call last):
    ...
    tightpack.runtime.pack_rows.PackRowError: packed row 1 of the batch: seq_start_id starts a sequence at 3, past the row's 3 input_ids (the starts must be increasing offsets into input_ids)
    """  # noqa: E501
    if not isinstance(row, Mapping):
        raise PackRowError(position, "row", f"must be a mapping of columns, got {type(row).__name__}")
    identity = _identity(row)

    def fail(key: str, problem: str):
        raise PackRowError(position, key, problem, identity)

    ids = _integers(row, "input_ids", fail)
    if len(ids) == 0:
        fail("input_ids", "is empty")
    lowest, highest = int(ids.min()), int(ids.max())  # the position is searched only on failure
    if lowest < 0:
        at = int(np.argmax(ids < 0))
        fail(
            "input_ids",
            f"holds id {int(ids[at])} at position {at}: ids are never negative",
        )
    if vocab_size is not None and highest >= vocab_size:
        outside = np.flatnonzero(ids >= vocab_size)
        at = int(outside[0])
        fail(
            "input_ids",
            f"holds id {int(ids[at])} at position {at} ({len(outside)} ids in all, up to {highest}), outside "
            f"the vocabulary of {vocab_size} tokens ({vocab_source}): the packs were made with another "
            "tokenizer",
        )
    starts = _integers(row, "seq_start_id", fail)
    if len(starts) == 0 or starts[0] != 0:
        fail("seq_start_id", f"must start with 0 (the first sequence starts the row), got {_preview(starts)}")
    steps = np.flatnonzero(np.diff(starts) <= 0)
    if len(steps):
        i = int(steps[0])
        fail(
            "seq_start_id",
            f"must increase: sequence {i + 1} starts at {int(starts[i + 1])} after sequence {i} at "
            f"{int(starts[i])}",
        )
    if starts[-1] >= len(ids):
        fail(
            "seq_start_id",
            f"starts a sequence at {int(starts[-1])}, past the row's {len(ids)} input_ids (the starts "
            "must be increasing offsets into input_ids)",
        )
    loss_mask = None
    if need_loss_mask:
        loss_mask = _integers(row, "loss_mask", fail, flags=True)
        if len(loss_mask) != len(ids):
            fail("loss_mask", f"has {len(loss_mask)} values for {len(ids)} input_ids (one per token)")
    stored = np.diff(np.append(starts, len(ids)))
    runtime = stored - 1
    seq_len = None
    if row.get("seq_len") is not None:
        seq_len = _integers(row, "seq_len", fail)
        if len(seq_len) != len(starts):
            fail("seq_len", f"has {len(seq_len)} values for {len(starts)} sequences (seq_start_id)")
        wrong = np.flatnonzero((seq_len < 0) | (seq_len > runtime))
        if len(wrong):
            i = int(wrong[0])
            fail(
                "seq_len",
                f"gives sequence {i} {int(seq_len[i])} real tokens, outside [0, {int(runtime[i])}] (its "
                f"runtime tokens: {int(stored[i])} stored - 1)",
            )
    if multiple > 1:
        uneven = np.flatnonzero(runtime % multiple)
        if len(uneven):
            i = int(uneven[0])
            fail(
                "seq_start_id",
                f"gives sequence {i} a segment of {int(runtime[i])} runtime tokens ({int(stored[i])} "
                f"stored), not a multiple of pad_seq_to_mult {multiple} ({multiple_source}): the packs are "
                "aligned to another multiple",
            )
    if seq_len is not None:
        padding = runtime - seq_len
        padded = np.flatnonzero(padding >= multiple)
        if len(padded):
            i = int(padded[0])
            fail(
                "seq_len",
                f"gives sequence {i} {int(seq_len[i])} real tokens in a segment of {int(runtime[i])}: "
                f"{int(padding[i])} token{'s' if padding[i] > 1 else ''} of alignment padding, so the packs "
                f"are aligned to a multiple above pad_seq_to_mult {multiple} ({multiple_source})",
            )
    return StoredRow(ids=ids, starts=starts, stored=stored, loss_mask=loss_mask, seq_len=seq_len)
