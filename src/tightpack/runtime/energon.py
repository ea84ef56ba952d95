"""Megatron-Energon online packing with tightpack's grouping and THD batch builder.

Energon packs when ``get_train_dataset(..., batch_size=1, packing_buffer_size=N)`` is given a task
encoder that overrides ``select_samples_to_pack`` and ``pack_selected_samples``: each time no group
is pending, the whole reading buffer (N samples, fewer at the end of a finite stream) goes to the
selector, and every sample the selector leaves out is discarded. Then one group per step goes through
``pack_selected_samples`` and ``batch([packed])``. Pending groups are saved as restore keys and
rebuilt on resume by running ``encode_sample`` and ``pack_selected_samples`` again, so both are
``@stateless``.

`PackingTaskEncoderMixin` supplies the three hooks; put it before ``TaskEncoder`` in the bases::

    class MyEncoder(PackingTaskEncoderMixin, TaskEncoder):
        pack_size = 8192
        pad_to_multiple_of = 8

        @stateless
        def encode_sample(self, sample: TextSample) -> PreparedSample:
            ids = torch.tensor(tokenizer.encode(sample.text))
            return PreparedSample.derive_from(sample, input_ids=ids)

The selector puts every sample into exactly one group of at most ``pack_size`` aligned tokens, with
one of ``STRATEGIES``:

- ``fullest_first`` (default) forms the groups one at a time, each the fullest that the samples
  still ungrouped allow (an exact subset sum, `tightpack.core.subset_fill.fill_groups`): the Minimum
  Bin Slack heuristic (Gupta and Ho, 1999) with an exact search. The last groups take what is left.
- ``ffd`` is first-fit decreasing, as the reference.

``best_fill`` is a deprecated alias of ``fullest_first`` (a ``FutureWarning`` says so): that name
belongs to `tightpack.runtime.online`'s streaming strategy, which emits one fullest pack per step and
keeps the leftovers for later, which Energon's selector cannot do (it must group the whole buffer).
``batch`` builds the THD row with `tightpack.runtime.in_batch.pack_samples` and adds the member
``keys``; with ``vlm_rope`` set (a `tightpack.runtime.mrope.QwenVLRope`) it builds it with
`tightpack.runtime.vlm.pack_vlm_samples`, which adds the Qwen-VL multimodal positions
(``mrope_position_ids``) and the visual tensors in member order. Needs the optional extra:
``pip install 'tightpack[energon]'``.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

from tightpack.core.alignment import ceil_to_multiple
from tightpack.core.planner import plan_packs
from tightpack.core.subset_fill import fill_groups
from tightpack.errors import TightpackError, check_choice
from tightpack.runtime.in_batch import VISUAL_KEYS, pack_samples
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.vlm import pack_vlm_samples

try:
    from megatron.energon import Sample, edataclass, stateless
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tightpack.runtime.energon needs megatron-energon, which is not installed; "
        "install the extra with: pip install 'tightpack[energon]'"
    ) from error

__all__ = ["STRATEGIES", "PackedSample", "PackingTaskEncoderMixin", "PreparedSample"]

STRATEGIES = ("fullest_first", "ffd")
_DEPRECATED_STRATEGIES = {"best_fill": "fullest_first"}  # old name: new name


@edataclass
class PreparedSample(Sample):
    """One tokenized sample, ready to pack: a 1-D ``input_ids`` and optional per-token and visual tensors.

    Build it with ``PreparedSample.derive_from(raw_sample, input_ids=...)`` to keep the key and restore key.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None


@edataclass
class PackedSample(Sample):
    """One group chosen by the selector; ``__key__`` joins the member keys with commas."""

    samples: list[PreparedSample]


class PackingTaskEncoderMixin:
    """Energon's packing hooks (``select_samples_to_pack``, ``pack_selected_samples``, ``batch``).

    Configure with class or instance attributes: ``pack_size`` (tokens per pack, required),
    ``pad_to_multiple_of`` (alignment of every member), ``pad_to_max_length`` (every row exactly
    ``pack_size`` wide), ``packing_strategy`` (``fullest_first`` or ``ffd``; ``best_fill`` is a
    deprecated alias of ``fullest_first``), ``pad_token_id``, ``ignore_index``, and for Qwen-VL
    models ``vlm_rope`` (``QwenVLRope.from_config(model_config)``). Members are `PreparedSample`
    objects, or any object with the same attributes.
    """

    pack_size: int | None = None
    pad_to_multiple_of: int = 1
    pad_to_max_length: bool = False
    packing_strategy: Literal["fullest_first", "ffd"] = "fullest_first"
    pad_token_id: int = 0
    ignore_index: int = -100
    vlm_rope: QwenVLRope | None = None

    def _checked_settings(self) -> tuple[int, int]:
        """``(pack_size, pad_to_multiple_of)`` after checking every setting."""
        size, multiple = self.pack_size, self.pad_to_multiple_of
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise TightpackError(
                f"{type(self).__name__}.pack_size must be a positive int (tokens per pack), got {size!r}; "
                "set it as a class attribute or in __init__"
            )
        if isinstance(multiple, bool) or not isinstance(multiple, int) or not 1 <= multiple <= size:
            raise TightpackError(
                f"{type(self).__name__}.pad_to_multiple_of must be an int between 1 and pack_size ({size}), "
                f"got {multiple!r}"
            )
        if self.packing_strategy not in _DEPRECATED_STRATEGIES:
            check_choice(f"{type(self).__name__}.packing_strategy", self.packing_strategy, STRATEGIES)
        return size, multiple

    def _strategy(self) -> str:
        """``packing_strategy`` with a deprecated alias resolved, and a ``FutureWarning`` for it."""
        name = self.packing_strategy
        if name in _DEPRECATED_STRATEGIES:
            new = _DEPRECATED_STRATEGIES[name]
            # FutureWarning, not DeprecationWarning: the call comes from Energon's loader, not from the
            # user's module, where a DeprecationWarning is hidden by default.
            warnings.warn(
                f"{type(self).__name__}.packing_strategy = {name!r} is deprecated: the grouping is now named "
                f"{new!r} ({name!r} is the online packer's strategy, which keeps leftovers for later); "
                f"set packing_strategy = {new!r}",
                FutureWarning,
                stacklevel=3,
            )
            return new
        return name

    def packing_length(self, sample: Any) -> int:
        """Tokens a sample takes in a pack: its length rounded up to ``pad_to_multiple_of``.

        Raises ValueError when that exceeds ``pack_size``. The selector checks every sample of the
        buffer, and Energon's error handler then drops the whole buffer; call this in ``encode_sample``
        (and raise ``SkipSample`` or let the error through) to lose only the offending sample.
        """
        size, multiple = self._checked_settings()
        tokens = getattr(sample, "input_ids", None)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or len(tokens) == 0:
            raise TightpackError(
                f"Sample {_key(sample)} needs a non-empty 1-D input_ids tensor for packing, got "
                f"{_describe(tokens)}; return a PreparedSample from encode_sample"
            )
        aligned = ceil_to_multiple(len(tokens), multiple)
        if aligned > size:
            raise TightpackError(
                f"Sample {_key(sample)} aligned sequence length {aligned} exceeds seq_length={size}. "
                "Truncate or skip it in encode_sample, or raise pack_size."
            )
        return aligned

    def select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        """Split the whole buffer into groups of at most ``pack_size`` aligned tokens, each sample in one."""
        size, _ = self._checked_settings()
        lengths = [self.packing_length(sample) for sample in samples]
        if self._strategy() == "ffd":
            groups = [group.tolist() for group in plan_packs(lengths, size, algorithm="ffd")]
        else:
            groups = fill_groups(lengths, size)
        return [[samples[i] for i in group] for group in groups]

    @stateless
    def pack_selected_samples(self, samples: list[Any]) -> PackedSample:
        """Wrap one selected group; Energon assigns its restore key afterwards."""
        if not samples:
            raise TightpackError("Cannot pack an empty sample group.")
        sources = tuple(src for sample in samples for src in (getattr(sample, "__sources__", None) or ()))
        return PackedSample(
            __key__=",".join(str(sample.__key__) for sample in samples),
            __restore_key__=(),
            __subflavors__={},
            __sources__=sources or None,
            samples=list(samples),
        )

    @stateless
    def batch(self, samples: list[Any]) -> dict[str, Any]:
        """The THD batch of one packed sample, with its members' ``keys`` in order.

        Also holds ``__restore_key__``, which Energon fills in: ``loader.restore_sample(key)`` rebuilds it.
        """
        packed = [isinstance(sample, PackedSample) for sample in samples]
        if any(packed) and not all(packed):
            raise TypeError("Energon batches cannot mix packed and unpacked samples.")
        if not any(packed):
            raise TightpackError(
                "PackingTaskEncoderMixin.batch expects packed samples: pass packing_buffer_size to "
                "get_train_dataset / get_val_dataset"
            )
        if len(samples) != 1:
            raise TightpackError("Energon native sequence packing requires physical micro_batch_size=1.")
        size, multiple = self._checked_settings()
        members = samples[0].samples
        length = sum(self.packing_length(member) for member in members)
        if length > size:
            raise TightpackError(f"Packed group length {length} exceeds seq_length={size}.")
        rows = [_as_mapping(member) for member in members]
        options = {"sequence_length": size, "pad_token_id": self.pad_token_id,
                   "ignore_index": self.ignore_index, "pad_to_multiple_of": multiple,
                   "pad_to_max_length": self.pad_to_max_length}  # fmt: skip
        if self.vlm_rope is None:
            batch = pack_samples(rows, **options)
        else:
            batch = pack_vlm_samples(rows, self.vlm_rope, **options)
        batch["keys"] = [member.__key__ for member in members]
        batch["__restore_key__"] = ()
        return batch


def _as_mapping(sample: Any) -> dict[str, Any]:
    keys = ("input_ids", "labels", "loss_mask", *VISUAL_KEYS)
    return {key: value for key in keys if (value := getattr(sample, key, None)) is not None}


def _key(sample: Any) -> str:
    return str(getattr(sample, "__key__", "<no __key__>"))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
