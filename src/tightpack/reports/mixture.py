"""The mixture of a packed folder as ``tightpack inspect`` shows it: a row per source, and a plot of
every source's share window by window against its target.

Both read the manifest's ``mixture`` section (`tightpack.offline.mixture.plan_mixture_run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tightpack.reports.plots import _HIGHLIGHT, _figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STATISTICS = (
    ("target share", lambda s: f"{s['target_share']:.2%}"),
    ("achieved share", lambda s: f"{s['share']:.2%}"),
    ("worst window (points)", lambda s: f"{s['worst_window_points']:.2f}"),
    ("rows", lambda s: f"{s.get('rows', 0):,}"),
    ("samples packed", lambda s: f"{s['samples_packed']:,}"),
    ("sequences written", lambda s: f"{s['sequences']:,}"),
    ("repetitions", lambda s: f"{s['repetitions']:.2f}x"),
    ("tokens", lambda s: f"{s['tokens']:,}"),
    ("supervised tokens", lambda s: f"{s['supervised_tokens']:,}"),
    ("truncated (packed)", lambda s: f"{s.get('truncated_packed', 0):,}"),
    ("dropped", lambda s: f"{s.get('dropped', 0):,}"),
)
"""The rows of `mixture_rows`: a name and how to show it from a source's entry."""


def mixture_rows(mixture: dict[str, Any]) -> list[tuple[str, ...]]:
    """A row per statistic (`STATISTICS`), a column per source: target and achieved share (of
    ``mix_by``), the source's worst window, rows read, samples packed, sequences written, repetitions
    (its measure written over the measure it holds), tokens, supervised tokens, truncated samples
    packed, samples dropped.

    >>> mixture = {"sources": [{"name": "a.jsonl", "target_share": 0.5, "share": 0.4998,
    ...     "worst_window_points": 1.25, "rows": 10, "samples_packed": 8, "sequences": 9,
    ...     "repetitions": 1.125, "tokens": 900, "supervised_tokens": 300}]}
    >>> mixture_rows(mixture)[:3]
    [('target share', '50.00%'), ('achieved share', '49.98%'), ('worst window (points)', '1.25')]
    """
    return [(name, *(show(source) for source in mixture["sources"])) for name, show in STATISTICS]


def mixture_title(mixture: dict[str, Any]) -> str:
    """What the table shows: the measure, and the worst window with its size."""
    windows = mixture["windows"]
    return (
        f"mixture by {mixture['mix_by']}: worst window of {windows['window_packs']:,} packs "
        f"{windows['worst_points']:.2f} points off (packs from {windows['worst_first_pack']:,})"
    )


def mixture_figure(mixture: dict[str, Any], path: str = "") -> Figure:
    """Every source's share of each window of packs, in the order a run reads them, beside its target
    (a dashed line of the same colour); the title names the worst window."""
    shares = np.asarray(mixture["window_shares"], dtype=np.float64)
    window = mixture["windows"]["window_packs"]
    figure = _figure(figsize=(11, 4))
    axes = figure.add_subplot(1, 1, 1, label="mixture")
    first_packs = np.arange(len(shares)) * window
    for s, source in enumerate(mixture["sources"]):
        color = f"C{s % 10}"
        axes.step(
            first_packs, shares[:, s] if len(shares) else [], where="post", color=color, label=source["name"]
        )
        axes.axhline(source["target_share"], color=color, linestyle="--", linewidth=0.8)
    worst = mixture["windows"]
    axes.axvline(worst["worst_first_pack"], color=_HIGHLIGHT, linestyle=":", linewidth=0.8)
    axes.set_ylim(0, 1)
    axes.set_xlabel(f"first pack of the window ({window:,} packs each, file order)")
    axes.set_ylabel(f"share of {mixture['mix_by']}")
    axes.set_title(f"{path}: {mixture_title(mixture)}" if path else mixture_title(mixture), fontsize="medium")
    axes.legend(loc="upper right", fontsize="small")
    return figure
