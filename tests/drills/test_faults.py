"""Drills around the soak: a fleet with no node left, a head restarted under load, clients
that go away or read slowly, and two heads sharing one-lane nodes."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from tests.drills.conftest import (
    DrillCluster,
    StreamResult,
    chat_body,
    fleet,
    long_seeds,
    ready_nodes,
    reference,
    stop_gracefully,
    stream,
)
from tests.drills.record import record, token_free
from tests.integration.conftest import Proc
from tests.waiting import until

pytestmark = [pytest.mark.drills, pytest.mark.slow, pytest.mark.timeout(150)]
PROMPT = "drill: tell me a long story about a shoal of fish"


def base(head: Proc) -> str:
    return f"http://127.0.0.1:{head.port}"


async def lanes_busy(http: aiohttp.ClientSession, head: Proc, identity: str | None = None) -> int:
    nodes = (await fleet(http, base(head)))["nodes"]
    return sum(n["lanes_busy"] for n in nodes if identity in (None, n["identity"]))


def noting(flowing: set[int], seed: int) -> Callable[[StreamResult], Awaitable[None]]:
    """An ``on_chunk`` that adds ``seed`` to ``flowing`` once its stream has text."""
    async def on_chunk(got: StreamResult) -> None:
        if got.text:
            flowing.add(seed)
    return on_chunk


def no_traceback(cluster: DrillCluster) -> None:
    for name, text in cluster.logs_text().items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"


# -- no capable node left ----------------------------------------------------------------


async def test_streams_end_with_a_clear_error_when_no_node_is_left(cluster: DrillCluster):
    """Both nodes die mid-stream: every stream ends with an error event that names the
    cause, after only tokens of its uninterrupted run; none just stops."""
    token = cluster.token()
    nodes = [cluster.node(f"n{i}", lanes=8, speed=40.0) for i in range(2)]
    head = cluster.head(nodes, extra=("--queue-timeout", "3"))
    seeds = long_seeds(PROMPT, 400, 12)
    async with aiohttp.ClientSession() as http:
        await until(lambda: _count_ready(http, head, 2), "both nodes")
        flowing: set[int] = set()
        tasks = [asyncio.create_task(stream(http, base(head), chat_body(PROMPT, s, 400),
                                            on_chunk=noting(flowing, s))) for s in seeds]
        # mid-stream: every client has text (a session placed but not yet answering would
        # get a 503 instead of an error event, which is another case)
        await until(lambda: len(flowing) == len(seeds), "every stream to flow")
        for node in nodes:
            node.signal(signal.SIGKILL)
        async with asyncio.timeout(60):
            results = await asyncio.gather(*tasks)
    clear = 0
    for seed, res in zip(seeds, results, strict=True):
        ref, _ = reference(PROMPT, seed, 400)
        assert res.error is not None and res.clear_error, (seed, res.broken, res.events[-3:])
        assert res.broken is None, res.broken
        assert res.error["code"] in ("no_node_available", "fleet_busy"), res.error
        assert 0 < len(res.text) < len(ref) and ref.startswith(res.text)
        clear += 1
    assert "Traceback" not in head.log_text()
    token_free(cluster.logs_text(), token)
    record("no_node_left", kind="drill",
           tried="12 streams running on 2 nodes; both nodes killed (SIGKILL) mid-stream",
           times=len(seeds),
           outcome=f"{clear} ended with an error event `{results[0].error['code']}` that "
                   "names the cause; every token before it was the uninterrupted run's; "
                   "none cut short",
           tokens_lost=0, failed_clear=clear)


async def _count_ready(http: aiohttp.ClientSession, head: Proc, count: int) -> bool:
    return len(await ready_nodes(http, base(head))) >= count


# -- a head restarted under load ---------------------------------------------------------


async def test_head_restarted_under_load(cluster: DrillCluster):
    """SIGTERM, then SIGKILL, a head with streams in flight: each in-flight stream ends
    with a clear error (SIGTERM) or a broken connection the client sees (SIGKILL), never
    a stream that looks complete; the head started again on the same port serves at
    once, with every lane of the nodes free."""
    token = cluster.token()
    nodes = [cluster.node(f"n{i}", lanes=8, speed=40.0) for i in range(2)]
    head = cluster.head(nodes)
    port = head.port
    seeds = long_seeds(PROMPT, 1500, 16)
    figures: dict[str, object] = {}
    async with aiohttp.ClientSession() as http:
        for how in ("SIGTERM", "SIGKILL"):
            await until(lambda h=head: _count_ready(http, h, 2), "both nodes")
            url = base(head)
            flowing: set[int] = set()
            tasks = [asyncio.create_task(stream(http, url, chat_body(PROMPT, s, 1500),
                                                on_chunk=noting(flowing, s))) for s in seeds]
            await until(lambda flowing=flowing: len(flowing) == len(seeds), "every stream to flow")
            if how == "SIGTERM":
                await asyncio.to_thread(stop_gracefully, head, 40)
            else:
                head.signal(signal.SIGKILL)
                await asyncio.to_thread(head.popen.wait, 10)
            async with asyncio.timeout(30):
                results = await asyncio.gather(*tasks)
            for seed, res in zip(seeds, results, strict=True):
                ref, _ = reference(PROMPT, seed, 1500)
                assert not res.done, f"{how}: a stream looked complete: {res.events[-2:]}"
                assert 0 < len(res.text) < len(ref) and ref.startswith(res.text), how
                if how == "SIGTERM":  # the head could say why: it must have
                    assert res.clear_error and res.broken is None, (res.broken, res.error)
                else:
                    assert res.broken is not None, res.events[-2:]
            figures[how] = {"in_flight": len(seeds),
                            "clear_error": sum(r.clear_error for r in results),
                            "broken": sum(r.broken is not None for r in results),
                            "code": next((r.error["code"] for r in results if r.error), None)}
            # started again on the same port: it serves at once, with every lane free
            restarted_at = time.monotonic()
            head = cluster.head(nodes, port=port)
            await until(lambda h=head: _count_ready(http, h, 2), "both nodes, again")
            await until(lambda h=head: _all_free(http, h), "every lane of the nodes free")
            burst = await asyncio.gather(*(stream(http, base(head), chat_body(PROMPT, s, 20))
                                           for s in seeds))
            assert all(r.completed for r in burst), [r.broken or r.error for r in burst]
            figures[how]["serving_after_s"] = round(time.monotonic() - restarted_at, 1)
    no_traceback(cluster)
    token_free(cluster.logs_text(), token)
    term, kill = figures["SIGTERM"], figures["SIGKILL"]
    record("head_restart", kind="drill",
           tried="a head with 16 streams in flight stopped by SIGTERM, then by SIGKILL, and "
                 "started again on the same port",
           times=2 * len(seeds),
           outcome=(f"SIGTERM: {term['clear_error']}/{term['in_flight']} ended with an error "
                    f"event `{term['code']}`; SIGKILL: {kill['broken']}/{kill['in_flight']} "
                    "saw the connection break (no [DONE]); the new head served 16 streams "
                    "at once on every lane"),
           tokens_lost=0, failed_clear=term["clear_error"] + kill["broken"], **figures)


async def _all_free(http: aiohttp.ClientSession, head: Proc) -> bool:
    return await lanes_busy(http, head) == 0


# -- clients that go away, and clients that read slowly ----------------------------------


async def raw_request(port: int, path: str, body: dict, *, rcvbuf: int | None = None
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one HTTP request on a socket of our own (optionally with a tiny receive
    buffer, so that a client that does not read pushes back on the head)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 "Connection: close\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


DISCONNECTS = [
    ("/v1/chat/completions", True), ("/v1/chat/completions", False),
    ("/api/chat", True), ("/api/generate", False), ("/v1/completions", True),
]


async def test_a_client_that_goes_away_frees_its_lane_within_a_second(cluster: DrillCluster):
    token = cluster.token()
    node = cluster.node("n0", lanes=2, speed=20.0)
    head = cluster.head([node])
    freed = 0
    async with aiohttp.ClientSession() as http:
        await until(lambda: _count_ready(http, head, 1), "the node")
        for path, streaming in DISCONNECTS:
            if path.startswith("/api/"):
                body: dict = {"model": "mock-m", "stream": streaming,
                              "options": {"num_predict": 2000, "seed": 3}}
                if path == "/api/chat":
                    body["messages"] = [{"role": "user", "content": PROMPT}]
                else:
                    body["prompt"] = PROMPT
            elif path == "/v1/completions":
                # seeded as the others: unseeded, the mock's end of text can come with
                # the first token, and the stream end before its lane is seen taken
                body = {"model": "mock-m", "prompt": PROMPT, "max_tokens": 2000,
                        "stream": streaming, "seed": 3}
            else:
                body = {**chat_body(PROMPT, 3, 2000), "stream": streaming}
            reader, writer = await raw_request(head.port, path, body)
            await until(lambda: _lane_taken(http, head), f"{path} to take a lane")
            if streaming:  # tokens are flowing to the client
                async with asyncio.timeout(10):
                    await reader.readuntil(b"\r\n\r\n")
                    await reader.read(200)
            writer.transport.abort()  # gone, without a goodbye
            await until(lambda: _all_free(http, head), f"the lane of {path} "
                        f"({'stream' if streaming else 'one answer'}) to be free", timeout=1.0)
            freed += 1
        state = await fleet(http, base(head))
    assert state["nodes"][0]["peak_busy"] == 1
    no_traceback(cluster)
    token_free(cluster.logs_text(), token)
    record("client_disconnect", kind="drill",
           tried="a client that drops its connection mid-answer: OpenAI chat streamed and "
                 "not, Ollama chat streamed, Ollama generate not, completions streamed",
           times=len(DISCONNECTS),
           outcome=f"{freed}/{len(DISCONNECTS)} lanes free within 1 s of the drop "
                   "(the node cancels the generation)",
           tokens_lost=None, failed_clear=None)


async def _lane_taken(http: aiohttp.ClientSession, head: Proc) -> bool:
    return await lanes_busy(http, head) >= 1


async def test_a_client_that_reads_slowly_costs_no_node_anything(cluster: DrillCluster):
    """A stream whose client stops reading for longer than a lease: the node finishes
    and frees its lane while the client has read nothing more; no failover, no fence;
    the client then gets every token."""
    token = cluster.token()
    node = cluster.node("n0", lanes=2, speed=50.0)
    head = cluster.head([node])
    (seed,) = long_seeds(PROMPT, 600, 1)
    ref, _ = reference(PROMPT, seed, 600)
    async with aiohttp.ClientSession() as http:
        await until(lambda: _count_ready(http, head, 1), "the node")
        reader, writer = await raw_request(head.port, "/v1/chat/completions",
                                           chat_body(PROMPT, seed, 600), rcvbuf=2048)
        try:
            async with asyncio.timeout(10):
                head_bytes = await reader.readuntil(b"\r\n\r\n")
                first = await reader.read(512)
            # now the client reads nothing: the node generates for 12 s, past its lease
            await until(lambda: _lane_taken(http, head), "the stream to take a lane")
            await until(lambda: _all_free(http, head), "the node to finish while the "
                        "client reads nothing", timeout=40)
            state = await fleet(http, base(head))
            async with asyncio.timeout(30):
                rest = await reader.read()
        finally:
            writer.close()
    assert b" 200 " in head_bytes.split(b"\r\n")[0]
    body = _unchunk(first + rest)
    res = StreamResult()
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: "):
            from tests.drills.conftest import _event
            _event(res, block[6:].decode())
    assert res.completed and res.text == ref, (len(res.text), len(ref), res.events[-2:])
    assert res.usage and res.usage["completion_tokens"] == 600
    (only,) = state["nodes"]
    assert only["state"] == "ready" and only["sessions_total"] == 1, only
    head_log, node_log = head.log_text(), node.log_text()
    for needle in ("moved from", "treating the node as hung", "lost node"):
        assert needle not in head_log, head_log[-2000:]
    assert "missed its lease renewal" not in node_log, node_log[-2000:]
    no_traceback(cluster)
    token_free(cluster.logs_text(), token)
    record("slow_reader", kind="drill",
           tried="a streaming client with a 2 KiB receive buffer that stops reading while "
                 "its 600 tokens are generated (12 s, past the 10 s lease), then reads all",
           times=1,
           outcome="the node finished and freed its lane while the client read nothing; no "
                   "failover, no fence, one placement; the client then read every token, "
                   "identical to the uninterrupted run",
           tokens_lost=0, failed_clear=0)


def _unchunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP response."""
    out, rest = b"", raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return out


# -- two heads on the same one-lane nodes ------------------------------------------------


async def test_two_heads_under_load_never_exceed_a_lane(cluster: DrillCluster):
    token = cluster.token()
    nodes = [cluster.node(f"n{i}", lanes=1, speed=200.0) for i in range(3)]
    heads = [cluster.head(nodes), cluster.head(nodes)]
    seeds = long_seeds(PROMPT, 40, 24)
    async with aiohttp.ClientSession() as http:
        for h in heads:
            await until(lambda h=h: _count_ready(http, h, 3), "three nodes at each head")
        results = await asyncio.gather(*(
            stream(http, base(heads[i % 2]), chat_body(PROMPT, s, 40))
            for i, s in enumerate(seeds)))
        state = await until(lambda: _idle(http, heads[0]), "every node to report idle")
    for seed, res in zip(seeds, results, strict=True):
        assert res.completed and res.text == reference(PROMPT, seed, 40)[0], res
    peaks = [n["peak_busy"] for n in state["nodes"]]
    assert peaks == [1, 1, 1], state
    full = sum(h.log_text().count("is full (") for h in heads)
    assert full > 0, "the heads never met on a node: the drill tested nothing"
    no_traceback(cluster)
    token_free(cluster.logs_text(), token)
    record("two_heads", kind="drill",
           tried="two heads placing 24 concurrent streams (12 each) on three one-lane nodes",
           times=len(seeds),
           outcome=f"every node's peak was 1 busy lane; {full} placements found a node full "
                   "(taken by the other head) and went to the next; all 24 identical to "
                   "their uninterrupted runs",
           tokens_lost=0, failed_clear=0, refusals_busy=full)


async def _idle(http: aiohttp.ClientSession, head: Proc) -> dict | None:
    state = await fleet(http, base(head))
    return state if all(n["lanes_busy"] == 0 for n in state["nodes"]) else None
