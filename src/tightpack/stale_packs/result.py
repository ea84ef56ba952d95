"""What `check_packed_data` returns: the findings, and what was read to find them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tightpack.config import Finding


@dataclass(frozen=True)
class PackedSplit:
    """What was read of one split.

    Attributes:
        split: ``train``, ``val`` or ``packed`` (``--packed``).
        path: the path as configured.
        files: the packed files it resolves to (empty when it does not resolve).
        manifest: the tightpack manifest read, or None (Megatron-Bridge's packs, legacy ``.npy``).
        rows_read: rows read (a sample without a manifest; all with ``deep``); 0 when none.
        rows: rows in the files (None when not counted).
    """

    split: str
    path: str
    files: tuple[str, ...] = ()
    manifest: str | None = None
    rows_read: int = 0
    rows: int | None = None

    def describe(self) -> str:
        if not self.files:
            return f"{self.split} {self.path} (not found)"
        source = "manifest" if self.manifest else "no manifest"
        files = f"{len(self.files)} file{'' if len(self.files) == 1 else 's'}"
        read = f"{self.rows_read:,} of {self.rows:,} rows read" if self.rows is not None else "no rows read"
        return f"{self.split} {self.path} ({source}, {files}, {read})"


@dataclass(frozen=True)
class PackedDataCheck:
    """The findings of `check_packed_data` and what it checked.

    Attributes:
        findings: the D findings, in rule order.
        splits: the splits read.
        metadata: the metadata file read, or None.
        tokenizer: how the tokenizer was compared (``fingerprint``, ``name``), or None.
        notes: one line each: why nothing was checked, or what was left out.
    """

    findings: tuple[Finding, ...]
    splits: tuple[PackedSplit, ...] = ()
    metadata: str | None = None
    tokenizer: str | None = None
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The text report's lines about the packed data (`format_report` puts them before the result)."""
        if not self.splits:
            return [f"packed data: {note}" for note in self.notes]
        lines = ["packed data:"]
        lines += [f"  {split.describe()}" for split in self.splits]
        if self.metadata:
            lines.append(f"  metadata {self.metadata}")
        if self.tokenizer:
            lines.append(f"  tokenizer compared by {self.tokenizer}")
        lines += [f"  {note}" for note in self.notes]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "splits": [dataclasses.asdict(split) for split in self.splits],
            "metadata": self.metadata,
            "tokenizer": self.tokenizer,
            "notes": list(self.notes),
        }
