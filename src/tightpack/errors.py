"""The one exception type for errors a user can act on (bad input, impossible settings).

The command line prints these as one line and exits with status 2; anything else is a bug and keeps
its traceback. Messages say what was wrong, where, and how to fix it.
"""

from __future__ import annotations

__all__ = ["TightpackError"]


class TightpackError(ValueError):
    """A user error: the message names the problem, its location and the fix."""
