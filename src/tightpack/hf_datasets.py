"""Packs as Hugging Face ``datasets``, both ways: what TRL and ``Trainer`` users already have.

- `to_hf_dataset`: the packs of ``tightpack pack`` as a ``datasets.Dataset`` with the columns
  `tightpack.runtime.hf_trainer.PackingCollator` reads (``input_ids``, ``loss_mask``,
  ``seq_start_id``, ``seq_len``), ready for ``Trainer(train_dataset=...)``.
- `from_hf_packed`: a TRL packed dataset (``trl.pack_dataset``: ``input_ids`` with ``seq_lengths``,
  or with ``position_ids`` restarting at every sequence; optionally ``completion_mask`` or
  ``assistant_masks``, 1 on the tokens that are targets) written as tightpack's packed Parquet and
  ``metadata.json``, so ``tightpack verify`` / ``inspect``, `PackedDataset` and Megatron-Bridge read it.

Each TRL sequence of ``n`` tokens becomes a stored sequence of ``n`` tokens (Megatron-Bridge's layout:
``n - 1`` inputs, the last token a target only), which trains on exactly the targets TRL's padding-free
collator gives it. TRL keeps no source rows: ``sample_index`` numbers the sequences in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from tightpack.core.pack_plan import PackPlan
from tightpack.core.packed_index import REQUIRED_COLUMNS, check_shards
from tightpack.core.packed_parquet import PackedRows
from tightpack.core.paths import resolve_parquet_spec
from tightpack.core.stats import pack_stats
from tightpack.errors import TightpackError
from tightpack.offline.output_folder import METADATA_NAME

__all__ = ["from_hf_packed", "to_hf_dataset"]

_MASK_COLUMNS = ("completion_mask", "assistant_masks")


def to_hf_dataset(path: str | Path):
    """The packs at ``path`` (an output folder, file or glob) as a ``datasets.Dataset``, one row per pack.

    Use it with ``TrainingArguments(remove_unused_columns=False)`` and `PackingCollator`.

    Raises:
        ImportError: ``datasets`` is not installed (``pip install 'tightpack[hf]'``).
    """
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "to_hf_dataset needs the datasets package: pip install 'tightpack[hf]' (or pip install datasets)"
        ) from None

    files = resolve_parquet_spec(str(path))
    check_shards(files, name=str(path))
    columns = (
        [*REQUIRED_COLUMNS, "seq_len"]
        if "seq_len" in pq.read_schema(files[0]).names
        else list(REQUIRED_COLUMNS)
    )
    return datasets.Dataset.from_parquet(files, columns=columns)


def _sequence_lengths(row: dict[str, Any], index: int) -> np.ndarray:
    if row.get("seq_lengths") is not None:
        lengths = np.asarray(row["seq_lengths"], dtype=np.int64)
    elif row.get("position_ids") is not None:
        starts = np.flatnonzero(np.asarray(row["position_ids"]) == 0)
        if not len(starts) or starts[0] != 0:
            raise TightpackError(
                f"pack {index}: position_ids must start at 0 and restart at 0 for each sequence"
            )
        lengths = np.diff(np.append(starts, len(row["position_ids"])))
    else:
        raise TightpackError(
            f"pack {index} has neither seq_lengths nor position_ids: not a packed dataset "
            "(trl.pack_dataset with strategy='bfd' writes seq_lengths)"
        )
    if int(lengths.sum()) != len(row["input_ids"]) or bool((lengths < 2).any()):
        raise TightpackError(
            f"pack {index}: sequence lengths {lengths.tolist()} must be at least 2 and sum to its "
            f"{len(row['input_ids'])} tokens"
        )
    return lengths


def from_hf_packed(dataset, output: str | Path, *, pack_size: int, overwrite: bool = False) -> Path:
    """Write a TRL packed ``datasets.Dataset`` (or any iterable of such rows) as packed Parquet at ``output``.

    Args:
        pack_size: the packs' size in runtime tokens (TRL's ``max_length``); a pack over it is an error.

    Returns the output folder: ``packs-00000.idx.parquet`` and ``metadata.json``.
    """
    output = Path(output)
    if output.exists() and not overwrite and any(output.iterdir()):
        raise TightpackError(f"output {str(output)!r} exists; pass overwrite=True or choose another folder")
    tokens, masks, starts, lengths, pack_sizes = [], [], [], [], []
    for index, row in enumerate(dataset):
        sequences = _sequence_lengths(row, index)
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask_key = next((key for key in _MASK_COLUMNS if row.get(key) is not None), None)
        targets = np.asarray(row[mask_key], dtype=np.int8) if mask_key else np.ones(len(ids), np.int8)
        # label-aligned: position t trains on token t + 1 of its sequence
        label_mask = np.append(targets[1:], 0)
        label_mask[np.cumsum(sequences) - 1] = 0
        if int((sequences - 1).sum()) > pack_size:
            raise TightpackError(
                f"pack {index} holds {int((sequences - 1).sum())} runtime tokens, over pack_size {pack_size}"
            )
        tokens.append(ids)
        masks.append(label_mask)
        starts.append(np.cumsum(sequences) - sequences)
        lengths.append(sequences)
        pack_sizes.append(len(sequences))
    if not tokens:
        raise TightpackError("the dataset has no packs")
    stored = np.concatenate(lengths)
    row_tokens = np.array([len(ids) for ids in tokens])
    rows = PackedRows(
        input_ids=np.concatenate(tokens).astype(np.int32),
        loss_mask=np.concatenate(masks),
        row_offsets=np.concatenate(([0], np.cumsum(row_tokens))),
        seq_start_id=np.concatenate(starts),
        seq_offsets=np.concatenate(([0], np.cumsum(pack_sizes))),
        sample_index=np.arange(len(stored)),
        seq_len=stored - 1,
    )
    output.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows.to_table(), output / "packs-00000.idx.parquet")
    plan = PackPlan(np.arange(len(stored)), np.concatenate(([0], np.cumsum(pack_sizes))))
    metadata = [pack_stats(plan, stored - 1, pack_size).megatron_metadata()]
    (output / METADATA_NAME).write_text(json.dumps(metadata, indent=2) + "\n")
    return output
