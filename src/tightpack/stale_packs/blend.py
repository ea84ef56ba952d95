"""D11: a blend's weights against what its packed folders hold.

Megatron-Bridge's ``offline_packing_specs.packed_train_data_blend`` (PR #5289) weights count packs: a
folder's share of the blend is its share of rows, whatever its packs hold. `check_blend` compares the
shares of the mixing measure (``--mix-by``, default tokens) that the weights give
(`tightpack.core.blend_weights.blend_shares`) with the shares meant: ``--blend-targets``, or else the
weights themselves, as a user who takes weights for token shares writes them. It warns when they differ
and gives the weights that give the shares meant. `check_indexed_blend` finds the other mistake: a pretraining
``GPTDatasetConfig`` whose ``blend``, ``blend_per_split`` or ``data_path`` names a tightpack folder,
which Megatron-Core cannot read (it reads indexed ``PREFIX.bin``/``PREFIX.idx`` datasets).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.config import Finding, GPTDatasetConfig, RunConfig
from tightpack.core.blend_weights import FolderStats, blend_counts, blend_shares, blend_weights
from tightpack.core.mixture import MIX_BY
from tightpack.core.pack_manifest import MANIFEST_NAME
from tightpack.errors import TightpackError
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.rules import SPECS

SHARE_TOLERANCE = 0.005
"""D11 warns when a folder's share of the measure is off its weight by more than this (half a point)."""
BLEND = f"{SPECS}.packed_train_data_blend"
_UNITS = {"tokens": "tokens", "supervised-tokens": "supervised tokens", "samples": "samples"}


def blend_sources(blend: object) -> tuple[list[str], list[float]] | None:
    """The sources and weights of a well-formed ``packed_train_data_blend``; None otherwise (X7 says why)."""
    if not isinstance(blend, list) or len(blend) != 2:
        return None
    sources, weights = blend
    if not all(isinstance(source, str) for source in sources) or len(sources) < 2:
        return None
    if len(weights) != len(sources) or not all(_positive(weight) for weight in weights):
        return None
    return list(sources), [float(weight) for weight in weights]


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def blend_split_name(index: int) -> str:
    """The name of the blend's source ``index`` as a split: ``train[0]``."""
    return f"train[{index}]"


def check_blend(context: CheckContext, splits: list[CheckedSplit]) -> None:
    """D11: the shares of ``context.mix_by`` that the blend's weights give are the shares meant
    (``context.blend_targets``, by default the weights themselves); a note with the shares by every
    measure and the packs each folder supplies."""
    found = blend_sources(context.specs.packed_train_data_blend if context.specs else None)
    if found is None:
        return
    sources, weights = found
    targets = context.blend_targets
    if targets is not None and len(targets) != len(sources):
        raise TightpackError(
            f"{len(targets)} blend targets for the {len(sources)} sources of {BLEND} "
            f"({', '.join(sources)}): give one share per source, in their order",
            parameters=("blend_targets",),
        )
    by_name = {split.name: split for split in splits}
    folders = []
    for index, source in enumerate(sources):
        split = by_name.get(blend_split_name(index))
        if split is None:
            return  # D1 names it
        if split.manifest is None:
            context.notes.append(f"blend: weights not checked: {source} has no tightpack manifest")
            return
        try:
            folders.append(FolderStats.from_manifest(split.manifest, f"{split.folder / MANIFEST_NAME}"))
        except TightpackError as error:
            context.notes.append(f"blend: weights not checked: {error}")
            return
    by = context.mix_by
    meant = np.asarray(targets if targets is not None else weights, dtype=np.float64)
    meant = meant / meant.sum()
    context.notes.append(_passes_note(context, sources, weights, folders))
    context.notes.append(_shares_note(weights, folders, sources))
    try:
        given = blend_shares(weights, folders, by=by, names=sources)
        better = blend_weights(meant, folders, by=by, names=sources)
    except TightpackError as error:  # a folder without supervised tokens
        context.add(
            "D11", "warning", f"{BLEND}: {error}.", "Mix by another measure (--mix-by), or drop the folder."
        )
        return
    if np.abs(given - meant).max() <= SHARE_TOLERANCE:
        return
    unit = _UNITS[by]
    per_pack = ", ".join(
        f"one of {source} {folder.per_pack(by):,.0f}" for source, folder in zip(sources, folders, strict=True)
    )
    meant_as = "the --blend-targets" if targets is not None else "the weights"
    command = " ".join(
        shlex.quote(f"{source}={share:.6g}") for source, share in zip(sources, meant, strict=True)
    )
    also = (
        ""
        if targets is not None
        else "; if they are the weights for other shares (tightpack blend's), give those shares with "
        "--blend-targets, and keep them if they are meant as shares of packs"
    )
    context.add(
        "D11",
        "warning",
        f"{BLEND} weights {_numbers(weights)} give {_percent(given)} of the {unit} of {', '.join(sources)}, "
        f"not {_percent(meant)} ({meant_as}): Megatron-Bridge's blend weights count packs, and a pack holds "
        f"{unit} by folder ({per_pack}, on average).",
        f"For {_percent(meant)} of the {unit} set {BLEND}: [[{', '.join(sources)}], [{_numbers(better, 6)}]] "
        f"(`tightpack blend {command} --mix-by {by}` prints them){also}.",
    )


def _shares_note(weights, folders: list[FolderStats], sources: list[str]) -> str:
    """The shares the weights give, by every measure the folders hold."""
    measures = [by for by in MIX_BY if all(folder.total(by) > 0 for folder in folders)]
    shares = ", ".join(f"{_UNITS[by]} {_percent(blend_shares(weights, folders, by=by))}" for by in measures)
    return f"blend shares of {', '.join(sources)}: {shares}"


def _passes_note(context: CheckContext, sources: list[str], weights, folders: list[FolderStats]) -> str:
    """What a blend of the configured size draws: each folder's packs (Megatron-Core's counts,
    `blend_counts`) and passes over it."""
    dataset = context.config.dataset
    configured = getattr(dataset, "max_train_samples", None)
    size = configured or sum(folder.packs for folder in folders)
    origin = "max_train_samples" if configured else "the folders' packs summed, without max_train_samples"
    counts = blend_counts(weights, size)
    drawn = [
        f"{source} {count:,} of {folder.packs:,} packs ({count / folder.packs:.2f} passes)"
        for source, count, folder in zip(sources, counts, folders, strict=True)
    ]
    return f"blend of {size:,} packs ({origin}): {'; '.join(drawn)}"


def _numbers(values, digits: int = 4) -> str:
    return ", ".join(f"{value:.{digits}g}" for value in values)


def _percent(values) -> str:
    return "/".join(f"{value:.1%}" for value in values)


def check_indexed_blend(config: RunConfig, raw: Mapping[str, Any]) -> list[Finding]:
    """D11 errors: a ``GPTDatasetConfig`` blend path that is a tightpack packed folder."""
    if not isinstance(config.dataset, GPTDatasetConfig):
        return []
    dataset = raw.get("dataset")
    if not isinstance(dataset, Mapping):
        return []
    packed: dict[str, list[str]] = {}
    for key, path in _indexed_paths(dataset):
        if (Path(path) / MANIFEST_NAME).is_file():
            packed.setdefault(key, []).append(path)
    return [
        Finding(
            "D11",
            "error",
            f"dataset.{key} names tightpack packed folders (packed Parquet): {', '.join(paths)}; "
            "GPTDatasetConfig's blends read Megatron-Core indexed datasets (PREFIX.bin and PREFIX.idx, "
            f"e.g. {paths[0]}.bin), so the run cannot read them.",
            "Blend packed folders with a GPTSFTDatasetConfig: dataset.type: GPTSFTDatasetConfig, "
            f"enable_offline_packing: true and {BLEND}: [[FOLDER, ...], [WEIGHT, ...]] "
            "(`tightpack blend FOLDER=SHARE ...` prints the weights).",
        )
        for key, paths in packed.items()
    ]


def _indexed_paths(dataset: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(key, path) of every dataset prefix of ``blend``, ``blend_per_split`` and ``data_path``."""
    blend = dataset.get("blend")
    if isinstance(blend, list) and blend and isinstance(blend[0], list):
        yield from (("blend", path) for path in blend[0] if isinstance(path, str))
    for index, split in enumerate(dataset.get("blend_per_split") or []):
        if isinstance(split, list) and split and isinstance(split[0], list):
            yield from ((f"blend_per_split[{index}]", path) for path in split[0] if isinstance(path, str))
    data_path = dataset.get("data_path")
    words = (
        data_path.split() if isinstance(data_path, str) else data_path if isinstance(data_path, list) else []
    )
    # Megatron-LM's --data-path: prefixes, or weight, prefix, weight, prefix ... (get_blend_from_list)
    prefixes = words[1::2] if len(words) % 2 == 0 else words
    yield from (("data_path", path) for path in prefixes if isinstance(path, str))
