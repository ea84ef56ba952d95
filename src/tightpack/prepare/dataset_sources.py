"""Rows in memory and Hugging Face ``datasets`` as sources.

A generator or iterator is read lazily, once, in chunks; a ``datasets.Dataset`` travels as Arrow
batches (converted in the workers, as Parquet); a ``datasets.IterableDataset`` (streaming too) is
read in one pass, never asked its length. Columnar rows (Arrow, ``datasets``) hold every column of
the schema, so a null there means the key is absent from that row.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tightpack.errors import TightpackError
from tightpack.prepare.chunks import Chunk, Source
from tightpack.prepare.file_sources import PACKED_MARK


def rows_source(
    rows: Callable[[], Iterable[Any]],
    name: str,
    identity: dict[str, Any],
    count: int | None,
    *,
    once: bool = False,
    nulls_absent: bool = False,
    first: Any = None,
) -> Source:
    """Rows from ``rows()``, read lazily in chunks; ``once``: it returns a generator or an iterator,
    which a second reading would find exhausted (so that is refused rather than packing nothing),
    whose ``first`` row, already taken, `Source.peek` gives."""
    started = False

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        nonlocal started
        if once and started:
            raise TightpackError(
                f"{name}: a generator or iterator can be read only once; pass a list or a file to "
                "read the rows again"
            )
        started = True
        position = 0
        iterator = iter(rows())
        while batch := list(itertools.islice(iterator, chunk_rows)):
            yield Chunk(
                first_sample + position, name, rows=batch, first_position=position, nulls_absent=nulls_absent
            )
            position += len(batch)

    return Source(name, identity, count, read, peek=(lambda: first) if once else None)


def datasets_kind(item: Any) -> str | None:
    """``dict`` (a ``DatasetDict`` / ``IterableDatasetDict``), ``map`` (a ``Dataset``), ``iterable``
    (an ``IterableDataset``), or None for anything else. An object of ``datasets`` exists only once
    the package is imported, so this imports nothing."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return None
    if isinstance(item, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return "dict"
    if isinstance(item, datasets.Dataset):
        return "map"
    if isinstance(item, datasets.IterableDataset):
        return "iterable"
    return None


def pick_split(splits: Any, split: str | None) -> tuple[str, Any]:
    """The name and dataset of the split ``split`` of a ``DatasetDict``; without one, its only split."""
    names = ", ".join(repr(str(name)) for name in splits) or "none"
    if split is None:
        if len(splits) == 1:
            return next(iter(splits.items()))
        raise TightpackError(
            f"the input is a {type(splits).__name__} with the splits {names}: choose one with --split "
            "(command line) or split= (Python)"
        )
    if split not in splits:
        raise TightpackError(f"split {split!r} is not in the {type(splits).__name__}; its splits: {names}")
    return split, splits[split]


def dataset_source(dataset: Any, kind: str, split: str | None = None) -> Source:
    """A ``datasets.Dataset`` (``kind="map"``) or ``datasets.IterableDataset`` (``"iterable"``).

    A Dataset is read as Arrow batches, in its own row order (after ``shuffle``/``select`` too) and
    with its formatted columns, whatever its output format (numpy, torch, ...); with a transform
    (``set_transform``), as the rows the transform returns. An IterableDataset is read in one pass
    and has no length.
    """
    label = getattr(getattr(dataset, "info", None), "dataset_name", None) or "in memory"
    name = f"dataset {label}" + (f" split {split!r}" if split is not None else "")
    if PACKED_MARK in (getattr(dataset, "column_names", None) or ()):  # e.g. from `to_hf_dataset`
        raise TightpackError(
            f"input {name} is packed data (a {PACKED_MARK!r} column: one row per pack), not rows: "
            "inputs are rows of samples; to re-pack give the rows they were packed from"
        )
    if kind == "iterable":
        identity = {"dataset": name, "streaming": True}  # no content fingerprint: never reused
        return rows_source(lambda: dataset, name, identity, None, nulls_absent=True)

    identity = {"dataset": name, "fingerprint": dataset._fingerprint, "rows": len(dataset)}
    layout = dataset.format
    if layout["type"] == "custom":
        return rows_source(lambda: dataset, name, identity, len(dataset), nulls_absent=True)

    def read(first_sample: int, chunk_rows: int) -> Iterator[Chunk]:
        import numpy as np

        arrow = dataset.with_format(
            "arrow", columns=layout["columns"], output_all_columns=layout["output_all_columns"]
        )
        position = 0
        for table in arrow.iter(batch_size=chunk_rows):
            # A table from `iter` is a view on the dataset's (memory-mapped) table, which pickles
            # whole (every row) when the chunk goes to a worker; `take` copies these rows alone.
            (batch,) = table.take(np.arange(table.num_rows)).combine_chunks().to_batches()
            yield Chunk(first_sample, name, batch=batch, first_position=position)
            first_sample += batch.num_rows
            position += batch.num_rows

    return Source(name, identity, len(dataset), read)


def saved_dataset(item: Any) -> Any:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict), loaded;
    anything else as it is."""
    if not isinstance(item, (str, Path)) or not Path(item).is_dir():
        return item
    folder = Path(item)
    if not ((folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()):
        return item
    try:
        from datasets import load_from_disk
    except ImportError:
        raise TightpackError(f"input {str(folder)!r} is a saved dataset: pip install datasets") from None
    return load_from_disk(str(folder))
