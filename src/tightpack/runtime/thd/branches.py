"""The preference keys of a THD batch (pairs and groups, `tightpack.runtime.preference_batch`): their
check, and the guard of consumers that read only the boundaries.

`validate_branches` is what `tightpack.runtime.thd.validate_thd_batch` runs on a batch with
``branch_unit``: every unit whole and its branches adjacent, numbered in order, and in the
shared-prefix layout (``branch_ids``) every branch inside its own unit's document, after the shared
prompt, in one run, at positions that continue the prompt. These are the corruptions that let a
branch see its sibling or lose its prompt (open-instruct #1466's ``cu_seq_lens`` offset is one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from tightpack.runtime.thd.access import logical_boundaries, physical_boundaries
from tightpack.runtime.thd.contract import ThdBatchError

__all__ = ["BRANCH_KEYS", "check_block_diagonal", "validate_branches"]

BRANCH_KEYS = ("branch_unit", "branch_index", "branch_group_size", "branch_prompt_length")
"""The per-branch keys every preference batch carries, int32 ``[NB]``."""
OPTIONAL_BRANCH_KEYS = {
    "branch_label": torch.bool,
    "branch_reward": torch.float32,
    "branch_advantage": torch.float32,
}


def _fail(message: str) -> NoReturn:
    raise ThdBatchError(message)


def check_block_diagonal(batch: Mapping[str, Any], consumer: str) -> None:
    """Refuse a shared-prefix row (``branch_ids``) in ``consumer``, which reads only the boundaries:
    the boundaries of that layout are whole units, so its branches would attend to their siblings."""
    if batch.get("branch_ids") is not None:
        raise ThdBatchError(
            f"{consumer} reads only the boundaries (cu_seqlens), which cannot keep the branches of a "
            "shared-prefix row apart: a branch would attend to its siblings. Build the row with "
            "layout='pairs' for this consumer, or run the shared-prefix row with a mask "
            "(tightpack.runtime.masks.sdpa_mask / additive_mask / flex_block_mask)"
        )


def _first_difference(values: torch.Tensor, expected: torch.Tensor) -> int:
    return int(torch.nonzero(values != expected)[0, 0])


def validate_branches(batch: Mapping[str, Any]) -> None:
    """Check the preference keys of ``batch``; raise `ThdBatchError` naming the key and the branch."""
    tables = {}
    for key in BRANCH_KEYS:
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int32 or value.dim() != 1:
            got = (
                type(value).__name__
                if not isinstance(value, torch.Tensor)
                else f"{value.dtype} {tuple(value.shape)}"
            )
            _fail(
                f"{key} must be an int32 [NB] tensor (one value per branch) in a preference batch, got {got}"
            )
        tables[key] = value.long().cpu()
    count = len(tables["branch_unit"])
    if count == 0 or any(len(value) != count for value in tables.values()):
        _fail(
            f"the per-branch keys must hold one value per branch; lengths {[len(v) for v in tables.values()]}"
        )
    for key, dtype in OPTIONAL_BRANCH_KEYS.items():
        value = batch.get(key)
        if value is not None and (
            not isinstance(value, torch.Tensor) or value.shape != (count,) or value.dtype != dtype
        ):
            _fail(f"{key} must be a {dtype} [{count}] tensor (one value per branch)")
    unit, index, size = tables["branch_unit"], tables["branch_index"], tables["branch_group_size"]
    starts = torch.ones(count, dtype=torch.bool)
    starts[1:] = unit[1:] != unit[:-1]
    expected_unit = torch.cumsum(starts.long(), 0) - 1
    if not torch.equal(unit, expected_unit):
        b = _first_difference(unit, expected_unit)
        _fail(
            f"branch_unit must number the units 0, 1, 2, ... with each unit's branches adjacent; branch {b} "
            f"has unit {int(unit[b])} where {int(expected_unit[b])} was expected"
        )
    first = torch.nonzero(starts).reshape(-1)
    counts = torch.diff(torch.cat([first, torch.tensor([count])]))
    expected_index = torch.arange(count) - torch.repeat_interleave(first, counts)
    if not torch.equal(index, expected_index):
        b = _first_difference(index, expected_index)
        _fail(f"branch_index must count 0, 1, ... within each unit; branch {b} has {int(index[b])}")
    expected_size = torch.repeat_interleave(counts, counts)
    if not torch.equal(size, expected_size):
        b = _first_difference(size, expected_size)
        _fail(
            f"unit {int(unit[b])} is not whole: branch_group_size says {int(size[b])} branches but the batch "
            f"holds {int(expected_size[b])} of them (a pair or group split across rows or packs)"
        )
    prompt = tables["branch_prompt_length"]
    if (prompt < 1).any() or not torch.equal(prompt, prompt[first].repeat_interleave(counts)):
        _fail(
            "branch_prompt_length must be >= 1 and one value for all branches of a unit (they share a prompt)"
        )
    layout = batch.get("preference_layout")
    shared = batch.get("branch_ids") is not None
    if layout is not None and layout != ("shared-prefix" if shared else "pairs"):
        _fail(f"preference_layout is {layout!r} but the batch {'has' if shared else 'has no'} branch_ids")
    if shared:
        _validate_shared_prefix(batch, unit, prompt, len(first))
    else:
        _validate_pairs(batch, unit, prompt, count)


def _positions(batch: Mapping[str, Any]) -> torch.Tensor | None:
    positions = batch.get("position_ids")
    return None if positions is None else positions.reshape(-1).long().cpu()


def _validate_pairs(batch: Mapping[str, Any], unit: torch.Tensor, prompt: torch.Tensor, count: int) -> None:
    """Pairs: one sequence per branch, each longer than its prompt, siblings starting with one prompt."""
    logical = logical_boundaries(batch).long().cpu()
    physical = physical_boundaries(batch).long().cpu()
    if len(logical) - 1 != count:
        _fail(
            f"a pairs-layout batch has one sequence per branch: {count} branches but cu_seqlens_q has "
            f"{len(logical) - 1} sequences"
        )
    lengths = logical.diff()
    short = torch.nonzero(lengths <= prompt).reshape(-1)
    if len(short):
        b = int(short[0])
        _fail(f"branch {b} has {int(lengths[b])} tokens, no more than its prompt of {int(prompt[b])}")
    tokens = batch["input_ids"] if batch.get("input_ids") is not None else batch.get("tokens")
    if tokens is None:
        return
    tokens = tokens.reshape(-1).cpu()
    later = torch.nonzero(unit[1:] == unit[:-1]).reshape(-1) + 1  # branches with a sibling before them
    n = prompt[later]
    offsets = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    of_branch = torch.repeat_interleave(later, n)
    here, before = physical[of_branch] + offsets, physical[of_branch - 1] + offsets
    differ = torch.nonzero(tokens[here] != tokens[before]).reshape(-1)
    if len(differ):
        b = int(of_branch[differ[0]])
        _fail(f"branch {b} does not start with the prompt of its sibling {b - 1} (unit {int(unit[b])})")


def _validate_shared_prefix(
    batch: Mapping[str, Any], unit: torch.Tensor, prompt: torch.Tensor, units: int
) -> None:
    """Shared prefix: one sequence per unit: its shared prompt, then each of its branches in one run."""
    branches = batch["branch_ids"]
    if branches.dtype != torch.int32:
        _fail(f"branch_ids must be int32, got {branches.dtype}")
    branch_of = branches.reshape(-1).long().cpu()
    physical = physical_boundaries(batch).long().cpu()
    logical = logical_boundaries(batch).long().cpu()
    if len(physical) - 1 != units:
        _fail(
            f"a shared-prefix batch has one sequence per unit: {units} units but the boundaries hold "
            f"{len(physical) - 1} sequences"
        )
    if len(branch_of) != int(physical[-1]):
        _fail(f"branch_ids holds {len(branch_of)} tokens, the row {int(physical[-1])}")
    count = len(unit)
    if ((branch_of < -1) | (branch_of >= count)).any():
        _fail(f"branch_ids must be -1 (shared prompt) or a branch 0..{count - 1}")
    document = torch.repeat_interleave(torch.arange(units), physical.diff())
    owned = branch_of >= 0
    wrong = torch.nonzero(owned & (unit[branch_of.clamp(min=0)] != document)).reshape(-1)
    if len(wrong):
        t = int(wrong[0])
        _fail(
            f"token {t} of branch {int(branch_of[t])} (unit {int(unit[branch_of[t]])}) lies in the sequence "
            f"of unit {int(document[t])}: a branch must lie inside its own unit's sequence"
        )
    # within a sequence: -1 first, then branches in increasing order, each one run
    key = torch.where(owned, branch_of, -1)
    same_document = document[1:] == document[:-1]
    if (same_document & (key[1:] < key[:-1])).any():
        t = int(torch.nonzero(same_document & (key[1:] < key[:-1]))[0, 0]) + 1
        _fail(
            f"token {t} of unit {int(document[t])} has branch_ids {int(branch_of[t])} after a later branch's "
            "tokens (the shared prompt comes first, then each branch in one run)"
        )
    shared = torch.bincount(document[~owned], minlength=units)
    first_branch = torch.nonzero(torch.cat([torch.tensor([True]), unit[1:] != unit[:-1]])).reshape(-1)
    expected_shared = prompt[first_branch] - 1
    if not torch.equal(shared, expected_shared):
        u = _first_difference(shared, expected_shared)
        _fail(
            f"unit {u} has {int(shared[u])} shared prompt tokens; its branch_prompt_length "
            f"{int(prompt[first_branch[u]])} makes {int(expected_shared[u])} (the prompt less its last token)"
        )
    present = torch.bincount(branch_of[owned], minlength=count)
    if (present == 0).any():
        _fail(f"branch {int(torch.nonzero(present == 0)[0, 0])} has no token in branch_ids")
    positions = _positions(batch)
    if positions is None:
        return
    real = torch.arange(len(branch_of)) - physical[:-1][document] < logical.diff()[document]
    begins = torch.ones(len(branch_of), dtype=torch.bool)
    begins[1:] = (branch_of[1:] != branch_of[:-1]) | ~same_document
    first_position = torch.where(owned, prompt[branch_of.clamp(min=0)] - 1, 0)
    run = torch.cumsum(begins.long(), 0) - 1
    run_start = torch.nonzero(begins).reshape(-1)
    expected = first_position[run_start][run] + torch.arange(len(branch_of)) - run_start[run]
    bad = torch.nonzero(real & (positions != expected)).reshape(-1)
    if len(bad):
        t = int(bad[0])
        where = f"branch {int(branch_of[t])}" if owned[t] else "the shared prompt"
        _fail(
            f"position_ids[{t}] is {int(positions[t])} in {where} of unit {int(document[t])}, expected "
            f"{int(expected[t])}: the shared prompt counts 0, 1, ... and every branch continues it from "
            "the prompt's last token"
        )
