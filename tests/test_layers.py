"""The layers of docs/architecture.md: imports point down only, the core never imports torch, and
an engine of the offline path never imports another."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tightpack"

# The layers each layer may import (besides its own). The offline path (tightpack.offline) and the
# runtime (torch) stand side by side above prepare: neither imports the other.
BELOW = {
    "front": {"offline", "runtime", "prepare", "core"},
    "offline": {"prepare", "core"},
    "runtime": {"prepare", "core"},
    "prepare": {"core"},
    "core": set(),
}
LAYERS = tuple(BELOW)
# the version, the one user-facing exception, the logger
SHARED = {"tightpack", "tightpack.errors", "tightpack.logs"}
ENGINES = "tightpack.offline.engines."
# what every engine shares: the interface, and the table of engines by name
ENGINE_SHARED = {ENGINES + "base", ENGINES.rstrip(".")}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "front"


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def tightpack_imports(path: Path) -> set[str]:
    """Every tightpack module a file imports, at any depth of the file (lazy imports included)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in imported if name.split(".")[0] == "tightpack" and is_module(name)}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


SOURCES = sorted(PACKAGE.rglob("*.py"))


def upward_imports(module: str, imported: set[str]) -> list[str]:
    """The imported modules of a layer ``module`` may not import: above it, or beside it."""
    here = layer_of(module)
    allowed = BELOW[here] | {here}
    return sorted(name for name in imported - SHARED if layer_of(name) not in allowed)


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: module_name(path))
def test_imports_point_down(path):
    module = module_name(path)
    upward = upward_imports(module, tightpack_imports(path))
    assert not upward, f"{module} ({layer_of(module)}) imports a layer above it: {upward}"


def test_an_upward_import_is_seen(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text(
        "def f():\n    from tightpack.offline.pipeline import PackConfig\n    import tightpack.errors\n"
    )
    imported = tightpack_imports(source)
    assert upward_imports("tightpack.core.planner", imported) == ["tightpack.offline.pipeline"]
    assert upward_imports("tightpack.cli", imported) == []


def test_an_import_beside_is_seen(tmp_path):
    source = tmp_path / "beside.py"
    source.write_text("from tightpack.runtime.collate import collate\nfrom tightpack.core import planner\n")
    imported = tightpack_imports(source)
    assert upward_imports("tightpack.offline.pipeline", imported) == ["tightpack.runtime.collate"]
    assert upward_imports("tightpack.cli", imported) == []


def engine_of(module: str) -> str | None:
    """The engine a module of `tightpack.offline.engines` is (``local``, ``ray``), or None."""
    if not module.startswith(ENGINES) or module in ENGINE_SHARED:
        return None
    return module[len(ENGINES) :].split(".")[0]


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: module_name(path))
def test_only_the_table_of_engines_imports_an_engine(path):
    """An engine never imports another, and the pipeline reaches each through the table by name."""
    module = module_name(path)
    engines = {engine_of(name) for name in tightpack_imports(path)} - {None, engine_of(module)}
    if module != ENGINES.rstrip("."):
        assert not engines, f"{module} imports the engine modules {sorted(engines)}"


def test_there_are_two_engines_and_each_is_a_module():
    engines = {engine_of(module_name(path)) for path in SOURCES} - {None}
    assert engines == {"local", "ray"}
    from tightpack.offline.config import Engine
    from tightpack.offline.engines import ENGINES as by_name

    assert set(by_name) == engines == set(get_args(Engine))


def _torch_modules_loaded_by(modules: list[str]) -> str:
    """The torch modules a fresh interpreter holds after importing ``modules`` (``[]`` when none)."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_the_core_and_prepare_never_import_torch():
    modules = [
        module_name(path)
        for path in SOURCES
        if layer_of(module_name(path)) in ("core", "prepare") and path.name != "__init__.py"
    ]
    assert len(modules) > 10
    loaded = _torch_modules_loaded_by(modules)
    assert loaded == "[]", f"importing the core and prepare layers loaded {loaded}"


def test_the_offline_path_never_imports_torch():
    modules = [module_name(path) for path in SOURCES if layer_of(module_name(path)) == "offline"]
    assert "tightpack.offline.engines.ray" in modules and len(modules) > 10
    loaded = _torch_modules_loaded_by(modules)
    assert loaded == "[]", f"importing the offline path loaded {loaded}"
