"""A client that holds a stream open and reads nothing does not keep the head's handler,
the session's lane or its key's concurrency slot: once its socket's buffers are full, a
write that finds no room for the head's ``write_timeout_s`` (30 s by default; shortened
here on the Head, as the keepalive tests shorten ``keepalive_s``) ends the answer.

A real head and mock node in this loop and a real client socket that sends its request
and never reads (its receive buffer made small, so that the buffers fill soon)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from engine.head.access import keys
from engine.runtimes import mock
from engine.runtimes.mock import MockEngine
from tests.integration.test_api_surface import MODEL, live_head
from tests.waiting import until, until_result

pytestmark = pytest.mark.timeout(300)
SECRET = bytes(range(7, 39))
WINDOW = 1 << 21  # room for an answer far longer than every buffer on the way
STALL_S = 0.5


async def silent_client(port: int, body: bytes, key: str) -> socket.socket:
    """A connection that sends one request and never reads its answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        await loop.sock_sendall(sock, head + body)
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.mark.slow  # seconds of waiting: out of the quick selection
async def test_a_client_that_reads_nothing_frees_its_lane_and_its_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a mock model that never ends its answer by itself: it runs to max_tokens
    monkeypatch.setattr(mock, "_EOS_ONE_IN", 1 << 62)
    policy = keys.Policy(default=keys.Limits(rpm=60_000, burst=1000, concurrent=1))
    key = keys.issue_key(SECRET, "reader")
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": WINDOW - 64,
                       "messages": [{"role": "user", "content": "talk"}]}).encode()
    async with live_head(lanes=1, keys_secret=SECRET, key_policy=policy,
                         write_timeout_s=STALL_S,
                         make_engine=lambda name: MockEngine(model=name, lanes=1,
                                                             context_window=WINDOW)) as live, \
            aiohttp.ClientSession() as http:
        agent = live.agents[0]

        async def models() -> int:
            async with http.get(live.url("/v1/models"),
                                headers={"Authorization": f"Bearer {key}"}) as r:
                return r.status

        sock = await silent_client(live.port, body, key)
        try:
            await until(lambda: agent.stats_record().lanes_busy == 1,
                        "the silent client's stream to take the lane")
            assert live.head.runner.live == 1
            assert await models() == 429  # the stream holds the key's one slot
            # its buffers fill, its writes wait, and after STALL_S the head lets it go
            # (how many tokens fill them is the kernel's to say: a generous bound, for a
            # busy machine that produces them slowly)
            assert await until_result(models, lambda status: status == 200,
                                      what="the key's slot freed", timeout=200) == 200
            await until(lambda: agent.stats_record().lanes_busy == 0,
                        "the node's lane freed")
            assert live.head.runner.live == 0
            async with http.get(live.url("/metrics"),
                                headers={"Authorization": f"Bearer {key}"}) as r:
                assert 'shoal_stream_errors_total{code="client_stalled"} 1' in await r.text()
        finally:
            sock.close()
