"""The documentation site builds with ``mkdocs build --strict``: no broken link, missing anchor or unresolved
API reference, without network."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build(site: Path) -> subprocess.CompletedProcess[str]:
    # No proxy and no reachable index: a build that needs the network fails here instead of waiting.
    # NO_MKDOCS_2_WARNING: Material's banner about its end of life (not a warning of this site).
    unreachable = "http://0.0.0.0:9"
    env = {**os.environ, "NO_COLOR": "1", "NO_MKDOCS_2_WARNING": "1"}
    env |= {"HTTP_PROXY": unreachable, "HTTPS_PROXY": unreachable, "http_proxy": unreachable}
    env |= {"https_proxy": unreachable}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    result = _build(site)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, output
    return site


def test_every_page_of_the_nav_is_built(site: Path) -> None:
    for page in ("index.html", "architecture/index.html", "reference/cli/index.html"):
        assert (site / page).is_file(), page


def test_the_cli_reference_lists_every_command_from_the_app(site: Path) -> None:
    from tightpack.cli.click_command import command

    text = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    assert len(command.commands) >= 6
    for name, sub in command.commands.items():
        assert f"tightpack {name}" in text, name
        for option in sub.params:
            for flag in option.opts:
                if flag.startswith("--"):
                    assert flag in text, (name, flag)


def test_the_api_reference_shows_the_docstrings(site: Path) -> None:
    from tightpack.runtime.hf_trainer import PackingCollator

    text = (site / "reference/hf/index.html").read_text(encoding="utf-8")
    first_line = PackingCollator.__doc__.strip().splitlines()[0]
    assert "tightpack.runtime.hf_trainer.PackingCollator" in text
    as_html = re.sub(r"``?([^`]+)``?", r"<code>\1</code>", first_line)
    assert as_html in text, as_html


def test_doctests_in_docstrings_are_shown_as_code(site: Path) -> None:
    # docs/hooks/doctest_fences.py: unfenced, a ">>>" line renders as three nested block quotes.
    text = (site / "reference/datasets/index.html").read_text(encoding="utf-8")
    assert "TokenBudgetBatchSampler" in text
    for page in (site / "reference").rglob("*.html"):
        assert "<blockquote>" not in page.read_text(encoding="utf-8"), page.relative_to(site)
    assert '<span class="gp">&gt;&gt;&gt; </span>' in text


def test_the_built_pages_need_nothing_from_the_network(site: Path) -> None:
    needed = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["'](?:https?:)?//""", re.IGNORECASE)
    for page in site.rglob("*.html"):
        found = needed.findall(page.read_text(encoding="utf-8"))
        assert not found, (page.relative_to(site), found[:3])
    for sheet in site.rglob("*.css"):
        assert not re.search(r"@import\s+url\(\s*['\"]?https?:", sheet.read_text(encoding="utf-8")), sheet
