"""tailscaled's LocalAPI, faked on a unix socket in tmp_path with the real status JSON shape."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from engine.discovery.tailscale import (
    MAX_STATUS_BYTES,
    LocalAPI,
    TailscaleError,
    online_peer_addresses,
    status,
)
from engine.link import transport
from tests.fake_tailscaled import STATE, serve_fake_tailscaled

PEERS = [
    {"HostName": "desk", "TailscaleIPs": ["127.0.0.1", "fd7a:115c:a1e0::5"], "Online": True},
    {"HostName": "laptop", "TailscaleIPs": ["100.101.1.6"], "Online": False},
]


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "ts.sock"


@pytest.fixture
async def fake(sock: Path) -> AsyncIterator[web.AppRunner]:
    runner = await serve_fake_tailscaled(sock, [dict(p) for p in PEERS])
    yield runner
    await runner.cleanup()


async def test_status_lists_online_peers_only(fake: web.AppRunner, sock: Path) -> None:
    st = await status(str(sock))
    assert st.backend_state == "Running"
    assert st.self_peer.host_name == "this-machine"
    assert [p.host_name for p in st.peers] == ["desk", "laptop"]
    assert online_peer_addresses(st) == [("desk", "127.0.0.1")]
    assert fake.app[STATE].requests == [{"host": "local-tailscaled.sock",
                                        "path": "/localapi/v0/status", "method": "GET"}]


async def test_peer_going_offline_is_seen(fake: web.AppRunner, sock: Path) -> None:
    fake.app[STATE].peers[0]["Online"] = False
    st = await status(LocalAPI(socket_path=str(sock)))
    assert online_peer_addresses(st) == []


async def test_online_peer_leads_to_a_link(fake: web.AppRunner, sock: Path) -> None:
    """The address tailscaled gives is dialed, and the Noise handshake completes there."""
    psk = secrets.token_bytes(32)
    accepts: list[asyncio.Task[transport.Link]] = []
    server = await transport.serve(lambda incoming: accepts.append(asyncio.create_task(
        transport.accept(incoming, psk=psk, timeout_s=5))), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        [(name, ip)] = online_peer_addresses(await status(str(sock)))
        link = await transport.dial(ip, port, psk=psk, timeout_s=5)
        assert (name, link.encrypted) == ("desk", True)
        [accepted] = accepts  # the dial returned: the listener has its connection
        served = await accepted
        assert served.encrypted
        link.close()
        served.close()
    finally:
        for task in accepts:
            task.cancel()
        server.close()
        await server.wait_closed()


async def test_needs_login(sock: Path) -> None:
    runner = await serve_fake_tailscaled(sock, [dict(p) for p in PEERS],
                                         backend_state="NeedsLogin")
    try:
        with pytest.raises(TailscaleError) as err:
            await status(str(sock))
        assert str(err.value) == "Tailscale is not logged in; run `tailscale up`"
    finally:
        await runner.cleanup()


async def test_missing_socket(sock: Path) -> None:
    with pytest.raises(TailscaleError) as err:
        await status(str(sock))
    assert str(err.value) == (f"Tailscale is not running here (no socket at {sock}); "
                              "start it or choose --discovery lan")


async def test_stale_socket_nobody_listening(sock: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))  # a socket file left behind by a daemon that died
    s.close()
    with pytest.raises(TailscaleError) as err:
        await status(str(sock))
    assert "not running here (nothing answers at" in str(err.value)


async def _serve(sock: Path,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/localapi/v0/status", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    return runner


async def test_oversized_status_is_refused(sock: Path) -> None:
    async def huge(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # chunked: no Content-Length to refuse up front
        await resp.prepare(request)
        chunk = b" " * 65536
        with contextlib.suppress(ConnectionError):
            for _ in range(MAX_STATUS_BYTES // len(chunk) + 2):
                await resp.write(chunk)
        return resp

    runner = await _serve(sock, huge)
    try:
        with pytest.raises(TailscaleError) as err:
            await status(str(sock), timeout=10)
        assert "larger than 4 MiB" in str(err.value)
    finally:
        await runner.cleanup()


async def test_bad_json_and_http_errors(sock: Path) -> None:
    answers = [web.Response(text="{not json"), web.Response(status=403, text="denied"),
               web.Response(status=500, text="oops")]

    async def next_answer(request: web.Request) -> web.Response:
        return answers.pop(0)

    runner = await _serve(sock, next_answer)
    try:
        for words in ("malformed JSON", "refused the status request (HTTP 403)", "HTTP 500"):
            with pytest.raises(TailscaleError) as err:
                await status(str(sock))
            assert words in str(err.value)
    finally:
        await runner.cleanup()


async def test_silent_daemon_times_out(sock: Path) -> None:
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await release.wait()
        return web.Response(text="{}")

    runner = await _serve(sock, stall)
    try:
        with pytest.raises(TailscaleError) as err:
            await status(str(sock), timeout=0.3)
        assert "did not answer within 0.3 s" in str(err.value)
    finally:
        release.set()
        await runner.cleanup()
