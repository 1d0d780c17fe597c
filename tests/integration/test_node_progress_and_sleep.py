"""The node's side of long prefills and idle unload, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from engine.link import messages as m
from engine.link.transport import Link, dial
from engine.node.agent import NodeAgent
from engine.runtimes.mock import MockEngine
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
TOKEN = bytes(range(32))
LONG = m.SamplingParams(seed=17)  # the mock writes 2000 tokens from prompt [1]


@contextlib.asynccontextmanager
async def node(engine: MockEngine, **kw: object) -> AsyncIterator[tuple[NodeAgent, int]]:
    agent = NodeAgent(engine, identity="n", psk=TOKEN, **kw)  # type: ignore[arg-type]
    _host, port = await agent.listen("127.0.0.1", 0)
    try:
        yield agent, port
    finally:
        await agent.close()


async def head_link(port: int, *, progress: bool) -> Link:
    link = await dial("127.0.0.1", port, psk=TOKEN)
    assert isinstance(await link.recv(), m.NodeHello)
    link.send(m.HeadHello(head_id="h", model="m", progress=progress))
    return link


async def records_until_tokens(link: Link) -> list[m.Record]:
    got: list[m.Record] = []
    while True:
        rec = await asyncio.wait_for(link.recv(), 20)
        if isinstance(rec, m.Stats):
            continue
        got.append(rec)
        if isinstance(rec, m.Tokens | m.Done | m.Error):
            return got


async def test_a_long_prefill_is_reported_to_a_head_that_reads_progress() -> None:
    prompt = [65] * 300  # 3 s at 100 prompt tokens/s
    async with node(MockEngine(model="m", lanes=1, prefill_tps=100.0)) as (_agent, port):
        link = await head_link(port, progress=True)
        link.send(m.Generate(session="s", lease_ms=30_000, prompt=prompt, max_tokens=3))
        got = await records_until_tokens(link)
        assert isinstance(got[0], m.Accepted) and isinstance(got[-1], m.Tokens)
        reports = [r for r in got if isinstance(r, m.Progress)]
        assert len(reports) >= 2  # one every PROGRESS_S through the prefill
        done = [r.prefilled for r in reports]
        assert done == sorted(done) and 0 < done[-1] <= 300 and done[0] < 300
        assert all(r.prompt == 300 and not r.loading for r in reports)
        link.close()


async def test_a_head_of_an_older_version_gets_no_progress_records() -> None:
    async with node(MockEngine(model="m", lanes=1, prefill_tps=100.0)) as (_agent, port):
        link = await head_link(port, progress=False)
        link.send(m.Generate(session="s", lease_ms=30_000, prompt=[65] * 250, max_tokens=3))
        got = await records_until_tokens(link)
        assert [type(r) for r in got] == [m.Accepted, m.Tokens]
        link.close()


async def test_an_idle_node_sleeps_and_the_next_session_wakes_it() -> None:
    engine = MockEngine(model="m", lanes=2, speed=500.0)
    async with node(engine, idle_unload_s=0.3) as (agent, port):
        link = await head_link(port, progress=True)
        heard: list[m.Stats] = []

        async def sleep_reported() -> bool:
            with contextlib.suppress(TimeoutError):
                rec = await asyncio.wait_for(link.recv(), 0.5)
                if isinstance(rec, m.Stats):
                    heard.append(rec)
            return any(st.sleep == "asleep" for st in heard)

        await until(sleep_reported, "the node to say it is asleep", timeout=20)
        assert engine.asleep and agent.sleep == "asleep"
        link.send(m.Generate(session="s", lease_ms=30_000, prompt=[1], max_tokens=5,
                             sampling=LONG))
        got = await records_until_tokens(link)
        assert isinstance(got[0], m.Accepted) and isinstance(got[-1], m.Tokens)
        assert not engine.asleep and engine.loads == 2 and agent.sleep == ""
        link.close()


async def test_a_busy_node_does_not_sleep() -> None:
    engine = MockEngine(model="m", lanes=1, speed=50.0)
    async with node(engine, idle_unload_s=0.2) as (_agent, port):
        link = await head_link(port, progress=True)
        link.send(m.Generate(session="s", lease_ms=30_000, prompt=[1], max_tokens=60,
                             sampling=LONG))
        got: list[m.Record] = []
        while not any(isinstance(r, m.Done) for r in got):  # ~1.2 s of tokens at 50/s
            rec = await asyncio.wait_for(link.recv(), 20)
            got.append(rec)
            assert not engine.asleep  # never while the session runs
        assert sum(len(r.ids) for r in got if isinstance(r, m.Tokens)) == 60
        await until(lambda: engine.asleep, "the node to sleep once idle")
        link.close()
