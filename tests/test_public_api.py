"""The supported Python API is what the docs' API reference shows (docs/reference/*.md); the rest is
internal. Every documented name imports; every name the docs' examples import is documented; and a module
declares ``__all__`` only for documented names, so ``__all__`` never makes an internal name look public."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.test_docs_examples import Block, doc_pages, parse_page

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tightpack"
DIRECTIVE = re.compile(r"^::: (tightpack[\w.]*)\s*$", re.M)


def documented_targets() -> list[str]:
    """The dotted paths of the reference pages' ``:::`` directives, in page order."""
    return [
        target
        for page in sorted((ROOT / "docs" / "reference").glob("*.md"))
        for target in DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    ]


def resolve(target: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        return value
    raise ImportError(target)


def _module_names(module: object) -> set[str]:
    """What a documented module's page shows: its ``__all__``."""
    return set(getattr(module, "__all__", ()))


def documented() -> tuple[set[int], set[str]]:
    """The ids of every documented object, and the documented modules' names."""
    objects, modules = set(), {"tightpack"}  # the package root's __all__ is its API
    for target in ["tightpack", *documented_targets()]:
        value = resolve(target)
        objects.add(id(value))
        if isinstance(value, type(importlib)):
            modules.add(value.__name__)
            objects.update(id(getattr(value, name)) for name in _module_names(value))
    return objects, modules


def _is_documented(module_name: str, name: str | None, objects: set[int], modules: set[str]) -> bool:
    value = importlib.import_module(module_name)
    if name is None:
        return module_name in modules
    if not hasattr(value, name):  # a submodule imported by name
        try:
            value = importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError:
            return False
        return value.__name__ in modules
    value = getattr(value, name)
    if isinstance(value, type(importlib)):
        return value.__name__ in modules
    return id(value) in objects


@pytest.mark.parametrize("target", documented_targets())
def test_every_documented_name_imports(target):
    value = resolve(target)
    assert value is not None
    assert getattr(value, "__doc__", None), f"{target} has no docstring for its reference entry"


def _example_imports() -> list[tuple[str, int, str, str | None]]:
    """(page, line, module, name) of every tightpack import in the visible python blocks of the docs."""
    found = []
    for page in doc_pages():
        for item in parse_page((ROOT / page).read_text(encoding="utf-8"), page):
            if not isinstance(item, Block) or item.language != "python":
                continue
            for node in ast.walk(ast.parse(item.body)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tightpack"):
                    found += [(page, item.line + node.lineno, node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    found += [
                        (page, item.line + node.lineno, a.name, None)
                        for a in node.names
                        if a.name.startswith("tightpack")
                    ]
    return found


def test_the_docs_examples_import_only_documented_names():
    objects, modules = documented()
    imports = _example_imports()
    missing = [
        f"{page}:{line}: {module}{'.' + name if name else ''}"
        for page, line, module, name in imports
        if not _is_documented(module, name, objects, modules)
    ]
    assert len(imports) > 40  # the examples were read
    assert not missing, "add these to docs/reference/ or import a documented name:\n" + "\n".join(missing)


def _declared_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def _module_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def test_only_public_names_are_declared_in_all():
    objects, modules = documented()
    shims = {path for path in PACKAGE.glob("*.py") if "tightpack._moved import forward" in path.read_text()}
    undocumented = [
        f"{_module_of(path)}.{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in shims and path.name != "_moved.py"
        for name in _declared_all(path) or ()
        if not _is_documented(_module_of(path), name, objects, modules)
    ]
    assert not undocumented, "document these in docs/reference/ or drop them from __all__:\n" + "\n".join(
        undocumented
    )


def test_the_check_fails_for_an_undocumented_name():
    objects, modules = documented()
    assert _is_documented("tightpack.runtime.collate", "PackedCollate", objects, modules)
    assert not _is_documented("tightpack.core.planner", "MAX_PACK_SIZE", objects, modules)
    assert not _is_documented("tightpack.core", None, objects, modules)
