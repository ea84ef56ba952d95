"""The compute cost of packs: a per-sequence polynomial in runtime length, evaluated vectorized.

A pack's cost is the sum over its sequences of ``linear * s + quadratic * s**2 + per_sequence``, with
``s`` the runtime (aligned) length the attention kernel sees: with per-sequence masks (varlen / THD
attention) the quadratic attention work of a pack is the sum of its sequences' squares, not the
square of the pack length. This module owns the cost model (`CostModel`), its presets
(`COST_MODELS`), its JSON form and the balance statistic of a set of costs (`cost_spread`). Token
counts and attention-cost totals of a plan live in `tightpack.core.stats`; plans in
`tightpack.core.planner`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tightpack.core.planner import PackPlan
from tightpack.errors import TightpackError

__all__ = ["CostModel"]

_FORMAT = "tightpack-cost-model/1"
"""The ``format`` key of a saved cost model; a file without it or with another one is rejected."""

_FIELDS = ("linear", "quadratic", "per_sequence", "unit")


@dataclass(frozen=True)
class CostModel:
    """Cost of a pack: ``linear * sum(s) + quadratic * sum(s**2) + per_sequence * len(s)``.

    ``s`` are the runtime lengths (aligned, as the kernel sees them) of the pack's sequences.

    Attributes:
        linear: cost per token (projections, MLP, logits).
        quadratic: cost per squared token of one sequence (attention scores and attention over
            values; sequences of a pack do not attend to each other).
        per_sequence: fixed cost per sequence (kernel launch, per-document overhead); 0 for a model
            built by `from_model`.
        unit: the unit of the costs: ``"flops"`` (forward + backward floating-point operations, or
            forward only with ``training=False``) for `from_model` and the presets, ``"seconds"`` for
            a model calibrated on measured step times, or any other label a calibration chooses.

    Coefficients are finite and non-negative, and not all zero.

    >>> model = CostModel(linear=2.0, quadratic=0.5, per_sequence=1.0, unit="seconds")
    >>> model.sequence_costs([0, 2, 4]).tolist()
    [1.0, 7.0, 17.0]
    """

    linear: float
    quadratic: float
    per_sequence: float = 0.0
    unit: str = "flops"

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "per_sequence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TightpackError(f"CostModel.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise TightpackError(
                    f"CostModel.{name} must be finite and non-negative, got {value!r}; a cost "
                    "coefficient counts work, so fit or set it to a value >= 0"
                )
            object.__setattr__(self, name, float(value))
        if self.linear == 0 and self.quadratic == 0 and self.per_sequence == 0:
            raise TightpackError(
                "CostModel has all coefficients zero, so every pack would cost 0; set at least one of "
                "linear, quadratic, per_sequence to a positive value"
            )
        if not isinstance(self.unit, str) or not self.unit:
            raise TightpackError(
                f"CostModel.unit must be a non-empty string such as 'flops', got {self.unit!r}"
            )

    # --- construction ------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        *,
        hidden_size: int,
        num_layers: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        vocab_size: int,
        swiglu: bool = True,
        causal: bool = True,
        training: bool = True,
        kv_channels: int | None = None,
    ) -> CostModel:
        """The FLOPs cost model of a dense decoder-only transformer, in ``"flops"``.

        The accounting of Megatron-LM's ``num_floating_point_operations``
        (``megatron/training/training.py``, dense branch) after Narayanan et al. (2021), "Efficient
        Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473,
        Appendix "Floating-point operation counting". A GEMM of ``(m x k) @ (k x n)`` costs
        ``2 m k n``; with ``h = hidden_size``, ``q = num_attention_heads * kv_channels`` (the query
        projection width, ``h`` by default), ``g / n`` the query groups per head, ``f`` the FFN width,
        ``V`` the vocabulary and ``L`` layers, the forward pass of one sequence of ``s`` tokens costs:

        - QKV projection with GQA and the attention output projection:
          ``L * 4 * h * q * (1 + g / n)`` per token (``2hq`` for Q, ``2 * 2hq * g/n`` for K and V,
          ``2qh`` for the output);
        - MLP: ``L * 2 * m * h * f`` per token, ``m = 3`` matrices with SwiGLU (gate, up, down),
          ``m = 2`` without;
        - logits: ``2 * h * V`` per token;
        - attention: ``L * 2 * 2 * s**2 * q`` per sequence (``QK^T`` and attention over values),
          halved when ``causal``: only the lower triangle is computed by causal (flash) kernels, as
          Megatron-LM counts it ("Only half of the attention matrix is non-zero and needs to be
          multiplied with V").

        The backward pass costs twice the forward pass (data and weight gradients), so ``training``
        multiplies everything by 3. Embedding lookups, norms, softmax and activation-recomputation
        are not counted; ``per_sequence`` is 0.

        Args:
            hidden_size: model width ``h``.
            num_layers: transformer layers ``L``.
            ffn_hidden_size: MLP intermediate width ``f``.
            num_attention_heads: query heads ``n``.
            num_query_groups: key/value heads ``g`` (GQA); ``None`` means ``n`` (multi-head).
            vocab_size: vocabulary size ``V`` (padded, as the logits GEMM sees it).
            swiglu: three MLP matrices instead of two.
            causal: count half of the ``s x s`` attention products.
            training: forward + backward (x3) instead of forward only.
            kv_channels: width of one head; ``None`` means ``hidden_size // num_attention_heads``.

        Raises:
            TightpackError: on a non-positive size or query groups that do not divide the heads.

        Llama-3-8B: attention work equals the rest of the model's work at about 57k tokens, and one
        8,192-token sample costs 14% more than 64 samples of 128 tokens (same token count):

        >>> llama = CostModel.from_model(hidden_size=4096, num_layers=32, ffn_hidden_size=14336,
        ...     num_attention_heads=32, num_query_groups=8, vocab_size=128256)
        >>> llama.linear, llama.quadratic
        (45027950592.0, 786432.0)
        >>> round(llama.crossover_length())
        57256
        >>> long, short = llama.sequence_costs([8192]).sum(), llama.sequence_costs([128] * 64).sum()
        >>> round(float(long / short), 4)
        1.1405
        """
        sizes = {
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "ffn_hidden_size": ffn_hidden_size,
            "num_attention_heads": num_attention_heads,
            "vocab_size": vocab_size,
        }
        if num_query_groups is not None:
            sizes["num_query_groups"] = num_query_groups
        if kv_channels is not None:
            sizes["kv_channels"] = kv_channels
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise TightpackError(
                    f"CostModel.from_model: {name} must be a positive integer, got {value!r}"
                )
        groups = num_attention_heads if num_query_groups is None else int(num_query_groups)
        if num_attention_heads % groups:
            raise TightpackError(
                f"CostModel.from_model: num_query_groups={groups} must divide "
                f"num_attention_heads={num_attention_heads}; use the model config's key/value head count"
            )
        head = hidden_size // num_attention_heads if kv_channels is None else int(kv_channels)
        if head < 1:
            raise TightpackError(
                f"CostModel.from_model: hidden_size={hidden_size} is smaller than "
                f"num_attention_heads={num_attention_heads}; pass kv_channels (the head width)"
            )
        query = num_attention_heads * head
        attention_projections = 4 * hidden_size * query * (1 + groups / num_attention_heads)
        mlp = 2 * (3 if swiglu else 2) * hidden_size * ffn_hidden_size
        logits = 2 * hidden_size * vocab_size
        scores = 2 * 2 * query * (0.5 if causal else 1.0)
        passes = 3 if training else 1
        return cls(
            linear=float(passes * (num_layers * (attention_projections + mlp) + logits)),
            quadratic=float(passes * num_layers * scores),
            per_sequence=0.0,
            unit="flops",
        )

    @classmethod
    def named(cls, name: str) -> CostModel:
        """The preset ``name`` of `COST_MODELS`.

        >>> CostModel.named("llama-1b").unit
        'flops'
        """
        try:
            return COST_MODELS[name]
        except (KeyError, TypeError):
            raise TightpackError(
                f"unknown cost model {name!r}; choose one of {', '.join(sorted(COST_MODELS))} or pass "
                "the path of a cost model JSON file"
            ) from None

    @classmethod
    def resolve(cls, spec: CostModel | str | os.PathLike) -> CostModel:
        """A cost model from a `CostModel`, a preset name (`COST_MODELS`) or a JSON file's path.

        A preset name wins over a file of the same name in the working directory.

        Raises:
            TightpackError: on another type, or a string that is neither a preset nor an existing file
                (the message lists the presets), or an unreadable or malformed file.
        """
        if isinstance(spec, CostModel):
            return spec
        if isinstance(spec, str) and spec in COST_MODELS:
            return COST_MODELS[spec]
        if isinstance(spec, (str, os.PathLike)):
            path = Path(spec)
            if path.is_file():
                return cls.load(path)
            where = "a folder, not a JSON file" if path.is_dir() else "no such file"
            raise TightpackError(
                f"cost model {os.fspath(spec)!r} is neither a preset ({', '.join(sorted(COST_MODELS))}) "
                f"nor a cost model file ({where}); pass a preset name or the path of a JSON file written "
                "by CostModel.save"
            )
        raise TightpackError(
            f"a cost model must be a CostModel, a preset name or a path, got {type(spec).__name__} {spec!r}"
        )

    # --- JSON --------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The JSON form: ``format``, the three coefficients and ``unit``.

        >>> CostModel(linear=1.0, quadratic=2.0, unit="seconds").to_dict()["quadratic"]
        2.0
        """
        return {
            "format": _FORMAT,
            "linear": self.linear,
            "quadratic": self.quadratic,
            "per_sequence": self.per_sequence,
            "unit": self.unit,
        }

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "cost model") -> CostModel:
        """The inverse of `to_dict`; ``source`` names the origin in error messages."""
        if not isinstance(data, dict):
            raise TightpackError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != _FORMAT:
            raise TightpackError(
                f"{source}: 'format' is {data.get('format')!r}, expected {_FORMAT!r}; write the file "
                "with CostModel.save"
            )
        unknown = sorted(set(data) - {"format", *_FIELDS})
        if unknown:
            raise TightpackError(f"{source}: unknown keys {unknown}; the keys are {['format', *_FIELDS]}")
        missing = [key for key in ("linear", "quadratic", "unit") if key not in data]
        if missing:
            raise TightpackError(f"{source}: missing keys {missing}")
        return cls(**{key: data[key] for key in _FIELDS if key in data})

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON form to ``path``, through a temporary file renamed into place."""
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        """Read a file written by `save`."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise TightpackError(f"cannot read cost model file {os.fspath(path)!r}: {error}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise TightpackError(
                f"cost model file {os.fspath(path)!r} is not valid JSON ({error}); write it with "
                "CostModel.save"
            ) from None
        return cls.from_dict(data, source=f"cost model file {os.fspath(path)!r}")

    # --- evaluation --------------------------------------------------------------------------------

    def crossover_length(self) -> float:
        """The length ``s`` at which one sequence's quadratic term equals its linear term.

        ``quadratic * s**2 == linear * s``, so ``s = linear / quadratic``: above it attention
        dominates. ``inf`` without a quadratic term, 0 without a linear term.
        """
        if self.quadratic == 0:
            return math.inf
        return self.linear / self.quadratic

    def sequence_costs(self, lengths) -> np.ndarray:
        """Cost of each sequence alone, float64 ``[n]`` for ``lengths`` ``[n]`` (runtime lengths).

        Raises:
            TightpackError: on lengths that are not one-dimensional, not finite or negative.
        """
        s = _as_lengths(lengths)
        return (self.linear + self.quadratic * s) * s + self.per_sequence

    def pack_costs(
        self, plan: PackPlan | tuple[np.ndarray, np.ndarray], lengths: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """Cost of each pack of ``plan``, float64 ``[len(plan)]``; an empty pack costs 0.

        Args:
            plan: a `PackPlan`, or its ``(order, offsets)`` CSR arrays.
            lengths: runtime lengths of all samples, ``[num_samples]``, indexed by ``plan.order``.

        >>> model = CostModel(linear=1.0, quadratic=1.0, per_sequence=10.0, unit="seconds")
        >>> plan = PackPlan(order=np.array([2, 0, 1]), offsets=np.array([0, 2, 2, 3]))
        >>> model.pack_costs(plan, [1, 2, 3]).tolist()  # packs [3, 1], [], [2]
        [34.0, 0.0, 16.0]
        """
        order, offsets = _csr(plan)
        costs = self.sequence_costs(lengths)
        if len(order) and (int(order.min()) < 0 or int(order.max()) >= len(costs)):
            raise TightpackError(
                f"the plan refers to samples {int(order.min())}..{int(order.max())} but lengths has "
                f"{len(costs)} entries; pass the lengths the plan was made from"
            )
        packs = len(offsets) - 1
        # bincount over pack ids, not np.add.reduceat: reduceat returns the next element, not 0, for
        # an empty pack. Within a pack the sum runs in plan order.
        pack_ids = np.repeat(np.arange(packs, dtype=np.int64), np.diff(offsets))
        return np.bincount(pack_ids, weights=costs[order], minlength=packs).astype(np.float64, copy=False)


COST_MODELS: dict[str, CostModel] = {
    "llama-8b": CostModel.from_model(
        hidden_size=4096,
        num_layers=32,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=128256,
    ),
    "llama-1b": CostModel.from_model(
        hidden_size=2048,
        num_layers=16,
        ffn_hidden_size=8192,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=128256,
    ),
}
"""Training FLOPs (forward + backward, causal) of Llama-3-8B and Llama-3.2-1B, by name."""


@dataclass(frozen=True)
class CostSpread:
    """How evenly cost is spread over packs (or ranks): the slowest one sets the step time.

    Attributes:
        count: number of costs.
        mean: their mean; 0 for no costs.
        max: the largest; 0 for no costs.
        max_over_mean: ``max / mean``, >= 1; the step time over the balanced step time. 1 for no costs
            or all-zero costs (nothing is imbalanced).
        cv: coefficient of variation, population ``std / mean``; 0 for no costs or all-zero costs.
    """

    count: int
    mean: float
    max: float
    max_over_mean: float
    cv: float


def cost_spread(costs) -> CostSpread:
    """The `CostSpread` of non-negative ``costs`` ``[n]``.

    >>> cost_spread([1.0, 1.0, 4.0])
    CostSpread(count=3, mean=2.0, max=4.0, max_over_mean=2.0, cv=0.7071067811865476)
    """
    values = np.asarray(costs, dtype=np.float64)
    if values.ndim != 1:
        raise TightpackError(f"costs must be one-dimensional, got shape {values.shape}")
    if len(values) and (not np.isfinite(values).all() or values.min() < 0):
        raise TightpackError("costs must be finite and non-negative; compute them with CostModel.pack_costs")
    if len(values) == 0:
        return CostSpread(count=0, mean=0.0, max=0.0, max_over_mean=1.0, cv=0.0)
    mean = float(values.mean())
    largest = float(values.max())
    if mean == 0:
        return CostSpread(count=len(values), mean=0.0, max=0.0, max_over_mean=1.0, cv=0.0)
    return CostSpread(
        count=len(values),
        mean=mean,
        max=largest,
        max_over_mean=largest / mean,
        cv=float(values.std()) / mean,
    )


def _as_lengths(lengths) -> np.ndarray:
    """``lengths`` as float64 ``[n]``, checked one-dimensional, finite and non-negative."""
    raw = np.asarray(lengths)
    if raw.ndim != 1:
        raise TightpackError(f"lengths must be one-dimensional, got shape {raw.shape}")
    if len(raw) and not (np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)):
        raise TightpackError(f"lengths must be numbers, got dtype {raw.dtype}")
    s = raw.astype(np.float64)
    if len(s) and not np.isfinite(s).all():
        raise TightpackError("lengths must be finite; got NaN or infinity")
    if len(s) and s.min() < 0:
        position = int(np.argmin(s))
        raise TightpackError(
            f"lengths must be non-negative, got {raw[position]} at index {position}; pass runtime "
            "(aligned) token counts"
        )
    return s


def _csr(plan: PackPlan | tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(order, offsets)`` of a plan, checked: offsets start at 0, never decrease, end at len(order)."""
    if isinstance(plan, PackPlan):
        order, offsets = plan.order, plan.offsets
    elif isinstance(plan, tuple) and len(plan) == 2:
        order, offsets = plan
    else:
        raise TightpackError(f"expected a PackPlan or an (order, offsets) pair, got {type(plan).__name__}")
    order = np.asarray(order)
    offsets = np.asarray(offsets)
    if order.ndim != 1 or offsets.ndim != 1 or len(offsets) == 0:
        raise TightpackError(
            f"order and offsets must be one-dimensional, offsets non-empty; got shapes {order.shape} and "
            f"{offsets.shape}"
        )
    for name, array in (("order", order), ("offsets", offsets)):
        if len(array) and not np.issubdtype(array.dtype, np.integer):
            raise TightpackError(f"{name} must be integers, got dtype {array.dtype}")
    order = order.astype(np.int64, copy=False)
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0 or offsets[-1] != len(order) or (np.diff(offsets) < 0).any():
        raise TightpackError(
            f"offsets must start at 0, never decrease and end at len(order)={len(order)}; got "
            f"{offsets[0]}..{offsets[-1]}"
        )
    return order, offsets
