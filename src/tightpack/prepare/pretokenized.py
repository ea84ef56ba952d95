"""Pre-tokenized rows (``--format tokens``): ``input_ids`` and an optional ``loss_mask`` per row.

No tokenizer runs; the ids are checked against the vocabulary and an EOS is appended as for text
samples (unless the row already ends with it), supervised when the row's last token is. Without a
``loss_mask`` every token is supervised; a null ``loss_mask`` (JSON ``null``, a null Parquet or
``datasets`` value) is no ``loss_mask``, as a null is an absent key in columnar rows. Parquet list
columns are read straight from Arrow buffers, so a chunk never becomes per-token Python objects;
JSON rows are converted row by row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tightpack.core.token_store import append_eos
from tightpack.errors import TightpackError

TOKENS_KEY = "input_ids"
MASK_KEY = "loss_mask"


def _from_arrow(
    batch: Any, source: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, list[tuple[int, str]]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if TOKENS_KEY not in batch.schema.names:
        raise TightpackError(
            f"{source}: no {TOKENS_KEY!r} column for format='tokens' (columns: {batch.schema.names})",
            parameters=("format='tokens'",),
        )
    bad: list[tuple[int, str]] = []

    def flat(column, what: str, bool_ok: bool, null_ok: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
            raise TightpackError(f"{source}: column of type {column.type} is not a list of integers")
        lengths = pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)
        values = column.flatten()
        allowed = pa.types.is_integer(values.type) or (bool_ok and pa.types.is_boolean(values.type))
        if not allowed:
            raise TightpackError(f"{source}: {what} values of type {values.type} are not integers")
        if not null_ok:
            bad.extend((int(row), f"{what} is null") for row in np.flatnonzero(np.asarray(column.is_null())))
        if values.null_count:
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            at = np.flatnonzero(np.asarray(values.is_null()))
            rows = np.searchsorted(offsets, at, side="right") - 1
            bad.extend((int(row), f"{what} holds a null value") for row in np.unique(rows))
            values = values.fill_null(0)
        return lengths, values.to_numpy(zero_copy_only=False).astype(np.int64)

    lengths, ids = flat(batch.column(TOKENS_KEY), TOKENS_KEY, bool_ok=False)
    if MASK_KEY not in batch.schema.names or pa.types.is_null(batch.schema.field(MASK_KEY).type):
        return lengths, ids, None, bad
    mask_column = batch.column(MASK_KEY)
    mask_lengths, values = flat(mask_column, MASK_KEY, bool_ok=True, null_ok=True)
    absent = np.asarray(mask_column.is_null(), dtype=bool)  # a null mask: every token supervised
    fits = (mask_lengths == lengths) & ~absent
    bad.extend(
        (int(row), f"{MASK_KEY} has a different length than {TOKENS_KEY}")
        for row in np.flatnonzero(~fits & ~absent)
    )
    if fits.all():
        return lengths, ids, values, bad
    # Keep the masks of the rows whose lengths agree, token for token; a row without a mask is all
    # ones, and the rows whose lengths differ are dropped as bad.
    row_of_token = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(ids)) - (np.cumsum(lengths) - lengths)[row_of_token]
    kept = fits[row_of_token]
    mask = np.ones(len(ids), dtype=np.int64)
    mask_starts = np.cumsum(mask_lengths) - mask_lengths
    mask[kept] = values[mask_starts[row_of_token[kept]] + position[kept]]
    return lengths, ids, mask, bad


def _integers(value: Any, key: str, *, bool_ok: bool) -> np.ndarray:
    """A JSON list of integers (and booleans where ``bool_ok``) as int64; anything else is refused."""
    allowed = {int, bool} if bool_ok else {int}
    if not isinstance(value, list) or not set(map(type, value)) <= allowed:
        raise ValueError(f"{key!r} must be a list of {'0/1 integers' if bool_ok else 'integers'}")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{key!r} holds an integer beyond int64") from None


def _from_rows(rows: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, list[tuple[int, str]]]:
    lengths, ids, masks, bad = [], [], [], []
    for row_number, row in enumerate(rows):
        try:
            if isinstance(row, Exception):  # a line that did not parse
                raise ValueError(str(row))
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            if TOKENS_KEY not in row:
                text = {"input", "output", "messages", "prompt", "completion", "text"} & set(map(str, row))
                raise ValueError(
                    f"missing key {TOKENS_KEY!r} (keys found: {', '.join(sorted(map(str, row))) or 'none'})"
                    + (
                        "; this run reads pre-tokenized rows, as its first row is one: text rows do not mix "
                        "with them in one run (tokenize them first, or pack them in a run of their own)"
                        if text
                        else ""
                    )
                )
            row_ids = _integers(row[TOKENS_KEY], TOKENS_KEY, bool_ok=False)
            if row.get(MASK_KEY) is not None:
                row_mask = _integers(row[MASK_KEY], MASK_KEY, bool_ok=True)
                if row_mask.shape != row_ids.shape:
                    raise ValueError(f"{MASK_KEY} has a different length than {TOKENS_KEY}")
            else:
                row_mask = np.ones(len(row_ids), np.int64)
        except ValueError as error:
            bad.append((row_number, str(error)))
            row_ids, row_mask = np.zeros(0, np.int64), np.zeros(0, np.int64)
        lengths.append(len(row_ids))
        ids.append(row_ids.astype(np.int64))
        masks.append(row_mask.astype(np.int64))
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    return np.array(lengths, dtype=np.int64), join(ids), join(masks), bad


def pretokenized_arrays(
    chunk: Any, rows: list[Any] | None, vocab_size: int, eos_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, str]]]:
    """Tokens, unshifted mask, stored lengths and the offsets (within the chunk) of the good rows,
    plus ``(offset, reason)`` for the bad ones.

    ``rows`` are the parsed rows of the chunk, or None when the chunk carries an Arrow batch.
    """
    if rows is None:
        lengths, ids, mask, bad = _from_arrow(chunk.batch, chunk.source)
    else:
        lengths, ids, mask, bad = _from_rows(rows)
    if mask is None:
        mask = np.ones(len(ids), dtype=np.int64)
    row_of_token = np.repeat(np.arange(len(lengths)), lengths)
    out_of_range = (ids < 0) | (ids >= vocab_size)
    bad.extend(
        (int(row), f"token id outside the vocabulary [0, {vocab_size})")
        for row in np.unique(row_of_token[out_of_range])
    )
    wrong_mask = (mask != 0) & (mask != 1)
    bad.extend((int(row), f"{MASK_KEY} values must be 0 or 1") for row in np.unique(row_of_token[wrong_mask]))
    good = np.ones(len(lengths), dtype=bool)
    good[[row for row, _ in bad]] = False
    keep = good[row_of_token]
    ids, mask, lengths = ids[keep], mask[keep], lengths[good]

    last = np.maximum(np.cumsum(lengths) - 1, 0)
    eos_supervised = np.where(lengths > 0, mask[last] if len(mask) else 1, 1).astype(bool)
    tokens, loss_mask, stored = append_eos(ids, mask, lengths, eos_id, eos_supervised)
    first_reason: dict[int, str] = {}
    for row, reason in bad:
        first_reason.setdefault(row, reason)
    return tokens, loss_mask, stored, np.flatnonzero(good), sorted(first_reason.items())
