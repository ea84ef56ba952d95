"""Deprecated: moved to `tightpack.offline.config`; importing it warns. Kept for old imports."""

from tightpack._moved import forward

__getattr__, __all__ = forward(__name__, "tightpack.offline.config")
