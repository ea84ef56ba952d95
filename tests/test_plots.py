"""`tightpack.reports.plots`: the PNG and HTML files are valid, and every plotted number is the computation's.

The figures are read back artist by artist (line data, bar heights) and compared with the fields of
`PackSizeRow` and the `PackArrays` the summary is made of; only the file tests render (about a second
a figure), the data tests never draw.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from tightpack.core.cost_model import CostModel
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.prepare.formats import FormatConfig
from tightpack.reports import plots
from tightpack.reports.mixture import mixture_figure
from tightpack.reports.pack_sizes import compare_pack_sizes
from tightpack.reports.summary import (
    pack_costs,
    read_pack_arrays,
    summarize_pack_arrays,
    summarize_packed,
)

from .conftest import random_words, write_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MISSING = "error: plots need matplotlib: pip install 'tightpack[plots]'"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """120 prompt/completion rows, completions of 2 to 3,000 words (up to ~5,000 tokens): some are
    truncated at 2,048 and at 4,096."""
    rng = np.random.default_rng(5)
    rows = [
        {"input": random_words(rng, 8), "output": random_words(rng, int(words))}
        for words in rng.permutation(np.geomspace(2, 3000, 120).astype(int))
    ]
    return write_jsonl(tmp_path_factory.mktemp("plots") / "train.jsonl", rows)


@pytest.fixture(scope="module")
def packed(source) -> Path:
    """Packed at 4,096 with a cap of 3,000: the histogram marks both."""
    out = source.parent / "packed"
    pack_dataset([source], out, PackConfig(packed_sequence_size=4096, max_seq_length=3000))
    return out


@pytest.fixture(scope="module")
def comparison(source):
    """At DP 4, 4,096 (GBS 2) cannot run: its overheads and epoch time are None."""
    return compare_pack_sizes([source], [2048, 4096], token_slots=8192, data_parallel_size=4)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``tightpack ARGS`` in this process: the exit status of `tightpack.cli.main`, stdout, stderr."""
    from tightpack.cli import main

    capsys.readouterr()
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def axes_by_label(figure) -> dict:
    return {axes.get_label(): axes for axes in figure.axes}


def lines_by_label(axes) -> dict:
    return {line.get_label(): line for line in axes.lines}


def vertical_lines(axes) -> dict[float, object]:
    """The axvline of each marked length, by its x."""
    return {float(line.get_xdata()[0]): line for line in axes.lines if len(set(line.get_xdata())) == 1}


def assert_histogram(axes, lengths: np.ndarray) -> None:
    """The bars are ``np.histogram(lengths)`` over the `_log_bins` edges, which the bars span."""
    edges = plots._log_bins(lengths)
    bars = axes.patches
    np.testing.assert_array_equal([bar.get_x() for bar in bars], edges[:-1])
    np.testing.assert_array_equal(bars[-1].get_x() + bars[-1].get_width(), edges[-1])
    np.testing.assert_array_equal([bar.get_height() for bar in bars], np.histogram(lengths, edges)[0])
    assert (axes.get_xscale(), axes.get_yscale()) == ("log", "log")


def assert_png(data: bytes, size: tuple[int, int]) -> None:
    """PNG signature, and decodes to ``size`` (width, height) pixels."""
    import io

    from matplotlib.image import imread

    assert data.startswith(PNG_SIGNATURE)
    image = imread(io.BytesIO(data), format="png")
    assert image.shape[:2] == (size[1], size[0])


class Page(HTMLParser):
    """Every start tag with its attributes, the tables' cells row by row, the tables' captions, and
    the paragraphs."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.rows: list[list[str]] = []
        self.paragraphs: list[str] = []
        self.captions: list[str] = []
        self.title = ""
        self._text: list[str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "tr":
            self.rows.append([])
        if tag in ("th", "td", "p", "title", "caption"):
            self._text = []

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self._text is not None:
            self.rows[-1].append("".join(self._text))
        elif tag == "p" and self._text is not None:
            self.paragraphs.append("".join(self._text))
        elif tag == "title" and self._text is not None:
            self.title = "".join(self._text)
        elif tag == "caption" and self._text is not None:
            self.captions.append("".join(self._text))
        if tag in ("th", "td", "p", "title", "caption"):
            self._text = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def assert_self_contained(page: Page) -> list[bytes]:
    """No script, nothing fetched; returns each image, decoded from its data: URI."""
    images = []
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed"), tag
        assert not any(name.startswith("on") for name in attrs), attrs
        for name in ("src", "href", "srcset", "action"):
            value = (attrs.get(name) or "").strip().lower()
            # a base64 payload may spell "http" by chance: only the URL's scheme says what is fetched
            assert not value or value.startswith("data:"), value[:80]
        if tag == "img":
            prefix = "data:image/png;base64,"
            assert attrs["src"].startswith(prefix)
            images.append(base64.b64decode(attrs["src"][len(prefix) :], validate=True))
    return images


# --- the arrays the summary and the plots share ----------------------------------------------------------


def test_pack_arrays_are_the_summary(packed):
    arrays = read_pack_arrays(packed)
    pack_of_sequence = np.repeat(np.arange(len(arrays.runtime)), arrays.sequences)
    lengths = arrays.sequence_lengths
    assert lengths.dtype == np.int64 and len(lengths) == arrays.sequences.sum()
    np.testing.assert_array_equal(np.bincount(pack_of_sequence, lengths), arrays.runtime)
    np.testing.assert_array_equal(np.bincount(pack_of_sequence, lengths.astype(float) ** 2), arrays.squared)
    assert lengths.max() <= 3000  # the cap
    model = CostModel.named("llama-8b")
    # what the pipeline recorded of its plan before writing, against what is read back from the files
    summary, manifest = (
        summarize_packed(packed, cost_model=model),
        json.loads((packed / "manifest.json").read_text()),
    )
    stats, counts = manifest["stats"], manifest["counts"]
    for name in ("packs", "efficiency", "packing_factor", "max_samples_per_pack", "min_packed_length"):
        assert summary[name] == stats[name], name
    assert (summary["sequences"], summary["runtime_tokens"]) == (counts["packed"], counts["tokens_packed"])
    assert summary["supervised_tokens"] == counts["supervised_packed"]
    # the summed formula is CostModel's per-sequence one, pack by pack
    offsets = np.concatenate(([0], np.cumsum(arrays.sequences)))
    np.testing.assert_allclose(
        pack_costs(arrays, model), model.pack_costs((np.arange(len(lengths)), offsets), lengths), rtol=1e-12
    )


def test_summary_of_a_small_folder_counted_by_hand(tmp_path):
    """Four token rows of 16, 16, 9 and 7 stored tokens (runtime 15, 15, 8, 6) at pack size 16: each 15
    fills a pack alone and 8 + 6 share the third. The 8 is supervised on its last 5 labels only."""
    eos = 50256
    rows = [
        {"input_ids": [*range(1, 16), eos]},
        {"input_ids": [*range(1, 9), eos], "loss_mask": [0] * 4 + [1] * 5},
        {"input_ids": [*range(1, 16), eos]},
        {"input_ids": [*range(1, 7), eos]},
    ]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "packed"
    pack_dataset([source], out, PackConfig(packed_sequence_size=16, format=FormatConfig(format="tokens")))

    arrays = read_pack_arrays(out)
    by_pack = sorted(
        zip(
            arrays.runtime.tolist(),
            arrays.sequences.tolist(),
            arrays.supervised.tolist(),
            arrays.squared.tolist(),
            strict=True,
        )
    )
    assert by_pack == [(14, 2, 11, 100.0), (15, 1, 15, 225.0), (15, 1, 15, 225.0)]
    assert sorted(arrays.sequence_lengths.tolist()) == [6, 8, 15, 15]

    squares = CostModel(linear=1.0, quadratic=1.0, unit="tokens")  # packs cost 240, 240, 14 + 100
    summary = summarize_packed(out, cost_model=squares)
    assert {key: summary[key] for key in summary if key not in ("path", "cost", "manifest")} == {
        "files": 1,
        "packs": 3,
        "sequences": 4,
        "runtime_tokens": 44,
        "supervised_tokens": 41,
        "max_samples_per_pack": 2,
        "min_packed_length": 14,
        "max_packed_length": 15,
        "mean_packed_length": pytest.approx(44 / 3, rel=1e-15),
        "packing_factor": pytest.approx(4 / 3, rel=1e-15),
        "pack_size": 16,
        "efficiency": pytest.approx(44 / 48, rel=1e-15),
        "over_pack_size": 0,
    }
    mean = (240 + 240 + 114) / 3  # 198; deviations 42, 42, -84
    assert summary["cost"]["mean"] == pytest.approx(mean, rel=1e-15)
    assert summary["cost"]["max_over_mean"] == pytest.approx(240 / mean, rel=1e-15)
    assert summary["cost"]["cv"] == pytest.approx(((42**2 * 2 + 84**2) / 3) ** 0.5 / mean, rel=1e-12)
    assert summarize_packed(out, pack_size=32)["efficiency"] == pytest.approx(44 / 96, rel=1e-15)


# --- the figures' data ------------------------------------------------------------------------------------


def test_plan_figure_plots_the_rows(comparison):
    figure = plots.plan_figure(comparison)
    axes = axes_by_label(figure)
    rows = comparison.rows
    sizes = [row.pack_size for row in rows]
    assert rows[1].overhead_balanced is None and rows[0].overhead_balanced is not None

    def field(name, scale=1.0):
        return [np.nan if getattr(row, name) is None else getattr(row, name) * scale for row in rows]

    expected = {
        "lost": {"supervised tokens lost (%)": field("supervised_lost_share", 100)},
        "truncated": {"samples truncated": field("truncated")},
        "fill": {"fill (%)": field("fill", 100)},
        "cost": {
            "attention cost": field("attention_cost_relative"),
            "step cost": field("step_cost_relative"),
            "epoch time (balanced)": field("epoch_time_relative"),
        },
        "overhead": {
            "in order": field("overhead_in_order", 100),
            "balanced": field("overhead_balanced", 100),
        },
    }
    for label, curves in expected.items():
        lines = lines_by_label(axes[label])
        for name, values in curves.items():
            np.testing.assert_array_equal(lines[name].get_xdata(), sizes)
            np.testing.assert_array_equal(lines[name].get_ydata(), values)  # NaN (a gap) where None
        assert axes[label].get_xscale() == "log"
        assert list(axes[label].get_xticks()) == sizes
    assert [row.truncated for row in rows] != [0, 0]  # the data truncates: the panel is not all zeros

    histogram = axes["sample lengths"]
    assert_histogram(histogram, comparison.sample_lengths)
    marks = vertical_lines(histogram)
    assert sorted(marks) == sizes
    assert comparison.recommended == 2048  # the only size that runs at DP 4
    widths = {size: line.get_linewidth() for size, line in marks.items()}
    assert widths[2048] > widths[4096]


def test_inspect_figure_plots_the_arrays(packed):
    arrays = read_pack_arrays(packed)
    model = CostModel.named("llama-1b")
    figure = plots.inspect_figure(arrays, pack_size=4096, cap=3000, cost_model=model)
    axes = axes_by_label(figure)
    packs = np.arange(len(arrays.runtime))
    summary = summarize_pack_arrays(arrays, cost_model=model)

    fill = lines_by_label(axes["fill"])
    np.testing.assert_array_equal(fill["fill"].get_xdata(), packs)
    np.testing.assert_array_equal(fill["fill"].get_ydata(), arrays.runtime / 4096)
    (mean,) = [line for name, line in fill.items() if name.startswith("mean")]
    assert mean.get_ydata()[0] == pytest.approx(summary["efficiency"])
    np.testing.assert_array_equal(
        lines_by_label(axes["sequences"])["sequences"].get_ydata(), arrays.sequences
    )
    cost = lines_by_label(axes["cost"])
    np.testing.assert_array_equal(cost["cost"].get_ydata(), pack_costs(arrays, model))
    (mean,) = [line for name, line in cost.items() if name.startswith("mean")]
    assert mean.get_ydata()[0] == pytest.approx(summary["cost"]["mean"])
    assert f"{summary['cost']['max_over_mean']:.3f}" in mean.get_label()

    assert_histogram(axes["sequence lengths"], arrays.sequence_lengths)
    assert sorted(vertical_lines(axes["sequence lengths"])) == [3000, 4096]

    # a long output path: the title in lines that fit the image
    arrays = dataclasses.replace(arrays, path=LONG_PATHS[1])
    extent, inside = drawn_title(plots.inspect_figure(arrays, pack_size=4096))
    assert inside.x0 <= extent.x0 and extent.x1 <= inside.x1, (extent, inside)

    # without a cost model: the attention work, sum of squared lengths
    squares = axes_by_label(plots.inspect_figure(arrays, pack_size=4096))["cost"]
    line = lines_by_label(squares)["sum of squared sequence lengths"]
    np.testing.assert_array_equal(line.get_ydata(), arrays.squared)


def mixture_section(window_shares: list[list[float]], window: int = 8) -> dict:
    """A manifest's ``mixture`` section with what `mixture_figure` reads: two sources, 60/40 by tokens,
    the worst global batch of ``window`` packs the second, the last (partial when the packs are not a
    multiple of the batch) 40 points off."""
    return {
        "mix_by": "tokens",
        "sources": [{"name": "a.jsonl", "target_share": 0.6}, {"name": "b.jsonl", "target_share": 0.4}],
        "windows": {
            "window_packs": window,
            "worst_points": 12.5,
            "worst_source": 0,
            "worst_first_pack": window,
            "last_batch_points": 40.0,
        },
        "window_shares": window_shares,
    }


def spans_by_label(axes) -> dict[str, tuple[float, float]]:
    """Each axvspan's (first pack, end) by its label."""
    return {patch.get_label(): (patch.get_x(), patch.get_x() + patch.get_width()) for patch in axes.patches}


def test_mixture_figure_draws_a_partial_last_batch_as_partial():
    """19 packs in global batches of 8: two full batches (packs 0-7, 8-15) and one of 3 packs (16-18).
    Each full batch is a step across its 8 packs; the partial one is a dotted line across its 3 packs
    over a grey band whose label gives its size and deviation, not a step like the others (nor a spike
    at pack 16)."""
    shares = [[0.6, 0.4], [0.5, 0.5], [1.0, 0.0]]
    figure = mixture_figure(mixture_section(shares), packs=19, path="out")
    axes = axes_by_label(figure)["mixture"]
    lines = lines_by_label(axes)
    for s, name in enumerate(["a.jsonl", "b.jsonl"]):
        full = lines[name]
        np.testing.assert_array_equal(full.get_xdata(), [0, 8, 16])  # the second step ends at pack 16
        np.testing.assert_array_equal(full.get_ydata(), [shares[0][s], shares[1][s], shares[1][s]])
        assert full.get_drawstyle() == "steps-post"
        partial = lines[f"{name}, partial last batch"]
        np.testing.assert_array_equal(partial.get_xdata(), [16, 19])
        np.testing.assert_array_equal(partial.get_ydata(), [shares[2][s]] * 2)
        assert partial.get_linestyle() == ":"
    spans = spans_by_label(axes)
    assert spans["partial last batch: 3 of 8 packs (dotted), 40.00 points off"] == (16, 19)
    assert spans["worst full batch: packs 8-15"] == (8, 16)
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == [
        "a.jsonl",
        "b.jsonl",
        "target share",
        "partial last batch: 3 of 8 packs (dotted), 40.00 points off",
        "worst full batch: packs 8-15",
    ]
    assert "a step per global batch of 8 packs" in axes.get_xlabel()
    assert figure.get_suptitle() == (
        "out: mixture by tokens: worst global batch of 8 packs: 12.50 points off (batch 1, packs 8-15)"
    )


def drawn_title(figure):
    """The figure's title drawn by Agg: its extent in pixels, and the figure's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return figure._suptitle.get_window_extent(canvas.get_renderer()), figure.bbox


LONG_PATHS = [
    "/data/runs/" + "/".join(["a-rather-long-folder-name"] * 6) + "/mixed",
    "/TMP/MEGATRON_WORKSPACE_MIXTURE_EXPERIMENTS_MAY/WIKIPEDIA_MATH_WEBMATH_CHAT_MIX_WINDOW_SIXTEEN"
    "_MAX_REPETITIONS_FOUR/MIXED_OUTPUT_MWM_SUPERVISED_TOKENS",
    "W" * 400,
]


@pytest.mark.parametrize("path", LONG_PATHS, ids=["words", "capitals", "one-wide-word"])
def test_mixture_figure_title_of_a_long_path_stays_inside_the_figure(path):
    """A deep output folder (capitals are wider than the average letter) and a partial last batch
    make a title wider than the figure: it is broken into lines, every character of it drawn inside
    the image, not clipped at the edges."""
    section = mixture_section([[0.6, 0.4], [0.5, 0.5], [1.0, 0.0]])
    section["windows"]["last_batch_packs"] = 3
    figure = mixture_figure(section, packs=19, path=path)
    extent, inside = drawn_title(figure)
    assert inside.x0 <= extent.x0 and extent.x1 <= inside.x1, (extent, inside)
    title = figure.get_suptitle()
    assert title.replace("\n", "").startswith(path) and len(title.splitlines()) > 1
    assert "last batch (3 of 8 packs) 40.00 points off" in title.replace("\n", " ")


def test_mixture_figure_of_whole_batches_has_no_partial_one():
    shares = [[0.6, 0.4], [0.55, 0.45]]
    axes = axes_by_label(mixture_figure(mixture_section(shares), packs=16))["mixture"]
    lines = lines_by_label(axes)
    assert sorted(name for name in lines if not name.startswith("_")) == ["a.jsonl", "b.jsonl"]
    np.testing.assert_array_equal(lines["a.jsonl"].get_xdata(), [0, 8, 16])
    np.testing.assert_array_equal(lines["a.jsonl"].get_ydata(), [0.6, 0.55, 0.55])
    assert list(spans_by_label(axes)) == ["worst full batch: packs 8-15"]


def test_mixture_figure_leaves_a_batch_without_the_measure_blank():
    """A batch with no supervised tokens has no shares: a gap, not every source at 0."""
    axes = axes_by_label(mixture_figure(mixture_section([[0.0, 0.0], [0.5, 0.5]]), packs=16))["mixture"]
    np.testing.assert_array_equal(lines_by_label(axes)["b.jsonl"].get_ydata(), [np.nan, 0.5, 0.5])


def test_mixture_figure_refuses_packs_its_windows_do_not_cover():
    with pytest.raises(
        TightpackError,
        match=r"^the manifest's mixture has 3 global batches of 8 packs but the dataset has 30 packs, which "
        r"make 4: "
        r"its files are not the ones it was packed into; run tightpack verify on it",
    ):
        mixture_figure(mixture_section([[0.6, 0.4]] * 3), packs=30)


def test_inspect_figure_needs_a_pack_size(packed):
    with pytest.raises(TightpackError, match=r"pack_size must be a positive integer, got 0"):
        plots.inspect_figure(read_pack_arrays(packed), pack_size=0)


# --- the files --------------------------------------------------------------------------------------------


def test_html_report(comparison, tmp_path):
    path = tmp_path / "report.html"
    title = 'plan <&> "quoted"'
    plots.write_html_report(
        path, title, comparison.table(), [plots.plan_figure(comparison)], notes=[comparison.reason]
    )
    text = path.read_text(encoding="utf-8")
    assert len(text) < 400_000
    page = Page(text)
    assert page.title == title
    assert page.rows == comparison.table()
    assert page.paragraphs == [comparison.reason]
    (image,) = assert_self_contained(page)
    assert_png(image, (11 * plots.DPI, 9 * plots.DPI))


def test_html_report_with_more_tables(tmp_path):
    """Each further table after the first, under its caption, escaped, its first row the header."""
    path = tmp_path / "report.html"
    first = [["packed dataset", "out"], ["packs", "3"]]
    mixture = [("source", "a <1>.jsonl", "b.jsonl"), ("tokens", "1,000", "2,000")]
    plots.write_html_report(path, "report", first, [], tables=[("mixture & more", mixture)])
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.rows == [*first, *(list(row) for row in mixture)]
    assert page.captions == ["mixture & more"]
    assert "a &lt;1&gt;.jsonl" in text and "<caption>mixture &amp; more</caption>" in text


def test_cli_inspect_plot_and_html(packed, tmp_path, capsys):
    code, out, err = run_cli(
        capsys,
        "inspect",
        packed,
        "--cost-model",
        "llama-8b",
        "--plot",
        tmp_path / "packs.png",
        "--html",
        tmp_path / "packs.html",
    )
    assert code == 0, err
    assert_png((tmp_path / "packs.png").read_bytes(), (11 * plots.DPI, 8 * plots.DPI))
    page = Page((tmp_path / "packs.html").read_text(encoding="utf-8"))
    (image,) = assert_self_contained(page)
    assert image.startswith(PNG_SIGNATURE)
    cells = dict(page.rows)
    summary = summarize_packed(packed, cost_model="llama-8b")
    assert cells["packed dataset"] == str(packed)
    assert cells["packs"] == f"{summary['packs']:,}"
    assert cells["pack cost, max / mean"] == f"{summary['cost']['max_over_mean']:.3f}"
    assert f"{summary['packs']:,}" in out  # the table is printed too


def test_cli_inspect_without_a_manifest_needs_the_pack_size(packed, tmp_path, capsys):
    folder = tmp_path / "mb"
    folder.mkdir()
    for file in packed.glob("*.parquet"):
        shutil.copy(file, folder)
    code, out, err = run_cli(capsys, "inspect", folder, "--plot", tmp_path / "packs.png")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"error: --plot and --html need the pack size and {folder} has no manifest to give it; pass it, "
        "e.g. --pack-size 4096"
    ]
    assert not (tmp_path / "packs.png").exists()
    arrays = read_pack_arrays(folder)
    figure = plots.inspect_figure(arrays, pack_size=4096)  # no cap: only the pack size is marked
    assert sorted(vertical_lines(axes_by_label(figure)["sequence lengths"])) == [4096]


def test_cli_plan_plot_and_html(source, comparison, tmp_path, capsys):
    code, _, err = run_cli(
        capsys,
        "plan",
        source,
        "--pack-sizes",
        "2048,4096",
        "--token-slots",
        "8192",
        "--plot",
        tmp_path / "plan.png",
        "--html",
        tmp_path / "plan.html",
    )
    assert code == 0, err
    assert_png((tmp_path / "plan.png").read_bytes(), (11 * plots.DPI, 9 * plots.DPI))
    html = (tmp_path / "plan.html").read_text(encoding="utf-8")
    page = Page(html)
    assert page.title == "tightpack plan"
    assert page.rows[0] == ["pack size", "2,048", "4,096"]
    assert [cells[0] for cells in page.rows] == [cells[0] for cells in comparison.table()]
    (image,) = assert_self_contained(page)
    assert image.startswith(PNG_SIGNATURE)
    assert len(html) < 1_000_000


def test_missing_matplotlib_is_one_line(packed, comparison, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code, out, err = run_cli(capsys, "inspect", packed, "--plot", tmp_path / "packs.png")
    assert (code, out, err.splitlines()) == (2, "", [MISSING])
    assert not (tmp_path / "packs.png").exists()
    with pytest.raises(TightpackError, match=r"^plots need matplotlib: pip install 'tightpack\[plots\]'$"):
        plots.plan_figure(comparison)
