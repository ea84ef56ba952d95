"""The equivalence probe: does this model, as loaded, compute a packed row as it computes its sequences alone?

Packing is only correct if no sequence of a row can see another one. Whether that holds depends on the
model's layers (attention reading the boundaries, recurrent or convolution state reset at every
sequence), its attention implementation, its dtype and kernels, and the transformers release: nothing a
packer can see from the batch. The probe asks the model itself, on a few short sequences cut from a
real batch:

- **context** ``c`` (up to 128 tokens) and **targets** ``t1 .. tk`` (k <= 3, each ``n`` <= 32 tokens);
- row A = ``[c, t1, .., tk]`` and row B = ``[c', t1, .., tk]``, where ``c'`` has ``c``'s length and
  other tokens of the batch. Both rows have the same shapes, so every kernel runs the same way;
- five forward passes: A and B packed (as the training path runs them), A and B as one sequence (one
  causal mask over the row: the *contaminated* packing), and the targets alone (one ``[k, n]`` batch).

On the targets' per-token log-probabilities (of each next token, as the loss reads them) it measures

- ``cross_sequence``: max |packed(A) - packed(B)|. The targets' outputs must not depend on the
  context's tokens at all: when the packing is right this is 0 in any dtype on any device (masked
  attention adds exact zeros), except for kernels whose rounding depends on values (a few ulps);
- ``leak``: max |contaminated(A) - contaminated(B)|, how much the same change moves the targets when
  the sequences are not kept apart: the size of a leak for this model, dtype and data;
- ``unpacked_gap``: max |packed(A) - alone|, and ``contaminated_gap``: max |contaminated(A) - alone|.
  The first is rounding noise when the packing is right (different shapes run different kernels);
  positions that do not restart per sequence show up here.

The rule (`LEAK_FRACTION`, `GAP_FRACTION`): the probe passes when ``cross_sequence <= leak / 1000``
and ``unpacked_gap <= contaminated_gap / 10``. Both bounds scale with what this model, in this dtype,
shows for a real leak, so no tolerance is tuned per model: a correct packing measures 0 (and a gap of a
few ulps), the leaks observed on the test families measure about 3% to 100% of the contaminated
one (docs/equivalence-probe.md).

This module is the probe's arithmetic over two forward functions; `tightpack.runtime.equivalence.hf`
and `tightpack.runtime.equivalence.megatron` give it the Hugging Face and Megatron-Core forwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from tightpack.errors import TightpackError

__all__ = ["PackingLeakError", "ProbeReport"]

LEAK_FRACTION = 1e-3  # cross_sequence may be at most this fraction of the leak of one causal mask
GAP_FRACTION = 0.1  # unpacked_gap may be at most this fraction of the contaminated run's gap
CONTEXT_TOKENS = 128
TARGET_TOKENS = 32
TARGETS = 3

PackedForward = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]  # (row [T], lengths) -> logits [T, V]
PlainForward = Callable[[torch.Tensor], torch.Tensor]  # ids [B, n] -> logits [B, n, V]


class PackingLeakError(TightpackError):
    """The probe found that a packed row is not computed as its sequences alone. ``report`` says how."""

    def __init__(self, message: str, report: ProbeReport) -> None:
        super().__init__(message)
        self.report = report


class ProbeSkipped(TightpackError):
    """The batch cannot give a probe (too few tokens, or inputs the probe cannot rebuild)."""


@dataclasses.dataclass(frozen=True)
class ProbeRows:
    """The probe's token rows, all 1-D and of one dtype.

    >>> rows = ProbeRows(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.tensor([[7, 8], [9, 10]]))
    >>> rows.row(swapped=True).tolist(), rows.lengths, rows.target_starts
    ([4, 5, 6, 7, 8, 9, 10], [3, 2, 2], [3, 5])
    """

    context: torch.Tensor  # [n0]
    swapped_context: torch.Tensor  # [n0], other tokens
    targets: torch.Tensor  # [k, n]

    def row(self, swapped: bool = False) -> torch.Tensor:
        first = self.swapped_context if swapped else self.context
        return torch.cat([first, self.targets.reshape(-1)])

    @property
    def lengths(self) -> list[int]:
        k, n = self.targets.shape
        return [len(self.context)] + [n] * k

    @property
    def target_starts(self) -> list[int]:
        k, n = self.targets.shape
        return [len(self.context) + j * n for j in range(k)]


def probe_rows(
    tokens: torch.Tensor,
    bounds: torch.Tensor,
    *,
    excluded: Sequence[int] = (),
    context_tokens: int = CONTEXT_TOKENS,
    target_tokens: int = TARGET_TOKENS,
    targets: int = TARGETS,
) -> ProbeRows:
    """Cut the probe's sequences from one packed row: tokens ``[T]`` with boundaries ``[N + 1]``.

    Runs of tokens inside one sequence and outside ``excluded`` (e.g. image placeholders) are the
    material. The context is the start of the longest run; targets are the starts of the next longest
    runs (or, with too few runs, the pieces after the context in its run), all cut to the shortest of
    them. The swapped context is a seeded draw of the row's own tokens, so its ids are in the vocabulary.

    >>> rows = probe_rows(torch.arange(20), torch.tensor([0, 12, 16, 20]), target_tokens=3)
    >>> rows.context.tolist(), rows.targets.tolist()
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [[12, 13, 14], [16, 17, 18]])

    Raises:
        ProbeSkipped: when the row has fewer than two usable pieces of 2 tokens.
    """
    tokens = tokens.reshape(-1)
    bounds = bounds.reshape(-1).long()
    usable = torch.ones(len(tokens), dtype=torch.bool)
    for token in excluded:
        usable &= tokens != token
    # runs: maximal spans of usable tokens within one sequence
    sequence_start = torch.zeros(len(tokens), dtype=torch.bool)
    sequence_start[bounds[:-1][bounds[:-1] < len(tokens)]] = True
    previous_usable = torch.cat([torch.tensor([False]), usable[:-1]])
    starts = torch.nonzero(usable & (sequence_start | ~previous_usable)).reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([len(tokens)])])
    # a run's usable tokens come first in [start, next start): what follows them, if anything, is excluded
    counted = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(usable.long(), 0)])
    run_lengths = counted[ends] - counted[starts]
    order = torch.argsort(run_lengths, descending=True, stable=True).tolist()
    pieces = [(int(starts[i]), int(run_lengths[i])) for i in order if run_lengths[i] >= 2]
    if not pieces:
        raise ProbeSkipped("the packed row has no run of 2 or more tokens to probe with")
    context_start, context_run = pieces[0]
    context_length = min(context_tokens, context_run if len(pieces) > 1 else context_run // 2)
    target_pieces = [(start, length) for start, length in pieces[1 : 1 + targets]]
    if not target_pieces:  # one run only: the pieces after the context in it
        rest_start, rest = context_start + context_length, context_run - context_length
        n = min(target_tokens, max(rest // targets, 2))
        target_pieces = [(rest_start + j * n, n) for j in range(min(targets, rest // n))]
    if context_length < 1 or not target_pieces:
        raise ProbeSkipped("the packed row is too short to probe (fewer than 4 tokens in one sequence)")
    n = min(target_tokens, *(length for _, length in target_pieces))
    context = tokens[context_start : context_start + context_length]
    material = tokens[usable]
    generator = torch.Generator().manual_seed(0)
    swapped = material[torch.randint(len(material), (context_length,), generator=generator)]
    if torch.equal(swapped, context):
        raise ProbeSkipped("the packed row holds one token id only: no other context to swap in")
    target_rows = torch.stack([tokens[start : start + n] for start, _ in target_pieces])
    return ProbeRows(context, swapped, target_rows)


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """What the probe measured, in nats of per-token log-probability, and its verdict.

    ``cross_sequence``, ``leak``, ``unpacked_gap`` and ``contaminated_gap`` are described in the module
    docstring. ``layers`` names where a leak enters, when it could be located.
    """

    cross_sequence: float
    leak: float
    unpacked_gap: float
    contaminated_gap: float
    tokens: int
    targets: int
    seconds: float
    model: str = ""
    layers: tuple[str, ...] = ()

    @property
    def leaks(self) -> bool:
        return self.cross_sequence > LEAK_FRACTION * self.leak

    @property
    def deviates(self) -> bool:
        return self.unpacked_gap > GAP_FRACTION * self.contaminated_gap

    @property
    def passed(self) -> bool:
        return not (self.leaks or self.deviates)

    @property
    def margin(self) -> float:
        """How many times below the leak the packed row's cross-sequence dependence is (inf for 0)."""
        return _ratio(self.leak, self.cross_sequence)

    def summary(self) -> str:
        """One line: the figures and the rule they were held to."""
        return (
            f"packed targets move {self.cross_sequence:.3g} when another sequence's tokens change "
            f"(one causal mask over the row: {self.leak:.3g}; allowed {LEAK_FRACTION:g} of it; margin "
            f"{_times(self.margin)}), and lie {self.unpacked_gap:.3g} from the sequences run alone "
            f"(contaminated: {self.contaminated_gap:.3g}; allowed {GAP_FRACTION:g} of it); {self.targets} "
            f"targets, {self.tokens} tokens, {self.seconds:.2f} s"
        )


def restarting_positions(lengths: Sequence[int]) -> torch.Tensor:
    """Positions ``[sum(lengths)]`` restarting at 0 for each sequence.

    >>> restarting_positions([3, 2]).tolist()
    [0, 1, 2, 0, 1]
    """
    return torch.cat([torch.arange(length) for length in lengths])


def sequence_boundaries(lengths: Sequence[int]) -> torch.Tensor:
    """Cumulative boundaries ``[N + 1]`` (int32) of sequences of ``lengths``.

    >>> sequence_boundaries([3, 2]).tolist()
    [0, 3, 5]
    """
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@contextlib.contextmanager
def eval_without_grad(module: torch.nn.Module | None) -> Iterator[None]:
    """Run the probe's forwards without gradients and with ``module`` (if any) in eval mode (dropout
    would move the figures); its mode is put back afterwards."""
    training = module.training if module is not None else False
    if module is not None:
        module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if module is not None:
            module.train(training)


def _ratio(numerator: float, denominator: float) -> float:
    if denominator == 0:
        return math.inf if numerator > 0 else 1.0
    return numerator / denominator


def _times(value: float) -> str:
    return "infinite" if math.isinf(value) else f"{value:.3g}x"


def _target_log_probs(logits: torch.Tensor, ids: torch.Tensor, starts: Sequence[int], n: int) -> torch.Tensor:
    """``[k, n - 1]`` log-probabilities of each target's next tokens, from logits ``[T, V]`` of a row."""
    index = torch.tensor(starts)[:, None] + torch.arange(n - 1)[None]  # positions predicting within a target
    log_probs = torch.log_softmax(logits[index.reshape(-1)].float(), dim=-1)
    following = ids[index.reshape(-1) + 1].long()
    return log_probs.gather(-1, following[:, None]).reshape(len(starts), n - 1)


def run_probe(rows: ProbeRows, packed: PackedForward, plain: PlainForward, *, model: str = "") -> ProbeReport:
    """The five forward passes of the probe and its figures (no verdict raised: see `ProbeReport.passed`).

    ``packed(row, lengths)`` runs one packed row ``[T]`` of sequences of ``lengths`` as training runs
    it and returns logits ``[T, V]``; ``plain(ids)`` runs unpacked sequences ``[B, n]`` and returns
    logits ``[B, n, V]``. Call it under ``torch.no_grad()`` with the model in eval mode.
    """
    start_time = time.perf_counter()
    k, n = rows.targets.shape
    starts, lengths = rows.target_starts, rows.lengths
    row_a, row_b = rows.row(), rows.row(swapped=True)
    packed_a = _target_log_probs(packed(row_a, lengths), row_a, starts, n)
    packed_b = _target_log_probs(packed(row_b, lengths), row_b, starts, n)
    mixed_a = _target_log_probs(plain(row_a[None])[0], row_a, starts, n)
    mixed_b = _target_log_probs(plain(row_b[None])[0], row_b, starts, n)
    alone_logits = plain(rows.targets)
    alone = torch.log_softmax(alone_logits[:, :-1].float(), dim=-1)
    alone = alone.gather(-1, rows.targets[:, 1:, None].long())[..., 0]

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        difference = (a - b).abs()
        # a non-finite output anywhere is as far from the reference as it gets
        return math.inf if not bool(torch.isfinite(difference).all()) else float(difference.max())

    return ProbeReport(
        cross_sequence=gap(packed_a, packed_b),
        leak=gap(mixed_a, mixed_b),
        unpacked_gap=gap(packed_a, alone),
        contaminated_gap=gap(mixed_a, alone),
        tokens=len(row_a),
        targets=k,
        seconds=time.perf_counter() - start_time,
        model=model,
    )
