"""Real clients against a head with a real SmolLM2 node: the `openai` SDK (Chat
Completions, Completions, Responses), the `anthropic` SDK and the `ollama` Python client,
unchanged, pointed at the head."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
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


@pytest.fixture
async def client(head: Proc) -> AsyncIterator[Any]:
    """The `openai` SDK's async client, closed while its loop still runs."""
    async with sdk(head) as c:
        yield c


@pytest.fixture
async def claude(head: Proc) -> AsyncIterator[Any]:
    """The `anthropic` SDK's async client, closed while its loop still runs."""
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{head.port}",
                                        api_key="unused", max_retries=0) as c:
        yield c


async def test_openai_sdk_chat_streaming_and_not(head: Proc, client: Any):
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


async def test_openai_sdk_tools(head: Proc, client: Any):
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


async def test_openai_sdk_completions(head: Proc, client: Any):
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


# -- the Anthropic SDK and the Responses API (agents, Copilot, Codex) ------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "the weather in a city",
                    "input_schema": {"type": "object",
                                     "properties": {"city": {"type": "string"}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather",
                    "description": "the weather in a city",
                    "parameters": {"type": "object",
                                   "properties": {"city": {"type": "string"}}}}]
GREEDY = {"temperature": 0}


async def chat_text(client: Any, messages: list[dict[str, Any]]) -> str:
    one = await client.chat.completions.create(model=NAME, messages=messages,
                                               max_tokens=24, temperature=0)
    return one.choices[0].message.content or ""


def prompt_tokens(usage: Any) -> int:
    """All of a Messages prompt: Anthropic counts what came from the cache apart."""
    return int(usage.input_tokens + usage.cache_read_input_tokens)


async def test_anthropic_sdk_messages(head: Proc, claude: Any, client: Any):
    raw = await claude.messages.with_raw_response.create(
        model=NAME, max_tokens=24, messages=COLOURS, extra_body=GREEDY)
    assert raw.headers["x-shoal-model"] == NAME
    one = await raw.parse()
    (block,) = one.content
    assert block.type == "text" and len(block.text.split()) >= 2
    assert one.stop_reason in ("end_turn", "max_tokens") and one.usage.output_tokens > 0
    # the same conversation through Chat Completions: the same greedy answer
    assert block.text == await chat_text(client, COLOURS)
    async with claude.messages.stream(model=NAME, max_tokens=24, messages=COLOURS,
                                      extra_body=GREEDY) as stream:
        parts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(parts) == final.content[0].text == block.text
    assert final.usage.output_tokens == one.usage.output_tokens
    counted = await claude.messages.count_tokens(model=NAME, messages=COLOURS)
    assert counted.input_tokens == prompt_tokens(one.usage) > 0
    # the second time, the node's prompt cache held the prompt: Anthropic's usage says so
    assert final.usage.cache_read_input_tokens > 0
    assert prompt_tokens(final.usage) == counted.input_tokens
    # a system prompt and earlier turns reach the model
    longer = await claude.messages.create(
        model=NAME, max_tokens=24, system="You answer in French.",
        messages=[*COLOURS, {"role": "assistant", "content": block.text},
                  {"role": "user", "content": "And one more?"}], extra_body=GREEDY)
    assert prompt_tokens(longer.usage) > prompt_tokens(one.usage)
    with pytest.raises(anthropic.NotFoundError) as err:
        await claude.messages.create(model="no-such-model", max_tokens=8, messages=COLOURS)
    assert err.value.body["type"] == "error"


async def test_anthropic_sdk_tool_use(head: Proc, claude: Any):
    first = await claude.messages.create(model=NAME, max_tokens=40, messages=WEATHER,
                                         tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    async with claude.messages.stream(model=NAME, max_tokens=40, messages=WEATHER,
                                      tools=ANTHROPIC_TOOLS, extra_body=GREEDY) as stream:
        streamed = await stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [("get_weather", {"city": "Paris"})]
    back = [*WEATHER, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "sunny, 21 C"}]}]
    final = await claude.messages.create(model=NAME, max_tokens=30, messages=back,
                                         tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    assert prompt_tokens(final.usage) > prompt_tokens(first.usage)
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_openai_sdk_responses(head: Proc, client: Any):
    one = await client.responses.create(model=NAME, input=COLOURS, max_output_tokens=24,
                                        temperature=0)
    assert one.status in ("completed", "incomplete") and one.output_text
    assert one.output_text == await chat_text(client, COLOURS)
    assert one.usage.output_tokens > 0
    async with client.responses.stream(model=NAME, input=COLOURS, max_output_tokens=24,
                                       temperature=0) as stream:
        events = [event async for event in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == one.output_text
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=NAME, input="hi", previous_response_id="resp_1")


async def test_openai_sdk_responses_function_tools(head: Proc, client: Any):
    first = await client.responses.create(model=NAME, input=WEATHER, tools=RESPONSES_TOOLS,
                                          max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    async with client.responses.stream(model=NAME, input=WEATHER, tools=RESPONSES_TOOLS,
                                       max_output_tokens=40, temperature=0) as stream:
        streamed = await stream.get_final_response()
    (scall,) = [item for item in streamed.output if item.type == "function_call"]
    assert json.loads(scall.arguments) == {"city": "Paris"}
    back = [*WEATHER, *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    final = await client.responses.create(model=NAME, input=back, tools=RESPONSES_TOOLS,
                                          max_output_tokens=30, temperature=0)
    assert final.usage.input_tokens > first.usage.input_tokens
    assert final.status in ("completed", "incomplete")


async def test_models_describe_themselves_to_editors(head: Proc, client: Any):
    (entry,) = [m for m in (await client.models.list()).data if m.id == NAME]
    described = entry.model_dump()
    assert described["context_window"] == 1024 and described["available"] is True
    assert described["capabilities"]["tools"] is True  # the tools template
    assert described["capabilities"]["fill_in_middle"] is False  # SmolLM2 has no FIM tokens
    oll = ollama.AsyncClient(host=f"http://127.0.0.1:{head.port}")
    shown = await oll.show(NAME)
    assert "tools" in shown.capabilities and "insert" not in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == 1024
    (loaded,) = (await oll.ps()).models
    assert loaded.model == NAME and loaded.context_length == 1024
