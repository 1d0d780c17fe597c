"""Who may change the fleet's aliases, and who may reach the API at all.

Coming from loopback proves nothing about a client: behind a reverse proxy on the same
machine (here a real nginx) every client is loopback. Alias changes need this machine's
admin secret (what `shoal alias` sends) or the head's --api-key; alias reads go through
the keys like every other route. An API served off loopback without a key is refused at
start unless the user says --insecure-no-auth.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from engine.errors import StartError
from engine.head.access.admin_secret import HEADER, admin_secret_path
from engine.service import Shoal
from engine.settings import Settings
from tests.integration.conftest import SHOAL, Cluster
from tests.integration.test_api_surface import MODEL, live_head
from tests.integration.test_service import both, running
from tests.waiting import until_result

pytestmark = pytest.mark.timeout(60)
ADMIN = "ab" * 32
SECRET = bytes(range(100, 132))
FORWARDED = ({}, {"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"},
             {"X-Real-IP": "203.0.113.9"}, {"Tailscale-User-Login": "someone@example.com"})


async def test_alias_changes_need_the_admin_secret_not_loopback():
    async with live_head(admin_secret=ADMIN) as live, aiohttp.ClientSession() as http:
        body = {"target": MODEL}
        for headers in (*FORWARDED, {HEADER: "cd" * 32}):
            for method, path, data in (("PUT", "/v1/aliases/fast", body),
                                       ("DELETE", "/v1/aliases/fast", None),
                                       ("POST", "/v1/aliases/fast/revert", None),
                                       ("POST", "/v1/aliases/import", {"aliases": []})):
                async with http.request(method, live.url(path), json=data,
                                        headers=headers) as r:
                    assert r.status == 403, (method, path, headers)
                    message = (await r.json())["error"]["message"]
                    assert "admin secret" in message and "shoal alias" in message
        assert live.head.aliases.get("fast") is None
        async with http.put(live.url("/v1/aliases/fast"), json=body,
                            headers={HEADER: ADMIN}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["entry"]["target"] == MODEL
        entry = live.head.aliases.get("fast")
        assert entry is not None and entry.target == MODEL


async def test_alias_reads_take_a_key_like_any_route_unless_sent_the_admin_secret():
    async with live_head(api_key="s3cret-key", admin_secret=ADMIN) as live, \
            aiohttp.ClientSession() as http:
        for headers in FORWARDED:
            async with http.get(live.url("/v1/aliases"), headers=headers) as r:
                assert r.status == 401, headers
            async with http.get(live.url("/v1/aliases/export"), headers=headers) as r:
                assert r.status == 401, headers
        async with http.get(live.url("/v1/aliases"), headers={HEADER: ADMIN}) as r:
            assert r.status == 200
        async with http.get(live.url("/v1/aliases"),
                            headers={"Authorization": "Bearer s3cret-key"}) as r:
            assert r.status == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def nginx_in_front(tmp_path: Path, upstream: int) -> AsyncIterator[str]:
    """A real nginx on 127.0.0.1 proxying to ``upstream``, as a user would put one in
    front of the head (its base URL); ended by its own process id."""
    port = _free_port()
    conf = tmp_path / "nginx.conf"
    temp = tmp_path / "nginx-temp"
    temp.mkdir(parents=True)
    conf.write_text(f"""
daemon off;
master_process off;
pid {tmp_path}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        }}
    }}
}}
""")
    proc = await asyncio.create_subprocess_exec(
        "nginx", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        async def health() -> int:
            try:
                async with aiohttp.ClientSession() as http, http.get(f"{base}/health") as r:
                    return r.status
            except aiohttp.ClientError:
                assert proc.returncode is None, "nginx ended at start"
                return 0

        await until_result(health, lambda status: status == 200, what="nginx to proxy")
        yield base
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


@pytest.mark.skipif(shutil.which("nginx") is None,
                    reason="nginx is not installed (scripts/lib/apt.sh installs it)")
async def test_a_client_behind_a_reverse_proxy_changes_and_reads_nothing(tmp_path: Path):
    async with live_head(admin_secret=ADMIN) as live, \
            nginx_in_front(tmp_path, live.port) as proxied, aiohttp.ClientSession() as http:
        async with http.put(f"{proxied}/v1/aliases/fast", json={"target": MODEL}) as r:
            assert r.status == 403  # the proxy's connection comes from loopback
        assert live.head.aliases.get("fast") is None
        async with http.get(f"{proxied}/v1/models") as r:
            assert r.status == 200  # the API itself is served through it (no keys here)
    async with live_head(admin_secret=ADMIN, keys_secret=SECRET) as live, \
            nginx_in_front(tmp_path / "second", live.port) as proxied, \
            aiohttp.ClientSession() as http, http.get(f"{proxied}/v1/aliases") as r:
        assert r.status == 401  # keys are on: a key is needed, as on every route


def test_shoal_alias_on_this_machine_sends_the_secret(cluster: Cluster):
    cluster.token()
    head = cluster.head([])
    assert admin_secret_path(cluster.home).stat().st_mode & 0o077 == 0
    out = subprocess.run([*SHOAL, "alias", "--head", f"127.0.0.1:{head.port}", "set", "fast",
                          "mock-m"], env=cluster.env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("fast -> mock-m (ver 1): 1/1 heads"), out.stdout
    # another home holds another secret (or none): refused with the cause and the fix
    env = {**cluster.env, "SHOAL_HOME": str(cluster.home / "elsewhere")}
    out = subprocess.run([*SHOAL, "alias", "--head", f"127.0.0.1:{head.port}", "rm", "fast"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "admin secret" in out.stderr and "Traceback" not in out.stderr, out.stderr


async def test_an_api_off_loopback_without_a_key_is_refused_at_start(tmp_path: Path):
    def off_loopback(**head: object) -> Settings:
        settings = both(tmp_path)
        assert settings.head is not None
        return settings.with_head(replace(settings.head, http="0.0.0.0:0", **head))

    with pytest.raises(StartError) as info:
        await Shoal.start(off_loopback())
    assert info.value.code == "open_api"
    text = str(info.value)
    assert "\n" not in text and "0.0.0.0:0" in text
    assert "shoal keys issue NAME" in text and "--insecure-no-auth" in text
    # told to, or given a key, it serves
    for extra in ({"insecure_no_auth": True}, {"api_key": "s3cret-key"}):
        async with running(off_loopback(**extra)) as shoal:
            assert shoal.api_url is not None and shoal.api_url.startswith("http://127.0.0.1:")


def test_the_cli_says_it_in_one_line(cluster: Cluster):
    out = subprocess.run([*SHOAL, "serve", "--runtime", "mock", "--http", "0.0.0.0:0"],
                         env=cluster.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    lines = [line for line in out.stderr.splitlines() if line.startswith("shoal:")]
    assert len(lines) == 1 and "--insecure-no-auth" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
