"""Which llama-server scripts/lib/llama_server.py takes or builds: the wheel's kept CMake tree
is used only when it is whole and its tools are still there, a server already built is
found before anything compiles, and the tree goes once a server exists. The builds
themselves run in scripts/test on a fresh machine (docs/benchmarks.md, "The suite")."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.lib import llama_server as ls

VERSION = "0.3.36"


def _tool(path: Path) -> Path:
    """An executable that answers ``--version`` (what ``works`` asks of a server)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def _tree(root: Path, *, version: str = VERSION, cmake: Path | None = None,
          make: Path | None = None) -> Path:
    tree = root / "portable-abc.tree"
    (tree / "build").mkdir(parents=True)
    (tree / "VERSION").write_text(version + "\n")
    (tree / "build" / "CMakeCache.txt").write_text(
        f"CMAKE_COMMAND:INTERNAL={cmake or root / 'gone' / 'cmake'}\n"
        f"CMAKE_MAKE_PROGRAM:UNINITIALIZED={make or root / 'gone' / 'ninja'}\n")
    return tree


def test_a_whole_tree_gives_the_cmake_and_generator_it_was_configured_with(tmp_path):
    cmake, ninja = _tool(tmp_path / "bin" / "cmake"), _tool(tmp_path / "bin" / "ninja")
    tree = _tree(tmp_path, cmake=cmake, make=ninja)
    assert ls._tree_tools(tree, VERSION) == (str(cmake), str(ninja))


def test_a_tree_of_another_version_or_without_its_tools_is_not_used(tmp_path):
    cmake, ninja = _tool(tmp_path / "bin" / "cmake"), _tool(tmp_path / "bin" / "ninja")
    assert ls._tree_tools(_tree(tmp_path / "a", version="0.3.35", cmake=cmake, make=ninja),
                          VERSION) is None
    # pip ran cmake from a build environment it has deleted since
    assert ls._tree_tools(_tree(tmp_path / "b", make=ninja), VERSION) is None
    assert ls._tree_tools(_tree(tmp_path / "c", cmake=cmake), VERSION) is None
    assert ls._tree_tools(tmp_path / "none", VERSION) is None


@pytest.mark.parametrize("built", ["static", "portable"])
def test_a_server_already_built_is_taken_and_the_tree_is_dropped(tmp_path, monkeypatch, built):
    root = tmp_path / "servers"
    binary = ls.binary_path(VERSION, root) if built == "static" \
        else ls.portable_path(VERSION, root)
    _tool(binary)
    tree = _tree(tmp_path, cmake=_tool(tmp_path / "bin" / "cmake"),
                 make=_tool(tmp_path / "bin" / "ninja"))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing should be built")

    monkeypatch.setattr(ls, "build_over_tree", no_build)
    monkeypatch.setattr(ls, "_build_static", no_build)
    found = ls.ensure_llama_server(version=VERSION, root=root, tree=tree, say=lambda _: None)
    assert found == binary
    assert not tree.exists()


def test_the_static_build_is_found_before_the_portable_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_LLAMA_SERVER_CACHE", str(tmp_path))
    monkeypatch.setattr(ls, "installed_version", lambda: VERSION)
    assert ls.find_llama_server() is None
    portable = _tool(ls.portable_path(VERSION))
    assert ls.find_llama_server() == portable
    static = _tool(ls.binary_path(VERSION))
    assert ls.find_llama_server() == static
