"""The link's socket adapter on real loopback sockets: records handed to a callback as
they are read (how the head reads its nodes), the end told once, flow control both ways."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from engine.link import messages as m
from engine.link.transport import _READ_LIMIT, Incoming, Link, LinkClosed, accept, dial, serve
from tests.waiting import until

TOKEN = bytes(range(32))
_MAX_READ = 256 * 1024  # the most asyncio's selector transport reads at once


@contextlib.asynccontextmanager
async def linked(psk: bytes | None = TOKEN) -> AsyncIterator[tuple[Link, Link]]:
    """(the accepting end, the dialing end) of one link."""
    incoming: asyncio.Queue[Incoming] = asyncio.Queue()
    server = await serve(incoming.put_nowait, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dialing = asyncio.create_task(dial("127.0.0.1", port, psk=psk))
    try:
        there = await accept(await incoming.get(), psk=psk)
        here = await dialing
        yield there, here
        here.close()
        there.close()
    finally:
        dialing.cancel()
        server.close()
        await server.wait_closed()


async def test_records_read_before_delivery_come_first_then_the_rest_in_order():
    async with linked() as (node, head):
        for i in range(10):
            node.send(m.Ping(nonce=i))
        assert await head.recv() == m.Ping(nonce=0)
        got: list[m.Record] = []
        ends: list[str] = []
        head.deliver_to(got.append, ends.append)
        for i in range(10, 20):
            node.send(m.Ping(nonce=i))
        await until(lambda: len(got) == 19, "the nineteen other records")
        assert got == [m.Ping(nonce=i) for i in range(1, 20)]
        assert ends == []
        with pytest.raises(RuntimeError):
            await head.recv()  # delivered links are not read twice


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_the_end_of_a_delivered_link_is_told_once_after_its_records(how: str):
    async with linked() as (node, head):
        got: list[m.Record] = []
        ends: list[str] = []
        head.deliver_to(got.append, ends.append)
        node.send(m.Ping(nonce=1))
        await until(lambda: got, "the record")
        node.send(m.Ping(nonce=2))
        if how == "close":
            await node.drain()
            node.close()
        else:
            node.abort()
        await until(lambda: ends, "the end of the link")
        head.close()
        await until(lambda: head.closed, "the link closed")
        assert len(ends) == 1, ends
        if how == "close":  # a clean close delivers what was sent before it
            assert got == [m.Ping(nonce=1), m.Ping(nonce=2)]
            assert "closed" in ends[0]
        with pytest.raises(LinkClosed):
            head.send(m.Ping(nonce=3))


async def test_a_link_closed_before_delivery_began_is_told_at_once():
    async with linked() as (node, head):
        node.send(m.Ping(nonce=7))
        await node.drain()
        node.close()
        await until(lambda: head._sock.lost, "the close to reach the head")
        got: list[m.Record] = []
        ends: list[str] = []
        head.deliver_to(got.append, ends.append)
        await until(lambda: ends, "the end of the link")
        assert got == [m.Ping(nonce=7)] and len(ends) == 1


async def test_a_broken_record_on_a_delivered_link_closes_it_and_says_why(
        caplog: pytest.LogCaptureFixture):
    # a plaintext loopback link, so that the test can write a frame of its own
    incoming: asyncio.Queue[Incoming] = asyncio.Queue()
    server = await serve(incoming.put_nowait, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"\x00\x00")  # no token: the plaintext marker
        head = await accept(await incoming.get(), psk=None)
        got: list[m.Record] = []
        ends: list[str] = []
        head.deliver_to(got.append, ends.append)
        record = b"\x00\x00\x00\x03\x93\xa1x"  # a record of an unknown kind
        with caplog.at_level(logging.WARNING, logger="shoal.link"):
            writer.write(len(record).to_bytes(2, "big") + record)
            await until(lambda: ends, "the end of the link")
        assert got == [] and len(ends) == 1
        assert head.closed
        assert "closed the link" in caplog.text
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_a_receiver_that_fails_drops_the_link_and_hears_its_end(
        caplog: pytest.LogCaptureFixture):
    async with linked() as (node, head):
        ends: list[str] = []

        def fail(rec: m.Record) -> None:
            raise ValueError(f"cannot take {rec}")

        with caplog.at_level(logging.ERROR, logger="shoal.link"):
            head.deliver_to(fail, ends.append)
            node.send(m.Ping(nonce=1))
            node.send(m.Ping(nonce=2))
            await until(lambda: ends, "the end of the link")
            await until(lambda: node._sock.lost, "the node to see the link dropped")
        assert len(ends) == 1 and "receiver" in ends[0]
        assert "its receiver failed" in caplog.text


async def test_a_link_nobody_reads_stops_reading_and_the_sender_waits():
    records = [m.Tokens(ids=[i % 100] * 20_000, index=i) for i in range(300)]  # 6 MiB
    async with linked() as (node, head):
        for rec in records:
            node.send(rec)
        # the head reads nothing: the node's kernel buffers fill and its sends queue
        await until(lambda: node._sock.transport.get_write_buffer_size() > 0,
                    "the sender's buffer to back up")
        assert head._conn.buffered <= _READ_LIMIT + _MAX_READ, head._conn.buffered
        drained = asyncio.create_task(node.drain())
        got = [await head.recv() for _ in records]
        await asyncio.wait_for(drained, 10)
        assert got == records
