"""The rule registry: every rule of the rule modules, in the order `validate` runs them.

`ORDER` is that order, declared once: the reference's ``ConfigContainer.validate()`` for R1-R22
(docs/contract.md §5; R12 and R14 derive values instead, see `tightpack.config.derive`), then the rules
it enforces elsewhere (X), then tightpack's additions (T). The rule modules register their rules with
their own `RuleGroup`; at import `ordered` checks that each id of `ORDER` has exactly one rule and that each
rule has an id in `ORDER`, so a new rule is one function in its module and one id here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from tightpack.config.rules import batching, collate_time, energon, offline, parallel
from tightpack.config.rules.base import Check, Rule, RuleGroup

ORDER: tuple[str, ...] = (
    "R1", "R2", "R3", "R4", "R5", "R6", "R7",
    "R8.1", "R8.2", "R8.3", "R8.4", "R8.5", "R8.6", "R8.7", "R8.8", "R8.9",
    "R9", "R10.1", "R10.2", "R10.3", "R10.4", "R10.5", "R10.6", "R10.7",
    "R11", "R13", "R15", "R16", "R17", "R18", "R19", "R20", "R21", "R22",
    "X1", "X2", "X3", "X4", "X5", "X6", "X7",
    "T1", "T2", "T3", "T4", "T5", "T6", "T7",
)  # fmt: skip
"""Every rule id, in the order `validate` runs the rules and reports their findings."""

GROUPS: tuple[RuleGroup, ...] = (
    batching.rules,
    collate_time.rules,
    energon.rules,
    offline.rules,
    parallel.rules,
)


def ordered(groups: Iterable[RuleGroup], order: Sequence[str]) -> tuple[Rule, ...]:
    """The rules of ``groups`` in ``order``.

    Raises:
        ValueError: an id appears twice in ``order``, has no rule or more than one, or a rule's id is not in
            ``order``; the message names every such id (and the modules of the rules).

    >>> ordered([batching.rules], ["R1", "R2", "R16", "R22"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: rule registry: rules without an id in ORDER: X1 (batching); add each id to ORDER ...
    """
    rules: dict[str, list[Rule]] = {}
    for group in groups:
        for rule in group:
            rules.setdefault(rule.id, []).append(rule)
    problems = []
    repeated = [rule_id for rule_id, count in Counter(order).items() if count > 1]
    if repeated:
        problems.append(f"ids listed more than once in ORDER: {', '.join(repeated)}")
    missing = [rule_id for rule_id in order if rule_id not in rules]
    if missing:
        problems.append(f"ids in ORDER without a rule: {', '.join(missing)}")
    several = {rule_id: found for rule_id, found in rules.items() if len(found) > 1}
    if several:
        problems.append(
            "ids with more than one rule: "
            + ", ".join(
                f"{rule_id} ({', '.join(rule.module for rule in found)})"
                for rule_id, found in several.items()
            )
        )
    undeclared = {rule_id: found for rule_id, found in rules.items() if rule_id not in order}
    if undeclared:
        problems.append(
            "rules without an id in ORDER: "
            + ", ".join(f"{rule_id} ({found[0].module})" for rule_id, found in undeclared.items())
            + "; add each id to ORDER in tightpack.config.rules.registry, or remove the rule"
        )
    if problems:
        raise ValueError(f"rule registry: {'; '.join(problems)}")
    return tuple(rules[rule_id][0] for rule_id in order)


REGISTRY: tuple[Rule, ...] = ordered(GROUPS, ORDER)
"""Every rule, in `ORDER`."""

RULES: tuple[tuple[str, Check], ...] = tuple((rule.id, rule.check) for rule in REGISTRY)
"""Every rule as (id, function), in the order `validate` runs them."""
