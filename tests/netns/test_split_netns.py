"""A model split across two machines on a LAN (issue 33): network namespaces joined by a
veth pair stand for them. The desk lends memory (``--lend``); the laptop serves Gemma 3
270M with its last layers on the desk, through the fleet's encrypted link across the
veth, neither machine's budget holding the model alone. The greedy answer is the model's
served whole; the desk's RPC server is reachable on the desk's own
loopback only, never from the laptop, on neither the desk's veth address nor any other.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.settings import NODE_PORT
from tests.e2e.conftest import gemma_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.netns.conftest import Pair
from tests.netns.test_join_netns import fleet, in_ns, machines, stop, wait_line
from tests.waiting import until_sync

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(240)]

BUDGET = "400M"  # the laptop's: Gemma 3 270M whole needs more; its part split fits
ROOT = Path(__file__).resolve().parents[2]
SHOAL = [sys.executable, "-m", "engine.cli"]
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
           "    print('connected')\n"
           "except OSError as exc:\n"
           "    print(type(exc).__name__)\n")


def connect_from(ns: str, host: str, port: int) -> str:
    """What a TCP connect from namespace ``ns`` to host:port comes to."""
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CONNECT, host,
                          str(port)], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


def complete(ns: str, port: int, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "The history of the printing press begins",
                       "max_tokens": 16, "temperature": 0})
    code = ("import urllib.request, sys; r = urllib.request.Request("
            f"'http://127.0.0.1:{port}/v1/completions', data=sys.argv[1].encode(), "
            "headers={'Content-Type': 'application/json'}); "
            "print(urllib.request.urlopen(r, timeout=120).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, body],
                         capture_output=True, text=True, timeout=150, check=True)
    return json.loads(out.stdout)


def test_a_split_across_two_hosts_reaches_the_rpc_server_only_through_the_link(
        netns_pair: Pair, tmp_path: Path, gemma_gguf: Path) -> None:  # noqa: F811
    token = "cd" * 32
    env = machines(tmp_path, token, "desk", "laptop")
    procs: list[subprocess.Popen[str]] = []
    try:
        desk = in_ns(netns_pair.a, ["node", "--runtime", "mock", "--model", "mock-m",
                                    "--identity", "desk", "--listen", f"{netns_pair.addr_a}:0",
                                    "--discovery", "none", "--lend", "--memory-budget", "300M"],
                     env["desk"], tmp_path / "desk.log")
        procs.append(desk)
        link_port = int(wait_line(desk, rf" on {re.escape(netns_pair.addr_a)}:(\d+) \(link")
                        .group(1))
        laptop_env = env["laptop"]
        # neither machine holds the model alone: the laptop's budget refuses it whole
        alone = subprocess.run(["ip", "netns", "exec", netns_pair.b, *SHOAL, "serve",
                                str(gemma_gguf), "--http", "127.0.0.1:0", "--memory-budget",
                                BUDGET, "--discovery", "none"], env=laptop_env,
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert alone.returncode == 2 and "leaves no room" in alone.stderr, alone.stderr
        laptop = in_ns(netns_pair.b, ["serve", str(gemma_gguf), "--runtime", "llamacpp",
                                      "--http", "127.0.0.1:0", "--max-batch", "1",
                                      "--memory-budget", BUDGET, "--discovery", "none",
                                      "--split-with", f"{netns_pair.addr_a}:{link_port}"],
                       laptop_env, tmp_path / "laptop.log")
        procs.append(laptop)
        # the same model whole, on a machine that holds it, with the kernels a split runs
        whole = in_ns(netns_pair.b, ["serve", str(gemma_gguf), "--runtime", "llamacpp",
                                     "--http", "127.0.0.1:0", "--max-batch", "1",
                                     "--discovery", "none"],
                      {**laptop_env, "SHOAL_LLAMA_REPACK": "0"}, tmp_path / "whole.log")
        procs.append(whole)
        whole_port = int(wait_line(whole, r"at http://127\.0\.0\.1:(\d+)/v1", timeout=180)
                         .group(1))
        http_port = int(wait_line(laptop, r"at http://127\.0\.0\.1:(\d+)/v1", timeout=180)
                        .group(1))
        laptop_log = (tmp_path / "laptop.log").read_text()
        layers = re.search(rf"its last layers run on memory desk \({re.escape(netns_pair.addr_a)}"
                           rf":{link_port}\) lends: (\d+) of (\d+) layers", laptop_log)
        assert layers is not None, laptop_log
        assert 0 < int(layers.group(1)) < int(layers.group(2))

        body = complete(netns_pair.b, http_port, gemma_gguf.stem)
        assert body["usage"]["completion_tokens"] == 16, body
        assert body["choices"][0]["text"].strip(), body
        # greedy: the split answers as the model does whole
        same = complete(netns_pair.b, whole_port, gemma_gguf.stem)
        assert same["choices"][0]["text"] == body["choices"][0]["text"], (same, body)

        served = re.search(r"RPC server on 127\.0\.0\.1:(\d+)",
                           (tmp_path / "desk.log").read_text())
        assert served is not None, (tmp_path / "desk.log").read_text()
        rpc_port = int(served.group(1))
        # on the desk itself it listens (its backlog takes a second client) ...
        assert connect_from(netns_pair.a, "127.0.0.1", rpc_port) == "connected"
        # ... but the laptop reaches it on no address: only the link carries it
        assert connect_from(netns_pair.b, netns_pair.addr_a, rpc_port) == \
            "ConnectionRefusedError"
        assert connect_from(netns_pair.b, "127.0.0.1", rpc_port) == "ConnectionRefusedError"
        assert connect_from(netns_pair.b, netns_pair.addr_a, link_port) == "connected"
        assert token not in laptop_log + (tmp_path / "desk.log").read_text()
    finally:
        stop(procs)


def test_a_node_that_joined_a_head_lends_on_the_port_it_opens(
        netns_pair: Pair, tmp_path: Path, gemma_gguf: Path) -> None:  # noqa: F811
    """`shoal node join --lend` (and the app's node, which joins heads): a node that heads
    do not dial listens on the node port while it lends, its head names it there, and a
    split on another machine reaches it."""
    token = "ef" * 32
    env = machines(tmp_path, token, "desk", "laptop")
    laptop_env = env["laptop"]
    procs: list[subprocess.Popen[str]] = []
    try:
        head = in_ns(netns_pair.b, ["serve", "mock-m", "--runtime", "mock", "--http",
                                    "127.0.0.1:0", "--fleet-listen", f"{netns_pair.addr_b}:0",
                                    "--discovery", "none"], laptop_env, tmp_path / "head.log")
        procs.append(head)
        http_port = int(wait_line(head, r"at http://127\.0\.0\.1:(\d+)/v1").group(1))
        joins = until_sync(lambda: re.search(r"taking nodes that join on [\d.]+:(\d+)",
                                             (tmp_path / "head.log").read_text()),
                           "the head's join port")
        desk = in_ns(netns_pair.a, ["node", "join", f"{netns_pair.addr_b}:{joins.group(1)}",
                                    "--runtime", "mock", "--model", "x", "--identity", "desk",
                                    "--discovery", "none", "--lend", "--memory-budget", "300M"],
                     env["desk"], tmp_path / "desk.log")
        procs.append(desk)

        def lending_desk() -> dict | None:
            return next((n for n in fleet(netns_pair.b, http_port)["nodes"]
                         if n["identity"] == "desk" and n["lend_bytes"] > 0 and n["reach"]),
                        None)

        found = until_sync(lending_desk, "the joined desk lending, and where", timeout=60)
        assert found["address"] == "joined:desk"
        assert found["reach"] == f"{netns_pair.addr_a}:{NODE_PORT}"
        split = in_ns(netns_pair.b, ["serve", str(gemma_gguf), "--runtime", "llamacpp",
                                     "--http", "127.0.0.1:0", "--max-batch", "1",
                                     "--discovery", "none", "--split-with", found["reach"]],
                      laptop_env, tmp_path / "split.log")
        procs.append(split)
        split_port = int(wait_line(split, r"at http://127\.0\.0\.1:(\d+)/v1", timeout=180)
                         .group(1))
        assert f"its last layers run on memory desk ({found['reach']}) lends: " in \
            (tmp_path / "split.log").read_text()
        body = complete(netns_pair.b, split_port, gemma_gguf.stem)
        assert body["usage"]["completion_tokens"] == 16, body
    finally:
        stop(procs)
