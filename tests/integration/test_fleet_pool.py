"""A head in process and a scripted node on the real link (127.0.0.1, Noise): what the
head does with a node's prefill progress and the report of its shared KV pool.

The scripted node speaks the link's records itself, so each test decides exactly what
the node says and when (its pace is set by the head's own renewals, never by a clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from engine.errors import RequestError
from engine.head.fleet.links import Fleet, NodePool
from engine.head.fleet.sessions import Finish, Job, SessionRunner
from engine.head.head import Head
from engine.link import messages as m
from engine.link.hello import exchange_hellos
from engine.link.transport import Incoming, Link, LinkClosed, accept, dial, serve
from tests.integration.test_api_surface import mock_model, parse_metrics, serving
from tests.integration.test_hostile_link import TOKEN, join_listener
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
LEASE_MS = 600  # renewals every 0.2 s; a 10-token prompt's first token is due 0.8 s after
RENEWALS = 10  # the scripted prefill: 2 s of renewals, well past that bound


@dataclass
class Joined:
    link: Link
    hello: m.HeadHello  # what the head said
    fleet: Fleet
    pool: NodePool


def node_hello(identity: str = "s", lanes: int = 1) -> m.NodeHello:
    return m.NodeHello(identity=identity, model="m", runtime="scripted",
                       context_window=4096, lanes=lanes)


@contextlib.asynccontextmanager
async def joined_node(identity: str = "s") -> AsyncIterator[Joined]:
    """A head's fleet and join listener, and one scripted node joined to it."""
    listener, fleet, port = await join_listener()
    link: Link | None = None
    try:
        link = await dial("127.0.0.1", port, psk=TOKEN)
        hello = await exchange_hellos(link, node_hello(identity), responder=False,
                                      expect=m.HeadHello, timeout_s=5)
        pool = await until(lambda: next((p for p in fleet.pools.values()
                                         if p.state == "ready"), None), "the node joined")
        yield Joined(link, hello, fleet, pool)
    finally:
        if link is not None:
            link.close()
        await listener.close()
        await fleet.close()


async def prefill_slowly(link: Link, *, report: bool, renewals_due: int = RENEWALS) -> int:
    """Take one generation and prefill it for ``renewals_due`` renewals (answering pings),
    sending a Progress record at each when ``report``, then answer two tokens. Returns
    the renewals seen (fewer when the head gave the session up and dropped the link)."""
    gen = await link.recv()
    assert isinstance(gen, m.Generate)
    link.send(m.Accepted(session=gen.session))
    renewals = 0
    try:
        while renewals < renewals_due:
            rec = await link.recv()
            if isinstance(rec, m.Ping):
                link.send(m.Pong(nonce=rec.nonce))
            elif isinstance(rec, m.Renew):
                renewals += 1
                if report:
                    link.send(m.Progress(prefilled=renewals, prompt=len(gen.prompt)))
        link.send(m.Tokens(ids=[104, 105], index=0))
        link.send(m.Done(finish_reason="length", prompt_tokens=len(gen.prompt),
                         completion_tokens=2))
    except LinkClosed:
        pass
    return renewals


async def run_job(runner: SessionRunner, session: str = "s1", prompt: int = 10,
                  affinity: str | None = None) -> list[int] | RequestError:
    ids: list[int] = []
    try:
        async for item in runner.run(Job(session=session, model="m", prompt=[1] * prompt,
                                         max_tokens=2, affinity=affinity)):
            if isinstance(item, Finish):
                assert item.moves == 0
                return ids
            ids.extend(item)
    except RequestError as exc:
        return exc
    raise AssertionError("the session ended without a Finish")


async def test_a_node_reporting_its_prefill_is_not_failed_over_past_the_first_token_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shoal.head")
    async with joined_node() as node:
        assert node.hello.progress  # the head said it reads Progress
        runner = SessionRunner(node.fleet, lease_ms=LEASE_MS, queue_timeout_s=0.5)
        job = asyncio.create_task(run_job(runner))
        renewals = await prefill_slowly(node.link, report=True)
        assert await job == [104, 105]
        assert renewals == RENEWALS
        assert "no first token" not in caplog.text


async def test_a_node_silent_but_for_pongs_past_the_first_token_bound_is_failed_over(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shoal.head")
    async with joined_node() as node:
        runner = SessionRunner(node.fleet, lease_ms=LEASE_MS, queue_timeout_s=0.5)
        job = asyncio.create_task(run_job(runner))
        renewals = await prefill_slowly(node.link, report=False)
        got = await job
        assert isinstance(got, RequestError), got  # the only node failed it: nowhere to go
        assert renewals < RENEWALS
        assert "no first token in time" in caplog.text


async def report_rates(node: Joined, rates: m.Rates) -> None:
    node.link.send(m.Stats(lanes=1, lanes_busy=0, kv_used=0, kv_total=4096, rates=rates))
    await until(lambda: node.pool.stats is not None, "the node's stats at the head")


async def test_the_first_token_bound_follows_the_nodes_fitted_prefill_cost() -> None:
    async with joined_node() as node:
        # 0.25 s a token: the 10-token prompt is due 2.5 s (and a lease) after accepted,
        # not the 0.2 s that the floor rate gives a node that has not fitted its cost
        await report_rates(node, m.Rates(prefill_tps=40.0, prefill_s_per_token=0.25))
        runner = SessionRunner(node.fleet, lease_ms=LEASE_MS, queue_timeout_s=0.5)
        job = asyncio.create_task(run_job(runner))
        renewals = await prefill_slowly(node.link, report=False, renewals_due=8)  # 1.6 s
        assert await job == [104, 105]
        assert renewals == 8


async def test_the_node_holding_the_conversation_is_given_the_new_tokens_prefill_only(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shoal.head")
    async with joined_node() as node:
        await report_rates(node, m.Rates(prefill_tps=20.0, prefill_s_per_token=0.05))
        runner = SessionRunner(node.fleet, lease_ms=LEASE_MS, queue_timeout_s=0.5)
        first = asyncio.create_task(run_job(runner, "t1", prompt=100, affinity="conv"))
        assert await prefill_slowly(node.link, report=False, renewals_due=0) == 0
        assert await first == [104, 105]
        # the node holds the 102 tokens of the first turn: 8 new ones are due in 0.4 s
        # (and a lease), not the whole 110 in 5.5 s; a silent 1.6 s is too long
        second = asyncio.create_task(run_job(runner, "t2", prompt=110, affinity="conv"))
        renewals = await prefill_slowly(node.link, report=False, renewals_due=8)
        assert isinstance(await second, RequestError)
        assert renewals < 8
        assert "no first token in time" in caplog.text


async def test_a_node_whose_pool_is_full_now_queues_the_request_until_it_has_room() -> None:
    async with joined_node() as node:
        # the window holds 4096 tokens, the pool has room for 50 more now
        node.link.send(m.Stats(lanes=1, lanes_busy=0, kv_used=4046, kv_total=4096,
                               max_prompt=50, kv_parked=0))
        await until(lambda: node.pool.view().max_prompt == 50, "the pool's report")
        runner = SessionRunner(node.fleet, lease_ms=LEASE_MS, queue_timeout_s=20)
        job = asyncio.create_task(run_job(runner, prompt=100))
        await until(lambda: runner.queued == 1, "the request queued for the pool")
        node.link.send(m.Stats(lanes=1, lanes_busy=0, kv_used=100, kv_total=4096,
                               max_prompt=3996, kv_parked=100))
        assert await prefill_slowly(node.link, report=False, renewals_due=0) == 0
        assert await job == [104, 105]


async def test_a_head_that_dials_a_node_says_it_reads_progress() -> None:
    hellos: asyncio.Queue[m.HeadHello] = asyncio.Queue()
    links: list[Link] = []

    async def answer(incoming: Incoming) -> None:
        link = await accept(incoming, psk=TOKEN, timeout_s=5)
        links.append(link)
        await hellos.put(await exchange_hellos(link, node_hello(), responder=True,
                                               expect=m.HeadHello, timeout_s=5))

    tasks: set[asyncio.Task[None]] = set()
    server = await serve(lambda inc: tasks.add(asyncio.create_task(answer(inc))),
                         "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fleet = Fleet(model="m", head_id="h-dial", psk=TOKEN)
    try:
        fleet.add_dialed("127.0.0.1", port)
        hello = await asyncio.wait_for(hellos.get(), 10)
        assert hello.progress and hello.head_id == "h-dial"
    finally:
        await fleet.close()
        for link in links:
            link.close()
        server.close()
        await server.wait_closed()
        await asyncio.gather(*tasks, return_exceptions=True)


REPORT = {"kv_parked": 300, "max_prompt": 3000, "mem_used": 2_000_000_000,
          "mem_budget": 3_000_000_000, "sleep": "asleep", "prompt_from_lanes": 1200,
          "prompt_from_host": 340, "prompt_prefilled": 5600}


async def test_the_fleet_view_and_metrics_show_what_the_node_says_of_its_pool() -> None:
    async with joined_node("pooled") as node:
        node.link.send(m.Stats(lanes=1, lanes_busy=0, kv_used=1000, kv_total=4096,
                               **REPORT))  # type: ignore[arg-type]
        await until(lambda: node.pool.stats is not None, "the node's stats at the head")
        head = Head([mock_model("m")], node.fleet, SessionRunner(node.fleet))
        async with serving(head) as port, aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/fleet") as r:
                (entry,) = (await r.json())["nodes"]
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
    assert entry["identity"] == "pooled"
    assert {k: entry[k] for k in REPORT} == REPORT
    assert node.pool.view().sleep == "asleep" and node.pool.view().kv_parked == 300
    samples = {(name, labels.get("source", "")): value
               for name, labels, value in parse_metrics(text) if labels.get("node") == "pooled"}
    assert samples[("shoal_node_kv_parked", "")] == 300
    assert samples[("shoal_node_memory_used_bytes", "")] == 2_000_000_000
    assert samples[("shoal_node_memory_budget_bytes", "")] == 3_000_000_000
    assert {source: samples[("shoal_node_prompt_tokens_total", source)]
            for source in ("lane", "host", "prefill")} == {"lane": 1200, "host": 340,
                                                          "prefill": 5600}


GPU = "Vulkan0 (NVIDIA GeForce RTX 4070)"


async def test_the_fleet_view_ps_and_metrics_say_where_the_nodes_model_runs(tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 3100)
    model = mock_model("m")
    model.vocab.path = str(gguf)  # type: ignore[attr-defined]  # a model file of 3100 bytes

    async def views(node: Joined, sent: m.Stats) -> tuple[dict[str, Any], dict[str, Any], str]:
        node.link.send(sent)
        await until(lambda: node.pool.stats == sent, "the node's stats at the head")
        head = Head([model], node.fleet, SessionRunner(node.fleet))
        async with serving(head) as port, aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/fleet") as r:
                (entry,) = (await r.json())["nodes"]
            async with http.get(f"http://127.0.0.1:{port}/api/ps") as r:
                (ps,) = (await r.json())["models"]
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        return entry, ps, text

    async with joined_node("gpu") as node:
        entry, ps, text = await views(node, m.Stats(
            lanes=1, lanes_busy=0, kv_used=0, kv_total=4096, device=GPU, gpu_layers=20,
            model_layers=31))
        assert (entry["device"], entry["gpu_layers"], entry["model_layers"]) == (GPU, 20, 31)
        assert (ps["size"], ps["size_vram"]) == (3100, 2000)  # 20 of 31 layers' share
        assert (ps["shoal"]["device"], ps["shoal"]["gpu_layers"]) == (GPU, 20)
        samples = {name: value for name, labels, value in parse_metrics(text)
                   if labels.get("node") == "gpu"}
        assert samples["shoal_node_gpu_layers"] == 20
        assert samples["shoal_node_model_layers"] == 31
        # the same node on its CPU: no device, nothing on a GPU
        entry, ps, text = await views(node, m.Stats(lanes=1, lanes_busy=0, kv_used=0,
                                                    kv_total=4096, model_layers=31))
        assert (entry["device"], entry["gpu_layers"], entry["model_layers"]) == (None, 0, 31)
        assert (ps["size"], ps["size_vram"]) == (3100, 0)
        assert ps["shoal"]["device"] is None
        assert [v for name, labels, v in parse_metrics(text)
                if name == "shoal_node_gpu_layers" and labels.get("node") == "gpu"] == [0]
