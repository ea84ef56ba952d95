"""TRL's ``DPOTrainer`` on packed preference rows.

TRL batches a step's pairs as one padded ``[2B, S]`` tensor, the ``B`` chosen rows then the ``B``
rejected rows, and asks the model (through its fused LM head, ``fused_lm_head=True``) for per-token
log-probabilities ``[2B, S - 1]``; its losses (sigmoid, IPO, hinge, ... and their weightings), the
reference model, PEFT adapters and the metrics all read them. `PackedDPOTrainer` patches the forward
of the model (and of the reference model) that TRL patched: a DPO forward is packed into one
preference row (`tightpack.runtime.preference_batch`; the prompt of a pair once in the
``shared-prefix`` layout), run packed, and its per-token outputs are put back where TRL reads them.
Everything else is TRL's own code.

`pack_padded_pairs` and `PackedPairs.unpack` are that conversion, usable without TRL.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import numpy as np
import torch

from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits
from tightpack.errors import TightpackError, check_choice
from tightpack.logs import logger
from tightpack.runtime.preference_batch import build_preference_row
from tightpack.runtime.preference_hf import preference_model_kwargs

__all__ = ["PackedDPOTrainer", "PackedPairs", "pack_padded_pairs"]


@dataclasses.dataclass(frozen=True)
class PackedPairs:
    """A padded DPO batch as one preference row, and where each of its targets goes back.

    ``row`` is the preference row; ``rows`` and ``columns`` (``[targets]``) place the row's targets,
    in row order, in the padded ``[2B, S - 1]`` per-token layout (column ``t`` scores token ``t + 1``).
    """

    row: dict[str, Any]
    rows: torch.Tensor
    columns: torch.Tensor
    shape: tuple[int, int]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` of the packed row (``[1, T]``, at the positions whose label is set) as
        the padded ``[2B, S - 1]`` tensor TRL reads, 0 elsewhere; differentiable."""
        trained = self.row["labels"].reshape(-1) != -100
        picked = values.reshape(-1)[trained.to(values.device)]
        out = values.new_zeros(self.shape)
        out[self.rows.to(values.device), self.columns.to(values.device)] = picked
        return out


def pack_padded_pairs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor, layout: Layout
) -> PackedPairs:
    """Pack TRL's padded DPO batch (``[2B, S]``: chosen rows, then rejected rows, right-padded; the
    completion marked by ``completion_mask``) into one preference row.

    A pair whose chosen and rejected rows start with the same prompt is one unit; otherwise (TRL's
    ``keep_end`` truncation can leave them different prompts) each row is a unit of its own. A row
    whose completion starts at its first token keeps that token as its prompt: TRL never scores it.

    >>> ids = torch.tensor([[1, 2, 3, 0], [1, 2, 4, 5]])
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    >>> completion = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]])
    >>> packed = pack_padded_pairs(ids, mask, completion, "shared-prefix")
    >>> packed.row["input_ids"].tolist(), packed.rows.tolist(), packed.columns.tolist()
    ([[1, 2, 3, 2, 4, 5]], [0, 1, 1], [1, 1, 2])
    """
    check_choice("layout", layout, LAYOUTS)
    if input_ids.dim() != 2 or input_ids.shape[0] % 2:
        raise TightpackError(
            f"a DPO batch is [2B, S] (chosen rows, then rejected rows); got {tuple(input_ids.shape)}"
        )
    ids = input_ids.cpu().numpy()
    lengths = attention_mask.sum(1).cpu().numpy()
    completion = completion_mask.cpu().numpy().astype(bool)
    starts = np.where(completion.any(1), completion.argmax(1), lengths)
    starts = np.maximum(starts, 1)  # the first token is never scored: it is at least the prompt
    pairs = len(ids) // 2
    prompts, branches, masks, counts, order = [], [], [], [], []
    for pair in range(pairs):
        chosen, rejected = pair, pair + pairs
        rows = [chosen, rejected]
        same = starts[chosen] == starts[rejected] and np.array_equal(
            ids[chosen, : starts[chosen]], ids[rejected, : starts[rejected]]
        )
        for unit_rows in [rows] if same else [[chosen], [rejected]]:
            prompts.append(ids[unit_rows[0], : starts[unit_rows[0]]].tolist())
            for r in unit_rows:
                branches.append(ids[r, starts[r] : lengths[r]].tolist())
                masks.append(completion[r, starts[r] : lengths[r]].astype(np.int8).tolist())
                order.append(r)
            counts.append(len(unit_rows))
    empty = [order[b] for b, branch in enumerate(branches) if not branch]
    if empty:
        raise TightpackError(
            f"DPO row {empty[0]} has no completion token after its prompt (truncated away?): raise "
            "max_length or shorten the prompts"
        )
    units = PreferenceUnits.from_lists(prompts, branches, counts, loss_masks=masks)
    row = build_preference_row(units, layout)
    target_rows, target_columns = [], []
    for branch, r in enumerate(order):
        supervised = np.flatnonzero(
            units.branch_loss_mask[units.branch_offsets[branch] : units.branch_offsets[branch + 1]]
        )
        target_rows.append(np.full(len(supervised), r))
        target_columns.append(starts[r] + supervised - 1)
    device = input_ids.device
    row = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in row.items()}
    return PackedPairs(
        row,
        torch.from_numpy(np.concatenate(target_rows)),
        torch.from_numpy(np.concatenate(target_columns)),
        (len(ids), ids.shape[1] - 1),
    )


_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's fused-head output, ``[rows, S - 1]``."""
_REPLACED = ("input_ids", "attention_mask", "labels", "use_cache")
"""The padded batch's keys that the packed row's own replace."""


def _packing_forward(model: torch.nn.Module, layout: Layout) -> None:
    """Wrap ``model.forward`` (TRL's fused-head forward) so a DPO forward runs packed."""
    fused_forward = model.forward

    @functools.wraps(fused_forward)
    def forward(self, *args, fused_lm_head: bool = False, **kwargs):
        input_ids, attention_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        labels = kwargs.get("labels")
        if not fused_lm_head or args or input_ids is None or labels is None or attention_mask is None:
            return fused_forward(*args, fused_lm_head=fused_lm_head, **kwargs)
        packed = pack_padded_pairs(input_ids, attention_mask, labels != -100, layout)
        rest = {k: v for k, v in kwargs.items() if k not in _REPLACED}
        model_kwargs = preference_model_kwargs(self, packed.row)
        output = fused_forward(**model_kwargs, shift_labels=packed.row["labels"], fused_lm_head=True, **rest)
        for name in _PER_TOKEN:  # back to TRL's padded [2B, S - 1] layout
            if getattr(output, name, None) is not None:
                output[name] = packed.unpack(getattr(output, name))
        output["label_mask"] = labels[:, 1:] != -100
        return output

    model.forward = types.MethodType(forward, model)


def _probe(model: torch.nn.Module, row: dict[str, Any]) -> None:
    from tightpack.runtime.equivalence.hf import check_packing, probe_enabled
    from tightpack.runtime.equivalence.probe import ProbeSkipped

    if not probe_enabled():
        return
    try:
        check_packing(
            model, row, hint="check a batch with tightpack.runtime.equivalence.check_packing(model, batch)"
        )
    except ProbeSkipped as skipped:
        logger().warning("packing check skipped for %s: %s", type(model).__name__, skipped)


def _trainer_base():
    try:
        from trl import DPOTrainer
    except ImportError as error:  # pragma: no cover - trl is a dev dependency here
        raise TightpackError("PackedDPOTrainer needs TRL: pip install trl") from error
    return DPOTrainer


class PackedDPOTrainer(_trainer_base()):
    """TRL's ``DPOTrainer`` whose forwards run on packed preference rows (the module docstring); it
    takes ``trl.DPOTrainer``'s arguments, and:

    Args:
        preference_layout: ``shared-prefix`` (a pair's prompt once) or ``pairs``.
        probe: check the model on the first packed row with the equivalence probe
            (`tightpack.runtime.equivalence.check_packing`; ``TIGHTPACK_PROBE=0`` turns it off).

    >>> # trainer = PackedDPOTrainer(model, args=DPOConfig(...), train_dataset=pairs,
    >>> #                            processing_class=tokenizer, preference_layout="shared-prefix")
    """

    def __init__(
        self, *args: Any, preference_layout: Layout = "shared-prefix", probe: bool = True, **kwargs: Any
    ):
        check_choice("preference_layout", preference_layout, LAYOUTS)
        super().__init__(*args, **kwargs)
        if getattr(self, "_is_vision_dataset", False):
            raise TightpackError(
                "PackedDPOTrainer packs text pairs; this dataset has images, whose inputs it does not "
                "pack: train it with trl.DPOTrainer"
            )
        from accelerate.utils import is_peft_model

        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        _packing_forward(model, preference_layout)
        if self.ref_model is not None:
            _packing_forward(self.accelerator.unwrap_model(self.ref_model), preference_layout)
        self.preference_layout = preference_layout
        self._probe_pending = probe

    def compute_loss(self, model, inputs, *args, **kwargs):
        # The probe runs here, before the first packed forward and outside it: a forward that called
        # the model again would re-enter accelerate's autocast wrapper, whose one context object then
        # leaves autocast switched on when it exits.
        if self._probe_pending:
            self._probe_pending = False
            completion = inputs["completion_mask"].bool()
            packed = pack_padded_pairs(
                inputs["input_ids"], inputs["attention_mask"], completion, self.preference_layout
            )
            _probe(model, packed.row)
        return super().compute_loss(model, inputs, *args, **kwargs)
