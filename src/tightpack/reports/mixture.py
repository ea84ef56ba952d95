"""The mixture of a packed folder as ``tightpack inspect`` shows it: a table with a column per source
(printed, and in the ``--html`` report), and a plot of every source's share global batch by global
batch against its target.

Both read the manifest's ``mixture`` section (`tightpack.offline.mixture.plan_mixture_run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tightpack.core.mixture import MIX_BY
from tightpack.errors import TightpackError
from tightpack.reports.plots import _HIGHLIGHT, _figure, fit_title

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STATISTICS = (
    ("target share", lambda s: f"{s['target_share']:.2%}"),
    ("achieved share", lambda s: f"{s['share']:.2%}"),
    ("worst global batch (points)", lambda s: f"{s['worst_window_points']:.2f}"),
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
    ``mix_by``), the source's worst global batch, rows read, samples packed, sequences written, repetitions
    (its measure written over the measure it holds), tokens, supervised tokens, truncated samples
    packed, samples dropped.

    >>> mixture = {"sources": [{"name": "a.jsonl", "target_share": 0.5, "share": 0.4998,
    ...     "worst_window_points": 1.25, "rows": 10, "samples_packed": 8, "sequences": 9,
    ...     "repetitions": 1.125, "tokens": 900, "supervised_tokens": 300}]}
    >>> mixture_rows(mixture)[:3]
    [('target share', '50.00%'), ('achieved share', '49.98%'), ('worst global batch (points)', '1.25')]
    """
    return [(name, *(show(source) for source in mixture["sources"])) for name, show in STATISTICS]


_NUMBERS = ("target_share", "share", "worst_window_points", "repetitions")
_COUNTS = ("samples_packed", "sequences", "tokens", "supervised_tokens")
_OPTIONAL_COUNTS = ("rows", "truncated_packed", "dropped")


def mixture_problem(mixture: Any, packs: int | None = None) -> str | None:
    """What keeps ``tightpack inspect`` from showing a manifest's ``mixture`` section (the field and its
    value), or None when every field it reads is there, of its kind, and (given the dataset's
    ``packs``) about these packs: as many global batches, the worst one among them.

    >>> mixture_problem({"mix_by": "tokens", "sources": 5})
    'mixture.sources is 5, not a list of sources'
    >>> mixture_problem({"mix_by": "bogus"})
    "mixture.mix_by is 'bogus', not one of tokens, supervised-tokens, samples"
    """

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(mixture, dict):
        return f"mixture is {mixture!r}, not a section"
    if mixture.get("mix_by") not in MIX_BY:
        return f"mixture.mix_by is {mixture.get('mix_by')!r}, not one of {', '.join(MIX_BY)}"
    sources = mixture.get("sources")
    if not isinstance(sources, list) or not sources:
        return f"mixture.sources is {sources!r}, not a list of sources"
    for s, source in enumerate(sources):
        field = f"mixture.sources[{s}]"
        if not isinstance(source, dict):
            return f"{field} is {source!r}, not a source"
        for key, fits in (
            [("name", lambda v: isinstance(v, str))]
            + [(k, number) for k in _NUMBERS]
            + [(k, count) for k in _COUNTS]
        ):
            if not fits(source.get(key)):
                return f"{field}.{key} is {source.get(key)!r}"
        for key in _OPTIONAL_COUNTS:
            if key in source and not count(source[key]):
                return f"{field}.{key} is {source[key]!r}"
    windows = mixture.get("windows")
    if not isinstance(windows, dict):
        return f"mixture.windows is {windows!r}, not a table of the global batches"
    for key, fits in (
        ("window_packs", lambda v: count(v) and v > 0),
        ("worst_points", number),
        ("worst_first_pack", count),
        ("last_batch_packs", lambda v: v is None or count(v)),
        ("last_batch_points", lambda v: v is None or number(v)),
    ):
        if not fits(windows.get(key)):
            return f"mixture.windows.{key} is {windows.get(key)!r}"
    window, first = windows["window_packs"], windows["worst_first_pack"]
    worst_source = windows.get("worst_source")
    if worst_source is not None and not (count(worst_source) and worst_source < len(sources)):
        return f"mixture.windows.worst_source is {worst_source!r}, not one of its {len(sources)} sources"
    if (windows.get("last_batch_packs") or 0) >= window:
        return f"mixture.windows.last_batch_packs is {windows['last_batch_packs']!r}, a full batch or more"
    shares = mixture.get("window_shares")
    if not isinstance(shares, list) or not all(
        isinstance(row, list) and len(row) == len(sources) and all(number(v) for v in row) for row in shares
    ):
        return f"mixture.window_shares is not a list of {len(sources)} shares per global batch"
    if packs is not None:  # the section against the packs it describes
        batches = -(-packs // window)
        if len(shares) != batches:
            return (
                f"mixture.window_shares has {len(shares):,} global batches, but the dataset's {packs:,} "
                f"packs make {batches:,} of {window:,}"
            )
        if first % window or first >= packs:
            return f"mixture.windows.worst_first_pack is {first:,}, not the first pack of one of its batches"
        if (windows.get("last_batch_packs") or 0) != packs % window:
            last = windows.get("last_batch_packs")
            return f"mixture.windows.last_batch_packs is {last!r}, not {packs % window:,}"
    return None


def source_labels(names: list[str]) -> list[str]:
    """Short column labels for the sources' names (input paths): each file's name, or as many of its
    last path parts as tell it from the others.

    >>> source_labels(["/data/a/train.jsonl", "/data/b/train.jsonl", "/data/long.jsonl"])
    ['a/train.jsonl', 'b/train.jsonl', 'long.jsonl']
    """
    parts = [str(name).split("/") for name in names]
    labels = [p[-1] for p in parts]
    for depth in range(2, max(len(p) for p in parts) + 1):
        clashing = {label for label in labels if labels.count(label) > 1}
        if not clashing:
            break
        labels = [
            "/".join(p[-depth:]) if label in clashing else label
            for p, label in zip(parts, labels, strict=True)
        ]
    return labels


def mixture_table(mixture: dict[str, Any]) -> list[tuple[str, ...]]:
    """`mixture_rows` under a header row of the sources' names: the table ``tightpack inspect`` prints
    and its ``--html`` report holds (the same rows, never computed twice).

    >>> mixture = {"sources": [{"name": "a.jsonl", "target_share": 0.5, "share": 0.4998,
    ...     "worst_window_points": 1.25, "rows": 10, "samples_packed": 8, "sequences": 9,
    ...     "repetitions": 1.125, "tokens": 900, "supervised_tokens": 300}]}
    >>> mixture_table(mixture)[:2]
    [('source', 'a.jsonl'), ('target share', '50.00%')]
    """
    names = source_labels([source["name"] for source in mixture["sources"]])
    return [("source", *names), *mixture_rows(mixture)]


def worst_batch(windows: dict[str, Any]) -> str:
    """The manifest's worst global batch in words (``mixture.windows``).

    >>> worst_batch({"window_packs": 64, "worst_points": 0.4, "worst_first_pack": 128})
    'global batch of 64 packs: 0.40 points off (batch 2, packs 128-191)'
    >>> worst_batch({"window_packs": 1, "worst_points": 12.5, "worst_first_pack": 16})
    'global batch of 1 pack: 12.50 points off (batch 16, pack 16)'
    """
    size, first = windows["window_packs"], windows["worst_first_pack"]
    where = f"pack {first:,}" if size == 1 else f"packs {first:,}-{first + size - 1:,}"
    return (
        f"global batch of {size:,} pack{'s' * (size != 1)}: {windows['worst_points']:.2f} points off "
        f"(batch {first // max(size, 1):,}, {where})"
    )


def mixture_title(mixture: dict[str, Any]) -> str:
    """What the table shows: the measure, the worst global batch with its size, and the last batch
    when it holds fewer packs (counted apart)."""
    windows = mixture["windows"]
    title = f"mixture by {mixture['mix_by']}: worst {worst_batch(windows)}"
    if windows.get("last_batch_packs"):
        title += (
            f"; last batch ({windows['last_batch_packs']:,} of {windows['window_packs']:,} packs) "
            f"{windows['last_batch_points']:.2f} points off"
        )
    return title


def window_edges(windows: int, window: int, packs: int) -> np.ndarray:
    """The first pack of each of ``windows`` global batches of ``window`` packs (consecutive, not
    overlapping), and the end of the last: int64 ``[windows + 1]``. The manifest's ``window_shares``
    has one row per batch in this order; the last batch is short (partial) when ``packs`` is not a
    multiple of ``window``.

    Raises:
        TightpackError: when ``windows`` batches of ``window`` packs do not cover ``packs`` packs (the
            folder's packs are not those its manifest counted).

    >>> window_edges(3, 8, 17).tolist()  # two full batches and one of a single pack
    [0, 8, 16, 17]
    >>> window_edges(2, 8, 16).tolist()
    [0, 8, 16]
    """
    if window < 1 or windows != -(-packs // window):
        raise TightpackError(
            f"the manifest's mixture has {windows:,} global batches of {window:,} packs but the dataset has "
            f"{packs:,} packs, which make {-(-packs // max(window, 1)):,}: its files are not the ones it was "
            "packed into; run tightpack verify on it, or pack it again"
        )
    return np.minimum(np.arange(windows + 1, dtype=np.int64) * window, packs)


def mixture_figure(mixture: dict[str, Any], *, packs: int, path: str = "") -> Figure:
    """Every source's share of each global batch, in the order a run reads them, beside its target
    (a dashed line of the same colour); the title names the worst batch, which is shaded.

    The batches are the manifest's ``window_shares``: consecutive and non-overlapping, ``window_packs``
    packs each (a step per batch, spanning its packs, `window_edges`). When ``packs`` (the packs of the
    dataset) is not a multiple of the batch, the last batch holds fewer packs and is counted apart: it
    is drawn dotted, with hollow markers, over a grey band whose legend entry gives its pack count and
    deviation. The worst full batch is shaded red. A batch with none of the measure (no supervised
    tokens) has no shares and is left blank.
    """
    from matplotlib.lines import Line2D

    sources = mixture["sources"]
    windows = mixture["windows"]
    window = windows["window_packs"]
    shares = np.asarray(mixture["window_shares"], dtype=np.float64).reshape(-1, len(sources))
    shares[shares.sum(axis=1) == 0] = np.nan  # nothing of the measure: no shares (a gap, not a 0)
    edges = window_edges(len(shares), window, packs)
    full = int(np.count_nonzero(np.diff(edges) == window))  # only the last window can be short
    figure = _figure(figsize=(11, 4))
    axes = figure.add_subplot(1, 1, 1, label="mixture")
    handles = []
    for s, source in enumerate(sources):
        color = f"C{s % 10}"
        if full:  # the last share repeated: the step spans its window to the window's end
            (line,) = axes.step(
                edges[: full + 1],
                np.append(shares[:full, s], shares[full - 1, s]),
                where="post",
                color=color,
                label=source["name"],
            )
            handles.append(line)
        if full < len(shares):
            axes.plot(
                edges[full:],
                np.repeat(shares[full, s], 2),
                color=color,
                linestyle=":",
                marker="o",
                markerfacecolor="none",
                markersize=4,
                label=f"{source['name']}, partial last batch",
            )
        axes.axhline(source["target_share"], color=color, linestyle="--", linewidth=0.8)
    handles.append(Line2D([], [], color="0.3", linestyle="--", linewidth=0.8, label="target share"))
    if full < len(shares):
        handles.append(
            axes.axvspan(
                edges[-2],
                edges[-1],
                color="0.85",
                zorder=0,
                label=(
                    f"partial last batch: {edges[-1] - edges[-2]:,} of {window:,} packs (dotted), "
                    f"{windows.get('last_batch_points', 0.0):.2f} points off"
                ),
            )
        )
    first = windows["worst_first_pack"]
    handles.append(
        axes.axvspan(
            first,
            first + window,
            color=_HIGHLIGHT,
            alpha=0.12,
            linewidth=0,
            label=f"worst full batch: packs {first:,}-{first + window - 1:,}",
        )
    )
    axes.set_xlim(-0.01 * packs, 1.01 * packs + 0.5)  # the markers at the last pack's end show whole
    axes.set_ylim(-0.02, 1.02)  # a share of 0 or 1 stays in sight
    axes.set_xlabel(f"pack (file order); a step per global batch of {window:,} packs")
    axes.set_ylabel(f"share of {mixture['mix_by']}")
    fit_title(figure, f"{path}: {mixture_title(mixture)}" if path else mixture_title(mixture))
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return figure
