"""Calibrate a `CostModel` in seconds by timing forward + backward of a small Llama on packs.

Packs of controlled composition (one sequence filling the pack, ``k`` equal ones, one long plus many
short) at several widths make ``Σs``, ``Σs²`` and the sequence count vary independently; each is
timed and `tightpack.core.cost_fit.fit_cost_model` fits the coefficients.

The cost model assumes varlen attention (each sequence attends to itself only: work ``Σs²``).
transformers' sdpa/eager with a block-diagonal mask compute all ``W × W`` scores of a packed row, so
their time would not depend on the composition. `varlen_sdpa_attention` is a real varlen attention
for transformers' `AttentionInterface` (registered as `VARLEN_ATTENTION`): it cuts the packed row at
the sequence starts and runs causal SDPA on each sequence. The least-squares fit lives in
`tightpack.core.cost_fit`; the ``tightpack calibrate`` command in `tightpack.cli.calibrate_command`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tightpack.core.cost_fit import CostFit, fit_cost_model
from tightpack.errors import TightpackError

__all__ = ["calibrate_cost_model"]

VARLEN_ATTENTION = "tightpack_varlen"
"""The ``attn_implementation`` name under which `varlen_sdpa_attention` is registered."""

DEFAULT_MODEL_CONFIG: dict = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
}
"""`transformers.LlamaConfig` keys of the default calibration model: ~0.9M parameters, small enough
for a CPU calibration in seconds, with attention still a visible share of the time at 1k tokens."""

DEFAULT_PACK_WIDTHS = (256, 512, 1024)
"""Pack widths (tokens) timed by default."""

_SHORTEST = 16
"""Shortest sequence in a calibration pack (tokens): below it per-sequence overhead dominates."""


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention of each sequence of packed rows with itself only (varlen), via SDPA.

    An `AttentionInterface` function. Sequence starts come from ``cu_seq_lens_q`` (int ``[n + 1]``
    boundaries of a single packed row) when given, else from ``position_ids`` ``[batch, tokens]``:
    a sequence starts where the position restarts at 0 (and at token 0).

    Args:
        query: ``[batch, heads, tokens, head_dim]``.
        key, value: ``[batch, kv_heads, tokens, head_dim]``; kv heads are repeated for grouped-query
            attention.
        attention_mask: must be ``None`` (pass no mask: the boundaries carry the structure).

    Returns:
        ``([batch, tokens, heads, head_dim], None)``, as transformers' sdpa function.
    """
    if attention_mask is not None:
        raise TightpackError(
            f"{VARLEN_ATTENTION} attention takes no attention_mask; pass position_ids restarting at 0 at "
            "each sequence (and use_cache=False)"
        )
    batch, heads, tokens, _ = query.shape
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    rows_starts = _sequence_starts(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), batch, tokens)
    output = torch.empty_like(query)
    dropout_p = dropout if module.training else 0.0
    for row, starts in enumerate(rows_starts):
        for begin, end in itertools.pairwise(starts):
            output[row, :, begin:end] = torch.nn.functional.scaled_dot_product_attention(
                query[row : row + 1, :, begin:end],
                key[row : row + 1, :, begin:end],
                value[row : row + 1, :, begin:end],
                dropout_p=dropout_p,
                is_causal=True,
                scale=scaling,
            )[0]
    return output.transpose(1, 2).contiguous(), None


def _sequence_starts(cu_seq_lens, position_ids, batch: int, tokens: int) -> list[list[int]]:
    """Per row, the sequence boundaries ``[0, ..., tokens]`` as Python ints."""
    if cu_seq_lens is not None:
        if batch != 1:
            raise TightpackError(f"cu_seq_lens_q describes one packed row; got a batch of {batch} rows")
        bounds = [int(b) for b in torch.as_tensor(cu_seq_lens).reshape(-1).tolist()]
        if bounds[0] != 0 or bounds[-1] != tokens or any(b >= a for b, a in itertools.pairwise(bounds)):
            raise TightpackError(f"cu_seq_lens_q must rise from 0 to {tokens} tokens, got {bounds}")
        return [bounds]
    if position_ids is None:
        return [[0, tokens]] * batch
    positions = position_ids.expand(batch, tokens).detach().cpu().numpy()
    rows = []
    for row in positions:
        starts = np.flatnonzero(row == 0)
        if len(starts) == 0 or starts[0] != 0:
            starts = np.concatenate(([0], starts))
        rows.append([*starts.tolist(), tokens])
    return rows


def register_varlen_attention() -> str:
    """Register `varlen_sdpa_attention` with transformers (idempotent); returns `VARLEN_ATTENTION`."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
    return VARLEN_ATTENTION


def build_calibration_model(model_config: dict | None = None, *, seed: int = 0, device: str = "cpu"):
    """A `transformers.LlamaForCausalLM` from `DEFAULT_MODEL_CONFIG` updated by ``model_config``.

    Uses `varlen_sdpa_attention`. Weights are drawn from ``torch.manual_seed(seed)`` inside
    `torch.random.fork_rng`, so the caller's global RNG state is left as it was. No download.

    Raises:
        TightpackError: on a key that is not a `transformers.LlamaConfig` key, a value it rejects, or
            a head count not divisible by the key/value head count.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if model_config is not None and not isinstance(model_config, dict):
        raise TightpackError(f"model_config must be a dict of LlamaConfig keys, got {type(model_config)}")
    settings = DEFAULT_MODEL_CONFIG | dict(model_config or {})
    known = set(LlamaConfig().to_dict())
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TightpackError(
            f"model config keys {unknown} are not LlamaConfig keys; use e.g. hidden_size, "
            "intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size"
        )
    try:
        config = LlamaConfig(**settings)
    except Exception as error:  # transformers raises ValueError or its own validation errors
        raise TightpackError(
            f"LlamaConfig rejects model config {settings}: {' '.join(str(error).split())}"
        ) from None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    if heads % kv_heads:
        raise TightpackError(
            f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads} "
            "(grouped-query attention)"
        )
    config._attn_implementation = register_varlen_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device).train()


def calibration_compositions(pack_widths: Sequence[int]) -> list[list[int]]:
    """The sequence lengths of each timed pack: per width ``W``, ``k`` equal sequences for ``k = 1, 2,
    4, ...`` while ``W / k >= 16``, and one of ``W / 2`` plus ``W / 16``-token ones.

    >>> [len(p) for p in calibration_compositions([64])], calibration_compositions([64])[-1]
    ([1, 2, 4, 9], [32, 4, 4, 4, 4, 4, 4, 4, 4])
    """
    packs = []
    for width in pack_widths:
        count = 1
        while width // count >= _SHORTEST:
            base, extra = divmod(width, count)
            packs.append([base + 1] * extra + [base] * (count - extra))
            count *= 2
        half = width // 2
        short = max(width // 16, 1)
        rest, last = divmod(width - half, short)
        packs.append([half] + [short] * rest + ([last] if last else []))
    return packs


def packed_inputs(
    lengths: Sequence[int], vocab_size: int, generator: torch.Generator, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Model inputs of one packed row of sequences ``lengths``: random ``input_ids`` ``[1, W]``,
    ``position_ids`` restarting at 0 per sequence and ``labels`` with -100 at each sequence start
    (no token predicts the next sequence's first one)."""
    width = int(sum(lengths))
    input_ids = torch.randint(0, vocab_size, (1, width), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in lengths]).reshape(1, width)
    labels = input_ids.clone()
    labels[0, np.cumsum([0, *lengths[:-1]])] = -100
    inputs = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def train_step(model, inputs: dict[str, torch.Tensor]) -> float:
    """Forward + backward of one packed row (mean cross-entropy), gradients accumulated; the loss."""
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def calibrate_cost_model(
    *,
    model_config: dict | None = None,
    pack_widths: Sequence[int] = DEFAULT_PACK_WIDTHS,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    seed: int = 0,
    threads: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> CostFit:
    """Time forward + backward of a small Llama on packs of `calibration_compositions` and fit.

    ``warmup`` untimed passes over all packs, then ``repeats`` timed passes (round robin, so load from
    other processes spreads over the packs); a pack's time is the median of its runs, measured with
    `time.perf_counter` (after `torch.cuda.synchronize` on CUDA), gradients zeroed between runs.

    Args:
        model_config: `transformers.LlamaConfig` keys overriding `DEFAULT_MODEL_CONFIG`.
        pack_widths: pack widths in tokens, at least two different ones, each >= 16.
        repeats: timed runs per pack, >= 1.
        warmup: untimed runs per pack before them, >= 0.
        device: ``"cpu"`` or ``"cuda"`` (any torch device string).
        seed: seed of the weights and token ids; the global RNG is not touched.
        threads: `torch.set_num_threads` for the duration (restored after); None leaves it.
        progress: called as ``progress(done, total, label)`` after each pass over the packs.

    Returns:
        `fit_cost_model` on the measurements, with labels like ``"512 = 4 x 128"``.

    Raises:
        TightpackError: on bad arguments or a model config transformers rejects.
    """
    widths = _check_widths(pack_widths)
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise TightpackError(f"{name} must be an integer >= {low}, got {value!r}")
    if threads is not None and (not isinstance(threads, (int, np.integer)) or threads < 1):
        raise TightpackError(f"threads must be a positive integer, got {threads!r}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise TightpackError(
            f"device {device!r} was asked for but CUDA is not available; use device='cpu'",
            parameters=("device='cpu'",),
        )
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        model = build_calibration_model(model_config, seed=seed, device=device)
        generator = torch.Generator().manual_seed(seed)
        compositions = calibration_compositions(widths)
        inputs = [
            packed_inputs(lengths, model.config.vocab_size, generator, device) for lengths in compositions
        ]
        # Round robin: pass r times every pack once, so a burst of load from another process slows
        # one run of many packs rather than all runs of a few (which would bias the fit).
        times: list[list[float]] = [[] for _ in compositions]
        for run in range(warmup + repeats):
            for index, pack in enumerate(inputs):
                elapsed = _timed_step(model, pack, device)
                if run >= warmup:
                    times[index].append(elapsed)
            if progress is not None:
                progress(
                    run + 1, warmup + repeats, "warmup" if run < warmup else f"repeat {run - warmup + 1}"
                )
        seconds = [statistics.median(runs) for runs in times]
    finally:
        torch.set_num_threads(previous_threads)
    lengths_arrays = [np.asarray(lengths, dtype=np.float64) for lengths in compositions]
    return fit_cost_model(
        [a.sum() for a in lengths_arrays],
        [(a**2).sum() for a in lengths_arrays],
        [len(a) for a in lengths_arrays],
        seconds,
        labels=[_label(lengths) for lengths in compositions],
    )


def _check_widths(pack_widths: Sequence[int]) -> list[int]:
    """``pack_widths`` as positive ints >= `_SHORTEST`, checked to hold two different widths."""
    widths = list(pack_widths) if not isinstance(pack_widths, (str, bytes)) else None
    if not widths or any(
        isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < _SHORTEST for w in widths
    ):
        raise TightpackError(
            f"pack_widths must be integers >= {_SHORTEST} (tokens), e.g. (256, 512, 1024); "
            f"got {pack_widths!r}"
        )
    if len(set(widths)) < 2:
        raise TightpackError(
            f"pack_widths needs at least two different widths to separate the per-token term from the "
            f"per-pack constant; got {list(widths)}"
        )
    return [int(w) for w in widths]


def _timed_step(model, inputs: dict[str, torch.Tensor], device: str) -> float:
    """Seconds of one forward + backward from zeroed gradients (synchronized on CUDA)."""
    cuda = str(device).startswith("cuda")
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    train_step(model, inputs)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def _label(lengths: Sequence[int]) -> str:
    """``"512 = 4 x 128"``, ``"512 = 256 + 16 x 16"``: a pack's width and composition."""
    width = sum(lengths)
    if len(set(lengths)) == 1:
        return f"{width} = {len(lengths)} x {lengths[0]}"
    head, *tail = lengths
    if len(set(tail)) == 1:
        return f"{width} = {head} + {len(tail)} x {tail[0]}"
    return f"{width} = {' + '.join(map(str, lengths))}"
