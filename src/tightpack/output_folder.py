"""Deprecated: moved to `tightpack.offline.output_folder` and `tightpack.offline.output_lock`;
importing it warns. Kept for old imports."""

from tightpack._moved import forward

__getattr__, __all__ = forward(__name__, "tightpack.offline.output_folder", "tightpack.offline.output_lock")
