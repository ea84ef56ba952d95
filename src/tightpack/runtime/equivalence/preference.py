"""The equivalence probe on a shared-prefix preference row: does a branch see only its prompt?

The probe takes one unit of the batch with two or more branches, keeps its prompt (at most
`PROMPT_TOKENS` of its end) and two branches A and B (at most `BRANCH_TOKENS` each), and runs the
model as training runs it (`tightpack.runtime.preference_hf.preference_model_kwargs`) on

1. the unit ``prompt, A, B`` and the unit with A's tokens replaced by others of the row: branch B's
   target log-probabilities must not move (``cross_sequence``, the sibling's influence);
2. the same two units under one causal mask per unit, so that B sees A: how far B moves when its
   sibling leaks (``leak``, the calibration);
3. ``prompt + B`` alone: B's packed log-probabilities must equal these (``unpacked_gap``), against the
   leaky run's distance (``contaminated_gap``).

The verdict is `ProbeReport.passed`, the rule of the sequence probe
(`tightpack.runtime.equivalence.probe`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from tightpack.core.preference_units import PreferenceUnits
from tightpack.runtime.equivalence.probe import ProbeReport, ProbeSkipped, eval_without_grad
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_hf import attention_masks, preference_model_kwargs

__all__ = ["probe_shared_prefix"]

PROMPT_TOKENS = 48
"""The most prompt tokens the probe keeps (the prompt's end)."""
BRANCH_TOKENS = 24
"""The most tokens of each probed branch (its start)."""


def _probe_unit(batch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The prompt, branches A and B of the first unit with two branches, and the row's tokens."""
    tokens = batch["input_ids"].reshape(-1).cpu().numpy()
    branch_of = batch["branch_ids"].reshape(-1).cpu().numpy()
    real = ~batch["padding_mask"].reshape(-1).cpu().numpy() if batch.get("padding_mask") is not None else None
    sizes = batch["branch_group_size"].cpu().numpy()
    units = batch["branch_unit"].cpu().numpy()
    candidates = np.flatnonzero((sizes >= 2) & (batch["branch_index"].cpu().numpy() == 0))
    if len(candidates) == 0:
        raise ProbeSkipped("the shared-prefix row has no unit of two or more branches to probe with")
    first = int(candidates[0])
    unit = units[first]
    bounds = batch["cu_seqlens_q_padded" if batch.get("cu_seqlens_q_padded") is not None else "cu_seqlens_q"]
    start, stop = (int(v) for v in bounds.reshape(-1)[[unit, unit + 1]].tolist())
    keep = np.zeros(len(tokens), dtype=bool)
    keep[start:stop] = True
    if real is not None:
        keep &= real

    def branch(b: int) -> np.ndarray:
        return tokens[keep & (branch_of == b)]

    a, b = branch(first), branch(first + 1)
    prompt = np.concatenate([tokens[keep & (branch_of == -1)], a[:1]])[-PROMPT_TOKENS:]
    a, b = a[1 : 1 + BRANCH_TOKENS], b[1 : 1 + BRANCH_TOKENS]
    if len(a) < 1 or len(b) < 2:
        raise ProbeSkipped("the probed unit's branches are too short (fewer than 2 tokens)")
    return prompt, a, b, tokens[real] if real is not None else tokens


def _units(prompt: np.ndarray, a: np.ndarray, b: np.ndarray) -> PreferenceUnits:
    return PreferenceUnits.from_lists([prompt.tolist()], [a.tolist(), b.tolist()], [2])


def _on(row: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in row.items()}


def _branch_log_probs(logits: torch.Tensor, row: Mapping[str, Any], branch: int) -> torch.Tensor:
    """Per-target log-probabilities of ``branch`` of a probe row (its targets, in order)."""
    labels = row["labels"].reshape(-1)
    where = (row["branch_ids"].reshape(-1) == branch) & (labels != -100)
    flat = logits.reshape(-1, logits.shape[-1])[where.to(logits.device)].float()
    return torch.log_softmax(flat, -1).gather(-1, labels[where].to(flat.device)[:, None])[:, 0]


def probe_shared_prefix(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    model_kwargs: Callable[[torch.nn.Module, Mapping[str, Any]], dict[str, Any]] = preference_model_kwargs,
    describe: str = "",
) -> ProbeReport:
    """Probe ``model`` on a unit of the shared-prefix row ``batch`` (the module docstring has the rule).

    Raises:
        ProbeSkipped: the row has no unit of two branches of at least 2 tokens.
    """
    started = time.perf_counter()
    prompt, a, b, material = _probe_unit(batch)
    generator = torch.Generator().manual_seed(0)
    other = material[torch.randint(len(material), (len(a),), generator=generator).numpy()]
    if np.array_equal(other, a):
        raise ProbeSkipped("the row holds one token id only: no other sibling to swap in")
    device = batch["input_ids"].device
    rows = [
        _on(build_preference_row(_units(prompt, sibling, b), "shared-prefix"), device)
        for sibling in (a, other)
    ]

    def forward(row: Mapping[str, Any], leaky: bool) -> torch.Tensor:
        kwargs = model_kwargs(model, row)
        if leaky:  # one causal mask over the unit (windows kept): B sees its sibling
            unit = {"cu_seqlens_q": row["cu_seqlens_q"], "position_ids": row["position_ids"]}
            kwargs["attention_mask"] = attention_masks(model, unit)
        output = model(**kwargs)
        logits = output.logits if hasattr(output, "logits") else output[0]
        return _branch_log_probs(logits, row, 1)

    with eval_without_grad(model):
        packed = [forward(row, leaky=False) for row in rows]
        leaked = [forward(row, leaky=True) for row in rows]
        alone_ids = torch.tensor([[*prompt.tolist(), *b.tolist()]], device=device)
        output = model(input_ids=alone_ids, use_cache=False)
        logits = (output.logits if hasattr(output, "logits") else output[0])[0].float()
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(b) - 1, device=device)
        alone = torch.log_softmax(logits[positions], -1).gather(-1, alone_ids[0, len(prompt) :, None])[:, 0]

    def gap(x: torch.Tensor, y: torch.Tensor) -> float:
        difference = (x - y).abs()
        return float("inf") if not bool(torch.isfinite(difference).all()) else float(difference.max())

    return ProbeReport(
        cross_sequence=gap(packed[0], packed[1]),
        leak=gap(leaked[0], leaked[1]),
        unpacked_gap=gap(packed[0], alone),
        contaminated_gap=gap(leaked[0], alone),
        tokens=int(rows[0]["input_ids"].shape[1]),
        targets=1,
        seconds=time.perf_counter() - started,
        model=describe,
    )
