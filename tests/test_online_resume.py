"""Online resume through torchdata's StatefulDataLoader with 2 workers: exact from every step of an epoch.

One worker's shard runs out well before the other's, so many cuts fall after it ended (its state is
saved ``exhausted``), and the last cuts fall after the last pack. A changed worker count is refused
with tightpack's message.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest

from tests.online_stream import Stream
from tightpack.errors import TightpackError
from tightpack.runtime.online import OnlinePackConfig, OnlinePacker

stateful = pytest.importorskip("torchdata.stateful_dataloader")
from tightpack.runtime.online_loader import OnlineLoader, check_loader_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata's telemetry hook on CPU

SAMPLES, PACK_SIZE, BUFFER = 64, 256, 6


def uneven_stream() -> Stream:
    """Worker 0 reads the even positions (long samples), worker 1 the odd ones (short): worker 1's
    shard runs out after about a third of the epoch's packs."""
    rng = np.random.default_rng(25)
    long, short = rng.integers(60, 200, SAMPLES), rng.integers(5, 40, SAMPLES)
    return Stream([int(long[i] if i % 2 == 0 else short[i]) for i in range(SAMPLES)])


def make_loader(stream: Stream, strategy: str, num_workers: int = 2, loader=stateful.StatefulDataLoader):
    config = OnlinePackConfig(
        pack_size=PACK_SIZE, packing_buffer_size=BUFFER, strategy=strategy, data_id="uneven-25"
    )
    packer = OnlinePacker(stream, config, restore=stream.restore)
    return loader(packer, batch_size=None, num_workers=num_workers)


def as_lists(packs) -> list[tuple[list[str], list[int]]]:
    return [(pack["keys"], pack["input_ids"].tolist()) for pack in packs]


@pytest.mark.parametrize("strategy", ["best_fill", "ffd"])
def test_resume_from_every_step_of_an_epoch_is_exact(strategy):
    stream = uneven_stream()
    loader = make_loader(stream, strategy)
    states = [copy.deepcopy(loader.state_dict())]  # states[k]: saved after k packs
    uninterrupted = []
    for pack in loader:
        uninterrupted.append((pack["keys"], pack["input_ids"].tolist()))
        states.append(copy.deepcopy(loader.state_dict()))
    after_the_epoch = copy.deepcopy(loader.state_dict())  # the loader has seen the end

    assert Counter(key for keys, _ in uninterrupted for key in keys) == Counter(
        f"s{i:04d}" for i in range(SAMPLES)
    )
    odd_packs = [k for k, (keys, _) in enumerate(uninterrupted) if int(keys[0][1:]) % 2 == 1]
    assert 5 <= odd_packs[-1] + 1 <= len(uninterrupted) - 10  # many cuts after worker 1's shard ran out
    assert states[-1]["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]["exhausted"]

    for cut, state in enumerate(states):
        resumed = make_loader(stream, strategy)
        resumed.load_state_dict(state)
        packs = uninterrupted[:cut] + as_lists(resumed)
        assert packs == uninterrupted, f"resumed after {cut} of {len(uninterrupted)} packs"
        assert Counter(key for keys, _ in packs for key in keys) == Counter(
            f"s{i:04d}" for i in range(SAMPLES)
        ), cut

    resumed = make_loader(stream, strategy)  # a state saved after the end: the next epoch, whole
    resumed.load_state_dict(after_the_epoch)
    assert as_lists(resumed) == uninterrupted


def test_a_packer_resumed_after_its_pass_ended_yields_nothing_then_a_new_pass():
    stream = uneven_stream()
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER)
    packer = OnlinePacker(stream, config, restore=stream.restore)
    first_pass = as_lists(packer)
    resumed = OnlinePacker(stream, config, restore=stream.restore)
    resumed.load_state_dict(packer.state_dict())
    assert as_lists(resumed) == []
    assert as_lists(resumed) == first_pass


def saved_state(stream: Stream, num_workers: int) -> dict:
    loader = make_loader(stream, "best_fill", num_workers)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    del iterator
    return state


@pytest.mark.parametrize(("saved", "now"), [(2, 1), (2, 3), (0, 2), (2, 0)])
def test_another_worker_count_is_refused_with_what_was_saved_and_the_fix(saved, now):
    stream = uneven_stream()
    state = saved_state(stream, saved)
    resumed = make_loader(stream, "best_fill", now, loader=OnlineLoader)
    message = (
        rf"saved with num_workers={saved} and is loaded with num_workers={now}: .*"
        rf"resume with num_workers={saved}"
    )
    with pytest.raises(TightpackError, match=message):
        resumed.load_state_dict(state)


def test_a_plain_stateful_dataloader_with_fewer_workers_gets_tightpacks_error():
    # Before torchdata's own check of the worker count (a bare AssertionError). On the way out
    # torchdata waits 5 s for each worker that failed to start: one worker here.
    stream = uneven_stream()
    resumed = make_loader(stream, "best_fill", num_workers=1)
    resumed.load_state_dict(saved_state(stream, 2))
    message = (
        r"saved by shard 0 of 2 \(DataLoader worker 0 of 2 .*\) and is loaded in shard 0 of 1 \(worker 0 "
    )
    with pytest.raises(TightpackError, match=message):
        next(iter(resumed))


def test_online_loader_checks_the_packer_settings_and_layout_before_any_worker_starts():
    stream = uneven_stream()
    state = saved_state(stream, 2)
    config = OnlinePackConfig(pack_size=PACK_SIZE, packing_buffer_size=BUFFER, data_id="uneven-25")
    other_rank = OnlinePacker(stream, config, restore=stream.restore, rank=1, world_size=2)
    with pytest.raises(TightpackError, match="rank saved 0 now 1, world_size saved 1 now 2"):
        OnlineLoader(other_rank, num_workers=2).load_state_dict(state)
    with pytest.raises(TightpackError, match="not a StatefulDataLoader state"):
        check_loader_state(other_rank, {"step": 3}, num_workers=2)
    same = OnlineLoader(OnlinePacker(stream, config, restore=stream.restore), num_workers=2)
    same.load_state_dict(state)  # the layout and settings match: it resumes after the 3 packs
    assert as_lists(same) == as_lists(make_loader(stream, "best_fill"))[3:]
    with pytest.raises(TightpackError, match="batch_size must be None, got 4"):
        OnlineLoader(OnlinePacker(stream, config), batch_size=4)
