"""What can never be placed is refused at once with its real status; a keepalive commits
only a request that is really waiting for a lane or its tokens; a long prompt never
stalls the head's loop. An in-process head on 127.0.0.1 with mock nodes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.integration.test_api_surface import MODEL, chat_body, live_head
from tests.loopwatch import LoopWatch

pytestmark = pytest.mark.timeout(60)


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with http.post(url, json=body) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_a_pin_to_a_node_the_fleet_does_not_have_is_404_at_once():
    # keepalives every 0.2 s, a queue of 5 s: a request that waited would be committed
    async with live_head(nodes=2, keepalive_s=0.2, queue_timeout_s=5.0) as live, \
            aiohttp.ClientSession() as http:
        status, _headers, body = await _post(
            http, live.url("/v1/chat/completions?host=ghost"), chat_body(max_tokens=3))
        assert status == 404, body
        assert body["error"]["code"] == "node_not_found"
        assert "'ghost'" in body["error"]["message"] and "n0, n1" in body["error"]["message"]
        assert live.head.runner.queued == 0


async def test_a_pin_to_a_node_that_is_down_is_503_with_retry_after():
    async with live_head(nodes=2, keepalive_s=0.2, queue_timeout_s=5.0) as live, \
            aiohttp.ClientSession() as http:
        await live.agents[0].close()
        pools = list(live.head.fleet.pools.values())
        async with asyncio.timeout(10):
            while pools[0].state == "ready":
                await asyncio.sleep(0.02)
        status, headers, body = await _post(
            http, live.url("/v1/chat/completions?host=n0"), chat_body(max_tokens=3))
        assert status == 503, body
        assert headers["Retry-After"] == "10"
        assert body["error"]["code"] == "node_unavailable"
        # the other node still answers
        status, headers, _ = await _post(http, live.url("/v1/chat/completions?host=n1"),
                                         chat_body(max_tokens=3))
        assert status == 200 and headers["X-Shoal-Node"] == "n1"


async def test_waiting_for_a_node_is_not_committed_by_keepalives():
    async with live_head(nodes=1, keepalive_s=0.2, queue_timeout_s=1.0) as live, \
            aiohttp.ClientSession() as http:
        await live.agents[0].close()
        pool = next(iter(live.head.fleet.pools.values()))
        async with asyncio.timeout(10):
            while pool.state == "ready":
                await asyncio.sleep(0.02)
        for path, body in (("/v1/chat/completions", chat_body(max_tokens=3, stream=True)),
                           ("/v1/chat/completions", chat_body(max_tokens=3)),
                           ("/api/generate", {"model": MODEL, "prompt": "hi"})):
            status, headers, answer = await _post(http, live.url(path), body)
            # five keepalive periods passed while it waited: still its real status
            assert status == 503, (path, answer)
            assert headers["Retry-After"] == "10"


async def test_a_long_prompt_is_tokenized_off_the_loop(loop_watch: LoopWatch):
    # 6 MiB of text: the mock tokenizer (pure Python) takes seconds over it
    async with live_head(nodes=1) as live, aiohttp.ClientSession() as http:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        status, _h, body = await _post(http, live.url("/v1/chat/completions"),
                                       chat_body("word " * 1_200_000, max_tokens=3))
        ticker.cancel()
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        # the loop kept turning while the prompt was tokenized (a few tenths of a second,
        # sharing the GIL with the tokenizer's thread); tokenized on the loop, the ticker
        # would not have run more than once or twice
        assert ticks >= 5, ticks
    assert loop_watch.stalls == [], loop_watch.report()
