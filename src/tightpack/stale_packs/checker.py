"""`run_checks`: one run of the packed-data checks, split by split, then the metadata; the findings in
rule order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tightpack.core.pack_manifest import MANIFEST_NAME
from tightpack.stale_packs.blend import check_blend
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.files import check_files
from tightpack.stale_packs.metadata import check_metadata
from tightpack.stale_packs.paths import find_metadata, open_split
from tightpack.stale_packs.result import PackedDataCheck, PackedSplit
from tightpack.stale_packs.rows import read_every_row, sample_split
from tightpack.stale_packs.rules import RULE_IDS
from tightpack.stale_packs.sizes import check_multiple, check_pack_size
from tightpack.stale_packs.tokenizer import Comparison, check_tokenizer


def run_checks(context: CheckContext, packed: Path | None, named: list[tuple[str, str]]) -> PackedDataCheck:
    """Check ``packed`` (``--packed``), else the ``named`` splits (name, configured path), against the
    configuration of ``context``."""
    dataset, specs = context.config.dataset, context.specs
    wanted = [("packed", str(packed))] if packed is not None else named
    if packed is None and dataset.do_validation and not specs.packed_val_data_path:
        context.notes.append(
            "val: no packed_val_data_path; the reference packs validation itself (not checked)"
        )
    if packed is None and not dataset.do_validation and specs.packed_val_data_path:
        wanted = [(name, path) for name, path in wanted if name != "val"]
        context.notes.append("val: do_validation is false, so packed_val_data_path is not read")
    opened = [split for name, path in wanted if (split := open_split(context, name, path)) is not None]
    metadata_path, entries = find_metadata(context, opened)
    tokenizer: Comparison | None = None
    splits = []
    for split in opened:
        split, compared = _check_split(context, split, entries)
        splits.append(split)
        if compared == "fingerprint" or (compared == "name" and tokenizer is None):
            tokenizer = compared  # a fingerprint compared anywhere says more than names did
    if context.pad_cu_seqlens:
        check_metadata(context, splits, metadata_path, entries)
    if packed is None:
        check_blend(context, splits)
    order = {rule: index for index, rule in enumerate(RULE_IDS)}
    findings = sorted(context.findings, key=lambda finding: order[finding.rule])  # stable within a rule
    return PackedDataCheck(
        tuple(findings),
        tuple(_described(split) for split in splits),
        str(metadata_path) if metadata_path else None,
        tokenizer,
        tuple(context.notes),
    )


def _check_split(
    context: CheckContext, split: CheckedSplit, entries: list[dict] | None
) -> tuple[CheckedSplit, Comparison | None]:
    """Every check of one split; returns the split with what the checks learnt of it, and how its
    tokenizer was compared (None: not compared)."""
    if split.manifest is None and entries:
        sizes = [entry["pack_size"] for entry in entries if isinstance(entry.get("pack_size"), int)]
        split = dataclasses.replace(split, pack_size=max(sizes) if sizes else None)
    compared = None
    if split.manifest is not None:
        check_files(context, split)
        compared = check_tokenizer(context, split)
    check_pack_size(context, split)
    if check_multiple(context, split):
        split = dataclasses.replace(split, misaligned=True)
    if split.manifest is None:  # the rows tell the stats, and (unless deep reads them all) the faults
        split = sample_split(context, split, report=not context.deep)
    if context.deep:
        split = read_every_row(context, split)
    return split, compared


def _described(split: CheckedSplit) -> PackedSplit:
    manifest = str(split.folder / MANIFEST_NAME) if split.manifest else None
    return PackedSplit(split.name, split.path, tuple(split.files), manifest, split.rows_read, split.rows)
