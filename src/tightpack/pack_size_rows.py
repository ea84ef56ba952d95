"""Deprecated: moved to `tightpack.reports.pack_size_rows`; importing it warns. Kept for old imports."""

from tightpack._moved import forward

__getattr__, __all__ = forward(__name__, "tightpack.reports.pack_size_rows")
