"""`PackConfig`: the settings of an offline packing run, checked before any work."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from tightpack.core.alignment import alignment_multiple, length_cap
from tightpack.core.cost_model import CostModel
from tightpack.core.planner import ALGORITHMS, MAX_PACK_SIZE
from tightpack.core.preference_units import LAYOUTS, Layout
from tightpack.errors import TightpackError, check_choice
from tightpack.offline.mixture import MixtureConfig
from tightpack.prepare.format_config import PREFERENCE_FORMATS
from tightpack.prepare.formats import FormatConfig

__all__ = ["PackConfig"]

LongSamples = Literal["truncate", "drop", "error"]
OutputFormat = Literal["parquet", "npy"]
Engine = Literal["local", "ray"]


_MIXTURE_REFUSES = {
    "engine='ray'": "the mixture needs each sample's input, which the local engine keeps",
    "balance_costs": "moving sequences between packs would undo the windows",
    "algorithm": "the mixture packs in its own order (chunks of the interleaved stream, packed apart)",
    "format": "mixtures of preference units are not supported yet",
}


def mixture_refusal(name: str) -> TightpackError:
    """The error of a setting a mixture run cannot take (``name``: a key of `_MIXTURE_REFUSES`).

    >>> print(mixture_refusal("balance_costs"))  # doctest: +NORMALIZE_WHITESPACE
    a mixture (weights) cannot take balance_costs: moving sequences between packs would undo the
    windows; drop balance_costs or the weights
    """
    return TightpackError(
        f"a mixture (weights) cannot take {name}: {_MIXTURE_REFUSES[name]}; drop {name} or the weights",
        parameters=(name, "weights"),
    )


@dataclass(kw_only=True)
class PackConfig:
    """Settings of an offline packing run (Megatron-Bridge names where the concept is the same).

    Attributes:
        packed_sequence_size: pack capacity P in runtime tokens (``--pack-size``).

    `validate` names the fields as written here (``max_seq_length``); the command line shows its
    flags instead (``--max-seq-length``).
        max_seq_length: per-sample cap L in runtime tokens; None means P. Must be <= P.
        pad_seq_to_mult: per-sequence alignment multiple m; None derives it from tp/cp/sp.
        tp, cp, sp: tensor/context parallel sizes and sequence parallelism, for the derived m.
        algorithm: planner algorithm (`tightpack.core.planner.ALGORITHMS`).
        seed: seed of the planner's shuffle (``first_fit_shuffle``).
        balance_costs: a cost model (preset name such as ``llama-8b`` or a JSON file, see
            `tightpack.core.cost_model.CostModel.resolve`): rewrite the plan so pack costs spread less
            (`tightpack.core.balanced_plan`; at most 0.1% more packs). None keeps the planner's packs.
        long_samples: samples with runtime length above the cap: ``truncate`` cuts them to
            ``cap + 1`` stored tokens as `tightpack.core.truncation` says (by default the prompt is
            trimmed and the answer kept; ``format`` chooses the fields, side and chat policy),
            ``drop`` leaves them out, ``error`` stops the run.
        pad_to_max_length, pad_cu_seqlens: recorded for the runtime collate (fixed width; static
            boundary shapes for CUDA graphs, which needs the fixed width).
        workers: tokenization processes (``local``), or tokenizer actors (``ray``; None: one per CPU of
            the cluster).
        engine: where tokenization runs: ``local`` worker processes, or a Ray cluster (``ray``,
            `tightpack.offline.engines.ray`); the output is byte-identical.
        ray_address: with ``engine="ray"``: ``auto`` or ``host:port`` joins a running cluster; None
            starts a local one for the run.
        reuse_store: keep the finished token store in the cache (``$TIGHTPACK_CACHE/stores``) and
            reuse it when the inputs, tokenizer and sample format are the same again.
        skip_bad_lines: count and report bad rows instead of stopping at the first one.
        row_group_size: packs per Parquet row group; None picks about 256k tokens per group.
        output_format: ``parquet`` (shards ``packs-NNNNN.idx.parquet``) or legacy ``npy`` (``packs.npy``).
        format: how rows become text (`tightpack.prepare.formats.FormatConfig`).
        preference_layout: with a preference format (``preference``, ``kto``, ``groups``): ``pairs``
            (every branch a sequence of its own, prompt included) or ``shared-prefix`` (the prompt once
            per unit, its branches after it; `tightpack.core.preference_layout`).
        mixture: weighted inputs (`tightpack.offline.mixture.MixtureConfig`: one weight per input, what
            the weights count, the repetition cap); None packs the inputs as they are.
    """

    packed_sequence_size: int
    max_seq_length: int | None = None
    pad_seq_to_mult: int | None = None
    tp: int = 1
    cp: int = 1
    sp: bool = False
    algorithm: str = "bfd"
    seed: int = 0
    balance_costs: str | None = None
    long_samples: LongSamples = "truncate"
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    workers: int | None = 1
    engine: Engine = "local"
    ray_address: str | None = None
    reuse_store: bool = True
    skip_bad_lines: bool = False
    row_group_size: int | None = None
    output_format: OutputFormat = "parquet"
    format: FormatConfig = field(default_factory=FormatConfig)
    preference_layout: Layout = "pairs"
    mixture: MixtureConfig | None = None

    @property
    def packs_units(self) -> bool:
        """The rows are preference units (a preference format), not SFT samples."""
        return self.format.format in PREFERENCE_FORMATS

    @property
    def multiple(self) -> int:
        if self.pad_seq_to_mult is not None:
            return self.pad_seq_to_mult
        return alignment_multiple(tp=self.tp, cp=self.cp, sp=self.sp)

    @property
    def cap(self) -> int:
        return length_cap(self.max_seq_length or self.packed_sequence_size, self.multiple)

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model of ``balance_costs``, resolved; None without one."""
        return None if self.balance_costs is None else CostModel.resolve(self.balance_costs)

    def validate(self) -> None:
        """Check every setting before any work; raises `TightpackError` naming the setting and the fix."""
        size = self.packed_sequence_size
        if not isinstance(size, int) or size < 2:
            raise TightpackError(
                f"packed_sequence_size must be an integer of at least 2, got {size!r}",
                parameters=("packed_sequence_size",),
            )
        if size > MAX_PACK_SIZE:
            raise TightpackError(
                f"packed_sequence_size {size} exceeds {MAX_PACK_SIZE} (2**31 - 1): pack boundaries "
                "(cu_seqlens) are int32; use a smaller pack size",
                parameters=("packed_sequence_size",),
            )
        if self.max_seq_length is not None and not 1 <= self.max_seq_length <= size:
            raise TightpackError(
                f"max_seq_length ({self.max_seq_length}) must be between 1 and packed_sequence_size ({size})",
                parameters=("max_seq_length", "packed_sequence_size"),
            )
        if self.pad_seq_to_mult is not None and self.pad_seq_to_mult < 1:
            raise TightpackError(
                f"pad_seq_to_mult must be a positive integer, got {self.pad_seq_to_mult}",
                parameters=("pad_seq_to_mult",),
            )
        if self.pad_seq_to_mult is not None and (self.tp, self.cp, self.sp) != (1, 1, False):
            raise TightpackError(
                "give either pad_seq_to_mult or tp/cp/sp, not both",
                parameters=("pad_seq_to_mult", "tp", "cp", "sp"),
            )
        check_choice("algorithm", self.algorithm, tuple(ALGORITHMS))
        check_choice("long_samples", self.long_samples, get_args(LongSamples))
        if self.balance_costs is not None:
            self.cost_model  # noqa: B018 - raises on an unknown preset or a bad file
        if self.pad_to_max_length and size % self.multiple:
            raise TightpackError(
                f"pad_to_max_length pads every pack to packed_sequence_size {size}, which is not a multiple "
                f"of the alignment multiple {self.multiple}: the trailing padding segment would break "
                f"context-parallel slicing (tightpack verify rejects it); use packed_sequence_size "
                f"{size // self.multiple * self.multiple} or {-(-size // self.multiple) * self.multiple}",
                parameters=("pad_to_max_length", "packed_sequence_size"),
            )
        if self.pad_cu_seqlens and not self.pad_to_max_length:
            raise TightpackError(
                "pad_cu_seqlens needs pad_to_max_length (static shapes need a fixed width)",
                parameters=("pad_cu_seqlens", "pad_to_max_length"),
            )
        check_choice("engine", self.engine, get_args(Engine))
        if self.workers is None and self.engine != "ray":
            raise TightpackError("workers=None (one per CPU of the cluster) needs engine='ray'")
        if self.workers is not None and self.workers < 1:
            raise TightpackError(f"workers must be at least 1, got {self.workers}", parameters=("workers",))
        if self.ray_address is not None and self.engine != "ray":
            raise TightpackError("ray_address needs engine='ray'", parameters=("ray_address", "engine='ray'"))
        if self.row_group_size is not None and self.row_group_size < 1:
            raise TightpackError(f"row_group_size must be at least 1, got {self.row_group_size}")
        check_choice("output_format", self.output_format, get_args(OutputFormat))
        if self.format.vision is not None and (self.engine != "local" or self.output_format != "parquet"):
            raise TightpackError(
                "packing images and videos (vision) writes packed Parquet with the local engine; drop "
                "engine='ray' and output_format='npy'",
                parameters=("vision", "engine='ray'", "output_format='npy'"),
            )
        self.cap  # noqa: B018 - raises when max_seq_length < the alignment multiple
        check_choice("preference_layout", self.preference_layout, LAYOUTS)
        # ``auto`` is resolved by the first row, and the run checks the settings again then
        if not self.packs_units and self.format.format != "auto" and self.preference_layout != "pairs":
            raise TightpackError(
                f"preference_layout {self.preference_layout!r} lays out preference units; it needs format "
                f"{', '.join(PREFERENCE_FORMATS)} (got {self.format.format!r})",
                parameters=("preference_layout", "format"),
            )
        if self.packs_units:
            self._check_units()
        if self.mixture is not None:
            self._check_mixture()

    def _check_mixture(self) -> None:
        """What a mixture run cannot take, each refused with why (`mixture_refusal`)."""
        self.mixture.validate()
        given = {
            "engine='ray'": self.engine != "local",
            "balance_costs": self.balance_costs is not None,
            "algorithm": self.algorithm != "bfd",
            "format": self.packs_units,
        }
        for name, refused in given.items():
            if refused:
                raise mixture_refusal(name)

    def _check_units(self) -> None:
        """What a run of preference units cannot take: each refused with why, not silently ignored."""
        refused = {
            "engine='ray'": (self.engine != "local", "units are tokenized with the local engine"),
            "output_format='npy'": (self.output_format != "parquet", "the legacy .npy has no unit columns"),
            "balance_costs": (self.balance_costs is not None, "the cost balance moves single sequences"),
            "vision": (self.format.vision is not None, "units are text"),
            "pad_to_max_length": (self.pad_to_max_length, "the preference reader lays rows out as they are"),
        }
        # the sample settings of SFT rows: a unit's rows have their own keys and rendering
        defaults = FormatConfig()
        for name in ("loss_on", "prompt_template", "input_key", "output_key", "messages_key", "tools_key",
                     "truncate_fields", "truncation_method", "chat_truncation"):  # fmt: skip
            refused[name] = (
                getattr(self.format, name) != getattr(defaults, name),
                "it is a setting of SFT rows; preference rows take prompt / chosen / rejected, completion or "
                "completions, their loss on the branches",
            )
        if self.cp > 1 and self.preference_layout == "shared-prefix":
            raise TightpackError(
                f"preference_layout 'shared-prefix' cannot take cp {self.cp}: context parallelism cuts a row "
                "at its sequence boundaries, which cannot keep a branch from its sibling; use "
                "preference_layout 'pairs', or drop cp",
                parameters=("preference_layout", "cp"),
            )
        for name, (given, why) in refused.items():
            if given:
                raise TightpackError(
                    f"format {self.format.format!r} packs whole preference units, without {name}: {why}; "
                    f"drop {name}",
                    parameters=(name, "format"),
                )

    def settings(self) -> dict[str, Any]:
        """Everything that changes the output (not ``workers``, ``reuse_store``, ``engine``,
        ``ray_address``: the output is the same)."""
        values = asdict(self)
        for same_output in ("workers", "engine", "ray_address"):
            values.pop(same_output)
        values.pop("reuse_store")
        if not self.packs_units:  # SFT manifests stay as they were before preference packing
            values.pop("preference_layout")
        if self.mixture is None:  # nor do manifests of runs without a mixture
            values.pop("mixture")
        else:  # a mixture packs in its own order: no algorithm of `plan_packs` made the packs
            values.pop("algorithm")
        values.update(
            pad_seq_to_mult=self.multiple, max_seq_length=self.max_seq_length or self.packed_sequence_size
        )
        if self.balance_costs is not None:  # the coefficients, not a path that may change or vanish
            values["balance_costs"] = self.cost_model.to_dict()
        return values
