"""Summaries of packed datasets on disk: ours, Megatron-Bridge's Parquet, or legacy ``.npy``.

Reads the rows column by column, one row group at a time, so any size summarizes in bounded memory.
A tightpack output folder also has a manifest (settings, counts); a Megatron-Bridge output has
neither, so the pack size is taken from ``--pack-size`` or from a metadata file when one is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core import legacy_npy
from tightpack.core.cost_model import CostModel, cost_spread
from tightpack.core.packed_index import REQUIRED_COLUMNS, check_shards
from tightpack.core.paths import packed_dataset_files
from tightpack.errors import TightpackError

__all__ = ["summarize_packed"]


def _row_batches(path: str):
    """Per row group: (stored length per row, sequences per row, label-aligned supervised tokens per row,
    sum over the row's sequences of their squared runtime length)."""
    if path.lower().endswith(".npy"):
        rows = legacy_npy.read_legacy_npy(path)
        stored = np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
        starts = [np.asarray(r["seq_start_id"], dtype=np.int64).ravel() for r in rows]
        start_offsets = np.concatenate(([0], np.cumsum([len(row) for row in starts]))).astype(np.int64)
        yield (
            stored,
            np.diff(start_offsets),
            np.array([int(np.asarray(r["loss_mask"]).sum()) for r in rows], dtype=np.int64),
            _squared_runtime(
                stored, np.concatenate(starts) if starts else np.zeros(0, np.int64), start_offsets
            ),
        )
        return
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)  # its schema was checked by check_shards
    try:
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group, columns=list(REQUIRED_COLUMNS))
            input_ids = table.column("input_ids").combine_chunks()
            mask = table.column("loss_mask").combine_chunks()
            mask_offsets = mask.offsets.to_numpy()
            mask_values = mask.values.to_numpy(zero_copy_only=False).astype(np.int64)
            cumulative = np.concatenate(([0], np.cumsum(mask_values)))
            stored = pc.list_value_length(input_ids).to_numpy(zero_copy_only=False).astype(np.int64)
            starts = table.column("seq_start_id").combine_chunks()
            start_offsets = starts.offsets.to_numpy().astype(np.int64)
            start_values = starts.values.to_numpy(zero_copy_only=False).astype(np.int64)
            yield (
                stored,
                np.diff(start_offsets),
                cumulative[mask_offsets[1:]] - cumulative[mask_offsets[:-1]],
                _squared_runtime(stored, start_values, start_offsets),
            )
    except (OSError, pa.ArrowException) as error:
        raise TightpackError(f"{path}: cannot read row group {group} ({error})") from error


def _squared_runtime(stored: np.ndarray, starts: np.ndarray, start_offsets: np.ndarray) -> np.ndarray:
    """Per row, the sum of its sequences' squared runtime lengths (stored tokens - 1 each), float64.

    ``starts`` holds every row's ``seq_start_id`` flat, ``start_offsets`` where each row's begin.

    >>> _squared_runtime(np.array([10, 4]), np.array([0, 6, 0]), np.array([0, 2, 3])).tolist()
    [34.0, 9.0]
    """
    counts = np.diff(start_offsets)
    row_of_sequence = np.repeat(np.arange(len(stored)), counts)
    ends = stored[row_of_sequence].copy()
    same_row = row_of_sequence[1:] == row_of_sequence[:-1]
    ends[:-1][same_row] = starts[1:][same_row]
    runtime = np.maximum(ends - starts - 1, 0)
    return np.bincount(row_of_sequence, weights=runtime.astype(np.float64) ** 2, minlength=len(stored))


_MANIFEST_KEYS = ("settings", "tokenizer", "counts", "sources")


def read_manifest(path: Path) -> dict[str, Any]:
    """A tightpack manifest, checked enough to be used: JSON, an object, with its main sections."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TightpackError(f"{path}: not a readable manifest ({error})") from error
    missing = [key for key in _MANIFEST_KEYS if not isinstance(manifest, dict) or key not in manifest]
    if missing:
        raise TightpackError(f"{path}: the manifest lacks {', '.join(missing)}; pack the dataset again")
    if not isinstance(manifest["settings"], dict) or "packed_sequence_size" not in manifest["settings"]:
        raise TightpackError(
            f"{path}: the manifest's settings lack packed_sequence_size; pack the dataset again"
        )
    return manifest


def summarize_packed(
    path: str | Path, *, pack_size: int | None = None, cost_model: CostModel | str | Path | None = None
) -> dict[str, Any]:
    """Summary of a packed dataset: files, packs, sequences, tokens, supervised tokens, fill.

    ``path`` is a file, folder or glob. Runtime tokens of a row are its stored tokens minus one per
    sequence (labels are the tokens shifted by one). ``pack_size`` defaults to the manifest's. With a
    ``cost_model`` (a `CostModel`, a preset name or a JSON file), ``summary["cost"]`` gives the spread
    of pack cost under it: mean, max / mean and coefficient of variation.
    """
    path = Path(path)
    manifest = None
    if path.is_dir() and (path / "manifest.json").is_file():
        manifest = read_manifest(path / "manifest.json")
        pack_size = pack_size or manifest["settings"]["packed_sequence_size"]
    files = packed_dataset_files(path)
    if not files[0].lower().endswith(".npy"):
        check_shards(files, name=str(path))
    model = None if cost_model is None else CostModel.resolve(cost_model)  # before reading anything
    stored, sequences, supervised, squares = [], [], [], []
    for file in files:
        for lengths, counts, labels, squared in _row_batches(file):
            stored.append(lengths)
            sequences.append(counts)
            supervised.append(labels)
            squares.append(squared)
    stored = np.concatenate(stored) if stored else np.zeros(0, np.int64)
    sequences = np.concatenate(sequences) if sequences else np.zeros(0, np.int64)
    supervised = np.concatenate(supervised) if supervised else np.zeros(0, np.int64)
    if len(stored) == 0:
        raise TightpackError(f"packed dataset {str(path)!r} is empty (0 rows)")
    runtime = stored - sequences
    summary: dict[str, Any] = {
        "path": str(path),
        "files": len(files),
        "packs": len(stored),
        "sequences": int(sequences.sum()),
        "runtime_tokens": int(runtime.sum()),
        "supervised_tokens": int(supervised.sum()),
        "max_samples_per_pack": int(sequences.max()),
        "min_packed_length": int(runtime.min()),
        "max_packed_length": int(runtime.max()),
        "mean_packed_length": float(runtime.mean()),
        "packing_factor": float(sequences.sum() / len(stored)),
        "pack_size": pack_size,
    }
    if pack_size:
        summary["efficiency"] = float(runtime.sum() / (len(stored) * pack_size))
        summary["over_pack_size"] = int((runtime > pack_size).sum())
    if model is not None:
        costs = (
            model.linear * runtime
            + model.quadratic * np.concatenate(squares)
            + model.per_sequence * sequences
        )
        spread = cost_spread(costs)
        summary["cost"] = {
            "model": model.to_dict(),
            "mean": spread.mean,
            "max_over_mean": spread.max_over_mean,
            "cv": spread.cv,
        }
    if manifest is not None:
        summary["manifest"] = {k: manifest[k] for k in ("settings", "tokenizer", "counts", "sources")}
    return summary
