"""A model split across two machines through the fleet's link (issue 33): a node that
lends memory (``--lend``: llama.cpp's RPC server on its loopback only) and a node that
serves Gemma 3 270M with its last layers there (``--split-with``), reached through a
tunnel over the encrypted link. Its greedy answer equals the model's served whole on one
machine with the same CPU kernels; the RPC server listens on 127.0.0.1 only; a machine
that does not lend refuses in one line; a lending machine killed mid-answer moves the
session to another node with no token twice, and the split forms again when it returns.
Real processes on loopback, real llama.cpp.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from engine.runtimes.rpc_lender import HEADROOM
from tests.e2e.conftest import gemma_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.integration.test_fleet import fleet_state, wait_ready
from tests.waiting import until, until_result, until_sync

pytestmark = [pytest.mark.processes, pytest.mark.e2e]

PROMPT = "The history of the printing press begins"


def greedy(head: Proc, model: str) -> str:
    req = urllib.request.Request(
        f"http://{head.address}/v1/completions",
        json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 24,
                    "temperature": 0}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    assert body["usage"]["completion_tokens"] == 24, body
    return str(body["choices"][0]["text"])


def split_and_whole(cluster: Cluster, gguf: Path, lenders: str) -> tuple[Proc, Proc]:
    """The model split with ``lenders`` (HOST:PORT,...) on a laptop, and whole on a machine
    with the kernels a split runs (``SHOAL_LLAMA_REPACK=0``): their greedy answers compare."""
    split = cluster.head([], model=str(gguf), runtime="llamacpp", ready_timeout=120,
                         extra=("--split-with", lenders, "--max-batch", "1"),
                         env=cluster.machine("laptop"))
    whole = cluster.head([], model=str(gguf), runtime="llamacpp", ready_timeout=120,
                         extra=("--max-batch", "1"),
                         env=cluster.machine("whole", SHOAL_LLAMA_REPACK="0"))
    return split, whole


def fleet_node(head: Proc) -> dict:
    """The one node a head with its own node lists in /v1/fleet."""
    with urllib.request.urlopen(f"http://{head.address}/v1/fleet", timeout=30) as r:
        return dict(json.loads(r.read())["nodes"][0])


def listening(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (IPv4, /proc/net/tcp)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:  # TCP_LISTEN
            out.append(".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_a_model_split_with_a_lending_machine_answers_as_it_does_whole(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    lender = cluster.node("desk", extra=("--lend", "--memory-budget", "300M"),
                          env=cluster.machine("desk"))
    split, whole = split_and_whole(cluster, gemma_gguf, lender.address)
    layers = re.search(rf"its last layers run on memory desk \({lender.address}\) lends: "
                       r"(\d+) of (\d+) layers", split.log_text())
    assert layers is not None, split.log_text()
    assert 0 < int(layers.group(1)) < int(layers.group(2))
    # the fleet shows the split node's part on the lending machine
    node = fleet_node(split)
    assert node["device"].startswith(f"desk ({lender.address}, ") and \
        node["device"].endswith(" lent over the fleet's link)"), node["device"]
    assert (node["gpu_layers"], node["model_layers"]) == (int(layers.group(1)),
                                                          int(layers.group(2)))
    assert node["device_kind"] == ""  # no GPU here for a fit to count
    # no host prompt cache: parking would read the lent layers' KV back over the network
    assert "host prompt cache" not in split.log_text()
    assert "host prompt cache" in whole.log_text()

    model = gemma_gguf.stem
    assert greedy(split, model) == greedy(whole, model)

    served = re.search(r"RPC server on 127\.0\.0\.1:(\d+) \(pid (\d+)\)", lender.log_text())
    assert served is not None, lender.log_text()
    assert listening(int(served.group(1))) == ["127.0.0.1"]  # never on another address
    # the server may take no more than the machine lends (within its 300M budget)
    limits = Path(f"/proc/{served.group(2)}/limits").read_text()
    data = re.search(r"Max data size\s+(\d+)\s+(\d+)", limits)
    assert data is not None, limits
    assert HEADROOM < int(data.group(1)) <= 300 * 2**20 + HEADROOM


def test_a_model_split_with_two_lending_machines_shares_its_layers_between_them(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    desk = cluster.node("desk", extra=("--lend", "--memory-budget", "280M"),
                        env=cluster.machine("desk"))
    attic = cluster.node("attic", extra=("--lend", "--memory-budget", "256M"),
                         env=cluster.machine("attic"))
    split, whole = split_and_whole(cluster, gemma_gguf, f"{desk.address},{attic.address}")
    layers = re.search(rf"its last layers run on memory desk \({desk.address}\), attic "
                       rf"\({attic.address}\) lend: (\d+) of (\d+) layers", split.log_text())
    assert layers is not None, split.log_text()
    node = fleet_node(split)
    # which machine holds which layers and memory
    parts = re.fullmatch(rf"desk \+ attic \(desk \({desk.address}\): [\d.]+ MiB, (\d+) layers; "
                         rf"attic \({attic.address}\): [\d.]+ MiB, (\d+) layers; lent over "
                         r"the fleet's link\)", node["device"])
    assert parts is not None, node["device"]
    on_desk, on_attic = int(parts.group(1)), int(parts.group(2))
    assert on_desk > 0 and on_attic > 0
    assert node["gpu_layers"] == on_desk + on_attic == int(layers.group(1))
    assert on_desk + on_attic < node["model_layers"]  # some stay on the serving machine

    model = gemma_gguf.stem
    assert greedy(split, model) == greedy(whole, model)
    for lender in (desk, attic):  # each lender's RPC server took a client
        assert re.search(r"RPC server on 127\.0\.0\.1:\d+", lender.log_text())


def test_a_machine_that_does_not_lend_is_refused_in_one_line(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    desk = cluster.node("desk", env=cluster.machine("desk"))
    out = subprocess.run([*SHOAL, "serve", str(gemma_gguf), "--split-with", desk.address,
                          "--http", "127.0.0.1:0"], env=cluster.machine("laptop"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line == (f"shoal: cannot split the model with {desk.address}: it lends no memory "
                    "(its owner allows it with --lend)")
    until_sync(lambda: desk.popen.poll() is None, "the desk still serving", timeout=5)


async def test_a_machine_on_its_battery_lends_only_when_its_owner_asked(
        cluster: Cluster, tmp_path: Path) -> None:
    from engine.node.lending import NotLending, Tunnel
    from tests.unit.test_power import supply

    power = tmp_path / "power_supply"  # a laptop off its charger
    supply(power, "AC", type="Mains", online="0")
    supply(power, "BAT0", type="Battery", present="1")
    laptop = cluster.node("laptop", extra=("--lend",),
                          env=cluster.machine("laptop", SHOAL_POWER_SUPPLY=str(power)))
    psk = bytes.fromhex((cluster.home / "fleet" / "token").read_text().strip())
    tunnel = Tunnel(laptop.address, psk, "desk")
    with pytest.raises(NotLending, match="runs on its battery and lends memory only on mains"):
        await tunnel.open()
    asked = cluster.node("asked", extra=("--lend", "--lend-on-battery"),
                         env=cluster.machine("asked", SHOAL_POWER_SUPPLY=str(power)))
    tunnel = Tunnel(asked.address, psk, "desk")
    try:
        await tunnel.open()
        assert tunnel.lend_bytes > 0 and tunnel.identity == "asked"
    finally:
        await tunnel.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ", 1)[1][0] != "Z"


async def completion_stream(head: Proc, max_tokens: int,
                            on_delta: Callable[[int], None]) -> tuple[list[str], dict]:
    """A greedy streamed completion of PROMPT: its text deltas and its usage."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage: dict = {}
    async with aiohttp.ClientSession() as http, \
            http.post(f"http://{head.address}/v1/completions", json=body,
                      timeout=aiohttp.ClientTimeout(total=600)) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    parts.append(choice["text"])
                    on_delta(len(parts))
    return parts, usage


MODEL_NAME = "gemma-3-270m-q4_k_m"
MAX_TOKENS = 800  # long enough that the answer is still running when the lender is killed


async def test_a_lending_machine_killed_mid_answer_moves_the_session_and_the_split_forms_again(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    assert gemma_gguf.stem == MODEL_NAME
    desk_env = cluster.machine("desk")
    lender = cluster.node("desk", extra=("--lend", "--memory-budget", "300M"), env=desk_env)
    laptop = cluster.node("laptop", model=str(gemma_gguf), runtime="llamacpp", lanes=1,
                          extra=("--split-with", lender.address),
                          env=cluster.machine("laptop"), ready_timeout=120)
    head = cluster.head([laptop], model=str(gemma_gguf), runtime="llamacpp",
                        extra=("--fleet-listen", "127.0.0.1:0"), ready_timeout=120)
    await wait_ready(head, 1, timeout=60)
    join = cluster.join_port(head)
    served = re.search(r"RPC server on 127\.0\.0\.1:\d+ \(pid (\d+)\)", lender.log_text())
    assert served is not None, lender.log_text()
    rpc_server = int(served.group(1))

    whole: list[Proc] = []
    killed_at: list[int] = []

    async def kill_the_lender_once_another_node_serves() -> None:
        # the session is on the split node (the only one): now a whole node joins, and the
        # lending machine goes away under the answer
        whole.append(await asyncio.to_thread(
            cluster._start, "whole",
            ["node", "join", f"127.0.0.1:{join}", "--runtime", "llamacpp", "--model",
             str(gemma_gguf), "--identity", "whole", "--max-batch", "1"],
            re.compile(r"joining [\d.]+:(\d+)"),
            cluster.machine("whole", SHOAL_LLAMA_REPACK="0"), (), 120))
        await wait_ready(head, 2, timeout=120)
        killed_at.append(len(parts_seen))
        lender.popen.kill()

    parts_seen: list[int] = []
    tasks: list[asyncio.Task[None]] = []

    def on_delta(n: int) -> None:
        parts_seen.append(n)
        if n == 1:
            tasks.append(asyncio.create_task(kill_the_lender_once_another_node_serves()))

    parts, usage = await completion_stream(head, MAX_TOKENS, on_delta)
    await asyncio.gather(*tasks)
    assert killed_at and killed_at[0] < len(parts), "the answer ended before the kill"
    moved = re.search(r"moved from 'laptop' to 'whole' at .* after (\d+) tokens",
                      head.log_text())
    assert moved is not None, head.log_text()
    at = int(moved.group(1))
    assert killed_at[0] <= at < usage["completion_tokens"]
    # one delta per token (a lagging loop may merge two): none delivered twice
    merged = usage["completion_tokens"] - len(parts)
    assert 0 <= merged <= 3, (usage, len(parts))
    # the lender's RPC server ended with its node, and the split node still runs, down
    await until(lambda: not alive(rpc_server), "the killed lender's RPC server to end")
    assert laptop.popen.poll() is None
    assert "the split with desk (" in laptop.log_text() and " is down: " in laptop.log_text()

    # the lending machine returns on its address: the split forms again and serves
    cluster.node("desk", port=lender.port, extra=("--lend", "--memory-budget", "300M"),
                 env=desk_env)
    await until(lambda: "formed again" in laptop.log_text(), "the split to form again",
                timeout=60)
    whole[0].stop()
    await until_result(lambda: fleet_state(head),
                       lambda s: [(n["identity"], n["lanes_busy"]) for n in s["nodes"]
                                  if n["state"] == "ready"] == [("laptop", 0)],
                       what="the split node ready again, alone", timeout=60)
    reference, _ = await completion_stream(head, at, lambda n: None)
    # before the seam the moved answer is the split's own greedy text, token for token
    assert "".join(parts).startswith("".join(reference)), (reference, parts)


async def test_a_lending_machine_that_sleeps_takes_the_split_down_until_it_wakes(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    lender = cluster.node("desk", extra=("--lend", "--memory-budget", "300M"),
                          env=cluster.machine("desk"))
    split = cluster.head([], model=str(gemma_gguf), runtime="llamacpp", ready_timeout=120,
                         extra=("--split-with", lender.address, "--max-batch", "1"),
                         env=cluster.machine("laptop", SHOAL_RPC_STALL_S="4"))
    model = gemma_gguf.stem
    assert greedy(split, model)

    assert fleet_node(split)["lanes_busy"] == 0
    lender.signal(signal.SIGSTOP)  # asleep: its sockets stay open, nothing answers
    try:
        await until(lambda: "is down: the link to desk" in split.log_text(),
                    "the split node to see the lender asleep", timeout=60)
        await until(lambda: (n := fleet_node(split))["lanes_busy"] == n["lanes"],
                    "every lane busy: heads place elsewhere meanwhile")
    finally:
        lender.signal(signal.SIGCONT)
    await until(lambda: "formed again" in split.log_text(), "the split to form again",
                timeout=60)
    await until(lambda: fleet_node(split)["lanes_busy"] == 0,
                "the split node to take sessions again")
    assert greedy(split, model)
    assert split.popen.poll() is None and lender.popen.poll() is None
