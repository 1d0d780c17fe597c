"""Deeply nested JSON and msgpack against real `shoal` processes on 127.0.0.1.

Thousands of nested brackets once made the decoders raise RecursionError: the HTTP
routes answered 500 with a traceback in the log, and a link record left the socket
open with its task dead. Now each route answers 400 in its own error shape and a link
closes with one log line.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter

import aiohttp
import pytest

from engine.head.access.admin_secret import HEADER as ADMIN_HEADER
from engine.head.access.admin_secret import admin_secret_path
from engine.link import messages as m
from engine.link.transport import Link, LinkClosed, dial
from tests.drills.record import record
from tests.integration.conftest import Cluster, Proc
from tests.integration.test_fleet import chat_body, url
from tests.waiting import until

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
    await until(lambda: needle in proc.log_text(), f"{needle!r} in the log of {proc.name}",
                timeout=timeout)
    return proc.log_text()


def assert_clean_log(proc: Proc) -> None:
    text = proc.log_text()
    assert "Traceback" not in text, text
    assert "RecursionError" not in text, text
    assert "Error handling request" not in text, text


async def test_deep_bodies_get_400_in_the_route_shape(cluster: Cluster):
    head = cluster.head([])
    # the alias routes are read as `shoal alias` calls them, with the admin secret
    admin = {ADMIN_HEADER: admin_secret_path(cluster.home).read_text().strip()}
    async with aiohttp.ClientSession() as http:
        for method, path, body, shape in ROUTES:
            async with http.request(method, url(head, path), data=body,
                                    headers={"Content-Type": "application/json",
                                             **admin}) as r:
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


# -- wide and odd JSON, on every route that reads a body ---------------------------------

# a valid body for the routes that generate; others get {"model": "mock-m"} to mangle
BODIES: dict[str, dict] = {
    "/v1/chat/completions": chat_body(max_tokens=3),
    "/v1/completions": {"model": "mock-m", "prompt": "hi", "max_tokens": 3},
    "/api/chat": {"model": "mock-m", "stream": False, "options": {"num_predict": 3},
                  "messages": [{"role": "user", "content": "hi"}]},
    "/api/generate": {"model": "mock-m", "prompt": "hi", "stream": False,
                      "options": {"num_predict": 3}},
    "/api/show": {"model": "mock-m"},
}


def odd_bodies(body: dict) -> list[tuple[str, bytes]]:
    """What a careless or hostile client sends instead of ``body``."""
    plain = json.dumps(body)
    wide_list = next((k for k in ("messages",) if k in body), None)
    cases = [
        ("wide object", (plain[:-1] + "".join(f', "k{i}": {i}' for i in range(100_000))
                         + "}").encode()),
        ("long string", json.dumps({**body, "model": "m" * 1_000_000}).encode()),
        ("NaN and Infinity", plain.replace('"mock-m"', '"mock-m", "temperature": NaN, '
                                           '"top_p": Infinity', 1).encode()),
        ("huge numbers", plain.replace('"mock-m"', '"mock-m", "max_tokens": 1e999, '
                                       '"seed": ' + "9" * 400, 1).encode()),
        ("lone surrogate", plain.replace('"hi"', '"\\ud800"').encode()),
        ("invalid UTF-8", plain.encode().replace(b'"mock-m"', b'"mock-\xff\xfe"')),
        ("a byte order mark", b"\xef\xbb\xbf" + plain.encode()),
        ("duplicate keys", (plain[:-1] + ', "model": 7}').encode()),
        ("top-level array", f"[{plain}]".encode()),
        ("top-level string", b'"hello"'),
        ("null", b"null"),
        ("empty", b""),
        ("truncated", plain.encode()[: len(plain) // 2]),
        ("types swapped", json.dumps({k: [v] for k, v in body.items()}).encode()),
        ("over the body limit", b'{"model": "' + b"m" * (9 * 1024 * 1024) + b'"}'),
    ]
    if wide_list:
        cases.append(("wide list", json.dumps(
            {**body, wide_list: [{"role": "user", "content": "x"}] * 100_000}).encode()))
    return cases


async def test_wide_and_odd_bodies_never_get_a_500(cluster: Cluster):
    """Every route of /openapi.json that takes a body, fed wide, odd and broken JSON: a
    4xx in its own error shape with a one-line message (or an answer), never a 500 or a
    traceback, and the head serves on."""
    head = cluster.head([])
    statuses: Counter[int] = Counter()
    async with aiohttp.ClientSession() as http:
        async with http.get(url(head, "/openapi.json")) as r:
            spec = await r.json()
        routes = [(method.upper(), path) for path, item in spec["paths"].items()
                  for method, op in item.items() if "requestBody" in op]
        assert set(BODIES) <= {path for _, path in routes}, routes
        for method, path in routes:
            body = BODIES.get(path, {"model": "mock-m"})
            target = re.sub(r"\{[^}]+\}", "x", path)
            for what, raw in odd_bodies(body):
                async with http.request(method, url(head, target), data=raw,
                                     headers={"Content-Type": "application/json"}) as r:
                    text = await r.text()
                statuses[r.status] += 1
                assert r.status < 500, (path, what, r.status, text[:500])
                if r.status >= 400:
                    err = json.loads(text)["error"]
                    message = err if isinstance(err, str) else err["message"]
                    assert message and "\n" not in message, (path, what, message)
                    assert len(message) < 1000, (path, what, len(message))
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body(max_tokens=3)) as r:
            assert r.status == 200, await r.text()
    assert_clean_log(head)
    assert statuses[400] > 0 and statuses[413] > 0, statuses
    record("http_wide_odd_json", kind="hostile",
           tried="wide objects and lists (100k keys or messages), a 1 MiB string, NaN, "
                 "1e999, a 400-digit int, lone surrogates, invalid UTF-8, a BOM, duplicate "
                 "keys, non-object bodies, truncated and empty bodies, swapped types, a "
                 f"9 MiB body, on all {len(routes)} routes of /openapi.json that take a "
                 "body (OpenAI, Ollama, aliases)",
           times=sum(statuses.values()),
           outcome="statuses " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
                   + "; never a 500 or a traceback; every error one line; the head served on",
           tokens_lost=None, failed_clear=None)
