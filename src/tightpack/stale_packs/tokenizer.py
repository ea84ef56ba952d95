"""D7: the manifest's tokenizer is the configuration's; and the configured vocabulary D10 checks ids in."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from tightpack.errors import TightpackError
from tightpack.stale_packs.context import CheckContext, CheckedSplit
from tightpack.stale_packs.repack import repack_fix
from tightpack.stale_packs.rules import SPECS

Comparison = Literal["fingerprint", "name"]


def check_tokenizer(context: CheckContext, split: CheckedSplit) -> Comparison | None:
    """D7 on a split with a manifest: by fingerprint when the configuration names a local tokenizer
    tightpack can load, else by name.

    Returns how the tokenizers were compared, or None when they were not (nothing to compare).
    """
    packed = split.manifest.get("tokenizer", {})
    packed_name, fingerprint = packed.get("name"), packed.get("fingerprint")
    wanted = configured_tokenizer(context.raw, context.specs)
    if wanted is None or not packed_name:
        return None
    key, value = wanted
    local = Path(value)
    if key == "tokenizer.tokenizer_model" and local.exists() and fingerprint:
        from tightpack.prepare.tokenizer import load_tokenizer

        try:
            spec = load_tokenizer(local)
        except TightpackError as error:
            context.notes.append(f"tokenizer {value}: not loadable by tightpack ({error}); names compared")
        else:
            if spec.fingerprint != fingerprint:
                context.add(
                    "D7",
                    "error",
                    f"{split.name} packs {split.path} were tokenized with {packed_name!r} (fingerprint "
                    f"{fingerprint[:12]}), {key} {value!r} has fingerprint {spec.fingerprint[:12]}: "
                    "other token ids.",
                    repack_fix(context, split),
                )
            return "fingerprint"
    if tokenizer_key(value) != tokenizer_key(packed_name):
        context.add(
            "D7",
            "warning",
            f"{split.name} packs {split.path} were tokenized with {packed_name!r}, the configuration "
            f"names {key} {value!r} (names compared: {value!r} is no local tokenizer tightpack can "
            "load, so the contents could not be).",
            f"If the tokenizers differ: {repack_fix(context, split)}",
        )
    return "name"


def configured_vocabulary(context: CheckContext) -> tuple[int, str, str] | None:
    """(size, key, value) of the configured tokenizer's vocabulary, loaded once per run; None (with a
    note, the first time) when the configuration names none that tightpack can load."""
    if "vocabulary" not in context.loaded:
        context.loaded["vocabulary"] = _load_vocabulary(context)
    return context.loaded["vocabulary"]


def _load_vocabulary(context: CheckContext) -> tuple[int, str, str] | None:
    from tightpack.prepare.tokenizer import load_tokenizer

    wanted = configured_tokenizer(context.raw, context.specs)
    if wanted is None:
        context.notes.append("token ids not checked (D10): the configuration names no tokenizer")
        return None
    key, value = wanted
    described = f"{key} {value!r}"
    if key == "tokenizer.tokenizer_type":  # GPT2BPETokenizer: GPT-2's vocabulary
        spec = load_tokenizer(None)
    elif key == "tokenizer.tokenizer_model" and Path(value).exists():
        try:
            spec = load_tokenizer(value)
        except TightpackError as error:
            context.notes.append(f"token ids not checked (D10): {described} is not loadable ({error})")
            return None
    else:
        context.notes.append(f"token ids not checked (D10): {described} is no local tokenizer")
        return None
    return spec.vocab_size, key, value


def configured_tokenizer(raw: Mapping[str, Any], specs: object) -> tuple[str, str] | None:
    """(key, value) of the tokenizer the configuration names: Megatron-Bridge's ``tokenizer`` section
    (``tokenizer_model``; ``tokenizer_type: GPT2BPETokenizer`` is GPT-2), else the packing specs'
    ``tokenizer_model_name`` (a name only)."""
    section = raw.get("tokenizer")
    if isinstance(section, Mapping):
        model = section.get("tokenizer_model")
        if isinstance(model, str) and model:
            return "tokenizer.tokenizer_model", model
        if section.get("tokenizer_type") == "GPT2BPETokenizer":
            return "tokenizer.tokenizer_type", "gpt2"
    name = getattr(specs, "tokenizer_model_name", None)
    if name:
        return f"{SPECS}.tokenizer_model_name", name
    return None


def tokenizer_key(name: str) -> str:
    """A tokenizer name reduced for comparison: ``'gpt2 (built-in)'``, ``'openai-community/gpt2'`` and
    ``'openai-community--gpt2'`` (the reference's directory form) are all ``'gpt2'``.

    >>> [tokenizer_key(name) for name in ("gpt2 (built-in)", "openai-community--gpt2", "/m/Llama-3/")]
    ['gpt2', 'gpt2', 'llama-3']
    """
    name = name.strip().removesuffix("(built-in)").strip().replace("--", "/").rstrip("/\\")
    return name.replace("\\", "/").rsplit("/", 1)[-1].lower()
