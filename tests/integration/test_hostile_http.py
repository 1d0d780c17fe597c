"""Slow and broken HTTP clients against a head started as the CLI and the app start it
(`Shoal.start`, with the HTTP server's own options), in process on 127.0.0.1.

A client that sends its headers a byte at a time, or never sends anything, is cut off
after the header bound; one that trickles its body gets 408; one that goes away in the
middle of its body costs a log line, not an error. Long answers are never cut by these
bounds. Keys with a small policy, flooded far above their limits, answer 429 with
Retry-After and never 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from pathlib import Path

import aiohttp
import pytest

from engine.api import app as api_app
from tests.drills.record import record, token_free
from tests.integration.conftest import SHOAL, Cluster
from tests.integration.test_service import both, ready, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)
BOUND_S = 1.0  # the header and body bounds in these tests (60 s in a real head)
TRICKLE_S = 0.05  # between two bytes of a trickling client
CHAT = {"model": "mock-m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def base(shoal) -> str:
    assert shoal.api_url is not None
    return shoal.api_url.removesuffix("/v1")


def port(shoal) -> int:
    return int(base(shoal).rsplit(":", 1)[1])


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := await reader.read(4096):
        data += chunk
    return data


async def one_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The status line and body of the next response (Content-Length framed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head.split(b"\r\n", 1)[0], await reader.readexactly(length)


async def trickle(writer: asyncio.StreamWriter, data: bytes, done: asyncio.Event) -> int:
    """Send ``data`` a byte at a time until the server closes; how many bytes went."""
    sent = 0
    for i in range(len(data)):
        if done.is_set():
            break
        try:
            writer.write(data[i:i + 1])
            await writer.drain()
        except (ConnectionError, OSError):
            break
        sent += 1
        await asyncio.sleep(TRICKLE_S)  # the client's pace, not a wait for the server
    return sent


def request_head(path: str, length: int, *, pad: int = 0) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n" + (f"X-Pad: {'a' * pad}\r\n" if pad else "")
            + "\r\n").encode()


async def test_headers_a_byte_at_a_time_are_cut_off(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(api_app, "HEADER_TIMEOUT_S", BOUND_S)
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        # three clients trickling their headers (20 s each at this pace) and one that
        # connects and sends nothing at all
        conns = [await asyncio.open_connection("127.0.0.1", port(shoal)) for _ in range(4)]
        data = request_head("/v1/chat/completions", 2, pad=400) + b"{}"
        stops = [asyncio.Event() for _ in conns]
        senders = [asyncio.create_task(trickle(w, data, stop))
                   for (_r, w), stop in zip(conns[:3], stops, strict=False)]
        try:
            async with asyncio.timeout(10):  # far less than the 20 s the trickle needs
                answers = await asyncio.gather(*(closed_by_server(r) for r, _w in conns))
        finally:
            for stop in stops:
                stop.set()
            sent = await asyncio.gather(*senders)
            for _r, w in conns:
                w.close()
        assert answers == [b""] * 4  # closed without an answer
        assert all(0 < n < len(data) for n in sent), sent
        # the bound never cuts an answer: a stream longer than it is read to its end
        async with aiohttp.ClientSession() as http:
            body = {**CHAT, "max_tokens": 400, "stream": True}  # 2 s at 200 tokens/s
            async with http.post(f"{base(shoal)}/v1/chat/completions", json=body) as r:
                raw = await r.text()
        assert raw.rstrip().endswith("data: [DONE]")
    record("http_slow_headers", kind="hostile",
           tried="clients sending their request headers a byte every 50 ms, and one "
                 "sending nothing, against the header bound (1 s here, 60 s by default)",
           times=4, outcome="each connection closed at the bound without an answer; a "
                            "2 s stream on the same head was read to its end",
           tokens_lost=None, failed_clear=None)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
async def test_a_trickled_body_gets_408(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        path: str):
    monkeypatch.setattr(api_app, "BODY_TIMEOUT_S", BOUND_S)
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 400}]})
        reader, writer = await asyncio.open_connection("127.0.0.1", port(shoal))
        writer.write(request_head(path, len(body)))
        stop = asyncio.Event()
        sender = asyncio.create_task(trickle(writer, body.encode(), stop))
        try:
            async with asyncio.timeout(10):  # far less than the 20 s the trickle needs
                status_line, raw = await one_response(reader)
        finally:
            stop.set()
            await sender
            writer.close()
        assert status_line.startswith(b"HTTP/1.1 408"), (status_line, raw[:300])
        error = json.loads(raw)["error"]
        message = error if path.startswith("/api/") else error["message"]
        assert "did not arrive within 1 s" in message
        status, _ = await chat(shoal)
        assert status == 200
    record(f"http_slow_body_{path.strip('/').split('/')[0]}", kind="hostile",
           tried=f"a body trickled a byte every 50 ms to {path} (body bound 1 s here, "
                 "60 s by default)",
           times=1, outcome="408 in the route's error shape at the bound; the head served "
                            "the next request", tokens_lost=None, failed_clear=None)


async def chat(shoal, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, \
            http.post(f"{base(shoal)}/v1/chat/completions", json=CHAT,
                      headers=headers or {}) as r:
        return r.status, {"body": await r.json(), **r.headers}


async def test_a_client_gone_in_the_middle_of_its_body_is_no_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    async with running(both(tmp_path)) as shoal:
        await ready(shoal)
        for path in ("/v1/chat/completions", "/api/generate", "/v1/aliases/x"):
            _reader, writer = await asyncio.open_connection("127.0.0.1", port(shoal))
            writer.write(request_head(path, 5000) + b'{"model": "mock-m", "mess')
            await writer.drain()
            writer.transport.abort()
        async with aiohttp.ClientSession() as http:
            async def metrics() -> str:
                async with http.get(f"{base(shoal)}/metrics") as r:
                    return await r.text()
            await until(lambda: _counted(metrics, 3), "the three cut requests to be counted")
            text = await metrics()
        assert 'status="500"' not in text
        assert (await chat(shoal))[0] == 200
    assert "unexpected error" not in caplog.text and "Traceback" not in caplog.text
    record("http_body_cut", kind="hostile",
           tried="a client that closes its connection in the middle of its body, on three "
                 "routes", times=3, outcome="no 500 and no traceback; the head served on",
           tokens_lost=None, failed_clear=None)


async def _counted(metrics, count: int) -> bool:
    text = await metrics()
    lines = [line for line in text.splitlines()
             if line.startswith("shoal_requests_total") and 'method="POST"' in line
             and 'method="POST",status="200"' not in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= count


# -- floods above the rate limits ------------------------------------------------------


async def test_keys_flooded_above_their_limits_get_429_never_500(cluster: Cluster,
                                                                  tmp_path: Path):
    """A head process (the flood's bursts would stall a loop that also runs the client)."""
    token = cluster.token()
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": {"rpm": 30, "burst": 5, "concurrent": 2}}))
    alice, bob = (subprocess.run([*SHOAL, "keys", "issue", name], env=cluster.env,
                                 capture_output=True, text=True, timeout=30,
                                 check=True).stdout.strip() for name in ("alice", "bob"))
    head = cluster.head([], extra=("--keys", "on", "--key-policy", str(policy),
                                   "--mock-speed", "200"))
    url = f"http://127.0.0.1:{head.port}/v1/chat/completions"
    statuses: dict[str, list[int]] = {"alice": [], "bob": [], "none": [], "wrong": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=300)) as http:
        async def one(who: str, key: str | None) -> None:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with http.post(url, json={**CHAT, "max_tokens": 20},
                                 headers=headers) as r:
                text = await r.text()
                statuses[who].append(r.status)
                if r.status == 429:
                    assert int(r.headers["Retry-After"]) >= 1
                    assert json.loads(text)["error"]["type"] == "rate_limit_error"
                elif r.status != 200:
                    assert r.status == 401, text

        async with asyncio.timeout(60):
            await asyncio.gather(*(one("alice", alice) for _ in range(150)),
                                 *(one("bob", bob) for _ in range(50)),
                                 *(one("none", None) for _ in range(25)),
                                 *(one("wrong", alice[:-4] + "AAAA") for _ in range(25)))
        async with http.post(url, json=CHAT, headers={"Authorization": f"Bearer {bob}"}) as r:
            after = r.status
    flat = [s for v in statuses.values() for s in v]
    assert 500 not in flat and set(flat) <= {200, 401, 429}
    # at most the burst at once (and what refilled meanwhile), each key on its own budget
    assert 1 <= statuses["alice"].count(200) <= 7 and statuses["alice"].count(429) >= 140
    assert 1 <= statuses["bob"].count(200) <= 7
    assert statuses["none"] == [401] * 25 and statuses["wrong"] == [401] * 25
    assert after in (200, 429)
    log = head.log_text()
    assert "Traceback" not in log and "unexpected error" not in log
    for name, key in (("alice", alice), ("bob", bob)):
        # the signature itself (base64url: it may hold "-"), never a piece of it
        signature = key.removeprefix(f"sk-shoal-{name}-")
        assert len(signature) >= 40 and signature not in log
    token_free({"head": log}, token)
    record("rate_limit_flood", kind="hostile",
           tried="250 requests at once: 150 with one key and 50 with another (policy: 30 a "
                 "minute, burst 5, 2 at once), 25 without a key, 25 with a forged key",
           times=len(flat),
           outcome=f"alice {statuses['alice'].count(200)} served, "
                   f"{statuses['alice'].count(429)} answered 429 with Retry-After; bob "
                   f"{statuses['bob'].count(200)} served on his own budget; 50 answered 401; "
                   "no 500", tokens_lost=None, failed_clear=None)
