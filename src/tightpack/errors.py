"""The one exception type for errors a user can act on (bad input, impossible settings).

The command line prints these as one line and exits with status 2; anything else is a bug and keeps
its traceback. Messages say what was wrong, where, and how to fix it.

A message names settings as the Python API spells them (``max_seq_length``, ``engine='ray'``) and
lists those spellings in `TightpackError.parameters`; the command line prints the same message with
its own flags in their place (``--max-seq-length``, ``--engine ray``: `tightpack.cli.flags`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["TightpackError"]


class TightpackError(ValueError):
    """A user error: the message names the problem, its location and the fix.

    Attributes:
        parameters: the Python spellings of the settings the message names, exactly as written in
            it (``("max_seq_length", "packed_sequence_size")``), for a front end to show as its own.
    """

    def __init__(self, message: str, *, parameters: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.parameters = tuple(parameters)

    def __reduce__(self):  # a worker process's error keeps its parameters on the way back
        if type(self).__init__ is not TightpackError.__init__:  # a subclass with arguments of its own
            return super().__reduce__()
        return _rebuild, (type(self), str(self), self.parameters)


def _rebuild(kind: type[TightpackError], message: str, parameters: tuple[str, ...]) -> TightpackError:
    return kind(message, parameters=parameters)


def check_choice(parameter: str, value: object, choices: tuple) -> None:
    """Raise `TightpackError` unless ``value`` is one of ``choices``; ``parameter`` is its Python name.

    >>> check_choice("format", "xml", ("auto", "chat"))
    Traceback (most recent call last):
    ...
    tightpack.errors.TightpackError: format must be one of auto, chat; got 'xml'
    """
    if value not in choices:
        raise TightpackError(
            f"{parameter} must be one of {', '.join(map(str, choices))}; got {value!r}",
            parameters=(parameter,),
        )
