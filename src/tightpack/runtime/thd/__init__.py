"""The THD batch contract: what a packed batch holds, a validator, and the accessors consumers read it with.

THD is one token stream per packed row plus cumulative sequence boundaries (docs/contract.md §1). There
are two kinds of boundaries:

- logical (``cu_seqlens_q``): how many real tokens each sequence has, cumulated;
- physical (``cu_seqlens_q_padded``): where each segment starts and ends in the tensor, alignment
  padding included. A batch without the ``*_padded`` keys has physical = logical.

Two builders emit the reference's two layouts. This module is the one place that knows both, and the
legacy keys too; consumers read batches through its accessors instead of looking at the keys:

================================  ======================================  ===================================
key                               offline rows (`PackedCollate`)          stream (`build_thd_from_rows`)
================================  ======================================  ===================================
``tokens`` / ``input_ids``        ``tokens`` int64 ``[B, W]``             ``input_ids``: the rows' dtype
                                                                          ``[1, T]``; text collators alias
                                                                          ``tokens`` to the same tensor
``labels``                        int64 ``[B, W]``; width padding EOS     rows' dtype ``[1, T]``; tails
                                                                          ``ignore_index``; only if the rows
                                                                          have labels
``loss_mask``                     int64 ``[B, W]``, 0/1                   rows' dtype ``[1, T]``; tails 0;
                                                                          only if the rows have it
``position_ids``                  int64 ``[B, W]``, 0, 1, ... per         rows' dtype ``[1, T]``; tails go on
                                  segment; width padding 0                ``last + 1, last + 2, ...``
``padding_mask``                  bool ``[B, W]``, always: True on        bool ``[1, T]``, with
                                  alignment tails and width padding       ``emit_padding_mask``: True on tails
``seq_idx``                       int32 ``[B, W]``: physical segment of   absent
                                  each token (tightpack's own)
``attention_mask``                None                                    None
``cu_seqlens_q`` (``_kv``: the    int32 ``[B, K]``, logical               int32 ``[N + 1]``, logical
same tensor)
``cu_seqlens_q_padded``           int32 ``[B, K]``, physical; only        int32 ``[N + 1]``, physical; only
(``_kv_padded``: the same)        when ``pad_seq_to_mult > 1``            when some segment was padded
``max_seqlen_q`` (``_kv``: the    int32 ``[B, 1]``; ``[B]`` with          int32 0-d CPU tensor
same tensor)                      ``pad_cu_seqlens`` (a stable fill)
``total_tokens``                  int ``W``                               int ``T``
``token_count``                   list of B ints: tokens per row          text collators: list of N ints,
                                                                          real tokens per sequence
================================  ======================================  ===================================

Legacy keys (``PackedCollate(legacy_keys=True)``, packs before Megatron-Bridge #5344), instead of
``cu_seqlens_q*`` and ``max_seqlen_*``: ``cu_seqlens`` int32 ``[B, K + 1]`` (K: the most boundaries of
a row), the physical boundaries right-padded with -1; ``cu_seqlens_argmin`` int64 ``[B, 1]``, the index
of the first -1; ``max_seqlen`` int32 ``[B, 1]``; with alignment also ``cu_seqlens_unpadded`` (logical)
and its argmin.

Where the layouts differ on purpose:

- The physical boundaries always end at the row width. Offline rows append the width padding as a
  trailing pseudo-segment (``[0, 3, 6, 8]`` for 6 real tokens in 8). The stream ends where its last
  segment ends, and with ``pad_to_max_length`` that segment takes the fill (``[0, 3, 8]``).
- Offline rows with fewer segments, and every row with ``pad_cu_seqlens``, are extended with
  zero-length segments (the physical array repeats the width, the logical one its last value), so the
  rows stack into one ``[B, K]`` tensor.
- Offline aligned rows always carry ``*_padded``. The stream carries them only when they differ.

Consumers get one packed row through `physical_boundaries`, `logical_boundaries`, `padded_boundaries`
and `max_seqlen`. They take ``[K]`` or ``[1, K]`` (a split offline micro-batch), or row ``r`` of
``[B, K]``, and both key schemas. `validate_thd_batch` checks a batch against this contract.

Debug mode: with the environment variable ``TIGHTPACK_CHECK_BATCHES=1`` (read once, at import) or inside
``with checking():`` (or after ``set_checking(True)``), the builders validate what they emit and the
consumers (`to_packed_seq_params`, `hf_packed_kwargs`, the masks, `slice_for_cp_rank`) validate what
they receive. When it is off, `check_thd_batch` tests one flag and returns.

>>> import torch
>>> batch = {"input_ids": torch.tensor([[5, 6, 7, 0, 8, 9, 0, 0]]),
...          "cu_seqlens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
...          "cu_seqlens_q_padded": torch.tensor([0, 4, 8], dtype=torch.int32),
...          "max_seqlen_q": torch.tensor(4, dtype=torch.int32), "total_tokens": 8}
>>> validate_thd_batch(batch)
>>> logical_boundaries(batch).tolist(), physical_boundaries(batch).tolist(), max_seqlen(batch)
([0, 3, 5], [0, 4, 8], 4)
>>> legacy = {"tokens": torch.zeros(1, 8, dtype=torch.long),
...           "cu_seqlens": torch.tensor([[0, 4, 8, -1]], dtype=torch.int32),
...           "cu_seqlens_argmin": torch.tensor([[3]]),
...           "cu_seqlens_unpadded": torch.tensor([[0, 3, 5, -1]], dtype=torch.int32),
...           "max_seqlen": torch.tensor([[4]], dtype=torch.int32)}
>>> validate_thd_batch(legacy)
>>> logical_boundaries(legacy).tolist(), padded_boundaries(legacy).tolist(), max_seqlen(legacy)
([0, 3, 5], [0, 4, 8], 4)
>>> try:
...     validate_thd_batch({**batch, "max_seqlen_q": torch.tensor(3, dtype=torch.int32)})
... except ThdBatchError as error:
...     print(error)
max_seqlen_q is 3, less than the longest segment of cu_seqlens_q_padded (4 tokens)
"""

from tightpack.runtime.thd.access import (
    is_packed,
    logical_boundaries,
    max_seqlen,
    padded_boundaries,
    physical_boundaries,
    token_tensor,
)
from tightpack.runtime.thd.branches import BRANCH_KEYS, check_block_diagonal, validate_branches
from tightpack.runtime.thd.contract import (
    CONTRACT,
    LEGACY_KEYS,
    METADATA_PREFIXES,
    PADDED_KEYS,
    TOKEN_KEYS,
    KeySpec,
    ThdBatchError,
)
from tightpack.runtime.thd.validate import (
    CHECK_ENV,
    check_thd_batch,
    checking,
    checking_enabled,
    set_checking,
    validate_thd_batch,
)

__all__ = [
    "BRANCH_KEYS",
    "CHECK_ENV",
    "CONTRACT",
    "LEGACY_KEYS",
    "METADATA_PREFIXES",
    "PADDED_KEYS",
    "TOKEN_KEYS",
    "KeySpec",
    "ThdBatchError",
    "check_block_diagonal",
    "check_thd_batch",
    "checking",
    "checking_enabled",
    "is_packed",
    "logical_boundaries",
    "max_seqlen",
    "padded_boundaries",
    "physical_boundaries",
    "set_checking",
    "token_tensor",
    "validate_branches",
    "validate_thd_batch",
]
