"""A node on one host finds the head on another over mDNS and joins it.

Two network namespaces joined by a veth pair stand for two machines on a LAN.
The head announces itself on its veth; the node, given no address, finds it,
checks its token against it, joins, and the head places a session on it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.netns.conftest import Pair

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def in_ns(ns: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    with log.open("w") as logf:
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "engine.cli",
                                 *args], env=env, stdout=subprocess.PIPE, stderr=logf,
                                text=True, cwd=ROOT)


def wait_line(proc: subprocess.Popen[str], pattern: str, timeout: float = 30.0) -> re.Match[str]:
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    deadline = time.monotonic() + timeout
    buf = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            buf += line
            m = re.search(pattern, buf)
            if m:
                return m
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {buf!r}")


def machines(tmp_path: Path, token: str, *names: str) -> dict[str, dict[str, str]]:
    """The environment of each machine: a home of its own holding the fleet token (its GPU
    off), and never the developer's keychain."""
    env = {}
    for name in names:
        home = tmp_path / name
        (home / "fleet").mkdir(parents=True)
        (home / "fleet" / "token").write_text(token)
        (home / "fleet" / "token").chmod(0o600)
        (home / "config.toml").write_text('[node]\ngpu = "off"\n')
        env[name] = {**os.environ, "PYTHONUNBUFFERED": "1", "SHOAL_HOME": str(home),
                     "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}
    return env


def stop(procs: list[subprocess.Popen[str]]) -> None:
    """End the processes a test started, by their ids (killed if they linger)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def fleet(ns: str, port: int) -> dict:
    code = (f"import urllib.request; print(urllib.request.urlopen("
            f"'http://127.0.0.1:{port}/v1/fleet', timeout=5).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=20, check=True)
    return json.loads(out.stdout)


def chat(ns: str, port: int) -> dict:
    # seed 1: the mock writes 400 tokens for "hi" before its end token
    body = json.dumps({"model": "mock-m", "max_tokens": 4, "seed": 1,
                       "messages": [{"role": "user", "content": "hi"}]})
    code = ("import urllib.request, sys; r = urllib.request.Request("
            f"'http://127.0.0.1:{port}/v1/chat/completions', data=sys.argv[1].encode(), "
            "headers={'Content-Type': 'application/json'}); "
            "print(urllib.request.urlopen(r, timeout=20).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, body],
                         capture_output=True, text=True, timeout=40, check=True)
    return json.loads(out.stdout)


def test_node_finds_head_over_mdns_across_hosts(netns_pair: Pair, tmp_path: Path) -> None:
    token = "ab" * 32
    env = machines(tmp_path, token, "a", "b")
    procs: list[subprocess.Popen[str]] = []
    try:
        head = in_ns(netns_pair.a, ["serve", "mock-m", "--runtime", "mock", "--http",
                                    "127.0.0.1:0", "--fleet-listen", "0.0.0.0:8454",
                                    "--discovery", "lan"],
                     env["a"], tmp_path / "head.log")
        procs.append(head)
        http_port = int(wait_line(head, r"at http://127\.0\.0\.1:(\d+)/v1").group(1))
        started = time.monotonic()
        node = in_ns(netns_pair.b, ["node", "join", "--discovery", "lan", "--runtime", "mock",
                                    "--model", "x", "--identity", "box-b"],
                     env["b"], tmp_path / "node.log")
        procs.append(node)
        m = wait_line(node, r"joining ([\d.]+):8454 as 'mock-m'")
        assert m.group(1) == netns_pair.addr_a
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            nodes = fleet(netns_pair.a, http_port)["nodes"]
            if any(n["address"] == "joined:box-b" and n["state"] == "ready" for n in nodes):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"box-b never joined: {nodes}")
        body = chat(netns_pair.a, http_port)
        assert body["usage"]["completion_tokens"] == 4
        print(f"node start to joined: {time.monotonic() - started:.2f} s")
        assert token not in (tmp_path / "head.log").read_text() + \
            (tmp_path / "node.log").read_text()
    finally:
        stop(procs)
