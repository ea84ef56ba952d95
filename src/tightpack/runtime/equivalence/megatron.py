"""The equivalence probe on a Megatron-Core forward that takes ``PackedSeqParams``.

Megatron-Core keeps packed sequences apart only where its attention kernel reads
``PackedSeqParams`` (Transformer Engine's fused attention with ``qkv_format="thd"``) and its rotary
embedding restarts per sequence; a custom attention, a spec that drops the parameters or a kernel
without THD support runs one causal mask over the row without any error. `check_mcore_packing` asks
the model itself, with the probe of `tightpack.runtime.equivalence.probe`:

>>> def forward(tokens, position_ids, packed_seq_params):  # a GPTModel as the training step calls it
...     return model(tokens, position_ids, None, packed_seq_params=packed_seq_params)
>>> # check_mcore_packing(forward, batch)  # raises PackingLeakError when packed sequences see each other

The packed runs pass ``PackedSeqParams(qkv_format="thd")`` built by
`tightpack.runtime.adapters.to_packed_seq_params` (what a tightpack batch gives the training step);
the contaminated and the unpacked runs pass None, the sequences as one causal row and alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tightpack.logs import logger
from tightpack.runtime import thd
from tightpack.runtime.adapters import to_packed_seq_params
from tightpack.runtime.equivalence.probe import (
    GAP_FRACTION,
    LEAK_FRACTION,
    PackingLeakError,
    ProbeReport,
    ProbeSkipped,
    eval_without_grad,
    probe_rows,
    restarting_positions,
    run_probe,
    sequence_boundaries,
)

__all__ = ["check_mcore_packing"]

# (tokens [B, T], position_ids [B, T], PackedSeqParams or None) -> logits [B, T, V]
McoreForward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def check_mcore_packing(
    forward: McoreForward,
    batch: Mapping[str, Any],
    *,
    model: torch.nn.Module | None = None,
    excluded_tokens: Sequence[int] = (),
) -> ProbeReport:
    """Probe a Megatron-Core forward on sequences cut from one packed row of a THD ``batch``.

    ``forward(tokens, position_ids, packed_seq_params)`` runs the model as the training step does and
    returns logits ``[B, T, V]`` (``[T, B, V]`` is not accepted: transpose first). ``model``, when given,
    is put in eval mode for the probe and back afterwards (dropout would move the figures).
    ``excluded_tokens``: ids the probe must not cut sequences from (image placeholders, say).

    Raises:
        PackingLeakError: packed sequences see each other, or are not computed as alone (positions
            that do not restart); ``.report`` holds the figures.
        ProbeSkipped: the batch is not one packed row with enough tokens to probe.
    """
    tokens = thd.token_tensor(batch)
    if tokens is None or tokens.dim() != 2 or tokens.shape[0] != 1:
        shape = None if tokens is None else tuple(tokens.shape)
        raise ProbeSkipped(f"the probe takes one packed row ([1, T] tokens), got shape {shape}")
    device = tokens.device
    rows = probe_rows(tokens[0].cpu(), thd.physical_boundaries(batch).cpu(), excluded=excluded_tokens)

    def packed(row: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        positions = restarting_positions(lengths).to(device)[None]
        bounds = sequence_boundaries(lengths)
        probe = {"tokens": row[None], "position_ids": positions, "cu_seqlens_q": bounds.to(device),
                 "max_seqlen_q": max(lengths)}  # fmt: skip
        params = to_packed_seq_params(probe)
        return forward(row.to(device)[None], positions, params)[0]

    def plain(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
        return forward(ids.to(device), positions, None)

    name = type(model).__name__ if model is not None else getattr(forward, "__qualname__", "forward")
    with eval_without_grad(model):
        report = run_probe(rows, packed, plain, model=f"{name} (Megatron-Core, PackedSeqParams thd)")
    if report.passed:
        logger().info("packing check passed for %s: %s", report.model, report.summary())
        return report
    if report.leaks:
        finding = (
            f"packed sequences see each other: a sequence's log-probabilities move "
            f"{report.cross_sequence:.3g} when the tokens of the sequence before it change, against "
            f"{report.leak:.3g} for one causal mask over the row (allowed {LEAK_FRACTION:g} of it): the "
            "attention does not read PackedSeqParams (use Transformer Engine's attention with "
            "qkv_format='thd', e.g. TEDotProductAttention, and pass packed_seq_params to the model)"
        )
    else:
        finding = (
            f"packed sequences are not computed as alone: {report.unpacked_gap:.3g} from the sequences run "
            f"alone, against {report.contaminated_gap:.3g} for one causal mask (allowed {GAP_FRACTION:g} "
            "of it): positions (rotary embedding) do not restart per sequence"
        )
    raise PackingLeakError(f"packing check failed for {report.model}: {finding}", report)
