"""Channels over one link (engine.link.mux) on real loopback sockets: what a loop step
sends leaves as one batch, channels open in order and end on their own or with the link,
and a channel nobody reads holds the link's reading instead of filling memory."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from engine import events as ev
from engine.head.fleet.links import Fleet, NodePool
from engine.link import messages as m
from engine.link import mux as mx
from engine.link.mux import Channel, Mux
from engine.link.transport import LinkClosed
from engine.node.agent import NodeAgent
from tests.integration.test_api_surface import chat_body, live_head
from tests.integration.test_link_transport import linked
from tests.waiting import until


@contextlib.asynccontextmanager
async def muxed(max_channels: int = mx.MAX_CHANNELS
                ) -> AsyncIterator[tuple[Mux, Mux, asyncio.Queue[Channel]]]:
    """(the head's end, the node's end, the channels the node saw opened)."""
    async with linked() as (there, here):
        opened: asyncio.Queue[Channel] = asyncio.Queue()
        node = Mux(there, on_channel=opened.put_nowait, max_channels=max_channels)
        head = Mux(here)
        head.start()
        reading = asyncio.create_task(node.run(idle_timeout_s=30))
        try:
            yield head, node, opened
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading


def delivered(chan: Channel) -> tuple[list[m.Record], list[str]]:
    got: list[m.Record] = []
    ends: list[str] = []
    chan.deliver_to(got.append, ends.append)
    return got, ends


Opened = tuple[Channel, Channel, list[m.Record], list[str]]


async def two_channels(head: Mux, opened: asyncio.Queue[Channel]) -> tuple[Opened, Opened]:
    """Two channels the head opened: (the head's end, the node's end, the records and the
    end the head was told), each."""
    first, second = head.open(), head.open()
    got_1, ends_1 = delivered(first)
    got_2, ends_2 = delivered(second)
    return ((first, await opened.get(), got_1, ends_1),
            (second, await opened.get(), got_2, ends_2))


async def test_records_go_both_ways_on_their_channels_and_a_step_leaves_as_one_batch():
    async with muxed() as (head, node, opened):
        (a, at_a, got_a, _), (b, at_b, got_b, _) = await two_channels(head, opened)
        assert (at_a.id, at_b.id) == (a.id, b.id)
        assert await at_a.recv() == m.Ping(nonce=0)  # the ping that opened it
        assert await at_b.recv() == m.Ping(nonce=0)
        sent: list[m.Record] = []
        real_send = node.link.send

        def counting(record: m.Record) -> None:
            sent.append(record)
            real_send(record)

        node.link.send = counting  # type: ignore[method-assign]
        for i in range(5):  # one step of the node's loop: a token on each channel
            at_a.send(m.Tokens(ids=[i], index=i))
            at_b.send(m.Tokens(ids=[100 + i], index=i))
        await until(lambda: len(got_a) == 5 and len(got_b) == 5, "ten tokens")
        assert [r.ids[0] for r in got_a if isinstance(r, m.Tokens)] == list(range(5))
        assert [r.ids[0] for r in got_b if isinstance(r, m.Tokens)] == list(range(100, 105))
        assert len(sent) == 1 and isinstance(sent[0], m.Batch), sent
        assert len(sent[0].items) == 10
        a.send(m.Cancel(session="s"))
        assert await at_a.recv() == m.Cancel(session="s")


async def test_channels_open_at_the_node_in_order_whichever_the_head_uses_first():
    async with muxed() as (head, _node, opened):
        chans = [head.open() for _ in range(4)]
        for chan in chans:
            delivered(chan)
        chans[3].send(m.Cancel(session="last"))  # the head takes the last one first
        chans[0].send(m.Cancel(session="first"))
        at = [await opened.get() for _ in range(4)]
        assert [c.id for c in at] == [c.id for c in chans]
        assert [await at[3].recv(), await at[3].recv()] == [m.Ping(nonce=0),
                                                            m.Cancel(session="last")]
        assert [await at[0].recv(), await at[0].recv()] == [m.Ping(nonce=0),
                                                            m.Cancel(session="first")]


async def test_a_closed_channel_ends_at_the_other_end_and_the_others_carry_on():
    async with muxed() as (head, node, opened):
        (a, at_a, _, ends_a), (b, at_b, got_b, ends_b) = await two_channels(head, opened)
        at_a.abort()  # the node fences a session
        await until(lambda: ends_a, "the head told the channel ended")
        assert ends_a == [mx.CLOSED_HERE]
        assert a.closed and not b.closed
        with pytest.raises(LinkClosed):
            a.send(m.Ping(nonce=1))
        at_b.send(m.Tokens(ids=[7], index=0))
        await until(lambda: any(isinstance(r, m.Tokens) for r in got_b), "b's token")
        b.close()  # the head closes one: the node's reader sees the end after the records
        assert await at_b.recv() == m.Ping(nonce=0)
        with pytest.raises(LinkClosed):
            await at_b.recv()
        await until(lambda: ends_b, "the head's own close told to its receiver")
        assert head.channels == 0 and node.channels == 0
        late = head.open()  # ids are never reused: a new channel is a new id
        assert (await opened.get()).id == late.id == 3


async def test_records_for_a_channel_closed_here_are_dropped_not_reopened():
    async with muxed() as (head, node, opened):
        a = head.open()
        delivered(a)
        at_a = await opened.get()
        at_a.close()
        await until(lambda: a.closed, "the close reached the head")
        # in flight when the node closed it: the head sends on the raw link
        head.link.send(m.Batch(items=[(a.id, m.Cancel(session="late"))]))
        b = head.open()
        delivered(b)
        assert (await opened.get()).id == b.id
        assert opened.empty() and node.channels == 1


async def test_the_link_ending_ends_every_channel_with_why():
    async with muxed() as (head, node, opened):
        chans = [head.open() for _ in range(3)]
        ends = [delivered(c)[1] for c in chans]
        at = [await opened.get() for _ in range(3)]
        node.link.abort()
        await until(lambda: all(ends), "every channel told")
        assert all(len(e) == 1 and e[0] == ends[0][0] for e in ends), ends  # the link's why
        assert ends[0][0] != mx.CLOSED_HERE and "closed" in ends[0][0]
        for chan in at:
            with pytest.raises(LinkClosed):
                while True:
                    await chan.recv()
        with pytest.raises(LinkClosed):
            head.open()


async def test_a_channel_over_the_limit_is_ended_at_once():
    async with muxed(max_channels=2) as (head, node, _opened):
        chans = [head.open() for _ in range(3)]
        ends = [delivered(c)[1] for c in chans]
        await until(lambda: ends[2], "the third channel refused")
        assert "more than 2 channels" in ends[2][0]
        assert ends[0] == ends[1] == []
        assert node.channels == 2


async def test_a_record_outside_a_batch_closes_the_link():
    async with linked() as (there, here):
        node = Mux(there, on_channel=lambda chan: None)
        reading = asyncio.create_task(node.run(idle_timeout_s=30))
        here.send(m.Ping(nonce=1))
        await asyncio.wait_for(reading, 10)
        assert node.ended is not None and "outside a channel" in node.ended


async def test_an_unread_channel_holds_the_links_reading_then_gives_every_record():
    async with muxed() as (head, _node, opened):
        a = head.open()
        delivered(a)
        at_a = await opened.get()
        sent = 0
        for _ in range(2000):  # bounded: 2000 steps of 1000 records, or until the link waits
            for _ in range(1000):
                a.send(m.Renew(session="s", lease_ms=1000))
                sent += 1
            await head.link.drain()
            await asyncio.sleep(0)  # the batch leaves at the end of the step
            if head.link._sock._write_paused:  # the node stopped reading: the kernel fills
                break
        await until(lambda: head.link._sock._write_paused, "the head's writes held back")
        assert len(at_a._inbox) <= mx.MAX_UNREAD + m.MAX_BATCH
        got = 0
        async with asyncio.timeout(30):
            while got < sent + 1:  # every record, and the opening ping, in order
                rec = await at_a.recv()
                got += 1
                assert isinstance(rec, m.Renew if got > 1 else m.Ping)
        assert got == sent + 1


async def test_a_silent_link_is_dropped_after_the_idle_timeout():
    async with linked() as (there, _here):
        node = Mux(there, on_channel=lambda chan: None)
        await asyncio.wait_for(node.run(idle_timeout_s=0.2), 10)
        assert node.ended is not None and "nothing heard" in node.ended
        await until(lambda: there.closed, "the link closed")



@pytest.mark.parametrize("node_has_channels", [True, False])
async def test_a_head_carries_a_nodes_sessions_over_one_link_or_one_per_lane(
        node_has_channels: bool, monkeypatch: pytest.MonkeyPatch):
    """A node that offers channels gets one link with a channel per lane; one that does
    not (an older node) gets a connection per lane; sessions run the same on both."""
    monkeypatch.setattr(NodeAgent, "offers_channels", node_has_channels)
    async with live_head(nodes=1, lanes=4, speed=100.0) as live:
        pool = next(iter(live.head.fleet.pools.values()))
        assert pool.conns == 4
        assert (pool.mux is not None) == node_has_channels
        links = {id(c.link._mux) if isinstance(c.link, Channel) else id(c.link)
                 for c in pool.idle}
        assert len(links) == (1 if node_has_channels else 4)
        url = f"http://127.0.0.1:{live.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            async def ask(i: int) -> dict:
                body = chat_body(f"question {i}", max_tokens=40, seed=i, temperature=0)
                async with http.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            answers = await asyncio.gather(*(ask(i) for i in range(6)))  # 6 on 4 lanes
        assert all(a["usage"]["completion_tokens"] >= 1 for a in answers)
        assert live.agents[0]._peak == 4
        assert live.agents[0].busy == 0


async def test_a_node_found_hung_by_several_sessions_at_once_is_told_once():
    """Sessions on one link hear their last tokens in the same record, so they find a
    frozen node silent at the same moment: one NodeUnreachable, not one per session."""
    told: list[object] = []
    fleet = Fleet(model="m", head_id="h", psk=None, emit=told.append)
    pool = NodePool(fleet, "n", "127.0.0.1", 1, dialed=True)
    pool._apply("dial_ok")
    for _ in range(3):
        pool.mark_unresponsive("no tokens and no pong for 3.0 s")
    assert [type(e) for e in told] == [ev.NodeLinked, ev.NodeUnreachable]
    assert pool.state == "unreachable"


async def test_a_head_stopped_as_its_node_answers_a_fresh_link_stops():
    """The head stops (its pools are cancelled) in the instant a node answers a link just
    dialed. On Python 3.11, `asyncio.wait_for` returned the answer there and the
    cancellation was lost: the pool dialed on, and the app's quit waited for it forever
    (the hang of the UI tests in CI). The pool must end cancelled."""
    fleet = Fleet(model="m", head_id="h", psk=None, emit=lambda _: None)
    pool = NodePool(fleet, "n", "127.0.0.1", 1, dialed=True)
    async with muxed() as (head, _node, _opened):
        waiting = asyncio.create_task(pool._served(head))
        await until(lambda: waiting._fut_waiter is not None, "the pool waiting for an answer")
        head.answered.set_result(None)  # the answer and the stop, in one step of the loop
        waiting.cancel()
        await asyncio.wait([waiting])
        assert waiting.cancelled(), f"the stop was lost: _served returned {waiting.result()}"
