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
