"""tightpack's logger: one line per event worth a user's attention (a probe's verdict, say).

Messages go to the ``tightpack`` logger. When the program has configured no logging at all, a handler
writing ``tightpack: <message>`` to stderr at INFO is attached once, so the lines are seen by default;
configure ``logging`` (or the ``tightpack`` logger) to route or silence them.
"""

from __future__ import annotations

import logging

_NAME = "tightpack"


def logger() -> logging.Logger:
    """The ``tightpack`` logger, with a stderr handler when nothing else would print its lines."""
    log = logging.getLogger(_NAME)
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"{_NAME}: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    return log
