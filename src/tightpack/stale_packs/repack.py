"""The fix of a stale pack: the ``tightpack pack`` command that makes packs the configuration can train on."""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tightpack.config.derive import has_fixed_width
from tightpack.core.alignment import alignment_multiple, length_cap
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pack_flags import sample_flags
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.rules import SPECS


def repack_fix(context: CheckContext, split: CheckedSplit) -> str:
    """The fix of a finding on ``split``: re-pack into a fresh folder, then point the configuration at it."""
    command, output = repack_command(context, split)
    where = f"{SPECS}.{split.attr}" if split.attr else "the configuration's packed path"
    configured = (context.specs.pad_seq_to_mult if context.specs else None) or 1
    target = math.lcm(max(configured, 1), context.k)
    also = f" and {SPECS}.pad_seq_to_mult: {target}" if target != configured else ""
    return f"Re-pack into a fresh output folder: {command}; then set {where}: {output}{also}."


def lowered(fix: str) -> str:
    """A fix to follow ``or``: its first letter in lower case."""
    return f"{fix[0].lower()}{fix[1:]}"


def repack_command(context: CheckContext, split: CheckedSplit) -> tuple[str, str]:
    """The ``tightpack pack`` command for packs this configuration can train on, and its output."""
    manifest = split.manifest or {}
    words = ["tightpack", "pack"]
    sources = [source.get("path") for source in manifest.get("sources", []) if source.get("path")]
    if any("(embedded default)" in source for source in sources):
        words.append("--demo")
    else:
        words += [shlex.quote(str(source)) for source in sources] or ["TRAINING.jsonl"]
    tokenizer = _repack_tokenizer(manifest, context.raw)
    if tokenizer:
        words += ["--tokenizer", shlex.quote(tokenizer)]
    model, specs = context.config.model, context.specs
    configured = (specs.pad_seq_to_mult if specs else None) or 1
    target = math.lcm(max(configured, 1), context.k)
    tp, cp, sp = model.tensor_model_parallel_size, model.context_parallel_size, model.sequence_parallel
    if target == alignment_multiple(tp=tp, cp=cp, sp=sp):
        words += [f"--cp {cp}"] if cp > 1 else []
        words += [f"--tp {tp}"] if tp > 1 and (sp or cp > 1) else []
        words += ["--sp"] if sp and tp > 1 else []
    else:
        words.append(f"--pad-seq-to-mult {target}")
    configured_p = context.configured_p
    size = configured_p if configured_p and configured_p > 0 else split.pack_size
    words.append(f"--pack-size {size}")
    settings = manifest.get("settings", {})
    cap = _repack_cap(settings, specs.max_single_sequence_length if specs else None, size)
    if cap is not None:
        words.append(f"--max-seq-length {cap}")
    if has_fixed_width(context.config.dataset):
        words.append("--pad-to-max-length")
    if context.pad_cu_seqlens:
        words.append("--pad-cu-seqlens")
    sample, unknown = sample_flags(settings)
    words += sample
    base = split.folder if Path(split.path).is_dir() or split.manifest else Path(split.path).parent
    output = f"{str(base).rstrip(os.sep)}-p{size}-m{target}"
    words += ["--output", shlex.quote(output)]
    command = " ".join(words)
    note = _cap_note(settings, cap or size, target)
    if note:
        command += f" ({note})"
    if unknown:  # recorded by a newer tightpack: say so rather than drop them
        command += f" (and the recorded {', '.join(unknown)}, which this tightpack has no flag for)"
    return command, output


def _repack_cap(settings: Mapping[str, Any], configured: int | None, size: int | None) -> int | None:
    """The re-pack's ``--max-seq-length``: the configuration's ``max_single_sequence_length``, else the
    manifest's cap when it was below its pack size (at most the new pack size); None: the pack size."""
    if configured:
        return configured
    cap, recorded_size = settings.get("max_seq_length"), settings.get("packed_sequence_size")
    if not cap or not recorded_size or cap >= recorded_size:
        return None
    return min(cap, size) if size else cap


def _cap_note(settings: Mapping[str, Any], cap: int | None, multiple: int) -> str | None:
    """Why the re-packed counts will differ although the cap is the one the manifest records: rounded
    down to the new alignment multiple (as every run rounds it), it is not the length the packs were
    cut at; None when it is, or when the re-pack asks for another cap."""
    recorded_size = settings.get("packed_sequence_size")
    if not cap or not recorded_size:
        return None
    before = PackConfig(
        packed_sequence_size=recorded_size,
        max_seq_length=settings.get("max_seq_length"),
        pad_seq_to_mult=settings.get("pad_seq_to_mult"),
        tp=settings.get("tp") or 1,
        cp=settings.get("cp") or 1,
        sp=bool(settings.get("sp")),
    )
    try:
        old, new = before.cap, length_cap(cap, multiple)
    except TightpackError:  # a cap below the multiple: the re-pack itself says so
        return None
    if old == new or cap != (before.max_seq_length or recorded_size):
        return None  # the same cut, or another cap asked for (a new pack size): no surprise
    how = "shorter" if new < old else "longer"
    return (
        f"its cap of {cap} tokens, rounded down to the multiple {multiple}, is {new}; the packs were "
        f"cut at {old}: samples longer than {min(old, new)} tokens are cut {how} than before, and the "
        "manifest's counts can differ"
    )


def _repack_tokenizer(manifest: Mapping[str, Any], raw: Mapping[str, Any]) -> str | None:
    """The ``--tokenizer`` of the re-pack: the configuration's local tokenizer, else the manifest's."""
    section = raw.get("tokenizer")
    model = section.get("tokenizer_model") if isinstance(section, Mapping) else None
    if isinstance(model, str) and Path(model).exists():
        return model
    name = manifest.get("tokenizer", {}).get("name")
    return None if not name or name.endswith("(built-in)") else name
