"""How a node holds its model, from the command line over config.toml to the node's settings
and on to the engine (`shoal serve`, `shoal node`, `shoal node join`): the flags given win,
the file's ``[node]`` stands where they are left out, the defaults where neither says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.cli import join_settings, node_settings, serve_settings
from engine.cli.parser import build_parser
from engine.errors import StartError
from engine.settings import NodeSettings, Settings
from engine.sizes import IDLE_UNLOAD_DEFAULT_S, GiB, Share


def settings(home: Path, *argv: str) -> Settings:
    args = build_parser().parse_args(list(argv))
    if args.command == "serve":
        return serve_settings(args, home)
    if args.node_command == "join":
        return join_settings(args, home, None)
    return node_settings(args, home)


def memory(node: NodeSettings | None) -> tuple[object, str, float | None]:
    assert node is not None
    return node.memory_budget, node.kv_type, node.idle_unload_s


VERBS = [["serve"], ["node", "--model", "m.gguf"], ["node", "join"]]


@pytest.mark.parametrize("verb", VERBS)
def test_without_flags_or_file_the_defaults(tmp_path: Path, verb: list[str]) -> None:
    assert memory(settings(tmp_path, *verb).node) == (None, "f16", IDLE_UNLOAD_DEFAULT_S)
    assert IDLE_UNLOAD_DEFAULT_S == 15 * 60


@pytest.mark.parametrize("verb", VERBS)
def test_the_flags_reach_the_node(tmp_path: Path, verb: list[str]) -> None:
    got = settings(tmp_path, *verb, "--memory-budget", "4096M", "--kv-type", "q8_0",
                   "--idle-unload", "never")
    assert memory(got.node) == (4 * GiB, "q8_0", None)


@pytest.mark.parametrize("verb", VERBS)
def test_the_config_file_stands_where_the_flags_are_left_out(tmp_path: Path,
                                                             verb: list[str]) -> None:
    (tmp_path / "config.toml").write_text(
        '[node]\nmemory_budget = "50%"\nkv_type = "q8_0"\nidle_unload = 5\n')
    assert memory(settings(tmp_path, *verb).node) == (Share(50.0), "q8_0", 300.0)
    got = settings(tmp_path, *verb, "--kv-type", "f16", "--memory-budget", "6G")
    assert memory(got.node) == (6 * GiB, "f16", 300.0)
    got = settings(tmp_path, *verb, "--idle-unload", "0")
    assert memory(got.node) == (Share(50.0), "q8_0", None)


@pytest.mark.parametrize("verb", VERBS)
def test_the_gpu_flag_over_the_file_over_the_default(tmp_path: Path, verb: list[str]) -> None:
    def gpu(*flags: str) -> str:
        node = settings(tmp_path, *verb, *flags).node
        assert node is not None
        return node.gpu

    assert gpu() == "auto"
    assert gpu("--gpu", "Vulkan1") == "Vulkan1"
    (tmp_path / "config.toml").write_text('[node]\ngpu = "off"\n')
    assert gpu() == "off"
    assert gpu("--gpu", "auto") == "auto"


def test_a_head_that_only_dials_nodes_has_no_node_to_hold_a_model(tmp_path: Path) -> None:
    got = settings(tmp_path, "serve", "--fleet", "h:8455", "--memory-budget", "6G")
    assert got.node is None
    got = settings(tmp_path, "serve", "--fleet", "h:8455", "--local-node", "--kv-type", "q8_0")
    assert memory(got.node)[1] == "q8_0"


def test_a_wrong_config_file_is_one_line_at_start(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[node]\nkv_type = "q2"\n')
    with pytest.raises(StartError) as err:
        settings(tmp_path, "node", "join")
    assert str(err.value) == (f"{tmp_path / 'config.toml'}: node.kv_type is 'q2'; use f16 "
                              "or q8_0")


def test_the_budget_kv_type_and_gpu_reach_llama_cpp_and_the_mock_ignores_them(
        caplog: pytest.LogCaptureFixture) -> None:
    from engine.runtimes import registry
    from engine.runtimes.llamacpp import LlamaCppEngine
    from engine.runtimes.mock import MockEngine

    engine = registry.make_engine("llamacpp", "/nowhere/m.gguf", model_name="m",
                                  memory_budget=6 * GiB, kv_type="q8_0",
                                  gpu="Vulkan0")  # not loaded
    assert isinstance(engine, LlamaCppEngine)
    assert (engine.memory_budget_bytes, engine.kv_type, engine.gpu) == (6 * GiB, "q8_0",
                                                                        "Vulkan0")
    default = registry.make_engine("llamacpp", "/nowhere/m.gguf", model_name="m")
    assert isinstance(default, LlamaCppEngine) and default.gpu == "auto"
    mock = registry.make_engine("mock", "m", model_name="m", memory_budget=6 * GiB,
                                kv_type="q8_0", gpu="off")
    assert isinstance(mock, MockEngine)
    assert "--gpu" not in caplog.text  # the mock runs no model: nothing to say


async def test_the_nodes_gpu_reaches_its_engine(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models import loading
    from engine.models.loading import Resolved
    from engine.roles.local_node import LocalNode
    from engine.runtimes import registry

    made: list[str] = []
    make = registry.make_engine

    def spy(*args: Any, gpu: str = "auto", **kw: Any) -> Any:
        made.append(gpu)
        return make(*args, gpu=gpu, **kw)

    monkeypatch.setattr(loading.registry, "make_engine", spy)
    ns = settings(tmp_path, "node", "--model", "m", "--runtime", "mock", "--gpu", "off").node
    assert ns is not None
    node = await LocalNode.start(ns, Resolved("m", "m", "mock"), name="m", psk=None,
                                 discovery="none")
    try:
        assert made == ["off"]
        snap = node.snapshot()
        assert (snap.device, snap.gpu_layers, snap.model_layers) == ("", 0, 0)  # the mock's
    finally:
        await node.close()


async def test_a_share_too_small_for_this_machine_is_refused_at_the_load() -> None:
    from engine.models.loading import Resolved, load_engine

    with pytest.raises(StartError) as err:
        await load_engine(Resolved("m", "m", "mock"), name="m", lanes=1, max_context=None,
                          mock_speed=0.0, memory_budget=Share(0.000001))
    assert "too little for a model and its KV cache" in str(err.value)
    assert err.value.code == "bad_budget"


@pytest.mark.parametrize(("flags", "want"), [
    ((), IDLE_UNLOAD_DEFAULT_S), (("--idle-unload", "1"), 60.0),
    (("--idle-unload", "never"), None),
])
async def test_the_idle_unload_reaches_the_nodes_agent(tmp_path: Path, flags: tuple[str, ...],
                                                       want: float | None) -> None:
    from engine.models.loading import Resolved
    from engine.roles.local_node import LocalNode

    ns = settings(tmp_path, "node", "--model", "m", "--runtime", "mock", *flags).node
    assert ns is not None
    node = await LocalNode.start(ns, Resolved("m", "m", "mock"), name="m", psk=None,
                                 discovery="none")
    try:
        assert node.agent.idle_unload_s == want
    finally:
        await node.close()
