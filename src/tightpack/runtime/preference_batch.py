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

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits, concatenated_ranges
from tightpack.errors import TightpackError, check_choice
from tightpack.runtime import thd

__all__ = ["build_preference_row"]

PER_BRANCH_KEYS = {"labels": "branch_label", "rewards": "branch_reward", "advantages": "branch_advantage"}
"""The optional per-branch values of `PreferenceUnits` and the batch keys that carry them."""


def _pieces(units: PreferenceUnits, layout: Layout) -> dict[str, np.ndarray]:
    """The row as consecutive pieces, each a run of source tokens: where it starts in the source
    (the prompts, then the branches), its length, its first position, its shift segment (labels
    shift within one), its branch (-1: shared) and its document (a THD sequence)."""
    prompts = units.prompt_lengths
    branch_unit = units.branch_unit
    n_branches = len(branch_unit)
    prompt_start = units.prompt_offsets[:-1]
    branch_start = len(units.prompt_tokens) + units.branch_offsets[:-1]
    branch_prompt = prompts[branch_unit]
    branches = np.arange(n_branches)
    if layout == "pairs":  # per branch: its prompt, then its tokens
        return {
            "start": np.stack([prompt_start[branch_unit], branch_start], 1).ravel(),
            "length": np.stack([branch_prompt, units.branch_lengths], 1).ravel(),
            "position": np.stack([np.zeros(n_branches, np.int64), branch_prompt], 1).ravel(),
            "segment": np.repeat(branches, 2),
            "branch": np.repeat(branches, 2),
            "document": np.repeat(branches, 2),
        }
    # per unit: the shared prompt less its last token, then per branch the last token and the branch
    first_branch = units.unit_offsets[:-1]
    per_branch = np.stack(
        [
            np.stack([prompt_start[branch_unit] + branch_prompt - 1, branch_start], 1),  # start
            np.stack([np.ones(n_branches, np.int64), units.branch_lengths], 1),  # length
            np.stack([branch_prompt - 1, branch_prompt], 1),  # position
        ]
    )  # [3, NB, 2]
    # unit u's pieces: its shared piece, then two per branch; the units before it take u + 2 * first_branch[u]
    slot_of_shared = np.arange(len(units)) + 2 * first_branch
    slot_of_branch = branch_unit + 1 + 2 * branches
    total = len(units) + 2 * n_branches
    start, length, position = (np.zeros(total, np.int64) for _ in range(3))
    segment, branch = np.zeros(total, np.int64), np.full(total, -1, np.int64)
    document = np.zeros(total, np.int64)
    start[slot_of_shared], length[slot_of_shared] = prompt_start, prompts - 1
    segment[slot_of_shared] = n_branches + np.arange(len(units))  # a segment of its own
    document[slot_of_shared] = np.arange(len(units))
    for part in range(2):
        slots = slot_of_branch + part
        start[slots], length[slots], position[slots] = per_branch[:, :, part]
        segment[slots], branch[slots], document[slots] = branches, branches, branch_unit
    return {"start": start, "length": length, "position": position, "segment": segment, "branch": branch,
            "document": document}  # fmt: skip


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
    if pad_to_multiple_of < 1:
        raise TightpackError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    pieces = _pieces(units, layout)
    source = np.concatenate([units.prompt_tokens, units.branch_tokens])
    supervised = np.concatenate([np.zeros(len(units.prompt_tokens), np.int8), units.branch_loss_mask])
    gather = concatenated_ranges(pieces["start"], pieces["length"])
    tokens, mask = source[gather], supervised[gather]
    piece_of_token = np.repeat(np.arange(len(pieces["length"])), pieces["length"])
    piece_first = np.concatenate([[0], np.cumsum(pieces["length"])])[:-1]
    positions = pieces["position"][piece_of_token] + np.arange(len(tokens)) - piece_first[piece_of_token]
    segment, branch = pieces["segment"][piece_of_token], pieces["branch"][piece_of_token]
    document = pieces["document"][piece_of_token]

    # labels: the next token of the same shift segment, where it is supervised
    follows = np.zeros(len(tokens), dtype=bool)
    follows[:-1] = segment[1:] == segment[:-1]
    next_supervised = np.zeros(len(tokens), dtype=bool)
    next_supervised[:-1] = mask[1:] == 1
    trained = follows & next_supervised
    labels = np.full(len(tokens), ignore_index, dtype=np.int64)
    labels[:-1][trained[:-1]] = tokens[1:][trained[:-1]]

    # alignment: every document padded to the multiple, the tail after its real tokens
    real = np.bincount(document, minlength=int(document.max()) + 1)
    physical = ceil_to_multiple(real, pad_to_multiple_of)
    physical_start = np.concatenate([[0], np.cumsum(physical)])
    real_start = np.concatenate([[0], np.cumsum(real)])
    width = int(physical_start[-1])
    destination = physical_start[document] + np.arange(len(tokens)) - real_start[document]
    out_tokens = np.full(width, pad_token_id, dtype=np.int64)
    out_labels = np.full(width, ignore_index, dtype=np.int64)
    out_positions = np.zeros(width, dtype=np.int64)
    out_branch = np.zeros(width, dtype=np.int64)
    out_tokens[destination], out_labels[destination] = tokens, labels
    out_positions[destination], out_branch[destination] = positions, branch
    tail_document = np.repeat(np.arange(len(real)), physical - real)
    tails = concatenated_ranges(physical_start[:-1] + real, physical - real)
    last = destination[real_start[1:] - 1]  # the last real token of every document
    tail_first = (physical_start[:-1] + real)[tail_document]
    out_positions[tails] = out_positions[last][tail_document] + 1 + tails - tail_first
    out_branch[tails] = out_branch[last][tail_document]  # a tail stays inside the last branch

    logical = torch.from_numpy(real_start.astype(np.int32))
    batch: dict[str, Any] = {
        "input_ids": torch.from_numpy(out_tokens)[None],
        "labels": torch.from_numpy(out_labels)[None],
        "loss_mask": torch.from_numpy((out_labels != ignore_index).astype(np.float32))[None],
        "position_ids": torch.from_numpy(out_positions)[None],
        "cu_seqlens_q": logical,
        "cu_seqlens_kv": logical,
    }
    if (physical != real).any():
        padded = torch.from_numpy(physical_start.astype(np.int32))
        batch["cu_seqlens_q_padded"] = batch["cu_seqlens_kv_padded"] = padded
        padding = np.ones(width, dtype=bool)
        padding[destination] = False
        batch["padding_mask"] = torch.from_numpy(padding)[None]
    longest = torch.tensor(int(physical.max()), dtype=torch.int32)
    batch["max_seqlen_q"] = batch["max_seqlen_kv"] = longest
    batch["tokens"] = batch["input_ids"]
    batch["token_count"] = real.tolist()
    batch["total_tokens"] = width
    batch["branch_unit"] = torch.from_numpy(units.branch_unit.astype(np.int32))
    batch["branch_index"] = torch.from_numpy(units.branch_index.astype(np.int32))
    group_size = units.branches_per_unit[units.branch_unit]
    batch["branch_group_size"] = torch.from_numpy(group_size.astype(np.int32))
    prompt_of_branch = units.prompt_lengths[units.branch_unit]
    batch["branch_prompt_length"] = torch.from_numpy(prompt_of_branch.astype(np.int32))
    if layout == "shared-prefix":
        batch["branch_ids"] = torch.from_numpy(out_branch.astype(np.int32))[None]
    for name, value in units.per_branch().items():
        batch[PER_BRANCH_KEYS[name]] = torch.from_numpy(value)
    batch["preference_layout"] = layout
    thd.check_thd_batch(batch)
    return batch
