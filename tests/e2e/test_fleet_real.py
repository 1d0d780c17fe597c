"""Heads and llama.cpp nodes as real processes on 127.0.0.1, on the real GGUF models."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.integration.conftest import SHOAL, Cluster, Proc, sse_text
from tests.integration.test_fleet import fleet_state, url, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
DATA = Path(__file__).parent / "data"
NAME = "SmolLM2-135M-Instruct.Q4_1"  # the head and nodes name a GGUF by its file stem


def real_node(cluster: Cluster, gguf: Path, identity: str, *, lanes: int = 2,
              ctx: int = 1024) -> Proc:
    return cluster.node(identity, model=str(gguf), runtime="llamacpp", lanes=lanes,
                        extra=("--max-context", str(ctx)))


def real_head(cluster: Cluster, gguf: Path, nodes: list[Proc], *extra: str) -> Proc:
    return cluster.head(nodes, model=str(gguf), runtime="llamacpp", extra=tuple(extra))


def chat(content: str, **kw: object) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], **kw}


async def post(head: Proc, body: dict, headers: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text
        return json.loads(text)


async def stream(head: Proc, body: dict, on_chunk=None) -> tuple[str, str | None, dict | None]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw: list[str] = []
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        n = 0
        async for line in r.content:
            raw.append(line.decode())
            n += 1
            if on_chunk is not None:
                await on_chunk(n)
    return sse_text("".join(raw))


async def test_streaming_chat_through_a_head_and_two_real_nodes(cluster, smollm2_gguf):
    cluster.token()
    nodes = [real_node(cluster, smollm2_gguf, f"r{i}") for i in range(2)]
    head = real_head(cluster, smollm2_gguf, nodes, "--fleet-policy", "round-robin")
    await wait_ready(head, 2)
    text, finish, usage = await stream(head, chat("Name three colours.", max_tokens=24,
                                                  temperature=0))
    assert finish in ("stop", "length") and usage["completion_tokens"] > 0
    assert len(text.split()) >= 2  # real words
    second = await post(head, chat("Name three colours.", max_tokens=24, temperature=0))
    assert second["choices"][0]["message"]["content"] == text  # greedy: same answer anywhere
    state = await fleet_state(head)
    assert sorted(n["sessions_total"] for n in state["nodes"]) == [1, 1]
    assert all(n["runtime"] == "llamacpp" and n["kv_total"] == 2048 for n in state["nodes"])
    assert f"runtime llamacpp serves {smollm2_gguf}: context window 1024 tokens (pinned by " \
        "--max-context), 2 lanes" in nodes[0].banner


async def test_eight_concurrent_requests_on_one_eight_lane_node(cluster, smollm2_gguf):
    node = real_node(cluster, smollm2_gguf, "wide", lanes=8, ctx=512)
    head = real_head(cluster, smollm2_gguf, [node])
    await wait_ready(head, 1)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        for _ in range(300):
            state = await fleet_state(head)
            peak = max(peak, state["nodes"][0]["lanes_busy"])
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(
        post(head, chat(f"Write a sentence about the number {i}.", max_tokens=24, seed=i))
        for i in range(8)))
    watcher.cancel()
    assert all(r["choices"][0]["finish_reason"] in ("stop", "length") for r in results)
    assert all(r["usage"]["completion_tokens"] > 0 for r in results)
    assert peak >= 4  # they ran side by side on the lanes, not one after another


async def test_second_turn_reuses_the_prompt_cache(cluster, smollm2_gguf):
    node = real_node(cluster, smollm2_gguf, "cache", lanes=2)
    head = real_head(cluster, smollm2_gguf, [node])
    await wait_ready(head, 1)
    hdr = {"X-Session-Id": "conversation-1"}
    story = "Here is a short story about a lighthouse keeper and a storm at sea. " * 6
    first_msgs = [{"role": "user", "content": story + "Summarise it."}]
    first = await post(head, {"model": NAME, "messages": first_msgs, "max_tokens": 16,
                              "temperature": 0}, hdr)
    answer = first["choices"][0]["message"]["content"]
    second_msgs = [*first_msgs, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "Now in one word."}]
    second = await post(head, {"model": NAME, "messages": second_msgs, "max_tokens": 8,
                               "temperature": 0}, hdr)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 2, (first["usage"], second["usage"])
    assert cached < second["usage"]["prompt_tokens"]


async def test_killed_node_mid_stream_gives_the_same_greedy_text(cluster, smollm2_gguf):
    cluster.token()
    nodes = [real_node(cluster, smollm2_gguf, f"k{i}", lanes=1) for i in range(2)]
    head = real_head(cluster, smollm2_gguf, nodes)
    await wait_ready(head, 2)
    body = chat("Tell me about the history of the bicycle.", max_tokens=80, temperature=0)
    reference, ref_finish, ref_usage = await stream(head, body)
    victim: list[Proc] = []

    async def kill_at(n: int) -> None:
        if n == 40 and not victim:
            state = await fleet_state(head)
            busy = next(x for x in state["nodes"] if x["own_sessions"] > 0)
            proc = next(p for p in nodes if p.address == busy["address"])
            proc.signal(signal.SIGKILL)
            victim.append(proc)

    text, finish, usage = await stream(head, body, on_chunk=kill_at)
    assert victim
    assert text == reference
    assert finish == ref_finish
    assert usage["completion_tokens"] == ref_usage["completion_tokens"]
    assert "moved from" in head.log_text()


async def test_gemma_answers_through_its_fallback_template(cluster, gemma_gguf):
    node = cluster.node("gemma", model=str(gemma_gguf), runtime="llamacpp", lanes=1,
                        extra=("--max-context", "512"))
    head = cluster.head([node], model=str(gemma_gguf), runtime="llamacpp")
    await wait_ready(head, 1)
    name = gemma_gguf.name[:-5]
    body = await post(head, {"model": name, "max_tokens": 12, "temperature": 0,
                             "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Say hello."}]})
    assert body["usage"]["completion_tokens"] > 0
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    # no template in the file: the head chose Gemma's built-in one
    from engine.head.prompt.model import load_head_model

    model = load_head_model("llamacpp", str(gemma_gguf), name=name)
    assert model.template.origin == "builtin" and model.template.family == "gemma"
    prompt = model.template.render([{"role": "user", "content": "hi"}], tools=None)
    assert "<start_of_turn>user" in prompt and prompt.endswith("<start_of_turn>model\n")


async def test_tool_call_round_trip(cluster, smollm2_gguf):
    node = real_node(cluster, smollm2_gguf, "tools", lanes=1)
    head = real_head(cluster, smollm2_gguf, [node], "--chat-template",
                     str(DATA / "tools_chatml.jinja"))
    await wait_ready(head, 1)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await post(head, {"model": NAME, "messages": msgs, "tools": tools,
                              "max_tokens": 40, "temperature": 0})
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # streaming gives the same call as deltas
    body = {"model": NAME, "messages": msgs, "tools": tools, "max_tokens": 40,
            "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as http, \
            http.post(url(head, "/v1/chat/completions"), json=body) as r:
        raw = await r.text()
    deltas = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: {")]
    calls = [d["choices"][0]["delta"]["tool_calls"] for d in deltas
             if d["choices"] and d["choices"][0]["delta"].get("tool_calls")]
    assert calls and calls[0][0]["function"]["name"] == "get_weather"
    assert deltas[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the tool's answer goes back and the model replies in text
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    final = await post(head, {"model": NAME, "messages": msgs, "tools": tools,
                              "max_tokens": 30, "temperature": 0})
    assert final["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert final["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_offline_pull_of_a_missing_id_fails_clearly(cluster):
    out = subprocess.run([*SHOAL, "serve", "someone/missing-model-GGUF:Q4_K_M", "--offline",
                          "--http", "127.0.0.1:0"], env=cluster.env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "someone/missing-model-GGUF:Q4_K_M is not in the cache" in out.stderr
    assert "run once without --offline to pull it" in out.stderr
    assert "Traceback" not in out.stderr
