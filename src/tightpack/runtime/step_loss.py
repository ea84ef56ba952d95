"""The loss of a packed micro-batch as its share of the step's loss (`packed_step_loss`).

A step's loss is normalized over the whole global batch, every rank's micro-batches together; a
micro-batch that divides by its own token count (or a rank by its own) weights short and long
sequences, and rich and poor ranks, differently from the unpacked step. The three common modes, with
``G_T`` the step's supervised tokens, ``G_S`` its sequences with at least one, and ``n_s`` the
supervised tokens of sequence ``s`` (`tightpack.core.step_planner.LossDenominators` holds ``G_T`` and
``G_S``; every rank computes them from the same plan):

- ``token-mean``: ``sum over every token of loss / G_T``;
- ``sequence-mean-token-mean``: ``sum over sequences of (sum of its token losses / n_s) / G_S``;
- ``sequence-mean-token-sum``: ``sum over sequences of (sum of its token losses) / G_S``.

Each is a sum over tokens with a weight per token, so a micro-batch contributes its tokens' weighted
sum and the step's loss is the sum of the contributions of every micro-batch of every rank: accumulate
gradients over a rank's micro-batches, then sum them over ranks. Distributed data parallelism
*averages* gradients over ranks, so there pass ``data_parallel_size``: the contribution is scaled by it
and the average is the step's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch

from tightpack.core.step_planner import LossDenominators
from tightpack.errors import TightpackError, check_choice
from tightpack.runtime import thd

__all__ = ["LOSS_MODES", "packed_step_loss"]

LossMode = Literal["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum"]
LOSS_MODES: tuple[str, ...] = get_args(LossMode)


def packed_step_loss(
    per_token_loss: torch.Tensor,
    batch: Mapping[str, Any],
    denominators: LossDenominators,
    *,
    mode: LossMode = "token-mean",
    data_parallel_size: int = 1,
    ignore_index: int = -100,
) -> torch.Tensor:
    """This micro-batch's share of the step's loss, a scalar to backpropagate.

    Args:
        per_token_loss: ``[1, T]`` or ``[T]``: the loss at every position of the packed row (any value,
            inf or nan included, where nothing is trained: ``batch["loss_mask"]`` selects).
        batch: the packed row (THD keys: ``loss_mask`` label-aligned, or else ``labels`` with -100 where
            nothing is trained; ``cu_seqlens_q`` and, with alignment padding, ``cu_seqlens_q_padded``);
            its sequences are whole.
        denominators: the step's (`tightpack.core.step_planner.StepPlan.loss_denominators`).
        mode: ``token-mean``, ``sequence-mean-token-mean`` or ``sequence-mean-token-sum``.
        data_parallel_size: the factor gradients are averaged by across ranks (DDP, FSDP: ``DP``); 1
            when they are summed.
        ignore_index: the label of an untrained position, where the batch has ``labels`` and no
            ``loss_mask``.

    Returns:
        The scalar; summed over the step's micro-batches of every rank (each contribution divided by
        ``data_parallel_size``), it is the step's loss in ``mode``.

    >>> import torch
    >>> from tightpack.runtime.in_batch import build_thd_from_rows
    >>> rows = [{"input_ids": torch.tensor([5, 6, 7]), "position_ids": torch.arange(3),
    ...          "loss_mask": torch.tensor([1, 1, 0])},
    ...         {"input_ids": torch.tensor([8, 9]), "position_ids": torch.arange(2),
    ...          "loss_mask": torch.tensor([1, 0])}]
    >>> batch = build_thd_from_rows(rows)
    >>> loss = torch.tensor([[2.0, 4.0, 0.0, 6.0, 0.0]])
    >>> step = LossDenominators(tokens=6, sequences=4)   # the step holds more than this micro-batch
    >>> [float(packed_step_loss(loss, batch, step, mode=m)) for m in LOSS_MODES]
    [2.0, 2.25, 3.0]
    """
    check_choice("mode", mode, LOSS_MODES)
    if (
        isinstance(data_parallel_size, bool)
        or not isinstance(data_parallel_size, int)
        or data_parallel_size < 1
    ):
        raise TightpackError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
    if denominators.tokens < 1 or denominators.sequences < 1:
        raise TightpackError(
            f"the step has {denominators.tokens} supervised tokens in {denominators.sequences} sequences: "
            "a loss needs at least one (leave out a step with nothing to learn)"
        )
    loss = per_token_loss.reshape(-1)
    if batch.get("loss_mask") is not None:
        selected = batch["loss_mask"].reshape(-1) != 0
    elif batch.get("labels") is not None:
        selected = batch["labels"].reshape(-1) != ignore_index
    else:
        raise TightpackError(
            "the batch has neither loss_mask nor labels, so nothing says which positions are trained: "
            "give each sample a loss_mask (or labels with -100 where nothing is trained)"
        )
    if loss.shape != selected.shape:
        raise TightpackError(
            f"per_token_loss has {loss.numel()} positions and the batch's loss_mask {selected.numel()}: give "
            "the loss at every position of the packed row"
        )
    selected = selected.to(loss.device)
    mask = selected.to(loss.dtype)
    trained = torch.where(
        selected, loss, torch.zeros_like(loss)
    )  # inf or nan where nothing is trained stay out
    if mode == "token-mean":
        total = trained.sum() / denominators.tokens
    else:
        bounds = thd.physical_boundaries(batch).to(loss.device, torch.int64)
        sequence = torch.bucketize(torch.arange(loss.numel(), device=loss.device), bounds[1:], right=True)
        per_sequence = torch.zeros(len(bounds) - 1, dtype=loss.dtype, device=loss.device)
        sums = per_sequence.index_add(0, sequence, trained)
        if mode == "sequence-mean-token-mean":
            counts = per_sequence.index_add(0, sequence, mask)
            sums = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
        total = sums.sum() / denominators.sequences
    return total * data_parallel_size
