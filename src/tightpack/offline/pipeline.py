"""The offline path end to end: rows -> token store -> lengths -> plan -> packed Parquet.

`pack_dataset` is what ``tightpack pack`` runs. Stages: read and tokenize into a token store, apply
alignment and the long-sample policy to the lengths, plan the packs, write the shards, the metadata
and the manifest. The tokenizing and the shards are the work of the run's engine
(`tightpack.offline.engines`: worker processes here, or a Ray cluster), the rest is done here. The
output folder appears atomically: everything is written into a hidden staging folder next to it,
which is renamed into place at the end.

Accounting: every input row ends in exactly one of *packed* (possibly *truncated*, with the reason:
prompt trimmed, turns dropped, answer cut, end cut), *dropped* (too long, with
``long_samples="drop"``), *no supervised token* (nothing to learn from, dropped: the source had
none, or truncation left none), or *bad row* (skipped with ``skip_bad_lines``). Tokens and supervised
tokens lost are counted too. The manifest lists the source row of every sample not packed whole.

Long samples are cut by `tightpack.core.truncation` (trim the prompt, keep the answer); the cut
samples are written to a small overlay store in the staging folder, and the writer takes them from
there. The token store itself keeps whole samples, so other pack sizes can reuse it; only a field
too long for any cap (`tightpack.offline.store_reuse.text_budget`) loses its middle before tokenizing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core.balanced_plan import balance_pack_costs
from tightpack.core.cost_model import cost_spread
from tightpack.core.paths import default_cache_dir
from tightpack.core.planner import PackPlan, plan_packs
from tightpack.core.stats import pack_stats
from tightpack.core.store_cache import claim
from tightpack.errors import TightpackError
from tightpack.offline.accounting import account_samples, nothing_left, truncation_loss_note
from tightpack.offline.config import PackConfig
from tightpack.offline.engines import ENGINES, Engine, start_engine
from tightpack.offline.mixture import count_mixture, plan_mixture_run
from tightpack.offline.mixture_figures import sample_sources
from tightpack.offline.output import build_manifest, write_packs
from tightpack.offline.output_folder import (
    MANIFEST_NAME,
    METADATA_NAME,
    check_publishable,
    publish,
    sweep_work,
)
from tightpack.offline.output_lock import output_lock
from tightpack.offline.preference import pack_units_into
from tightpack.offline.stages import NoProgress, PackResult, Progress, stage
from tightpack.prepare.formats import run_format
from tightpack.prepare.sources import first_row, open_sources
from tightpack.prepare.tokenize import TokenizeReport
from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer
from tightpack.prepare.vision_tokens import VisionTokenIds

__all__ = ["PackConfig", "PackResult", "pack_dataset"]


def pack_dataset(
    inputs: Iterable[Any] | str | Path | None,
    output: str | Path,
    config: PackConfig,
    *,
    tokenizer: str | Path | TokenizerSpec | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    split: str | None = None,
) -> PackResult:
    """Pack SFT samples into Megatron-Bridge-readable packed Parquet.

    Args:
        inputs: JSONL/Parquet paths or glob patterns, a ``datasets.Dataset``, ``IterableDataset``
            (streaming too) or ``DatasetDict`` (with ``split``), an iterable of row dicts (a generator
            is read once), or None for the embedded default corpus. An empty list is an error.
        output: output folder; refused when it exists unless ``overwrite``.
        config: the run's settings.
        tokenizer: a tokenizer path, a loaded `TokenizerSpec`, or None for the built-in GPT-2.
        split: the split of a ``DatasetDict`` input.

    With ``config.workers > 1`` outside Linux, worker processes are spawned, so a script calling this
    needs the usual ``if __name__ == "__main__":`` guard there.

    Example::

        result = pack_dataset(["train.jsonl"], "packed", PackConfig(packed_sequence_size=4096))
        print(result.stats.efficiency)
    """
    config.validate()
    with output_lock(output) as target:  # one run per output folder; the lock dies with its process
        sweep_work(target)  # work folders of killed runs; a previous output they set aside goes back
        check_publishable(output, overwrite, _input_paths(inputs), cache=default_cache_dir())
        return _pack(
            inputs, split, Path(output), target, config, tokenizer, overwrite, progress or NoProgress()
        )


@dataclass
class TokenizedInputs:
    """The token store of some inputs and what made it (`tokenize_inputs`)."""

    spec: TokenizerSpec
    sources: list
    report: TokenizeReport
    warnings: list[str]
    seconds: float


def tokenize_inputs(
    inputs: Iterable[Any] | str | Path | None,
    config: PackConfig,
    workdir: Path,
    *,
    tokenizer: str | Path | TokenizerSpec | None = None,
    split: str | None = None,
    progress: Progress | None = None,
) -> TokenizedInputs:
    """Tokenize ``inputs`` as `pack_dataset` does, with the same token store reuse, and nothing else.

    For tools that plan without writing packs (``tightpack plan``). A store that is not cached is
    written under ``workdir``, which the caller removes. ``config`` decides the sample format and, by its
    cap, the text budget of very long fields: give the largest pack size that will be planned.
    """
    config.validate()
    spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
    sources = open_sources(inputs, split=split)
    config = _run_config(config, sources)
    warnings: list[str] = []
    times: dict[str, float] = {}
    estimates = [source.estimated_rows for source in sources]
    progress = progress or NoProgress()
    with stage("tokenize", None if None in estimates else sum(estimates), progress, times):
        with ENGINES["local"](config) as engine:  # plans are made on this machine, whatever the engine
            report = engine.tokenize(
                sources, spec, config, workdir, on_rows=progress.advance, warnings=warnings
            )
    return TokenizedInputs(spec, sources, report, warnings, times["tokenize"])


def _pack(
    inputs, split, output: Path, target: Path, config: PackConfig, tokenizer, overwrite: bool, progress
):
    """`pack_dataset` once the output folder is held and checked (``target``: resolved ``output``)."""
    times: dict[str, float] = {}
    notes: list[str] = []
    with stage("load", None, NoProgress(), times):
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
        if config.format.vision is not None:
            VisionTokenIds(config.format.vision, spec.backend)  # raises when the tokenizer lacks them
        owners: list[int] = []
        sources = open_sources(inputs, split=split, owners=owners)
        config = _run_config(config, sources)
        config.validate()  # again: ``auto`` may have become a preference format
        inputs_named = _input_names(inputs, sources, owners)
        if config.mixture is not None:
            config.mixture.validate(len(inputs_named))
        if not config.packs_units and config.preference_layout != "pairs":
            raise TightpackError(
                f"preference_layout {config.preference_layout!r} lays out preference units, but the first "
                f"row of {sources[0].name} is an SFT sample (no chosen/rejected, completions or label): "
                "give preference rows, or drop preference_layout",
                parameters=("preference_layout",),
            )

    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:12]}"
    claim(staging)
    try:
        if config.packs_units:
            result = pack_units_into(staging, sources, spec, config, progress, times, notes)
        else:
            with start_engine(config) as engine:
                mixed = None if config.mixture is None else (inputs_named, owners)
                result = _pack_into(staging, sources, spec, config, progress, engine, times, notes, mixed)
        publish(staging, target, overwrite=overwrite)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dataclasses.replace(result, output=output)


def _pack_into(
    staging: Path,
    sources,
    spec: TokenizerSpec,
    config: PackConfig,
    progress,
    engine: Engine,
    times,
    notes,
    mixed: tuple[list[str], list[int]] | None = None,
) -> PackResult:
    """Tokenize, account, plan and write into ``staging`` (published by the caller); the tokenizing
    and the shards by ``engine`` (`tightpack.offline.engines`). ``mixed``: a mixture's input names
    and the input of each source."""
    estimates = [source.estimated_rows for source in sources]
    with stage("tokenize", None if None in estimates else sum(estimates), progress, times):
        report = engine.tokenize(sources, spec, config, staging, on_rows=progress.advance, warnings=notes)
    store = report.store

    with stage("plan", 1, progress, times):
        measures: dict[str, np.ndarray] | None = None if mixed is None else {}
        counts, keep, aligned, excluded, overlay = account_samples(
            store, config, report, staging, measures=measures, source_names=[s.name for s in sources]
        )
        if counts["samples_in"] == 0:
            names = ", ".join(source.name for source in sources)
            raise TightpackError(f"no sample to pack: {names} held no rows (empty, or blank lines only)")
        lost = excluded["no_supervised_after_truncation"]
        note = truncation_loss_note(store, lost, config.cap) if lost else None
        if not keep.any():
            raise TightpackError(nothing_left(counts, note))
        if note:
            notes.append(note)
        mixture = None
        if mixed is None:
            plan, cost_balance = plan_kept(aligned, keep, config)
        else:
            names, owners = mixed
            sample_input = sample_sources(store.source_index, report.source_starts, owners)
            run = plan_mixture_run(
                config.mixture, names, sample_input, keep, measures["tokens"], measures["supervised"],
                aligned, config.packed_sequence_size, config.seed,
            )  # fmt: skip
            plan, cost_balance, mixture = run.plan, None, run.report
            count_mixture(counts, excluded, store, report, owners, run, keep, measures, aligned)
        del keep  # the plan holds the kept samples now (the driver's memory per sample)
        stats = pack_stats(plan, aligned, config.packed_sequence_size)
        progress.advance(1)

    with stage("write", len(plan), progress, times):
        files = write_packs(
            store, plan, aligned, staging, spec.eos_id, config, progress.advance, overlay, engine
        )
        metadata = [stats.megatron_metadata()]
        (staging / METADATA_NAME).write_text(json.dumps(metadata, indent=2) + "\n")
        manifest = build_manifest(config, spec, sources, counts, stats, files, excluded, report.bad_rows)
        if mixture is not None:
            manifest["mixture"] = mixture
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    for work in sorted(staging.glob("_*")):  # the work folders of the engine and of the accounting
        shutil.rmtree(work, ignore_errors=True)
    return PackResult(
        staging, counts, stats, times, files, report.bad_rows, report.reused, notes, cost_balance,
        mixture=mixture,
    )  # fmt: skip


_MAP_SAMPLES = 1 << 20
"""Plan entries renumbered at a time by `plan_kept`."""


def plan_kept(
    aligned: np.ndarray, keep: np.ndarray, config: PackConfig
) -> tuple[PackPlan, dict[str, Any] | None]:
    """The packs of the kept samples (numbered as ``aligned``), and the cost balance report.

    ``bfd`` plans ``aligned`` itself, the samples not kept marked -1 in place (they are never read
    again): no array over the samples is made beside the plan's order (the driver's memory per
    sample, `benchmarks/bench_driver_memory.py`). The other planners and the cost balance take the
    kept samples' lengths, and their order is renumbered a block at a time.
    """
    size, algorithm = config.packed_sequence_size, config.algorithm
    if algorithm == "bfd" and config.balance_costs is None:
        aligned[~keep] = -1
        return plan_packs(aligned, size, algorithm=algorithm, skip_negative=True), None
    kept_lengths = aligned[keep].astype(np.int64, copy=False)
    plan = plan_packs(kept_lengths, size, algorithm=algorithm, seed=config.seed)
    cost_balance = None
    if config.balance_costs is not None:
        plan, cost_balance = _balance(plan, kept_lengths, config)
    del kept_lengths
    kept, order = np.flatnonzero(keep), plan.order
    for first in range(0, len(order), _MAP_SAMPLES):
        block = order[first : first + _MAP_SAMPLES]
        block[:] = kept[block]
    return plan, cost_balance


def _balance(plan: PackPlan, lengths: np.ndarray, config: PackConfig) -> tuple[PackPlan, dict[str, Any]]:
    """The plan rewritten by `balance_pack_costs` under ``config.balance_costs``, and the spread of pack
    cost before and after (``PackResult.cost_balance``)."""
    model = config.cost_model
    balanced = balance_pack_costs(plan, lengths, config.packed_sequence_size, model)
    report = {"model": config.balance_costs}
    for key, which in (("before", plan), ("after", balanced)):
        report[key] = {"packs": len(which), **asdict(cost_spread(model.pack_costs(which, lengths)))}
    return balanced, report


def _run_config(config: PackConfig, sources) -> PackConfig:
    """``config`` with its format resolved for the run (`run_format`: ``auto`` on pre-tokenized inputs
    is ``tokens``); the manifest records the format the rows were read as."""
    resolved = run_format(config.format, first_row(sources)) if config.format.format == "auto" else None
    if resolved is None or resolved is config.format:
        return config
    return dataclasses.replace(config, format=resolved)


def _input_names(inputs, sources, owners: list[int]) -> list[str]:
    """Each input's name for messages and the manifest: a path or pattern as given, else the name of
    its first source (a dataset)."""
    given = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    names = {}
    for source, owner in zip(sources, owners, strict=True):
        names.setdefault(owner, source.name)
    return [
        str(given[owner]) if owner < len(given) and isinstance(given[owner], (str, Path)) else name
        for owner, name in sorted(names.items())
    ]


def _input_paths(inputs) -> list[Path]:
    """The inputs given as paths (an iterable of rows is not consumed)."""
    if isinstance(inputs, (str, Path)):
        return [Path(inputs)]
    if isinstance(inputs, (list, tuple)):
        return [Path(item) for item in inputs if isinstance(item, (str, Path))]
    return []
