"""`shoal node join` without --model serves the embedded default, as `shoal serve` and
the app do: the same settings (model None) and the same resolver (engine.models.loading)
that turn it into the embedded GGUF. `shoal node` (heads dial it) still asks for one."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine import events as ev
from engine.cli import _node, join_settings, serve_settings
from engine.cli.parser import build_parser
from engine.errors import StartError
from engine.models.embedded import EMBEDDED_FILE, EMBEDDED_NAME
from engine.models.loading import Pulls, resolve

GGUF = b"GGUF" + bytes(range(256)) * 16


def _bundle(folder: Path) -> Path:
    """An installed bundle's models folder: the embedded file and its recorded sha256."""
    folder.mkdir(parents=True)
    (folder / EMBEDDED_FILE).write_bytes(GGUF)
    (folder / f"{EMBEDDED_FILE}.sha256").write_text(
        f"{hashlib.sha256(GGUF).hexdigest()}  {EMBEDDED_FILE}\n")
    return folder


def test_join_without_model_takes_the_default_serve_takes(tmp_path: Path):
    parser = build_parser()
    joined = join_settings(parser.parse_args(["node", "join", "127.0.0.1:8454"]), tmp_path,
                           None)
    served = serve_settings(parser.parse_args(["serve"]), tmp_path)
    assert joined.node is not None and served.node is not None
    assert (joined.node.model, joined.node.runtime) == (None, None)
    assert (joined.node.model, joined.node.runtime) == (served.node.model, served.node.runtime)
    assert joined.join is not None and joined.join.head == "127.0.0.1:8454"
    # a model given on either side of the verb still wins
    for argv in (["node", "join", "--model", "org/repo:Q8_0"],
                 ["node", "--model", "org/repo:Q8_0", "join"]):
        node = join_settings(parser.parse_args(argv), tmp_path, None).node
        assert node is not None and node.model == "org/repo:Q8_0"


async def test_that_default_resolves_to_the_embedded_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHOAL_BUNDLED_MODELS", str(_bundle(tmp_path / "bundle")))
    home = tmp_path / "home"
    settings = join_settings(build_parser().parse_args(["node", "join", "--offline"]), home,
                             None)
    assert settings.node is not None
    seen: list[ev.ShoalEvent] = []
    got = await resolve(settings.node.model, settings.node.runtime, home=home,
                        offline=settings.offline, emit=seen.append, pulls=Pulls())
    assert (got.name, got.runtime) == (EMBEDDED_NAME, "llamacpp")
    assert Path(got.path) == home / "models" / "embedded" / EMBEDDED_FILE
    assert Path(got.path).read_bytes() == GGUF


def test_a_node_that_heads_dial_still_asks_for_a_model(tmp_path: Path):
    args = build_parser().parse_args(["node"])
    with pytest.raises(StartError, match="say which model to serve with --model"):
        _node(args, listen=args.listen)
