"""What ``tightpack verify`` found: each fault with its check and place, and the totals read."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Violation:
    """One fault: which check, what is wrong, and where (file, pack row, sequence within the row)."""

    check: str
    message: str
    file: str | None = None
    row: int | None = None
    sequence: int | None = None

    def __str__(self) -> str:
        where = ", ".join(
            f"{name} {value}"
            for name, value in (("file", self.file), ("row", self.row), ("sequence", self.sequence))
            if value is not None
        )
        return f"[{self.check}] {where + ': ' if where else ''}{self.message}"


@dataclass
class VerifyReport:
    """Every fault found (at most ``limit`` listed per check; ``counts`` has the totals) and what was read."""

    path: str
    settings: dict[str, Any]
    checked: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    limit: int = 20

    @property
    def ok(self) -> bool:
        return not self.counts

    def add(self, check: str, message: str, **where: Any) -> None:
        self.counts[check] += 1
        if self.counts[check] <= self.limit:
            self.violations.append(Violation(check, message, **where))

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "settings": self.settings,
            "checked": self.checked,
            "violations": [asdict(v) for v in self.violations],
            "counts": dict(self.counts),
        }
