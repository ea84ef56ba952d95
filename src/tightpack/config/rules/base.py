"""What a rule is, how a rule module registers its rules, and the helpers their messages share.

A rule is a check over a configuration and its derived values that yields one `Issue` per violation; its id,
severities, contract section and summary are data (`Rule`), from which docs/validation-rules.md is rendered
(`tightpack.config.rules_table`). Each rule module makes one `RuleGroup` and registers its checks with the
group's decorator; `tightpack.config.rules.registry` puts the rules of every group in the reference's order::

    rules = RuleGroup()

    @rules.add("R21", "error", section="§5, §3.7", summary="in-batch packing needs MBS > 1")
    def _in_batch_mbs(config: RunConfig, derived: DerivedValues) -> Iterator[Issue]:
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, get_args

from tightpack.config.derive import DerivedValues
from tightpack.config.report import Severity
from tightpack.config.schema import RunConfig
from tightpack.core.alignment import ceil_to_multiple


class Issue(NamedTuple):
    """One violation found by a check; `validate` makes it a `Finding` with the rule's id."""

    severity: Severity
    reason: str
    fix: str


def error(reason: str, fix: str) -> Issue:
    return Issue("error", reason, fix)


def warning(reason: str, fix: str) -> Issue:
    return Issue("warning", reason, fix)


Check = Callable[[RunConfig, DerivedValues], Iterable[Issue]]


@dataclass(frozen=True)
class Rule:
    """One rule: its check, and what docs/validation-rules.md says of it.

    Attributes:
        id: ``R1``-``R22`` are the reference's ``ConfigContainer.validate()`` in its numbering
            (docs/contract.md §5), ``X`` ids the rules it enforces elsewhere, ``T`` ids the rules
            tightpack adds.
        severities: what its findings can be: ``("error",)``, ``("warning",)`` or both (by case).
        section: the contract sections that state it, e.g. ``"§5, §3.7"``.
        summary: one line of Markdown for the table.
        check: yields an `Issue` per violation, nothing when the rule holds.
    """

    id: str
    severities: tuple[Severity, ...]
    section: str
    summary: str
    check: Check

    @property
    def module(self) -> str:
        """The rule module that defines it, e.g. ``"offline"``."""
        return self.check.__module__.rpartition(".")[2]


class RuleGroup:
    """The rules of one rule module, in the order `add` registered them (the registry orders them all)."""

    def __init__(self) -> None:
        self._rules: list[Rule] = []

    def add(
        self, rule_id: str, *severities: Severity, section: str, summary: str
    ) -> Callable[[Check], Check]:
        """A decorator registering its function as the check of rule ``rule_id``; the function is unchanged.

        Raises:
            ValueError: ``severities`` is empty or holds another value than ``"error"`` and ``"warning"``.
        """
        known = get_args(Severity)
        if not severities or any(severity not in known for severity in severities):
            raise ValueError(f"rule {rule_id}: severities must be one or both of {known}, got {severities}")

        def register(check: Check) -> Check:
            self._rules.append(Rule(rule_id, severities, section, summary, check))
            return check

        return register

    def __iter__(self) -> Iterator[Rule]:
        return iter(self._rules)


def round_options(value: int, multiple: int) -> str:
    """``'4096 or 4100'``: the nearest multiples below (when positive) and above.

    >>> round_options(4098, 4), round_options(3, 8)
    ('4096 or 4100', '8')
    """
    below, above = value // multiple * multiple, int(ceil_to_multiple(value, multiple))
    return f"{below} or {above}" if 0 < below != above else str(above)


def multiple_origin(config: RunConfig, derived: DerivedValues) -> str:
    """Where k comes from, for the messages: ``'k = 4 from TP=1, CP=2, eval CP=2, SP=False'``."""
    model = config.model
    return (
        f"k = {derived.alignment_multiple} from TP={model.tensor_model_parallel_size}, "
        f"CP={model.context_parallel_size}, eval CP={derived.eval_context_parallel_size}, "
        f"SP={model.sequence_parallel}"
    )
