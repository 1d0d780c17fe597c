"""Keys, revocation, per-key limits and CORS over HTTP, on an in-process head."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import aiohttp
import pytest
from aiohttp import web

from engine.head.access import keys
from engine.runtimes.base import GenerationRequest, GenerationResult
from engine.runtimes.mock import MockEngine, MockGeneration
from tests.integration.conftest import SHOAL, Cluster
from tests.integration.test_api_surface import MODEL, chat_body, live_head, read_lines
from tests.waiting import until, until_result

pytestmark = pytest.mark.timeout(60)
SECRET = bytes(range(100, 132))
T = TypeVar("T")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_static_api_key():
    async with live_head(api_key="s3cret-key") as live, aiohttp.ClientSession() as http:
        async with http.get(live.url("/v1/models")) as r:
            assert r.status == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            err = (await r.json())["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in err["message"]
        async with http.get(live.url("/v1/models"), headers=bearer("wrong")) as r:
            assert r.status == 401
        async with http.post(live.url("/v1/chat/completions"), json=chat_body(max_tokens=2),
                             headers=bearer("s3cret-key")) as r:
            assert r.status == 200
        # Ollama's routes answer in Ollama's error shape
        async with http.get(live.url("/api/tags")) as r:
            assert r.status == 401 and isinstance((await r.json())["error"], str)
        # /health stays open; alias reads take a key too (`shoal alias` sends this
        # machine's admin secret instead: tests/integration/test_admin_trust.py)
        async with http.get(live.url("/health")) as r:
            assert r.status == 200
        async with http.get(live.url("/v1/aliases")) as r:
            assert r.status == 401


async def raw_status(port: int, request: bytes) -> int:
    """The status line's code for ``request`` sent as raw bytes (a client library would
    refuse to send what these tests send)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        return int(status.split()[1])
    finally:
        writer.close()


async def test_a_key_header_that_is_not_utf8_is_refused_as_a_bad_key():
    async with live_head(api_key="s3cret-key") as live:
        for method, path in (("GET", "/v1/models"), ("PUT", "/v1/aliases")):
            for header in (b"Authorization: Bearer s3cret-\xff\xfe", b"x-api-key: \xc3("):
                request = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\n"
                           "Content-Length: 2\r\nConnection: close\r\n").encode() \
                    + header + b"\r\n\r\n{}"
                assert await raw_status(live.port, request) == 401, (method, path, header)


async def test_issued_and_revoked_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    revoked = tmp_path / "fleet" / "revoked.json"
    alice = keys.issue_key(SECRET, "alice")
    forged = keys.issue_key(bytes(32), "alice")
    roomy = keys.Policy(default=keys.Limits(rpm=60_000, burst=1000, concurrent=4))
    async with live_head(keys_secret=SECRET, revoked_path=revoked, key_policy=roomy) as live, \
            aiohttp.ClientSession() as http:
        async def status(key: str) -> tuple[int, str]:
            async with http.get(live.url("/v1/models"), headers=bearer(key)) as r:
                body = await r.json()
                return r.status, body["error"]["message"] if r.status != 200 else ""

        assert (await status(alice))[0] == 200
        assert (await status(forged))[0] == 401
        assert (await status(alice[:-1] + ("A" if alice[-1] != "A" else "B")))[0] == 401
        assert (await status("sk-shoal-"))[0] == 401
        # revoked while the head runs: a request within the watch interval sees it
        await asyncio.to_thread(keys.revoke, revoked, "alice")  # it syncs the file to disk
        code, message = await until_result(lambda: status(alice), lambda r: r[0] == 401)
        assert "key 'alice' has been revoked" in message
        assert (await status(keys.issue_key(SECRET, "bob")))[0] == 200
        await asyncio.to_thread(keys.unrevoke, revoked, "alice")
        await until_result(lambda: status(alice), lambda r: r[0] == 200)
        # a corrupt list keeps the last good one (once the head has read it and said so)
        revoked.write_text("{not json")
        code, _ = await until_result(lambda: status(alice),
                                     lambda _r: "not valid JSON" in caplog.text)
        assert code == 200
        assert "keeping the last good revocation list" in caplog.text


async def test_rate_limit_answers_429_with_retry_after():
    policy = keys.Policy(default=keys.Limits(rpm=6, burst=2, concurrent=4),
                         keys={"carol": keys.Limits(rpm=600, burst=50, concurrent=4)})
    dave, carol = keys.issue_key(SECRET, "dave"), keys.issue_key(SECRET, "carol")
    async with live_head(keys_secret=SECRET, key_policy=policy) as live, \
            aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(3):
            async with http.get(live.url("/v1/models"), headers=bearer(dave)) as r:
                statuses.append(r.status)
                if r.status == 429:
                    retry = int(r.headers["Retry-After"])
                    err = (await r.json())["error"]
        assert statuses == [200, 200, 429]
        assert 1 <= retry <= 10  # a token every 10 s at 6 per minute
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limited_rate"
        assert "6 requests per minute, burst 2" in err["message"]
        # another key has its own bucket (and its own policy entry)
        for _ in range(5):
            async with http.get(live.url("/v1/models"), headers=bearer(carol)) as r:
                assert r.status == 200
        async with http.get(live.url("/metrics"), headers=bearer(carol)) as r:
            text = await r.text()
        assert 'shoal_refused_total{reason="rate"} 1' in text


async def test_concurrency_cap_and_release_on_every_path():
    policy = keys.Policy(default=keys.Limits(rpm=6000, burst=100, concurrent=1))
    erin = keys.issue_key(SECRET, "erin")
    async with live_head(keys_secret=SECRET, key_policy=policy, speed=40.0) as live, \
            aiohttp.ClientSession() as http:
        slow = chat_body(max_tokens=40, seed=1, stream=True)

        async def long_stream() -> int:
            async with http.post(live.url("/v1/chat/completions"), json=slow,
                                 headers=bearer(erin)) as r:
                await r.read()
                return r.status

        first = asyncio.create_task(long_stream())
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first stream to hold its slot")
        async with http.get(live.url("/v1/models"), headers=bearer(erin)) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "rate_limited_concurrency"
        assert await first == 200
        async with http.get(live.url("/v1/models"), headers=bearer(erin)) as r:
            assert r.status == 200  # released when the stream ended
        # refused requests release too (a 404 and a 400)
        async with http.post(live.url("/v1/chat/completions"), json={"model": "nope"},
                             headers=bearer(erin)) as r:
            assert r.status == 400
        async with http.get(live.url("/v1/nothing"), headers=bearer(erin)) as r:
            assert r.status == 404
        # a client that goes away mid-stream releases its slot
        async with http.post(live.url("/v1/chat/completions"),
                             json={**slow, "max_tokens": 400}, headers=bearer(erin)) as r:
            assert r.status == 200
            await r.content.readline()
        # the response is closed here, before the end of the stream

        async def models() -> int:
            async with http.get(live.url("/v1/models"), headers=bearer(erin)) as r:
                return r.status

        await until_result(models, lambda status: status == 200,
                           what="the slot of the stream left mid-way released")


async def test_cors_allow_list_and_preflight():
    allow = keys.parse_allow_list("https://app.example,http://localhost:*")
    async with live_head(cors_allow=allow, api_key="k") as live, \
            aiohttp.ClientSession() as http:
        ok = {"Origin": "https://app.example", **bearer("k")}
        async with http.get(live.url("/v1/models"), headers=ok) as r:
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert "Origin" in r.headers["Vary"]
            assert "X-Shoal-Model" in r.headers["Access-Control-Expose-Headers"]
        # a stream gets them too (its headers leave before the handler returns)
        async with http.post(live.url("/v1/chat/completions"),
                             json=chat_body(max_tokens=3, stream=True),
                             headers={**bearer("k"), "Origin": "http://localhost:5173"}) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
            assert (await read_lines(r))[-2].strip() == "data: [DONE]"
        async with http.get(live.url("/v1/models"),
                            headers={"Origin": "https://evil.example", **bearer("k")}) as r:
            assert r.status == 403
            assert "not allowed" in (await r.json())["error"]["message"]
            assert "Access-Control-Allow-Origin" not in r.headers
        # preflight: answered without a key for an allowed origin, refused otherwise
        pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        async with http.options(live.url("/v1/chat/completions"), headers=pre) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        async with http.options(live.url("/v1/chat/completions"),
                                headers={**pre, "Origin": "https://evil.example"}) as r:
            assert r.status == 403
        # no Origin (curl, SDKs): no CORS headers, served as usual
        async with http.get(live.url("/v1/models"), headers=bearer("k")) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def test_no_keys_configured_means_no_auth():
    async with live_head() as live, aiohttp.ClientSession() as http:
        async with http.post(live.url("/api/generate"),
                             json={"model": MODEL, "prompt": "x", "stream": False,
                                   "options": {"num_predict": 2}}) as r:
            assert r.status == 200 and json.loads(await r.read())["done"]
        async with http.get(live.url("/v1/models"), headers=bearer("anything")) as r:
            assert r.status == 200


async def test_keys_turn_on_when_the_secret_file_appears_and_follow_it(tmp_path: Path):
    home = tmp_path
    secret_file = keys.secret_path(home)
    keys.policy_path(home).write_text(json.dumps(
        {"default": {"rpm": 60_000, "burst": 1000, "concurrent": 4}}))
    async with live_head(keys_secret_path=secret_file, revoked_path=keys.revoked_path(home),
                         key_policy_path=keys.policy_path(home)) as live, \
            aiohttp.ClientSession() as http:
        async def status(key: str | None = None) -> int:
            async with http.get(live.url("/v1/models"),
                                headers=bearer(key) if key else {}) as r:
                return r.status

        assert await status() == 200  # no secret yet: no keys
        # what `shoal keys issue` does, in its own process: off this test's loop (it fsyncs)
        secret = await asyncio.to_thread(keys.load_or_make_secret, secret_file)
        await until_result(status, lambda code: code == 401)
        alice = keys.issue_key(secret, "alice")
        assert await status(alice) == 200
        # an edited policy applies to the running head
        keys.policy_path(home).write_text(json.dumps(
            {"default": {"rpm": 1, "burst": 1, "concurrent": 4}}))
        await until_result(lambda: status(alice), lambda code: code == 429)
        keys.policy_path(home).unlink()  # back to the default limits (burst 10)
        # rotated: the old key is refused, a new one taken
        new = keys.rotate_secret(secret_file)
        await until_result(lambda: status(alice), lambda code: code == 401)
        assert await status(keys.issue_key(new, "bob")) == 200
        # removed: every issued key is refused (it fails closed); no key does not open it
        secret_file.unlink()
        await until_result(lambda: status(keys.issue_key(new, "bob")), lambda code: code == 401)
        assert await status() == 401


async def test_only_hosts_that_name_this_machine_are_served():
    async with live_head() as live, aiohttp.ClientSession() as http:
        async def get(path: str, host: str) -> tuple[int, object]:
            async with http.get(live.url(path), headers={"Host": host}) as r:
                return r.status, await r.json(content_type=None)

        for host in (f"127.0.0.1:{live.port}", f"localhost:{live.port}", "localhost",
                     f"[::1]:{live.port}", "ui.localhost"):
            assert (await get("/v1/models", host))[0] == 200, host
        # a page whose name was rebound to 127.0.0.1 reads nothing, /health included
        for path in ("/v1/models", "/v1/fleet", "/metrics", "/v1/aliases/export", "/health",
                     "/v1/nothing"):
            code, body = await get(path, f"rebind.evil.example:{live.port}")
            assert code == 403, path
            assert isinstance(body, dict)
            err = body["error"]
            assert err["code"] == "host_not_allowed" and err["type"] == "permission_error"
            assert err["message"] == (
                "this head does not answer to the host name 'rebind.evil.example' (a guard "
                "against DNS rebinding); if you reach it by that name, start it with "
                "--allow-host rebind.evil.example")
        code, body = await get("/api/tags", "rebind.evil.example")  # Ollama's shape
        assert code == 403 and isinstance(body, dict)
        assert isinstance(body["error"], str) and "--allow-host" in body["error"]
        async with http.get(live.url("/metrics")) as r:
            assert 'shoal_refused_total{reason="host"} 7' in await r.text()
        # the user's own proxy name, once allowed
        live.head.allowed_hosts = ("rebind.evil.example",)
        assert (await get("/v1/models", "rebind.evil.example"))[0] == 200
        live.head.allowed_hosts = ("*",)
        assert (await get("/v1/models", "anything.example"))[0] == 200
        live.head.allowed_hosts = ()
        # HTTP/1.0 without a Host header is served
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        writer.write(b"GET /v1/models HTTP/1.0\r\n\r\n")
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
        assert status_line.split()[1] == b"200"


def test_alias_writes_compare_the_static_key_in_constant_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    from engine.api import admin
    from engine.api.context import HEAD

    app = web.Application()
    app[HEAD] = SimpleNamespace(api_key="s3cret-key")  # type: ignore[assignment]
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        ("192.0.2.7", 50000) if name == "peername" else default)
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    def allowed(auth: str | None) -> bool:
        headers = {"Authorization": auth} if auth is not None else {}
        request = make_mocked_request("PUT", "/v1/aliases/a", headers=headers, app=app,
                                      transport=transport)
        assert request.remote == "192.0.2.7"
        return admin._allowed(request)

    assert allowed("Bearer s3cret-key")
    assert compared  # through hmac.compare_digest, not ==
    assert not allowed("Bearer s3cret-kez") and not allowed(None) and not allowed("s3cret-key")
    app[HEAD] = SimpleNamespace(api_key=None)  # type: ignore[assignment]
    assert not allowed("Bearer anything")


async def test_allow_host_on_the_command_line(cluster: Cluster):
    cluster.token()
    head = cluster.head([], extra=("--allow-host", "proxy.example,*.tail.ts.net",
                                   "--allow-host", "10.9.8.7"))
    async with aiohttp.ClientSession() as http:
        for host, want in (("proxy.example", 200), ("box.tail.ts.net:443", 200),
                           ("10.9.8.7:8453", 200), (f"127.0.0.1:{head.port}", 200),
                           (socket.gethostname(), 200), ("evil.example", 403),
                           ("tail.ts.net", 403)):
            async with http.get(f"http://127.0.0.1:{head.port}/v1/models",
                                headers={"Host": host}) as r:
                assert r.status == want, host
    out = subprocess.run([*SHOAL, "serve", "--runtime", "mock", "--http", "127.0.0.1:0",
                          "--allow-host", "http://proxy.example"], env=cluster.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip() == ("shoal: --allow-host 'http://proxy.example' is not a host "
                                  "name or address; write it like shoal.example.com, "
                                  "*.example.com, 192.168.1.5 or *")


class _Reusing(MockEngine):
    """A node whose prompt cache held all but the last token of every prompt, as if
    someone sent it before (the mock itself reports none)."""

    def generate(self, request: GenerationRequest) -> MockGeneration:
        gen = super().generate(request)
        held = len(request.prompt) - 1

        class Reused(MockGeneration):
            @property
            def result(self) -> GenerationResult:
                return dataclasses.replace(super().result, cached_tokens=held)

        gen.__class__ = Reused
        return gen


async def test_cached_tokens_never_confirm_another_keys_prompt():
    """With keys on, one key holder could read another's prompt token by token from
    `cached_tokens`; now a key is told only of what its own conversation left there."""
    alice, bob = keys.issue_key(SECRET, "alice"), keys.issue_key(SECRET, "bob")
    roomy = keys.Policy(default=keys.Limits(rpm=60_000, burst=1000, concurrent=4))
    turn1 = [{"role": "user", "content": "the secret plan is to"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a b"}, {"role": "user", "content": "go"}]

    async def cached(http: aiohttp.ClientSession, live: object, key: str | None,
                     messages: list[dict[str, str]]) -> int:
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
        async with http.post(live.url("/v1/chat/completions"), json=body,  # type: ignore[attr-defined]
                             headers=bearer(key) if key else {}) as r:
            got = await r.json()
            assert r.status == 200, got
            return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with live_head(keys_secret=SECRET, key_policy=roomy,
                         make_engine=lambda m: _Reusing(model=m, lanes=2)) as live, \
            aiohttp.ClientSession() as http:
        assert await cached(http, live, alice, turn1) == 0  # a first turn: nothing of its own
        assert await cached(http, live, bob, turn1) == 0  # alice's prompt: not confirmed
        assert await cached(http, live, alice, turn2) > 0  # her own first turn, reused
    async with live_head(make_engine=lambda m: _Reusing(model=m, lanes=2)) as live, \
            aiohttp.ClientSession() as http:
        assert await cached(http, live, None, turn1) > 0  # no keys: the node's own figure
