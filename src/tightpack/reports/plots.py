"""Charts of ``tightpack plan`` and ``tightpack inspect`` (PNG), and a self-contained HTML report.

Draws what the computations return, never recomputes it: `plan_figure` plots the fields of
`tightpack.reports.pack_sizes.PackSizeRow` and `PackSizeComparison.sample_lengths`; `inspect_figure` plots the
`tightpack.reports.summary.PackArrays` the summary was made from, priced by
`tightpack.reports.summary.pack_costs`. The table of the HTML report is the caller's (``table()``).

matplotlib is optional (``pip install 'tightpack[plots]'``) and imported only when a figure is made.
Figures are `matplotlib.figure.Figure` objects drawn without pyplot: no global state, no display, no
backend to choose.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tightpack.errors import TightpackError

if TYPE_CHECKING:  # the annotations only: importing these costs matplotlib (and the planner)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from tightpack.core.cost_model import CostModel
    from tightpack.reports.pack_sizes import PackSizeComparison
    from tightpack.reports.summary import PackArrays

DPI = 100
"""Dots per inch of every PNG: the 11 x 9 inch plan figure is 1100 x 900 pixels, about 150 KB."""

HISTOGRAM_BINS = 48
"""Log-spaced bins of a length histogram (fewer where short lengths round to the same integer)."""

_MISSING = "plots need matplotlib: pip install 'tightpack[plots]'"
_HIGHLIGHT = "C3"


def require_matplotlib() -> None:
    """Raise `TightpackError` with the install command when matplotlib is missing (check before work)."""
    _figure()


def _figure(**kwargs) -> Figure:
    try:
        import matplotlib  # noqa: F401  (first: a cached matplotlib.figure must not hide its absence)
        from matplotlib.figure import Figure
    except ImportError:
        raise TightpackError(_MISSING) from None
    return Figure(layout="constrained", **kwargs)


def fit_title(figure: Figure, text: str, fontsize: str = "medium") -> None:
    """``text`` as ``figure``'s title, broken into lines that each fit the figure's width (measured in
    the font, not counted in characters): at spaces where they serve, inside a word (a long output
    path) where not. Constrained layout clips a wider title at both edges."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    font, measure = FontProperties(size=fontsize), TextToPath()
    width = 0.9 * figure.get_figwidth() * 72  # points, a margin for the renderer's hinting

    def fits(line: str) -> bool:
        return measure.get_text_width_height_descent(line, font, ismath=False)[0] <= width

    def longest_head(word: str) -> int:  # the most characters of `word` that fit (at least one)
        low, high = 1, len(word) - 1
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(word[:middle]) else (low, middle - 1)
        return low

    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        joined = f"{line} {word}" if line else word
        if fits(joined):
            line = joined
            continue
        if line:
            lines.append(line)
        while not fits(word):  # the longest head of the word that fits, on a line of its own
            cut = longest_head(word)
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    lines.append(line)
    figure.suptitle("\n".join(lines), fontsize=fontsize)


def plan_figure(comparison: PackSizeComparison) -> Figure:
    """The measures of ``tightpack plan`` against pack size, and the sample lengths.

    Top: histogram of ``comparison.sample_lengths`` (log-spaced bins, log axes) with a line per candidate
    pack size, the recommended one in red. Below, on a log2 axis with the sizes as ticks: supervised
    tokens lost (%) and samples truncated; fill; attention cost, step cost and epoch time relative to the
    cheapest size; straggler overhead (%) in order and balanced. A measure that is None (the size cannot
    run at this DP, or ``pack`` refuses it) leaves a gap.
    """
    figure = _figure(figsize=(11, 9))
    rows = comparison.rows
    sizes = np.array([row.pack_size for row in rows], dtype=np.float64)
    grid = figure.add_gridspec(3, 2, height_ratios=(1.2, 1, 1))
    histogram = figure.add_subplot(grid[0, :], label="sample lengths")
    _length_histogram(
        histogram,
        comparison.sample_lengths,
        [(row.pack_size, f"{row.pack_size:,}", row.pack_size == comparison.recommended) for row in rows],
    )
    histogram.set_title(f"sample lengths ({comparison.samples_in:,} samples) and the candidate pack sizes")
    histogram.set_xlabel("runtime tokens per sample")

    lost = figure.add_subplot(grid[1, 0], label="lost")
    lost.plot(sizes, _values(rows, "supervised_lost_share", 100), "o-", label="supervised tokens lost (%)")
    lost.set_ylabel("supervised tokens lost (%)")
    lost.set_ylim(bottom=0)
    truncated = lost.twinx()
    truncated.set_label("truncated")
    truncated.plot(sizes, _values(rows, "truncated"), "s--", color="C1", label="samples truncated")
    truncated.set_ylabel("samples truncated", color="C1")
    truncated.set_ylim(bottom=0)
    lost.set_title("lost to truncation")
    lost.legend(handles=[*lost.lines, *truncated.lines], loc="upper right", fontsize="small")

    fill = figure.add_subplot(grid[1, 1], label="fill")
    fill.plot(sizes, _values(rows, "fill", 100), "o-", label="fill (%)")
    fill.set_ylabel("fill (%)")
    # at least 2 points of range: fills within 0.02% of each other must not look like a V
    fills = _values(rows, "fill", 100)
    lowest = float(np.nanmin(fills)) if np.isfinite(fills).any() else 100.0  # all NaN: no size packs
    fill.set_ylim(max(0.0, min(98.0, lowest - 1.0)), 100.2)
    fill.set_title("fill: packed tokens over packs x pack size")

    cost = figure.add_subplot(grid[2, 0], label="cost")
    for name, label in (
        ("attention_cost_relative", "attention cost"),
        ("step_cost_relative", "step cost"),
        ("epoch_time_relative", "epoch time (balanced)"),
    ):
        cost.plot(sizes, _values(rows, name), "o-", label=label)
    cost.set_ylabel("relative to the cheapest size")
    cost.set_title(f"cost under {comparison.cost_model.get('name', 'the cost model')}")
    cost.legend(fontsize="small")

    overhead = figure.add_subplot(grid[2, 1], label="overhead")
    overhead.plot(sizes, _values(rows, "overhead_in_order", 100), "o-", label="in order")
    overhead.plot(sizes, _values(rows, "overhead_balanced", 100), "o-", label="balanced")
    overhead.set_ylabel("straggler overhead (%)")
    overhead.set_ylim(bottom=0)
    overhead.set_title(f"straggler overhead at DP {comparison.data_parallel_size}")
    overhead.legend(fontsize="small")

    for axes in (lost, fill, cost, overhead):
        _pack_size_axis(axes, sizes, comparison.recommended)
    figure.suptitle(
        f"tightpack plan: {comparison.token_slots:,} token slots per step"
        + ("" if comparison.recommended is None else f", recommended {comparison.recommended:,}")
    )
    return figure


def inspect_figure(
    arrays: PackArrays, *, pack_size: int, cap: int | None = None, cost_model: CostModel | None = None
) -> Figure:
    """A packed dataset pack by pack: the arrays of its summary.

    Top left: histogram of ``arrays.sequence_lengths`` (log-spaced bins, log axes) with ``pack_size``
    and ``cap`` (the longest sequence allowed, ``max_seq_length``) marked. The other panels share the
    x axis, the pack index in file order (the order ``PackedBatchSampler`` reads them in; planners leave
    their least filled packs at the end, and a pack's fill, sequences and cost line up across panels):
    fill (runtime tokens over ``pack_size``), sequences per pack, and cost per pack under ``cost_model``
    (`tightpack.reports.summary.pack_costs`), or the sum of squared sequence lengths without one.
    """
    from tightpack.core.cost_model import cost_spread
    from tightpack.reports.summary import pack_costs

    if not isinstance(pack_size, int | np.integer) or pack_size < 1:
        raise TightpackError(f"pack_size must be a positive integer, got {pack_size!r}")
    figure = _figure(figsize=(11, 8))
    packs = np.arange(len(arrays.runtime))
    histogram = figure.add_subplot(2, 2, 1, label="sequence lengths")
    marks = [(pack_size, f"pack size {pack_size:,}", True)]
    if cap is not None and cap != pack_size:
        marks.append((cap, f"cap {cap:,}", False))
    elif cap is not None:
        marks = [(pack_size, f"pack size = cap {pack_size:,}", True)]
    _length_histogram(histogram, arrays.sequence_lengths, marks)
    histogram.set_title(f"sequence lengths ({len(arrays.sequence_lengths):,} sequences)")
    histogram.set_xlabel("runtime tokens per sequence")

    fill = figure.add_subplot(2, 2, 2, label="fill")
    ratio = arrays.runtime / pack_size
    fill.plot(packs, ratio, linewidth=0.7, label="fill")
    fill.axhline(ratio.mean(), color=_HIGHLIGHT, linestyle="--", label=f"mean {ratio.mean():.2%}")
    fill.set_ylim(0, max(1.0, float(ratio.max())) * 1.02)
    fill.set_ylabel(f"runtime tokens / {pack_size:,}")
    fill.set_title("fill per pack")
    fill.legend(loc="lower left", fontsize="small")

    sequences = figure.add_subplot(2, 2, 3, sharex=fill, label="sequences")
    sequences.plot(packs, arrays.sequences, linewidth=0.7, color="C2", label="sequences")
    sequences.set_ylim(bottom=0)
    sequences.set_ylabel("sequences")
    sequences.set_title("sequences per pack")

    cost = figure.add_subplot(2, 2, 4, sharex=fill, label="cost")
    if cost_model is None:
        values, unit, what = arrays.squared, "tokens²", "sum of squared sequence lengths"
    else:
        values, unit, what = pack_costs(arrays, cost_model), cost_model.unit, "cost"
    spread = cost_spread(values)
    cost.plot(packs, values, linewidth=0.7, color="C4", label=what)
    cost.axhline(
        spread.mean, color=_HIGHLIGHT, linestyle="--", label=f"mean; max / mean {spread.max_over_mean:.3f}"
    )
    cost.set_ylim(bottom=0)
    cost.set_ylabel(unit)
    cost.set_title(f"{what} per pack")
    cost.legend(loc="lower left", fontsize="small")
    for axes in (sequences, cost):
        axes.set_xlabel("pack (file order)")
    fit_title(figure, f"{arrays.path}: {len(packs):,} packs")
    return figure


def save_png(figure: Figure, path: str | Path) -> None:
    """Write ``figure`` to ``path`` as a PNG at `DPI`."""
    Path(path).write_bytes(_png(figure))


def write_html_report(
    path: str | Path,
    title: str,
    table: Sequence[Sequence[str]],
    figures: Iterable[Figure],
    *,
    notes: Iterable[str] = (),
    tables: Iterable[tuple[str, Sequence[Sequence[str]]]] = (),
) -> None:
    """Write one self-contained HTML file: ``title``, ``table`` (its first row is the header), ``notes``
    (a paragraph each), ``tables`` (each a caption and its rows, the first row the header), then each
    figure as an inline PNG (a ``data:`` URI). No script, no link, nothing fetched; every text is
    escaped."""
    escape = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        f"<title>{escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1em}"
        "th,td{border:1px solid #bbb;padding:.2em .6em;text-align:right}"
        "caption{text-align:left;font-weight:bold;padding:.4em 0}"
        "tbody th{text-align:left}img{max-width:100%}</style>",
        "</head>",
        "<body>",
        f"<h1>{escape(title)}</h1>",
    ]
    if table:
        parts.extend(_html_table(table))
    parts.extend(f"<p>{escape(note)}</p>" for note in notes)
    for caption, rows in tables:
        if rows:
            parts.extend(_html_table(rows, caption))
    for index, figure in enumerate(figures, start=1):
        suptitle = figure.get_suptitle() or f"figure {index}"
        data = base64.b64encode(_png(figure)).decode("ascii")
        parts.append(f'<figure><img alt="{escape(suptitle)}" src="data:image/png;base64,{data}"></figure>')
    parts.extend(["</body>", "</html>", ""])
    Path(path).write_text("\n".join(parts), encoding="utf-8")


def _html_table(table: Sequence[Sequence[str]], caption: str = "") -> list[str]:
    """``table`` as HTML lines: its first row the header, each other row's first cell a row header."""
    escape = html.escape
    header, *rows = table
    parts = ["<table>"]
    if caption:
        parts.append(f"<caption>{escape(caption)}</caption>")
    parts.append(
        "<thead><tr>" + "".join(f"<th>{escape(str(cell))}</th>" for cell in header) + "</tr></thead>"
    )
    parts.append("<tbody>")
    for name, *cells in rows:
        parts.append(
            f"<tr><th>{escape(str(name))}</th>"
            + "".join(f"<td>{escape(str(cell))}</td>" for cell in cells)
            + "</tr>"
        )
    parts.append("</tbody></table>")
    return parts


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _values(rows, name: str, scale: float = 1.0) -> np.ndarray:
    """``rows``' field ``name`` times ``scale``, float64, NaN (a gap in the line) where it is None."""
    return np.array(
        [np.nan if getattr(row, name) is None else getattr(row, name) * scale for row in rows],
        dtype=np.float64,
    )


def _log_bins(lengths: np.ndarray) -> np.ndarray:
    """Integer bin edges from the shortest length (at least 1) to the longest, log-spaced.

    Lengths are integers, so short bins narrower than a token are merged (the edges are rounded, then
    made unique); zero lengths fall below the first edge and are not counted (a log axis has no 0).

    >>> edges = _log_bins(np.array([1, 1000]))
    >>> len(edges), edges[:8].tolist(), edges[-3:].tolist()
    (41, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 9.0], [750.0, 866.0, 1000.0])
    """
    low = max(int(lengths.min()), 1) if len(lengths) else 1
    high = max(int(lengths.max()) if len(lengths) else 1, low + 1)
    return np.unique(np.round(np.geomspace(low, high, HISTOGRAM_BINS + 1)))


def _length_histogram(axes: Axes, lengths: np.ndarray, marks: list[tuple[int, str, bool]]) -> None:
    """Histogram of ``lengths`` on log axes with a vertical line per ``(length, label, highlighted)``."""
    from matplotlib.ticker import LogFormatter

    axes.hist(lengths, bins=_log_bins(lengths), color="0.6", label="count")
    axes.set_xscale("log")
    axes.set_yscale("log")  # the rare long samples, the ones a pack size truncates, stay visible
    axes.set_ylim(bottom=0.7)  # every bin of 1 and more shows (autoscale cuts at the lowest bar's top)
    axes.yaxis.set_major_formatter(LogFormatter())  # plain numbers, some minor ticks labeled too
    axes.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    axes.set_ylabel("count")
    for length, label, highlighted in marks:
        axes.axvline(
            length,
            color=_HIGHLIGHT if highlighted else "C0",
            linewidth=2 if highlighted else 1,
            linestyle="-" if highlighted else "--",
            label=label,
        )
    lengths_shown = [length for length, _, _ in marks]
    if len(lengths):
        lengths_shown += [max(int(lengths.min()), 1), int(lengths.max())]
    axes.set_xlim(min(lengths_shown) / 1.2, max(lengths_shown) * 1.2)
    axes.legend(loc="upper right", fontsize="small", ncols=min(len(marks), 6))


def _pack_size_axis(axes: Axes, sizes: np.ndarray, recommended: int | None) -> None:
    """A log2 x axis with the candidate sizes as its ticks, and the recommended size shaded."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(FixedLocator(sizes))
    axes.xaxis.set_major_formatter(FixedFormatter([f"{int(size):,}" for size in sizes]))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlabel("pack size")
    if len(sizes) == 1:
        axes.set_xlim(sizes[0] / 1.5, sizes[0] * 1.5)
    else:
        axes.set_xlim(sizes[0] / 1.2, sizes[-1] * 1.2)
    if recommended is not None:
        axes.axvspan(recommended / 1.05, recommended * 1.05, color=_HIGHLIGHT, alpha=0.12, linewidth=0)
    axes.grid(alpha=0.3)
