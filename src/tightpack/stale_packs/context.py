"""What every packed-data check reads (`CheckContext`), and one split as it is checked (`CheckedSplit`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tightpack.config import Finding, PackedSequenceSpecs, RunConfig
from tightpack.config.derive import DerivedValues, derive, packing_specs
from tightpack.config.report import Severity


@dataclass(frozen=True)
class CheckContext:
    """One run of the packed-data checks: what they read, and the list they add their findings to.

    Attributes:
        config: the configuration checked.
        derived: its derived values (`tightpack.config.derive.derive`).
        deep: read every row and hash every file.
        raw: the configuration as read from YAML, for the sections tightpack does not model
            (``tokenizer``); empty when not given.
        specs: ``dataset.offline_packing_specs``, or None.
        k: the alignment multiple the configuration needs (CP/SP, rule R13).
        configured_p: ``packed_sequence_size``, or None without specs.
        pad_cu_seqlens: ``pad_cu_seqlens`` is set.
        mix_by: what a blend's weights are meant to count (`tightpack.core.mixture.MIX_BY`; rule D11).
        blend_targets: the shares a blend is meant to give, one per source (None: its weights; D11).
        findings: what the checks found, in the order they found it (`add`).
        notes: one line each: what was left out, or how something was compared.
        loaded: what is read once per run, by name (the configured tokenizer's vocabulary).
    """

    config: RunConfig
    derived: DerivedValues
    deep: bool
    raw: Mapping[str, Any]
    specs: PackedSequenceSpecs | None
    k: int
    configured_p: int | None
    pad_cu_seqlens: bool
    mix_by: str = "tokens"
    blend_targets: tuple[float, ...] | None = None
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loaded: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        config: RunConfig,
        *,
        deep: bool,
        raw: Mapping[str, Any],
        mix_by: str = "tokens",
        blend_targets: tuple[float, ...] | None = None,
    ) -> CheckContext:
        """The context of one run over ``config``."""
        derived = derive(config)
        specs = packing_specs(config.dataset)
        return cls(
            config=config,
            derived=derived,
            deep=deep,
            raw=raw,
            specs=specs,
            k=derived.alignment_multiple,
            configured_p=specs.packed_sequence_size if specs else None,
            pad_cu_seqlens=bool(specs and specs.pad_cu_seqlens),
            mix_by=mix_by,
            blend_targets=blend_targets,
        )

    def add(self, rule: str, severity: Severity, reason: str, fix: str) -> None:
        """Record one finding."""
        self.findings.append(Finding(rule, severity, reason, fix))

    def context_parallel_sizes(self) -> tuple[int, int]:
        """The training and the evaluation CP."""
        return (self.config.model.context_parallel_size, self.derived.eval_context_parallel_size)

    def origin(self) -> str:
        """Where k comes from, for a message: ``k = 4 from TP=2, CP=2, eval CP=2, SP=True``."""
        model = self.config.model
        return (
            f"k = {self.k} from TP={model.tensor_model_parallel_size}, CP={model.context_parallel_size}, "
            f"eval CP={self.derived.eval_context_parallel_size}, SP={model.sequence_parallel}"
        )


@dataclass(frozen=True)
class CheckedSplit:
    """One split while it is checked: its files, manifest and what the packs say of themselves.

    A check that learns something of the split returns a new one (`dataclasses.replace`).
    """

    name: str
    path: str
    files: list[str]
    folder: Path
    manifest: dict[str, Any] | None = None
    pack_size: int | None = None
    multiple: int | None = None
    stats: dict[str, int] = field(default_factory=dict)  # max_samples_per_bin, dataset_max_seqlen, ...
    rows: int | None = None
    rows_read: int = 0
    misaligned: bool = False  # D3 found the recorded multiple wrong: deep reading need not repeat it

    @property
    def attr(self) -> str:
        """The configuration key of its path (``packed_train_data_path``), or "" for ``--packed``."""
        return "" if self.name == "packed" else split_attr(self.name)


def split_attr(name: str) -> str:
    """The configuration key of a split's path: ``train`` -> ``packed_train_data_path``, ``train[1]`` (the
    second source of a blend) -> ``packed_train_data_blend[0][1]``."""
    if name.startswith("train["):
        return f"packed_train_data_blend[0]{name[len('train') :]}"
    return {"train": "packed_train_data_path", "val": "packed_val_data_path"}.get(name, name)
