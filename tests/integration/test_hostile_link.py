"""Strangers on the link ports of a node and of a head, in process on 127.0.0.1.

A handshake sent a byte at a time is cut off at the pre-handshake bound; a peer that
passes the handshake but never says hello is dropped at the hello bound; a copied first
message is answered at most once, and fresh ones relayed from a fake node stay inside
the caps until their hello; floods of wrong-token dials are refused each time but
logged once per address; a flood of
connections that never handshake leaves the head's HTTP API serving and a real node
able to join once it is gone. The token never reaches a log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from engine.head.fleet.joins import JoinListener
from engine.head.fleet.links import Fleet
from engine.link import messages as m
from engine.link.connection import LinkConnection, LinkError, LinkErrorKind
from engine.link.hello import exchange_hellos
from engine.link.transport import LinkClosed, dial
from engine.node.agent import NodeAgent
from engine.runtimes.mock import MockEngine
from engine.settings import HeadSettings, NodeSettings, Settings
from tests.drills.record import record, token_free
from tests.integration.test_service import QUIET, ready, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
TOKEN = bytes(range(32))
OTHER = bytes(range(1, 33))
BOUND_S = 0.5  # the handshake bound in these tests (3 s before the handshake by default)
DRIBBLE_S = 0.05
FIRST_FRAME_LEN = 2 + 32 + 8 + 16  # a first Noise message framed: length, e, time, tag


async def node_agent() -> tuple[NodeAgent, int]:
    agent = NodeAgent(MockEngine(model="m", lanes=2), identity="n", psk=TOKEN,
                      handshake_timeout_s=BOUND_S)
    _h, port = await agent.listen("127.0.0.1", 0)
    return agent, port


async def join_listener() -> tuple[JoinListener, Fleet, int]:
    fleet = Fleet(model="m", head_id="h-test", psk=TOKEN)
    listener = JoinListener(fleet, handshake_timeout_s=BOUND_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    await listener.listen_on(sock)
    return listener, fleet, int(sock.getsockname()[1])


async def dribble_handshake(port: int) -> tuple[bytes, int]:
    """A real first Noise message, a byte every DRIBBLE_S; what the server sent back
    before it closed, and how many bytes went."""
    first = LinkConnection(initiator=True, psk=TOKEN).initiate(time.time())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    try:
        async with asyncio.timeout(10):
            for i in range(len(first)):
                if reader.at_eof():
                    break
                try:
                    writer.write(first[i:i + 1])
                    await writer.drain()
                except (ConnectionError, OSError):
                    break
                sent += 1
                # the client's pace, and a look for the server's close between bytes
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRIBBLE_S):
                        if await reader.read(1) == b"":
                            break
            try:
                return await reader.read(), sent
            except ConnectionResetError:
                # closed with a byte of ours unread (it came as the server closed): the
                # kernel says so with a reset instead of an end of stream; nothing was said
                return b"", sent
    finally:
        writer.close()


@pytest.mark.parametrize("side", ["node", "head"])
async def test_a_handshake_sent_a_byte_at_a_time_is_cut_off(side: str):
    if side == "node":
        agent, port = await node_agent()
        pending = agent._pending
    else:
        listener, fleet, port = await join_listener()
        pending = listener._pending
    try:
        answers = await asyncio.gather(*(dribble_handshake(port) for _ in range(4)))
        for data, sent in answers:
            # closed with nothing said, long before the 58 bytes could all go (2.9 s)
            assert data == b"" and 0 < sent < FIRST_FRAME_LEN, (data, sent)
        await until(lambda: len(pending) == 0, "the pending handshakes to be released")
        link = await dial("127.0.0.1", port, psk=TOKEN)  # a real peer still gets in
        link.close()
    finally:
        if side == "node":
            await agent.close()
        else:
            await listener.close()
            await fleet.close()
    record(f"link_slow_handshake_{side}", kind="hostile",
           tried=f"4 peers sending a valid first Noise message to a {side} a byte every "
                 "50 ms (pre-handshake bound 0.5 s here, 3 s by default)",
           times=4, outcome="each cut off at the bound with nothing said; the pending "
                            "count went back to 0; a real peer linked after",
           tokens_lost=None, failed_clear=None)


async def test_a_peer_that_never_says_hello_is_dropped():
    agent, port = await node_agent()
    listener, fleet, head_port = await join_listener()
    try:
        for where in (port, head_port):
            link = await dial("127.0.0.1", where, psk=TOKEN)
            try:
                with pytest.raises(LinkClosed):
                    async with asyncio.timeout(10):
                        while True:  # their hello and stats, then the close
                            await link.recv()
            finally:
                link.close()
    finally:
        await agent.close()
        await listener.close()
        await fleet.close()
    record("link_no_hello", kind="hostile",
           tried="a peer holding the token that completes the handshake and never says "
                 "hello, at a node and at a head", times=2,
           outcome="the link closed at the handshake timeout",
           tokens_lost=None, failed_clear=None)





async def capture_first_message(psk: bytes) -> bytes:
    """A first Noise message as a real dialer sends it, caught by a listener that is no
    Shoal peer (the fake node a stranger announces on mDNS for a head to dial)."""
    caught: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def fake_node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            caught.set_result(await reader.readexactly(FIRST_FRAME_LEN))
        writer.close()

    server = await asyncio.start_server(fake_node, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with contextlib.suppress(OSError, TimeoutError, LinkError):
            link = await dial("127.0.0.1", port, psk=psk, timeout_s=5)
            link.close()
        async with asyncio.timeout(5):
            return await caught
    finally:
        server.close()
        await server.wait_closed()


LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian)


def accepted_sockets(port: int) -> int:
    """How many of this process's descriptors are connections the listener on
    127.0.0.1:``port`` accepted: sockets whose local end is 127.0.0.1:``port`` and that are
    not the listening one. The clients' ends, in this process too, have ports of their own;
    one bound to another loopback address (127.0.0.5) may get the listener's port number
    (a CI run counted one so), so the address counts too."""
    inodes: set[str] = set()
    with contextlib.suppress(FileNotFoundError), open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            fields = line.split()
            address, local_port = fields[1].rsplit(":", 1)
            if (address == LOOPBACK_HEX and int(local_port, 16) == port
                    and fields[3] != "0A"):  # 0A: LISTEN
                inodes.add(fields[9])
    held = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in inodes:
                held += 1
    return held


def _connected(port: int, source: str) -> socket.socket:
    """A socket bound to ``source`` and connected to the listener. In a worker thread: 300
    binds to a source address at once hold the test's loop (which is the listener's) for
    over 100 ms, and the loop watch is there to catch the listener blocking, not the test."""
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def send_first(port: int, frame: bytes, source: str) -> tuple[str, asyncio.StreamWriter]:
    """Open a connection from ``source``, send ``frame`` and read the first answer:
    "reply" (the responder's message 2) or "closed". The connection stays open."""
    sock = await asyncio.to_thread(_connected, port, source)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(frame)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    try:
        async with asyncio.timeout(10):
            got = await reader.read(2 + 48)
    except ConnectionError:
        got = b""
    return ("reply" if got else "closed"), writer


AT_ONCE = 16  # sends in flight: hundreds of task steps made ready together hold the loop
# (the listener's too) past the watch's bound, a stall of the test's making


async def send_each(port: int, sends: list[tuple[bytes, str]],
                    ) -> list[tuple[str, asyncio.StreamWriter]]:
    """:func:`send_first` for each (frame, source), ``AT_ONCE`` at a time; every
    connection stays open."""
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(frame: bytes, source: str) -> tuple[str, asyncio.StreamWriter]:
        async with gate:
            return await send_first(port, frame, source)

    return await asyncio.gather(*(one(frame, source) for frame, source in sends))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
@pytest.mark.parametrize("side", ["node", "head"])
@pytest.mark.slow  # seconds of waiting: out of the quick selection
async def test_replayed_and_relayed_first_messages_hold_the_caps(
        side: str, caplog: pytest.LogCaptureFixture):
    """One captured first message replayed 300 times is answered at most once; 300
    fresh ones relayed from 20 addresses (what a stranger gets by having heads dial a
    fake node) stay within the caps, counted until a hello that never comes or a newer
    one pushes them out; the
    listener's descriptors stay within the cap and a real peer links after."""
    caplog.set_level(logging.INFO)
    if side == "node":
        agent = NodeAgent(MockEngine(model="m", lanes=2), identity="n", psk=TOKEN,
                          handshake_timeout_s=5.0)
        _h, port = await agent.listen("127.0.0.1", 0)
        pending = agent._pending
    else:
        fleet = Fleet(model="m", head_id="h-test", psk=TOKEN)
        listener = JoinListener(fleet, handshake_timeout_s=5.0)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        await listener.listen_on(sock)
        port = int(sock.getsockname()[1])
        pending = listener._pending
    held: list[asyncio.StreamWriter] = []
    try:
        captured = await capture_first_message(TOKEN)
        assert len(captured) == FIRST_FRAME_LEN

        # the same message, 300 times: answered at most once, the rest closed at once
        answers = await send_each(port, [(captured, "127.0.0.1")] * 300)
        held += [w for _, w in answers]
        replies = sum(1 for a, _ in answers if a == "reply")
        assert replies <= 1, f"a copied first message was answered {replies} times"
        await until(lambda: len(pending) == 0, "the one answered copy to be let go")
        assert any("a copy of a handshake this machine already took" in r.getMessage()
                   for r in caplog.records), "the replays were not logged"

        # 300 fresh first messages (each a real one: what heads send to a fake node),
        # 15 from each of 20 addresses, none followed by a hello
        fresh = [LinkConnection(initiator=True, psk=TOKEN).initiate(time.time())
                 for _ in range(300)]
        answers = await send_each(port, [(frame, f"127.0.0.{2 + i % 20}")
                                          for i, frame in enumerate(fresh)])
        held += [w for _, w in answers]
        # what the listener holds now, besides the client ends this test holds itself
        listener_fds = accepted_sockets(port)
        # past the cap each new one pushed out the oldest (never refused: admission.py)
        assert pending.dropped >= 300 - pending.total
        assert len(pending) <= pending.total
        assert listener_fds <= pending.total, f"the listener holds {listener_fds} sockets"
        # each is closed at the bound, with no hello: one line per address says so
        await until(lambda: len(pending) == 0, "the unproven connections to be closed",
                    timeout=15)
        silent = [r for r in caplog.records if "sent no hello" in r.getMessage()]
        assert 1 <= len(silent) <= 21, len(silent)
        for w in held:
            w.close()
        held.clear()

        # a peer holding the token still links
        link = await dial("127.0.0.1", port, psk=TOKEN)
        mine = m.HeadHello(head_id="h2", model="m") if side == "node" else \
            m.NodeHello(identity="good", model="m", runtime="mock", context_window=64, lanes=1)
        theirs = await exchange_hellos(link, mine, responder=False,
                                       expect=(m.NodeHello, m.HeadHello), timeout_s=5)
        assert theirs is not None
        link.close()
    finally:
        for w in held:
            w.close()
        if side == "node":
            await agent.close()
        else:
            await listener.close()
            await fleet.close()
    token_free({"caplog": caplog.text}, TOKEN.hex())
    record(f"link_replay_{side}", kind="hostile",
           tried=f"one captured first Noise message replayed 300 times at a {side}, then 300 "
                 "fresh ones from 20 addresses that never say hello",
           times=600, outcome="the copy answered at most once, the others closed at once; "
                              f"at most {pending.total} fresh ones held, each until the "
                              "hello bound; a real peer linked after",
           tokens_lost=None, failed_clear=None)


async def test_wrong_token_floods_are_refused_and_logged_once(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    agent, port = await node_agent()
    listener, fleet, head_port = await join_listener()
    refused = 0
    try:
        for where in (port, head_port):
            async def wrong(where: int = where) -> str:
                try:
                    link = await dial("127.0.0.1", where, psk=OTHER, timeout_s=5)
                except LinkError as exc:
                    return exc.kind.name
                except ConnectionResetError:
                    return "reset"  # the refusal's close raced our read
                link.close()
                return "linked"

            kinds = await asyncio.gather(*(wrong() for _ in range(60)))
            assert set(kinds) <= {LinkErrorKind.CLOSED_AT_HANDSHAKE.name, "reset"}, kinds
            refused += len(kinds)
        # both still take the right token
        for where in (port, head_port):
            link = await dial("127.0.0.1", where, psk=TOKEN)
            mine = m.HeadHello(head_id="h2", model="m") if where == port else \
                m.NodeHello(identity="good", model="m", runtime="mock", context_window=64,
                            lanes=1)
            theirs = await exchange_hellos(link, mine, responder=False,
                                           expect=(m.NodeHello, m.HeadHello), timeout_s=5)
            assert theirs is not None
            link.close()
    finally:
        await agent.close()
        await listener.close()
        await fleet.close()
    lines = [r.getMessage() for r in caplog.records if "another fleet token" in r.getMessage()
             or "refused a" in r.getMessage()]
    # one line per address and side with the cause and the fix, not one per dial
    assert 1 <= len(lines) <= 2, lines
    assert any("give the node's --auth-file the same token" in line for line in lines), lines
    token_free({"caplog": caplog.text}, TOKEN.hex())
    token_free({"caplog": caplog.text}, OTHER.hex())
    record("wrong_token_flood", kind="hostile",
           tried="120 dials with another fleet token (60 at a node, 60 at a head's join "
                 "port), all at once", times=refused,
           outcome=f"every one refused at the handshake; {len(lines)} log lines in all (once "
                   "per address, with the fix); the right token still linked; no token in "
                   "any log", tokens_lost=None, failed_clear=None)


async def test_a_connection_flood_leaves_the_api_serving(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    (tmp_path / "fleet").mkdir()
    token_file = tmp_path / "fleet" / "token"
    token_file.write_text(TOKEN.hex())
    token_file.chmod(0o600)
    settings = Settings(home=tmp_path, discovery=QUIET, auth_file=token_file,
                        head=HeadSettings(model="mock-m", runtime="mock", http="127.0.0.1:0",
                                          fleet_listen="127.0.0.1:0"),
                        node=NodeSettings(model="mock-m", runtime="mock", lanes=2,
                                          mock_speed=200.0))
    async with running(settings) as shoal:
        await ready(shoal)
        host, join_port = shoal.fleet_address  # type: ignore[misc]
        listener = shoal._roles.head.fleet_side.listener  # type: ignore[union-attr]
        flood = []
        for _ in range(300):
            try:
                flood.append(await asyncio.open_connection("127.0.0.1", join_port))
            except OSError:
                break  # the backlog is full: that is the kernel refusing, fine
        assert len(flood) >= 100
        api = shoal.api_url.removesuffix("/v1")  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{api}/health") as r:
                assert r.status == 200
            body = {"model": "mock-m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5}
            async with http.post(f"{api}/v1/chat/completions", json=body) as r:
                assert r.status == 200
        # one address: its newest connections only (the older pushed out or timed out)
        assert len(listener._pending) <= listener._pending.per_address
        for _r, writer in flood:
            writer.close()
        await until(lambda: len(listener._pending) == 0, "the flood to be let go")
        link = await dial(host, join_port, psk=TOKEN)  # a node joins once it is gone
        hello = await exchange_hellos(
            link, m.NodeHello(identity="late", model="mock-m", runtime="mock",
                              context_window=64, lanes=1),
            responder=False, expect=m.HeadHello, timeout_s=5)
        assert hello.model == "mock-m"
        await until(lambda: "joined:late" in shoal._roles.head.head.fleet.pools,  # type: ignore[union-attr]
                    "the late node to join")
        link.close()
    token_free({"caplog": caplog.text}, TOKEN.hex())
    record("connection_flood", kind="hostile",
           tried=f"{len(flood)} connections to a head's join port that never handshake",
           times=len(flood),
           outcome=f"{listener._pending.per_address} waited in the handshake at most, the "
                   "rest closed at once; /health and a chat answered 200 during the flood; "
                   "a node joined once it was gone", tokens_lost=None, failed_clear=None)
