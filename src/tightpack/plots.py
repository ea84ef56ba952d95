"""Moved to `tightpack.reports.plots`; it works here, with a warning, for one release."""

import importlib
import warnings

_NEW = "tightpack.reports.plots"


def __getattr__(name: str):
    module = importlib.import_module(_NEW)
    if (name.startswith("__") and name != "__all__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__} is deprecated: import from {_NEW}", DeprecationWarning, stacklevel=2)
    return getattr(module, name)
