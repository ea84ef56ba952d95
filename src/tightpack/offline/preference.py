"""The offline path for preference, KTO and group rows: rows -> units -> fitted -> planned -> packed
preference Parquet (`tightpack.core.preference_parquet`).

`pack_units_into` is what `tightpack.offline.pipeline.pack_dataset` runs for a preference format
(``preference``, ``kto``, ``groups``). A row becomes a unit, its prompt tokenized once and each branch
after it (`tightpack.prepare.preference_rows`), in ``config.workers`` processes. A unit is planned and
written whole: its size and attention cost are those of ``config.preference_layout``.

Accounting, by unit: every input row ends in exactly one of *packed* (possibly *truncated*: prompt
trimmed at its start, branches cut at their end), *dropped* as too long (``long_samples="drop"``, or
a unit that cannot fit even cut), *no supervised token* (a cut would have left a branch without one)
or *bad row* (skipped with ``skip_bad_lines``). The manifest lists the source row of every unit not
packed whole, by reason.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core.pack_plan import PackPlan
from tightpack.core.packed_parquet import default_row_group_size
from tightpack.core.preference_parquet import PreferenceFiles, write_preference_parquet
from tightpack.core.preference_units import (
    PreferenceUnits,
    UnitFit,
    fit_units,
    plan_units,
    sequence_plan,
    unit_attention_costs,
    unit_sizes,
)
from tightpack.core.stats import PackStats, pack_stats
from tightpack.errors import TightpackError
from tightpack.offline.accounting import LongSamplesError
from tightpack.offline.config import PackConfig
from tightpack.offline.engines.base import read_chunks
from tightpack.offline.output import build_manifest
from tightpack.offline.output_folder import MANIFEST_NAME, METADATA_NAME
from tightpack.offline.stages import PackResult, Progress, stage
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.preference_rows import PreferenceEncoder, TokenizedUnits
from tightpack.prepare.tokenize import BadRow, bad_row_error
from tightpack.prepare.tokenizer import TokenizerSpec
from tightpack.prepare.worker_pool import map_in_processes


class _Worker:
    encoder: PreferenceEncoder | None = None


def _init_worker(encoder: PreferenceEncoder) -> None:
    _Worker.encoder = encoder


def _encode_chunk(chunk: Chunk) -> TokenizedUnits:
    return _Worker.encoder.encode_chunk(chunk)


@dataclass(frozen=True)
class Tokenized:
    """The units of a run's inputs, and what could not become one."""

    units: PreferenceUnits
    bad_rows: list[BadRow]
    rows: int


def tokenize_units(
    sources, spec: TokenizerSpec, config: PackConfig, on_rows: Callable[[int], None]
) -> Tokenized:
    """Every row of ``sources`` as a unit (token ids kept as int32), in input order.

    Raises:
        TightpackError: on the first bad row (in input order) unless ``config.skip_bad_lines``.
    """
    encoder = PreferenceEncoder(spec, config.format.format, config.format.template_vars)
    chunks = read_chunks(sources)
    workers = config.workers or 1
    results: Iterator[TokenizedUnits] = (
        (encoder.encode_chunk(chunk) for chunk in chunks)
        if workers == 1
        else map_in_processes(_encode_chunk, chunks, workers, initializer=_init_worker, initargs=(encoder,))
    )
    parts, bad_rows, rows = [], [], 0
    for result in results:
        if result.bad_rows and not config.skip_bad_lines:
            raise bad_row_error(result.bad_rows[0])
        units = result.units
        tokens = {name: getattr(units, name).astype(np.int32) for name in ("prompt_tokens", "branch_tokens")}
        parts.append(dataclasses.replace(units, **tokens))
        bad_rows.extend(result.bad_rows)
        rows += result.rows
        on_rows(result.rows)
    kept = [part for part in parts if len(part)]
    if not kept:
        return Tokenized(PreferenceUnits.from_lists([], [], []), bad_rows, rows)
    return Tokenized(PreferenceUnits.concatenate(kept), bad_rows, rows)


def _fit(units: PreferenceUnits, config: PackConfig) -> UnitFit:
    """The long-sample policy on units: truncate (`fit_units`), drop or stop at those over the cap."""
    layout, multiple, cap = config.preference_layout, config.multiple, config.cap
    sizes = unit_sizes(units, layout, multiple)
    over = np.flatnonzero(sizes > cap)
    if len(over) and config.long_samples == "error":
        first = int(over[0])
        raise LongSamplesError(
            f"{len(over)} units are larger than the cap of {cap} tokens in the {layout} layout (first: "
            f"source row {int(units.source_index[first])}, {int(sizes[first])} tokens)"
        )
    if config.long_samples == "truncate":
        return fit_units(units, cap, layout, pad_to_multiple_of=multiple)
    kept = np.flatnonzero(sizes <= cap)
    reasons = {
        int(unit): f"{int(sizes[unit])} tokens in the {layout} layout, over the cap of {cap}" for unit in over
    }
    return UnitFit(units.select(kept), kept, dropped=reasons)


def account_units(tokenized: Tokenized, config: PackConfig) -> tuple[UnitFit, dict[str, int], dict[str, Any]]:
    """The units kept (`UnitFit`), the counts of the manifest and the source rows excluded, by reason."""
    units = tokenized.units
    fit = _fit(units, config) if len(units) else UnitFit(units, np.zeros(0, np.int64))
    layout, multiple = config.preference_layout, config.multiple
    kept = fit.units
    lost = np.asarray(fit.no_supervised, dtype=np.int64)
    too_long = np.setdiff1d(np.fromiter(fit.dropped, dtype=np.int64, count=len(fit.dropped)), lost)
    original = units.select(fit.kept)
    cut = (original.prompt_lengths != kept.prompt_lengths) | (
        np.add.reduceat(original.branch_lengths != kept.branch_lengths, kept.unit_offsets[:-1])
        if len(kept)
        else np.zeros(0, bool)
    ) > 0
    sizes = unit_sizes(kept, layout, multiple)
    counts = {
        "samples_in": tokenized.rows,
        "bad_rows": len(tokenized.bad_rows),
        "units_in": len(units),
        "packed": len(kept),
        "branches_packed": len(kept.branch_lengths),
        "truncated": int(cut.sum()),
        "truncated_prompt_trimmed": fit.prompt_trimmed,
        "truncated_branches_cut": fit.branches_cut,
        "dropped_long": len(too_long),
        "no_supervised": len(lost),
        "tokens_in": int(units.prompt_lengths.sum() + units.branch_lengths.sum()),
        "tokens_packed": int(kept.prompt_lengths.sum() + kept.branch_lengths.sum()),
        "layout_tokens": int(sizes.sum()),
        "supervised_in": int(units.branch_loss_mask.sum()),
        "supervised_packed": int(kept.branch_loss_mask.sum()),
    }
    counts["tokens_lost"] = counts["tokens_in"] - counts["tokens_packed"]
    counts["supervised_lost"] = counts["supervised_in"] - counts["supervised_packed"]
    counts["alignment_padding"] = int(sizes.sum() - unit_sizes(kept, layout, 1).sum())
    source = units.source_index
    excluded = {
        "truncated": source[fit.kept[cut]].tolist(),
        "dropped_long": source[too_long].tolist(),
        "no_supervised": source[lost].tolist(),
        "dropped_reasons": {str(int(source[unit])): reason for unit, reason in sorted(fit.dropped.items())},
    }
    return fit, counts, excluded


def unit_stats(units: PreferenceUnits, plan: PackPlan, config: PackConfig) -> PackStats:
    """`pack_stats` over the units (their sizes), with the attention cost of their layout."""
    layout, multiple = config.preference_layout, config.multiple
    stats = pack_stats(plan, unit_sizes(units, layout, multiple), config.packed_sequence_size)
    if len(plan) == 0:
        return stats
    attention = plan.pack_loads(unit_attention_costs(units, layout, multiple))
    return PackStats(
        **{
            **stats.to_dict(),
            "attention_cost_mean": float(attention.mean()),
            "attention_cost_max": int(attention.max()),
        }
    )


def pack_units_into(
    staging: Path,
    sources,
    spec: TokenizerSpec,
    config: PackConfig,
    progress: Progress,
    times: dict,
    notes: list,
) -> PackResult:
    """Tokenize, fit, plan and write the units of ``sources`` into ``staging`` (published by the caller)."""
    estimates = [source.estimated_rows for source in sources]
    with stage("tokenize", None if None in estimates else sum(estimates), progress, times):
        tokenized = tokenize_units(sources, spec, config, progress.advance)

    with stage("plan", 1, progress, times):
        if tokenized.rows == 0:
            names = ", ".join(source.name for source in sources)
            raise TightpackError(f"no row to pack: {names} held no rows (empty, or blank lines only)")
        fit, counts, excluded = account_units(tokenized, config)
        units = fit.units
        if len(units) == 0:
            raise TightpackError(
                f"no unit left to pack ({counts['samples_in']} rows in, {counts['bad_rows']} bad, "
                f"{counts['dropped_long']} too long, {counts['no_supervised']} without supervised tokens)"
            )
        layout, multiple = config.preference_layout, config.multiple
        plan = plan_units(
            units,
            config.packed_sequence_size,
            layout,
            pad_to_multiple_of=multiple,
            # bfd, then emptying its emptiest packs into the others (`tightpack.core.unit_fill`): whole
            # units leave more room than single sequences, and the drain takes most of it back
            algorithm="bfd_drain" if config.algorithm == "bfd" else config.algorithm,
        )
        stats = unit_stats(units, plan, config)
        sequences, lengths = sequence_plan(units, plan, layout, multiple)
        progress.advance(1)

    with stage("write", len(plan), progress, times):
        files_of = PreferenceFiles(config.format.format, layout, multiple, spec.eos_id)
        files = write_preference_parquet(
            units,
            plan,
            staging,
            files_of,
            row_group_size=config.row_group_size or default_row_group_size(config.packed_sequence_size),
            on_packs=progress.advance,
        )
        metadata = [pack_stats(sequences, lengths, config.packed_sequence_size).megatron_metadata()]
        (staging / METADATA_NAME).write_text(json.dumps(metadata, indent=2) + "\n")
        manifest = build_manifest(config, spec, sources, counts, stats, files, excluded, tokenized.bad_rows)
        manifest["preference"] = {
            "kind": files_of.kind,
            "layout": layout,
            "branches": counts["branches_packed"],
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return PackResult(
        staging,
        counts,
        stats,
        times,
        files,
        tokenized.bad_rows,
        warnings=notes,
        unit_kind=config.format.format,
    )
