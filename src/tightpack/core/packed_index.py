"""Random access to packed datasets: a flat, memory-mapped index built once from the Parquet shards.

Parquet decodes whole pages of a row group; reading one pack of a 500-pack row group decodes all of
them, and a shuffled sampler misses any row-group cache almost every time (docs/contract.md §10).
The index turns the packed columns into flat arrays, written once (a sequential decode of every
shard) and memory-mapped afterwards, so fetching a pack is two slices:

- ``input_ids.bin`` int32 / ``loss_mask.bin`` int8: every pack's tokens and mask, back to back;
- ``row_offsets.bin`` int64 ``[rows + 1]``: pack ``i`` is ``[row_offsets[i], row_offsets[i+1])``;
- ``seq_start_id.bin`` int64 and ``seq_offsets.bin`` int64 ``[rows + 1]``: its sequence starts;
- ``seq_len.bin`` int64 (only when the shards have our ``seq_len`` column);
- ``index.json``: the shards it was built from (path, size, mtime), rows, tokens.

An index is keyed by its shards' paths, sizes and modification times; a changed shard gets a new one.
It is written to a temporary folder and renamed into place, so concurrent builders never see half of
one (the first rename wins).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tightpack.errors import TightpackError

REQUIRED_COLUMNS = ("input_ids", "loss_mask", "seq_start_id")
_FORMAT_VERSION = 1


def check_shards(files: list[str], name: str | None = None) -> int:
    """Check every shard's schema (footer only) and return the total number of rows; ``name`` is
    how errors call the dataset (default: its first file).

    Raises:
        TightpackError: a shard that is not Parquet, misses a required column, or an empty dataset.
    """
    rows = 0
    for file in files:
        try:
            parquet = pq.ParquetFile(file)
        except (OSError, pa.ArrowException) as error:
            raise TightpackError(f"{file}: not a readable Parquet file ({error})") from error
        missing = [c for c in REQUIRED_COLUMNS if c not in parquet.schema_arrow.names]
        if missing:
            raise TightpackError(
                f"Packed Parquet file {file!r} is missing required columns: {', '.join(missing)}"
            )
        rows += parquet.metadata.num_rows
    if rows == 0:
        raise TightpackError(f"packed dataset {name or files[0]!r} is empty (0 rows)")
    return rows


def index_key(files: list[str]) -> str:
    """Identity of a set of shards: resolved paths, sizes and modification times."""
    identity = []
    for file in files:
        stat = os.stat(file)
        identity.append([str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps([_FORMAT_VERSION, identity]).encode()).hexdigest()[:24]


def flat_list_column(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, per-row lengths) of a list column, without Python objects."""
    array = column.combine_chunks()
    lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return array.flatten().to_numpy(zero_copy_only=False), lengths


def _build(files: list[str], folder: Path) -> None:
    has_seq_len = all("seq_len" in pq.ParquetFile(file).schema_arrow.names for file in files)
    columns = [*REQUIRED_COLUMNS, *(["seq_len"] if has_seq_len else [])]
    names = {"input_ids": "input_ids.bin", "loss_mask": "loss_mask.bin", "seq_start_id": "seq_start_id.bin"}
    names |= {"seq_len": "seq_len.bin"} if has_seq_len else {}
    handles = {column: open(folder / names[column], "wb") for column in columns}
    row_lengths, seq_counts = [], []
    try:
        for file in files:
            parquet = pq.ParquetFile(file)
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group, columns=columns)
                ids, id_lengths = flat_list_column(table.column("input_ids"))
                mask, mask_lengths = flat_list_column(table.column("loss_mask"))
                starts, start_counts = flat_list_column(table.column("seq_start_id"))
                if not np.array_equal(id_lengths, mask_lengths):
                    row = int(np.flatnonzero(id_lengths != mask_lengths)[0])
                    raise TightpackError(
                        f"{file}: row group {group}, row {row}: loss_mask length != input_ids length"
                    )
                handles["input_ids"].write(ids.astype(np.int32).tobytes())
                handles["loss_mask"].write(mask.astype(np.int8).tobytes())
                handles["seq_start_id"].write(starts.astype(np.int64).tobytes())
                if has_seq_len:
                    handles["seq_len"].write(
                        flat_list_column(table.column("seq_len"))[0].astype(np.int64).tobytes()
                    )
                row_lengths.append(id_lengths)
                seq_counts.append(start_counts)
    finally:
        for handle in handles.values():
            handle.close()
    for name, counts in (("row_offsets.bin", row_lengths), ("seq_offsets.bin", seq_counts)):
        offsets = np.zeros(sum(len(c) for c in counts) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(counts) if counts else np.zeros(0, np.int64), out=offsets[1:])
        offsets.tofile(folder / name)
    meta = {"format_version": _FORMAT_VERSION, "files": files, "rows": int(sum(len(c) for c in row_lengths))}
    (folder / "index.json").write_text(json.dumps(meta, indent=1) + "\n")


@dataclass(frozen=True)
class PackedIndex:
    """A memory-mapped packed index (see the module docstring)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    row_offsets: np.ndarray
    seq_start_id: np.ndarray
    seq_offsets: np.ndarray
    seq_len: np.ndarray | None

    @classmethod
    def ensure(cls, files: list[str], cache_dir: str | Path) -> PackedIndex:
        """Open the index of ``files`` under ``cache_dir``, building it first when missing."""
        folder = Path(cache_dir) / index_key(files)
        if not (folder / "index.json").is_file():
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            staging = Path(cache_dir) / f".{folder.name}.partial-{uuid.uuid4().hex[:12]}"
            staging.mkdir()
            try:
                _build(files, staging)
                try:
                    staging.rename(folder)
                except OSError:  # another process renamed its build first: use that one
                    if not (folder / "index.json").is_file():
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return cls.open(folder)

    @classmethod
    def open(cls, folder: str | Path) -> PackedIndex:
        folder = Path(folder)

        def mapped(name: str, dtype) -> np.ndarray:
            path = folder / name
            return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)

        seq_len = folder / "seq_len.bin"
        return cls(
            input_ids=mapped("input_ids.bin", np.int32),
            loss_mask=mapped("loss_mask.bin", np.int8),
            row_offsets=np.fromfile(folder / "row_offsets.bin", dtype=np.int64),
            seq_start_id=mapped("seq_start_id.bin", np.int64),
            seq_offsets=np.fromfile(folder / "seq_offsets.bin", dtype=np.int64),
            seq_len=mapped("seq_len.bin", np.int64) if seq_len.is_file() else None,
        )

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, index: int) -> dict[str, np.ndarray]:
        """Pack ``index`` as ``{input_ids, loss_mask, seq_start_id[, seq_len]}`` (copies)."""
        tokens = slice(self.row_offsets[index], self.row_offsets[index + 1])
        sequences = slice(self.seq_offsets[index], self.seq_offsets[index + 1])
        row = {
            "input_ids": np.array(self.input_ids[tokens]),
            "loss_mask": np.array(self.loss_mask[tokens]),
            "seq_start_id": np.array(self.seq_start_id[sequences]),
        }
        if self.seq_len is not None:
            row["seq_len"] = np.array(self.seq_len[sequences])
        return row
