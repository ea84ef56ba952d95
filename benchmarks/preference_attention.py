"""Attention whose cost follows a packed row's block structure, for the preference benchmark on CPU.

On a GPU a varlen kernel (flash-attention's ``cu_seqlens``, FlexAttention's block mask) computes only
the blocks a row's mask allows: every sequence's own causal triangle, and for a shared-prefix unit
the prompt's triangle plus every branch's rows against the prompt and itself. transformers' ``sdpa``
on CPU takes a packed row's mask as one dense ``T x T`` matrix instead, so a row of many sequences
pays its whole length squared. `blockwise_attention` is registered with transformers'
``AttentionInterface`` under `ATTENTION` and runs torch's SDPA once per block of the structure given
by `blocks` (a context manager), so every layout pays what a varlen kernel would:

- ``causal`` block ``(s, e)``: tokens ``s..e`` attend causally among themselves (a sequence of a
  packed row; with ``s, e = 0, L``, every row of a right-padded batch ``[B, L]``, whose real tokens
  never see the padding after them);
- ``suffix`` block ``(s, e, ks, ke)``: a shared-prefix branch, tokens ``s..e`` attend to the shared
  prompt ``ks..ke`` and causally to their own branch (SDPA with a lower-right causal bias over the
  keys ``prompt + branch``), never to a sibling.

`row_blocks` reads the structure of a tightpack row (its physical boundaries and ``branch_ids``),
`sequence_blocks` that of sequences laid end to end (TRL's ``padding_free``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from tightpack.runtime import thd

ATTENTION = "tightpack_bench_blockwise"
"""The ``attn_implementation`` name `blockwise_attention` is registered under."""

Block = tuple[int, int, int, int]
"""``(start, end, key_start, key_end)``: queries ``start..end``; ``key_end == key_start`` for a causal
block, else the shared prompt ``key_start..key_end`` they also see."""

_current: list[Sequence[Block]] = []


@contextlib.contextmanager
def blocks(structure: Sequence[Block]) -> Iterator[None]:
    """Run the model's forwards inside with ``structure`` as the attention's blocks."""
    _current.append(structure)
    try:
        yield
    finally:
        _current.pop()


def causal_blocks(bounds: Sequence[int]) -> list[Block]:
    """One causal block per sequence between consecutive ``bounds``."""
    return [(int(s), int(e), int(s), int(s)) for s, e in itertools.pairwise(bounds) if e > s]


def sequence_blocks(lengths: Sequence[int]) -> list[Block]:
    """Sequences of these lengths laid end to end (one causal block each)."""
    return causal_blocks(np.concatenate([[0], np.cumsum(lengths)]).tolist())


def row_blocks(batch: Mapping[str, Any]) -> list[Block]:
    """The blocks of a tightpack preference row: every physical segment causal (``pairs``), or per
    shared-prefix unit its prompt causal and then every branch a suffix block."""
    bounds = thd.physical_boundaries(batch).tolist()
    branch_ids = batch.get("branch_ids")
    if branch_ids is None:
        return causal_blocks(bounds)
    branch = branch_ids.reshape(-1).numpy()
    out: list[Block] = []
    for s, e in itertools.pairwise(bounds):
        ids = branch[s:e]
        prompt_end = s + int(np.argmax(ids != -1)) if (ids != -1).any() else e
        if prompt_end > s:
            out.append((s, prompt_end, s, s))
        changes = np.flatnonzero(np.diff(ids[prompt_end - s :])) + 1 + prompt_end
        edges = [prompt_end, *changes.tolist(), e]
        out += [(a, b, s, prompt_end) for a, b in itertools.pairwise(edges) if b > a]
    return out


def blockwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, Hkv, T, D]``):
    SDPA per block of the current `blocks` structure; returns ``[B, T, H, D]``."""
    if not _current:
        raise RuntimeError(f"{ATTENTION} needs the row's structure: run the model inside `blocks(...)`")
    if attention_mask is not None:
        raise RuntimeError(f"{ATTENTION} takes its structure from `blocks`, not from an attention mask")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    structure = _current[-1]
    sizes = [end - start for start, end, _, _ in structure]
    if sizes and sum(sizes) != query.shape[2]:
        raise RuntimeError(f"the blocks cover {sum(sizes)} of the row's {query.shape[2]} tokens")
    # split, not sliced: the backward of a split concatenates, a slice's would fill a row-long zero
    # tensor per block (quadratic in the blocks of a row)
    queries, keys, values = (t.split(sizes, 2) for t in (query, key, value))
    block_at = {(start, end): i for i, (start, end, _, _) in enumerate(structure)}
    pieces = []
    for i, (start, end, key_start, key_end) in enumerate(structure):
        if key_end == key_start:
            k, v, bias, causal = keys[i], values[i], None, True
        else:
            prompt = block_at[key_start, key_end]
            k, v = torch.cat([keys[prompt], keys[i]], 2), torch.cat([values[prompt], values[i]], 2)
            bias, causal = causal_lower_right(end - start, k.shape[2]), False
        pieces.append(
            F.scaled_dot_product_attention(queries[i], k, v, attn_mask=bias, is_causal=causal, scale=scaling)
        )
    out = torch.cat(pieces, 2) if len(pieces) > 1 else pieces[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, blockwise_attention)
