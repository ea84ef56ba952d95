"""Vision-language packs at training time: pixels loaded once, where the batch is built.

Offline (``tightpack pack --vision-processor DIR``), packs hold token ids and, per sequence, the JSON
of its images and videos (files, patch grids, frame rates: the ``media`` column,
`tightpack.prepare.vision_rows.media_json`), never pixels. `VisionPackedDataset` reads a pack,
collates it (`tightpack.runtime.collate.PackedCollate`), loads each member's media with a
`MediaLoader` and adds the visual tensors and the multimodal positions
(`tightpack.runtime.vlm.add_vision`). `VisionSFTCollator` packs raw rows at collate time into the same
batch. A loader whose grid differs from the one recorded at packing time means the processor
settings changed since: the tokens no longer fit the pixels, and the pack must be rebuilt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from tightpack.errors import TightpackError
from tightpack.prepare.formats import FormatConfig
from tightpack.prepare.media import open_image
from tightpack.prepare.tokenize import Encoder
from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer
from tightpack.prepare.vision_rows import MediaItem, VisionSpec, parse_media_json
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.collate_truncation import LongSampleCounts, LongSampleRules
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.online_config import LongSamples
from tightpack.runtime.sft_collate import shift_labels
from tightpack.runtime.vlm import add_vision, pack_vlm_samples

__all__ = ["VisionPackedDataset", "VisionSFTCollator", "processor_media_loader"]

MediaLoader = Callable[[MediaItem], dict[str, torch.Tensor]]
"""One image or video -> its visual tensors: ``pixel_values`` and ``image_grid_thw`` (``[1, 3]``), or
``pixel_values_videos``, ``video_grid_thw`` and optionally ``second_per_grid_ts`` (``[1]``)."""


def open_picture(path: str | Path) -> Any:
    """One picture as the processors read it (transformers' ``load_image``): decoded, turned upright
    by its EXIF orientation, in RGB (a PIL image).

    Raises:
        TightpackError: naming the file, when it is missing or cannot be decoded.
    """
    from PIL import Image

    try:
        return open_image(path)
    except FileNotFoundError:
        raise TightpackError(f"media file {path} does not exist (moved or deleted since packing?)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise TightpackError(f"media file {path} cannot be read: {error}") from None


def processor_media_loader(processor: Any, media_root: str | Path = ".") -> MediaLoader:
    """A `MediaLoader` running a transformers processor's image and video processors on the files
    (relative paths from ``media_root``, read by `open_picture`); frames are given as already sampled."""
    root = Path(media_root)

    def load(item: MediaItem) -> dict[str, torch.Tensor]:
        pictures = [open_picture(root / path) for path in item.paths]
        if item.kind == "image":
            out = processor.image_processor(images=pictures, return_tensors="pt")
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        frames = np.stack([np.asarray(picture) for picture in pictures])
        out = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        visual = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}
        temporal = getattr(processor.video_processor, "temporal_patch_size", 2)
        if item.fps is not None:
            visual["second_per_grid_ts"] = torch.tensor([item.second_per_grid(temporal)])
        return visual

    return load


def load_visuals(media: str | Sequence[MediaItem], load: MediaLoader) -> dict[str, torch.Tensor]:
    """The visual tensors of one sequence's media (its `media_json` or items), concatenated in order.

    Raises:
        TightpackError: when a loaded grid differs from the recorded one (stale packs), or when
            ``load`` fails on an item (the error names its files).
    """
    items = parse_media_json(media) if isinstance(media, str) else list(media)
    visual: dict[str, list[torch.Tensor]] = {}
    for item in items:
        try:
            loaded = load(item)
        except TightpackError:
            raise
        except Exception as error:  # a loader of the user's: name the files it was given
            raise TightpackError(f"{item.kind} {_files(item)} cannot be loaded: {error}") from error
        grid = loaded["image_grid_thw" if item.kind == "image" else "video_grid_thw"].reshape(-1).tolist()
        if tuple(grid) != tuple(item.grid):
            raise TightpackError(
                f"{item.kind} {item.paths[0]} has the patch grid {grid} now but {list(item.grid)} when it "
                "was packed: the processor settings (or the file) changed since; re-pack with the "
                "processor used for training"
            )
        for key, value in loaded.items():
            visual.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in visual.items()}


def _files(item: MediaItem) -> str:
    if len(item.paths) == 1:
        return item.paths[0]
    return f"{item.paths[0]} ... {item.paths[-1]} ({len(item.paths)} frames)"


class _MediaColumn:
    """The ``media`` column of packed Parquet files, read a row group at a time."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.groups = []  # (first row, file, row group)
        first = 0
        for name in files:
            metadata = pq.ParquetFile(name).metadata
            if "media" not in metadata.schema.to_arrow_schema().names:
                raise TightpackError(
                    f"{name} has no media column: it was not packed for vision (pass --vision-processor to "
                    "tightpack pack)"
                )
            for group in range(metadata.num_row_groups):
                self.groups.append((first, name, group))
                first += metadata.row_group(group).num_rows
        self.starts = np.array([start for start, _, _ in self.groups])
        self._cached: tuple[int, list] | None = None

    def location(self, index: int) -> tuple[str, int]:
        """The file holding pack ``index`` and the pack's row in that file."""
        at = int(np.searchsorted(self.starts, index, side="right")) - 1
        name = self.groups[at][1]
        first_of_file = next(start for start, file, _ in self.groups if file == name)
        return name, index - first_of_file

    def row(self, index: int) -> list[str]:
        at = int(np.searchsorted(self.starts, index, side="right")) - 1
        if self._cached is None or self._cached[0] != at:
            _, name, group = self.groups[at]
            column = pq.ParquetFile(name).read_row_group(group, columns=["media"]).column("media")
            self._cached = (at, column.to_pylist())
        return self._cached[1][index - int(self.starts[at])]


class VisionPackedDataset(torch.utils.data.Dataset):
    """Offline vision packs as THD batches with pixels: one pack per item, ``[1, T]``.

    Args:
        path: the packed output folder (or files) of ``tightpack pack --vision-processor``.
        collate: the packs' `PackedCollate` (its ``pad_seq_to_mult`` must be the packs' multiple).
        rope: the model's multimodal positions (``QwenVLRope.from_config(model.config)``).
        load: loads one image or video (`processor_media_loader`, or your own).
    """

    def __init__(self, path: str | Path, collate: PackedCollate, rope: QwenVLRope, load: MediaLoader) -> None:
        self.packs = PackedDataset(path)
        self.media = _MediaColumn(self.packs.files)
        self.collate, self.rope, self.load = collate, rope, load

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.packs[index]
        batch = self.collate([row])
        at = int(index) % len(self.packs)
        try:
            members = [load_visuals(media, self.load) for media in self.media.row(at)]
        except TightpackError as error:
            file, offset = self.media.location(at)
            raise TightpackError(f"pack {at} ({file}, row {offset}): {error}") from error
        segments = int(batch["cu_seqlens_q"].reshape(-1).numel()) - 1
        return add_vision(batch, members + [{}] * (segments - len(members)), self.rope)


class VisionSFTCollator:
    """Pack raw vision-language rows at collate time into one THD row with pixels.

    Rows become tokens as ``tightpack pack`` makes them (same formatter, tokenizer and vision
    expansion); each sequence is its stored tokens without the final one, labels shifted by one, as
    the offline packs hold it, so both paths give the same batch for the same samples.

    ``max_length`` and ``long_samples`` are those of ``tightpack pack --max-seq-length
    --long-samples`` (`tightpack.runtime.collate_truncation`): a text-only sample over ``max_length``
    tokens is cut as offline, one with images or videos is left out (a cut could split an image's
    tokens), and a sample with no supervised token is left out; ``long_sample_counts`` and
    ``last_batch_counts`` say what was, and a batch left with no sample raises `TightpackError`.
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec | str | Path | None,
        vision: VisionSpec,
        rope: QwenVLRope,
        load: MediaLoader,
        *,
        format: FormatConfig | None = None,
        max_length: int | None = None,
        long_samples: LongSamples = "truncate",
        pad_to_multiple_of: int = 1,
        ignore_index: int = -100,
    ) -> None:
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
        config = format or FormatConfig()
        self.encoder = Encoder(spec, dataclasses.replace(config, vision=vision))
        self.long_samples = LongSampleRules(
            max_length, long_samples, config.truncation_method, owner=type(self).__name__, stored_extra=1
        )
        self.rope, self.load = rope, load
        self.pad_to_multiple_of, self.ignore_index = pad_to_multiple_of, ignore_index

    @property
    def long_sample_counts(self) -> LongSampleCounts:
        """Running totals of the batches collated so far (`PackingCollator.long_sample_counts`)."""
        return self.long_samples.totals

    @property
    def last_batch_counts(self) -> LongSampleCounts:
        """The counts of the last batch collated."""
        return self.long_samples.last

    def __call__(self, rows: Sequence[Any]) -> dict[str, Any]:
        result = self.encoder.encode_rows(list(rows), source="batch")
        if result.bad_rows:
            bad = result.bad_rows[0]
            raise TightpackError(f"{bad.location}: {bad.reason}")
        kept, fitted = self.long_samples.fit(result)
        samples = []
        for index, (ids, mask) in zip(kept, fitted, strict=True):
            labels, loss_mask = shift_labels(ids, mask, self.ignore_index)
            sample = {
                "input_ids": torch.as_tensor(ids[:-1].astype(np.int64)),
                "labels": torch.from_numpy(labels[:-1]),
                "loss_mask": torch.from_numpy(loss_mask[:-1]),
            }
            samples.append(sample | load_visuals(result.media[index], self.load))
        return pack_vlm_samples(
            samples,
            self.rope,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=self.encoder.spec.eos_id,
            ignore_index=self.ignore_index,
        )
