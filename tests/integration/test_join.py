"""Nodes that join heads, as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.fake_tailscaled import serve_fake_tailscaled
from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.integration.test_fleet import chat_body, fleet_state, url
from tests.waiting import until, until_result

pytestmark = pytest.mark.timeout(120)
LOOPBACK_HEAD = ("--fleet-listen", "127.0.0.1:0", "--discovery", "none")


async def wait_node(head: Proc, key: str, state: str = "ready", timeout: float = 20.0,
                    connections: int = 0) -> dict:
    def found(nodes: list[dict]) -> dict | None:
        return next((n for n in nodes if n["address"] == key and n["state"] == state
                     and n["connections"] >= connections), None)

    async def nodes() -> list[dict]:
        return (await fleet_state(head))["nodes"]

    return found(await until_result(nodes, found, what=f"{key} {state}", timeout=timeout))


async def chat_ok(head: Proc, **kw: object) -> dict:
    # seed 3: the mock writes 400 tokens for "hello" before its end token
    body = chat_body(max_tokens=5, **{"seed": 3, **kw})
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def joinless_head(cluster: Cluster, *extra: str) -> tuple[Proc, int]:
    head = cluster.head([], extra=(*LOOPBACK_HEAD, *extra))
    return head, cluster.join_port(head)


async def test_node_joins_by_address_and_serves(cluster: Cluster):
    cluster.token()
    head, port = joinless_head(cluster)
    node = cluster.joined_node("j1", f"127.0.0.1:{port}", model="/some/other/path.gguf")
    assert f"joining 127.0.0.1:{port} as 'mock-m'" in node.banner  # named as the head announced
    # the node is ready on its first connection; its second (one per lane) may come later
    info = await wait_node(head, "joined:j1", connections=2)
    assert info["lanes"] == 2 and info["model"] == "mock-m" and info["connections"] == 2
    body = await chat_ok(head)
    assert body["usage"]["completion_tokens"] == 5
    assert "fleet node 'j1' at joined:j1" in head.log_text()


async def test_link_drop_and_rejoin(cluster: Cluster):
    cluster.token()
    head, port = joinless_head(cluster)
    node = cluster.joined_node("j1", f"127.0.0.1:{port}")
    await wait_node(head, "joined:j1")
    # the head goes away: the node keeps dialing, and joins the head that comes back
    head.signal(signal.SIGKILL)
    head.popen.wait(5)
    await until(lambda: "dialing again" in node.log_text(), "the node to see the head gone")
    head2 = cluster.head([], extra=("--fleet-listen", f"127.0.0.1:{port}", "--discovery", "none"))
    await wait_node(head2, "joined:j1", timeout=25)
    await chat_ok(head2)
    assert "dialing again" in node.log_text()
    # the node goes away: the head waits for it rather than dialing it
    node.signal(signal.SIGKILL)
    node.popen.wait(5)
    await wait_node(head2, "joined:j1", state="left")
    assert "left; waiting for it to join again" in head2.log_text()
    cluster.joined_node("j1", f"127.0.0.1:{port}")
    await wait_node(head2, "joined:j1")
    await chat_ok(head2)


async def test_wrong_token_stops_the_node_before_loading(cluster: Cluster, tmp_path: Path):
    cluster.token()
    head, port = joinless_head(cluster)
    other = tmp_path / "other-token"
    other.write_text("cd" * 32)
    other.chmod(0o600)  # a token file open to other users is refused
    out = subprocess.run([*SHOAL, "node", "join", f"127.0.0.1:{port}", "--runtime", "mock",
                          "--model", "m", "--auth-file", str(other)],
                         env=cluster.env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"the head at 127.0.0.1:{port} refused this node's fleet token" in out.stderr
    assert "pair again" in out.stderr and "Traceback" not in out.stderr
    assert "runtime" not in out.stdout  # it stopped before serving anything
    assert "cd" * 32 not in out.stderr + head.log_text()


async def test_no_head_found_says_where_it_looked(cluster: Cluster, tmp_path: Path):
    cluster.token()
    out = subprocess.run([*SHOAL, "node", "join", "--runtime", "mock", "--model", "m",
                          "--discovery", "tailnet", "--tailscale-socket",
                          str(tmp_path / "nothing.sock")],
                         env=cluster.env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "no head of this fleet found (on the tailnet" in out.stderr
    assert "Tailscale is not running" in out.stderr


@contextlib.contextmanager
def fake_tailscaled(path: Path, peers: list[dict]) -> Iterator[None]:
    """The fake LocalAPI on its own loop: the test's own loop blocks while processes start."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(serve_fake_tailscaled(path, peers), loop).result(10)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def test_node_finds_the_head_over_the_tailnet(cluster: Cluster, tmp_path: Path):
    cluster.token()
    head, port = joinless_head(cluster)
    sock = tmp_path / "tailscaled.sock"
    peers = [{"HostName": "desk", "TailscaleIPs": ["127.0.0.1"], "Online": True},
             {"HostName": "laptop", "TailscaleIPs": ["127.0.0.9"], "Online": False}]
    with fake_tailscaled(sock, peers):
        node = cluster.joined_node("tn", "--discovery", "tailnet", "--tailscale-socket",
                                   str(sock), "--head-port", str(port))
        await wait_node(head, "joined:tn")
        await chat_ok(head)
    assert f"linked with the head at 127.0.0.1:{port} (tailnet)" in node.log_text()


async def test_leave_closes_the_links_and_forgets(cluster: Cluster):
    cluster.token()
    head, port = joinless_head(cluster)
    node = cluster.joined_node("j1", f"127.0.0.1:{port}")
    await wait_node(head, "joined:j1")
    token_file = cluster.home / "fleet" / "token"
    assert token_file.exists()
    out = subprocess.run([*SHOAL, "node", "leave", "--forget-token"], env=cluster.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"closed the links to 127.0.0.1:{port}" in out.stdout
    assert "removed the fleet token" in out.stdout
    assert node.popen.wait(10) == 0
    assert not token_file.exists()
    assert not (cluster.home / "fleet" / "node.json").exists()
    await wait_node(head, "joined:j1", state="left")


async def test_pairing_by_qr_image_joins_a_new_machine(cluster: Cluster, tmp_path: Path):
    token = cluster.token()
    head, port = joinless_head(cluster)
    png = tmp_path / "pair.png"
    out = subprocess.run([*SHOAL, "fleet", "pair", "--head", f"127.0.0.1:{port}",
                          "--fleet-name", "desk", "--png", str(png)], env=cluster.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"shoal://join?head=127.0.0.1%3A{port}&token={token}&fleet=desk" in out.stdout \
        or f"shoal://join?head=127.0.0.1:{port}&token={token}&fleet=desk" in out.stdout
    assert png.stat().st_size > 0
    # a second machine: its own home, no token yet
    home2 = tmp_path / "home2"
    env2 = {**cluster.env, "SHOAL_HOME": str(home2)}
    node = cluster.joined_node("newbox", "--code", str(png), env=env2)
    await wait_node(head, "joined:newbox")
    stored = home2 / "fleet" / "token"
    assert stored.read_text().strip() == token
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert token not in node.log_text() + head.log_text()


async def test_head_finds_a_listening_node_over_the_tailnet(cluster: Cluster, tmp_path: Path):
    cluster.token()
    node = cluster.node("listener")
    sock = tmp_path / "tailscaled.sock"
    peers = [{"HostName": "box", "TailscaleIPs": ["127.0.0.1"], "Online": True}]
    with fake_tailscaled(sock, peers):
        head = cluster.head([], extra=("--fleet-listen", "127.0.0.1:0", "--discovery",
                                       "tailnet", "--tailscale-socket", str(sock),
                                       "--node-port", str(node.port)))
        await wait_node(head, f"127.0.0.1:{node.port}")
        await chat_ok(head)
    assert f"found a node at 127.0.0.1:{node.port} (tailnet); dialing it" in head.log_text()


async def test_config_file_sets_discovery(cluster: Cluster):
    cluster.token()
    cluster.home.mkdir(parents=True, exist_ok=True)
    (cluster.home / "config.toml").write_text('[discovery]\nmode = "none"\n')
    out = subprocess.run([*SHOAL, "node", "join", "--runtime", "mock", "--model", "m"],
                         env=cluster.env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "no head of this fleet found (nowhere: discovery is off)" in out.stderr


async def test_node_finds_a_head_that_moved(cluster: Cluster, tmp_path: Path):
    cluster.token()
    first, port = joinless_head(cluster)
    sock = tmp_path / "tailscaled.sock"
    peers = [{"HostName": "desk", "TailscaleIPs": ["127.0.0.1"], "Online": True}]
    with fake_tailscaled(sock, peers):
        node = cluster.joined_node("roamer", "--discovery", "tailnet", "--tailscale-socket",
                                   str(sock), "--head-port", str(port))
        await wait_node(first, "joined:roamer")
        # the head's machine comes back on another address; the tailnet says where
        first.signal(signal.SIGKILL)
        first.popen.wait(5)
        peers[0] = {**peers[0], "TailscaleIPs": ["127.0.0.2"]}
        moved = cluster.head([], extra=("--fleet-listen", f"127.0.0.2:{port}",
                                        "--discovery", "none"))
        await wait_node(moved, "joined:roamer", timeout=30)
        await chat_ok(moved)
    log = node.log_text()
    assert f"found the head at 127.0.0.2:{port} (tailnet)" in log
    assert f"the head at 127.0.0.1:{port} is gone; forgetting it" in log
