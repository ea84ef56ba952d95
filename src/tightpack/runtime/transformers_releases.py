"""The transformers (and torch) releases from which each attention implementation keeps packed
sequences apart, and the refusal below them.

A packed row reaches the model as ``input_ids`` ``[1, T]`` with ``position_ids`` restarting at 0 per
sequence (plus ``cu_seq_lens_q/k`` and ``max_length_q/k``) and no 2-D ``attention_mask``
(`tightpack.runtime.hf_kwargs`). Below its floor an implementation silently applies one causal mask
to the whole row: every sequence attends to the ones before it (a tiny Llama is off by 0.38 per
sequence on 4.53.0, with no error). Each floor was found by reading the released wheels and the
eager/sdpa ones confirmed by running both sides of it (docs/transformers-releases.md).
"""

from __future__ import annotations

import dataclasses
import re
from importlib.metadata import PackageNotFoundError, version

from tightpack.errors import TightpackError

Release = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class ReleaseFloor:
    """The first transformers release, and the oldest torch, with which an attention implementation
    keeps the sequences of a packed row apart."""

    transformers: Release
    torch: Release = (0, 0, 0)


# eager, sdpa, flex: 4.54.0 added `masking_utils.find_packed_sequence_indices`; its mask builders
# (causal, sliding-window, chunked) AND the mask with "same sequence" whenever position_ids are given,
# no 2-D attention_mask and no cache, but only on torch >= 2.6 (`_is_torch_greater_or_equal_than_2_6`).
# 4.53.x has masking_utils without it; up to 4.52 the models' `_update_causal_mask` never reads
# position_ids, and flex (4.47+) takes sequence boundaries only from a 2-D mask, which packed rows lack.
_MASK_FROM_POSITIONS = ReleaseFloor(transformers=(4, 54, 0), torch=(2, 6, 0))
RELEASE_FLOORS: dict[str, ReleaseFloor] = {
    "eager": _MASK_FROM_POSITIONS,
    "sdpa": _MASK_FROM_POSITIONS,
    "flex_attention": _MASK_FROM_POSITIONS,
    # 4.44.0: `_flash_attention_forward` switches to the varlen kernel with boundaries from
    # position_ids (`prepare_fa2_from_position_ids`) when they restart and no mask is given; 4.43 has
    # no such branch. 4.47 adds cu_seq_lens_q/k and max_length_q/k as an alternative.
    "flash_attention_2": ReleaseFloor(transformers=(4, 44, 0)),
    # 4.53.0: the first release that has flash_attention_3; it shares the varlen path above.
    "flash_attention_3": ReleaseFloor(transformers=(4, 53, 0)),
}


@dataclasses.dataclass(frozen=True)
class FamilyFloor:
    """The first transformers release that keeps a model family's packed sequences apart, and what
    the releases before it do to a packed row (a clause after "transformers X.Y.Z")."""

    release: Release
    before: str


# Model families (``model_type``) whose own code reads the packed boundaries only from a later release
# than their attention implementation.
# - gpt2: 4.55.0 moved GPT2Model to `masking_utils.create_causal_mask` with position_ids; 4.54 keeps
#   its own `_update_causal_mask`, which ignores them (a tiny GPT-2 with sdpa leaks 105% of one causal
#   mask's change on 4.54.0). Many others still build their mask that way on 4.57 (falcon, gptj,
#   gpt_neo, codegen, stablelm, qwen2_moe, olmoe, ...); the equivalence probe refuses them on the
#   first packed row.
# - mamba2: 5.25.0 hands the forward's seq_idx to its convolution and scan kernels (causal_conv1d,
#   mamba_ssm), and its torch path raises when it gets one; 5.24 gives its layers no boundaries.
FAMILY_FLOORS: dict[str, FamilyFloor] = {
    "gpt2": FamilyFloor(
        (4, 55, 0),
        "builds gpt2's attention mask without reading position_ids, so one causal mask covers the whole "
        "packed row",
    ),
    "mamba2": FamilyFloor(
        (5, 25, 0),
        "gives mamba2's Mamba-2 (state-space) layers no sequence boundaries, so every packed sequence "
        "starts from the state the one before it left",
    ),
}


def parse_release(text: str) -> Release:
    """``"4.54.0"`` -> ``(4, 54, 0)``; suffixes (``.dev0``, ``rc1``, ``+cpu``) are dropped.

    >>> parse_release("4.53.0"), parse_release("2.13.0+cpu"), parse_release("5.0.0rc1")
    ((4, 53, 0), (2, 13, 0), (5, 0, 0))
    """
    parts = [int(match) for match in re.findall(r"\d+", text.split("+")[0])[:3]]
    if not parts:
        raise TightpackError(f"cannot read a release number from {text!r}")
    major, minor, patch = [*parts, 0, 0][:3]
    return major, minor, patch


def installed_release(package: str) -> str | None:
    """The installed release of ``package`` (``"transformers"``, ``"torch"``), None if absent."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _text(release: Release) -> str:
    return ".".join(map(str, release))


def check_release(
    attn_implementation: str, version: str | None = None, *, torch_version: str | None = None
) -> None:
    """Refuse an attention implementation that the transformers ``version`` (default: the installed
    one) or the ``torch_version`` (default: installed) cannot run on packed rows without attention
    crossing sequences.

    >>> check_release("sdpa", "4.54.0", torch_version="2.6.0")
    >>> check_release("sdpa", "4.53.0")
    Traceback (most recent call last):
    ...
    tightpack.errors.TightpackError: transformers 4.53.0 does not keep packed sequences apart with ...

    Raises:
        TightpackError: naming the installed release, the first one that packs this implementation,
            and the fix (upgrade, or an implementation that this release packs).
    """
    floor = RELEASE_FLOORS.get(attn_implementation)
    if floor is None:
        raise TightpackError(
            f"attention implementation {attn_implementation!r} does not keep packed sequences apart; load "
            f"the model with attn_implementation= one of {', '.join(RELEASE_FLOORS)}"
        )
    version = version or installed_release("transformers")
    installed = parse_release(version) if version else None
    if installed is not None and installed < floor.transformers:
        working = [name for name, other in RELEASE_FLOORS.items() if installed >= other.transformers]
        instead = f", or load the model with attn_implementation={working[0]!r}" if working else ""
        first = _text(floor.transformers)
        raise TightpackError(
            f"transformers {version} does not keep packed sequences apart with attn_implementation="
            f"{attn_implementation!r}: one causal mask covers the whole packed row, so every sequence "
            f"attends to the ones before it; the first release that packs {attn_implementation} is "
            f"{first}: upgrade with pip install 'transformers>={first}'{instead}"
        )
    torch_version = torch_version or installed_release("torch")
    if torch_version and parse_release(torch_version) < floor.torch:
        raise TightpackError(
            f"torch {torch_version} is too old for transformers to keep packed sequences apart with "
            f"attn_implementation={attn_implementation!r} (it builds the packed mask only on torch>="
            f"{_text(floor.torch)}): upgrade with pip install 'torch>={_text(floor.torch)}'"
        )


def check_family_release(model_type: str | None, version: str | None = None) -> None:
    """Refuse a model family (``model_type``) that the transformers ``version`` (default: installed)
    runs across the sequences of a packed row although its attention implementation could pack.

    >>> check_family_release("gpt2", "4.55.0")
    >>> check_family_release("gpt2", "4.54.0")
    Traceback (most recent call last):
    ...
    tightpack.errors.TightpackError: transformers 4.54.0 builds gpt2's attention mask without ...
    """
    floor = FAMILY_FLOORS.get(model_type or "")
    version = version or installed_release("transformers")
    if floor is None or version is None or parse_release(version) >= floor.release:
        return
    first = _text(floor.release)
    raise TightpackError(
        f"transformers {version} {floor.before}; the first release that packs {model_type} is {first}: "
        f"upgrade with pip install 'transformers>={first}', or train it unpacked (padded batches)"
    )
