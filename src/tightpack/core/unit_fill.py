"""Fewer packs for whole units: best-fit decreasing, then its emptiest packs drained into fuller ones.

Preference units (a DPO pair, a GRPO group) are packed whole and often take thousands of tokens, two
to eight to a pack, so best-fit decreasing (`tightpack.core.best_fit`) leaves gaps that no remaining
unit fits. `drain_packs` empties packs of such a plan into others. It takes one of the emptiest packs,
``q``, and every pack ``p`` that can take more of ``q``'s tokens, and refills the two exactly: ``p``
gets the fullest subset of both packs' units (as `tightpack.core.subset_fill.best_subset` picks it),
``q`` keeps the rest. One refill is a move or a swap of any number of units between the two. ``p``
always ends fuller than either pack was, so the sum of the squared pack loads grows (Falkenauer and
Delchambre's bin-packing fitness, 1992): tokens flow towards full packs until ``q`` runs dry, one pack
fewer. The search stops at Martello and Toth's lower bound L2 (`least_packs`) or when sweeps stop
emptying packs.

The result never has more packs than the plan it starts from: a plan with fewer comes back, or the
plan itself. `tightpack.core.preference_units.plan_units` plans with it by default
(``algorithm="bfd_drain"``); `tightpack.core.planner.plan_packs` (free sequences) never does.
"""

from __future__ import annotations

import math

import numpy as np

from tightpack.core.pack_plan import PackPlan
from tightpack.core.planner import plan_packs
from tightpack.core.subset_fill import best_subset

__all__ = ["DRAIN_MAX_CAPACITY", "drain_packs", "least_packs", "plan_drained"]

DRAIN_MAX_CAPACITY = 1 << 20
"""Largest pack size (after dividing out the lengths' common factor) that `drain_packs` works on:
every refill runs a subset-sum over that many bits. Above it the plan is returned unchanged."""

DRAINED_PER_SWEEP = 32
"""Emptiest packs drained per sweep, before the packs are ranked again."""

PATIENCE = 6
"""Sweeps in a row without a pack emptied after which the search stops."""

PAIR_REMOVALS_UP_TO = 8
"""Packs of at most this many units let a swap take two of their units out (else one)."""

ENUMERATED_UP_TO = 10
"""Packs of at most this many units have their subset sums listed one by one (else a bitset)."""

REFILLS_PER_PACK = 16
"""Refill attempts allowed per pack of the starting plan: the search's work budget."""

CHUNK_PACKS = 1024
"""Plans of more packs are drained in chunks of about this many (`drain_packs`)."""


def least_packs(lengths: np.ndarray, capacity: int) -> int:
    """A lower bound on the packs any plan of these whole items needs: Martello and Toth's L2 (items
    over ``capacity - a`` and over half a pack each need a pack of their own; the items of ``a`` up to
    half a pack fill what those leave, then whole packs), the best over every ``a``; at least their
    tokens over the capacity.

    >>> least_packs(np.array([6, 6, 6, 5, 5, 5]), 10), least_packs(np.array([3, 3, 3, 3]), 10)
    (5, 2)
    """
    s = np.sort(np.asarray(lengths, dtype=np.int64))
    if len(s) == 0:
        return 0
    prefix = np.concatenate([[0], np.cumsum(s)])
    alphas = np.unique(np.concatenate([[0], s[s <= capacity // 2]]))
    half = int(np.searchsorted(s, capacity // 2, side="right"))  # items <= capacity / 2
    fits = np.searchsorted(s, capacity - alphas, side="right")  # items <= capacity - a
    alone = len(s) - fits  # over capacity - a: nothing of size >= a joins them
    over_half = np.maximum(fits - half, 0)  # over half a pack, up to capacity - a
    over_half_tokens = prefix[np.maximum(fits, half)] - prefix[half]
    small_tokens = prefix[half] - prefix[np.searchsorted(s, alphas, side="left")]  # a .. capacity / 2
    room = over_half * capacity - over_half_tokens
    more = np.maximum(0, -(-(small_tokens - room) // capacity))
    return int(max((alone + over_half + more).max(), -(-prefix[-1] // capacity)))


def plan_drained(lengths: np.ndarray, pack_size: int) -> PackPlan:
    """Best-fit decreasing (`plan_packs`), then `drain_packs`: never more packs than bfd.

    Lengths ``[6, 3, 3, 2, 2, 2, 2]`` in packs of 10: bfd puts a 3 beside the 6 and leaves a 2 alone;
    draining that pack refills the others exactly (``6 2 2`` and ``3 3 2 2``).

    >>> lengths = np.array([6, 3, 3, 2, 2, 2, 2])
    >>> [pack.tolist() for pack in plan_packs(lengths, 10)]
    [[0, 1], [2, 3, 4, 5], [6]]
    >>> [pack.tolist() for pack in plan_drained(lengths, 10)]
    [[0, 3, 4], [1, 2, 5, 6]]
    """
    plan = plan_packs(lengths, pack_size)
    return drain_packs(lengths, pack_size, plan)


def drain_packs(lengths: np.ndarray, pack_size: int, plan: PackPlan) -> PackPlan:
    """``plan`` (of ``lengths`` in packs of ``pack_size``, as `plan_packs` returns it) with fewer packs
    where two-pack refills can empty some (see the module docstring); ``plan`` itself when none
    empties, when it already meets the lower bound `least_packs`, or when the pack size is over
    `DRAIN_MAX_CAPACITY`. Packs the search left alone keep their place and their order; a refilled
    pack lists its units longest first. Deterministic.

    Plans of more than `CHUNK_PACKS` packs are drained in chunks of about that many packs (every
    chunk a mix of the emptiest and the fullest), so the work grows linearly with the plan.

    >>> plan = PackPlan(order=np.array([0, 1, 2, 3]), offsets=np.array([0, 2, 3, 4]))
    >>> [pack.tolist() for pack in drain_packs(np.array([5, 3, 2, 5]), 10, plan)]
    [[0, 1, 2], [3]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(plan) < 2:
        return plan
    step = math.gcd(int(np.gcd.reduce(lengths)), int(pack_size)) or 1  # e.g. 8 for aligned lengths
    sizes, capacity = lengths // step, int(pack_size) // step
    if capacity > DRAIN_MAX_CAPACITY or len(plan) <= least_packs(sizes, capacity):
        return plan
    packs = [plan[p].tolist() for p in range(len(plan))]
    size = sizes.tolist()
    chunks = -(-len(plan) // CHUNK_PACKS)
    by_load = np.argsort(plan.pack_loads(sizes), kind="stable")
    emptied = False
    for chunk in range(chunks):
        members = np.sort(by_load[chunk::chunks]).tolist()
        search = _Drain([packs[p] for p in members], size, capacity)
        chunk_sizes = sizes[np.concatenate([plan[p] for p in members])]
        if search.run(least_packs(chunk_sizes, capacity), REFILLS_PER_PACK * len(members)):
            emptied = True
            for p, refilled in zip(members, search.packs, strict=True):
                packs[p] = refilled
    if not emptied:
        return plan
    packs = [members for members in packs if members]
    order = np.array([unit for members in packs for unit in members], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(members) for members in packs])]).astype(np.int64)
    return PackPlan(order=order, offsets=offsets)


def _subset_sums(lengths: list[int], capacity: int) -> np.ndarray:
    """Every sum of a subset of ``lengths`` up to ``capacity``, ascending (0 included).

    >>> _subset_sums([3, 5], 10).tolist()
    [0, 3, 5, 8]
    """
    if len(lengths) <= 6:  # a few dozen sums: Python beats numpy's per-call cost
        sums = {0}
        for length in lengths:
            sums |= {total + length for total in sums if total + length <= capacity}
        return np.array(sorted(sums), dtype=np.int64)
    if len(lengths) <= ENUMERATED_UP_TO:  # 2**n sums directly: cheaper than a bitset of capacity bits
        sums = np.zeros(1, dtype=np.int64)
        for length in lengths:
            sums = np.concatenate([sums, sums + length])
        return np.unique(sums[sums <= capacity])
    mask, reach = (1 << (capacity + 1)) - 1, 1
    for length in lengths:
        reach |= (reach << length) & mask
    raw = np.frombuffer(reach.to_bytes(capacity // 8 + 1, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).astype(np.int64)


def _fullest(lengths: list[int], capacity: int) -> list[int]:
    """`best_subset` (the fullest subset, the earliest candidates preferred), by listing all ``2**n``
    subsets when there are few: subset ``m`` holds candidate ``j`` when bit ``j`` of ``m`` is set, so
    the smallest ``m`` of the largest sum is the one `best_subset` returns.

    >>> _fullest([5, 4, 4, 3], 12), _fullest([9, 7], 6)
    ([0, 1, 3], [])
    """
    if len(lengths) > ENUMERATED_UP_TO:
        return best_subset(lengths, capacity)
    sums = np.zeros(1, dtype=np.int64)
    for length in lengths:
        sums = np.concatenate([sums, sums + length])
    sums[sums > capacity] = -1
    mask = int(np.argmax(sums))  # the first of the largest
    return [j for j in range(len(lengths)) if mask >> j & 1]


class _Drain:
    """The search's state: the packs (lists of unit indices), their loads, and every pack's removals.

    A *removal* of pack ``p`` is the sum ``a`` of a subset of its units that a refill might take out
    of it: none, one unit, or two (packs of up to `PAIR_REMOVALS_UP_TO` units). A refill with a
    drained pack ``q`` that puts in a subset of ``q`` summing to ``b`` makes ``p`` fuller than both
    packs were when ``b - a`` exceeds ``max(0, load_q - load_p)`` and fits ``p``'s room. The
    removals sit in flat arrays, each with ``a - load_p`` (``base``) and ``a + room_p`` (``upper``),
    so that one numpy pass finds every pack that can take more of ``q``. A pack's entries are
    appended anew when it changes; the old ones are marked dead (``a`` above the capacity, which no
    subset sum of a pack reaches) and dropped once a third of the entries are dead.
    """

    def __init__(self, packs: list[list[int]], size: list[int], capacity: int):
        self.packs, self.size, self.capacity = [list(members) for members in packs], size, capacity
        self.loads = np.array([sum(size[u] for u in members) for members in packs], dtype=np.int64)
        self.longest = np.array([max((size[u] for u in members), default=0) for members in packs], np.int64)
        self.counts = np.array([len(members) for members in packs], dtype=np.int64)
        self.alive = len(packs)
        entries = [self._removals(members) for members in self.packs]
        self.count = np.array([len(e) for e in entries], dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(self.count)[:-1]]).astype(np.int64)
        self.used = int(self.count.sum())
        room = 2 * self.used + 64
        self.removed = np.zeros(room, dtype=np.int64)
        self.owner = np.zeros(room, dtype=np.int64)
        self.removed[: self.used] = np.concatenate(entries)
        self.owner[: self.used] = np.repeat(np.arange(len(packs), dtype=np.int64), self.count)
        self.base = self.removed - self.loads[self.owner]
        self.upper = self.base + capacity
        self.dead = 0

    def _removals(self, members: list[int]) -> np.ndarray:
        values = [self.size[u] for u in members]
        if len(values) > PAIR_REMOVALS_UP_TO:
            return np.array([0, *values], dtype=np.int64)
        pairs = [a + b for i, a in enumerate(values) for b in values[i + 1 :]]
        return np.array([0, *values, *pairs], dtype=np.int64)

    def _rewrite(self, pack: int) -> None:
        """Mark ``pack``'s removals dead and append its current ones (none once it is empty)."""
        start, count = self.start[pack], self.count[pack]
        self.removed[start : start + count] = self.capacity + 1
        self.dead += int(count)
        new = self._removals(self.packs[pack]) if self.packs[pack] else np.zeros(0, dtype=np.int64)
        if 3 * self.dead > self.used or self.used + len(new) > len(self.removed):
            self._compact(len(new))
        end = self.used + len(new)
        self.removed[self.used : end] = new
        self.owner[self.used : end] = pack
        self.base[self.used : end] = new - self.loads[pack]
        self.upper[self.used : end] = new - self.loads[pack] + self.capacity
        self.start[pack], self.count[pack], self.used = self.used, len(new), end

    def _compact(self, more: int) -> None:
        """Drop the dead entries, with room for ``more`` new ones."""
        live = np.flatnonzero(self.removed[: self.used] <= self.capacity)
        room = max(len(self.removed), 2 * (len(live) + more) + 64)
        arrays = []
        for values in (self.removed, self.owner, self.base, self.upper):
            kept = np.zeros(room, dtype=np.int64)
            kept[: len(live)] = values[live]
            arrays.append(kept)
        self.removed, self.owner, self.base, self.upper = arrays
        self.used, self.dead = len(live), 0
        # every pack's live entries are one run, in order: its start is where its owner begins
        owner = self.owner[: self.used]
        firsts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]]) if self.used else live
        self.start[owner[firsts]] = firsts

    def _hits(self, q: int, reach: np.ndarray, entries: slice | np.ndarray) -> np.ndarray:
        """Which of the ``entries`` let a refill with pack ``q`` (subset sums ``reach``, ascending)
        make their pack fuller than both packs were: positions into ``entries``."""
        removed = self.removed[entries]
        least = np.maximum(removed, self.base[entries] + self.loads[q])  # b must exceed it
        k = np.searchsorted(reach, least, side="right")
        found = np.flatnonzero(k < len(reach))
        fits = reach[k[found]] <= self.upper[entries][found]
        hits = found[fits]
        return hits[self.owner[entries][hits] != q]

    def _reach(self, q: int) -> np.ndarray:
        return _subset_sums([self.size[u] for u in self.packs[q]], self.capacity)

    def _refill(self, p: int, q: int) -> bool:
        """Refill packs ``p`` and ``q``: ``p`` the fullest subset of both, ``q`` the rest; whether
        ``p`` ends fuller than both were (else nothing changes)."""
        size = self.size
        merged = sorted(self.packs[p] + self.packs[q], key=lambda u: (-size[u], u))
        picked = _fullest([size[u] for u in merged], self.capacity)
        load = sum(size[merged[i]] for i in picked)
        if load <= max(self.loads[p], self.loads[q]):
            return False
        chosen = set(picked) | {i for i, u in enumerate(merged) if size[u] == 0}  # free riders: to p
        self.packs[p] = [u for i, u in enumerate(merged) if i in chosen]
        self.packs[q] = [u for i, u in enumerate(merged) if i not in chosen]
        self.counts[p], self.counts[q] = len(self.packs[p]), len(self.packs[q])
        self.loads[q] = self.loads[p] + self.loads[q] - load
        self.loads[p] = load
        self.longest[p] = size[self.packs[p][0]]  # longest first
        self.longest[q] = size[self.packs[q][0]] if self.packs[q] else 0
        self._rewrite(p)
        self._rewrite(q)
        return True

    def _drain(self, q: int, budget: int) -> tuple[bool, int]:
        """Refill ``q`` with every pack that can take more of it (the one that can take the most tokens
        first, then the fullest) until none can or ``q`` is empty; whether one could, and the budget
        left."""
        reach = self._reach(q)
        hits = self._hits(q, reach, slice(0, self.used))
        # rows: owner, removed, base, upper of every hit; the most tokens a pack can take first
        rows = np.stack([self.owner[hits], self.removed[hits], self.base[hits], self.upper[hits]])
        most = reach[np.searchsorted(reach, rows[3], side="right") - 1] - rows[1]
        rows = rows[:, np.lexsort((-self.loads[rows[0]], -most))]
        changed = False
        while rows.shape[1] and budget > 0:
            p = int(rows[0, 0])
            rows = rows[:, rows[0] != p]
            budget -= 1
            if not self._refill(p, q):
                continue
            changed = True
            if not self.packs[q]:
                self.alive -= 1
                break
            # q changed: keep the candidates that still let their pack take more of it
            reach = self._reach(q)
            k = np.searchsorted(reach, np.maximum(rows[1], rows[2] + self.loads[q]), side="right")
            rows = rows[:, (k < len(reach)) & (reach[np.minimum(k, len(reach) - 1)] <= rows[3])]
        return changed, budget

    def run(self, floor: int, budget: int) -> bool:
        """Drain the `DRAINED_PER_SWEEP` emptiest packs, sweep after sweep, until ``floor`` packs are
        left, `PATIENCE` sweeps in a row empty none, or ``budget`` refills were tried; whether a pack
        was emptied."""
        half, start, quiet = self.capacity // 2, self.alive, 0
        while self.alive > floor and quiet < PATIENCE and budget > 0:
            # a pack holding a unit over half a pack can never be emptied for good: drained last
            live = np.flatnonzero(self.counts > 0)
            rank = self.loads[live] + (self.longest[live] > half) * (self.capacity + 1)
            before, changed = self.alive, False
            for q in live[np.argsort(rank, kind="stable")[:DRAINED_PER_SWEEP]].tolist():
                drained, budget = self._drain(q, budget)
                changed |= drained
                if self.alive <= floor or budget <= 0:
                    break
            quiet = 0 if self.alive < before else quiet + 1
            if not changed:
                break
        return self.alive < start
