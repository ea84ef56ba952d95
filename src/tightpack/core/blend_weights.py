"""Blend weights for separately packed folders: the pack weights that give a mix of tokens.

Megatron-Bridge blends separately packed folders at run time by samples, and a sample of packed data is
one pack (a Parquet row): ``offline_packing_specs.packed_train_data_blend`` normalises its weights and
draws each folder's share of the blend's rows (`GPTSFTPackedParquetBlendDataset`, the selection of
Megatron-Core's ``BlendedDataset``). A pack of one folder holds other numbers of tokens, supervised
tokens and samples than a pack of another, so weights meant as shares of tokens give another mix. With
``m_f`` the measure (`tightpack.core.mixture.MIX_BY`) per pack of folder ``f``:

- the weights for target shares ``t``: ``w_f = (t_f / m_f) / sum_g (t_g / m_g)`` (`blend_weights`);
- the shares that weights ``w`` give in expectation: ``s_f = w_f m_f / sum_g w_g m_g`` (`blend_shares`).

`plan_blend` adds the packs a blend of N rows draws from each folder and how many passes over it that
is: `blend_counts`, Megatron-Core's own selection, for the weights as written (`written_weights`). What
a folder holds comes from its manifest (`FolderStats.from_manifest`); ``tightpack blend`` prints the
weights in Megatron-Bridge's syntax and rule D11 of ``tightpack validate`` checks a configuration's.
Mixing samples before packing, into one folder, is `tightpack.core.mixture`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tightpack.core.mixture import MIX_BY, check_weights
from tightpack.errors import TightpackError

__all__ = [
    "BlendPlan",
    "FolderStats",
    "blend_counts",
    "blend_shares",
    "blend_weights",
    "plan_blend",
    "written_weights",
]

_UNITS = {"tokens": "tokens", "supervised-tokens": "supervised tokens", "samples": "samples"}


@dataclass(frozen=True)
class FolderStats:
    """What one packed folder holds, as a blend counts it.

    Attributes:
        packs: rows (packs): what Megatron-Bridge's blend weights count.
        samples: samples (sequences) in the packs.
        tokens: runtime tokens of those samples (without alignment padding, when the manifest says).
        supervised_tokens: tokens with a loss.

    >>> folder = FolderStats(packs=10, samples=120, tokens=38_000, supervised_tokens=9_500)
    >>> folder.per_pack("samples"), folder.per_pack("tokens")
    (12.0, 3800.0)
    """

    packs: int
    samples: int
    tokens: int
    supervised_tokens: int

    def total(self, by: str) -> int:
        """The folder's total of ``by`` (`MIX_BY`)."""
        if by not in MIX_BY:
            raise TightpackError(
                f"unknown mix_by {by!r}; choose one of {', '.join(MIX_BY)}", parameters=("mix_by",)
            )
        return {"tokens": self.tokens, "supervised-tokens": self.supervised_tokens, "samples": self.samples}[
            by
        ]

    def per_pack(self, by: str) -> float:
        """The folder's ``by`` per pack: what one unit of blend weight draws of it."""
        return self.total(by) / self.packs

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], where: str = "the manifest") -> FolderStats:
        """The statistics a tightpack ``manifest.json`` records: ``stats.packs``, ``stats.samples``,
        ``counts.tokens_packed`` and ``counts.supervised_packed``.

        Raises:
            TightpackError: a value is missing (a manifest of another kind, preference packs): the
                message names it and ``where``.
        """
        stats, counts = manifest.get("stats") or {}, manifest.get("counts") or {}
        values = {
            "packs": stats.get("packs"),
            "samples": stats.get("samples", counts.get("packed")),
            "tokens": counts.get("tokens_packed"),
            "supervised_tokens": counts.get("supervised_packed"),
        }
        missing = [name for name, value in values.items() if not isinstance(value, int)]
        if missing:
            raise TightpackError(
                f"{where} records no {', '.join(missing)} (stats.packs, stats.samples, counts.tokens_packed, "
                "counts.supervised_packed): pack the folder again with this tightpack"
            )
        return cls(**values)


def _per_pack(folders: Sequence[FolderStats], by: str, names: Sequence[str]) -> np.ndarray:
    """The measure per pack of every folder; an error naming a folder with no packs or none of it."""
    for folder, name in zip(folders, names, strict=True):
        if folder.packs <= 0:
            raise TightpackError(f"{name} holds no packs: remove it from the blend", parameters=("folders",))
        if folder.total(by) <= 0:
            raise TightpackError(
                f"{name} holds no {_UNITS[by]}, so no weight gives it a share of them: remove it from the "
                "blend, or mix by another measure",
                parameters=("folders",),
            )
    return np.array([folder.per_pack(by) for folder in folders], dtype=np.float64)


def _names(names: Sequence[str] | None, count: int) -> list[str]:
    return list(names) if names is not None else [f"folder {index}" for index in range(count)]


def blend_weights(
    targets: Sequence[float],
    folders: Sequence[FolderStats],
    *,
    by: str = "tokens",
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """The pack weights (summing to 1) whose expected mix of ``by`` is ``targets`` under sample weighting.

    Args:
        targets: one positive target share per folder (normalised).
        folders: what each folder holds.
        by: what the targets count (`MIX_BY`).
        names: the folders' names for messages (default ``folder 0``, ...).

    Raises:
        TightpackError: a target is not a positive number, their count is not the folders', or a folder
            holds no packs or none of ``by``.

    A folder of short samples holds more samples per pack; for equal shares of samples it gets the
    smaller weight:

    >>> short = FolderStats(packs=10, samples=120, tokens=38_000, supervised_tokens=9_500)
    >>> long = FolderStats(packs=40, samples=40, tokens=150_000, supervised_tokens=75_000)
    >>> blend_weights([1, 1], [short, long], by="samples").round(4).tolist()
    [0.0769, 0.9231]
    """
    names = _names(names, len(folders))
    shares = check_weights(list(targets), names)
    weights = shares / _per_pack(folders, by, names)
    return weights / weights.sum()


def blend_shares(
    weights: Sequence[float],
    folders: Sequence[FolderStats],
    *,
    by: str = "tokens",
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """The shares of ``by`` that pack weights give in expectation (the inverse of `blend_weights`).

    Raises:
        TightpackError: as `blend_weights`.

    >>> short = FolderStats(packs=10, samples=120, tokens=38_000, supervised_tokens=9_500)
    >>> long = FolderStats(packs=40, samples=40, tokens=150_000, supervised_tokens=75_000)
    >>> blend_shares([0.5, 0.5], [short, long], by="supervised-tokens").round(4).tolist()
    [0.3363, 0.6637]
    """
    names = _names(names, len(folders))
    weights = check_weights(list(weights), names)
    drawn = weights * _per_pack(folders, by, names)
    return drawn / drawn.sum()


def blend_counts(weights: Sequence[float], size: int) -> np.ndarray:
    """The rows (packs) a blend of ``size`` rows takes from each source: Megatron-Core's counts, exactly.

    Megatron-Core's ``BlendedDataset`` normalises the weights (``datasets.utils.normalize``, in
    float64) and deals the rows out with ``helpers_cpp.build_blending_indices``: row i goes to the source
    with the largest ``weight * max(i, 1) - count``, the lower index on ties. This repeats it in the same
    float64 arithmetic, so the counts are the run's, not ``weight * size`` rounded (which can differ by
    one). Megatron-Bridge's blend of packed folders selects its rows the same way. It costs about 0.2 s
    per million rows of a blend of two sources (a Python loop).

    Args:
        weights: one positive weight per source (normalised here, as Megatron-Core does).
        size: the rows of the blend (Megatron-Bridge's ``max_train_samples``).

    Returns:
        int64 ``[sources]``: the rows from each source, summing to ``size``.

    Raises:
        TightpackError: a weight is not a positive number, or ``size`` is negative.

    >>> blend_counts([0.402297, 0.597703], 32_000).tolist()  # round(0.402297 * 32,000) is 12,873
    [12874, 19126]
    >>> blend_counts([1, 1, 1], 4).tolist()  # ties go to the first source
    [2, 1, 1]
    """
    if len(weights) == 0:
        raise TightpackError("a blend needs one weight per source, got none", parameters=("weights",))
    check_weights(list(weights), [f"source {index}" for index in range(len(weights))])
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
        raise TightpackError(f"size must be a non-negative integer, got {size!r}", parameters=("size",))
    array = np.asarray(weights, dtype=np.float64)
    shares = (array / np.sum(array)).tolist()  # Megatron-Core's normalize(), float64
    counts = [0] * len(shares)
    others = range(1, len(shares))
    first = shares[0]
    for row in range(int(size)):
        at = float(row) if row > 1 else 1.0
        chosen, largest = 0, first * at - counts[0]
        for source in others:
            error = shares[source] * at - counts[source]
            if error > largest:
                chosen, largest = source, error
        counts[chosen] += 1
    return np.asarray(counts, dtype=np.int64)


def written_weights(weights: Sequence[float]) -> list[float]:
    """The weights as ``tightpack blend`` writes them into the configuration: 6 significant digits.

    >>> written_weights([0.40229267, 0.59770733])
    [0.402293, 0.597707]
    """
    return [float(f"{weight:.6g}") for weight in weights]


@dataclass(frozen=True)
class BlendPlan:
    """The weights of a blend and what a run of ``samples`` rows draws with them.

    Attributes:
        names: the folders, as given.
        by: what the targets count (`MIX_BY`).
        targets: float64 ``[folders]``: the target shares (normalised).
        weights: float64 ``[folders]``: the pack weights, summing to 1.
        samples: N, the rows (packs) of the blend: Megatron-Bridge's ``max_train_samples``, by default
            the folders' packs summed.
        drawn: int64 ``[folders]``: the packs the blend takes from each folder: Megatron-Core's
            selection (`blend_counts`) with the weights as written into the configuration
            (`written_weights`), about ``weights * N``.
        passes: float64 ``[folders]``: ``drawn`` over the folder's packs: above 1 the folder is read
            more than once (each pass in a new order), below 1 only that fraction of it is read.
        shares: the expected share of every folder under these weights, by each measure of `MIX_BY`.
        naive: the shares the targets would give if written as the weights, by each measure.
    """

    names: tuple[str, ...]
    by: str
    targets: np.ndarray
    weights: np.ndarray
    samples: int
    drawn: np.ndarray
    passes: np.ndarray
    shares: dict[str, np.ndarray]
    naive: dict[str, np.ndarray]

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values, one entry per folder."""
        folders = []
        for index, name in enumerate(self.names):
            folders.append(
                {
                    "folder": name,
                    "target": float(self.targets[index]),
                    "weight": float(self.weights[index]),
                    "drawn": int(self.drawn[index]),
                    "passes": float(self.passes[index]),
                    "shares": {by: float(shares[index]) for by, shares in self.shares.items()},
                    "naive_shares": {by: float(shares[index]) for by, shares in self.naive.items()},
                }
            )
        return {"mix_by": self.by, "samples": self.samples, "folders": folders}


def plan_blend(
    targets: Sequence[float],
    folders: Sequence[FolderStats],
    *,
    by: str = "tokens",
    samples: int | None = None,
    names: Sequence[str] | None = None,
) -> BlendPlan:
    """`blend_weights` for ``targets``, with the shares they give by every measure, and the packs a
    blend of ``samples`` rows draws from each folder.

    Args:
        targets: one positive target share per folder (normalised).
        folders: what each folder holds.
        by: what the targets count (`MIX_BY`).
        samples: the rows the blend holds: global batch size x training steps when Megatron-Bridge's
            ``max_train_samples`` is set to it; None: the folders' packs summed, its default.
        names: the folders' names for messages and the plan (default ``folder 0``, ...).

    Raises:
        TightpackError: as `blend_weights`, or ``samples`` is not positive.

    >>> short = FolderStats(packs=10, samples=120, tokens=38_000, supervised_tokens=9_500)
    >>> long = FolderStats(packs=40, samples=40, tokens=150_000, supervised_tokens=75_000)
    >>> plan = plan_blend([1, 1], [short, long], by="tokens", samples=100)
    >>> plan.weights.round(4).tolist(), plan.drawn.tolist(), plan.passes.round(2).tolist()
    ([0.4967, 0.5033], [50, 50], [5.0, 1.25])
    """
    names = _names(names, len(folders))
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0):
        raise TightpackError(f"samples must be a positive integer, got {samples!r}", parameters=("samples",))
    weights = blend_weights(targets, folders, by=by, names=names)
    size = samples if samples is not None else sum(folder.packs for folder in folders)
    drawn = blend_counts(written_weights(weights), size)
    measures = [measure for measure in MIX_BY if all(folder.total(measure) > 0 for folder in folders)]
    return BlendPlan(
        names=tuple(names),
        by=by,
        targets=check_weights(list(targets), names),
        weights=weights,
        samples=size,
        drawn=drawn,
        passes=drawn / np.array([folder.packs for folder in folders], dtype=np.float64),
        shares={measure: blend_shares(weights, folders, by=measure, names=names) for measure in measures},
        naive={measure: blend_shares(targets, folders, by=measure, names=names) for measure in measures},
    )
