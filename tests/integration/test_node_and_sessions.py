"""Node agent and session runner in one loop, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from engine.api.errors import status_for
from engine.errors import RequestError
from engine.head.fleet.links import Fleet
from engine.head.fleet.sessions import Finish, Job, SessionRunner
from engine.link import messages as m
from engine.link.transport import Link, LinkClosed, dial
from engine.node.agent import NodeAgent
from engine.runtimes.mock import MockEngine
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
TOKEN = bytes(range(32))
# with this seed the mock writes 2000 tokens from prompt [1] before its end token
LONG = m.SamplingParams(seed=17)


@contextlib.asynccontextmanager
async def node(identity: str, *, lanes: int = 1, speed: float = 100.0, **kw):
    agent = NodeAgent(MockEngine(model="m", lanes=lanes, speed=speed), identity=identity,
                      psk=TOKEN, **kw)
    _host, port = await agent.listen("127.0.0.1", 0)
    try:
        yield agent, port
    finally:
        await agent.close()


async def raw_link(port: int, head_id: str = "h") -> Link:
    link = await dial("127.0.0.1", port, psk=TOKEN)
    hello = await link.recv()
    assert isinstance(hello, m.NodeHello)
    link.send(m.HeadHello(head_id=head_id, model="m"))
    return link


async def recv_skipping_stats(link: Link) -> m.Record:
    while True:
        rec = await asyncio.wait_for(link.recv(), 5)
        if not isinstance(rec, m.Stats):
            return rec


async def test_node_fences_a_session_whose_lease_lapses():
    async with node("n", lanes=1, speed=200.0) as (agent, port):
        link = await raw_link(port)
        link.send(m.Generate(session="s1", lease_ms=300, prompt=[1], max_tokens=10_000,
                             sampling=LONG))
        assert isinstance(await recv_skipping_stats(link), m.Accepted)
        got = 0
        with pytest.raises(LinkClosed):
            while True:
                rec = await recv_skipping_stats(link)
                assert not isinstance(rec, m.Done)
                if isinstance(rec, m.Tokens):
                    got += len(rec.ids)
        # ~0.3 s at 200 tok/s (~60 tokens): it stopped at the lease, far short of 10 000
        assert 0 < got < 1000
        assert agent.stats_record().lanes_busy == 0
        # the lane is free for the next session
        link2 = await raw_link(port)
        link2.send(m.Generate(session="s2", lease_ms=5000, prompt=[1], max_tokens=3,
                             sampling=LONG))
        assert isinstance(await recv_skipping_stats(link2), m.Accepted)
        link2.close()


async def test_renewed_lease_keeps_the_session_running():
    async with node("n", lanes=1, speed=200.0) as (_agent, port):
        link = await raw_link(port)
        link.send(m.Generate(session="s1", lease_ms=1000, prompt=[1], max_tokens=400,
                             sampling=LONG))
        got = 0
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + 0.1
        while True:
            rec = await recv_skipping_stats(link)
            if loop.time() > next_renew:
                link.send(m.Renew(session="s1", lease_ms=1000))
                next_renew = loop.time() + 0.1
            if isinstance(rec, m.Tokens):
                got += len(rec.ids)
            if isinstance(rec, m.Done):
                break
        assert got == 400  # 2 s at 200 tok/s, well past the first lease


async def test_full_node_refuses_at_once():
    async with node("n", lanes=1, speed=50.0) as (agent, port):
        a, b = await raw_link(port, "h1"), await raw_link(port, "h2")
        a.send(m.Generate(session="s1", lease_ms=5000, prompt=[1], max_tokens=100,
                             sampling=LONG))
        assert isinstance(await recv_skipping_stats(a), m.Accepted)
        b.send(m.Generate(session="s2", lease_ms=5000, prompt=[1], max_tokens=100,
                             sampling=LONG))
        rec = await asyncio.wait_for(recv_skipping_stats(b), 0.5)
        assert isinstance(rec, m.Error) and rec.code == "busy"
        assert agent.stats_record().peak_busy == 1
        a.close()
        b.close()


class Recorder:
    """A NodeObserver that keeps what it was told."""

    def __init__(self) -> None:
        self.sessions: list[str] = []
        self.sent: list[tuple[str, int, list[int]]] = []

    def admitted(self, gen: m.Generate) -> None:
        self.sessions.append(gen.session)

    def tokens(self, gen: m.Generate, record: m.Tokens) -> None:
        self.sent.append((gen.session, record.index, list(record.ids)))


async def test_observer_is_told_of_each_admission_and_every_tokens_record():
    seen = Recorder()
    async with node("n", lanes=1, speed=200.0, observer=seen) as (_agent, port):
        a, b = await raw_link(port, "h1"), await raw_link(port, "h2")
        a.send(m.Generate(session="s1", lease_ms=5000, prompt=[1], max_tokens=100,
                          sampling=LONG))
        assert isinstance(await recv_skipping_stats(a), m.Accepted)
        b.send(m.Generate(session="s2", lease_ms=5000, prompt=[1], max_tokens=5,
                          sampling=LONG))
        refused = await recv_skipping_stats(b)
        assert isinstance(refused, m.Error) and refused.code == "busy"
        got: list[tuple[str, int, list[int]]] = []
        while not isinstance(rec := await recv_skipping_stats(a), m.Done):
            assert isinstance(rec, m.Tokens)
            got.append(("s1", rec.index, list(rec.ids)))
        a.close()
        b.close()
    assert seen.sessions == ["s1"]  # the refused session took no lane
    assert seen.sent == got
    assert sum(len(ids) for _, _, ids in got) == 100


async def test_idle_connection_is_dropped_after_the_idle_timeout():
    async with node("n", idle_timeout_s=0.4) as (_agent, port):
        link = await raw_link(port)
        with pytest.raises(LinkClosed):
            for _ in range(10):
                await asyncio.wait_for(link.recv(), 2)


async def test_handshake_timeout_drops_a_silent_dialer():
    async with node("n", handshake_timeout_s=0.3) as (_agent, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = await asyncio.wait_for(reader.read(), 3)
        assert data == b""  # closed by the node, nothing sent
        writer.close()


def job(session: str, **kw: object) -> Job:
    return Job(session=session, model="m", sampling=LONG, **kw)  # type: ignore[arg-type]


async def wait_ready(fleet: Fleet, n: int) -> None:
    await until(lambda: sum(1 for p in fleet.pools.values() if p.state == "ready") >= n,
                f"{n} nodes ready")


async def collect(runner: SessionRunner, job: Job) -> tuple[list[int], Finish]:
    ids: list[int] = []
    async for item in runner.run(job):
        if isinstance(item, Finish):
            return ids, item
        ids.extend(item)
    raise AssertionError("no finish")


async def test_head_tries_the_next_node_when_one_refuses_as_full(caplog):
    caplog.set_level(logging.INFO)
    async with node("x", lanes=1, speed=50.0) as (_ax, px), \
            node("y", lanes=1, speed=500.0) as (_ay, py):
        fleet = Fleet(model="m", head_id="head-b", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", px)
        fleet.add_dialed("127.0.0.1", py)
        runner = SessionRunner(fleet)
        await wait_ready(fleet, 2)
        # another head holds x's only lane
        other = await raw_link(px, "head-a")
        other.send(m.Generate(session="busy", lease_ms=5000, prompt=[1], max_tokens=500,
                             sampling=LONG))
        assert isinstance(await recv_skipping_stats(other), m.Accepted)
        # this head has not seen x's stats yet: it offers x first, x refuses, y serves
        fleet.pools[f"127.0.0.1:{px}"].on_stats = lambda st: None  # type: ignore[method-assign]
        fleet.pools[f"127.0.0.1:{px}"].stats = None
        ids, fin = await collect(runner, job("s", prompt=[1, 2], max_tokens=20,
                                             prefer=("x",)))
        assert fin.node == "y" and len(ids) == 20 and fin.moves == 0
        assert "node 'x' is full" in caplog.text
        other.close()
        await fleet.close()


async def test_generation_ceiling_ends_the_session():
    async with node("x", lanes=1, speed=20.0) as (_a, port):
        fleet = Fleet(model="m", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        runner = SessionRunner(fleet, max_wall_s=0.5)
        await wait_ready(fleet, 1)
        ids, fin = await collect(runner, job("s", prompt=[1], max_tokens=1000))
        assert fin.reason == "length" and 3 < len(ids) < 30
        await fleet.close()


async def test_prompt_beyond_every_window_is_refused():
    async with node("x") as (_a, port):
        fleet = Fleet(model="m", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        runner = SessionRunner(fleet)
        await wait_ready(fleet, 1)
        with pytest.raises(RequestError) as err:
            await collect(runner, job("s", prompt=[1] * 5000, max_tokens=1))
        assert status_for(err.value) == 400 and err.value.code == "context_length_exceeded"
        await fleet.close()


async def test_queue_is_first_in_first_out():
    async with node("x", lanes=1, speed=400.0) as (_a, port):
        fleet = Fleet(model="m", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        runner = SessionRunner(fleet, queue_timeout_s=10)
        await wait_ready(fleet, 1)
        order: list[int] = []

        async def one(i: int) -> None:
            await collect(runner, job(f"s{i}", prompt=[1], max_tokens=20))
            order.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(one(i)))
            # the next arrives once this one is placed (i == 0) or queued behind the others
            await until(lambda i=i: runner.queued == i, f"request {i} to queue")
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        await fleet.close()
