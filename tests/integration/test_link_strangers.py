"""A stranger on the LAN who knows the fleet id (it is in clear in mDNS) cannot shut the
fleet out: fake heads get one first handshake message from a joined node, not one per
lane every few seconds; replaying fresh first messages never fills a machine's replay
guard against a real peer; and a flood of silent connections never refuses a real head.
Real NodeAgent, Joiner and dial on loopback (127.0.0.x stands for the LAN's addresses)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from engine.link import found, listener, transport
from engine.link.connection import LinkConnection
from engine.link.transport import dial
from engine.node.agent import NodeAgent
from engine.node.join import HeadAddress, Joiner
from engine.runtimes.mock import MockEngine
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)
TOKEN = bytes(range(32))
LANES = 8


async def test_fake_heads_announced_to_a_joined_node_get_one_message_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the wait after a failed handshake outlasts the test: the growth to an hour is the
    # unit test's (tests/unit/test_found.py)
    monkeypatch.setattr(transport, "_FOUND", found.FoundAddresses(first_wait_s=3600))
    harvested: dict[int, list[bytes]] = {}

    async def fake_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # keeps the dialer's first message (to replay elsewhere) and hangs up
        port = writer.get_extra_info("sockname")[1]
        with_message = await reader.read(4096)
        if with_message:
            harvested[port].append(with_message)
        writer.close()

    servers = [await asyncio.start_server(fake_head, "127.0.0.1", 0) for _ in range(8)]
    heads = [HeadAddress("127.0.0.1", s.sockets[0].getsockname()[1], "lan") for s in servers]
    for head in heads:
        harvested[head.port] = []
    agent = NodeAgent(MockEngine(model="m", lanes=LANES), identity="n", psk=TOKEN)
    joiner = Joiner(agent, psk=TOKEN, handshake_timeout_s=2.0)
    try:
        for head in heads:
            joiner.link(head)
        # every lane of every fake head failed three times over: a dial each, before
        await until(lambda: all(joiner.failures.get(h, 0) >= 3 * LANES for h in heads),
                    "every lane's third failed try")
        assert {p: len(got) for p, got in harvested.items()} == {h.port: 1 for h in heads}
        assert joiner.linked == {h: 0 for h in heads}
    finally:
        await joiner.close()
        await agent.close()
        for server in servers:
            server.close()
            await server.wait_closed()


async def test_fresh_first_messages_replayed_at_a_node_never_refuse_a_real_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the guard scaled down to 100 keys, as the review measured it; fresh messages stand
    # for the ones fake heads harvest from the fleet's dials
    monkeypatch.setattr(transport._REPLAYS, "max_remembered", 100)
    forgotten = transport._REPLAYS.forgotten
    agent = NodeAgent(MockEngine(model="m", lanes=1), identity="n", psk=TOKEN)
    _h, port = await agent.listen("127.0.0.1", 0)
    try:
        for n in range(150):
            reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                           local_addr=(f"127.0.0.{2 + n % 8}", 0))
            writer.write(LinkConnection(initiator=True, psk=TOKEN).initiate(time.time()))
            await reader.read(4096)  # the node answers the copy; no hello follows
            writer.close()
            await writer.wait_closed()
        assert transport._REPLAYS.forgotten - forgotten >= 50
        link = await dial("127.0.0.1", port, psk=TOKEN)  # a real head of the fleet
        link.close()
    finally:
        await agent.close()


@contextlib.asynccontextmanager
async def patient_node(monkeypatch: pytest.MonkeyPatch, *, first_message_s: float,
                       ) -> AsyncIterator[tuple[NodeAgent, int]]:
    """A listening node that waits 60 s for a hello (nothing of a flood times out
    meanwhile), and ``first_message_s`` for a connection's first bytes."""
    monkeypatch.setattr(listener, "PRE_HELLO_S", 60.0)
    agent = NodeAgent(MockEngine(model="m", lanes=1), identity="n", psk=TOKEN,
                      handshake_timeout_s=60.0)
    agent.first_message_s = first_message_s
    _h, port = await agent.listen("127.0.0.1", 0)
    try:
        yield agent, port
    finally:
        await agent.close()


async def test_a_flood_of_silent_connections_never_refuses_a_real_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    flood: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    async with patient_node(monkeypatch, first_message_s=60.0) as (agent, port):
        try:
            for n in range(128):  # 16 from each of 8 addresses: both caps reached
                flood.append(await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(f"127.0.0.{2 + n % 8}", 0)))
            await until(lambda: len(agent._pending) == 128,
                        "the node to count the whole flood")
            link = await dial("127.0.0.1", port, psk=TOKEN, timeout_s=10)
            link.close()
            assert agent._pending.dropped >= 1
            await until(lambda: sum(r.at_eof() for r, _w in flood) >= 1,
                        "the oldest silent connection closed")
        finally:
            for _r, writer in flood:
                writer.close()


async def test_a_connection_silent_past_its_first_message_deadline_is_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # far shorter than the hello's 60 s here
    async with patient_node(monkeypatch, first_message_s=0.2) as (agent, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await until(reader.at_eof, "the silent connection closed", timeout=20)
            assert not len(agent._pending)
        finally:
            writer.close()
        await agent.close()
