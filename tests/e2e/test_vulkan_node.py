"""llama.cpp's Vulkan backend on a real Vulkan driver: Mesa's lavapipe, as llama.cpp's own CI
runs it. Nodes and heads are real processes on 127.0.0.1 on the real GGUF models.

ggml leaves CPU-type Vulkan devices out unless ``GGML_VK_VISIBLE_DEVICES`` names them (as
``--gpu auto`` must on a user's machine: lavapipe is slower than the CPU backend), so the
Vulkan nodes here get ``GGML_VK_VISIBLE_DEVICES=0``. Lavapipe decodes at about a token a
second and compiles its shaders at start (tens of seconds): answers stay short.

Greedy answers on lavapipe are compared with the CPU backend's on a prompt where the two
agree for the whole answer: SmolLM2 (Q4_1) on "What is 2 + 2?", its first 4 tokens here, the
whole answer of Gemma 3 270M on a raw completion in scripts/bench/gpu.py. On
most SmolLM2 prompts they part within the first few tokens (measured on five chat prompts:
equal for 11 tokens on one, apart after 0, 3, 4 and 20 on the others): lavapipe has no
integer dot product, so ggml computes the Q4_1 matrix products in floating point where
the CPU backend quantizes the activations to 8 bits, and a 135M model's greedy choice is
often a near-tie. (A second prompt on lavapipe, for a sensible answer alone, cost 40 s
at about 6 s a token on one CPU; it left.) The failover test moves a session of the same
prompt, whose answer the two backends agree on whole, and whose prefill the Vulkan node
finds in its lane from the compared answer.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import aiohttp
import pytest

from engine.runtimes.gpu import vulkan_library
from tests.integration.conftest import Cluster, Proc, sse_text
from tests.integration.test_fleet import fleet_state, url, wait_ready
from tests.waiting import until_result

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

LAVAPIPE_ICDS = ("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json",
                 "/usr/share/vulkan/icd.d/lvp_icd.aarch64.json")
VK_START = 300.0  # s: lavapipe compiles every pipeline the warm-up uses
SUM = "What is 2 + 2?"
# tokens compared: the greedy answer is "The answer to this classic math problem is 4."
# (11 tokens) on both backends; each token on lavapipe costs about 6 s on one CPU, so the
# comparison takes its first 4 ("The answer to this"), where a backend that computed
# anything else (a wrong layer, a wrong quantisation path) has already parted from the CPU
SUM_TOKENS = 4
ANSWER = 16  # the failover's answer: SUM's whole, to its end of generation

needs_lavapipe = pytest.mark.skipif(
    vulkan_library() is None or not any(os.path.exists(p) for p in LAVAPIPE_ICDS),
    reason="needs llama.cpp's Vulkan backend in .venv and Mesa's lavapipe "
           "(scripts/test installs both: scripts/lib/vulkan_backend.py, mesa-vulkan-drivers)")


def said(proc: Proc) -> str:
    """What a process printed at start: its ready line, and the lines before it in its log."""
    return proc.banner + proc.log_text()


def lavapipe_env(cluster: Cluster) -> dict[str, str]:
    return {**cluster.env, "GGML_VK_VISIBLE_DEVICES": "0"}


def serve(cluster: Cluster, gguf: Path, *extra: str, env: dict[str, str] | None = None,
          ctx: int = 1024) -> Proc:
    """A head with its own llama.cpp node in one process (`shoal serve`)."""
    return cluster.head([], model=str(gguf), runtime="llamacpp", env=env,
                        extra=("--max-context", str(ctx), "--max-batch", "2", *extra),
                        ready_timeout=VK_START)


async def chat(head: Proc, model: str, content: str, max_tokens: int, *,
               host: str = "") -> dict:
    """``host``: on that node only (``?host=``)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    where = f"/v1/chat/completions?host={host}" if host else "/v1/chat/completions"
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, where), json=body) as r:
        text = await r.text()
        assert r.status == 200, text
        return await r.json()


def has_text(line: str) -> bool:
    """An SSE line of a chat stream that carries answer text (not the role, not usage)."""
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line[len("data: "):])
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or [])


async def local_node(head: Proc) -> dict:
    state = await wait_ready(head, 1, timeout=60)
    (node,) = state["nodes"]
    return node


@pytest.mark.parametrize(("case", "line"), [
    ("no_driver", "the GPU is not used: llama.cpp's Vulkan backend did not start: no "
                  "working Vulkan driver"),
    ("cpu_device_only", "the GPU is not used: no Vulkan driver lists a GPU"),
])
@needs_lavapipe
async def test_without_a_usable_driver_the_node_runs_on_the_cpu_and_says_why(
        cluster, smollm2_gguf, case, line):
    env = dict(cluster.env)
    env.pop("GGML_VK_VISIBLE_DEVICES", None)
    if case == "no_driver":
        # the Vulkan loader finds no driver at all (the path names no manifest)
        nowhere = "/nonexistent/icd.json"
        env.update(VK_ICD_FILENAMES=nowhere, VK_DRIVER_FILES=nowhere,
                   GGML_VK_VISIBLE_DEVICES="0")
    # else: lavapipe is there, and ggml leaves a CPU-type device out by default
    cluster.token()
    head = serve(cluster, smollm2_gguf, env=env)
    assert line in said(head), said(head)
    assert "the model runs on the CPU" in said(head)
    assert (await local_node(head))["device"] is None
    got = await chat(head, smollm2_gguf.name[:-5], SUM, 16)
    assert "4" in got["choices"][0]["message"]["content"], got


@needs_lavapipe
async def test_a_vulkan_node_offloads_answers_as_the_cpu_is_placed_and_failed_over(
        cluster, smollm2_gguf):
    """A lavapipe node and a CPU node behind one head. The Vulkan node puts every layer on
    the GPU and says so, and answers as the CPU node does. Both measure their rates at
    start, so the head knows before any session that the CPU node is the fast one
    (lavapipe is a CPU, and a slow one) and places the first session there. Then, with the
    CPU node gone, a session runs on the Vulkan node; a CPU node comes back on the same
    address, the Vulkan node is killed mid-answer, and the session finishes on the CPU node
    with the same greedy text, no token lost. (One lavapipe node for all of it: its start
    compiles Vulkan's shaders on the CPU. Gemma 3 270M on lavapipe, minutes at a token a
    second on two cores, is scripts/bench/gpu.py --model gemma --device 0.)"""
    cluster.token()
    name = smollm2_gguf.name[:-5]
    extra = ("--max-context", "1024")

    def cpu_node(port: int = 0) -> Proc:
        return cluster.node("cpu", model=str(smollm2_gguf), runtime="llamacpp", lanes=1,
                            port=port, extra=(*extra, "--gpu", "off"))

    fast = cpu_node()
    assert "the GPU is not used (--gpu off); the model runs on the CPU" in said(fast)
    assert "Vulkan0" not in said(fast)
    vk = cluster.node("vk", model=str(smollm2_gguf), runtime="llamacpp", lanes=1,
                      extra=(*extra, "--gpu", "auto"), env=lavapipe_env(cluster),
                      ready_timeout=VK_START)
    # the one line that says what the node chose
    assert "GPU Vulkan0 (llvmpipe" in said(vk), said(vk)
    assert "all layers of the model on it" in said(vk), said(vk)
    head = cluster.head([fast, vk], model=str(smollm2_gguf), runtime="llamacpp",
                        extra=("--fleet-listen", "127.0.0.1:0"))
    state = await wait_ready(head, 2, timeout=60)
    by_addr = {n["address"]: n for n in state["nodes"]}
    cpu_seen, vk_seen = by_addr[fast.address], by_addr[vk.address]
    # the warm-up's rates reached the head before its first session
    assert cpu_seen["sessions_total"] == vk_seen["sessions_total"] == 0
    assert cpu_seen["decode_tps"] > vk_seen["decode_tps"] > 0
    assert vk_seen["device"].startswith("Vulkan0 (llvmpipe") and cpu_seen["device"] is None
    assert vk_seen["gpu_layers"] == vk_seen["model_layers"] > 0

    # the same greedy answer from the GPU as from the CPU
    on_cpu = await chat(head, name, SUM, SUM_TOKENS, host="cpu")
    on_vk = await chat(head, name, SUM, SUM_TOKENS, host="vk")
    text = on_vk["choices"][0]["message"]["content"]
    assert text.startswith("The answer"), text
    assert text == on_cpu["choices"][0]["message"]["content"], text
    assert on_vk["usage"]["completion_tokens"] == on_cpu["usage"]["completion_tokens"] > 0

    reference = await chat(head, name, SUM, ANSWER)
    assert reference["choices"][0]["finish_reason"] == "stop", reference
    after = {n["address"]: n for n in (await fleet_state(head))["nodes"]}
    # the pinned ones above, then the first free choice: the fast node
    assert after[fast.address]["sessions_total"] == 2
    assert after[vk.address]["sessions_total"] == 1

    fast.signal(signal.SIGKILL)
    await until_result(lambda: fleet_state(head),
                       lambda st: any(n["address"] == fast.address and n["state"] != "ready"
                                      for n in st["nodes"]),
                       what="the head to see the CPU node gone", timeout=30)
    join = f"127.0.0.1:{cluster.join_port(head)}"
    body = {"model": name, "max_tokens": ANSWER, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": SUM}]}
    raw: list[str] = []
    back: list[Proc] = []
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            raw.append(line.decode())
            if not back and has_text(raw[-1]):  # the answer has begun on the Vulkan node
                # frozen at once, while both backends still agree (it would otherwise go
                # on decoding while the CPU node starts); a CPU node joins (it dials the
                # head), then the Vulkan one dies. The head may find it hung first (no
                # pong for 3 s while the CPU node starts): the session moves either way
                vk.signal(signal.SIGSTOP)
                back.append(cluster._start(
                    "cpu2", ["node", "join", join, "--runtime", "llamacpp", "--model",
                             str(smollm2_gguf), "--identity", "cpu2", "--max-batch", "1",
                             *extra, "--gpu", "off"],
                    re.compile(r"joining [\d.]+:(\d+)")))
                await until_result(lambda: fleet_state(head),
                                   lambda st: any(n["identity"] == "cpu2"
                                                  and n["state"] == "ready"
                                                  for n in st["nodes"]),
                                   what="the CPU node joined", timeout=60)
                vk.signal(signal.SIGKILL)
    assert back, "the stream ended before the Vulkan node had begun"
    text, finish, usage = sse_text("".join(raw))
    # moved mid-answer: after at least the token the client had when the node froze
    assert re.search(r"moved from 'vk' to 'cpu2' .* after [1-9]\d* tokens",
                     head.log_text()), head.log_text()
    assert text == reference["choices"][0]["message"]["content"]
    assert finish == reference["choices"][0]["finish_reason"]
    assert usage["completion_tokens"] == reference["usage"]["completion_tokens"]
