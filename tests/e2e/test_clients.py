"""Real clients against a head with a real SmolLM2 node: the `openai` SDK and the `ollama`
Python client, unchanged, pointed at the head."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from tests.e2e.test_fleet_real import DATA, NAME, real_head, real_node
from tests.integration.conftest import Cluster, Proc
from tests.integration.test_fleet import wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.processes,
              pytest.mark.timeout(300)]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
COLOURS = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[Proc]:
    """One head for the module, with the small tools template (plain ChatML otherwise)."""
    tmp = tmp_path_factory.mktemp("clients")
    logs = tmp / "logs"
    logs.mkdir()
    cluster = Cluster(tmp / "home", logs)
    try:
        node = real_node(cluster, smollm2_gguf, "r0", lanes=2)
        proc = real_head(cluster, smollm2_gguf, [node], "--chat-template",
                         str(DATA / "tools_chatml.jinja"))
        asyncio.run(wait_ready(proc, 1))
        yield proc
    finally:
        cluster.close()


def sdk(head: Proc) -> Any:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{head.port}/v1", api_key="unused",
                              max_retries=0)


async def test_openai_sdk_chat_streaming_and_not(head: Proc):
    client = sdk(head)
    raw = await client.chat.completions.with_raw_response.create(
        model=NAME, messages=COLOURS, max_tokens=24, temperature=0)
    assert raw.headers["x-shoal-model"] == NAME
    one = raw.parse()
    text = one.choices[0].message.content
    assert one.choices[0].finish_reason in ("stop", "length") and len(text.split()) >= 2
    assert one.usage.completion_tokens > 0
    stream = await client.chat.completions.create(
        model=NAME, messages=COLOURS, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == text  # greedy: the same answer
    assert usage is not None and usage.completion_tokens == one.usage.completion_tokens
    # a loosely spelled name reaches the same model
    loose = await client.chat.completions.create(
        model=NAME.lower(), messages=COLOURS, max_tokens=24, temperature=0)
    assert loose.choices[0].message.content == text
    models = await client.models.list()
    assert NAME in [m.id for m in models.data]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=COLOURS)


async def test_openai_sdk_tools(head: Proc):
    client = sdk(head)
    first = await client.chat.completions.create(
        model=NAME, messages=WEATHER, tools=TOOLS, max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the SDK's deltas add up to the same call
    stream = await client.chat.completions.create(
        model=NAME, messages=WEATHER, tools=TOOLS, max_tokens=40, temperature=0, stream=True)
    name, args, finish = "", "", None
    async for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}
    assert finish == "tool_calls"
    # the tool's answer goes back through the SDK's own message objects
    msgs = [*WEATHER, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = await client.chat.completions.create(
        model=NAME, messages=msgs, tools=TOOLS, max_tokens=30, temperature=0)
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


async def test_openai_sdk_completions(head: Proc):
    client = sdk(head)
    one = await client.completions.create(model=NAME, prompt="The capital of France is",
                                          max_tokens=8, temperature=0)
    text = one.choices[0].text
    assert text and one.usage.completion_tokens > 0
    assert one.choices[0].finish_reason in ("stop", "length")
    stream = await client.completions.create(model=NAME, prompt="The capital of France is",
                                             max_tokens=8, temperature=0, stream=True)
    parts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(parts) == text
    # SmolLM2's GGUF has no fill-in-the-middle tokens: a clear 400, not a guess
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=NAME, prompt="def add(a, b):\n    ",
                                        suffix="\n\nprint(add(1, 2))", max_tokens=8)
    assert "has no fill-in-the-middle tokens" in str(err.value)


async def test_ollama_client_chat_and_generate(head: Proc):
    client = ollama.AsyncClient(host=f"http://127.0.0.1:{head.port}")
    options = {"num_predict": 24, "temperature": 0}
    one = await client.chat(model=NAME, messages=COLOURS, options=options)
    text = one.message.content
    assert one.done and one.done_reason in ("stop", "length") and text
    assert one.eval_count > 0 and one.prompt_eval_count > 0 and one.total_duration > 0
    parts = [p async for p in await client.chat(model=NAME, messages=COLOURS,
                                                options=options, stream=True)]
    assert "".join(p.message.content or "" for p in parts) == text
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    # /api/generate renders the same chat template around the prompt: the same answer
    gen = await client.generate(model=NAME, prompt=COLOURS[0]["content"], options=options)
    assert gen.response == text and gen.done
    streamed = [p async for p in await client.generate(
        model=NAME, prompt=COLOURS[0]["content"], options=options, stream=True)]
    assert "".join(p.response or "" for p in streamed) == text
    # ":latest" as Ollama's tools add it
    tagged = await client.chat(model=f"{NAME}:latest", messages=COLOURS, options=options)
    assert tagged.message.content == text
    listed = await client.list()
    assert NAME in [m.model for m in listed.models]
    shown = await client.show(NAME)
    assert "completion" in (shown.capabilities or [])
    assert shown.details and shown.details.format == "gguf"
    with pytest.raises(ollama.ResponseError) as err:
        await client.chat(model="no-such-model", messages=COLOURS)
    assert err.value.status_code == 404


async def test_ollama_client_tools(head: Proc):
    client = ollama.AsyncClient(host=f"http://127.0.0.1:{head.port}")
    r = await client.chat(model=NAME, messages=WEATHER, tools=TOOLS,
                          options={"num_predict": 40, "temperature": 0})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    assert dict(call.function.arguments) == {"city": "Paris"}
    # the call and the tool's answer go back as Ollama sends them
    msgs = [*WEATHER, r.message, {"role": "tool", "tool_name": "get_weather",
                                  "content": "sunny, 21 C"}]
    final = await client.chat(model=NAME, messages=msgs, tools=TOOLS,
                              options={"num_predict": 30, "temperature": 0})
    assert final.done and final.prompt_eval_count > r.prompt_eval_count
