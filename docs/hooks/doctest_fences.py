"""A griffe extension for the API reference: a doctest in a docstring is shown as a Python console block.

The docstrings hold their examples as doctests (``>>>`` lines and their output, run by ``pytest
--doctest-modules``) in the running text, not in an ``Examples:`` section. In Markdown a ``>>>`` line is
a nested block quote and an output like ``[[0, 4], [2]]`` a reference link, so each run of doctest lines
(up to the next blank line) is fenced as ``pycon`` before the docstring is parsed. The source is unchanged.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with every run of doctest lines (a ``>>>`` line up to a blank line) in a ``pycon`` fence.

    >>> fence_doctests("Text.\\n\\n>>> 1 + 1\\n2\\n\\nMore.").split("\\n")
    ['Text.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    out: list[str] = []
    indent: str | None = None  # the indentation of the open fence, None outside one
    for line in text.split("\n"):
        stripped = line.lstrip()
        if indent is not None and not stripped:
            out.append(f"{indent}```")
            indent = None
        elif indent is None and (stripped == ">>>" or stripped.startswith(">>> ")):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
        out.append(line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctests of every docstring griffe reads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
