"""A head with no token stays on its machine; strangers on the LAN cannot make heads and
nodes dial without end or exhaust them with connections. Loopback only."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import pytest
from zeroconf import ServiceStateChange

from engine.discovery import mdns
from engine.discovery.service import announce_head
from engine.head.fleet import links as fleet_mod
from engine.head.fleet.links import Fleet
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.prompt.model import load_head_model
from engine.link import admission
from engine.link.connection import NEED_DATA, HandshakeDone, LinkConnection
from engine.link.transport import dial
from engine.node.agent import NodeAgent
from engine.runtimes.mock import MockEngine
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, Settings
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
TOKEN = bytes(range(32))


def mock_head(psk: bytes | None) -> Head:
    fleet = Fleet(model="m", head_id="h-" + secrets.token_hex(4), psk=psk)
    return Head([load_head_model("mock", "m", name="m")], fleet, SessionRunner(fleet))


async def test_a_head_without_a_token_runs_no_discovery(caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path):
    caplog.set_level(logging.INFO)
    started: list[str] = []

    async def refuse(*a: object, **k: object) -> None:
        started.append("mdns")

    monkeypatch.setattr(mdns.Announcer, "start", refuse)
    monkeypatch.setattr(mdns.Browser, "start", refuse)
    settings = Settings(home=tmp_path, head=HeadSettings(
        model="m", runtime="mock", http="127.0.0.1:0", fleet_listen="0.0.0.0:0"),
        discovery=DiscoverySettings(mode="both"))
    shoal = await Shoal.start(settings)
    try:
        assert shoal.snapshot().has_token is False
        assert shoal.fleet_address is not None  # it takes nodes (from this machine only)
        assert started == []
        assert "no fleet token" in caplog.text and "looks for none" in caplog.text
    finally:
        await shoal.stop()


async def test_a_loopback_fleet_listener_is_not_announced(caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch):
    caplog.set_level(logging.INFO)
    started: list[str] = []
    monkeypatch.setattr(mdns.Announcer, "start",
                        lambda *a, **k: started.append("announcer"))  # type: ignore[misc]
    head = mock_head(TOKEN)
    closers = await announce_head("lan", head_id=head.fleet.head_id,
                                   model=head.fleet.model, psk=TOKEN, port=8454,
                                  host="127.0.0.1")
    assert closers == [] and started == []
    assert "not announcing this head on the LAN" in caplog.text
    await head.close()


async def test_the_browser_keeps_a_bounded_set(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mdns, "MAX_SERVICES", 8)
    browser = mdns.Browser(interfaces=["127.0.0.1"], resolve_timeout=0.05)
    await browser.start()
    try:
        for i in range(50):  # a flood of announcements of names that resolve to nothing
            browser._handle(f"flood-{i}.{mdns.SERVICE_TYPE}", ServiceStateChange.Added)
        assert len(browser._resolving) == 8
        assert browser._full_warned
    finally:
        await browser.close()


async def test_a_discovered_node_that_never_answers_is_let_go(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fleet_mod, "RETRY_S", 0.05)
    # something listens there but is no Shoal node: it closes every connection at once
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fleet = Fleet(model="m", head_id="h", psk=TOKEN, handshake_timeout_s=1.0)
    given = fleet.add_dialed("127.0.0.1", port)  # given by the user: kept for ever
    fleet.add_dialed("127.0.0.1", port, key="found", discovered=True)
    await until(lambda: "found" not in fleet.pools, "the discovered node let go")
    # (dials to a found address that failed its handshake wait; the given one's do not)
    await until(lambda: given.failures >= fleet_mod.DROP_DISCOVERED_AFTER,
                "the given node's failed dials")
    assert given.key in fleet.pools
    await fleet.close()
    server.close()


async def test_connections_that_never_handshake_are_capped(monkeypatch: pytest.MonkeyPatch):
    agent = NodeAgent(MockEngine(model="m", lanes=1), identity="n", psk=TOKEN)
    agent._pending = admission.PendingHandshakes(per_address=4, total=8)
    agent.first_message_s = 30.0  # the silent ones stay until pushed out
    _h, port = await agent.listen("127.0.0.1", 0)
    flood = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
    # the agent counts each connection as it pushes one out or admits it: wait for all 20
    await until(lambda: agent._pending.dropped + len(agent._pending) == 20,
                "the agent to take in the whole flood")
    assert agent._pending.dropped == 16 and len(agent._pending) == 4
    # the oldest were closed (our readers see EOF); the newest four are still served: one
    # of them completes a handshake (no wait for a close that must not come)
    await until(lambda: sum(reader.at_eof() for reader, _w in flood) == 16,
                "16 pushed-out connections closed")
    admitted = [(reader, writer) for reader, writer in flood if not reader.at_eof()]
    assert admitted == flood[-4:] and len(agent._pending) == 4
    reader, writer = admitted[0]
    ini = LinkConnection(initiator=True, psk=TOKEN)
    writer.write(ini.initiate(time.time()))
    async with asyncio.timeout(10):
        while (event := ini.next_event()) is NEED_DATA:
            ini.receive_data(await reader.read(65536))
    assert isinstance(event, HandshakeDone), event
    for _reader, writer in flood:
        writer.close()
    await until(lambda: not len(agent._pending), "the admitted connections let go")
    link = await dial("127.0.0.1", port, psk=TOKEN)  # the flood is gone: a head gets in
    link.close()
    await agent.close()
