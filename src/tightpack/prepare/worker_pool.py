"""Work on chunks in K worker processes, results in input order (`map_in_processes`).

Shared by the tokenizing of SFT rows (`tightpack.prepare.tokenize`) and of preference rows
(`tightpack.prepare.preference_rows`): at most ``2 * K`` chunks are in flight, so memory does not grow
with the input, and results come back in the order of the chunks, so the output does not depend on K.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_in_processes(
    function: Callable[[Item], Result],
    items: Iterable[Item],
    workers: int,
    *,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> Iterator[Result]:
    """``function(item)`` for every item, computed in ``workers`` processes, yielded in input order.

    ``function`` must be importable (a module-level function); ``initializer(*initargs)`` sets up each
    process. Closing the iterator early stops the workers.
    """
    # Fork on Linux: workers start at once and inherit what the parent loaded (a tokenizer), as
    # PyTorch's DataLoader workers do; elsewhere spawn, the safe default there. Not in a process
    # connected to Ray: a fork copies locks its threads hold, and the child can hang.
    ray = sys.modules.get("ray")
    threaded = ray is not None and ray.is_initialized()
    context = multiprocessing.get_context("fork" if sys.platform == "linux" and not threaded else "spawn")
    with context.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(function, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
