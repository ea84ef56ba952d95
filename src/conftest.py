"""Doctest collection of src/: the deprecated shims (tightpack/_moved.py) hold no doctests and warn
when imported, so they are not collected."""

from pathlib import Path

collect_ignore = [
    str(path)
    for path in sorted((Path(__file__).parent / "tightpack").glob("*.py"))
    if "from tightpack._moved import forward" in path.read_text(encoding="utf-8")
]
