"""Cost-balanced packs (`tightpack.core.balanced_plan`): same samples, capacity kept, spread narrowed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightpack.core.balanced_plan import balance_pack_costs
from tightpack.core.cost_model import CostModel, cost_spread
from tightpack.core.planner import PackPlan, plan_packs
from tightpack.errors import TightpackError

from .conftest import examples

SQUARES = CostModel(linear=1.0, quadratic=0.05, per_sequence=2.0, unit="seconds")


def long_tail(rng: np.random.Generator, n: int, pack_size: int) -> np.ndarray:
    """Lognormal lengths, 5% of them above half a pack: the issue's long-tail distribution."""
    lengths = np.clip(rng.lognormal(4.0, 1.0, n).astype(np.int64), 1, pack_size // 2)
    tail = rng.random(n) < 0.05
    lengths[tail] = rng.integers(pack_size // 2 + 1, pack_size + 1, int(tail.sum()))
    return lengths


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=300),
    st.sampled_from([64, 100, 128]),
    st.sampled_from(["bfd", "ffd", "first_fit"]),
    st.sampled_from([0.0, 0.001, 0.05]),
)
def test_every_sample_once_no_pack_over_capacity_and_never_a_wider_spread(
    lengths, pack_size, algorithm, extra
):
    lengths = np.array(lengths)
    plan = plan_packs(lengths, pack_size, algorithm=algorithm)
    balanced = balance_pack_costs(plan, lengths, pack_size, SQUARES, extra_packs=extra)
    assert sorted(balanced.order.tolist()) == list(range(len(lengths)))
    assert balanced.pack_loads(lengths).max() <= pack_size
    assert (balanced.pack_sizes > 0).all()
    assert len(balanced) <= len(plan) + int(extra * len(plan))  # fewer when a pack was left empty
    before, after = SQUARES.pack_costs(plan, lengths), SQUARES.pack_costs(balanced, lengths)
    assert after.std() <= before.std()
    if balanced is not plan:
        assert after.std() < before.std()


def test_the_spread_narrows_where_sequences_of_middle_length_shared_packs():
    rng = np.random.default_rng(0)
    lengths = long_tail(rng, 20_000, 1024)
    model = CostModel(linear=1.0, quadratic=1 / 512, unit="seconds")  # crossover at 512 tokens
    plan = plan_packs(lengths, 1024)
    balanced = balance_pack_costs(plan, lengths, 1024, model)
    before, after = (
        cost_spread(model.pack_costs(plan, lengths)),
        cost_spread(model.pack_costs(balanced, lengths)),
    )
    assert after.cv < 0.9 * before.cv
    assert after.mean == pytest.approx(before.mean, rel=2e-3)  # the same work over (almost) as many packs
    assert len(balanced) <= len(plan) + len(plan) // 1000
    fill = lambda p: lengths.sum() / (len(p) * 1024)  # noqa: E731
    assert fill(plan) - fill(balanced) < 0.001


def test_a_pack_that_cannot_change_is_left_as_it_is():
    """One sequence filling its pack costs what it costs: balancing never splits or drops it."""
    lengths = np.array([10, 5, 5])
    plan = PackPlan(order=np.arange(3), offsets=np.array([0, 1, 3]))
    assert balance_pack_costs(plan, lengths, 10, SQUARES) is plan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"extra_packs": 2.0}, "extra_packs must be a fraction"),
        ({"cost_model": "llama-8b"}, "cost_model must be a CostModel"),
        ({"pack_size": 4}, "a pack above pack_size 4"),
    ],
)
def test_errors(kwargs, match):
    lengths = np.array([3, 3, 2])
    plan = plan_packs(lengths, 8)
    arguments = {"pack_size": 8, "cost_model": SQUARES} | kwargs
    with pytest.raises(TightpackError, match=match):
        balance_pack_costs(
            plan, lengths, arguments.pop("pack_size"), arguments.pop("cost_model"), **arguments
        )
