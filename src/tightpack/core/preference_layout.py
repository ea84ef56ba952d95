"""Preference units laid out in one row, as numpy arrays (`lay_out_units`): the arithmetic every
preference row shares, whether collated (`tightpack.runtime.preference_batch`) or written to packed
Parquet (`tightpack.core.preference_parquet`).

Two layouts (`tightpack.core.preference_units.LAYOUTS`):

- ``pairs``: every branch is a THD sequence ``prompt + branch`` of its own.
- ``shared-prefix``: every unit is one THD sequence: the prompt less its last token once, then each
  branch, which starts with the prompt's last token; positions continue the prompt in every branch.

In both, label ``t`` is token ``t + 1`` of the row wherever ``trained[t]`` (the next token is a
supervised token of the same branch), so the row and its label-aligned mask say everything a loss
needs. Each THD sequence is aligned to the multiple by a tail after its real tokens: the pad id, no
label, positions going on, in the sequence's last branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits, concatenated_ranges
from tightpack.errors import TightpackError, check_choice

__all__ = ["UnitRow", "lay_out_units"]


@dataclass(frozen=True)
class UnitRow:
    """One row of preference units (`lay_out_units`), ``T`` tokens, ``S`` THD sequences, ``NB`` branches.

    Attributes:
        tokens: ``[T]`` int64, alignment tails included.
        trained: ``[T]`` bool, label-aligned: ``tokens[t + 1]`` is a target at ``t``.
        positions: ``[T]`` int64 position ids.
        branch: ``[T]`` int64, the branch of every token (its index among the row's branches); -1 for
            a shared prompt (``shared-prefix`` only).
        padding: ``[T]`` bool, the alignment tails.
        sequence_starts: ``[S + 1]`` int64, physical (aligned) boundaries of the THD sequences.
        sequence_lengths: ``[S]`` int64, the real tokens of each.
        branch_starts: ``[NB]`` int64, where each branch's own tokens start in the row.
    """

    tokens: np.ndarray
    trained: np.ndarray
    positions: np.ndarray
    branch: np.ndarray
    padding: np.ndarray
    sequence_starts: np.ndarray
    sequence_lengths: np.ndarray
    branch_starts: np.ndarray

    @property
    def real_starts(self) -> np.ndarray:
        """``[S + 1]`` int64, the boundaries of the sequences without their alignment tails."""
        return np.concatenate([[0], np.cumsum(self.sequence_lengths)])


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


def lay_out_units(
    units: PreferenceUnits, layout: Layout, *, pad_to_multiple_of: int = 1, pad_token_id: int = 0
) -> UnitRow:
    """``units`` in one row in ``layout``, each THD sequence aligned to ``pad_to_multiple_of``.

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> row = lay_out_units(units, "shared-prefix")
    >>> row.tokens.tolist(), row.positions.tolist(), row.branch.tolist()
    ([1, 2, 3, 7, 8, 3, 9], [0, 1, 2, 3, 4, 2, 3], [-1, -1, 0, 0, 0, 1, 1])
    >>> row.trained.astype(int).tolist(), row.branch_starts.tolist()
    ([0, 0, 1, 1, 0, 1, 0], [3, 6])
    >>> lay_out_units(units, "pairs", pad_to_multiple_of=3).sequence_starts.tolist()
    [0, 6, 12]
    """
    check_choice("layout", layout, LAYOUTS)
    if len(units) == 0:
        raise TightpackError("a preference row needs at least one unit")
    if pad_to_multiple_of < 1:
        raise TightpackError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    pieces = _pieces(units, layout)
    source = np.concatenate([units.prompt_tokens, units.branch_tokens]).astype(np.int64, copy=False)
    supervised = np.concatenate([np.zeros(len(units.prompt_tokens), np.int8), units.branch_loss_mask])
    gather = concatenated_ranges(pieces["start"], pieces["length"])
    tokens, mask = source[gather], supervised[gather]
    piece_of_token = np.repeat(np.arange(len(pieces["length"])), pieces["length"])
    piece_first = np.concatenate([[0], np.cumsum(pieces["length"])])[:-1]
    positions = pieces["position"][piece_of_token] + np.arange(len(tokens)) - piece_first[piece_of_token]
    segment, branch = pieces["segment"][piece_of_token], pieces["branch"][piece_of_token]
    document = pieces["document"][piece_of_token]

    # trained: the next token is of the same shift segment, and supervised
    trained = np.zeros(len(tokens), dtype=bool)
    trained[:-1] = (segment[1:] == segment[:-1]) & (mask[1:] == 1)

    # alignment: every document padded to the multiple, the tail after its real tokens
    real = np.bincount(document, minlength=int(document.max()) + 1)
    physical = ceil_to_multiple(real, pad_to_multiple_of)
    physical_start = np.concatenate([[0], np.cumsum(physical)])
    real_start = np.concatenate([[0], np.cumsum(real)])
    width = int(physical_start[-1])
    destination = physical_start[document] + np.arange(len(tokens)) - real_start[document]
    out_tokens = np.full(width, pad_token_id, dtype=np.int64)
    out_trained = np.zeros(width, dtype=bool)
    out_positions = np.zeros(width, dtype=np.int64)
    out_branch = np.zeros(width, dtype=np.int64)
    out_tokens[destination], out_trained[destination] = tokens, trained
    out_positions[destination], out_branch[destination] = positions, branch
    tail_document = np.repeat(np.arange(len(real)), physical - real)
    tails = concatenated_ranges(physical_start[:-1] + real, physical - real)
    last = destination[real_start[1:] - 1]  # the last real token of every document
    tail_first = (physical_start[:-1] + real)[tail_document]
    out_positions[tails] = out_positions[last][tail_document] + 1 + tails - tail_first
    out_branch[tails] = out_branch[last][tail_document]  # a tail stays inside the last branch
    padding = np.ones(width, dtype=bool)
    padding[destination] = False
    # every branch's own tokens are its second piece (pairs: after its prompt; shared: after the copy)
    own = np.flatnonzero(pieces["branch"] >= 0)[1::2]
    return UnitRow(
        tokens=out_tokens,
        trained=out_trained,
        positions=out_positions,
        branch=out_branch,
        padding=padding,
        sequence_starts=physical_start.astype(np.int64),
        sequence_lengths=real.astype(np.int64),
        branch_starts=destination[piece_first[own]],
    )
