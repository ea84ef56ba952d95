"""Preference units (`tightpack.core.preference_units.PreferenceUnits`) -> one packed THD row ``[1, T]``.

`build_preference_row` lays the units of a micro-batch out in one of two layouts:

- ``pairs``: every branch is a sequence ``prompt + branch`` of its own; the THD boundaries are the
  branches, and plain block-diagonal attention (every varlen kernel) keeps them apart.
- ``shared-prefix``: every unit is one document, the prompt less its last token once, then each
  branch, which starts with the prompt's last token. ``branch_ids`` (per token) says which branch a
  token is in, -1 for the shared prompt: a token attends to the earlier tokens of its document that
  are shared or of its own branch, never to a sibling branch (`tightpack.runtime.masks` builds the
  masks). Positions continue the prompt in every branch. The boundaries are the units, so a kernel
  that reads only ``cu_seqlens`` cannot run this layout (`tightpack.runtime.thd.check_block_diagonal`).

In both layouts a branch's sequence is the same tokens (``prompt + branch``, at the same positions)
with the same labels, shifted within the branch: token ``t`` predicts ``t + 1``. The keys beside the
THD contract's (docs/contract.md):

==========================  ===================  ============================================================
key                         shape, dtype         meaning
==========================  ===================  ============================================================
``branch_unit``             ``[NB]`` int32       the unit of every branch (0, 0, 1, 1, ... for pairs)
``branch_index``            ``[NB]`` int32       its place in the unit: 0 = ``chosen``, 1 = ``rejected``
``branch_group_size``       ``[NB]`` int32       the branches of its unit (2 for a pair): a unit is whole
``branch_prompt_length``    ``[NB]`` int32       prompt tokens before the branch's own tokens
``branch_ids``              ``[1, T]`` int32     shared-prefix only: the branch of every token, -1 = prompt
``branch_label``            ``[NB]`` bool        KTO: desirable or not (when the units have labels)
``branch_reward``           ``[NB]`` float32     groups: each completion's reward (when given)
``branch_advantage``        ``[NB]`` float32     groups: each completion's advantage (when given)
``preference_layout``       str                  ``pairs`` or ``shared-prefix``
==========================  ===================  ============================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tightpack.core.preference_layout import UnitRow, lay_out_units
from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits
from tightpack.errors import TightpackError, check_choice
from tightpack.runtime import thd

__all__ = ["build_preference_row"]

PER_BRANCH_KEYS = {"labels": "branch_label", "rewards": "branch_reward", "advantages": "branch_advantage"}
"""The optional per-branch values of `PreferenceUnits` and the batch keys that carry them."""


def build_preference_row(
    units: PreferenceUnits,
    layout: Layout = "pairs",
    *,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """One packed row ``[1, T]`` of ``units`` in ``layout`` (the module docstring has the keys).

    Each THD sequence (a branch for ``pairs``, a unit for ``shared-prefix``) is aligned to a multiple
    of ``pad_to_multiple_of``; the alignment tail gets ``pad_token_id``, labels ``ignore_index`` and
    positions going on from the sequence's last, as `tightpack.runtime.in_batch.build_thd_from_rows`.

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> pairs = build_preference_row(units, "pairs")
    >>> pairs["input_ids"].tolist(), pairs["cu_seqlens_q"].tolist()
    ([[1, 2, 3, 7, 8, 1, 2, 3, 9]], [0, 5, 9])
    >>> shared = build_preference_row(units, "shared-prefix")
    >>> shared["input_ids"].tolist(), shared["position_ids"].tolist(), shared["branch_ids"].tolist()
    ([[1, 2, 3, 7, 8, 3, 9]], [[0, 1, 2, 3, 4, 2, 3]], [[-1, -1, 0, 0, 0, 1, 1]])
    >>> shared["labels"].tolist() == [[-100, -100, 7, 8, -100, 9, -100]]
    True
    """
    check_choice("layout", layout, LAYOUTS)
    if len(units) == 0:
        raise TightpackError("build_preference_row needs at least one unit")
    row = lay_out_units(units, layout, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)
    return preference_batch(row, units, layout, ignore_index=ignore_index)


def preference_batch(
    row: UnitRow, units: PreferenceUnits, layout: Layout, *, ignore_index: int = -100
) -> dict[str, Any]:
    """The batch of a laid-out row (`tightpack.core.preference_layout.lay_out_units`) of ``units``."""
    width = len(row.tokens)
    labels = np.full(width, ignore_index, dtype=np.int64)
    labels[:-1][row.trained[:-1]] = row.tokens[1:][row.trained[:-1]]
    real_start, physical_start = row.real_starts, row.sequence_starts
    logical = torch.from_numpy(real_start.astype(np.int32))
    batch: dict[str, Any] = {
        "input_ids": torch.from_numpy(row.tokens)[None],
        "labels": torch.from_numpy(labels)[None],
        "loss_mask": torch.from_numpy(row.trained.astype(np.float32))[None],
        "position_ids": torch.from_numpy(row.positions)[None],
        "cu_seqlens_q": logical,
        "cu_seqlens_kv": logical,
    }
    if row.padding.any():
        padded = torch.from_numpy(physical_start.astype(np.int32))
        batch["cu_seqlens_q_padded"] = batch["cu_seqlens_kv_padded"] = padded
        batch["padding_mask"] = torch.from_numpy(row.padding)[None]
    longest = torch.tensor(int(np.diff(physical_start).max()), dtype=torch.int32)
    batch["max_seqlen_q"] = batch["max_seqlen_kv"] = longest
    batch["tokens"] = batch["input_ids"]
    batch["token_count"] = row.sequence_lengths.tolist()
    batch["total_tokens"] = width
    batch["branch_unit"] = torch.from_numpy(units.branch_unit.astype(np.int32))
    batch["branch_index"] = torch.from_numpy(units.branch_index.astype(np.int32))
    group_size = units.branches_per_unit[units.branch_unit]
    batch["branch_group_size"] = torch.from_numpy(group_size.astype(np.int32))
    prompt_of_branch = units.prompt_lengths[units.branch_unit]
    batch["branch_prompt_length"] = torch.from_numpy(prompt_of_branch.astype(np.int32))
    if layout == "shared-prefix":
        batch["branch_ids"] = torch.from_numpy(row.branch.astype(np.int32))[None]
    for name, value in units.per_branch().items():
        batch[PER_BRANCH_KEYS[name]] = torch.tensor(value)
    batch["preference_layout"] = layout
    thd.check_thd_batch(batch)
    return batch
