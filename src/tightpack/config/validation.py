"""`validate`: derive the values, run every rule in the registry's order, collect every finding."""

from __future__ import annotations

from tightpack.config.derive import derive
from tightpack.config.report import Finding, ValidationReport
from tightpack.config.rules.registry import REGISTRY
from tightpack.config.schema import RunConfig


def validate(config: RunConfig) -> ValidationReport:
    """Check every rule and return all findings (never just the first) with the derived values.

    The configuration is not modified; ``report.derived.overrides()`` lists what the reference would write.

    >>> from tightpack.config import load_config
    >>> config = load_config({
    ...     "train": {"micro_batch_size": 4, "global_batch_size": 32},
    ...     "model": {"seq_length": 2048},
    ...     "dataset": {"type": "GPTSFTDatasetConfig", "seq_length": 2048, "dataset_root": "squad",
    ...                 "enable_offline_packing": True, "dataset_kwargs": {"pad_to_max_length": True},
    ...                 "offline_packing_specs": {"packed_sequence_size": 2048}}})
    >>> report = validate(config)
    >>> report.ok, [finding.rule for finding in report.findings]
    (False, ['R20'])
    >>> print(report.errors[0].fix)  # doctest: +NORMALIZE_WHITESPACE
    Use the equivalent configuration: train.micro_batch_size: 1 (now 4), train.global_batch_size: 8 (now 32),
    and dataset.offline_packing_specs.packed_sequence_size: 8192 (now 2048), with model.seq_length and
    dataset.seq_length 8192.
    >>> report.derived.packing, report.derived.micro_batches_per_step
    ('offline', 8)
    """
    derived = derive(config)
    findings = [
        Finding(rule.id, issue.severity, issue.reason, issue.fix)
        for rule in REGISTRY
        for issue in rule.check(config, derived)
    ]
    return ValidationReport(findings=tuple(findings), derived=derived, not_checked=config.not_checked)
