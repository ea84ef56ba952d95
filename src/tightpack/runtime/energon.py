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

A sample longer than the pack never costs the others of its buffer (Energon's error handler would
drop the whole buffer if the selector raised): ``long_samples`` cuts it (``truncate``, default),
leaves it out (``drop``), both counted, or stops the run (``error``, a `LongSampleError` that
Energon re-raises whatever its handler), as ``--long-samples`` and `OnlinePackConfig` do.

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

import copy
import dataclasses
import warnings
from typing import Any, Literal, get_args

import torch

from tightpack.core.alignment import ceil_to_multiple, length_cap
from tightpack.core.planner import plan_packs
from tightpack.core.subset_fill import fill_groups
from tightpack.errors import TightpackError, check_choice
from tightpack.logs import logger
from tightpack.runtime.in_batch import VISUAL_KEYS, pack_samples
from tightpack.runtime.mrope import QwenVLRope
from tightpack.runtime.online_config import LongSamples
from tightpack.runtime.vlm import pack_vlm_samples

try:
    from megatron.energon import Sample, SkipSample, edataclass, stateless
    from megatron.energon.errors import FatalSampleError
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tightpack.runtime.energon needs megatron-energon, which is not installed; "
        "install the extra with: pip install 'tightpack[energon]'"
    ) from error

__all__ = ["LongSampleError", "PackedSample", "PackingTaskEncoderMixin", "PreparedSample"]

STRATEGIES = ("fullest_first", "ffd")
_DEPRECATED_STRATEGIES = {"best_fill": "fullest_first"}  # old name: new name
_PER_TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


class LongSampleError(TightpackError, FatalSampleError):
    """A sample longer than the pack under ``long_samples = "error"``.

    A `FatalSampleError` too: Energon's error handlers re-raise it (as a ``FatalSampleError`` with
    this message) instead of logging it and dropping the buffer, so the run stops.
    """


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
    """One group chosen by the selector; ``__key__`` joins the member keys with commas.

    ``truncated`` and ``dropped`` hold the keys of the members cut to the pack and of the samples
    left out by the long-sample policy (``PackingTaskEncoderMixin.long_samples``).
    """

    samples: list[PreparedSample]
    truncated: list[str] = dataclasses.field(default_factory=list)
    dropped: list[str] = dataclasses.field(default_factory=list)


class PackingTaskEncoderMixin:
    """Energon's packing hooks (``select_samples_to_pack``, ``pack_selected_samples``, ``batch``).

    Configure with class or instance attributes: ``pack_size`` (tokens per pack, required),
    ``pad_to_multiple_of`` (alignment of every member), ``pad_to_max_length`` (every row exactly
    ``pack_size`` wide), ``packing_strategy`` (``fullest_first`` or ``ffd``; ``best_fill`` is a
    deprecated alias of ``fullest_first``), ``pad_token_id``, ``ignore_index``, and for Qwen-VL
    models ``vlm_rope`` (``QwenVLRope.from_config(model_config)``). Members are `PreparedSample`
    objects, or any object with the same attributes.

    ``long_samples`` says what happens to a sample whose aligned length exceeds ``pack_size``, as
    in the offline and online paths, and never costs another sample: ``truncate`` (default) keeps
    the longest aligned prefix that fits (a sample with visual tensors is dropped instead, as the
    offline path does: a cut could split an image); ``drop`` leaves it out; ``error`` stops the run
    with `LongSampleError`, whatever Energon's error handler. Truncated and dropped samples are
    counted in ``long_sample_counts`` (this process's: each DataLoader worker has its own), logged
    one line each, and listed in the batch of their pack (``truncated_keys``, ``dropped_keys``).
    """

    pack_size: int | None = None
    pad_to_multiple_of: int = 1
    pad_to_max_length: bool = False
    packing_strategy: Literal["fullest_first", "ffd"] = "fullest_first"
    pad_token_id: int = 0
    ignore_index: int = -100
    vlm_rope: QwenVLRope | None = None
    long_samples: LongSamples = "truncate"

    @property
    def long_sample_counts(self) -> dict[str, int]:
        """``{"truncated": n, "dropped": m}``: long samples handled so far by this process's selector."""
        return self.__dict__.setdefault("_long_sample_counts", {"truncated": 0, "dropped": 0})

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
        check_choice(f"{type(self).__name__}.long_samples", self.long_samples, get_args(LongSamples))
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

        Raises `TightpackError` when that exceeds ``pack_size``. The selector does not call it on
        long samples: it applies ``long_samples`` to them. Call it in ``encode_sample`` (and raise
        ``SkipSample``) to skip long samples there instead.
        """
        size, _ = self._checked_settings()
        aligned = self._aligned_length(sample)
        if aligned > size:
            raise TightpackError(
                f"Sample {_key(sample)} aligned sequence length {aligned} exceeds seq_length={size}. "
                "Truncate or skip it in encode_sample, or raise pack_size."
            )
        return aligned

    def _aligned_length(self, sample: Any) -> int:
        tokens = getattr(sample, "input_ids", None)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or len(tokens) == 0:
            raise TightpackError(
                f"Sample {_key(sample)} needs a non-empty 1-D input_ids tensor for packing, got "
                f"{_describe(tokens)}; return a PreparedSample from encode_sample"
            )
        return ceil_to_multiple(len(tokens), self.pad_to_multiple_of)

    def _long_sample_action(self, sample: Any, aligned: int) -> Literal["truncate", "drop"]:
        """What ``long_samples`` does with a sample of ``aligned`` tokens, above the pack.

        Raises:
            LongSampleError: under ``long_samples = "error"``.
        """
        if self.long_samples == "error":
            raise LongSampleError(
                f"Sample {_key(sample)} aligned sequence length {aligned} exceeds seq_length="
                f"{self.pack_size}. long_samples='error' stops the run: truncate or skip it in "
                "encode_sample, raise pack_size, or set long_samples to 'truncate' or 'drop'."
            )
        if self.long_samples == "drop" or any(getattr(sample, key, None) is not None for key in VISUAL_KEYS):
            return "drop"
        return "truncate"

    def select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        """Split the whole buffer into groups of at most ``pack_size`` aligned tokens, each sample in one.

        A sample longer than the pack takes the length it is cut to (``truncate``), or none
        (``drop``: it rides in the first group, which leaves it out, so that its restore key goes
        with a pack); ``error`` raises `LongSampleError`. The other samples are grouped as if it
        were not there.
        """
        size, multiple = self._checked_settings()
        fitting, lengths, dropped = [], [], []
        for sample in samples:
            aligned = self._aligned_length(sample)
            if aligned > size:
                action = self._long_sample_action(sample, aligned)
                self._record_long_sample(sample, aligned, action)
                if action == "drop":
                    dropped.append(sample)
                    continue
                aligned = length_cap(size, multiple)
            fitting.append(sample)
            lengths.append(aligned)
        if self._strategy() == "ffd":
            groups = [group.tolist() for group in plan_packs(lengths, size, algorithm="ffd")]
        else:
            groups = fill_groups(lengths, size)
        selected = [[fitting[i] for i in group] for group in groups] or [[]]
        selected[0] += dropped
        return [group for group in selected if group]

    def _record_long_sample(self, sample: Any, aligned: int, action: str) -> None:
        kind = "truncated" if action == "truncate" else "dropped"
        self.long_sample_counts[kind] += 1
        split = action == "drop" and self.long_samples == "truncate"  # a media sample, not cut
        reason = " (it has visual tensors, which a cut could split)" if split else ""
        logger().warning(
            f"sample {_key(sample)} is {aligned} aligned tokens, above pack_size={self.pack_size}: "
            f"{kind}{reason} by long_samples={self.long_samples!r} "
            f"({self.long_sample_counts[kind]} {kind} in this process)"
        )

    @stateless
    def pack_selected_samples(self, samples: list[Any]) -> PackedSample:
        """Wrap one selected group; Energon assigns its restore key afterwards.

        Members longer than the pack are cut or left out here, by ``long_samples`` (the selector
        only chose their place), so that a pack rebuilt from its restore key is the same.
        """
        if not samples:
            raise TightpackError("Cannot pack an empty sample group.")
        size, multiple = self._checked_settings()
        members, truncated, dropped = [], [], []
        for sample in samples:
            aligned = self._aligned_length(sample)
            if aligned > size:
                if self._long_sample_action(sample, aligned) == "drop":
                    dropped.append(str(sample.__key__))
                    continue
                sample = _truncated(sample, length_cap(size, multiple))
                truncated.append(str(sample.__key__))
            members.append(sample)
        if not members:  # only dropped samples: Energon skips the pack
            raise SkipSample()
        sources = tuple(src for sample in members for src in (getattr(sample, "__sources__", None) or ()))
        return PackedSample(
            __key__=",".join(str(sample.__key__) for sample in members),
            __restore_key__=(),
            __subflavors__={},
            __sources__=sources or None,
            samples=members,
            truncated=truncated,
            dropped=dropped,
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
        for name, keys in (("truncated_keys", samples[0].truncated), ("dropped_keys", samples[0].dropped)):
            if keys:
                batch[name] = list(keys)
        batch["__restore_key__"] = ()
        return batch


def _truncated(sample: Any, keep: int) -> Any:
    """A copy of ``sample`` with its per-token tensors cut to the first ``keep`` tokens."""
    cut = {
        key: value[:keep]
        for key in _PER_TOKEN_KEYS
        if isinstance(value := getattr(sample, key, None), torch.Tensor)
    }
    if dataclasses.is_dataclass(sample):
        return dataclasses.replace(sample, **cut)
    copied = copy.copy(sample)
    for key, value in cut.items():
        setattr(copied, key, value)
    return copied


def _as_mapping(sample: Any) -> dict[str, Any]:
    keys = ("input_ids", "labels", "loss_mask", *VISUAL_KEYS)
    return {key: value for key in keys if (value := getattr(sample, key, None)) is not None}


def _key(sample: Any) -> str:
    return str(getattr(sample, "__key__", "<no __key__>"))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
