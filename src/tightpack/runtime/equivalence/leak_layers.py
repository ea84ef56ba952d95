"""Where a leak enters: the first decoder layer whose outputs at the probe's targets depend on the
context's tokens when packed, held to the probe's rule against the same layer under one causal mask.

Forward hooks on the decoder layers (the largest `torch.nn.ModuleList` of ``num_hidden_layers``
modules) capture the targets' hidden states in four of the probe's runs. The layer is named with its
class and, where the configuration lists them (``layer_types``, ...), its kind, e.g.
``layer 0 (MambaDecoderLayer, type 'mamba')``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tightpack.runtime.equivalence.probe import LEAK_FRACTION, ProbeRows

_LAYER_KINDS = ("layer_types", "layers_block_type", "block_types")


def text_config(model: torch.nn.Module) -> Any:
    """The language model's configuration (the text part of a multimodal one)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    config = text_config(model)
    count = getattr(config, "num_hidden_layers", None)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    matching = [m for m in lists if len(m) == count] or lists
    return max(matching, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def _layer_name(model: torch.nn.Module, layers: torch.nn.ModuleList, index: int) -> str:
    config = text_config(model)
    kind = next(
        (
            kinds[index]
            for name in _LAYER_KINDS
            if isinstance(kinds := getattr(config, name, None), (list, tuple)) and len(kinds) == len(layers)
        ),
        None,
    )
    described = type(layers[index]).__name__ + (f", type {kind!r}" if kind else "")
    return f"layer {index} ({described})"


def locate_leak(
    model: torch.nn.Module,
    rows: ProbeRows,
    packed: Callable[[torch.Tensor, Sequence[int]], torch.Tensor],
    plain: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[str, ...]:
    """``("layer i (Class, type 'kind')",)`` for the first decoder layer whose outputs at the targets
    depend on the context's tokens packed (by the probe's rule); ``()`` when none is found or the
    layers cannot be hooked."""
    layers = _decoder_layers(model)
    if layers is None:
        return ()
    captured: list[torch.Tensor] = []
    width, context = len(rows.row()), len(rows.context)

    def keep(module, args, output) -> None:
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == width:
            captured.append(hidden[0, context:].float())  # the targets' hidden states

    handles = [layer.register_forward_hook(keep) for layer in layers]
    runs = []
    try:
        for run in (
            lambda: packed(rows.row(), rows.lengths),
            lambda: packed(rows.row(swapped=True), rows.lengths),
            lambda: plain(rows.row()[None]),
            lambda: plain(rows.row(swapped=True)[None]),
        ):
            captured.clear()
            run()
            runs.append(list(captured))
    finally:
        for handle in handles:
            handle.remove()
    if any(len(run) != len(layers) for run in runs):
        return ()
    for index, (a, b, mixed_a, mixed_b) in enumerate(zip(*runs, strict=True)):
        if float((a - b).abs().max()) > LEAK_FRACTION * float((mixed_a - mixed_b).abs().max()):
            return (_layer_name(model, layers, index),)
    return ()
