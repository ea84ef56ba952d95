"""The peers of `bench_step_planner.py`: how other RL frameworks cut one step into micro-batches per rank.

Every planner here takes one step's sequence lengths (int64 ``[N]``), the data-parallel size ``DP``, the
token budget of a micro-batch and the per-sequence costs of the shared cost model, and returns a
`Layout`: the rank of every sequence, its micro-batch within that rank, and the micro-batches per rank
(the same on every rank: a rank with fewer runs empty ones).

- verl 0.9.1 as its PPO trainer runs it with ``use_dynamic_bsz`` and ``balance_batch``:
  `verl_balance` is ``RayPPOTrainer._balance_batch``, verl's own ``get_seqlen_balanced_partitions(
  workloads, DP, equal_size=True)`` (Karmarkar-Karp on ``calculate_workload(s) = 24576 s + s**2``, or on
  the shared cost model's costs); `verl_micro_batches` replays ``rearrange_micro_batches`` with
  ``same_micro_num_in_dp`` on every rank (``ceil(tokens / max_token_len)`` micro-batches, the most of any
  rank, partitioned by Karmarkar-Karp on verl's workload, the count raised on every rank until all fit the
  budget), and `verl_micro_batches_by_verl` runs verl's own ``rearrange_micro_batches`` instead, to check
  the replay and to time verl (`load_verl` imports verl's module from the wheel).
- `slime_plan`: the scheme of slime PR #2017 (``--balance-by-flops``): cost ``c * s + s**2`` per
  sequence (here the shared cost model's, ``c = linear / quadratic``), ``ceil(tokens / budget)``
  micro-batches for the whole step (rounded up to a multiple of ``DP``) formed by Karmarkar-Karp on the
  costs without a cap on their tokens, then dealt to ranks by Karmarkar-Karp with equal counts.
  Reimplemented here (`karmarkar_karp`), not slime's code.
- `ffd_plan`: first-fit decreasing by tokens under the budget for the whole step, micro-batch ``i`` to
  rank ``i % DP`` (round-robin), empty micro-batches so that every rank has as many.
- `pieces_plan`: today's tightpack pieces: `tightpack.core.planner.plan_packs` (``bfd``) under the
  budget for the whole step, padded with empty micro-batches to a multiple of ``DP``, dealt by cost
  with `tightpack.core.balance.deal_balanced`.
- `step_plan`: `tightpack.core.step_planner.plan_step`.

A sequence above the budget (``allow_oversize``): `ffd_plan` and `pieces_plan` give it a micro-batch of
its own, as `plan_step` does with ``allow_oversize=True``; verl refuses the step (its
``assert max_token_len >= max_seq_len``); `slime_plan` never looks at the budget after the count.
"""

from __future__ import annotations

import heapq
import importlib.util
import subprocess
import sys
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tightpack.core.balance import deal_balanced
from tightpack.core.planner import plan_packs
from tightpack.core.step_planner import plan_step

VERL_VERSION = "0.9.1"
VERL_MODULE = "verl/utils/seqlen_balancing.py"
VERL_CACHE = Path(sys.prefix) / "tightpack-bench" / f"verl-{VERL_VERSION}"
"""Where the verl wheel is downloaded and its module extracted: inside the virtual environment, out of git."""


@dataclass
class Layout:
    """One planner's answer for one step: ``rank[i]``, ``batch[i]`` (within its rank) of sequence ``i``."""

    rank: np.ndarray
    batch: np.ndarray
    per_rank: int


# --- Karmarkar-Karp ------------------------------------------------------------------------------------


def karmarkar_karp(values: np.ndarray, k: int, equal_size: bool = False) -> np.ndarray:
    """The partition (``0..k-1``) of every item by the largest differencing method, k-way.

    Karmarkar & Karp (1982), "The differencing method of set partitioning" (UC Berkeley report
    UCB/CSD 82/113); k-way form as in Michiels, Aarts, Korst, van Leeuwen & Spieksma (2012),
    "Computer-assisted proof of performance ratios for the Differencing Method", Discrete Optimization
    9(1): every item starts as a k-tuple of sums holding it alone; the two tuples with the largest spread
    (max - min) are merged, the largest sum of one with the smallest of the other, until one tuple is
    left. ``equal_size``: the balanced variant verl uses, items sorted and cut into tuples of ``k``
    consecutive items, so every part gets ``len(values) / k`` items.

    A tuple is kept sparse (its non-empty parts only, sorted descending; missing parts are empty and
    sum 0), so a merge costs the parts it touches, not ``k``; parts are tracked as union-find nodes.
    """
    values = np.asarray(values, dtype=np.float64)
    count = len(values)
    parent = np.arange(count, dtype=np.int64)
    heap: list = []
    serial = 0

    def push(sums: np.ndarray, nodes: np.ndarray) -> None:
        nonlocal serial
        low = sums[-1] if len(sums) == k else 0.0
        heapq.heappush(heap, (-(sums[0] - low), -sums[0], serial, sums, nodes))
        serial += 1

    if equal_size:
        if count % k:
            raise ValueError(f"{count} items do not split into {k} equal parts")
        ascending = np.argsort(values, kind="stable")
        for start in range(0, count, k):
            chunk = ascending[start : start + k][::-1]
            push(values[chunk], chunk.copy())
    else:
        for item in range(count):
            push(values[item : item + 1], np.array([item], dtype=np.int64))
    while len(heap) > 1:
        _, _, _, sums_a, nodes_a = heapq.heappop(heap)
        _, _, _, sums_b, nodes_b = heapq.heappop(heap)
        p, q = len(sums_a), len(sums_b)
        m = max(0, p + q - k)  # A's last m parts meet B's last m parts, reversed (largest with smallest)
        paired = sums_a[p - m :] + sums_b[q - m :][::-1]
        parent[nodes_b[q - m :][::-1]] = nodes_a[p - m :]
        sums = np.concatenate([sums_a[: p - m], sums_b[: q - m], paired])
        nodes = np.concatenate([nodes_a[: p - m], nodes_b[: q - m], nodes_a[p - m :]])
        order = np.argsort(-sums, kind="stable")
        push(sums[order], nodes[order])
    while True:
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    part_of_root = np.full(count, -1, dtype=np.int64)
    if heap:
        part_of_root[heap[0][4]] = np.arange(len(heap[0][4]))
    return part_of_root[parent]


# --- verl ----------------------------------------------------------------------------------------------


def verl_module_path(cache: Path = VERL_CACHE) -> Path:
    """verl's ``seqlen_balancing.py``, downloaded once (``pip download verl==0.9.1 --no-deps``)."""
    module = cache / VERL_MODULE
    if module.exists():
        return module
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"verl-{VERL_VERSION}-*.whl"))
    if not wheels:
        print(f"downloading verl=={VERL_VERSION} (no dependencies) into {cache} ...", flush=True)
        command = [sys.executable, "-m", "pip", "download", f"verl=={VERL_VERSION}", "--no-deps"]
        subprocess.run([*command, "-q", "--disable-pip-version-check", "-d", str(cache)], check=True)
        wheels = sorted(cache.glob(f"verl-{VERL_VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(VERL_MODULE, cache)
    return module


def load_verl(cache: Path = VERL_CACHE) -> types.ModuleType:
    """verl's ``verl.utils.seqlen_balancing`` imported by path, with the three verl imports it needs
    (``DataProto``, ``tensordict_utils``, ``get_device_name``) stubbed for the time of the import."""
    path = verl_module_path(cache)
    stubs = {
        "verl": types.ModuleType("verl"),
        "verl.protocol": types.ModuleType("verl.protocol"),
        "verl.utils": types.ModuleType("verl.utils"),
        "verl.utils.tensordict_utils": types.ModuleType("verl.utils.tensordict_utils"),
        "verl.utils.device": types.ModuleType("verl.utils.device"),
    }
    stubs["verl.protocol"].DataProto = object
    stubs["verl.utils.tensordict_utils"].index_select_tensor_dict = lambda batch, indices: None
    stubs["verl.utils.device"].get_device_name = lambda: "cpu"
    stubs["verl.utils"].tensordict_utils = stubs["verl.utils.tensordict_utils"]
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("verl_seqlen_balancing", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    module.__tightpack_source__ = str(path)
    return module


class _Nested:
    """What ``rearrange_micro_batches`` reads of a nested (jagged) ``input_ids``: its offsets."""

    is_nested = True

    def __init__(self, offsets) -> None:
        self._offsets = offsets

    def offsets(self):
        return self._offsets


def verl_balance(verl, lengths: np.ndarray, ranks: int, workloads: np.ndarray | None = None) -> list:
    """``RayPPOTrainer._balance_batch``: verl's Karmarkar-Karp with equal counts across the DP ranks, on
    ``calculate_workload`` of the lengths (``workloads=None``, as shipped) or on ``workloads``; verl's
    own code. Returns every rank's share, int64 index arrays."""
    import torch

    if workloads is None:
        workload_list = verl.calculate_workload(torch.from_numpy(lengths)).tolist()
    else:
        workload_list = [int(w) for w in workloads]
    partitions = verl.get_seqlen_balanced_partitions(workload_list, k_partitions=ranks, equal_size=True)
    return [np.asarray(sorted(part), dtype=np.int64) for part in partitions]


class VerlRefused(Exception):
    """verl refuses the step (a sequence above ``max_token_len``, or too few sequences for the count)."""


def _layout_of_shares(count: int, shares: list, batches: list, per_rank: int) -> Layout:
    rank = np.empty(count, dtype=np.int64)
    batch_of = np.empty(count, dtype=np.int64)
    for r, (share, parts) in enumerate(zip(shares, batches, strict=True)):
        rank[share] = r
        batch_of[share] = parts
    return Layout(rank, batch_of, per_rank)


def verl_micro_batches(lengths: np.ndarray, shares: list, budget: int) -> Layout:
    """``rearrange_micro_batches`` with ``same_micro_num_in_dp`` on every rank at once, replayed.

    verl's loop, as its ranks run it in lockstep through their all-reduces: the count starts at the most
    any rank needs, ``min(n_r, ceil(tokens_r / max_token_len))``; at each count every rank partitions its
    sequences by Karmarkar-Karp (``equal_size=False``) on ``calculate_workload``; the count is raised by
    one until every rank's micro-batches fit. Replayed with `karmarkar_karp`, which returns the same
    partitions as verl's ``karmarkar_karp`` (checked against verl's own ``rearrange_micro_batches`` by
    `verl_micro_batches_by_verl`): verl's pure-Python version needs minutes per step where ranks hold
    thousands of sequences. A count is rejected at the first rank that does not fit, which changes the
    time of the replay, not its answer.
    """
    if int(lengths.max()) > budget:
        raise VerlRefused(
            f"max_token_len must be greater than the sequence length ({lengths.max()} > {budget})"
        )
    workloads = 24576 * lengths + lengths * lengths  # verl's calculate_workload, int64
    count = max(min(len(s), -(-int(lengths[s].sum()) // budget)) for s in shares)
    fewest = min(len(s) for s in shares)
    order = list(range(len(shares)))
    while True:
        if count > fewest:
            raise VerlRefused(f"{count} micro-batches requested but a rank has only {fewest} sequences")
        parts: dict[int, np.ndarray] = {}
        for r in order:
            share = shares[r]
            parts[r] = karmarkar_karp(workloads[share], count)
            if np.bincount(parts[r], weights=lengths[share], minlength=count).max() > budget:
                order.remove(r)
                order.insert(0, r)  # the rank that failed is tried first at the next count
                break
        else:
            return _layout_of_shares(len(lengths), shares, [parts[r] for r in range(len(shares))], count)
        count += 1


def verl_micro_batches_by_verl(verl, lengths: np.ndarray, shares: list, budget: int) -> tuple[Layout, float]:
    """The same with verl's own ``rearrange_micro_batches`` on every rank, without a process group: each
    rank called with ``min_num_micro_batch`` = the agreed count until all ranks return it (what the
    synchronised loop reaches). Also returns the CPU seconds of the slowest rank (the ranks run in
    parallel)."""
    import torch

    batches = [
        {"input_ids": _Nested(torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[s])])))} for s in shares
    ]
    count = max(min(len(s), -(-int(lengths[s].sum()) // budget)) for s in shares)
    seconds = [0.0] * len(shares)
    while True:
        results = []
        for r, batch in enumerate(batches):
            start = time.process_time()
            _, indices = verl.rearrange_micro_batches(batch, max_token_len=budget, min_num_micro_batch=count)
            seconds[r] += time.process_time() - start
            results.append(indices)
        agreed = max(len(indices) for indices in results)
        if all(len(indices) == agreed for indices in results):
            break
        count = agreed
    parts = []
    for share, indices in zip(shares, results, strict=True):
        part = np.empty(len(share), dtype=np.int64)
        for k, local in enumerate(indices):
            part[local] = k
        parts.append(part)
    return _layout_of_shares(len(lengths), shares, parts, agreed), max(seconds)


# --- the others ----------------------------------------------------------------------------------------


def _ranks_of_batches(batch_of_item: np.ndarray, batch_rank: np.ndarray, ranks: int) -> Layout:
    """Micro-batch ``b`` goes to rank ``batch_rank[b]``; within a rank micro-batches keep their order."""
    order = np.argsort(batch_rank, kind="stable")
    within = np.empty(len(batch_rank), dtype=np.int64)
    starts = np.searchsorted(batch_rank[order], np.arange(ranks))
    within[order] = np.arange(len(batch_rank)) - starts[batch_rank[order]]
    per_rank = int(np.bincount(batch_rank, minlength=ranks).max(initial=0))
    return Layout(batch_rank[batch_of_item], within[batch_of_item], max(per_rank, 1))


def _oversize_apart(lengths: np.ndarray, budget: int, pack) -> tuple[np.ndarray, int]:
    """The micro-batch of every sequence: ``pack`` plans those within the budget; one above it alone."""
    batch_of = np.empty(len(lengths), dtype=np.int64)
    alone = lengths > budget
    plan = pack(lengths[~alone])
    batch_of[np.flatnonzero(~alone)] = plan.pack_of_sample()
    batch_of[alone] = len(plan) + np.arange(int(alone.sum()))
    return batch_of, len(plan) + int(alone.sum())


def slime_plan(lengths: np.ndarray, ranks: int, budget: int, costs: np.ndarray) -> Layout:
    """slime-style flops Karmarkar-Karp (module docstring)."""
    count = -(-int(lengths.sum()) // budget)
    count = -(-max(count, ranks) // ranks) * ranks
    batch_of = karmarkar_karp(costs, count)
    batch_costs = np.bincount(batch_of, weights=costs, minlength=count)
    return _ranks_of_batches(batch_of, karmarkar_karp(batch_costs, ranks, equal_size=True), ranks)


def ffd_plan(lengths: np.ndarray, ranks: int, budget: int, costs: np.ndarray | None = None) -> Layout:
    """First-fit decreasing by tokens, dealt round-robin (module docstring)."""
    batch_of, count = _oversize_apart(lengths, budget, lambda x: plan_packs(x, budget, algorithm="ffd"))
    return _ranks_of_batches(batch_of, np.arange(count, dtype=np.int64) % ranks, ranks)


def pieces_plan(lengths: np.ndarray, ranks: int, budget: int, costs: np.ndarray) -> Layout:
    """``plan_packs`` then ``deal_balanced`` by cost (module docstring)."""
    batch_of, count = _oversize_apart(lengths, budget, lambda x: plan_packs(x, budget))
    padded = -(-max(count, 1) // ranks) * ranks
    batch_costs = np.bincount(batch_of, weights=costs, minlength=padded)
    dealt = deal_balanced(batch_costs, ranks)  # [ranks, padded / ranks] positions
    batch_rank = np.empty(padded, dtype=np.int64)
    batch_rank[dealt] = np.arange(ranks)[:, None]
    return _ranks_of_batches(batch_of, batch_rank, ranks)


def step_plan(lengths: np.ndarray, ranks: int, budget: int, model, allow_oversize: bool = False) -> Layout:
    """`plan_step` under the budget with the shared cost model."""
    plan = plan_step(lengths, ranks, max_tokens=budget, cost_model=model, allow_oversize=allow_oversize)
    slot = np.repeat(np.arange(ranks * plan.micro_batches, dtype=np.int64), np.diff(plan.offsets))
    rank = np.empty(len(lengths), dtype=np.int64)
    batch = np.empty(len(lengths), dtype=np.int64)
    rank[plan.order] = slot // plan.micro_batches
    batch[plan.order] = slot % plan.micro_batches
    return Layout(rank, batch, plan.micro_batches)


def check_layout(layout: Layout, count: int, ranks: int) -> None:
    """Every sequence on one rank in one of its ``per_rank`` micro-batches (raises otherwise)."""
    ok = (
        len(layout.rank) == count
        and (count == 0 or (layout.rank.min() >= 0 and layout.rank.max() < ranks))
        and (count == 0 or (layout.batch.min() >= 0 and layout.batch.max() < layout.per_rank))
    )
    if not ok:
        raise AssertionError("a planner returned an invalid layout")


__all__ = [
    "Layout",
    "VerlRefused",
    "check_layout",
    "ffd_plan",
    "karmarkar_karp",
    "load_verl",
    "pieces_plan",
    "slime_plan",
    "step_plan",
    "verl_balance",
    "verl_micro_batches",
    "verl_micro_batches_by_verl",
]
