"""A head has a node of its fleet serve another model (issue 25: each machine pulls its own
model of the split): `Shoal.serve_on` over real links on 127.0.0.1, the node a real `Shoal`
on the mock runtime (its "pull" made slow and counted, below) or a bare agent. The node's
Stats carry its RAM, its disk free and the pull under way, and its model changes at the
head once it serves it."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from engine.errors import CommandError
from engine.link import messages as m
from engine.models.cache import HubId
from engine.node.agent import NO_FLEET_MODELS, NodeAgent
from engine.runtimes import registry
from engine.runtimes.mock import MockEngine
from engine.service import Shoal
from engine.settings import HeadSettings, NodeSettings, Settings
from engine.snapshot import NodeSnapshot, to_json
from tests.integration.test_service import QUIET, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)
CHOSEN = "acme/Chosen-Coder-GGUF:Q4_K_M"
PULL_BYTES = 5000


def head_settings(home: Path) -> Settings:
    return Settings(home=home, discovery=QUIET,
                    head=HeadSettings(model="mock-m", runtime="mock", http="127.0.0.1:0",
                                      fleet_listen="127.0.0.1:0"),
                    node=NodeSettings(model="mock-m", runtime="mock", lanes=1))


def node_settings(home: Path) -> Settings:
    return Settings(home=home, discovery=QUIET,
                    node=NodeSettings(model="mock-m", runtime="mock", lanes=2,
                                      identity="b-node"))


def node_at(head: Shoal, identity: str) -> NodeSnapshot | None:
    return next((n for n in head.snapshot().nodes
                 if n.identity == identity and n.state == "ready"), None)


class SlowPull:
    """The mock runtime's model lookup made a pull of the ids ``held`` (CHOSEN): it reports
    bytes as a hub pull does, half of them, then waits until the test lets it finish; with
    ``fail``, it fails then."""

    def __init__(self, held: Callable[[str], bool] = CHOSEN.__eq__, *,
                 fail: bool = False) -> None:
        self.go = threading.Event()
        self.asked: list[str] = []
        self.held, self.fail = held, fail

    def find(self, spec: str | None, home: Path, offline: bool, progress: object,
             cancel: object) -> registry.ResolvedModel:
        name = spec or "mock"
        if spec is not None and self.held(spec):
            self.asked.append(spec)
            progress("", PULL_BYTES // 2, PULL_BYTES)  # type: ignore[operator]
            if not self.go.wait(30):
                raise registry.RuntimeUnavailable("the test never let the pull finish")
            if self.fail:
                raise registry.RuntimeUnavailable("the test ends this pull here")
        return registry.ResolvedModel(name, name)


def holding(monkeypatch: pytest.MonkeyPatch, pull: SlowPull) -> Iterator[SlowPull]:
    """The mock runtime with ``pull``'s lookup, for a fixture."""
    mock = registry._RUNTIMES["mock"]
    monkeypatch.setitem(registry._RUNTIMES, "mock", dataclasses.replace(mock, find_model=pull.find))
    yield pull
    pull.go.set()  # a failed test does not leave the worker thread waiting


@pytest.fixture
def slow_pull(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowPull]:
    yield from holding(monkeypatch, SlowPull())


@contextlib.asynccontextmanager
async def dialing(tmp_path: Path, agent: NodeAgent) -> AsyncIterator[Shoal]:
    """A head that dials ``agent`` (its sessions as channels of one link)."""
    _host, port = await agent.listen("127.0.0.1", 0)
    settings = dataclasses.replace(head_settings(tmp_path / "a"), head=HeadSettings(
        model="mock-m", runtime="mock", http="127.0.0.1:0", fleet=(f"127.0.0.1:{port}",)))
    try:
        async with running(settings) as a:
            yield a
    finally:
        await agent.close()


async def joined_fleet(a: Shoal, b: Shoal) -> NodeSnapshot:
    pairing = await a.create_fleet("desk")
    host, port = a.fleet_address  # type: ignore[misc]
    pairing = await a.pairing(head=f"{host}:{port}")
    await b.join(pairing.url)
    return await until(lambda: node_at(a, "b-node"), "b's node ready at a's head")


async def test_a_head_has_a_joined_node_pull_and_serve_another_model(tmp_path: Path,
                                                                     slow_pull: SlowPull):
    async with running(head_settings(tmp_path / "a")) as a, \
            running(node_settings(tmp_path / "b")) as b:
        seen = await joined_fleet(a, b)
        # what a fit estimate needs of b's machine reaches a's head
        facts = await until(lambda: (n := node_at(a, "b-node")) is not None and n.disk_free
                            and n, "b's disk free at a")
        assert facts.ram_total == b.memory.total > 0
        assert facts.device_kind == "" and facts.device_total == 0  # the mock: no GPU
        assert facts.pull_model == "" and seen.key == "joined:b-node"
        local = b.snapshot().roles.node
        assert local is not None and local.ram_total == b.memory.total
        assert local.disk_free > 0

        line = await a.serve_on(seen.key, CHOSEN)
        assert line.startswith(f"pulling {CHOSEN}")
        # the pull under way shows at the head, in the snapshot and in /v1/fleet
        pulling = await until(lambda: (n := node_at(a, "b-node")) is not None
                              and n.pull_model == CHOSEN and n, "b's pull at a")
        assert (pulling.pull_done, pulling.pull_total) == (PULL_BYTES // 2, PULL_BYTES)
        assert pulling.model == "mock-m"  # still serving the old one meanwhile
        [row] = [n for n in to_json(a.snapshot())["nodes"] if n["identity"] == "b-node"]
        assert row["pull_model"] == CHOSEN and row["ram_total"] == b.memory.total
        assert slow_pull.asked == [CHOSEN]
        # a name from the link is a hub id, never a path on b's machine
        assert all(isinstance(spec, HubId) for spec in slow_pull.asked)
        # asked again while it switches: refused with why
        with pytest.raises(CommandError) as busy:
            await a.serve_on(seen.key, "acme/Other-GGUF:Q8_0")
        assert busy.value.code == "node_refused" and "switching to" in str(busy.value)

        slow_pull.go.set()
        served = await until(lambda: (n := node_at(a, "b-node")) is not None
                             and n.model == CHOSEN and n, "b serving the chosen model at a",
                             timeout=30)
        assert served.pull_model == ""
        assert b.snapshot().roles.node is not None
        assert b.snapshot().roles.node.model == CHOSEN
        assert b.settings.node is not None and b.settings.node.model == CHOSEN
        # the same model again: nothing to do
        assert (await a.serve_on(seen.key, CHOSEN)) == f"serves {CHOSEN} already"


async def test_a_node_whose_user_keeps_its_model_refuses(tmp_path: Path):
    async with running(head_settings(tmp_path / "a")) as a, \
            running(node_settings(tmp_path / "b")) as b:
        seen = await joined_fleet(a, b)
        await b.update_settings(fleet_may_choose_model=False)
        assert b.pending.node is not None and not b.pending.node.fleet_may_choose_model
        with pytest.raises(CommandError) as err:
            await a.serve_on(seen.key, CHOSEN)
        assert err.value.code == "node_refused"
        assert str(err.value).startswith(f"b-node refused to serve {CHOSEN}: this machine "
                                         "keeps the model its user chose")
        assert b.snapshot().roles.node is not None
        assert b.snapshot().roles.node.model == "mock-m"


async def test_unknown_nodes_paths_and_a_node_without_a_chooser(tmp_path: Path):
    # a bare agent, with no owner to hand a model to
    agent = NodeAgent(MockEngine(model="mock-m", lanes=1), identity="bare", psk=None)
    async with dialing(tmp_path, agent) as a:
        bare = await until(lambda: node_at(a, "bare"), "the bare agent ready")
        assert bare.ram_total == 0  # its owner said nothing of the machine
        with pytest.raises(CommandError) as err:
            await a.serve_on(bare.key, CHOSEN)
        assert err.value.code == "node_refused"
        assert str(err.value) == f"bare refused to serve {CHOSEN}: {NO_FLEET_MODELS}"
        with pytest.raises(CommandError) as err:
            await a.serve_on("joined:nobody", CHOSEN)
        assert err.value.code == "node_unknown" and "no node 'joined:nobody'" in str(
            err.value)
        for path in ("/models/x.gguf", "acme/repo/file.gguf", "not an id"):
            with pytest.raises(CommandError) as err:
                await a.serve_on(bare.key, path)
            assert err.value.code == "bad_model" and "org/repo:QUANT" in str(err.value)
        # this machine's own node switches as set_model does
        assert await a.serve_on("local", "mock-b") == "this machine serves mock-b"
        assert a.snapshot().roles.node is not None
        assert a.snapshot().roles.node.model == "mock-b"


async def test_a_head_without_the_api_has_no_fleet_node_to_ask(tmp_path: Path):
    async with running(node_settings(tmp_path / "b")) as b:
        with pytest.raises(CommandError) as err:
            await b.serve_on("joined:x", CHOSEN)
        assert err.value.code == "no_head"


class OlderAgent(NodeAgent):
    """A node from before ServeModel: its hello does not say it takes models."""

    def _hello(self) -> m.NodeHello:
        return msgspec.structs.replace(super()._hello(), takes_models=False)


async def test_an_older_node_is_not_asked(tmp_path: Path):
    async def would_pull(spec: str, split_with: tuple[str, ...]) -> tuple[bool, str]:
        return True, "would have pulled it"

    agent = OlderAgent(MockEngine(model="mock-m", lanes=1), identity="old", psk=None,
                       serve_model=would_pull)
    async with dialing(tmp_path, agent) as a:
        old = await until(lambda: node_at(a, "old"), "the older node ready")
        with pytest.raises(CommandError) as err:
            await a.serve_on(old.key, CHOSEN)
        assert err.value.code == "node_too_old" and "update Shoal there" in str(err.value)
        assert node_at(a, "old") is not None  # its link is up: nothing was sent to it
