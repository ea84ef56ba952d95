"""The mixture options of ``tightpack pack`` (``--weights`` and its companions), and the lines the
command prints of a mixture run.

``tightpack pack a.jsonl 'long/*.jsonl' c.jsonl --weights 5,3,2 --mix-by supervised-tokens``: one
weight per input, in input order (a glob pattern is one input).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any

import typer

from tightpack.core.mixture_plan import DEFAULT_WINDOW
from tightpack.errors import TightpackError
from tightpack.offline.mixture import MixtureConfig
from tightpack.reports.mixture import worst_batch


class MixBy(str, Enum):
    tokens = "tokens"
    supervised_tokens = "supervised-tokens"
    samples = "samples"


Weights = Annotated[
    str | None,
    typer.Option(
        help="Mix the inputs: one weight per input, in input order, comma-separated (5,3,2 or 0.5,0.3,0.2; "
        "a glob pattern is one input). What a weight counts is --mix-by."
    ),
]
MixByOption = Annotated[
    MixBy,
    typer.Option(
        help="What the weights count: runtime tokens, supervised tokens (what the model learns from), or "
        "samples (as Megatron's and Energon's blends count)."
    ),
]
MaxRepetitions = Annotated[
    float,
    typer.Option(
        help="With --weights: take a source at most this many times over (1: never repeat); larger sources "
        "are subsampled by --seed."
    ),
]
MixTokens = Annotated[
    str | None,
    typer.Option(
        help="With --weights: the mixture's runtime tokens (500k, 20M, 1.5B); default: the largest mixture "
        "--max-repetitions allows."
    ),
]
MixPacks = Annotated[int | None, typer.Option(help="With --weights: the mixture's packs, exactly.")]
MixWindow = Annotated[
    int,
    typer.Option(
        help="With --weights: packs per global batch; every batch of this many consecutive packs holds "
        "the mixture (set it to your global batch size in packs)."
    ),
]
MixTolerance = Annotated[
    float | None,
    typer.Option(
        help="With --weights: stop when a global batch's share of a source is further than this many "
        "percentage points from its target (default: report the worst batch only)."
    ),
]

_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def token_count(text: str) -> int:
    """``500k``, ``20M``, ``1.5B``, ``1e6`` or an integer (``266,250`` as printed) as a number of tokens.

    >>> [token_count(text) for text in ("1.5B", "20M", "4096", "266,250", "1e6")]
    [1500000000, 20000000, 4096, 266250, 1000000]
    """
    digits = re.sub(r"(?<=\d)[,_](?=\d{3})", "", text)  # thousands separators, as the messages print them
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE]\d+)?)\s*([kKmMbBgG]?)\s*", digits)
    if match is None or float(match[1]) * _SCALE[match[2].lower()] < 1:
        raise TightpackError(
            f"--mix-tokens {text!r}: give a number of tokens such as 500000, 500k, 20M or 1.5B"
        )
    return round(float(match[1]) * _SCALE[match[2].lower()])


def mixture_config(
    weights: str | None,
    mix_by: MixBy,
    max_repetitions: float,
    mix_tokens: str | None,
    mix_packs: int | None,
    mix_window: int,
    mix_tolerance: float | None,
) -> MixtureConfig | None:
    """The `MixtureConfig` of the options, or None without ``--weights`` (the other mixture options
    are then refused: they would do nothing)."""
    if weights is None:
        given = {
            "--mix-by": mix_by != MixBy.tokens,
            "--max-repetitions": max_repetitions != 1.0,
            "--mix-tokens": mix_tokens is not None,
            "--mix-packs": mix_packs is not None,
            "--mix-tolerance": mix_tolerance is not None,
            "--mix-window": mix_window != DEFAULT_WINDOW,
        }
        unused = [flag for flag, set_ in given.items() if set_]
        if unused:
            raise TightpackError(
                f"{unused[0]} sets the mixture of --weights: give --weights, or drop {unused[0]}"
            )
        return None
    parts = [part.strip() for part in weights.split(",")]
    try:
        values = tuple(float(part) for part in parts)
    except ValueError:
        raise TightpackError(
            f"--weights {weights!r}: give one number per input, comma-separated, such as 5,3,2"
        ) from None
    return MixtureConfig(
        weights=values,
        mix_by=mix_by.value,
        max_repetitions=max_repetitions,
        total_tokens=None if mix_tokens is None else token_count(mix_tokens),
        total_packs=mix_packs,
        window_packs=mix_window,
        tolerance=mix_tolerance,
    )


def mixture_lines(mixture: dict[str, Any]) -> list[str]:
    """What ``tightpack pack`` prints of a mixture run: every source's target and achieved share, its
    repetitions, and the worst global batch (the last, partial one apart)."""
    windows = mixture["windows"]
    lines = [f"mixture by {mixture['mix_by']} (target -> achieved; repetitions):"]
    for source in mixture["sources"]:
        lines.append(
            f"  {source['name']}: {source['target_share']:.2%} -> {source['share']:.2%}; "
            f"{source['repetitions']:.2f}x; {source['sequences']:,} sequences"
        )
    lines.append(f"worst {worst_batch(windows)}")
    if windows.get("last_batch_packs"):
        lines.append(
            f"last global batch ({windows['last_batch_packs']:,} of {windows['window_packs']:,} packs, "
            f"counted apart): {windows['last_batch_points']:.2f} points off"
        )
    return lines
