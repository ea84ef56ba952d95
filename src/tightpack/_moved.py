"""Old import paths of moved modules: the old module warns when imported, then finds each name in the
module (or modules) that now holds it.

A shim at the old path is two lines::

    from tightpack._moved import forward

    __getattr__, __all__ = forward(__name__, "tightpack.offline.pipeline")
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["forward"]


def forward(old: str, *new: str) -> tuple[Callable[[str], Any], list[str]]:
    """Warn that module ``old`` is deprecated for ``new``; return the old module's ``__getattr__``
    (names looked up in the ``new`` modules in turn) and its ``__all__`` (theirs together).

    The `DeprecationWarning` is attributed to the code that imported ``old``, so Python shows it
    there by default when that code is a script.
    """
    where = " and ".join(new)
    warnings.warn(
        f"{old} is deprecated: import from {where} instead", DeprecationWarning, stacklevel=_importer_level()
    )
    modules = [importlib.import_module(name) for name in new]

    def __getattr__(name: str) -> Any:
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {where})")

    return __getattr__, sorted({name for module in modules for name in getattr(module, "__all__", ())})


def _importer_level() -> int:
    """The ``stacklevel`` of the first frame outside this file, the shim and the import machinery
    (which `warnings.warn` does not count)."""
    frame, level = sys._getframe(1), 1  # forward
    shim = frame.f_back.f_code.co_filename if frame.f_back is not None else None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib"):
            frame = frame.f_back
            continue
        if name != __file__ and name != shim:
            return level
        frame, level = frame.f_back, level + 1
    return 1
