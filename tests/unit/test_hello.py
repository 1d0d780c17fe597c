"""The hello exchange (engine.link.hello) between two in-memory links: real Noise
connections wired back to back, no sockets. Each test checks the trace of what each
end sent, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from engine.link import messages as m
from engine.link.connection import NEED_DATA, Closed, HandshakeDone, LinkConnection
from engine.link.hello import Hello, WrongPeer, exchange_hellos
from engine.link.transport import LinkClosed

TOKEN = bytes(range(32))
NODE = m.NodeHello(identity="n1", model="mock-m", runtime="mock", context_window=4096,
                   lanes=2)
HEAD = m.HeadHello(head_id="h1", model="mock-m", listen_port=8454)
OTHER_HEAD = m.HeadHello(head_id="h2", model="mock-m")
WAIT_S = 5.0  # bounds every exchange that must succeed; a bug fails instead of hanging


class MemoryLink:
    """A link whose bytes go straight into its peer's connection."""

    def __init__(self, conn: LinkConnection, name: str, trace: list[tuple[str, object]]) -> None:
        self.conn = conn
        self.name = name
        self.trace = trace
        self.other: MemoryLink | None = None
        self.closed = False
        self._arrived = asyncio.Event()

    def send(self, record: m.Record) -> None:
        if self.closed:
            raise LinkClosed("the connection is closed")
        assert self.other is not None
        self.trace.append((self.name, record))
        self.other.feed(self.conn.send(record))

    def feed(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self._arrived.set()

    async def recv(self) -> m.Record:
        while True:
            event = self.conn.next_event()
            if event is NEED_DATA:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if isinstance(event, Closed):
                raise LinkClosed("the peer closed the connection")
            assert not isinstance(event, HandshakeDone)
            return event  # type: ignore[return-value]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.trace.append((self.name, "close"))
            assert self.other is not None
            self.other.feed(b"")


def pair() -> tuple[MemoryLink, MemoryLink, list[tuple[str, object]]]:
    """(initiator, responder, the trace both write to), handshake done."""
    ini = LinkConnection(initiator=True, psk=TOKEN)
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(ini.initiate(now=0.0))
    assert res.next_event() == HandshakeDone(encrypted=True)
    ini.receive_data(res.handshake_reply())
    assert ini.next_event() == HandshakeDone(encrypted=True)
    trace: list[tuple[str, object]] = []
    a, b = MemoryLink(ini, "initiator", trace), MemoryLink(res, "responder", trace)
    a.other, b.other = b, a
    return a, b, trace


async def both(initiator: Awaitable[Hello], responder: Awaitable[Hello]) -> list[object]:
    """Both ends at once; what each returned or raised."""
    async with asyncio.timeout(WAIT_S):
        return await asyncio.gather(initiator, responder, return_exceptions=True)


async def test_the_responder_speaks_first_and_the_initiator_answers() -> None:
    head_side, node_side, trace = pair()
    got = await both(
        exchange_hellos(head_side, HEAD, responder=False, expect=m.NodeHello, timeout_s=WAIT_S),
        exchange_hellos(node_side, NODE, responder=True, expect=m.HeadHello, timeout_s=WAIT_S))
    assert got == [NODE, HEAD]
    assert trace == [("responder", NODE), ("initiator", HEAD)]
    assert not head_side.closed and not node_side.closed


async def test_a_joining_node_and_a_head_that_takes_joins() -> None:
    node_side, head_side, trace = pair()
    got = await both(
        exchange_hellos(node_side, NODE, responder=False, expect=m.HeadHello, timeout_s=WAIT_S),
        exchange_hellos(head_side, HEAD, responder=True, expect=(m.NodeHello, m.HeadHello),
                        timeout_s=WAIT_S))
    assert got == [HEAD, NODE]
    assert trace == [("responder", HEAD), ("initiator", NODE)]


async def test_a_listener_that_takes_either_kind_takes_a_head() -> None:
    dialer, listener, _ = pair()
    got = await both(
        exchange_hellos(dialer, OTHER_HEAD, responder=False, expect=m.HeadHello,
                        timeout_s=WAIT_S),
        exchange_hellos(listener, HEAD, responder=True, expect=(m.NodeHello, m.HeadHello),
                        timeout_s=WAIT_S))
    assert got == [HEAD, OTHER_HEAD]


async def test_the_initiator_checks_who_answered_before_it_says_anything() -> None:
    head_side, other_head, trace = pair()
    other_head.send(OTHER_HEAD)  # a head where a node was expected
    with pytest.raises(WrongPeer) as err:
        await exchange_hellos(head_side, HEAD, responder=False, expect=m.NodeHello,
                              timeout_s=WAIT_S)
    assert str(err.value) == "the peer is not a Shoal node (it said hello as a head)"
    assert err.value.got == OTHER_HEAD
    assert trace == [("responder", OTHER_HEAD), ("initiator", "close")]
    assert isinstance(err.value, LinkClosed)  # callers that catch LinkClosed catch it


async def test_a_record_that_is_no_hello_is_a_wrong_peer() -> None:
    ini, res, trace = pair()
    res.send(m.Ping(nonce=1))
    with pytest.raises(WrongPeer, match=r"^the peer is not a Shoal head \(it did not say "
                                        r"hello\)$"):
        await exchange_hellos(ini, NODE, responder=False, expect=m.HeadHello,
                              timeout_s=WAIT_S)
    assert trace == [("responder", m.Ping(nonce=1)), ("initiator", "close")]


async def test_a_listener_names_both_kinds_it_takes() -> None:
    ini, res, _ = pair()
    ini.send(m.Ping(nonce=1))
    with pytest.raises(WrongPeer, match="not a Shoal node or head"):
        await exchange_hellos(res, HEAD, responder=True, expect=(m.NodeHello, m.HeadHello),
                              timeout_s=WAIT_S)


async def test_a_probe_reads_the_hello_and_answers_nothing() -> None:
    prober, node_side, trace = pair()
    node_side.send(NODE)
    async with asyncio.timeout(WAIT_S):
        got = await exchange_hellos(prober, None, responder=False, expect=m.NodeHello,
                                    timeout_s=WAIT_S)
    assert got == NODE
    assert trace == [("responder", NODE)]


async def test_silence_times_out_and_closes_the_link() -> None:
    ini, _res, trace = pair()
    with pytest.raises(TimeoutError):
        await exchange_hellos(ini, HEAD, responder=False, expect=m.NodeHello, timeout_s=0.01)
    assert ini.closed and trace == [("initiator", "close")]


async def test_a_peer_that_hangs_up_is_a_closed_link() -> None:
    ini, res, trace = pair()
    res.close()
    with pytest.raises(LinkClosed) as err:
        await exchange_hellos(ini, HEAD, responder=False, expect=m.NodeHello,
                              timeout_s=WAIT_S)
    assert not isinstance(err.value, WrongPeer)
    assert trace == [("responder", "close"), ("initiator", "close")]


async def test_a_responder_needs_a_hello_of_its_own() -> None:
    _ini, res, trace = pair()
    with pytest.raises(ValueError, match="speaks first"):
        await exchange_hellos(res, None, responder=True, expect=m.HeadHello, timeout_s=WAIT_S)
    assert trace == []
