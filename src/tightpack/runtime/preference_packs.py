"""`PackedPreferenceDataset`: the packs of ``tightpack pack --format preference|kto|groups`` for training.

Each item is the units of one pack (`tightpack.core.preference_units.PreferenceUnits`, read back from
packed preference Parquet, `tightpack.core.preference_parquet`); `PackedPreferenceDataset.collate`
lays the items of a micro-batch out in one ``[1, T]`` row in the files' layout and alignment
(`tightpack.runtime.preference_batch.build_preference_row`), so a pack read from disk is the very row
`tightpack.runtime.preference_collate.PreferenceCollator` builds from the same rows. Row groups are
decoded one at a time in each process (the last one kept); DataLoader workers open the files
themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from tightpack.core.paths import packed_dataset_files
from tightpack.core.preference_parquet import PreferencePacks
from tightpack.core.preference_units import PreferenceUnits
from tightpack.runtime.preference_batch import build_preference_row

__all__ = ["PackedPreferenceDataset"]


class PackedPreferenceDataset(torch.utils.data.Dataset):
    """Packed preference units with random access, one pack per item.

    Args:
        path: a folder written by ``tightpack pack --format preference|kto|groups``, a shard, or a glob.
        ignore_index: the label of positions without a target in the collated rows.

    Attributes:
        kind: ``preference``, ``kto`` or ``groups``, as packed.
        layout: ``pairs`` or ``shared-prefix``, as packed.
        multiple: the alignment multiple of every THD sequence, as packed.

    Example::

        dataset = PackedPreferenceDataset("packed-pairs/")
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=dataset.collate)
        batch = next(iter(loader))  # input_ids [1, T], labels, position_ids, cu_seqlens_*, branch_*
    """

    def __init__(self, path: str | os.PathLike, *, ignore_index: int = -100) -> None:
        self.packs = PreferencePacks(packed_dataset_files(path))
        described = self.packs.description
        self.kind, self.layout, self.multiple = described.kind, described.layout, described.multiple
        self.pad_id = described.pad_id
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> PreferenceUnits:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} packs")
        return self.packs.units(index % len(self))

    def collate(self, items: Sequence[PreferenceUnits]) -> dict[str, Any]:
        """The units of ``items`` (packs) in one preference row ``[1, T]``, in the files' layout."""
        return build_preference_row(
            PreferenceUnits.concatenate(list(items)),
            self.layout,
            pad_to_multiple_of=self.multiple,
            pad_token_id=self.pad_id,
            ignore_index=self.ignore_index,
        )
