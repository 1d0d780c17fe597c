"""The `Shoal` object driven in process: roles started from Settings and changed at run
time, snapshots, events, commands, and a clean stop. Mock runtime, real sockets on
127.0.0.1, every test under the loop-lag probe and the leak check (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from engine import events as ev
from engine.errors import CommandError, JoinError, ShoalError, StartError
from engine.service import Shoal
from engine.settings import (
    DiscoverySettings,
    HeadSettings,
    JoinSettings,
    NodeSettings,
    Settings,
)
from engine.snapshot import to_json
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
QUIET = DiscoverySettings(mode="none")


def both(home: Path, **head: object) -> Settings:
    """A head with its local node (what `shoal serve` and the app run), mock model."""
    return Settings(home=home, discovery=QUIET,
                    head=HeadSettings(model="mock-m", runtime="mock", http="127.0.0.1:0",
                                      **head),  # type: ignore[arg-type]
                    node=NodeSettings(model="mock-m", runtime="mock", lanes=2,
                                      mock_speed=200.0))


@contextlib.asynccontextmanager
async def running(settings: Settings, *, drain: float = 1) -> AsyncIterator[Shoal]:
    shoal = await Shoal.start(settings)
    try:
        yield shoal
    finally:
        await shoal.stop(drain=drain)


async def ready(shoal: Shoal, count: int = 1) -> None:
    await until(lambda: shoal.snapshot().ready_nodes >= count, f"{count} node(s) ready")


async def chat(shoal: Shoal, *, max_tokens: int = 5, path: str = "/v1/chat/completions",
               model: str = "mock-m", **kw: object) -> tuple[int, dict]:
    assert shoal.api_url is not None
    base = shoal.api_url.removesuffix("/v1")
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "seed": 3, **kw}
    async with aiohttp.ClientSession() as http, http.post(base + path, json=body) as r:
        return r.status, await r.json()


async def test_start_serve_answer_and_stop(tmp_path: Path):
    events = None
    async with running(both(tmp_path)) as shoal:
        events = shoal.events()
        await ready(shoal)
        snap = shoal.snapshot()
        assert snap.roles.head and snap.roles.api_url == shoal.api_url
        assert snap.roles.node is not None and snap.roles.node.state == "serving"
        assert snap.model == "mock-m" and snap.lanes == 2
        [node] = snap.nodes
        assert node.key == "local" and node.link == "local" and node.state == "ready"
        status, body = await chat(shoal)
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        finished = None
        while finished is None:
            event = await asyncio.wait_for(events.get(), 5)
            if isinstance(event, ev.SessionFinished):
                finished = event
        assert finished.model == "mock-m" and finished.completion_tokens == 5
        assert finished.error is None and finished.node == node.identity
        assert finished.ttft_ms > 0 and finished.duration_ms >= finished.ttft_ms
        # /v1/fleet renders the same snapshot
        base = shoal.api_url.removesuffix("/v1")  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as http, http.get(base + "/v1/fleet") as r:
            fleet = await r.json()
        assert fleet["nodes"][0]["key"] == "local" and fleet["roles"]["head"] is True
        assert set(fleet) >= set(to_json(shoal.snapshot()))
    # the bus ended with the Shoal: a reader sees the end, not a hang
    assert events is not None
    with pytest.raises(StopAsyncIteration):
        while True:
            await asyncio.wait_for(events.__anext__(), 5)


async def test_a_port_in_use_fails_before_any_model_loads(tmp_path: Path):
    async with running(both(tmp_path)) as first:
        taken = first.api_url.split(":")[-1].split("/")[0]  # type: ignore[union-attr]
        settings = replace(both(tmp_path), head=replace(
            both(tmp_path).head, http=f"127.0.0.1:{taken}"))  # type: ignore[arg-type]
        with pytest.raises(StartError) as err:
            await Shoal.start(settings)
        assert err.value.code == "port_in_use" and "in use" in str(err.value)


async def test_a_failed_start_can_start_again_on_fixed_settings(tmp_path: Path):
    async with running(both(tmp_path)) as first:
        taken = first.api_url.split(":")[-1].split("/")[0]  # type: ignore[union-attr]
        held = replace(both(tmp_path), head=replace(
            both(tmp_path).head, http=f"127.0.0.1:{taken}"))  # type: ignore[arg-type]
        shoal = Shoal(held)
        events = shoal.events()
        try:
            with pytest.raises(StartError):
                await shoal.open()
            assert shoal.api_url is None and shoal.snapshot().roles.node is None
            await shoal.open(both(tmp_path))  # another port: it starts, its bus still open
            await ready(shoal)
            assert (await chat(shoal))[0] == 200
            role = await asyncio.wait_for(events.get(), 5)
            assert isinstance(role, ev.RolesChanged) and role.head
            with pytest.raises(CommandError):
                await shoal.open()  # once running, not twice
        finally:
            events.close()
            await shoal.stop(drain=0)


async def test_head_on_and_off_at_run_time(tmp_path: Path):
    settings = Settings(home=tmp_path, discovery=QUIET,
                        node=NodeSettings(model="mock-m", runtime="mock", lanes=2))
    async with running(settings) as shoal:
        assert shoal.api_url is None and not shoal.snapshot().roles.head
        with pytest.raises(CommandError):
            _ = shoal.aliases
        events = shoal.events()
        await shoal.set_head(True)
        role = await asyncio.wait_for(events.get(), 5)
        assert isinstance(role, ev.RolesChanged) and role.head
        await ready(shoal)
        assert (await chat(shoal))[0] == 200
        url = shoal.api_url
        await shoal.set_head(False)
        assert shoal.api_url is None and shoal.snapshot().roles.head is False
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as http, http.get(url + "/models") as r:
                await r.read()
        events.close()


async def test_pause_and_resume_serving(tmp_path: Path):
    """A paused node is "paused" everywhere, its lanes counted neither free nor busy, and
    a fleet of nothing but paused nodes answers at once with why (a 30 s queue and
    keepalives that never commit: once, it waited the queue out and answered 200/429)."""
    async with running(both(tmp_path, queue_timeout_s=30.0, keepalive_s=30.0)) as shoal:
        await ready(shoal)
        await shoal.pause_serving(True)
        assert shoal.snapshot().roles.node.state == "paused"  # type: ignore[union-attr]
        node = await until(lambda: (n := shoal.snapshot().nodes[0]).state == "paused" and n,
                           "the head to see the node paused")
        assert node.lanes_busy == 0 and shoal.snapshot().ready_nodes == 0
        status, body = await chat(shoal)
        assert status == 503 and body["error"]["code"] == "fleet_paused", body
        assert "is paused" in body["error"]["message"]
        assert shoal.api_url is not None
        async with aiohttp.ClientSession() as http, \
                http.get(shoal.api_url.removesuffix("/v1") + "/v1/fleet") as r:
            assert [n["state"] for n in (await r.json())["nodes"]] == ["paused"]
        await shoal.pause_serving(False)
        await until(lambda: shoal.snapshot().nodes[0].state == "ready", "the node back")
        assert (await chat(shoal))[0] == 200


async def test_the_fleet_name_kept_beside_the_token_wins_over_an_older_config(tmp_path: Path):
    """Four keepers of the fleet's name once disagreed: a config.toml written before a
    rename (by the CLI, say) brought the old name back at the next start."""
    async with running(both(tmp_path)) as shoal:
        await shoal.create_fleet("desk")
    (tmp_path / "config.toml").write_text('[fleet]\nname = "old name"\n')
    from engine.config import machine_settings

    settings, _ = machine_settings(tmp_path, both(tmp_path))
    assert settings.fleet_name == "old name"  # what an older config.toml says
    async with running(settings) as again:
        assert again.snapshot().fleet_name == "desk"


async def test_aliases_through_the_commands(tmp_path: Path):
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        events = shoal.events()
        change = await shoal.aliases.set("coder", "mock-m")
        assert change.line == "coder -> mock-m (ver 1): 1/1 heads"
        got = await asyncio.wait_for(events.get(), 5)
        assert isinstance(got, ev.AliasChanged) and got.name == "coder" and got.version == 1
        [row] = shoal.snapshot().aliases
        assert row.name == "coder" and row.resolves_to == "mock-m" and row.state == "ok"
        assert (await chat(shoal, model="coder"))[0] == 200
        with pytest.raises(CommandError) as err:
            await shoal.aliases.set("mock-m", "x")
        assert err.value.code == "alias_shadowed"
        removed = await shoal.aliases.remove("coder")
        assert removed.entry.target is None and shoal.snapshot().aliases == ()
        # saved off the loop, where the next start reads it
        assert '"coder"' in (tmp_path / "aliases.json").read_text()
        events.close()


async def test_keys_issued_reach_the_running_head(tmp_path: Path):
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        assert (await chat(shoal))[0] == 200
        key = await shoal.keys.issue("alice")
        base = shoal.api_url.removesuffix("/v1")  # type: ignore[union-attr]

        async def status(token: str | None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with aiohttp.ClientSession() as http, \
                    http.get(base + "/v1/models", headers=headers) as r:
                return r.status

        await until(lambda: _eq(status(None), 401), "keys to switch on")
        assert await status(key) == 200
        assert await shoal.keys.revoke("alice") is True
        await until(lambda: _eq(status(key), 401), "the revocation to reach the head")


async def _eq(value: object, expected: object) -> bool:
    return await value == expected  # type: ignore[misc]


async def test_a_slow_subscriber_loses_old_events_and_never_stalls(tmp_path: Path):
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        slow = shoal.events(buffer=3)
        for i in range(10):
            assert (await chat(shoal, max_tokens=2 + i % 3))[0] == 200
        first = await asyncio.wait_for(slow.get(), 5)
        assert isinstance(first, ev.Dropped) and first.count > 0
        rest = []
        while (e := slow.get_nowait()) is not None:
            rest.append(e)
        assert len(rest) == 3
        slow.close()


async def test_pairing_then_a_second_shoal_joins_and_leaves(tmp_path: Path):
    a_settings = both(tmp_path / "a", fleet_listen="127.0.0.1:0")
    async with running(a_settings) as a:
        await ready(a)
        with pytest.raises(CommandError):
            await a.pairing()  # no token yet
        host, port = a.fleet_address  # type: ignore[misc]
        pairing = await a.create_fleet("desk")
        assert a.snapshot().has_token and a.snapshot().fleet_name == "desk"
        pairing = await a.pairing(head=f"{host}:{port}")
        assert pairing.url.startswith("shoal://join?") and pairing.png[:4] == b"\x89PNG"
        assert pairing.fleet == "desk" and "\u2580" in pairing.text
        # b: a node of its own, joining a's head with the code
        b_settings = Settings(home=tmp_path / "b", discovery=QUIET,
                              node=NodeSettings(model="mock-m", runtime="mock", lanes=2,
                                                identity="b-node"))
        async with running(b_settings) as b:
            joined = await b.join(pairing.url)
            assert joined.fleet == "desk" and joined.model == "mock-m"
            assert b.snapshot().roles.member and b.snapshot().fleet_name == "desk"
            await until(lambda: any(n.identity == "b-node" and n.state == "ready"
                                    for n in a.snapshot().nodes), "b's node in a's fleet")
            status, body = await chat(a, path="/v1/chat/completions?host=b-node")
            assert status == 200 and body["usage"]["completion_tokens"] == 5
            done = await b.leave()
            assert done and "closed the links" in done[0]
            await until(lambda: all(n.identity != "b-node" or n.state == "left"
                                    for n in a.snapshot().nodes), "b's node to leave")


async def test_a_wrong_join_code_says_what_is_wrong(tmp_path: Path):
    settings = Settings(home=tmp_path, discovery=QUIET,
                        node=NodeSettings(model="m", runtime="mock", lanes=1))
    bad = "5e" * 31 + "zz"  # a token that looks real, its last two characters mistyped
    async with running(settings) as shoal:
        with pytest.raises(JoinError) as err:
            await shoal.join(f"shoal://join?head=127.0.0.1:9&token={bad}&fleet=x")
        assert err.value.code == "bad_join_code" and "token" in str(err.value)
        assert "not 64 hex characters" in str(err.value)  # the cause, and not the token:
        assert not any(bad[i:i + 6] in str(err.value) for i in range(len(bad) - 5))
        assert not shoal.snapshot().roles.member


async def test_join_at_start_refuses_a_head_of_another_fleet(tmp_path: Path):
    async with running(both(tmp_path / "a", fleet_listen="127.0.0.1:0")) as a:
        await a.create_fleet("a-fleet")
        host, port = a.fleet_address  # type: ignore[misc]
        other = await Shoal.start(Settings(home=tmp_path / "c", discovery=QUIET))
        stranger = (await other.fleet_token()).hex()
        await other.stop()
        code = f"shoal://join?head={host}:{port}&token={stranger}&fleet=x"
        settings = Settings(home=tmp_path / "b", discovery=QUIET,
                            node=NodeSettings(model="m", runtime="mock", lanes=1),
                            join=JoinSettings(code=code))
        with pytest.raises(JoinError) as err:
            await Shoal.start(settings)
        assert "refused this node's fleet token" in str(err.value)
        assert stranger not in str(err.value)


async def test_set_model_moves_head_and_node_over(tmp_path: Path):
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        name = await shoal.set_model("mock-b", runtime="mock")
        assert name == "mock-b"
        await until(lambda: any(n.model == "mock-b" and n.state == "ready"
                                for n in shoal.snapshot().nodes), "the new model served")
        assert shoal.snapshot().model == "mock-b"
        assert (await chat(shoal, model="mock-b"))[0] == 200
        assert (await chat(shoal, model="mock-m"))[0] == 404


async def test_a_model_that_fails_to_load_leaves_the_old_one_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """ServeModel is on by default: a failed load once left the machine with no API and no
    node, and the bad name in the settings for the next config write."""
    from engine.runtimes import registry

    mock = registry._RUNTIMES["mock"]

    def make(spec: registry.EngineSpec) -> object:
        if spec.path == "mock-broken":
            raise RuntimeError("llama_model_load: the file is not a model")
        return mock.make_engine(spec)

    monkeypatch.setitem(registry._RUNTIMES, "mock", replace(mock, make_engine=make))
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        with pytest.raises(ShoalError) as err:
            await shoal.set_model("mock-broken", runtime="mock")
        assert str(err.value) == ("could not serve mock-broken (llama_model_load: the file is "
                                  "not a model); this machine serves mock-m again")
        assert shoal.settings.node is not None and shoal.settings.node.model == "mock-m"
        await ready(shoal)
        assert shoal.snapshot().model == "mock-m"
        assert (await chat(shoal, model="mock-m"))[0] == 200
        assert await shoal.set_model("mock-b", runtime="mock") == "mock-b"  # and still swaps


async def test_stop_drains_a_running_session(tmp_path: Path):
    shoal = await Shoal.start(both(tmp_path))
    await ready(shoal)
    task = asyncio.create_task(chat(shoal, max_tokens=40))  # 0.2 s at 200 tok/s
    await until(lambda: shoal.snapshot().nodes[0].lanes_busy == 1, "the session to run")
    await shoal.stop(drain=5)
    status, body = await task
    assert status == 200 and body["usage"]["completion_tokens"] == 40


async def test_settings_for_the_next_start_are_checked_and_kept_apart(tmp_path: Path):
    async with running(both(tmp_path)) as shoal:
        events = shoal.events()
        for bad in ({"http_port": 0}, {"http_port": True}, {"fleet_port": 70000},
                    {"discovery": "everywhere"}, {"queue_timeout_s": 0},
                    {"app": {f"k{i}": True for i in range(65)}}, {"app": {"x": [1]}}):
            with pytest.raises(CommandError) as err:
                await shoal.update_settings(**bad)  # type: ignore[arg-type]
            assert err.value.code == "bad_setting"
        assert shoal.pending == shoal.settings  # nothing half-changed
        change = await shoal.update_settings(http_port=18461, app={"notify": False})
        assert change.restart_needed and change.pending.head.http == "127.0.0.1:18461"  # type: ignore[union-attr]
        assert shoal.settings.head.http == "127.0.0.1:0"  # type: ignore[union-attr]
        assert shoal.app_settings == {"notify": False}
        got = await asyncio.wait_for(events.get(), 5)
        assert isinstance(got, ev.SettingsChanged) and got.restart_needed
        events.close()
    # a Shoal that runs nothing (a failed start) takes them at once: the next open uses them
    idle = Shoal(both(tmp_path / "idle"))
    change = await idle.update_settings(http_port=18462)
    assert not change.restart_needed and idle.settings.head.http == "127.0.0.1:18462"  # type: ignore[union-attr]
    await idle.stop(drain=0)
