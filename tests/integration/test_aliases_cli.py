"""`shoal alias` end to end: two heads, persistence across restarts, catching up."""

from __future__ import annotations

import json
import socket
import subprocess

import aiohttp
import pytest

from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.integration.test_fleet import url
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alias(cluster: Cluster, head: Proc, *args: str) -> subprocess.CompletedProcess:
    """`shoal alias ARGS` against ``head``, as its user on its machine (its home, which
    holds the admin secret the command sends)."""
    env = {**cluster.env, "SHOAL_HOME": str(head.home or cluster.home)}
    return subprocess.run([*SHOAL, "alias", "--head", f"127.0.0.1:{head.port}", *args],
                          env=env, capture_output=True, text=True, timeout=30)


def start_head(cluster: Cluster, home, join_port: int, peer_port: int, node: Proc) -> Proc:
    env = {**cluster.env, "SHOAL_HOME": str(home)}
    args = ["serve", "mock-m", "--runtime", "mock", "--http", "127.0.0.1:0",
            "--fleet", node.address, "--fleet-listen", f"127.0.0.1:{join_port}",
            "--discovery", "none", "--seeds", f"127.0.0.1:{peer_port}",
            "--also-model", "mock-b"]
    import re

    return cluster._start("head", args, re.compile(r"at http://127\.0\.0\.1:(\d+)/v1"), env=env)


async def test_aliases_across_two_heads_restarts_and_catch_up(cluster: Cluster, tmp_path):
    cluster.token()
    token = (cluster.home / "fleet" / "token").read_text()
    homes = [tmp_path / "ha", tmp_path / "hb"]
    for h in homes:
        (h / "fleet").mkdir(parents=True)
        (h / "fleet" / "token").write_text(token)
        (h / "fleet" / "token").chmod(0o600)
    node = cluster.node("n0", model="mock-m")
    node_b = cluster.node("nb", model="mock-b")
    ports = [free_port(), free_port()]
    a = start_head(cluster, homes[0], ports[0], ports[1], node)
    b = start_head(cluster, homes[1], ports[1], ports[0], node)
    await until(lambda: "linked with head" in a.log_text() and "linked with head"
                in b.log_text(), "the two heads linked", timeout=20)

    out = alias(cluster, a, "set", "coder", "mock-b", "--fallback", "mock-m")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "coder -> mock-b then mock-m (ver 1): 2/2 heads"
    assert "coder -> mock-b then mock-m (ver 1" in alias(cluster, b, "ls").stdout

    # resolution on the other head: mock-b has no node on b's fleet list, so the fallback runs
    async with aiohttp.ClientSession() as http:
        body = {"model": "coder", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(url(b, "/v1/chat/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Shoal-Alias"] == "coder"
            assert r.headers["X-Shoal-Model"] == "mock-m"
        async with http.get(url(b, "/v1/models")) as r:
            ids = [m["id"] for m in (await r.json())["data"]]
        assert "mock-m" in ids and "coder" in ids

    # head b is off while the alias changes: a counts 1 of 2, b catches up when back
    b.signal(15)
    b.popen.wait(10)
    out = alias(cluster, a, "set", "coder", "mock-m")
    assert out.stdout.strip() == "coder -> mock-m (ver 2): 1/2 heads"
    b2 = start_head(cluster, homes[1], ports[1], ports[0], node)
    # it catches up at its first sync (serving its saved table alone is checked below)
    await until(lambda: "(ver 2" in alias(cluster, b2, "ls").stdout, "b to catch up with ver 2",
                timeout=20)

    # revert, history, rm, export, import
    out = alias(cluster, a, "revert", "coder")
    assert out.stdout.strip() == "coder -> mock-b then mock-m (ver 3): 2/2 heads"
    hist = alias(cluster, b2, "history", "coder").stdout
    await until(lambda: "ver 3" in alias(cluster, b2, "history", "coder").stdout,
                "ver 3 in b's history", timeout=20)
    assert "ver 1: mock-b" in hist and "ver 2: mock-m" in hist
    exported = alias(cluster, a, "export").stdout
    assert json.loads(exported)
    out = alias(cluster, a, "rm", "coder")
    assert out.stdout.strip() == "coder removed (ver 4): 2/2 heads"
    assert "no aliases" in alias(cluster, a, "ls").stdout
    dump = tmp_path / "aliases.json"
    dump.write_text(exported)
    out = alias(cluster, a, "import", str(dump))
    assert out.returncode == 0 and "imported coder: 2/2 heads" in out.stdout

    # a head restarted alone keeps its table on disk
    a.signal(15)
    a.popen.wait(10)
    a2 = start_head(cluster, homes[0], ports[0], free_port(), node)
    assert "coder -> mock-b" in alias(cluster, a2, "ls").stdout
    assert node_b.popen.poll() is None


async def test_alias_errors_are_one_line(cluster: Cluster):
    head = cluster.head([cluster.node("n0")])
    out = alias(cluster, head, "rm", "nothing")
    assert out.returncode == 2 and "no alias named 'nothing'" in out.stderr
    out = alias(cluster, head, "set", "mock-m", "other")
    assert out.returncode == 2 and "a real model name always wins" in out.stderr
    out = subprocess.run([*SHOAL, "alias", "--head", "127.0.0.1:9", "ls"], env=cluster.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no head answers at 127.0.0.1:9" in out.stderr
    assert all("Traceback" not in o for o in (out.stderr,))
