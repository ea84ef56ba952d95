"""Old import paths keep working for one release: each gives the new object, with a DeprecationWarning
that names the new path."""

from __future__ import annotations

import importlib
import sys

import pytest

# (old module, new module, a name both give)
MOVED_MODULES = [
    ("tightpack.packed_summary", "tightpack.reports.summary", "summarize_packed"),
    ("tightpack.pack_sizes", "tightpack.reports.pack_sizes", "compare_pack_sizes"),
    ("tightpack.pack_size_rows", "tightpack.reports.pack_size_rows", "PackSizeRow"),
    ("tightpack.plots", "tightpack.reports.plots", "write_html_report"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED_MODULES, ids=[row[0] for row in MOVED_MODULES])
def test_an_old_module_path_warns_and_gives_the_new_object(old, new, name):
    sys.modules.pop(old, None)  # import it afresh: a shim may warn when imported
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: import from {new}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


# (module, old name, new name)
RENAMED = [
    ("tightpack.config", "TrainingConfig", "RunConfig"),
    ("tightpack.config", "TrainConfig", "TrainSection"),
    ("tightpack.config", "ModelConfig", "ModelSection"),
    ("tightpack.config", "DDPConfig", "DDPSection"),
    ("tightpack.config", "ValidationConfig", "ValidationSection"),
    ("tightpack.config", "DistConfig", "DistSection"),
    ("tightpack.config", "CommOverlapConfig", "CommOverlapSection"),
    ("tightpack.config", "DistTrainConfig", "DistTrainSection"),
    ("tightpack.config.schema", "TrainingConfig", "RunConfig"),
    ("tightpack.config.schema", "TrainConfig", "TrainSection"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED, ids=[f"{row[0]}.{row[1]}" for row in RENAMED])
def test_an_old_name_warns_and_gives_the_new_object(module, old, new):
    imported = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use {module}\.{new}"):
        value = getattr(imported, old)
    assert value is getattr(imported, new)


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchConfig'"):
        importlib.import_module("tightpack.config").NoSuchConfig  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'no_such_function'"):
        importlib.import_module("tightpack.plots").no_such_function  # noqa: B018
