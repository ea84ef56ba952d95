"""torchdata's ``StatefulDataLoader`` for an `OnlinePacker`, refusing a state it cannot resume exactly.

`OnlineLoader` is a ``StatefulDataLoader`` with ``batch_size=None`` whose ``load_state_dict`` checks,
in the main process and before any worker starts, that the state was saved with the same number of
DataLoader workers and with the packer's settings and data-parallel layout
(`check_loader_state`). A plain ``StatefulDataLoader`` resumes the same packs; on another worker
count it stops with torchdata's bare ``AssertionError`` (from 0 to some workers, or back) or with
the packer's `TightpackError` raised inside a worker. What makes the resume exact (each worker's
state, including one whose shard ran out) lives in `tightpack.runtime.online`. Needs the optional
extra: ``pip install 'tightpack[online]'``.
"""

from __future__ import annotations

from typing import Any

from tightpack.errors import TightpackError
from tightpack.runtime.online import OnlinePacker

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tightpack.runtime.online_loader needs torchdata, which is not installed; "
        "install the extra with: pip install 'tightpack[online]'"
    ) from error

__all__ = ["OnlineLoader"]

# torchdata's state layout (torchdata/stateful_dataloader/stateful_dataloader.py, 0.10 and 0.11).
_SNAPSHOT, _MAIN, _WORKERS, _NUM_WORKERS = "_snapshot", "_main_snapshot", "_worker_snapshots", "_num_workers"
_SINGLE_PROCESS_KEY, _DATASET_STATE = "_num_yielded", "dataset_state"


def _saved_workers(state: dict[str, Any]) -> tuple[int, list[dict[str, Any] | None]]:
    """``(num_workers, dataset states)`` of a ``StatefulDataLoader.state_dict()``."""
    if _SNAPSHOT in state:
        snapshot = state[_SNAPSHOT]
        workers = snapshot[_MAIN][_NUM_WORKERS]
        saved = snapshot.get(_WORKERS, {})
        return workers, [(saved.get(f"worker_{i}") or {}).get(_DATASET_STATE) for i in range(workers)]
    if _SINGLE_PROCESS_KEY in state:
        return 0, [state.get(_DATASET_STATE)]
    raise TightpackError(
        f"not a StatefulDataLoader state (keys {sorted(state)}): pass what loader.state_dict() returned"
    )


def check_loader_state(packer: OnlinePacker, state: dict[str, Any], num_workers: int) -> None:
    """Refuse (`TightpackError`) a loader state that ``packer`` with ``num_workers`` cannot resume exactly.

    ``state`` is a ``StatefulDataLoader.state_dict()`` (``{}`` passes: nothing to resume). It must
    come from as many DataLoader workers (0: the main process), and each worker's packer state from
    the same settings and data-parallel layout (`OnlinePacker.check_state`). For example, a state
    saved with 2 workers and checked for 4 raises "the loader state was saved with num_workers=2 and
    is loaded with num_workers=4: ...; resume with num_workers=2, ...".
    """
    if not state:
        return
    saved_workers, dataset_states = _saved_workers(state)
    if saved_workers != num_workers:
        raise TightpackError(
            f"the loader state was saved with num_workers={saved_workers} and is loaded with "
            f"num_workers={num_workers}: each DataLoader worker packs its own shard of the stream and "
            f"the state holds {max(saved_workers, 1)} shard buffer(s) and read position(s), so another "
            f"worker count would repeat or skip samples; resume with num_workers={saved_workers}, or "
            "change it at the start of an epoch, without loading the state"
        )
    for dataset_state in dataset_states:
        if dataset_state is not None:
            packer.check_state(dataset_state)


class OnlineLoader(StatefulDataLoader):
    """``StatefulDataLoader(packer, batch_size=None, ...)`` that refuses a state it cannot resume.

    One item per pack (the packer's THD batch). ``loader.state_dict()`` saves every worker's buffer
    and position; ``loader.load_state_dict(state)`` raises `TightpackError` at once when the state
    was saved with another ``num_workers``, other packer settings or another data-parallel layout::

        loader = OnlineLoader(packer, num_workers=2)
        torch.save(loader.state_dict(), "loader.pt")  # at a checkpoint
        loader.load_state_dict(torch.load("loader.pt"))  # on resume: same packer settings and workers
    """

    def __init__(self, packer: OnlinePacker, **kwargs: Any) -> None:
        if not isinstance(packer, OnlinePacker):
            raise TightpackError(f"OnlineLoader loads an OnlinePacker, got {type(packer).__name__}")
        batch_size = kwargs.setdefault("batch_size", None)
        if batch_size is not None:
            raise TightpackError(
                f"OnlineLoader yields one pack per step: batch_size must be None, got {batch_size!r}"
            )
        super().__init__(packer, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the state against this loader's packer and ``num_workers``, then load it."""
        check_loader_state(self.dataset, state_dict, self.num_workers)
        super().load_state_dict(state_dict)
