"""D2, D3, D4: the packs' size and alignment multiple, from the manifest or the metadata, against the
configuration's."""

from __future__ import annotations

import math

from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.repack import repack_fix
from tightpack.stale_packs.rules import SPECS


def check_pack_size(context: CheckContext, split: CheckedSplit) -> None:
    """D2: the pack size fits ``packed_sequence_size`` and both sequence lengths, and fills the first."""
    size, configured = split.pack_size, context.configured_p or 0
    if size is None:
        return
    source = "manifest" if split.manifest else "metadata pack_size"
    limits = [(f"{SPECS}.packed_sequence_size", configured)] if configured > 0 else []
    limits += [
        ("dataset.seq_length", context.config.dataset.seq_length),
        ("model.seq_length", context.config.model.seq_length),
    ]
    over = [(name, value) for name, value in limits if size > value]
    if over:
        name, value = min(over, key=lambda item: item[1])
        context.add(
            "D2",
            "error",
            f"{split.name} packs {split.path} were made with pack size {size} ({source}), above "
            f"{name} {value}: rows of up to {size} runtime tokens do not fit a batch width of {value}.",
            repack_fix(context, split),
        )
    elif size < configured:
        context.add(
            "D2",
            "warning",
            f"{split.name} packs {split.path} were made with pack size {size} ({source}), below "
            f"{SPECS}.packed_sequence_size {configured}: each pack holds at most {size} tokens, so "
            "steps train on fewer tokens than configured.",
            f"{repack_fix(context, split)} Or set {SPECS}.packed_sequence_size: {size} (with the sequence "
            "lengths to match).",
        )


def check_multiple(context: CheckContext, split: CheckedSplit) -> bool:
    """D3 and D4: the manifest's alignment multiple is one of k (D3) and the configured one (D4).

    Returns whether D3 found it wrong (deep reading then need not report the same segments again).
    """
    multiple = split.multiple
    if multiple is None:  # no manifest: D8 samples the segments instead
        return False
    k = context.k
    cp_part = math.lcm(*(2 * cp for cp in context.context_parallel_sizes() if cp > 1), 1)
    if multiple % k:
        origin = context.origin()
        if multiple % cp_part:
            context.add(
                "D3",
                "error",
                f"{split.name} packs {split.path} are aligned to pad_seq_to_mult {multiple} (manifest), "
                f"not a multiple of {k} ({origin}): context-parallel slicing needs every segment "
                f"divisible by {cp_part} (2*CP).",
                repack_fix(context, split),
            )
        else:
            context.add(
                "D3",
                "warning",
                f"{split.name} packs {split.path} are aligned to pad_seq_to_mult {multiple} (manifest), "
                f"not a multiple of the sequence-parallel multiple {k} ({origin}); the reference's "
                "recipes align packed segments to it.",
                repack_fix(context, split),
            )
        return True
    configured = (context.specs.pad_seq_to_mult if context.specs else None) or 1
    if configured != multiple:
        context.add(
            "D4",
            "warning",
            f"{split.name} packs {split.path} are aligned to pad_seq_to_mult {multiple} (manifest), the "
            f"configuration says {SPECS}.pad_seq_to_mult {configured}; the reference reads the packs "
            + (
                "as aligned and strips trailing EOS from the logical lengths."
                if configured > 1
                else "as unaligned: no cu_seqlens_q_padded, the alignment padding counts as sequence."
            ),
            f"Set {SPECS}.pad_seq_to_mult: {multiple} (what the packs hold).",
        )
    return False
