"""Summaries of packed datasets on disk: ours, Megatron-Bridge's Parquet, or legacy ``.npy``.

Reads the rows column by column, one row group at a time, into per-pack and per-sequence counts
(`read_pack_arrays`; 8 bytes per sequence and 32 per pack, never the tokens), then summarizes them
(`summarize_pack_arrays`); `tightpack.reports.plots` draws the same arrays. A tightpack output folder also
has a manifest (settings, counts); a Megatron-Bridge output has none, so the pack size is taken
from ``pack_size`` (``--pack-size``), else from the folder's ``<P>_metadata.jsonl``
(`tightpack.core.pack_manifest.read_pack_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core import legacy_npy
from tightpack.core.cost_model import CostModel, cost_spread
from tightpack.core.pack_manifest import read_manifest, read_pack_settings
from tightpack.core.packed_index import REQUIRED_COLUMNS, check_shards
from tightpack.core.paths import packed_dataset_files
from tightpack.core.preference_parquet import PreferenceFiles, PreferencePacks
from tightpack.core.preference_units import unit_attention_costs
from tightpack.errors import TightpackError


def _row_batches(path: str):
    """Per row group: (stored length per row, sequences per row, label-aligned supervised tokens per row,
    runtime length of every sequence of those rows, row by row)."""
    if path.lower().endswith(".npy"):
        rows = legacy_npy.read_legacy_npy(path)
        stored = np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
        starts = [np.asarray(r["seq_start_id"], dtype=np.int64).ravel() for r in rows]
        start_offsets = np.concatenate(([0], np.cumsum([len(row) for row in starts]))).astype(np.int64)
        yield (
            stored,
            np.diff(start_offsets),
            np.array([int(np.asarray(r["loss_mask"]).sum()) for r in rows], dtype=np.int64),
            sequence_runtime(
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
                sequence_runtime(stored, start_values, start_offsets),
            )
    except (OSError, pa.ArrowException) as error:
        raise TightpackError(f"{path}: cannot read row group {group} ({error})") from error


def sequence_runtime(stored: np.ndarray, starts: np.ndarray, start_offsets: np.ndarray) -> np.ndarray:
    """Runtime length of every sequence (its stored tokens - 1, at least 0), int64, row by row.

    ``starts`` holds every row's ``seq_start_id`` flat, ``start_offsets`` where each row's begin; a
    sequence ends where the next one of its row starts, the last one at the row's stored length.

    >>> sequence_runtime(np.array([10, 4]), np.array([0, 6, 0]), np.array([0, 2, 3])).tolist()
    [5, 3, 3]
    """
    row_of_sequence = np.repeat(np.arange(len(stored)), np.diff(start_offsets))
    ends = stored[row_of_sequence].copy()
    same_row = row_of_sequence[1:] == row_of_sequence[:-1]
    ends[:-1][same_row] = starts[1:][same_row]
    return np.maximum(ends - starts - 1, 0)


@dataclass(frozen=True, eq=False)  # eq=False: == on numpy fields is elementwise; compare by identity
class PackArrays:
    """What `read_pack_arrays` reads of a packed dataset, packs in file order.

    Attributes:
        path: the dataset as given (file, folder or glob).
        files: the files read, in order.
        manifest: the folder's manifest (`read_manifest`), or None (Megatron-Bridge output, a file).
        runtime: runtime tokens per pack, int64 ``[packs]``: stored tokens minus one per sequence
            (labels are the tokens shifted by one).
        sequences: sequences per pack, int64 ``[packs]``.
        supervised: label-aligned supervised tokens per pack, int64 ``[packs]``.
        squared: sum over the pack's sequences of their squared runtime length, float64 ``[packs]``
            (tokens squared: the attention work of the pack).
        sequence_lengths: runtime length of every sequence, pack after pack, int64 ``[sum(sequences)]``.
        units: preference packs only: the units (pairs, KTO samples, groups) of every pack, int64
            ``[packs]``; None for SFT packs.
    """

    path: str
    files: tuple[str, ...]
    manifest: dict[str, Any] | None
    runtime: np.ndarray
    sequences: np.ndarray
    supervised: np.ndarray
    squared: np.ndarray
    sequence_lengths: np.ndarray
    units: np.ndarray | None = None


def read_pack_arrays(path: str | Path) -> PackArrays:
    """Read a packed dataset (file, folder or glob; ours, Megatron-Bridge's, or legacy ``.npy``) into
    per-pack and per-sequence arrays, one row group at a time.

    Raises:
        TightpackError: on a bad manifest, a file that is missing, unreadable or lacks a column, or a
            dataset with no row.
    """
    path = Path(path)
    manifest = None
    if path.is_dir() and (path / "manifest.json").is_file():
        manifest = read_manifest(path / "manifest.json")
    files = packed_dataset_files(path)
    described = None if files[0].lower().endswith(".npy") else PreferenceFiles.of_file(files[0])
    if described is not None:
        return _preference_arrays(str(path), files, manifest, described)
    if not files[0].lower().endswith(".npy"):
        check_shards(files, name=str(path))
    stored, sequences, supervised, lengths = [], [], [], []
    for file in files:
        for row_stored, row_sequences, row_supervised, row_lengths in _row_batches(file):
            stored.append(row_stored)
            sequences.append(row_sequences)
            supervised.append(row_supervised)
            lengths.append(row_lengths)
    stored, sequences, supervised, lengths = (
        np.concatenate(parts) if parts else np.zeros(0, np.int64)
        for parts in (stored, sequences, supervised, lengths)
    )
    if len(stored) == 0:
        raise TightpackError(f"packed dataset {str(path)!r} is empty (0 rows)")
    pack_of_sequence = np.repeat(np.arange(len(stored)), sequences)
    return PackArrays(
        path=str(path),
        files=tuple(files),
        manifest=manifest,
        runtime=stored - sequences,
        sequences=sequences,
        supervised=supervised,
        squared=np.bincount(pack_of_sequence, weights=lengths.astype(np.float64) ** 2, minlength=len(stored)),
        sequence_lengths=lengths,
    )


def _preference_arrays(path: str, files: list[str], manifest, described: PreferenceFiles) -> PackArrays:
    """`PackArrays` of packed preference Parquet: a row is as long as it runs, its sequences are its THD
    sequences (aligned), and its attention work is that of its units' layout."""
    width, sequences, supervised, squared, lengths, units_per_pack = [], [], [], [], [], []
    packs = PreferencePacks(files)
    for group in range(packs.row_groups):
        rows = packs.group(group)
        offsets = rows.offsets
        width.append(np.diff(offsets["input_ids"]))
        sequences.append(np.diff(offsets["sequence_start"]))
        cumulative = np.concatenate([[0], np.cumsum(rows.values["loss_mask"].astype(np.int64))])
        supervised.append(cumulative[offsets["loss_mask"][1:]] - cumulative[offsets["loss_mask"][:-1]])
        units = rows.units(0, len(rows))
        units_per_pack.append(np.diff(offsets["sample_index"]))
        costs = unit_attention_costs(units, described.layout, described.multiple)
        per_row = np.concatenate([[0], np.cumsum(costs)])[offsets["sample_index"]]
        squared.append(np.diff(per_row).astype(np.float64))
        lengths.append(
            sequence_runtime(
                width[-1], rows.values["sequence_start"].astype(np.int64), offsets["sequence_start"]
            )
            + 1
        )
    runtime = np.concatenate(width)
    return PackArrays(
        path=path,
        files=tuple(files),
        manifest=manifest,
        runtime=runtime,
        sequences=np.concatenate(sequences),
        supervised=np.concatenate(supervised),
        squared=np.concatenate(squared),
        sequence_lengths=np.concatenate(lengths),
        units=np.concatenate(units_per_pack),
    )


def pack_costs(arrays: PackArrays, model: CostModel) -> np.ndarray:
    """Cost of each pack under ``model``, float64 ``[packs]``: the `CostModel` formula on the pack's
    sums, ``linear * runtime + quadratic * squared + per_sequence * sequences``.

    The one place a read dataset is priced: the summary's spread and the plot's cost per pack use it.
    """
    return (
        model.linear * arrays.runtime
        + model.quadratic * arrays.squared
        + model.per_sequence * arrays.sequences
    )


def summarize_packed(
    path: str | Path, *, pack_size: int | None = None, cost_model: CostModel | str | Path | None = None
) -> dict[str, Any]:
    """Summary of a packed dataset: files, packs, sequences, tokens, supervised tokens, fill.

        ``path`` is a file, folder or glob. Runtime tokens of a row are its stored tokens minus one per
        sequence (labels are the tokens shifted by one). ``pack_size`` defaults to the manifest's, else to
    the ``pack_size`` of a Megatron-Bridge folder's metadata. With a
        ``cost_model`` (a `CostModel`, a preset name or a JSON file), ``summary["cost"]`` gives the spread
        of pack cost under it: mean, max / mean and coefficient of variation.

        ``read_pack_arrays`` then `summarize_pack_arrays`; call those two to keep the arrays (for plots).
    """
    model = None if cost_model is None else CostModel.resolve(cost_model)  # before reading anything
    return summarize_pack_arrays(read_pack_arrays(path), pack_size=pack_size, cost_model=model)


def summarize_pack_arrays(
    arrays: PackArrays, *, pack_size: int | None = None, cost_model: CostModel | str | Path | None = None
) -> dict[str, Any]:
    """The summary of `summarize_packed` from arrays already read (`read_pack_arrays`)."""
    model = None if cost_model is None else CostModel.resolve(cost_model)
    manifest = arrays.manifest
    if manifest is not None:
        pack_size = pack_size or manifest["settings"]["packed_sequence_size"]
    elif pack_size is None and (recorded := read_pack_settings(arrays.files).pack_size) is not None:
        pack_size = recorded.value  # a Megatron-Bridge folder's <P>_metadata.jsonl records it
    runtime, sequences = arrays.runtime, arrays.sequences
    summary: dict[str, Any] = {
        "path": arrays.path,
        "files": len(arrays.files),
        "packs": len(runtime),
        "sequences": int(sequences.sum()),
        "runtime_tokens": int(runtime.sum()),
        "supervised_tokens": int(arrays.supervised.sum()),
        "max_samples_per_pack": int(sequences.max()),
        "min_packed_length": int(runtime.min()),
        "max_packed_length": int(runtime.max()),
        "mean_packed_length": float(runtime.mean()),
        "packing_factor": float(sequences.sum() / len(runtime)),
        "pack_size": pack_size,
    }
    if arrays.units is not None:  # preference packs: sequences are branches (pairs) or units
        summary["units"] = int(arrays.units.sum())
        summary["units_per_pack"] = float(arrays.units.mean())
        summary["max_units_per_pack"] = int(arrays.units.max())
    if pack_size:
        summary["efficiency"] = float(runtime.sum() / (len(runtime) * pack_size))
        summary["over_pack_size"] = int((runtime > pack_size).sum())
    if model is not None:
        spread = cost_spread(pack_costs(arrays, model))
        summary["cost"] = {
            "model": model.to_dict(),
            "mean": spread.mean,
            "max_over_mean": spread.max_over_mean,
            "cv": spread.cv,
        }
    if manifest is not None:
        summary["manifest"] = {k: manifest[k] for k in ("settings", "tokenizer", "counts", "sources")}
        if "mixture" in manifest:  # a mixture's statistics per source and its windows
            summary["manifest"]["mixture"] = manifest["mixture"]
    return summary
