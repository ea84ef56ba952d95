"""The compute cost of preference units under a `CostModel`: what a unit adds to the cost of its pack.

A `CostModel` prices a pack as ``linear * sum(s) + quadratic * sum(s**2) + per_sequence * len(s)``
over its THD sequences of aligned lengths ``s`` (`tightpack.core.cost_model`). A unit of the
``pairs`` layout is G such sequences, so that formula prices it directly. A unit of the
``shared-prefix`` layout is one sequence whose branches never attend to each other: its attention
work is below ``s**2`` (`tightpack.core.preference_units.unit_attention_costs` counts it), so the
quadratic term takes that work instead. `unit_costs` gives both, one value per unit, so that the
cost of a pack of whole units is the sum of its units' costs, as the online packer's cost cap
(`tightpack.runtime.online_preference`) and `tightpack.core.capped_fill` count it.
"""

from __future__ import annotations

import numpy as np

from tightpack.core.cost_model import CostModel
from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits, unit_attention_costs, unit_sizes
from tightpack.errors import check_choice

__all__ = ["unit_costs"]


def unit_costs(
    units: PreferenceUnits, layout: Layout, cost_model: CostModel, *, pad_to_multiple_of: int = 1
) -> np.ndarray:
    """The cost of every unit in ``layout``, float64 ``[N]``, in ``cost_model``'s unit.

    ``linear`` times the unit's tokens (`unit_sizes`, alignment included), plus ``quadratic`` times its
    attention work (`unit_attention_costs`: a sequence of ``s`` tokens is ``s**2``; a shared-prefix
    branch sees the prompt and itself, not its siblings), plus ``per_sequence`` times its THD
    sequences (G for ``pairs``, 1 for ``shared-prefix``).

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> model = CostModel(linear=1.0, quadratic=1.0, per_sequence=10.0, unit="seconds")
    >>> unit_costs(units, "pairs", model).tolist()  # sequences of 5 and 4 tokens: 9 + 25 + 16 + 2 * 10
    [70.0]
    >>> unit_costs(units, "shared-prefix", model).tolist()  # 7 tokens, attention 37, one sequence
    [54.0]
    >>> float(model.sequence_costs([5, 4]).sum())  # pairs: what the cost model gives the two sequences
    70.0
    """
    check_choice("layout", layout, LAYOUTS)
    sizes = unit_sizes(units, layout, pad_to_multiple_of).astype(np.float64)
    attention = unit_attention_costs(units, layout, pad_to_multiple_of).astype(np.float64)
    sequences = units.branches_per_unit if layout == "pairs" else np.ones(len(units), dtype=np.int64)
    return cost_model.linear * sizes + cost_model.quadratic * attention + cost_model.per_sequence * sequences
