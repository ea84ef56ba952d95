"""All data-parallel ranks of a sampler at once, for `bench_balance.py` (issue 13).

`simulate` reproduces, for every rank together, what each rank's sampler yields over an epoch, with
the samplers' own internals and the core functions their ``_batch`` calls; `verify_simulation`
checks it index for index against real per-rank samplers; `overhead` turns it into the straggler
overhead of a contender.
"""

from __future__ import annotations

import numpy as np

from tightpack.core.balance import deal_balanced, straggler_overhead
from tightpack.runtime.balanced_sampler import BalancedPackedBatchSampler
from tightpack.runtime.samplers import PackedBatchSampler

BASELINE, DEAL, REGROUP = "baseline", "deal", "regroup"


def baseline_sampler(total: int, gbs: int, dp: int, rank: int, seed: int) -> PackedBatchSampler:
    """Today's sampler of the offline path: ``batch`` type, one pack per micro-batch."""
    return PackedBatchSampler(
        total,
        dataloader_type="batch",
        micro_batch_size=1,
        global_batch_size=gbs,
        data_parallel_rank=rank,
        data_parallel_size=dp,
        seed=seed,
    )


def simulate(contender: str, costs: np.ndarray, dp: int, gbs: int, seed: int, epoch: int) -> np.ndarray:
    """Every rank's dataset indices per step of one epoch, int64 ``[steps, DP, GBS / DP]``.

    Row ``[s, d]`` is what rank ``d``'s sampler yields at step ``s`` (``drop_last``, so no padding):

    - ``baseline``: ``PackedBatchSampler._batch`` takes ``batch[d::DP]`` of each global batch;
    - ``deal``: ``BalancedPackedBatchSampler._batch`` with ``regroup=False`` deals each global batch
      with ``deal_balanced`` on its costs;
    - ``regroup``: the same with ``regroup=True`` runs ``balanced_steps`` once over the epoch's permuted
      costs (``_regrouped_steps``, all ranks at once).

    `verify_simulation` checks this against real per-rank samplers.
    """
    per_rank = gbs // dp
    if contender == BASELINE:
        sampler = baseline_sampler(len(costs), gbs, dp, 0, seed)
        batches = np.stack(list(sampler._global_batches(epoch, 0)))  # [steps, GBS]
        return batches.reshape(-1, per_rank, dp).transpose(0, 2, 1)
    sampler = BalancedPackedBatchSampler(
        costs,
        global_batch_size=gbs,
        data_parallel_rank=0,
        data_parallel_size=dp,
        seed=seed,
        regroup=contender == REGROUP,
    )
    if contender == DEAL:
        batches = list(sampler._global_batches(epoch, 0))
        return np.stack([batch[deal_balanced(sampler.pack_costs[batch], dp)] for batch in batches])
    if contender == REGROUP:
        return sampler._regrouped_steps(epoch)
    raise ValueError(f"contender {contender!r} is not one of {(BASELINE, DEAL, REGROUP)}")


def real_ranks(contender: str, costs: np.ndarray, dp: int, gbs: int, seed: int, epoch: int) -> np.ndarray:
    """The same as `simulate`, from ``DP`` real samplers iterated epoch ``epoch``: slow, for checks."""
    rows = []
    for rank in range(dp):
        if contender == BASELINE:
            sampler = baseline_sampler(len(costs), gbs, dp, rank, seed)
        else:
            sampler = BalancedPackedBatchSampler(
                costs,
                global_batch_size=gbs,
                data_parallel_rank=rank,
                data_parallel_size=dp,
                seed=seed,
                regroup=contender == REGROUP,
            )
        sampler.consumed_samples = epoch * sampler.samples_per_epoch
        rows.append(np.array(list(sampler), dtype=np.int64))  # [steps, GBS / DP]
    return np.stack(rows, axis=1)


def verify_simulation(seed: int) -> dict[str, bool]:
    """`simulate` against real per-rank samplers, index for index, on small configurations.

    Costs with ties (rounded) and a pack count that leaves a dropped tail; DP 8 with 1, 4 and 16 packs
    per rank, epochs 0 and 1.
    """
    rng = np.random.default_rng(seed)
    costs = np.round(rng.lognormal(0.0, 1.0, size=389), 1)
    checks = {}
    for contender in (BASELINE, DEAL, REGROUP):
        for per_rank in (1, 4, 16):
            for epoch in (0, 1):
                simulated = simulate(contender, costs, 8, 8 * per_rank, seed, epoch)
                real = real_ranks(contender, costs, 8, 8 * per_rank, seed, epoch)
                key = f"{contender}: DP 8, GBS {8 * per_rank}, {len(costs)} packs, epoch {epoch}"
                checks[key] = simulated.shape == real.shape and bool((simulated == real).all())
    return checks


def overhead(
    contender: str,
    costs: np.ndarray,
    dp: int,
    gbs: int,
    seed: int,
    epochs: int,
    scored_by: dict[str, np.ndarray] | None = None,
) -> dict:
    """Straggler overhead of one contender over ``epochs`` epochs, with the step count.

    The contender deals by ``costs``. ``scored_by`` (name -> the same packs' costs under another cost
    model) scores that same dealing again under each: ``result["scored"][name]`` is its overhead
    there, a prediction by a model that did not choose the dealing.
    """
    dealt = np.concatenate(
        [simulate(contender, costs, dp, gbs, seed, epoch) for epoch in range(epochs)]
    )  # [steps, DP, GBS / DP]
    result = {"overhead": straggler_overhead(costs[dealt].sum(axis=2)), "steps": len(dealt)}
    if scored_by is not None:
        result["scored"] = {
            name: straggler_overhead(other[dealt].sum(axis=2)) for name, other in scored_by.items()
        }
    return result
