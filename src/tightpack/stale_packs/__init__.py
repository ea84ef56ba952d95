"""Never train on stale packs: the packed data a training configuration points at, checked against it.

`check_packed_data` reads the packed data of an offline-packing configuration (``--packed DIR``, or
``dataset.offline_packing_specs.packed_train_data_path``, ``packed_val_data_path`` and
``packed_metadata_path``) and reports, as `Finding` objects with rule ids ``D1``... (`DATA_RULES`;
docs/validation-rules.md lists them), every way in which the packs no longer fit the configuration: pack
size, alignment multiple, tokenizer, metadata, files changed after packing. It is cheap by default: a
tightpack output folder's ``manifest.json`` records the settings the packs were made with, so no row is
read; Megatron-Bridge's own packs (no manifest) are checked on a fixed, seeded sample of rows; ``deep``
reads every row (`tightpack.verify.verify_packed`) and hashes every file.

An error's fix is the full ``tightpack pack`` command that makes packs the configuration can train on,
built from the manifest (sources, tokenizer) and the configuration (pack size, topology), into a fresh
output folder: the reference's guidance after a topology change.

The configuration rules live in `tightpack.config`; `validate_with_packed_data` joins both into one
`ValidationReport` for ``tightpack validate CONFIG --packed DIR --deep``.

Modules: `rules` (the D rules as data), `result` (what a check returns), `context` (`CheckContext`, what
every check reads and the list it adds its findings to; `CheckedSplit`, one split as it is checked),
`checker` (one run: split by split, then the metadata). The checks are plain functions of a context, one
module per group of rules: `paths` (D1), `sizes` (D2-D4), `metadata` (D5, D6), `tokenizer` (D7), `rows`
(D8, D10: the rows read), `files` (D9), `blend` (D11: a blend's weights); `repack` builds the fix command
they share. Every source of ``packed_train_data_blend`` is checked as a training split (``train[0]``, ...).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tightpack.config import RunConfig, ValidationReport, load_config, validate
from tightpack.config.derive import is_offline, packing_specs
from tightpack.core.mixture import MIX_BY
from tightpack.errors import TightpackError
from tightpack.stale_packs.blend import blend_sources, blend_split_name, check_indexed_blend
from tightpack.stale_packs.checker import run_checks
from tightpack.stale_packs.context import CheckContext
from tightpack.stale_packs.result import PackedDataCheck, PackedSplit  # noqa: F401 (for the package's own modules; not public API)
from tightpack.stale_packs.rules import DATA_RULES, SAMPLE_ROWS, DataRule  # noqa: F401 (for the package's own modules; not public API)


def validate_with_packed_data(
    path: str | os.PathLike[str],
    *,
    packed: str | os.PathLike[str] | None = None,
    deep: bool = False,
    config_only: bool = False,
    mix_by: str = "tokens",
    blend_targets: Sequence[float] | None = None,
) -> tuple[ValidationReport, PackedDataCheck]:
    """``tightpack validate``: the configuration rules and the packed-data rules, in one report.

    ``config_only`` skips the packed data (a configuration checked where its data is not mounted);
    ``mix_by`` and ``blend_targets`` are what a blend is meant to give (rule D11, `check_packed_data`).

    Raises:
        TightpackError: the configuration, a manifest, a metadata file or a pack cannot be read.
    """
    config = load_config(path)
    report = validate(config)
    if config_only:
        return report, PackedDataCheck((), notes=("not checked (--config-only)",))
    raw = _read_yaml(Path(path))
    checked = check_packed_data(
        config,
        packed=Path(packed) if packed else None,
        deep=deep,
        raw=raw,
        mix_by=mix_by,
        blend_targets=blend_targets,
    )
    joined = dataclasses.replace(report, findings=report.findings + checked.findings)
    return joined, checked


def format_report(report: ValidationReport, checked: PackedDataCheck) -> str:
    """The report's text with the packed-data lines before its last line (the result)."""
    lines = report.format().splitlines()
    return "\n".join([*lines[:-1], *checked.lines(), lines[-1]])


def check_packed_data(
    config: RunConfig,
    *,
    packed: Path | None = None,
    deep: bool = False,
    raw: Mapping[str, Any] | None = None,
    mix_by: str = "tokens",
    blend_targets: Sequence[float] | None = None,
) -> PackedDataCheck:
    """Check the packed data ``config`` points at (or ``packed``) against it; see `DATA_RULES`.

    Args:
        config: the configuration (`tightpack.config.load_config`).
        packed: a tightpack output folder, a Megatron-Bridge pack folder, or a Parquet file or glob; it
            replaces the configuration's train and validation paths.
        deep: read every row (`tightpack.verify.verify_packed`) and hash every file.
        raw: the configuration as read from YAML, for the sections tightpack does not model
            (``tokenizer``, a pretraining dataset's ``blend``); None skips them.
        mix_by: what ``packed_train_data_blend``'s weights are meant to count (`MIX_BY`; rule D11).
        blend_targets: the shares of ``mix_by`` the blend is meant to give, one per source in order
            (None: its weights, as written).

    Relative paths are taken from the current directory, as the training job does.

    Raises:
        TightpackError: a manifest, a metadata file or a pack exists but cannot be read; ``mix_by`` or
            ``blend_targets`` is not one of its values, or their count is not the blend's sources'.
    """
    if mix_by not in MIX_BY:
        raise TightpackError(
            f"unknown mix_by {mix_by!r}; choose one of {', '.join(MIX_BY)}", parameters=("mix_by",)
        )
    targets = None if blend_targets is None else tuple(float(share) for share in blend_targets)
    if targets is not None and not all(math.isfinite(share) and share > 0 for share in targets):
        raise TightpackError(
            f"blend_targets must be positive numbers, one per source of the blend; got {list(blend_targets)}",
            parameters=("blend_targets",),
        )
    checked = _check_packs(config, packed, deep, raw or {}, mix_by, targets)
    misplaced = tuple(check_indexed_blend(config, raw or {}))  # D11 of a pretraining blend
    return dataclasses.replace(checked, findings=checked.findings + misplaced) if misplaced else checked


def _check_packs(
    config: RunConfig,
    packed: Path | None,
    deep: bool,
    raw: Mapping[str, Any],
    mix_by: str,
    blend_targets: tuple[float, ...] | None,
) -> PackedDataCheck:
    specs = packing_specs(config.dataset)
    if packed is None and (specs is None or not is_offline(config.dataset)):
        return PackedDataCheck((), notes=("nothing to check: the configuration has no offline packing",))
    named = [("train", specs.packed_train_data_path), ("val", specs.packed_val_data_path)] if specs else []
    found = blend_sources(specs.packed_train_data_blend) if specs else None
    named[1:1] = [(blend_split_name(index), source) for index, source in enumerate(found[0] if found else [])]
    named = [(split, path) for split, path in named if path]
    if packed is None and not named:
        nothing = "no packed_train_data_path, packed_train_data_blend or packed_val_data_path (nor --packed)"
        return PackedDataCheck((), notes=(f"nothing to check: {nothing}",))
    context = CheckContext.of(config, deep=deep, raw=raw, mix_by=mix_by, blend_targets=blend_targets)
    return run_checks(context, packed, named)


def _read_yaml(path: Path) -> Mapping[str, Any]:
    """The configuration file as a mapping (load_config has read and checked it already)."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data if isinstance(data, Mapping) else {}
