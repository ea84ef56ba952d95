"""`_Checker`: one run of the packed-data checks, split by split; its row, metadata and re-pack parts are
mixins in `rows`, `metadata` and `repack`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from tightpack.config import Finding, TrainingConfig
from tightpack.config.derive import DerivedValues, packing_specs
from tightpack.config.report import Severity
from tightpack.core.paths import packed_dataset_files
from tightpack.errors import TightpackError
from tightpack.offline.output_folder import MANIFEST_NAME
from tightpack.packed_summary import read_manifest
from tightpack.stale_packs.metadata import MetadataChecks
from tightpack.stale_packs.repack import Repack
from tightpack.stale_packs.result import CheckedSplit, PackedDataCheck, PackedSplit
from tightpack.stale_packs.rows import RowChecks
from tightpack.stale_packs.rules import RULE_IDS
from tightpack.stale_packs.rules import SPECS as _SPECS


class _Checker(RowChecks, MetadataChecks, Repack):
    def __init__(self, config: TrainingConfig, derived: DerivedValues, deep: bool, raw: Mapping) -> None:
        self.config, self.derived, self.deep, self.raw = config, derived, deep, raw
        self.specs = packing_specs(config.dataset)
        self.k = derived.alignment_multiple
        self.configured_p = self.specs.packed_sequence_size if self.specs else None
        self.pad_cu_seqlens = bool(self.specs and self.specs.pad_cu_seqlens)
        self.issues: list[Finding] = []
        self.notes: list[str] = []
        self.tokenizer_how: str | None = None

    def add(self, rule: str, severity: Severity, reason: str, fix: str) -> None:
        self.issues.append(Finding(rule, severity, reason, fix))

    def run(self, packed: Path | None, named: list[tuple[str, str]]) -> PackedDataCheck:
        wanted = [("packed", str(packed))] if packed is not None else named
        if packed is None and self.config.dataset.do_validation and not self.specs.packed_val_data_path:
            self.notes.append(
                "val: no packed_val_data_path; the reference packs validation itself (not checked)"
            )
        if packed is None and not self.config.dataset.do_validation and self.specs.packed_val_data_path:
            wanted = [(name, path) for name, path in wanted if name != "val"]
            self.notes.append("val: do_validation is false, so packed_val_data_path is not read")
        splits = [split for name, path in wanted if (split := self._open(name, path)) is not None]
        metadata_path, entries = self._metadata(splits, packed)
        for split in splits:
            self._check_split(split, entries)
        if self.pad_cu_seqlens:
            self._check_metadata(splits, metadata_path, entries)
        order = {rule: index for index, rule in enumerate(RULE_IDS)}
        findings = sorted(self.issues, key=lambda finding: order[finding.rule])  # stable within a rule
        return PackedDataCheck(
            tuple(findings),
            tuple(
                PackedSplit(
                    split.name,
                    split.path,
                    tuple(split.files),
                    str(split.folder / MANIFEST_NAME) if split.manifest else None,
                    split.rows_read,
                    split.rows,
                )
                for split in splits
            ),
            str(metadata_path) if metadata_path else None,
            self.tokenizer_how,
            tuple(self.notes),
        )

    # -- locating ----------------------------------------------------------------------------------------

    def _open(self, name: str, path: str) -> CheckedSplit | None:
        where = "--packed" if name == "packed" else f"{_SPECS}.{_split_attr(name)}"
        try:
            files = packed_dataset_files(path)
        except TightpackError as error:
            self.add(
                "D1",
                "error",
                f"{where} {path!r} names no packed data: {error}",
                f"Point {where} at the packed folder, Parquet file or glob (the reference raises "
                "FileNotFoundError when it builds PackedSequenceSpecs), or pack it: tightpack pack INPUT "
                f"--output {path}.",
            )
            return None
        folder = Path(path) if Path(path).is_dir() else Path(files[0]).parent
        split = CheckedSplit(name, path, files, folder)
        if (folder / MANIFEST_NAME).is_file():
            split.manifest = read_manifest(folder / MANIFEST_NAME)
            settings = split.manifest["settings"]
            split.pack_size = settings.get("packed_sequence_size")
            split.multiple = settings.get("pad_seq_to_mult")
            stats = split.manifest.get("stats", {})
            split.stats = {
                "max_samples_per_bin": stats.get("max_samples_per_pack"),
                "dataset_max_seqlen": stats.get("dataset_max_length"),
                "min_packed_seqlen": stats.get("min_packed_length"),
            }
            split.stats = {key: value for key, value in split.stats.items() if value is not None}
        return split

    # -- per split ---------------------------------------------------------------------------------------

    def _check_split(self, split: CheckedSplit, entries: list[dict] | None) -> None:
        if split.manifest is None and entries:
            sizes = [entry["pack_size"] for entry in entries if isinstance(entry.get("pack_size"), int)]
            split.pack_size = max(sizes) if sizes else None
        if split.manifest is not None:
            self._check_files(split)
            self._check_tokenizer(split)
        self._check_pack_size(split)
        self._check_multiple(split)
        if split.manifest is None:  # the rows tell the stats, and (unless deep reads them all) the faults
            self._sample(split, report=not self.deep)
        if self.deep:
            self._deep(split)

    def _check_pack_size(self, split: CheckedSplit) -> None:
        size, configured = split.pack_size, self.configured_p or 0
        if size is None:
            return
        source = "manifest" if split.manifest else "metadata pack_size"
        limits = [(f"{_SPECS}.packed_sequence_size", configured)] if configured > 0 else []
        limits += [
            ("dataset.seq_length", self.config.dataset.seq_length),
            ("model.seq_length", self.config.model.seq_length),
        ]
        over = [(name, value) for name, value in limits if size > value]
        if over:
            name, value = min(over, key=lambda item: item[1])
            self.add(
                "D2",
                "error",
                f"{split.name} packs {split.path} were made with pack size {size} ({source}), above "
                f"{name} {value}: rows of up to {size} runtime tokens do not fit a batch width of {value}.",
                self._repack_fix(split),
            )
        elif size < configured:
            self.add(
                "D2",
                "warning",
                f"{split.name} packs {split.path} were made with pack size {size} ({source}), below "
                f"{_SPECS}.packed_sequence_size {configured}: each pack holds at most {size} tokens, so "
                "steps train on fewer tokens than configured.",
                f"{self._repack_fix(split)} Or set {_SPECS}.packed_sequence_size: {size} (with the sequence "
                "lengths to match).",
            )

    def _check_multiple(self, split: CheckedSplit) -> None:
        multiple = split.multiple
        if multiple is None:  # no manifest: D8 samples the segments instead
            return
        k = self.k
        cp_part = math.lcm(*(2 * cp for cp in self._cps() if cp > 1), 1)
        if multiple % k:
            split.misaligned = True
            origin = self._origin()
            if multiple % cp_part:
                self.add(
                    "D3",
                    "error",
                    f"{split.name} packs {split.path} are aligned to pad_seq_to_mult {multiple} (manifest), "
                    f"not a multiple of {k} ({origin}): context-parallel slicing needs every segment "
                    f"divisible by {cp_part} (2*CP).",
                    self._repack_fix(split),
                )
            else:
                self.add(
                    "D3",
                    "warning",
                    f"{split.name} packs {split.path} are aligned to pad_seq_to_mult {multiple} (manifest), "
                    f"not a multiple of the sequence-parallel multiple {k} ({origin}); the reference's "
                    "recipes align packed segments to it.",
                    self._repack_fix(split),
                )
            return
        configured = (self.specs.pad_seq_to_mult if self.specs else None) or 1
        if configured != multiple:
            self.add(
                "D4",
                "warning",
                f"{split.name} packs {split.path} are aligned to pad_seq_to_mult {multiple} (manifest), the "
                f"configuration says {_SPECS}.pad_seq_to_mult {configured}; the reference reads the packs "
                + (
                    "as aligned and strips trailing EOS from the logical lengths."
                    if configured > 1
                    else "as unaligned: no cu_seqlens_q_padded, the alignment padding counts as sequence."
                ),
                f"Set {_SPECS}.pad_seq_to_mult: {multiple} (what the packs hold).",
            )

    def _check_files(self, split: CheckedSplit) -> None:
        listed = {entry["name"]: entry for entry in split.manifest.get("files", []) if "name" in entry}
        manifest = split.folder / MANIFEST_NAME
        fix = self._repack_fix(split)
        for file in split.files:
            name = Path(file).name
            entry = listed.get(name)
            if entry is None:
                self.add(
                    "D9",
                    "error",
                    f"{file} is not in {manifest}: it was added after packing (another run's shard?), and "
                    "the training job reads it too.",
                    f"Remove {file}, or {fix[0].lower()}{fix[1:]}",
                )
                continue
            size = os.stat(file).st_size
            if entry.get("bytes") is not None and size != entry["bytes"]:
                self.add(
                    "D9",
                    "error",
                    f"{file} has {size:,} bytes, {manifest} lists {entry['bytes']:,}: the file changed "
                    "after packing.",
                    fix,
                )
            elif self.deep and entry.get("sha256"):
                from tightpack.core.checksums import file_digest

                digest = file_digest(file)["sha256"]
                if digest != entry["sha256"]:
                    self.add(
                        "D9",
                        "error",
                        f"{file} has sha256 {digest[:12]}..., {manifest} lists "
                        f"{entry['sha256'][:12]}...: the file changed after packing.",
                        fix,
                    )
        if Path(split.path).is_dir():
            for name in sorted(set(listed) - {Path(file).name for file in split.files}):
                self.add(
                    "D9",
                    "error",
                    f"{split.folder / name} is listed in {manifest} but missing.",
                    fix,
                )

    def _check_tokenizer(self, split: CheckedSplit) -> None:
        packed = split.manifest.get("tokenizer", {})
        packed_name, fingerprint = packed.get("name"), packed.get("fingerprint")
        wanted = _configured_tokenizer(self.raw, self.specs)
        if wanted is None or not packed_name:
            return
        key, value = wanted
        local = Path(value)
        if key == "tokenizer.tokenizer_model" and local.exists() and fingerprint:
            from tightpack.prepare.tokenizer import load_tokenizer

            try:
                spec = load_tokenizer(local)
            except TightpackError as error:
                self.notes.append(f"tokenizer {value}: not loadable by tightpack ({error}); names compared")
            else:
                self.tokenizer_how = "fingerprint"
                if spec.fingerprint != fingerprint:
                    self.add(
                        "D7",
                        "error",
                        f"{split.name} packs {split.path} were tokenized with {packed_name!r} (fingerprint "
                        f"{fingerprint[:12]}), {key} {value!r} has fingerprint {spec.fingerprint[:12]}: "
                        "other token ids.",
                        self._repack_fix(split),
                    )
                return
        self.tokenizer_how = self.tokenizer_how or "name"
        if _tokenizer_key(value) != _tokenizer_key(packed_name):
            self.add(
                "D7",
                "warning",
                f"{split.name} packs {split.path} were tokenized with {packed_name!r}, the configuration "
                f"names {key} {value!r} (names compared: {value!r} is no local tokenizer tightpack can "
                "load, so the contents could not be).",
                f"If the tokenizers differ: {self._repack_fix(split)}",
            )

    @cached_property
    def configured_vocabulary(self) -> tuple[int, str, str] | None:
        """(size, key, value) of the configured tokenizer's vocabulary, loaded once; None (with a note)
        when the configuration names none that tightpack can load."""
        from tightpack.prepare.tokenizer import load_tokenizer

        wanted = _configured_tokenizer(self.raw, self.specs)
        if wanted is None:
            self.notes.append("token ids not checked (D10): the configuration names no tokenizer")
            return None
        key, value = wanted
        described = f"{key} {value!r}"
        if key == "tokenizer.tokenizer_type":  # GPT2BPETokenizer: GPT-2's vocabulary
            spec = load_tokenizer(None)
        elif key == "tokenizer.tokenizer_model" and Path(value).exists():
            try:
                spec = load_tokenizer(value)
            except TightpackError as error:
                self.notes.append(f"token ids not checked (D10): {described} is not loadable ({error})")
                return None
        else:
            self.notes.append(f"token ids not checked (D10): {described} is no local tokenizer")
            return None
        return spec.vocab_size, key, value

    # -- helpers -----------------------------------------------------------------------------------------

    def _cps(self) -> tuple[int, int]:
        return (self.config.model.context_parallel_size, self.derived.eval_context_parallel_size)

    def _origin(self) -> str:
        model = self.config.model
        return (
            f"k = {self.k} from TP={model.tensor_model_parallel_size}, CP={model.context_parallel_size}, "
            f"eval CP={self.derived.eval_context_parallel_size}, SP={model.sequence_parallel}"
        )


def _split_attr(name: str) -> str:
    return {"train": "packed_train_data_path", "val": "packed_val_data_path"}.get(name, name)


def _configured_tokenizer(raw: Mapping[str, Any], specs: object) -> tuple[str, str] | None:
    """(key, value) of the tokenizer the configuration names: Megatron-Bridge's ``tokenizer`` section
    (``tokenizer_model``; ``tokenizer_type: GPT2BPETokenizer`` is GPT-2), else the packing specs'
    ``tokenizer_model_name`` (a name only)."""
    section = raw.get("tokenizer")
    if isinstance(section, Mapping):
        model = section.get("tokenizer_model")
        if isinstance(model, str) and model:
            return "tokenizer.tokenizer_model", model
        if section.get("tokenizer_type") == "GPT2BPETokenizer":
            return "tokenizer.tokenizer_type", "gpt2"
    name = getattr(specs, "tokenizer_model_name", None)
    if name:
        return f"{_SPECS}.tokenizer_model_name", name
    return None


def _tokenizer_key(name: str) -> str:
    """A tokenizer name reduced for comparison: ``'gpt2 (built-in)'``, ``'openai-community/gpt2'`` and
    ``'openai-community--gpt2'`` (the reference's directory form) are all ``'gpt2'``.

    >>> [_tokenizer_key(name) for name in ("gpt2 (built-in)", "openai-community--gpt2", "/m/Llama-3/")]
    ['gpt2', 'gpt2', 'llama-3']
    """
    name = name.strip().removesuffix("(built-in)").strip().replace("--", "/").rstrip("/\\")
    return name.replace("\\", "/").rsplit("/", 1)[-1].lower()
