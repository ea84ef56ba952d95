"""The token store of a run taken from the cache of finished stores, or tokenized and added to it.

`tokenize_reusing_store` is the local engine's tokenize pass (`tightpack.offline.engines.local`). A
store is keyed by what decides its samples (`store_key`: the inputs' content, the tokenizer, the
sample settings); ``chat``, ``prompt-completion`` and ``auto`` share a key, and the store records
which format made it and the kinds of its rows, so a run takes it only where both formats read every
row the same (`same_samples`): ``auto`` and ``chat`` on rows that all have messages. The cache itself
(folders, atomic commit, pruning) is `tightpack.core.store_cache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from tightpack import __version__
from tightpack.core.paths import default_cache_dir
from tightpack.core.store_cache import StoreCache
from tightpack.core.token_store import STORE_FORMAT_VERSION, TokenStore
from tightpack.offline.config import PackConfig
from tightpack.offline.output_folder import os_error_message
from tightpack.prepare.chunks import Chunk
from tightpack.prepare.tokenize import BadRow, TokenizeReport, max_token_bytes, tokenize_to_store
from tightpack.prepare.tokenizer import TokenizerSpec

_TEXT_FORMATS = ("auto", "chat", "prompt-completion")


def tokenize_reusing_store(
    sources,
    chunks: Callable[[list[int]], Iterator[Chunk]],
    spec: TokenizerSpec,
    config: PackConfig,
    staging: Path,
    on_rows: Callable[[int], None],
    warnings: list[str],
    budget: int,
) -> TokenizeReport:
    """The token store of ``sources``: the cache's when it holds one that serves this run, else
    ``chunks(starts)`` tokenized (into the cache with ``config.reuse_store``, else into ``staging``);
    ``chunks`` appends the first row of each source to ``starts`` (the report's ``source_starts``).

    ``budget`` is the text budget (`text_budget`); a cached store whose texts are not what this
    budget makes (`same_texts`) is made again. An unwritable cache turns reuse off for the run (a
    warning in ``warnings``), it does not stop it.
    """
    key = store_key(sources, spec, config) if config.reuse_store else None
    cache = StoreCache(default_cache_dir() / "stores")
    store_dir = staging / "_store"
    if key is not None:
        try:
            store_dir = cache.new_partial()
        except OSError as error:
            warnings.append(
                f"token store reuse is off: the cache cannot be written ({os_error_message(error)})"
            )
            key = None
    if key is not None and (hit := cache.lookup(key)) is not None:
        folder, info = hit
        store = TokenStore.open(folder)
        longest = int(store.lengths.max(initial=0))
        same = same_samples(info.get("format"), config.format.format, info.get("kinds", ()))
        starts = info.get("source_starts")  # None: cached before stores kept it (tokenized anew)
        if (
            same
            and starts is not None
            and same_texts(info["text_budget"], info["texts_cut"], longest, budget, config.cap)
        ):
            shutil.rmtree(store_dir, ignore_errors=True)
            on_rows(info["rows_read"])
            bad_rows = [BadRow(**row) for row in info["bad_rows"]]
            return TokenizeReport(
                store,
                info["rows_read"],
                bad_rows,
                reused=True,
                texts_cut=info["texts_cut"],
                source_starts=tuple(starts),
            )
        del store
        shutil.rmtree(folder, ignore_errors=True)  # other samples, or cut texts too short for this cap
    starts: list[int] = []
    try:
        report = tokenize_to_store(
            chunks(starts),
            spec,
            config.format,
            store_dir,
            workers=config.workers,
            skip_bad_rows=config.skip_bad_lines,
            on_rows=on_rows,
            text_budget=budget,
        )
    except BaseException:
        shutil.rmtree(store_dir, ignore_errors=True)
        raise
    report = dataclasses.replace(report, source_starts=tuple(starts))
    if key is None:
        return report
    info = {
        "source_starts": starts,
        "rows_read": report.rows_read,
        "bad_rows": [asdict(row) for row in report.bad_rows],
        "texts_cut": report.texts_cut,
        "text_budget": budget,
        "format": config.format.format,
        "kinds": sorted(report.kinds),
    }
    folder = cache.commit(store_dir, key, info)
    return dataclasses.replace(report, store=TokenStore.open(folder))


def store_key(sources, spec: TokenizerSpec, config: PackConfig) -> str | None:
    """Fingerprint of what decides the token store; None when an input has no content fingerprint."""
    identities = [source.identity for source in sources]
    if config.format.vision is not None:  # the media files are not fingerprinted: tokenize anew
        return None
    if not all("sha256" in identity or "fingerprint" in identity for identity in identities):
        return None
    # Chat, prompt-completion and auto share a key: which of them made a store, and the kinds of its
    # rows, are in its information, and `same_samples` tells whether it serves this run.
    format_settings = config.settings()["format"]
    if format_settings["format"] in _TEXT_FORMATS:
        format_settings["format"] = "text"
    decisive = [
        identities,
        spec.fingerprint,
        format_settings,
        config.skip_bad_lines,
        __version__,
        STORE_FORMAT_VERSION,
    ]
    return hashlib.sha256(json.dumps(decisive, sort_keys=True, default=str).encode()).hexdigest()


def same_samples(made_with: str | None, wanted: str, kinds: Iterable[str]) -> bool:
    """Whether a store made with the format ``made_with`` holds the samples the format ``wanted`` would
    make of rows of ``kinds`` (`tightpack.prepare.formats.row_kind`): ``auto`` reads each row as its
    kind, the others read every row as themselves. ``chat`` rows only: ``auto`` and ``chat`` agree.

    >>> same_samples("chat", "auto", ["chat"]), same_samples("chat", "auto", ["chat", "prompt-completion"])
    (True, False)
    """
    if made_with is None:  # a store of an older release
        return False
    read_as = lambda fmt, kind: kind if fmt == "auto" else fmt  # noqa: E731
    return all(read_as(made_with, kind) == read_as(wanted, kind) for kind in kinds)


def same_texts(store_budget: int, texts_cut: int, longest: int, budget: int, cap: int) -> bool:
    """Whether a token store made with text budget ``store_budget`` holds the very samples a run with
    ``budget`` and cap ``cap`` would tokenize (so its counts, ``tokens_in`` included, are that run's).

    ``texts_cut``: samples of the store that lost their middle; ``longest``: its longest sample (stored
    tokens). A field cut at ``budget`` has over ``2 * budget`` characters, so over ``2 * (cap + 1)``
    tokens (a token covers at most ``max_token_bytes`` characters): a store whose samples are all
    shorter, and none cut, is the same at any budget.

    >>> same_texts(9000, 0, 300, 5000, 100), same_texts(9000, 0, 300, 5000, 149)
    (False, True)
    """
    if budget == store_budget:
        return True
    if texts_cut:  # its cut texts keep another middle than this budget would
        return False
    return budget > store_budget or longest <= 2 * (cap + 1)


def text_budget(spec: TokenizerSpec, config: PackConfig) -> int:
    """Characters kept at each end of a field cut before tokenizing (`tightpack.prepare.formats._bounded`).

    A sample keeps at most ``cap + 1`` tokens, and a token covers at most ``max_token_bytes`` bytes
    (so at most that many characters): the tokens any truncation keeps from one end of a field lie in
    its first or last ``(cap + 1) * max_token_bytes`` characters. The margin keeps the word that
    straddles that bound whole. Fields within twice the budget are never cut.
    """
    return (config.cap + 1) * max_token_bytes(spec) + 4096
