"""What the packs of weighted sources hold per source, tallied as a run reads them: `MixtureStats`.

`tightpack.runtime.online_mixture.WeightedSources.new_stats` makes one for its sources; a loop with
DataLoader workers tallies the packs it receives with `MixtureStats.add`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tightpack.errors import TightpackError

__all__ = ["MixtureStats", "sample_counts"]


def sample_counts(sample: Mapping[str, Any], ignore_index: int = -100) -> tuple[int, int | None]:
    """``(tokens, supervised tokens)`` of a prepared sample; supervised is None without ``loss_mask``
    and ``labels``."""
    tokens = len(sample["input_ids"])
    mask = sample.get("loss_mask")
    if mask is not None:
        return tokens, int((mask > 0).sum())
    labels = sample.get("labels")
    if labels is not None:
        return tokens, int((labels != ignore_index).sum())
    return tokens, None


class MixtureStats:
    """What a mixture's packs hold, per source: rows, tokens, supervised tokens, and the shares.

    `tightpack.runtime.online.OnlinePacker.mixture_stats` gives the packer's (the packs it emitted in
    this process); with DataLoader workers, tally the packs the training loop receives with `add`,
    starting from `WeightedSources.new_stats`.

    Attributes:
        names: the sources' names.
        targets: float64 ``[num_sources]``: the target shares (the weights normalised).
        mix_by: what the weights count (`tightpack.core.mixture.MIX_BY`).
        rows, tokens, supervised: int64 ``[num_sources]``: samples, real tokens and supervised tokens
            in the packs (after truncation).
        dropped: int64 ``[num_sources]``: samples left out by ``long_samples="drop"`` (packer only).
        exhausted: the sources past their repetition cap so far (packer only).

    >>> import torch
    >>> stats = MixtureStats(["short", "long"], [0.5, 0.5], mix_by="tokens")
    >>> stats.add({"sources": ["short", "long"], "cu_seqlens_q": torch.tensor([0, 2, 8]),
    ...            "loss_mask": torch.tensor([[0, 1, 0, 0, 1, 1, 1, 1]])})
    >>> stats.tokens.tolist(), stats.supervised.tolist(), stats.shares.tolist()
    ([2, 6], [1, 4], [0.25, 0.75])
    """

    def __init__(
        self, names: Sequence[str], targets: Sequence[float], *, mix_by: str, ignore_index: int = -100
    ) -> None:
        count = len(names)
        self.names = tuple(names)
        self.targets = np.asarray(targets, dtype=np.float64)
        self.mix_by = mix_by
        self.ignore_index = ignore_index
        self.rows = np.zeros(count, np.int64)
        self.tokens = np.zeros(count, np.int64)
        self.supervised = np.zeros(count, np.int64)
        self.dropped = np.zeros(count, np.int64)
        self.exhausted: tuple[str, ...] = ()
        self._index = {name: i for i, name in enumerate(self.names)}

    @property
    def measure(self) -> np.ndarray:
        """int64 ``[num_sources]``: what the weights count, per source (tokens, supervised or rows)."""
        return {"tokens": self.tokens, "supervised-tokens": self.supervised, "samples": self.rows}[
            self.mix_by
        ]

    @property
    def shares(self) -> np.ndarray:
        """float64 ``[num_sources]``: each source's achieved share of the measure (0 before any pack)."""
        return self.measure / max(int(self.measure.sum()), 1)

    def add_sample(self, source: int, sample: Mapping[str, Any]) -> None:
        """Count one sample of source number ``source``, as packed."""
        tokens, supervised = sample_counts(sample, self.ignore_index)
        self.rows[source] += 1
        self.tokens[source] += tokens
        self.supervised[source] += supervised or 0

    def add(self, pack: Mapping[str, Any]) -> None:
        """Count the members of a pack of a mixture (its ``sources``, ``cu_seqlens_q`` and
        ``loss_mask`` or ``labels``).

        Raises:
            TightpackError: the pack has no ``sources`` (not from weighted sources), or names a source
                this mixture does not have.
        """
        if "sources" not in pack:
            raise TightpackError(
                "the pack has no 'sources': MixtureStats counts the packs of an OnlinePacker reading "
                "WeightedSources"
            )
        bounds = np.asarray(pack["cu_seqlens_q"]).astype(np.int64)
        starts = np.asarray(pack.get("cu_seqlens_q_padded", pack["cu_seqlens_q"])).astype(np.int64)
        lengths = np.diff(bounds)
        mask = pack.get("loss_mask")
        if mask is not None:
            supervised = np.asarray(mask).reshape(-1) > 0
        elif pack.get("labels") is not None:
            supervised = np.asarray(pack["labels"]).reshape(-1) != self.ignore_index
        else:
            supervised = np.zeros(int(starts[-1]), dtype=bool)
        for member, name in enumerate(pack["sources"]):
            if name not in self._index:
                raise TightpackError(
                    f"the pack holds a sample of source {name!r}, which this mixture does not have "
                    f"({', '.join(self.names)})"
                )
            source, start, length = self._index[name], int(starts[member]), int(lengths[member])
            self.rows[source] += 1
            self.tokens[source] += length
            self.supervised[source] += int(supervised[start : start + length].sum())

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for a log, a JSON file or a checkpoint), shares included."""
        return {
            "names": list(self.names),
            "mix_by": self.mix_by,
            "targets": self.targets.tolist(),
            "rows": self.rows.tolist(),
            "tokens": self.tokens.tolist(),
            "supervised": self.supervised.tolist(),
            "dropped": self.dropped.tolist(),
            "shares": self.shares.tolist(),
            "exhausted": list(self.exhausted),
        }

    def load(self, values: Mapping[str, Any]) -> None:
        """Take the counts of a `to_dict`."""
        for name in ("rows", "tokens", "supervised", "dropped"):
            getattr(self, name)[:] = values[name]
        self.exhausted = tuple(values["exhausted"])

    def table(self) -> str:
        """One line per source: rows, tokens, supervised tokens, achieved and target share."""
        width = max(len("source"), *(len(name) for name in self.names))
        lines = [
            f"{'source':<{width}} {'rows':>8} {'tokens':>10} {'supervised':>10} {'share':>7} {'target':>7}"
        ]
        for i, name in enumerate(self.names):
            lines.append(
                f"{name:<{width}} {self.rows[i]:>8,} {self.tokens[i]:>10,} {self.supervised[i]:>10,} "
                f"{self.shares[i]:>7.1%} {self.targets[i]:>7.1%}"
            )
        return "\n".join(lines)
