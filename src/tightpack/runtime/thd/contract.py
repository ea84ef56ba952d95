"""The keys of a THD batch as data (`CONTRACT`: kind and dtype), and the key groups consumers look up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tightpack.errors import TightpackError

__all__ = [
    "CONTRACT",
    "LEGACY_KEYS",
    "METADATA_PREFIXES",
    "PADDED_KEYS",
    "TOKEN_KEYS",
    "KeySpec",
    "ThdBatchError",
]

Side = Literal["q", "kv"]
Kind = Literal["sequence", "boundaries", "max_seqlen", "argmin"]


@dataclass(frozen=True)
class KeySpec:
    """One tensor key of the contract, as the validator reads it (the table above, for the code)."""

    name: str
    kind: Kind
    """``sequence``: one value per token (the token shape); ``boundaries``: cumulative offsets;
    ``max_seqlen``: one value per row; ``argmin``: legacy index of the first -1."""
    dtype: torch.dtype | None = None
    """The required dtype; None: the rows' own dtype."""


CONTRACT: dict[str, KeySpec] = {
    spec.name: spec
    for spec in (
        KeySpec("tokens", "sequence"),
        KeySpec("input_ids", "sequence"),
        KeySpec("labels", "sequence"),
        KeySpec("loss_mask", "sequence"),
        KeySpec("position_ids", "sequence"),
        KeySpec("padding_mask", "sequence", torch.bool),
        KeySpec("seq_idx", "sequence", torch.int32),
        KeySpec("branch_ids", "sequence", torch.int32),
        KeySpec("cu_seqlens_q", "boundaries", torch.int32),
        KeySpec("cu_seqlens_kv", "boundaries", torch.int32),
        KeySpec("cu_seqlens_q_padded", "boundaries", torch.int32),
        KeySpec("cu_seqlens_kv_padded", "boundaries", torch.int32),
        KeySpec("max_seqlen_q", "max_seqlen", torch.int32),
        KeySpec("max_seqlen_kv", "max_seqlen", torch.int32),
        KeySpec("cu_seqlens", "boundaries", torch.int32),
        KeySpec("cu_seqlens_unpadded", "boundaries", torch.int32),
        KeySpec("cu_seqlens_argmin", "argmin", torch.int64),
        KeySpec("cu_seqlens_unpadded_argmin", "argmin", torch.int64),
        KeySpec("max_seqlen", "max_seqlen", torch.int32),
    )
}

TOKEN_KEYS = ("tokens", "input_ids")
"""Where the token stream lives, in the order consumers look (offline: ``tokens``; stream: the token key)."""
PADDED_KEYS = ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")
"""Optional: present only when they carry information (see the table)."""
LEGACY_KEYS = (
    "cu_seqlens",
    "cu_seqlens_argmin",
    "max_seqlen",
    "cu_seqlens_unpadded",
    "cu_seqlens_unpadded_argmin",
)
CURRENT_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", *PADDED_KEYS, "max_seqlen_q", "max_seqlen_kv")
METADATA_PREFIXES = ("cu_seqlens", "max_seqlen")
"""Keys with these prefixes describe the whole row (boundaries stay global under context parallelism)."""
PER_TOKEN_KEYS = tuple(name for name, spec in CONTRACT.items() if spec.kind == "sequence")
"""The per-token keys, token keys first: they all have the token shape."""


class ThdBatchError(TightpackError):
    """A batch that breaks the THD contract; the message names the key, what was expected and what it held."""


def no_boundaries() -> ThdBatchError:
    return ThdBatchError("the batch has no packed boundaries: expected cu_seqlens_q or legacy cu_seqlens")
