"""`PackedDataset`: packed rows for training, from packed Parquet (ours or Megatron-Bridge's) or legacy .npy.

Rows come back as ``{input_ids, loss_mask, seq_start_id[, seq_len]}`` numpy arrays, the input of
`tightpack.runtime.collate.PackedCollate`. Parquet shards are read through a memory-mapped index
(`tightpack.core.packed_index`), built once per set of shards, so a shuffled access costs two slices
instead of decoding a row group. Files are opened lazily in each process, after DataLoader workers
start; the constructor only reads Parquet footers (schema and row counts).

docs/contract.md §2.9: a negative index is a padding row (the batch sampler pads the last global
batch with -1): real tokens, all-zero loss mask. Beyond the reference, such a row also carries
``padding_row: True`` (real rows have no such key): a collate that rebuilds the loss mask from the
tokens (``answer_only_loss=False``) could not tell it from a real row otherwise. With
``max_num_samples`` the dataset is an epoch-level mapping: every epoch a seeded permutation of the
rows, truncated to ``max_num_samples``.
"""

from __future__ import annotations

import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tightpack.core import legacy_npy
from tightpack.core.pack_manifest import PackSettings, read_pack_settings
from tightpack.core.packed_index import PackedIndex, check_shards
from tightpack.core.paths import default_cache_dir, resolve_parquet_spec
from tightpack.errors import TightpackError

__all__ = ["PackedDataset"]


def _npy_rows(path: str) -> int:
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    with open(path, "rb") as handle:
        try:
            shape, _, _ = readers[np.lib.format.read_magic(handle)](handle)
        except (KeyError, ValueError) as error:
            raise TightpackError(f"{path}: not a readable .npy file ({error})") from error
    if len(shape) != 1:
        raise TightpackError(f"{path}: a legacy packed .npy holds a 1-D array of rows, got shape {shape}")
    return shape[0]


class PackedDataset(torch.utils.data.Dataset):
    """Packed rows with random access.

    Args:
        path: a packed Parquet file, folder or glob (docs/contract.md §2.7 rules), or a legacy ``.npy``.
        max_num_samples: length of an epoch-level shuffled mapping over the rows (oversampling
            allowed); None: the rows themselves, in order.
        seed: seed of that mapping.
        cache_dir: where Parquet indexes are kept (default `default_cache_dir` / "index").

    Example::

        dataset = PackedDataset("packed/")
        row = dataset[0]  # input_ids, loss_mask, seq_start_id (numpy arrays) of the first pack
        padding = dataset[-1]  # the last pack with an all-zero loss_mask and padding_row=True
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_num_samples: int | None = None,
        seed: int = 0,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        path = str(path)
        self.is_npy = path.lower().endswith(".npy")
        if self.is_npy:
            if not Path(path).is_file():
                raise TightpackError(f"legacy packed file not found: {path}")
            self.files = [path]
            self.rows = _npy_rows(path)
            if self.rows == 0:
                raise TightpackError(f"packed dataset {path} is empty (0 rows)")
        else:
            self.files = resolve_parquet_spec(path)
            self.rows = check_shards(self.files, name=path)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "index"
        self.mapping = None
        if max_num_samples is not None:
            if max_num_samples < 1:
                raise TightpackError(f"max_num_samples must be positive, got {max_num_samples}")
            rng = np.random.default_rng(seed)
            epochs = math.ceil(max_num_samples / self.rows)
            self.mapping = np.concatenate([rng.permutation(self.rows) for _ in range(epochs)])[
                :max_num_samples
            ]
        self._source = None
        self._source_pid = None

    def __len__(self) -> int:
        return self.rows if self.mapping is None else len(self.mapping)

    @cached_property
    def settings(self) -> PackSettings:
        """What the packs record of themselves, read once: EOS (pad) id, alignment multiple, pack size
        and vocabulary size, each with the file and key it came from (`read_pack_settings`; None where
        not recorded, as in Megatron-Bridge's folders). `PackedCollate.from_dataset` reads it."""
        return read_pack_settings(self.files)

    def _rows(self):
        if self._source is None or self._source_pid != os.getpid():  # per process, after a fork
            if self.is_npy:
                self._source = legacy_npy.read_legacy_npy(self.files[0])
            else:
                self._source = PackedIndex.ensure(self.files, self.cache_dir)
            self._source_pid = os.getpid()
        return self._source

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        padding = index < 0  # on the index given: the sampler pads with -1
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for a packed dataset of {len(self)} rows")
        if self.mapping is not None:
            index = int(self.mapping[index])
        index %= self.rows
        source = self._rows()
        row = dict(source[index]) if self.is_npy else source.row(index)
        if padding:
            row["loss_mask"] = np.zeros_like(row["loss_mask"])
            row["padding_row"] = True
        return row

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_source"] = state["_source_pid"] = None  # reopened where it is used
        return state
