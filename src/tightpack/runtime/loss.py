"""Per-token loss across micro-batches, data- and context-parallel ranks (docs/contract.md §7).

Packs hold different numbers of supervised tokens, and a context-parallel shard may hold none, so
the loss of an optimizer step is the exact mean over all its supervised tokens:

1. each micro-batch contributes ``(sum of loss x mask, number of supervised tokens)``
   (`masked_token_loss`) and back-propagates the sum, never a mean;
2. after the last micro-batch, `finalize_per_token_grads` sums the token counts and the gradients
   over the data x context parallel group (never averaging in the collective) and scales the
   gradients by ``1 / total tokens``;
3. the reported loss is the global sum over the global count (`global_mean_loss`).

Padding rows and alignment gaps carry a zero mask, so they count zero in both.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from tightpack.errors import TightpackError

__all__ = ["finalize_per_token_grads", "global_mean_loss", "masked_token_loss", "token_losses"]


def token_losses(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of every position, ``[..., T]``, at least float32 (0 where the label is ignored).

    ``logits`` is ``[..., T, V]`` and ``labels`` ``[..., T]``, already aligned (label of position t =
    token t + 1, as in THD batches).
    """
    flat = torch.nn.functional.cross_entropy(
        _at_least_float32(logits.flatten(0, -2)),
        labels.flatten(),
        ignore_index=ignore_index,
        reduction="none",
    )
    return flat.view(labels.shape)


def _at_least_float32(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.promote_types(values.dtype, torch.float32))


def masked_token_loss(
    output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of loss x mask, number of supervised tokens)`` of one micro-batch or shard.

    ``output`` is the per-token losses, or ``(losses, mask)`` whose mask replaces ``loss_mask``
    (model-side context-parallel slicing returns its own); the mask is 0/1. The sum is float32 (or
    float64 for float64 losses) and ignores whatever the unsupervised positions hold; the count is an
    int64 0-d tensor. Non-finite losses on supervised tokens raise.

    >>> masked_token_loss(torch.tensor([[2.0, 9.0, 1.0]]), torch.tensor([[1, 0, 1]]))
    (tensor(3.), tensor(2))
    """
    losses, mask = output if isinstance(output, tuple) else (output, loss_mask)
    if losses.shape != mask.shape:
        raise TightpackError(
            f"losses {tuple(losses.shape)} and loss mask {tuple(mask.shape)} differ in shape: slice both "
            "with the same indices (slice_for_cp_rank)"
        )
    supervised = mask.bool()
    if not bool(torch.isfinite(losses[supervised]).all()):
        raise TightpackError("the loss is NaN or infinite on a supervised token")
    return _at_least_float32(losses).where(supervised, 0.0).sum(), supervised.sum()


def finalize_per_token_grads(
    parameters: Iterable[torch.nn.Parameter], num_tokens: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum token counts and gradients over ``group`` (data x context parallel), then divide by the count.

    Call once per optimizer step, after every micro-batch's backward of its loss *sum*, with
    ``num_tokens`` the supervised tokens of this rank's micro-batches. Without an initialized
    process group this is the single-process case. Returns the global token count.
    """
    total = num_tokens.detach().to(torch.int64).clone()
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.all_reduce(total, group=group)
    scale = 1.0 / max(int(total), 1)
    for parameter in parameters:
        if parameter.grad is None:
            continue
        if distributed:
            dist.all_reduce(parameter.grad, group=group)
        parameter.grad.mul_(scale)
    return total


def global_mean_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The reported loss: global sum over global count, float64 0-d (0 when no token is supervised).

    >>> global_mean_loss(torch.tensor(6.0), torch.tensor(4))
    tensor(1.5000, dtype=torch.float64)
    """
    pair = torch.stack([loss_sum.detach().double(), num_tokens.detach().double()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(pair, group=group)
    return pair[0] / pair[1].clamp(min=1)
