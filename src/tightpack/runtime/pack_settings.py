"""The pad id, alignment multiple and pack size a collate uses, taken from the packs and checked against
what the training script passes: `resolve_pack_settings`.

The packs record their settings (`tightpack.core.pack_manifest.read_pack_settings`: tightpack's
manifest, Megatron-Bridge's metadata). A value the script leaves out is taken from there; a value it
passes must agree with the recorded one, and an id must lie inside the tokenizer's vocabulary. Every
refusal is a `TightpackError` that names both values and where each came from, e.g.::

    eos_id 50256 (PackedCollate argument) disagrees with 2 (tokenizer.eos_id of packs/manifest.json)

Packs without a manifest (Megatron-Bridge's) record only the pack size: the EOS id then comes from the
argument or the tokenizer, and the alignment multiple must be passed (``pad_seq_to_mult`` of the
configuration that packed them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tightpack.core.pack_manifest import PackSettings, Recorded
from tightpack.errors import TightpackError


@dataclass(frozen=True)
class ResolvedSettings:
    """The values a collate uses, and where each came from (for messages).

    Attributes:
        pack_size, eos_id, pad_seq_to_mult: the values.
        vocab_size: ids must lie below it (None: unknown).
        sources: per name, where its value came from (``"tokenizer.eos_id of packs/manifest.json"``).
    """

    pack_size: int
    eos_id: int
    pad_seq_to_mult: int
    vocab_size: int | None
    sources: dict[str, str]


def _tokenizer_values(tokenizer: Any) -> tuple[Recorded | None, Recorded | None]:
    """(EOS id, vocabulary size) of a tokenizer, each with its source, or None where it has none."""
    if isinstance(tokenizer, str | os.PathLike):
        from tightpack.prepare.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    if hasattr(tokenizer, "eos_token_id"):  # transformers
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    elif hasattr(tokenizer, "eos_id") and hasattr(tokenizer, "vocab_size"):  # TokenizerSpec
        name, eos, vocab = tokenizer.name, tokenizer.eos_id, tokenizer.vocab_size
    else:
        raise TightpackError(
            f"tokenizer must be a tightpack TokenizerSpec, a tokenizer folder or file, or a transformers "
            f"tokenizer; got {type(tokenizer).__name__}"
        )
    where = f"tokenizer {name!r}"
    return (
        Recorded(int(eos), f"the EOS id of {where}") if eos is not None else None,
        Recorded(int(vocab), f"the vocabulary of {where}") if vocab else None,
    )


_FIXES = {
    "eos_id": "the packs pad with the EOS id of the tokenizer they were made with: leave eos_id out (the "
    "packs' manifest gives it) or use that tokenizer",
    "pad_seq_to_mult": "leave pad_seq_to_mult out to take the packs' multiple, or re-pack for the one you "
    "need (tightpack pack --pad-seq-to-mult)",
}


def _agreed(name: str, values: list[Recorded | None]) -> Recorded | None:
    """The first value present; every other value present must be the same."""
    present = [value for value in values if value is not None]
    for other in present[1:]:
        if other.value != present[0].value:
            raise TightpackError(f"{name} {present[0]} disagrees with {other}: {_FIXES[name]}")
    return present[0] if present else None


def resolve_pack_settings(
    packs: PackSettings,
    *,
    pack_size: int | None = None,
    eos_id: int | None = None,
    pad_seq_to_mult: int | None = None,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    caller: str = "PackedCollate",
) -> ResolvedSettings:
    """Each value from the arguments, else from the packs (else, for the EOS id, from the tokenizer).

    Args:
        packs: what the packs record (`read_pack_settings`).
        pack_size: the batch width cap; at least the packs' P (larger: wider batches, as a static
            shape may need).
        eos_id: the pad id (the EOS id the packs were made with).
        pad_seq_to_mult: the packs' alignment multiple.
        tokenizer: a `TokenizerSpec`, a tokenizer folder, or a transformers tokenizer: a source of the
            EOS id (which must agree with the packs') and of the vocabulary.
        vocab_size: ids must lie below it (the model's ``config.vocab_size``); default: the
            tokenizer's, else the packs'.
        caller: named in the messages (``PackedCollate``, ``PackingCollator``).

    Raises:
        TightpackError: a value that disagrees with the packs or the tokenizer, or a value neither
            given nor recorded. (`PackedCollate` itself refuses a pad id outside ``vocab_size``.)
    """
    argument = f"{caller} argument"
    token_eos, token_vocab = _tokenizer_values(tokenizer) if tokenizer is not None else (None, None)

    def given(value: int | None) -> Recorded | None:
        return None if value is None else Recorded(int(value), argument)

    eos = _agreed("eos_id", [given(eos_id), packs.eos_id, token_eos])
    if eos is None:
        raise TightpackError(
            f"{caller} needs the packs' EOS id (the pad id): {packs.where} has no manifest.json "
            "recording it (Megatron-Bridge's packs); pass eos_id= (the EOS id of the tokenizer the packs "
            "were made with) or tokenizer="
        )
    multiple = _agreed("pad_seq_to_mult", [given(pad_seq_to_mult), packs.pad_seq_to_mult])
    if multiple is None:
        raise TightpackError(
            f"{caller} needs the packs' alignment multiple: {packs.where} has no manifest.json recording it "
            "(Megatron-Bridge's packs); pass pad_seq_to_mult= (offline_packing_specs.pad_seq_to_mult of the "
            "configuration that packed them; 1 when they are not aligned)"
        )
    size = given(pack_size) or packs.pack_size
    if size is None:
        raise TightpackError(
            f"{caller} needs the pack size: {packs.where} records none (no manifest.json, no metadata "
            "with pack_size); pass pack_size="
        )
    if packs.pack_size is not None and size.value < packs.pack_size.value:
        raise TightpackError(
            f"pack_size {size} is below the packs' {packs.pack_size}: rows of up to "
            f"{packs.pack_size.value} runtime tokens would not fit the batch; leave pack_size out or pass "
            f"at least {packs.pack_size.value}"
        )
    vocab = None if vocab_size is None else Recorded(int(vocab_size), f"{argument} vocab_size")
    vocab = vocab or token_vocab or packs.vocab_size
    return ResolvedSettings(
        pack_size=size.value,
        eos_id=eos.value,
        pad_seq_to_mult=multiple.value,
        vocab_size=None if vocab is None else vocab.value,
        sources={
            "pack_size": size.source,
            "eos_id": eos.source,
            "pad_seq_to_mult": multiple.source,
            **({"vocab_size": vocab.source} if vocab else {}),
        },
    )
