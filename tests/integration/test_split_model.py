"""A model split across two machines through the fleet's link (issue 33): a node that
lends memory (``--lend``: llama.cpp's RPC server on its loopback only) and a node that
serves Gemma 3 270M with its last layers there (``--split-with``), reached through a
tunnel over the encrypted link. Its greedy answer equals the model's served whole on one
machine with the same CPU kernels; the RPC server listens on 127.0.0.1 only; a machine
that does not lend refuses in one line. Real processes on loopback, real llama.cpp.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import gemma_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.waiting import until_sync

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
    split = cluster.head([], model=str(gemma_gguf), runtime="llamacpp", ready_timeout=120,
                         extra=("--split-with", lender.address, "--max-batch", "1"),
                         env=cluster.machine("laptop"))
    whole = cluster.head([], model=str(gemma_gguf), runtime="llamacpp", ready_timeout=120,
                         extra=("--max-batch", "1"),
                         env=cluster.machine("whole", SHOAL_LLAMA_REPACK="0"))
    layers = re.search(rf"its last layers run on memory desk \({lender.address}\) lends: "
                       r"(\d+) of (\d+) layers", split.log_text())
    assert layers is not None, split.log_text()
    assert 0 < int(layers.group(1)) < int(layers.group(2))
    # the fleet shows the split node's part on the lending machine
    with urllib.request.urlopen(f"http://{split.address}/v1/fleet", timeout=30) as r:
        node = json.loads(r.read())["nodes"][0]
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

    served = re.search(r"RPC server on 127\.0\.0\.1:(\d+)", lender.log_text())
    assert served is not None, lender.log_text()
    assert listening(int(served.group(1))) == ["127.0.0.1"]  # never on another address


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
