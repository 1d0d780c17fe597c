"""Lanes are freed on every path, and leases never wait on the HTTP client.

Node agents and a head's session runner in one loop, over real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from engine.api.errors import status_for
from engine.errors import RequestError
from engine.head.fleet.links import Fleet
from engine.head.fleet.sessions import Finish, Job, SessionRunner
from engine.link import messages as m
from engine.node.agent import NodeAgent
from engine.runtimes.base import EngineInfo, EngineStats, GenerationRequest
from engine.runtimes.mock import MockEngine
from tests.integration.test_api_surface import live_head
from tests.integration.test_node_and_sessions import (
    LONG,
    TOKEN,
    collect,
    raw_link,
    recv_skipping_stats,
    wait_ready,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def agent_on(engine: object, identity: str) -> AsyncIterator[tuple[NodeAgent, int]]:
    agent = NodeAgent(engine, identity=identity, psk=TOKEN)  # type: ignore[arg-type]
    _host, port = await agent.listen("127.0.0.1", 0)
    try:
        yield agent, port
    finally:
        await agent.close()


# -- item 1: a generation that fails to start frees its lane ----------------------------


async def test_a_prompt_the_runtime_refuses_frees_its_lane_and_says_why():
    async with agent_on(MockEngine(model="m", lanes=4), "n") as (agent, port):
        link = await raw_link(port)
        for i in range(6):  # more than the node has lanes
            link.send(m.Generate(session=f"s{i}", lease_ms=5000, prompt=[], max_tokens=5))
            rec = await recv_skipping_stats(link)
            assert isinstance(rec, m.Error) and rec.code == "bad_request", rec
            assert "empty" in rec.message
        link.send(m.Generate(session="bad-ids", lease_ms=5000, prompt=[1, 10**9],
                             max_tokens=5))
        rec = await recv_skipping_stats(link)
        assert isinstance(rec, m.Error) and rec.code == "bad_request"
        assert "outside the vocabulary" in rec.message
        assert agent.stats_record().lanes_busy == 0
        # every lane is still there: four sessions start at once
        links = [await raw_link(port, f"h{i}") for i in range(4)]
        for i, other in enumerate(links):
            other.send(m.Generate(session=f"ok{i}", lease_ms=5000, prompt=[1], max_tokens=200,
                                  sampling=LONG))
        for other in links:
            assert isinstance(await recv_skipping_stats(other), m.Accepted)
        for other in [link, *links]:
            other.close()


class DeadRuntime(MockEngine):
    """A runtime whose decode thread has died: it refuses every generation."""

    def generate(self, request: GenerationRequest):  # type: ignore[no-untyped-def]
        raise RuntimeError("the llamacpp engine stopped: decode thread died")


async def test_a_runtime_that_cannot_start_the_generation_frees_the_lane():
    async with agent_on(DeadRuntime(model="m", lanes=2), "n") as (agent, port):
        link = await raw_link(port)
        for i in range(3):
            link.send(m.Generate(session=f"s{i}", lease_ms=5000, prompt=[1], max_tokens=5))
            rec = await recv_skipping_stats(link)
            assert isinstance(rec, m.Error) and rec.code == "internal", rec
            assert "decode thread died" in rec.message
        assert agent.stats_record().lanes_busy == 0
        link.close()


async def test_the_head_answers_a_refused_prompt_as_a_bad_request():
    async with agent_on(MockEngine(model="m", lanes=1), "x") as (agent, port):
        fleet = Fleet(model="m", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        runner = SessionRunner(fleet)
        await wait_ready(fleet, 1)
        with pytest.raises(RequestError) as err:
            await collect(runner, Job(session="s", model="m", prompt=[1, 10**9],
                                      max_tokens=5))
        assert status_for(err.value) == 400 and "outside the vocabulary" in str(err.value)
        # the node is not blamed: the next request runs there
        ids, fin = await collect(runner, Job(session="t", model="m", prompt=[1],
                                             max_tokens=5, sampling=LONG))
        assert fin.node == "x" and len(ids) == 5 and fin.moves == 0
        assert agent.stats_record().lanes_busy == 0
        await fleet.close()


async def test_ollama_autocomplete_in_an_empty_file_is_answered_and_keeps_every_lane():
    async with live_head(lanes=4) as live, aiohttp.ClientSession() as http:
        for _ in range(6):
            async with http.post(live.url("/api/generate"), json={
                    "model": "mock-m", "prompt": "", "suffix": "", "stream": False}) as r:
                assert r.status == 200
                body = await r.json()
                assert body["done"] is True and body["response"] == ""
        async with http.post(live.url("/v1/completions"), json={
                "model": "mock-m", "prompt": "", "suffix": ""}) as r:
            assert r.status == 400
            assert "empty" in (await r.json())["error"]["message"]
        async with http.get(live.url("/v1/fleet")) as r:
            nodes = (await r.json())["nodes"]
        assert [n["lanes_busy"] for n in nodes] == [0]
        assert live.agents[0].stats_record().lanes_busy == 0


class StuckRuntime(MockEngine):
    """Takes a generation and never produces a token, while its node answers pings."""

    def __init__(self) -> None:
        super().__init__(model="m", lanes=2)
        self.info = EngineInfo(model="m", runtime="mock", context_window=4096, lanes=2)
        self.started = 0

    def generate(self, request: GenerationRequest):  # type: ignore[no-untyped-def]
        self.started += 1
        return _Never()

    def stats(self) -> EngineStats:
        return EngineStats(lanes=2, lanes_busy=0, kv_used=0, kv_total=8192,
                           prefill_tps=0.0, decode_tps=0.0, ttft_ms=0.0)


class _Never:
    def __init__(self) -> None:
        self._stop = asyncio.Event()

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._run()

    async def _run(self):  # type: ignore[no-untyped-def]
        await self._stop.wait()
        if False:
            yield []

    def cancel(self) -> None:
        self._stop.set()

    @property
    def result(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("never finished")


async def test_an_accepted_session_without_tokens_fails_over_within_one_lease():
    stuck = StuckRuntime()
    async with agent_on(stuck, "stuck") as (_s, ps), \
            agent_on(MockEngine(model="m", lanes=2), "good") as (_g, pg):
        fleet = Fleet(model="m", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", ps)
        fleet.add_dialed("127.0.0.1", pg)
        # a short lease keeps the test quick; the node answers every ping meanwhile
        runner = SessionRunner(fleet, lease_ms=400)
        await wait_ready(fleet, 2)
        ids, fin = await collect(runner, Job(session="s", model="m", prompt=[1, 2],
                                             max_tokens=30, sampling=LONG, prefer=("stuck",)))
        assert stuck.started == 1
        assert fin.node == "good" and fin.moves == 1 and len(ids) == 30
        # the stuck node still answers pings: it stays linked, only that try moved
        assert fleet.pools[f"127.0.0.1:{ps}"].state == "ready"
        await fleet.close()


# -- item 2: renewals and pings never wait on the client -------------------------------


async def test_a_client_that_stops_reading_costs_no_lease_and_no_node():
    async with agent_on(MockEngine(model="m", lanes=1, speed=200.0), "x") as (agent, port):
        fleet = Fleet(model="m", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        # leases of 0.3 s: a second of a paused client is three missed renewals if the
        # renewals waited on the client
        runner = SessionRunner(fleet, lease_ms=300)
        await wait_ready(fleet, 1)
        run = runner.run(Job(session="s", model="m", prompt=[1], max_tokens=200,
                             sampling=LONG))
        first = await anext(run)
        assert isinstance(first, list) and first
        # the client pauses: read nothing until the node has finished the whole answer
        await until(lambda: agent.stats_record().lanes_busy == 0 and
                    not fleet.pools[f"127.0.0.1:{port}"].busy, "the session to finish",
                    timeout=5)
        ids = list(first)
        fin = None
        async for item in run:
            if isinstance(item, Finish):
                fin = item
                break
            ids.extend(item)
        assert fin is not None and fin.reason == "length" and fin.moves == 0
        assert len(ids) == 200 and fin.node == "x"
        assert fleet.pools[f"127.0.0.1:{port}"].state == "ready"
        await run.aclose()
        await fleet.close()
