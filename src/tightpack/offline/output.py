"""What a packing run writes into its staging folder: the packs and the manifest.

The packs are packed Parquet shards (`tightpack.core.packed_parquet`), written by the run's engine
(`tightpack.offline.engines.base.Engine.write_shards`), or the legacy Megatron-Bridge ``.npy``, written
here. The manifest records the settings, the tokenizer, the sources, every count and excluded row, and
the checksum of every file (`tightpack.offline.output_folder` reads it back to overwrite safely).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tightpack import __version__
from tightpack.core import legacy_npy
from tightpack.core.checksums import file_digest
from tightpack.core.packed_parquet import Overlay, default_row_group_size, gather_packs
from tightpack.core.planner import PackPlan
from tightpack.offline.config import PackConfig
from tightpack.offline.engines.base import Engine
from tightpack.offline.output_folder import MANIFEST_FORMAT, METADATA_NAME

_NPY_PACKS = 1024
"""Packs gathered per step for the legacy ``.npy``."""


def write_packs(
    store,
    plan: PackPlan,
    aligned: np.ndarray,
    staging: Path,
    pad_id: int,
    config: PackConfig,
    on_packs: Callable[[int], None],
    overlay: Overlay | None,
    engine: Engine,
) -> list[dict]:
    """Write the packs of ``plan`` into ``staging`` in ``config.output_format``; returns the manifest's
    file entries (``name``, ``rows``, ``bytes``, ``sha256``).

    ``store`` (a token store, or the parts of a Ray run) holds the samples the plan numbers,
    ``aligned`` their aligned lengths, ``overlay`` the truncated ones. Parquet shards are written by
    ``engine`` (`tightpack.offline.engines.base.Engine.write_shards`); the ``.npy`` here.
    """
    if config.output_format == "npy":
        path = staging / "packs.npy"
        legacy_npy.write_legacy_npy(path, _npy_rows(store, plan, aligned, pad_id, on_packs, overlay))
        return [{"name": path.name, "rows": len(plan), **file_digest(path)}]
    return engine.write_shards(
        store,
        plan,
        aligned,
        staging,
        pad_id=pad_id,
        row_group_size=config.row_group_size or default_row_group_size(config.packed_sequence_size),
        on_packs=on_packs,
        overlay=overlay,
    )


def _npy_rows(store, plan: PackPlan, aligned, pad_id: int, on_packs, overlay) -> list[dict]:
    """The packs as the legacy format's rows (one dict of arrays per pack)."""
    rows = []
    for first in range(0, len(plan), _NPY_PACKS):
        stop = min(first + _NPY_PACKS, len(plan))
        packed = gather_packs(store, plan, aligned, pad_id, first, stop, overlay)
        for row in range(stop - first):
            tokens = slice(packed.row_offsets[row], packed.row_offsets[row + 1])
            seqs = slice(packed.seq_offsets[row], packed.seq_offsets[row + 1])
            rows.append(
                {
                    "input_ids": packed.input_ids[tokens],
                    "loss_mask": packed.loss_mask[tokens],
                    "seq_start_id": packed.seq_start_id[seqs],
                    "sample_index": packed.sample_index[seqs],
                    "seq_len": packed.seq_len[seqs],
                }
            )
        on_packs(stop - first)
    return rows


def build_manifest(config, spec, sources, counts, stats, files, excluded, bad_rows) -> dict:
    """``manifest.json`` of a run: what was packed, from what, how, and the file of every pack."""
    source_identity = [s.identity for s in sources]
    source_fingerprint = hashlib.sha256(json.dumps(source_identity, sort_keys=True).encode()).hexdigest()
    settings = config.settings()
    run_fingerprint = hashlib.sha256(
        json.dumps([settings, spec.fingerprint, source_fingerprint], sort_keys=True, default=str).encode()
    ).hexdigest()
    return {
        "format": MANIFEST_FORMAT,
        "tightpack_version": __version__,
        "engine": config.engine,
        "fingerprint": run_fingerprint,
        "settings": settings,
        "tokenizer": {
            "name": spec.name,
            "fingerprint": spec.fingerprint,
            "vocab_size": spec.vocab_size,
            "eos_id": spec.eos_id,
            "eos_token": spec.eos_token,
            "chat_template": spec.chat_template is not None,
        },
        "sources": source_identity,
        "source_fingerprint": source_fingerprint,
        "counts": counts,
        "stats": stats.to_dict(),
        "metadata_file": METADATA_NAME,
        "files": files,
        "excluded": excluded,
        "bad_rows": [asdict(row) for row in bad_rows],
    }
