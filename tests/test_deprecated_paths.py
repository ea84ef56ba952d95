"""Old import paths of moved modules keep working: each warns with the new path and gives the same
objects; no code of this repository imports an old path; the package root never warns."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layers import tightpack_imports

ROOT = Path(__file__).resolve().parents[1]

# (old module, new module, a name the old module gives from the new one)
MOVED = [
    ("tightpack.pipeline", "tightpack.offline.pipeline", "pack_dataset"),
    ("tightpack.pipeline", "tightpack.offline.pipeline", "plan_kept"),
    ("tightpack.pack_config", "tightpack.offline.config", "PackConfig"),
    ("tightpack.pack_config", "tightpack.offline.config", "Engine"),
    ("tightpack.pack_output", "tightpack.offline.output", "build_manifest"),
    ("tightpack.sample_accounting", "tightpack.offline.accounting", "account_samples"),
    ("tightpack.output_folder", "tightpack.offline.output_folder", "publish"),
    ("tightpack.output_folder", "tightpack.offline.output_lock", "output_lock"),
    ("tightpack.store_reuse", "tightpack.offline.store_reuse", "tokenize_reusing_store"),
    ("tightpack.pack_flags", "tightpack.offline.pack_flags", "SETTING_FLAGS"),
    ("tightpack.ray_engine", "tightpack.offline.engines.ray", "ray_cluster"),
    ("tightpack.packed_summary", "tightpack.reports.summary", "summarize_packed"),
    ("tightpack.pack_sizes", "tightpack.reports.pack_sizes", "compare_pack_sizes"),
    ("tightpack.pack_size_rows", "tightpack.reports.pack_size_rows", "PackSizeRow"),
    ("tightpack.plots", "tightpack.reports.plots", "write_html_report"),
]
OLD = sorted({old for old, _, _ in MOVED})


@pytest.mark.parametrize(("old", "new", "name"), MOVED, ids=[f"{old}.{name}" for old, _, name in MOVED])
def test_an_old_path_warns_and_gives_the_new_objects(old, new, name, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported anew, so it warns again
    with pytest.warns(DeprecationWarning, match=re.escape(old) + ".*" + re.escape(new)):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("old", OLD)
def test_an_old_path_names_the_new_one_for_a_missing_name(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module(old)
    with pytest.raises(AttributeError, match="moved to tightpack"):
        module.no_such_name  # noqa: B018


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


def test_an_unknown_config_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchConfig'"):
        importlib.import_module("tightpack.config").NoSuchConfig  # noqa: B018


def _shim_path(module: str) -> Path:
    return ROOT / "src" / Path(*module.split(".")).with_suffix(".py")


def test_no_code_here_imports_an_old_path():
    shims = {_shim_path(old) for old in OLD}
    files = [
        path
        for folder in ("src", "tests", "benchmarks", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path not in shims
    ]
    found = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in tightpack_imports(path)
        if name in OLD
    }
    assert len(files) > 100
    assert not found, sorted(found)


def test_the_package_root_and_the_command_line_never_warn():
    code = (
        "import tightpack.cli, tightpack.offline.pipeline, tightpack.offline.engines.ray\n"
        "from tightpack import PackConfig, PackResult, pack_dataset\n"
        "from tightpack.offline import PackConfig, pack_dataset\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_the_warning_points_at_the_importer(tmp_path):
    script = tmp_path / "old_user.py"
    script.write_text("from tightpack.pipeline import pack_dataset\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert f"{script}:1: DeprecationWarning: tightpack.pipeline is deprecated" in result.stderr
    assert "tightpack.offline.pipeline" in result.stderr
