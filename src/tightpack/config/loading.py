"""Reading a configuration: `load_config` builds a `RunConfig` from a YAML file or a dict.

The file is laid out like Megatron-Bridge's ``ConfigContainer``: sections ``train``, ``model``, ``ddp``,
``dataset``, ``validation``, ``dist``, ``comm_overlap`` and ``dist_train`` with Megatron-Bridge's field names
(the classes of `tightpack.config.schema`). Misspelt or misplaced keys (below) and wrong types are user errors
(`TightpackError`) naming the path.

Keys tightpack does not read. A real Megatron-Bridge file (a recipe override, or the configuration it
serializes) holds hundreds of settings no packing rule uses. `load_config` accepts them without reading
them and the report names them once (``ValidationReport.not_checked``: "not checked by tightpack: ...").
Typos of the fields tightpack reads are still errors. The rule, for each key:

1. A field tightpack models is read and type-checked (the classes of `tightpack.config.schema`).
2. At the top level, Megatron-Bridge's other ``ConfigContainer`` sections (``optimizer``, ``scheduler``,
   ``logger``, ``checkpoint``, ``tokenizer``, ... : `MB_SECTIONS` in `tightpack.config.megatron_bridge`) are
   accepted whole; any other name is an error, naming the closest section (a closed list of about 25 names,
   so a stray one is a wrong file or a misplaced section).
3. Inside a section, a field that Megatron-Bridge's class has and tightpack does not model
   (``train.eval_iters``, ``dist.use_megatron_fsdp``, ``model.hidden_size``: `MB_FIELDS`, the dataclass
   fields, inherited ones included, of Megatron-Bridge 067f987 with its Megatron-LM 2a75ac1) is accepted.
   So is any key of a ``model`` whose ``_target_`` names a model provider: a serialized file lists every
   field of its provider class, model-family fields included.
4. Another key is an error when it looks like a field tightpack checks: a field of its section with a
   difflib ratio of at least 0.8 (``seq_lenght``; the message names the closest), a field tightpack reads
   in another section (``train.seq_length``), or a field of another dataset kind (``pad_to_max_length`` on
   GPT SFT). A ``DatasetProvider`` is the user's own class, so only closeness counts there.
5. Any other key is accepted too. Field lists lag Megatron-Core releases, and the packing report should
   not fail on a field that is newer than the lists; Megatron-Bridge rejects a key its class lacks anyway.

The dataset kind is ``dataset.type``, one of the reference's class names (`DATASET_TYPES`), or the class
that ``dataset._target_`` names: Megatron-Bridge's serialized configurations name every section's class
with a dotted ``_target_`` path (``megatron.bridge.data.builders.gpt_sft.GPTSFTDatasetConfig``), and
`load_config` accepts those keys on every section where they name the class it expects. Without either
(Megatron-Bridge's override files have none: the recipe supplies the class), the kind is inferred from the
dataset's fields when exactly one kind has them all (the fields tightpack models and, by rule 3, those
Megatron-Bridge's class has; keys accepted by rule 5 do not count); the report says so
(``derived.dataset_type_source``), and fields that fit several kinds or none are a user error. A
``DatasetProvider`` is a custom provider: it has the generic packing fields and none of the kinds' rules.
This module never touches the filesystem beyond reading the YAML file: explicit packed paths are not
checked for existence (the reference does that when it builds ``PackedSequenceSpecs``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from tightpack.config.keys import infer_dataset_kind, join_path, unknown_key_message
from tightpack.config.megatron_bridge import DATASET_ALIASES, MODEL_TARGET_SUFFIXES, SECTION_TARGETS
from tightpack.config.schema import (
    DATASET_TYPES,
    DatasetConfig,
    DatasetProvider,
    GPTSFTDatasetConfig,
    ModelSection,
    RunConfig,
    check_minimum,
)
from tightpack.errors import TightpackError

_TARGET = "_target_"


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> RunConfig:
    """Build a `RunConfig` from a YAML file path or a dict of sections.

    ``_target_`` keys (Megatron-Bridge's serialized class paths) are accepted on every section that they
    name the right class for; on ``dataset`` the class picks the kind. A dataset with neither ``type`` nor
    ``_target_`` gets the one kind that has all its fields. Keys tightpack does not read are accepted by the
    rules of the module docstring and listed in ``config.not_checked``.

    Raises:
        TightpackError: the file cannot be read or parsed, a key looks like a misspelt or misplaced field
            tightpack checks or is no ConfigContainer section (the message names its path and the closest
            valid name), a required key is missing, a value has the wrong type, a
            ``_target_`` names another class, or the dataset kind is unknown, contradictory (``type`` vs
            ``_target_``) or ambiguous (fields that several kinds have: set ``type``).

    >>> config = load_config({"train": {"micro_batch_size": 1, "global_batch_size": 8},
    ...                       "model": {"seq_length": 4096},
    ...                       "dataset": {"type": "GPTSFTDatasetConfig", "seq_length": 4096}})
    >>> config.dataset.dataloader_type, config.model.context_parallel_size
    ('batch', 1)
    >>> inferred = load_config({"train": {"micro_batch_size": 1, "global_batch_size": 8},
    ...                         "model": {"seq_length": 4096},
    ...                         "dataset": {"seq_length": 4096, "dataset_root": "/data/squad"}})
    >>> inferred.dataset.type, inferred.dataset.type_source
    ('GPTSFTDatasetConfig', 'inferred from its fields: dataset_root')
    >>> recipe = load_config({"train": {"micro_batch_size": 1, "global_batch_size": 8, "eval_iters": 10},
    ...                       "model": {"seq_length": 4096, "hidden_size": 4096},
    ...                       "dataset": {"seq_length": 4096, "dataset_root": "/data/squad"},
    ...                       "optimizer": {"lr": 1e-5}})
    >>> recipe.not_checked
    ('train.eval_iters', 'model.hidden_size', 'optimizer')
    >>> load_config({"train": {"micro_batch_sise": 1}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tightpack.errors.TightpackError: unknown key 'micro_batch_sise' ...; did you mean train.micro_batch_size?
    """
    if isinstance(source, Mapping):
        return _build_config(source)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise TightpackError(f"cannot read config {path}: {reason}") from None
    try:
        import yaml
    except ImportError:  # pragma: no cover - transformers depends on PyYAML
        raise TightpackError("reading YAML configs needs PyYAML: pip install pyyaml") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise TightpackError(f"cannot parse config {path} as YAML: {problem}{where}") from None
    if not isinstance(data, Mapping):
        raise TightpackError(
            f"config {path} must be a mapping of sections (train, model, dataset, ...), got {_kind(data)}"
        )
    return _build_config(data)


def _build_config(data: Mapping[str, Any]) -> RunConfig:
    skipped: list[str] = []
    config = _build(RunConfig, data, "", skipped)
    config.not_checked = tuple(skipped)
    return config


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def _build(cls: type, data: object, prefix: str, skipped: list[str]) -> Any:
    """An instance of ``cls`` from ``data``; the keys it accepts unread are appended to ``skipped``."""
    if not isinstance(data, Mapping):
        raise TightpackError(f"{prefix or 'the config'} must be a mapping, got {_kind(data)}")
    any_key = False
    if _TARGET in data:
        _check_section_target(cls, data[_TARGET], prefix)
        any_key = cls is ModelSection  # a serialized provider: every field of its class (rule 3)
        data = {key: value for key, value in data.items() if key != _TARGET}
    fields = {item.name: item for item in dataclasses.fields(cls) if item.init}
    for key in data:
        if not isinstance(key, str):
            raise TightpackError(f"{prefix or 'the config'} has a non-string key {key!r}")
        message = None if key in fields or any_key else unknown_key_message(cls, key, prefix)
        if message is not None:
            raise TightpackError(message)
    hints = get_type_hints(cls)
    values = {}
    for key, value in data.items():  # in file order, so that ``skipped`` is too
        path = join_path(prefix, key)
        if key not in fields:
            skipped.append(path)
            continue
        values[key] = _convert(value, hints[key], path, skipped)
        check_minimum(values[key], fields[key].metadata.get("minimum"), path)
    for name, item in fields.items():
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        if required and name not in values:
            raise TightpackError(f"missing required key {join_path(prefix, name)}")
    return cls(**values)


def _target_class(value: object, path: str) -> str:
    """The class a ``_target_`` names: the last component of its dotted path."""
    name = value.rsplit(".", 1)[-1] if isinstance(value, str) else ""
    if not name.isidentifier():
        raise TightpackError(
            f"{path} must be a dotted class path (e.g. {GPTSFTDatasetConfig.target}), got {_kind(value)}"
        )
    return name


def _check_section_target(cls: type, value: object, prefix: str) -> None:
    """A section's ``_target_`` must name the Megatron-Bridge class the section is; then it is dropped."""
    path = join_path(prefix, _TARGET)
    name = _target_class(value, path)
    if cls is ModelSection:
        dataset_class = name in DATASET_TYPES or name in DATASET_ALIASES
        if name.endswith(MODEL_TARGET_SUFFIXES) and not dataset_class:
            return
        expected = "a model provider (a class named *Provider or *ModelConfig, e.g. GPTModelProvider)"
    else:
        if name == SECTION_TARGETS[cls]:
            return
        expected = f"Megatron-Bridge's {SECTION_TARGETS[cls]}"
    raise TightpackError(
        f"{path} {value!r} names {name}, but {prefix or 'the top level'} holds {expected}; move the keys to "
        f"their section or remove {path}"
    )


def _build_dataset(data: object, path: str, skipped: list[str]) -> Any:
    if not isinstance(data, Mapping):
        raise TightpackError(f"{path} must be a mapping, got {_kind(data)}")
    for key in data:
        if not isinstance(key, str):
            raise TightpackError(f"{path} has a non-string key {key!r}")
    fields = {key: value for key, value in data.items() if key not in ("type", _TARGET)}
    kind, source = _dataset_kind(data, list(fields), path)
    try:
        dataset = _build(DATASET_TYPES[kind], fields, path, skipped)
    except TightpackError as error:
        if source.startswith("inferred"):
            how = source.replace("inferred", f"inferred as {kind}", 1)
            raise TightpackError(
                f"{error} ({path} type {how}; set {path}.type if you meant another)"
            ) from None
        raise
    dataset.type_source = source
    return dataset


def _dataset_kind(data: Mapping[str, Any], keys: list[str], path: str) -> tuple[str, str]:
    """The dataset kind from ``type``, ``_target_`` or the fields, and how it was chosen (``type_source``)."""
    declared = data.get("type")
    if "type" in data and (not isinstance(declared, str) or declared not in DATASET_TYPES):
        names = ", ".join(DATASET_TYPES)
        close = difflib.get_close_matches(str(declared), DATASET_TYPES, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TightpackError(f"unknown {path}.type {declared!r}; {hint}(one of {names})")
    if _TARGET in data:
        value = data[_TARGET]
        name = _target_class(value, join_path(path, _TARGET))
        target = DATASET_ALIASES.get(name, name)
        if target not in DATASET_TYPES:
            if declared == DatasetProvider.type:
                return declared, f"{path}.type"  # a custom provider names its own class
            raise TightpackError(_unknown_dataset_target_message(value, name, path))
        if "type" in data and declared != target:
            raise TightpackError(
                f"{path}.type {declared!r} and {path}._target_ {value!r} name different dataset types "
                f"({declared}, {target}); keep the one you mean and remove the other"
            )
        return target, f"{path}.type" if "type" in data else f"{path}._target_"
    if "type" in data:
        return declared, f"{path}.type"
    kind, deciding = infer_dataset_kind(keys, path)
    return kind, f"inferred from its fields: {', '.join(deciding)}"


def _unknown_dataset_target_message(value: object, name: str, path: str) -> str:
    head = (
        f"unknown {path}._target_ {value!r}: its class {name} is none of {', '.join(DATASET_TYPES)} "
        f"(or {', '.join(DATASET_ALIASES)})"
    )
    config_name = f"{name}Config"  # the dataset class instead of its configuration
    if config_name in DATASET_TYPES or config_name in DATASET_ALIASES:
        return f"{head}; did you mean {config_name}?"
    return f"{head}; for a custom provider set {path}.type: {DatasetProvider.type}"


def _describe(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if annotation in names:
        return names[annotation]
    if origin is list:
        return f"a list of {_describe(args[0])}"
    return "a mapping"


def _matches(value: object, annotation: Any) -> bool:
    """Whether ``value`` has the right kind for ``annotation`` (the union member to convert with)."""
    origin = get_origin(annotation)
    if annotation is Any:
        return True
    if origin is Literal:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list)
    if origin is dict or dataclasses.is_dataclass(annotation):
        return isinstance(value, Mapping)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is type(None):
        return value is None
    return isinstance(value, annotation)


def _convert(value: object, annotation: Any, path: str, skipped: list[str]) -> Any:
    if annotation == DatasetConfig:
        return _build_dataset(value, path, skipped)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        for member in args:
            if _matches(value, member):
                return _convert(value, member, path, skipped)
        raise TightpackError(f"{path} must be {_describe(annotation)}, got {_kind(value)}")
    if not _matches(value, annotation):
        raise TightpackError(f"{path} must be {_describe(annotation)}, got {_kind(value)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(arg) for arg in args], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TightpackError(f"{path} must be {_describe(annotation)}, got {value!r}{hint}")
        return value
    if origin is list:
        return [_convert(item, args[0], f"{path}[{index}]", skipped) for index, item in enumerate(value)]  # type: ignore[arg-type]
    if origin is dict:
        for key in value:  # type: ignore[union-attr]
            if not isinstance(key, str):
                raise TightpackError(f"{path} keys must be strings, got {key!r}")
        return {key: _convert(item, args[1], join_path(path, key), skipped) for key, item in value.items()}  # type: ignore[union-attr]
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, path, skipped)  # type: ignore[arg-type]
    return float(value) if annotation is float else value  # type: ignore[arg-type]
