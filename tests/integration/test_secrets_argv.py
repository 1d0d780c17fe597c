"""Secrets given on the command line do not stay there: other users can read a running
process's command line (/proc/PID/cmdline, ps) and, as root, its environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from engine.credentials.codes import join_url
from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.integration.test_join import joinless_head, wait_node

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads /proc/PID/cmdline and environ (Linux)")]


def process_text(pid: int) -> bytes:
    """What other users (cmdline) and the same user (environ) can read of a process."""
    return Path(f"/proc/{pid}/cmdline").read_bytes() + b"\n" + \
        Path(f"/proc/{pid}/environ").read_bytes()


def second_machine(cluster: Cluster, tmp_path: Path) -> dict[str, str]:
    return {**cluster.env, "SHOAL_HOME": str(tmp_path / "home2")}


async def test_a_join_code_in_argv_leaves_the_running_node(cluster: Cluster, tmp_path: Path):
    token = cluster.token()
    head, port = joinless_head(cluster)
    url = join_url(f"127.0.0.1:{port}", bytes.fromhex(token), "desk")
    node = cluster.joined_node("argv-node", "--code", url, env=second_machine(cluster, tmp_path))
    await wait_node(head, "joined:argv-node")
    seen = process_text(node.popen.pid)
    assert token.encode() not in seen and b"shoal://" not in seen
    assert b"node\0join\0" in seen and b"--code" not in seen  # the rest of argv stays
    assert (tmp_path / "home2" / "fleet" / "token").read_text().strip() == token
    assert token not in node.log_text()


async def test_a_join_code_from_stdin_or_a_file(cluster: Cluster, tmp_path: Path):
    token = cluster.token()
    head, port = joinless_head(cluster)
    url = join_url(f"127.0.0.1:{port}", bytes.fromhex(token), "desk")
    # --code @FILE: a text file holding the URL
    text = tmp_path / "code.txt"
    text.write_text(url + "\n")
    by_file = cluster.joined_node("file-node", "--code", f"@{text}",
                                  env=second_machine(cluster, tmp_path))
    await wait_node(head, "joined:file-node")
    assert token.encode() not in process_text(by_file.popen.pid)
    # --code -: piped in
    log = tmp_path / "stdin-node.log"
    with log.open("w") as logf:
        popen = subprocess.Popen(
            [*SHOAL, "node", "join", "--code", "-", "--runtime", "mock", "--model", "m",
             "--identity", "stdin-node", "--max-batch", "1"],
            env={**cluster.env, "SHOAL_HOME": str(tmp_path / "home3")}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=logf, text=True, start_new_session=True)
    cluster.procs.append(Proc(popen, log, port, "stdin-node"))  # stopped by the fixture
    assert popen.stdin is not None and popen.stdout is not None
    popen.stdin.write(url + "\n")
    popen.stdin.close()
    os.set_blocking(popen.stdout.fileno(), False)
    banner, deadline = "", time.monotonic() + 30
    while "joining" not in banner and popen.poll() is None and time.monotonic() < deadline:
        banner += popen.stdout.readline() or ""
        time.sleep(0.05)
    assert "joining" in banner, log.read_text()
    await wait_node(head, "joined:stdin-node")
    assert (tmp_path / "home3" / "fleet" / "token").read_text().strip() == token


async def test_an_api_key_in_argv_leaves_the_running_head(cluster: Cluster):
    cluster.token()
    key = "argv-key-" + "7" * 24
    head = cluster.head([], extra=("--api-key", key))
    assert key.encode() not in process_text(head.popen.pid)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{head.port}/v1/models"
        async with http.get(url) as r:
            assert r.status == 401
        async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200


async def test_the_api_key_from_a_private_file(cluster: Cluster, tmp_path: Path):
    cluster.token()
    key_file = tmp_path / "api.key"
    key_file.write_text("file-key-0123456789\n")
    key_file.chmod(0o644)
    out = subprocess.run([*SHOAL, "serve", "--runtime", "mock", "--http", "127.0.0.1:0",
                          "--api-key-file", str(key_file)], env=cluster.env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"shoal: other users can read or change the API key file "
                                  f"{key_file} (mode 0644); run `chmod 600 {key_file}`")
    key_file.chmod(0o600)
    head = cluster.head([], extra=("--api-key-file", str(key_file)))
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{head.port}/v1/models"
        async with http.get(url) as r:
            assert r.status == 401
        async with http.get(url, headers={"Authorization": "Bearer file-key-0123456789"}) as r:
            assert r.status == 200
    assert "file-key-0123456789" not in head.log_text()
