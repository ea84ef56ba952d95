"""The layers of docs/architecture.md: imports point down only, and the core never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tightpack"

# Each layer may import the layers after it in this list, never those before it.
LAYERS = ("front", "runtime", "prepare", "core")
SHARED = {"tightpack", "tightpack.errors", "tightpack.logs"}  # the version, the one user-facing exception, the logger


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
    here = LAYERS.index(layer_of(module))
    return sorted(name for name in imported - SHARED if LAYERS.index(layer_of(name)) < here)


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: module_name(path))
def test_imports_point_down(path):
    module = module_name(path)
    upward = upward_imports(module, tightpack_imports(path))
    assert not upward, f"{module} ({layer_of(module)}) imports a layer above it: {upward}"


def test_an_upward_import_is_seen(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text(
        "def f():\n    from tightpack.pipeline import PackConfig\n    import tightpack.errors\n"
    )
    imported = tightpack_imports(source)
    assert upward_imports("tightpack.core.planner", imported) == ["tightpack.pipeline"]
    assert upward_imports("tightpack.cli", imported) == []


def test_the_core_and_prepare_never_import_torch():
    modules = [
        module_name(path)
        for path in SOURCES
        if layer_of(module_name(path)) in ("core", "prepare") and path.name != "__init__.py"
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert len(modules) > 10
    assert result.stdout.strip() == "[]", f"importing the core and prepare layers loaded {result.stdout}"
