"""Deeply nested JSON and msgpack against real `shoal` processes on 127.0.0.1.

Thousands of nested brackets once made the decoders raise RecursionError: the HTTP
routes answered 500 with a traceback in the log, and a link record left the socket
open with its task dead. Now each route answers 400 in its own error shape and a link
closes with one log line.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from engine.link import messages as m
from engine.link.transport import Link, LinkClosed, dial
from tests.integration.conftest import Cluster, Proc
from tests.integration.test_fleet import chat_body, url

pytestmark = pytest.mark.timeout(120)
DEPTH = 5000
DEEP = "[" * DEPTH + "]" * DEPTH
# a record tagged "ping" with one extra field holding DEPTH nested arrays
DEEP_RECORD = b"\x93\xa4ping\x01" + b"\x91" * DEPTH + b"\x00"
LOOPBACK_HEAD = ("--fleet-listen", "127.0.0.1:0", "--discovery", "none")


def splice(body: dict, key: str, raw: str) -> bytes:
    """``body`` as JSON with ``"key": raw`` added verbatim."""
    return (json.dumps(body)[:-1] + f', "{key}": {raw}}}').encode()


ROUTES = [
    # method, path, body, shape of the error body
    ("POST", "/v1/chat/completions", splice(chat_body(), "tool_choice", DEEP), "openai"),
    ("POST", "/v1/chat/completions", splice(chat_body(), "unknown", DEEP), "openai"),
    ("POST", "/v1/chat/completions",
     splice(chat_body(), "tool_choice", "[" * 200 + "]" * 200), "openai"),
    ("POST", "/v1/chat/completions", json.dumps(chat_body(messages=[
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": DEEP}}]},
        {"role": "user", "content": "go on"}])).encode(), None),  # a string: served
    ("POST", "/v1/completions", splice({"model": "mock-m", "prompt": "hi"}, "x", DEEP),
     "openai"),
    ("POST", "/api/chat", splice({"model": "mock-m", "messages": []}, "format", DEEP),
     "ollama"),
    ("POST", "/api/generate", splice({"model": "mock-m", "prompt": "hi"}, "options", DEEP),
     "ollama"),
    ("POST", "/api/generate", splice({"model": "mock-m", "prompt": "hi"}, "format", DEEP),
     "ollama"),
    ("PUT", "/v1/aliases/x", splice({"target": "mock-m"}, "fallbacks", DEEP), "openai"),
    ("PUT", "/v1/aliases/x", DEEP.encode(), "openai"),
    ("POST", "/v1/aliases/import",
     splice({"format": "shoal-aliases", "version": 1}, "aliases", DEEP), "openai"),
]


async def wait_log(proc: Proc, needle: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.log_text()
        if needle in text:
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"{needle!r} never in the log of {proc.name}:\n{proc.log_text()}")


def assert_clean_log(proc: Proc) -> None:
    text = proc.log_text()
    assert "Traceback" not in text, text
    assert "RecursionError" not in text, text
    assert "Error handling request" not in text, text


async def test_deep_bodies_get_400_in_the_route_shape(cluster: Cluster):
    head = cluster.head([])
    async with aiohttp.ClientSession() as http:
        for method, path, body, shape in ROUTES:
            async with http.request(method, url(head, path), data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                text = await r.text()
                if shape is None:
                    assert r.status == 200, text
                    continue
                assert r.status == 400, (path, r.status, text)
                err = json.loads(text)["error"]
            if shape == "openai":
                assert set(err) >= {"message", "type", "code"}, err
                assert err["type"] == "invalid_request_error"
                message = err["message"]
            else:
                assert isinstance(err, str), err
                message = err
            assert message and "\n" not in message and "Traceback" not in message
        # still serving
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body(max_tokens=3)) as r:
            assert r.status == 200, await r.text()
    assert_clean_log(head)


async def send_raw(link: Link, raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Send ``raw`` as one record's body through the real framing (and encryption)."""
    with monkeypatch.context() as patch:
        patch.setattr(m, "encode", lambda _record: raw)
        link.send(m.Ping(nonce=1))
    await link.drain()


async def assert_closed_by_peer(link: Link) -> None:
    with pytest.raises(LinkClosed):
        async with asyncio.timeout(10):
            while True:
                await link.recv()  # stats and pongs may come first; EOF must follow


def node_hello(identity: str) -> m.NodeHello:
    return m.NodeHello(identity=identity, model="mock-m", runtime="mock", context_window=4096,
                       lanes=1)


@pytest.mark.parametrize("after_hello", [False, True])
async def test_a_deep_record_closes_the_link_at_the_head(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, after_hello: bool):
    psk = bytes.fromhex(cluster.token())
    head = cluster.head([], extra=LOOPBACK_HEAD)
    link = await dial("127.0.0.1", cluster.join_port(head), psk=psk)
    try:
        async with asyncio.timeout(10):
            assert isinstance(await link.recv(), m.HeadHello)
        if after_hello:  # a joined node's connection, read by the fleet
            link.send(node_hello("evil"))
        await send_raw(link, DEEP_RECORD, monkeypatch)
        await assert_closed_by_peer(link)
    finally:
        link.close()
    text = await wait_log(head, "bad record from peer")
    assert len([line for line in text.splitlines() if "bad record from peer" in line]) == 1
    assert_clean_log(head)


async def test_a_deep_record_closes_the_link_at_the_node(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch):
    psk = bytes.fromhex(cluster.token())
    node = cluster.node("n1")
    link = await dial("127.0.0.1", node.port, psk=psk)
    try:
        async with asyncio.timeout(10):
            assert isinstance(await link.recv(), m.NodeHello)
        link.send(m.HeadHello(head_id="h-test", model="mock-m"))
        await send_raw(link, DEEP_RECORD, monkeypatch)
        await assert_closed_by_peer(link)
    finally:
        link.close()
    text = await wait_log(node, "bad record from peer")
    assert len([line for line in text.splitlines() if "bad record from peer" in line]) == 1
    assert_clean_log(node)
