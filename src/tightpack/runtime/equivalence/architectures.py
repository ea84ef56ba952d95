"""Model families the installed transformers cannot run packed, refused before any step.

Two kinds, each measured on tiny models of the family (``tests/test_packing_probe.py`` runs every one
through the probe with this table bypassed, so an entry that transformers has since fixed fails there):

- layers that carry state from one token to the next (state-space, recurrent, linear attention) and
  that transformers gives no sequence boundaries, so every sequence starts from the previous one's state;
- attention whose mask or positions are built from ``attention_mask`` or the row alone and never read
  ``position_ids``: one causal mask covers the row, and in some families the positions run on.

Families whose state layers do read the boundaries (``seq_idx`` / ``cu_seqlens``: Bamba, FalconH1,
GraniteMoeHybrid, NemotronH, Zamba2, LFM2, Kimi-Linear, Qwen3-Next, ...) are not here: they keep
sequences apart with their kernels (``causal_conv1d``, ``mamba_ssm``, ``fla``) and raise without them,
and the probe checks them on the user's model. Mamba-2 reads them from transformers 5.25, and is
refused before that release by `tightpack.runtime.transformers_releases.FAMILY_FLOORS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tightpack.errors import TightpackError

_STATE = (
    "its {layers} layers carry state from one token to the next and transformers gives them no sequence "
    "boundaries, so every packed sequence starts from the state the one before it left"
)
_MASK = (
    "its attention {what} built from the row alone, not from position_ids, so one causal mask covers the "
    "packed row{positions}"
)


@dataclasses.dataclass(frozen=True)
class _Family:
    reason: str
    applies: Callable[[Any], bool] = lambda config: True


UNPACKABLE: dict[str, _Family] = {
    "mamba": _Family(_STATE.format(layers="Mamba (state-space)")),
    "falcon_mamba": _Family(_STATE.format(layers="Mamba (state-space)")),
    "jamba": _Family(_STATE.format(layers="Mamba (state-space)")),
    "rwkv": _Family(_STATE.format(layers="RWKV (recurrent)")),
    "xlstm": _Family(_STATE.format(layers="mLSTM (recurrent)")),
    "recurrent_gemma": _Family(_STATE.format(layers="RG-LRU (recurrent)")),
    "minimax": _Family(_STATE.format(layers="lightning (linear) attention")),
    "opt": _Family(_MASK.format(what="mask is", positions=" and positions count on from its start")),
    "biogpt": _Family(_MASK.format(what="mask is", positions=" and positions count on from its start")),
    "xglm": _Family(_MASK.format(what="mask is", positions=" and positions count on from its start")),
    "bloom": _Family(_MASK.format(what="mask and ALiBi biases are", positions="")),
    "mpt": _Family(_MASK.format(what="mask and ALiBi biases are", positions="")),
    "falcon": _Family(
        _MASK.format(what="mask and ALiBi biases are", positions=" (Falcon with alibi=True)"),
        lambda config: bool(getattr(config, "alibi", False)),
    ),
}


def _configs(model: Any) -> list[Any]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def unpackable_reason(model: Any) -> str | None:
    """Why the installed transformers cannot run this model packed, or None when nothing is known."""
    for config in _configs(model):
        family = UNPACKABLE.get(getattr(config, "model_type", None))
        if family is not None and family.applies(config):
            return family.reason
    return None


def check_architecture(model: Any) -> None:
    """Refuse a model of a family in `UNPACKABLE`.

    Raises:
        TightpackError: naming the model class, why it cannot be packed and what to do.
    """
    reason = unpackable_reason(model)
    if reason is not None:
        from tightpack.runtime.mrope import transformers_version

        release = ".".join(map(str, transformers_version() or ("?",)))
        raise TightpackError(
            f"{type(model).__name__} cannot be trained on packed rows with transformers {release}: {reason}. "
            "Train it unpacked (padded batches, e.g. DataCollatorForSeq2Seq), or choose a model family "
            "whose layers read the sequence boundaries"
        )
