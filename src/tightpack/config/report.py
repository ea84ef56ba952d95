"""What `validate` returns: findings and the report, as text or as JSON-ready data.

`Finding` is one violated rule; `ValidationReport` holds every finding, the derived values and the keys no
rule read. `ValidationReport.format` is what ``tightpack validate`` prints, `ValidationReport.to_dict` what
``tightpack validate --json`` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tightpack.config.derive import DerivedValues

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One violated rule.

    Attributes:
        rule: rule id, e.g. ``"R20"`` (docs/validation-rules.md lists them).
        severity: ``"error"`` (the run would fail or compute the wrong thing) or ``"warning"``.
        reason: what is wrong, with the values.
        fix: what to set.
    """

    rule: str
    severity: Severity
    reason: str
    fix: str


@dataclass(frozen=True)
class ValidationReport:
    """Every finding of `validate`, in rule order, the derived values and the keys no rule read.

    Attributes:
        findings: the violations, errors and warnings, in rule order.
        derived: what the reference derives (None: not computed).
        not_checked: the dotted paths `load_config` accepted without reading (``RunConfig.not_checked``).

    >>> report = ValidationReport(findings=(Finding("R21", "error", "MBS is 1", "set MBS 2"),), derived=None)
    >>> report.ok, [finding.rule for finding in report.errors], report.warnings
    (False, ['R21'], ())
    """

    findings: tuple[Finding, ...]
    derived: DerivedValues | None
    not_checked: tuple[str, ...] = ()

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == "warning")

    @property
    def ok(self) -> bool:
        """False when there is any error (warnings do not count)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``ok``, ``errors``, ``warnings``, ``derived``, ``overrides`` and ``not_checked``."""
        derived = self.derived
        return {
            "ok": self.ok,
            "errors": [dataclasses.asdict(finding) for finding in self.errors],
            "warnings": [dataclasses.asdict(finding) for finding in self.warnings],
            "derived": dataclasses.asdict(derived) if derived else None,
            "overrides": derived.overrides() if derived else {},
            "not_checked": list(self.not_checked),
        }

    def format(self) -> str:
        """Human-readable text: errors, warnings (rule, reason, fix), derived values, keys not checked."""
        lines: list[str] = []
        for title, findings in (("errors", self.errors), ("warnings", self.warnings)):
            lines.append(f"{title} ({len(findings)}):" if findings else f"{title}: none")
            for finding in findings:
                lines.append(f"  {finding.rule:<6} {finding.reason}")
                lines.append(f"  {'':<6} fix: {finding.fix}")
        if self.derived is not None:
            lines.append("derived values:")
            lines += [f"  {name:<42} {value}" for name, value in _derived_rows(self.derived)]
        if self.not_checked:
            lines.append(_not_checked_line(self.not_checked))
        counts = f"{_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"
        lines.append(f"result: {'ok' if self.ok else 'invalid'} ({counts})")
        return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


_NOT_CHECKED_SHOWN = 3  # a section with more unread keys is summarized as "N keys of SECTION"


def _not_checked_line(paths: Iterable[str]) -> str:
    """The keys no rule read, in one line: whole sections first, then each section's keys or their count.

    >>> model = ["model.hidden_size", "model.num_layers", "model.ffn_hidden_size", "model.vocab_size"]
    >>> _not_checked_line(["train.eval_iters", *model, "optimizer", "scheduler"])
    'not checked by tightpack: optimizer, scheduler, train.eval_iters, 4 keys of model (7 keys)'
    """
    groups: dict[str, list[str]] = {"": []}  # the top level's whole sections first
    for path in paths:
        groups.setdefault(path.rpartition(".")[0], []).append(path)
    shown: list[str] = []
    for section, keys in groups.items():
        many = section and len(keys) > _NOT_CHECKED_SHOWN
        shown += [f"{len(keys)} keys of {section}"] if many else keys
    total = sum(len(keys) for keys in groups.values())
    return f"not checked by tightpack: {', '.join(shown)} ({_plural(total, 'key')})"


def _dataset_type_shown(derived: DerivedValues) -> str:
    """``GPTSFTDatasetConfig (inferred from its fields: dataset_root)``: the kind, and why unless declared."""
    source = derived.dataset_type_source
    if source is None or source.endswith(".type"):
        return derived.dataset_type
    return f"{derived.dataset_type} ({source if source.startswith('inferred') else f'from {source}'})"


def _derived_rows(derived: DerivedValues) -> list[tuple[str, object]]:
    def shown(value: object) -> object:
        return "n/a" if value is None else value

    rows: list[tuple[str, object]] = [
        ("dataset type", _dataset_type_shown(derived)),
        ("packing", derived.packing),
        ("alignment multiple k (R13)", derived.alignment_multiple),
        ("data-parallel size", shown(derived.data_parallel_size)),
        ("micro-batches per step", shown(derived.micro_batches_per_step)),
        ("eval context-parallel size", derived.eval_context_parallel_size),
        ("eval data-parallel size", shown(derived.eval_data_parallel_size)),
        ("eval micro-batches per step", shown(derived.eval_micro_batches_per_step)),
        ("pad_to_max_length (R12)", shown(derived.pad_to_max_length)),
        ("in_batch_packing_pad_to_multiple_of (R14)", shown(derived.in_batch_packing_pad_to_multiple_of)),
        ("pad_to_multiple_of (R14)", shown(derived.pad_to_multiple_of)),
        ("model._enable_in_batch_packing (R14)", derived.enable_in_batch_packing),
        ("model.variable_seq_lengths (R14)", derived.variable_seq_lengths),
    ]
    rows += [(f"{path} (R11)", False) for path in derived.forced_off]
    return rows
