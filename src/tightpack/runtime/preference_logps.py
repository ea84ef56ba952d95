"""Per-branch log-probabilities from one packed preference row, and the DPO-family losses on them.

`sequence_logps` sums the target log-probabilities of every branch of a row built by
`tightpack.runtime.preference_batch.build_preference_row`, in either layout, in one gather and one
``index_add`` (no loop per sequence). `chosen_rejected` pairs them per unit, `grouped` lays a row of
groups out as ``[units, G]``. `dpo_loss` is the sigmoid DPO loss; any other objective takes the same
per-branch sums (or ``means`` for length-normalised ones: SimPO, IPO).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.runtime import thd
from tightpack.runtime.loss import token_losses

__all__ = ["BranchLogps", "chosen_rejected", "dpo_loss", "grouped", "sequence_logps"]


@dataclass(frozen=True)
class BranchLogps:
    """Per-branch figures ``[NB]``: ``sums`` of target log-probabilities, ``tokens`` (targets counted),
    ``means`` (sums / tokens). At least float32, in the logits' dtype when wider (float64 stays)."""

    sums: torch.Tensor
    tokens: torch.Tensor

    @property
    def means(self) -> torch.Tensor:
        return self.sums / self.tokens.clamp(min=1)


def _token_branches(batch: Mapping[str, Any], width: int) -> torch.Tensor:
    """The branch of every token ``[T]``: ``branch_ids`` (shared prefix), else its sequence (pairs)."""
    branches = batch.get("branch_ids")
    if branches is not None:
        return branches.reshape(-1).long()
    bounds = thd.physical_boundaries(batch).long()
    sequences = torch.arange(len(bounds) - 1, device=bounds.device)
    return torch.repeat_interleave(sequences, bounds.diff(), output_size=width)


def sequence_logps(
    logits: torch.Tensor, batch: Mapping[str, Any], *, ignore_index: int = -100
) -> BranchLogps:
    """Sum the log-probability of every branch's targets (``labels`` not ``ignore_index``).

    Args:
        logits: ``[1, T, V]`` or ``[T, V]``, position ``t`` predicting ``labels[t]``.
        batch: the preference row (``labels`` ``[1, T]``, ``branch_unit``; ``branch_ids`` for a
            shared-prefix row).

    >>> from tightpack.core.preference_units import PreferenceUnits
    >>> from tightpack.runtime.preference_batch import build_preference_row
    >>> batch = build_preference_row(PreferenceUnits.from_lists([[1, 2]], [[3, 4], [5]], [2]))
    >>> logps = sequence_logps(torch.zeros(1, 7, 8), batch)  # uniform over 8 tokens
    >>> logps.tokens.tolist(), [round(v, 4) for v in logps.sums.tolist()]
    ([2, 1], [-4.1589, -2.0794])
    """
    if batch.get("branch_unit") is None:
        raise TightpackError(
            "sequence_logps needs a preference row (branch_unit, ...): build it with "
            "tightpack.runtime.preference_batch.build_preference_row"
        )
    labels = batch["labels"].reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] != labels.shape[0]:
        raise TightpackError(f"logits hold {flat.shape[0]} positions, the row {labels.shape[0]} labels")
    count = len(batch["branch_unit"])
    branch = _token_branches(batch, len(labels)).to(flat.device)
    trained = labels.to(flat.device) != ignore_index
    logps = -token_losses(flat, labels.to(flat.device), ignore_index)
    sums = torch.zeros(count, dtype=logps.dtype, device=flat.device).index_add(
        0, branch[trained], logps[trained]
    )
    tokens = torch.zeros(count, dtype=torch.long, device=flat.device)
    tokens = tokens.index_add(0, branch[trained], torch.ones_like(branch[trained]))
    return BranchLogps(sums, tokens)


def chosen_rejected(values: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)``, each ``[units]``, of per-branch ``values`` ``[NB]`` of a row of pairs.

    Raises:
        TightpackError: when a unit of the row is not a pair.
    """
    size = batch["branch_group_size"].to(values.device)
    if (size != 2).any():
        raise TightpackError("chosen_rejected takes a row of pairs; this row has units of other sizes")
    index = batch["branch_index"].to(values.device)
    return values[index == 0], values[index == 1]


def grouped(values: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """Per-branch ``values`` ``[NB]`` of a row of groups as ``[units, G]`` (every group of size G)."""
    size = batch["branch_group_size"]
    if len(torch.unique(size)) != 1:
        raise TightpackError(
            f"grouped needs groups of one size; this row has sizes {torch.unique(size).tolist()}"
        )
    return values.reshape(-1, int(size[0]))


def dpo_loss(
    policy: BranchLogps | torch.Tensor,
    reference: BranchLogps | torch.Tensor,
    batch: Mapping[str, Any],
    *,
    beta: float = 0.1,
) -> torch.Tensor:
    """The sigmoid DPO loss of every pair ``[units]``: ``-log sigmoid(beta * (policy margin -
    reference margin))``, margins ``chosen - rejected`` of the summed log-probabilities."""
    policy_sums = policy.sums if isinstance(policy, BranchLogps) else policy
    reference_sums = reference.sums if isinstance(reference, BranchLogps) else reference
    policy_chosen, policy_rejected = chosen_rejected(policy_sums, batch)
    reference_chosen, reference_rejected = chosen_rejected(reference_sums.to(policy_sums), batch)
    margin = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    return -torch.nn.functional.logsigmoid(beta * margin)
