"""The equivalence probe on a Hugging Face model, as the user loaded it.

Two ways in, one per training path:

- `probe_model_inputs`: the keyword arguments of one training forward as the model receives them
  (what ``Trainer`` passes from `tightpack.runtime.hf_trainer.PackingCollator`, TRL's padding-free
  collator or any other: ``input_ids`` ``[1, T]``, restarting ``position_ids``, the optional
  ``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``, ...). The probe rows are given the same keys,
  rebuilt for them, so they take the path the training batch takes.
- `probe_batch`: a THD batch (`tightpack.runtime.thd`) and the function that turns a THD batch into
  the model's keyword arguments (`tightpack.runtime.hf_kwargs.model_kwargs` for ``packed_forward``).

`check_packing` runs either, raises `PackingLeakError` on a failed probe and logs one line on success.
The model runs in eval mode without gradients during the probe and is put back as it was.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tightpack.errors import TightpackError
from tightpack.logs import logger
from tightpack.runtime import thd
from tightpack.runtime.equivalence.leak_layers import locate_leak, text_config
from tightpack.runtime.equivalence.preference import probe_shared_prefix
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
from tightpack.runtime.hf_kwargs import model_kwargs as packed_forward_kwargs

__all__ = ["check_packing"]

PROBE_ENV = "TIGHTPACK_PROBE"  # "0" turns the automatic probes off
# inputs the probe leaves out: targets (no loss is computed) and the visual tensors (its rows are text)
_DROPPED = frozenset(
    ("labels", "shift_labels", "loss_mask", "num_items_in_batch", "pixel_values", "image_grid_thw",
     "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "image_sizes", "padding_mask")
)  # fmt: skip
_SPECIAL_TOKENS = (
    "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    "image_token_index", "video_token_index", "audio_token_id", "audio_token_index",
)  # fmt: skip
# non-tensor inputs kept as given (use_cache decides whether transformers builds the packed mask)
_KEPT_SETTINGS = frozenset(("use_cache", "is_causal", "output_router_logits"))


def probe_enabled() -> bool:
    """False when the environment variable ``TIGHTPACK_PROBE`` is ``0`` (or ``false``/``off``)."""
    return os.environ.get(PROBE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def describe_model(model: torch.nn.Module) -> str:
    """``"LlamaForCausalLM (attention sdpa, torch.bfloat16, transformers 5.24)"``."""
    from tightpack.runtime.mrope import transformers_version

    config = text_config(model)
    attention = getattr(config, "_attn_implementation", None)
    parameter = next(model.parameters(), None)
    dtype = parameter.dtype if parameter is not None else None
    release = ".".join(map(str, transformers_version() or ("?",)))
    parts = [f"attention {attention}"] if attention else []
    return f"{type(model).__name__} ({', '.join([*parts, str(dtype), f'transformers {release}'])})"


def _excluded_tokens(model: torch.nn.Module) -> list[int]:
    config = getattr(model, "config", None)
    return [value for name in _SPECIAL_TOKENS if isinstance(value := getattr(config, name, None), int)]


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def _plain(model: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return _logits(model(input_ids=ids.to(device), use_cache=False))

    return forward


def _model_input_bounds(inputs: Mapping[str, Any], width: int) -> torch.Tensor:
    """The sequences of a training forward's inputs: ``cu_seq_lens_q``, else where positions restart."""
    bounds = inputs.get("cu_seq_lens_q")
    if isinstance(bounds, torch.Tensor):
        return bounds.reshape(-1).cpu()
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        return torch.tensor([0, width])
    text = positions.reshape(-1, width)[0].cpu()  # [1, T], or row 0 of [3|4, 1, T]
    starts = torch.nonzero(text.diff() != 1).reshape(-1) + 1
    return torch.cat([torch.tensor([0]), starts, torch.tensor([width])])


def _rebuild_inputs(inputs: Mapping[str, Any], row: torch.Tensor, lengths: Sequence[int]) -> dict[str, Any]:
    """The training forward's keyword arguments, rebuilt for the probe row ``[T']`` of ``lengths``."""
    width = int(inputs["input_ids"].shape[-1])
    bounds = sequence_boundaries(lengths)
    # positions as the batch numbers them: restarting per sequence, or (a collator's mistake the probe
    # must see, not repair) running on over the row
    given = inputs.get("position_ids")
    starts = _model_input_bounds(inputs, width)[:-1].long()
    runs_on = isinstance(given, torch.Tensor) and bool((given.reshape(-1, width)[0].cpu()[starts] != 0).any())
    positions = torch.arange(len(row)) if runs_on else restarting_positions(lengths)
    rebuilt: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in _DROPPED:
            continue
        if key in ("max_length_q", "max_length_k") and not isinstance(value, torch.Tensor):
            rebuilt[key] = max(lengths)
            continue
        if not isinstance(value, torch.Tensor):
            if key in _KEPT_SETTINGS:
                rebuilt[key] = value  # others (a trainer's own switches, say) may change what comes back
            continue
        like = {"dtype": value.dtype, "device": value.device}
        if key == "input_ids":
            rebuilt[key] = row.to(**like)[None]
        elif key == "position_ids":  # [1, T] or [R, 1, T] (Qwen-VL): text rows restart, as for text tokens
            rebuilt[key] = positions.to(**like).expand(*value.shape[:-1], len(row)).clone()
        elif key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            rebuilt[key] = bounds.to(**like)
        elif key in ("max_length_q", "max_length_k"):
            rebuilt[key] = torch.tensor(max(lengths), **like)
        elif key == "seq_idx":
            counts = torch.tensor(lengths)
            rebuilt[key] = torch.repeat_interleave(torch.arange(len(lengths)), counts).to(**like)[None]
        elif key == "token_type_ids":
            rebuilt[key] = torch.zeros(1, len(row), **like)
        elif key == "attention_mask" and value.dim() == 2:
            rebuilt[key] = torch.ones(1, len(row), **like)  # as given: a 2-D mask over the packed row
        elif value.shape[-1] == width or key == "attention_mask":
            raise ProbeSkipped(
                f"the probe cannot rebuild {key!r} (shape {tuple(value.shape)}) for its rows; run "
                "check_packing on a batch without it, or turn the probe off"
            )
        # other tensors (not token-aligned) pass as they are
        else:
            rebuilt[key] = value
    return rebuilt


def _enforce(model: torch.nn.Module, report: ProbeReport, hint: str) -> ProbeReport:
    if report.passed:
        logger().info("packing check passed for %s: %s", report.model, report.summary())
        return report
    where = f"; it enters at {', '.join(report.layers)}" if report.layers else ""
    if report.leaks:
        share = report.cross_sequence / report.leak if report.leak else float("inf")
        finding = (
            f"the packed sequences see each other: a sequence's log-probabilities move "
            f"{report.cross_sequence:.3g} when the tokens of the sequence before it change, {share:.1%} of "
            f"what one causal mask over the row gives ({report.leak:.3g}; allowed {LEAK_FRACTION:g} of it)"
            f"{where}"
        )
    else:
        finding = (
            f"packed sequences are not computed as alone: their log-probabilities lie "
            f"{report.unpacked_gap:.3g} from the sequences run alone, against {report.contaminated_gap:.3g} "
            f"for one causal mask over the row (allowed {GAP_FRACTION:g} of it): positions or other inputs "
            "do not restart per sequence"
        )
    raise PackingLeakError(
        f"packing check failed for {report.model}: {finding}. Train this model unpacked (padded batches), "
        f"or with an attention implementation and transformers release that keep packed sequences apart; "
        f"{hint}. To run without the check (at your own risk): {PROBE_ENV}=0",
        report,
    )


def _probe(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    bounds: torch.Tensor,
    packed: Callable[[torch.Tensor, Sequence[int]], torch.Tensor],
) -> ProbeReport:
    rows = probe_rows(tokens.cpu(), bounds, excluded=_excluded_tokens(model))
    plain = _plain(model, tokens.device)
    with eval_without_grad(model):
        report = run_probe(rows, packed, plain, model=describe_model(model))
        if report.leaks:
            report = dataclasses.replace(report, layers=locate_leak(model, rows, packed, plain))
    return report


def packed_row_bounds(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """The boundaries ``[N + 1]`` of a training forward's inputs when they are one packed row of two or
    more sequences (``cu_seq_lens_q``, else where ``position_ids`` restart); None otherwise (a padded
    ``[B, S]`` batch, or one sequence: nothing packed to check)."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        return None
    bounds = _model_input_bounds(inputs, ids.shape[1])
    return bounds if len(bounds) > 2 else None


def check_label_boundaries(inputs: Mapping[str, Any], bounds: torch.Tensor) -> None:
    """Refuse ``labels`` (transformers' convention: the model shifts them) that make the last token of a
    sequence learn to predict the first token of the next one: each later sequence's first label must
    be ignored (negative, e.g. -100). With ``shift_labels`` (read by the loss instead) nothing is checked.

    Raises:
        TightpackError: naming the sequences whose first label is a target.
    """
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor) or isinstance(inputs.get("shift_labels"), torch.Tensor):
        return
    starts = bounds[1:-1].long()
    crossing = torch.nonzero(labels.reshape(-1).cpu()[starts] >= 0).reshape(-1)
    if len(crossing):
        first = int(starts[crossing[0]])
        value = int(labels.reshape(-1)[first])
        raise TightpackError(
            f"labels cross sequences: the first label of {len(crossing)} of the {len(starts)} later "
            f"sequences of the packed row is a target (labels[0, {first}] = {value}), "
            "so each previous sequence's last token learns to predict it; set -100 at every sequence's "
            "first label (tightpack's PackingCollator and transformers' DataCollatorWithFlattening do)"
        )


def probe_model_inputs(model: torch.nn.Module, inputs: Mapping[str, Any]) -> ProbeReport:
    """Probe ``model`` with the keyword arguments of one training forward: one packed row (``input_ids``
    ``[1, T]``) of two or more sequences. Its ``labels`` are checked first (`check_label_boundaries`).

    Raises:
        TightpackError: labels that cross sequences.
        ProbeSkipped: the inputs are not such a row, or hold a token-aligned tensor the probe cannot
            rebuild (a 4-D attention mask, say).
    """
    bounds = packed_row_bounds(inputs)
    if bounds is None:
        ids = inputs.get("input_ids")
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
        raise ProbeSkipped(
            f"the probe takes one packed row of two or more sequences (input_ids [1, T] with restarting "
            f"position_ids or cu_seq_lens_q); got input_ids of shape {shape}"
        )

    check_label_boundaries(inputs, bounds)

    def packed(row: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        return _logits(model(**_rebuild_inputs(inputs, row, lengths)))[0]

    return _probe(model, inputs["input_ids"][0], bounds, packed)


def probe_batch(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    model_kwargs: Callable[[torch.nn.Module, Mapping[str, Any]], dict[str, Any]],
    **forward_kwargs: Any,
) -> ProbeReport:
    """Probe ``model`` on sequences of one packed row of a THD batch, run as ``model(**model_kwargs(model,
    probe_batch), use_cache=False, **forward_kwargs)`` (``packed_forward``'s call)."""
    tokens = thd.token_tensor(batch)
    if tokens is None or tokens.dim() != 2 or tokens.shape[0] != 1:
        shape = None if tokens is None else tuple(tokens.shape)
        raise ProbeSkipped(f"the probe takes one packed row ([1, T] tokens), got shape {shape}")
    vlm = batch.get("mrope_position_ids") is not None
    device = tokens.device

    def packed(row: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        positions = restarting_positions(lengths).to(device)[None]
        probe = {"tokens": row.to(device)[None], "position_ids": positions,
                 "cu_seqlens_q": sequence_boundaries(lengths).to(device)}  # fmt: skip
        if vlm:  # text tokens: the same position on the three multimodal axes
            probe["mrope_position_ids"] = positions.expand(3, 1, -1).clone()
        return _logits(model(**model_kwargs(model, probe), use_cache=False, **forward_kwargs))[0]

    return _probe(model, tokens[0], thd.physical_boundaries(batch).cpu(), packed)


def check_packing(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    model_kwargs: Callable[[torch.nn.Module, Mapping[str, Any]], dict[str, Any]] | None = None,
    hint: str = "",
) -> ProbeReport:
    """Probe ``model`` on ``batch`` and stop on a failed probe; log one line when it passes.

    ``batch`` is a THD batch (``cu_seqlens_q``; then ``model_kwargs`` builds the model's arguments,
    default `tightpack.runtime.hf_kwargs.model_kwargs`, what ``packed_forward`` passes), a shared-prefix
    preference row (``branch_ids``: `tightpack.runtime.equivalence.preference.probe_shared_prefix`) or
    the keyword arguments of a training forward (what ``Trainer`` passes the model).

    >>> # report = check_packing(model, collator(rows))  # raises PackingLeakError when it fails

    Raises:
        PackingLeakError: the probe failed; the message names the model, the figures, the layer where
            the leak enters (when found) and what to do; ``.report`` holds the `ProbeReport`.
        ProbeSkipped: the batch cannot give a probe.
    """
    if batch.get("branch_ids") is not None:  # a shared-prefix preference row: siblings must not meet
        report = probe_shared_prefix(model, batch, describe=describe_model(model))
    elif thd.is_packed(batch):
        report = probe_batch(model, batch, model_kwargs or packed_forward_kwargs)
    else:
        report = probe_model_inputs(model, batch)
    return _enforce(model, report, hint or "check a batch again with tightpack.runtime.hf.check_packing")
