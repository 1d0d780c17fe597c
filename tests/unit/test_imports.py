"""Import rules inside the engine: arrows point down, route modules stand alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def modules_under(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize("lower", ["engine.head", "engine.node", "engine.link"])
def test_lower_layers_never_import_the_api(lower: str) -> None:
    paths = modules_under(lower)
    assert paths
    offenders = {str(p.relative_to(ROOT)): sorted(i for i in imports_of(p)
                                                   if i.startswith("engine.api"))
                 for p in paths}
    assert {p: found for p, found in offenders.items() if found} == {}


def test_imports_of_sees_function_level_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from engine.api.openai import HEAD\n")
    assert "engine.api.openai" in imports_of(probe)


ROUTES = ("engine.api.openai", "engine.api.completions", "engine.api.ollama")


def module_path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def names_any(imports: set[str], modules: set[str]) -> set[str]:
    return {i for i in imports if any(i == m or i.startswith(m + ".") for m in modules)}


@pytest.mark.parametrize("route", ROUTES)
def test_route_modules_do_not_import_each_other(route: str) -> None:
    others = set(ROUTES) - {route}
    assert names_any(imports_of(module_path(route)), others) == set()


def test_only_the_app_imports_the_route_modules() -> None:
    importers = {str(p.relative_to(ROOT)) for p in modules_under("engine")
                 if names_any(imports_of(p), set(ROUTES))
                 and str(p.relative_to(ROOT)) != "engine/api/app.py"}
    assert importers == set()


def test_names_any_catches_a_route_imported_by_package(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from engine.api import ollama\n")
    assert names_any(imports_of(probe), set(ROUTES)) == {"engine.api.ollama"}
