"""What a key that tightpack does not model means, and which dataset kind a ``dataset`` without a type is.

`unknown_key_message` applies rules 2 to 5 of `tightpack.config.loading` (which states them in full) to one
key: a Megatron-Bridge section or field is accepted unread, a key like a field tightpack checks is an error
naming that field. `infer_dataset_kind` finds the one kind that has every key of an untyped ``dataset``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from functools import cache
from typing import get_args, get_type_hints

from tightpack.config.megatron_bridge import MB_FIELDS, MB_SECTIONS
from tightpack.config.schema import DATASET_TYPES, DatasetProvider, RunConfig
from tightpack.errors import TightpackError

# Rule 4: an unread key this close (difflib ratio) to a field of its section is a typo of that field.
_CLOSE_RATIO = 0.8


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@cache
def _dataset_fields() -> dict[str, frozenset[str]]:
    """Each dataset kind -> the keys tightpack models for it."""
    return {
        name: frozenset(item.name for item in dataclasses.fields(cls) if item.init)
        for name, cls in DATASET_TYPES.items()
    }


@cache
def _dataset_known_fields() -> dict[str, frozenset[str]]:
    """Each dataset kind -> the keys its Megatron-Bridge class takes: tightpack's and `MB_FIELDS`."""
    return {
        name: names | MB_FIELDS.get(DATASET_TYPES[name], frozenset())
        for name, names in _dataset_fields().items()
    }


def infer_dataset_kind(keys: list[str], path: str) -> tuple[str, tuple[str, ...]]:
    """The one dataset kind that has every key, and the keys that decide it.

    A key that no kind has does not count when rule 5 of `tightpack.config.loading` accepts it (`load_config`
    then lists it as not checked); it is an error when it looks like a field tightpack checks (rule 4). The
    deciding keys are those no other kind has; when every key is shared (the combination decides), those
    that not every kind has.

    >>> infer_dataset_kind(["seq_length", "dataset_root", "enable_offline_packing"], "dataset")
    ('GPTSFTDatasetConfig', ('dataset_root',))
    >>> infer_dataset_kind(["seq_length", "enable_in_batch_packing", "offline_packing_specs"], "dataset")
    ('DatasetProvider', ('enable_in_batch_packing', 'offline_packing_specs'))
    >>> infer_dataset_kind(["seq_length", "data_path", "cache_tag"], "dataset")  # Megatron-Bridge's field
    ('GPTDatasetConfig', ('data_path',))
    """
    kinds = _dataset_known_fields()
    known = frozenset().union(*kinds.values())
    hints = {key: _dataset_key_hint(key, path) for key in keys if key not in known}
    suspects = {key: hint for key, hint in hints.items() if hint is not None}
    if suspects:
        raise TightpackError(_unknown_dataset_keys_message(suspects, path))
    keys = [key for key in keys if key in known]
    owners = {key: [name for name, names in kinds.items() if key in names] for key in keys}
    distinctive = [key for key in keys if len(owners[key]) < len(kinds)]
    fits = [name for name, names in kinds.items() if names.issuperset(keys)]
    if len(fits) == 1:
        unique = tuple(key for key in keys if owners[key] == fits)
        return fits[0], unique or tuple(distinctive)
    if fits:
        example = DATASET_TYPES[fits[0]]
        raise TightpackError(
            f"{path} has no type and its fields ({', '.join(keys) or 'none'}) fit {len(fits)} dataset types: "
            f"{', '.join(fits)}; set {path}.type to the one you mean (e.g. type: {example.type}) or "
            f"{path}._target_ to its class path (e.g. _target_: {example.target})"
        )
    described = [
        f"{key} {'' if index else 'is a field '}of {', '.join(owners[key])}"
        + (" only" if len(owners[key]) == 1 else "")
        for index, key in enumerate(distinctive)
    ]
    raise TightpackError(
        f"{path} has no type and its fields fit no dataset type: {', '.join(described)}; set {path}.type and "
        "remove the fields it does not have"
    )


def _dataset_key_hint(key: str, path: str) -> str | None:
    """Rule 4 for a key no dataset kind has: the field tightpack checks that it likely means, else None."""
    elsewhere = [found for found in _field_paths().get(key, ()) if found.rsplit(".", 1)[0] != path]
    if elsewhere:
        return " or ".join(elsewhere)
    names = sorted(frozenset().union(*_dataset_fields().values()))
    close = difflib.get_close_matches(key, names, n=1, cutoff=_CLOSE_RATIO)
    return join_path(path, close[0]) if close else None


def _unknown_dataset_keys_message(suspects: Mapping[str, str], path: str) -> str:
    """Keys of a dataset without a type that no kind has (key -> the field it likely means)."""
    several = len(suspects) > 1
    guesses = [f"{hint} (for {key})" if several else hint for key, hint in suspects.items()]
    return (
        f"unknown key{'s' if several else ''} {', '.join(map(repr, suspects))} in {path} "
        f"({', '.join(join_path(path, key) for key in suspects)}); no dataset type has "
        f"{'them' if several else 'it'}; did you mean {', '.join(guesses)}?"
    )


@cache
def _field_paths() -> dict[str, tuple[str, ...]]:
    """Every known field name -> the dotted paths where it is valid (dataset fields of all kinds)."""
    paths: dict[str, list[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for item in dataclasses.fields(cls):
            if not item.init:
                continue
            path = join_path(prefix, item.name)
            paths.setdefault(item.name, [])
            if path not in paths[item.name]:
                paths[item.name].append(path)
            for member in (hints[item.name], *get_args(hints[item.name])):
                if dataclasses.is_dataclass(member):
                    walk(member, path)

    walk(RunConfig, "")
    return {name: tuple(found) for name, found in paths.items()}


def unknown_key_message(cls: type, key: str, prefix: str) -> str | None:
    """The error for a key that ``cls`` does not model, or None when it is accepted unread.

    Rules 2 to 5 of `tightpack.config.loading`: a Megatron-Bridge section or field is accepted; a key like a
    field tightpack checks (misplaced, of another dataset kind, or within `_CLOSE_RATIO`) is an error; a stray
    top-level name is an error; any other key is accepted.
    """
    valid = [item.name for item in dataclasses.fields(cls) if item.init]
    kind = getattr(cls, "type", None)
    where = prefix or "the top level"
    head = f"unknown key {key!r} in {where}{f' ({kind})' if kind else ''} ({join_path(prefix, key)})"
    top = cls is RunConfig
    if key in (MB_SECTIONS if top else MB_FIELDS.get(cls, ())):
        return None
    custom = cls is DatasetProvider  # the user's own class: only closeness counts
    owners = [name for name, names in _dataset_fields().items() if key in names] if kind else []
    if owners and not custom:
        hint = f"; it is a field of {', '.join(owners)}, not of {kind}"
        if key == "pad_to_max_length" and "dataset_kwargs" in valid:
            hint += f"; {kind} takes it as {prefix}.dataset_kwargs.pad_to_max_length"
        return head + hint
    elsewhere = [path for path in _field_paths().get(key, ()) if path.rsplit(".", 1)[0] != prefix]
    if elsewhere and not custom:
        return f"{head}; did you mean {' or '.join(elsewhere)}?"
    if top:
        sections = sorted(MB_SECTIONS)
        close = difflib.get_close_matches(key, [*valid, *sections], n=1, cutoff=0.5)
        if close:
            return f"{head}; did you mean {close[0]}?"
        return (
            f"{head}; valid keys: {', '.join(valid)}, and Megatron-Bridge's other sections, which tightpack "
            f"does not check: {', '.join(sections)}"
        )
    close = difflib.get_close_matches(key, valid, n=1, cutoff=_CLOSE_RATIO)
    return f"{head}; did you mean {join_path(prefix, close[0])}?" if close else None
