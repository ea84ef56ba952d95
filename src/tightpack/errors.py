"""The one exception type for errors a user can act on (bad input, impossible settings).

The command line prints these as one line and exits with status 2; anything else is a bug and keeps
its traceback. Messages say what was wrong, where, and how to fix it.
"""

from __future__ import annotations

__all__ = ["TightpackError", "check_choice"]


class TightpackError(ValueError):
    """A user error: the message names the problem, its location and the fix."""


def check_choice(option: str, value: object, choices: tuple) -> None:
    """Raise `TightpackError` unless ``value`` is one of ``choices``.

    >>> check_choice("--format", "xml", ("auto", "chat"))
    Traceback (most recent call last):
    ...
    tightpack.errors.TightpackError: --format must be one of auto, chat; got 'xml'
    """
    if value not in choices:
        raise TightpackError(f"{option} must be one of {', '.join(map(str, choices))}; got {value!r}")
