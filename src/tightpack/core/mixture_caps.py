"""The arithmetic of a mixture's repetition cap in runtime tokens: whether shares fit it at a total
(`fits_cap`), and the mixture nearest the asked shares that reaches a total under it
(`closest_quotas`, `within_caps`), for `tightpack.core.mixture`'s checks and messages.
"""

from __future__ import annotations

import numpy as np

__all__ = ["closest_quotas", "fits_cap", "within_caps"]


def fits_cap(
    targets: np.ndarray, available: np.ndarray, tokens_per_unit: np.ndarray, cap: float, total_tokens: float
) -> bool:
    """Whether a mixture of ``total_tokens`` runtime tokens at the shares ``targets`` (of the measure)
    takes no source past ``cap`` times its ``available`` measure: `resolve_mixture`'s test
    (`tightpack.core.mixture`)."""
    largest = float((cap * available / targets).min())
    return total_tokens / float((targets * tokens_per_unit).sum()) <= largest * (1 + 1e-9)


def within_caps(
    counts: np.ndarray, limits: np.ndarray, tokens_per_unit: np.ndarray, total_tokens: int
) -> np.ndarray | None:
    """``counts`` (integer weights) moved a unit at a time until, as weights of a mixture of
    ``total_tokens`` runtime tokens, no source's quota passes its ``limits``: each move takes a unit
    from the source furthest past its limit and gives it to the source that stays within its own
    with the most runtime tokens per unit (raising every other quota's room). None where a source
    would be left no unit, or the moves do not end within a few per source."""
    counts = counts.copy()
    for _ in range(8 * len(counts) + 32):
        cost = float(counts @ tokens_per_unit)  # runtime tokens of the weights' units
        over = counts * float(total_tokens) / (limits * cost)  # each quota over its limit
        worst = int(np.argmax(over))
        if over[worst] <= 1 and (counts > 0).all():
            return counts
        if (counts == 0).any():  # a share printed as 0: the next decimal
            return None
        if counts[worst] <= 1:
            return None
        moved = cost - tokens_per_unit[worst] + tokens_per_unit
        room = (counts + 1) * float(total_tokens) <= limits * moved
        room[worst] = False
        if not room.any():
            return None
        taker = int(np.flatnonzero(room)[np.argmax(tokens_per_unit[room])])
        counts[worst] -= 1
        counts[taker] += 1
    return None


def closest_quotas(
    targets: np.ndarray, caps: np.ndarray, cost: np.ndarray, total: float
) -> np.ndarray | None:
    """The quotas nearest the shares ``targets`` whose cost (``quotas * cost``) is ``total`` when no
    quota may pass its cap (``caps``): capped sources at their cap, the rest in proportion to their
    targets. None when every source at its cap costs less than ``total``.

    With ``cost`` the runtime tokens per unit of the measure and ``total`` the runtime tokens asked,
    these are the measure of each source in the closest mixture of that many tokens.

    >>> caps = np.array([10.0, 1.0, 10.0])
    >>> closest_quotas(np.array([0.5, 0.3, 0.2]), caps, np.ones(3), 10).round(4).tolist()
    [6.4286, 1.0, 2.5714]
    >>> closest_quotas(np.array([0.5, 0.5]), np.array([10.0, 1.0]), np.array([1.0, 4.0]), 10).tolist()
    [6.0, 1.0]
    >>> print(closest_quotas(np.array([0.5, 0.5]), np.array([10.0, 1.0]), np.array([1.0, 4.0]), 20))
    None
    """
    quotas = np.zeros_like(targets, dtype=np.float64)
    free = np.ones(len(targets), dtype=bool)
    remaining = float(total)
    while free.any():
        proposal = targets * remaining / float((targets[free] * cost[free]).sum())
        over = free & (proposal > caps * (1 + 1e-12))  # a source exactly at its cap is not over it
        if not over.any():
            quotas[free] = proposal[free]
            return quotas
        quotas[over] = caps[over]
        remaining -= float((caps[over] * cost[over]).sum())
        free &= ~over
    return None
