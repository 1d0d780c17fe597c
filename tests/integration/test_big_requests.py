"""Large requests are decoded, rendered and tokenized off the event loop: a head whose
loop is held by one request's prompt stalls every other request and session (their
tokens, pings and lease renewals). Sized by the whole request: 100,000 empty messages,
512 large tools or long tool-call arguments weigh as much as long content does.

A real head and mock node in this loop, requests through the real HTTP routes; the loop
watch (tests/loopwatch.py) fails the test if anything held the loop for 100 ms."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from engine.api.schemas import MAX_BODY
from tests.integration.test_api_surface import MODEL, live_head, mock_model

pytestmark = pytest.mark.timeout(120)

# ChatML that renders the tools (the mock's own template leaves them out), as the
# templates of models that call tools do
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}{% for tool in tools %}"
    "{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ call.function.arguments | tojson }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = 100_000
TOOLS = 512


def empty_messages() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": ""}] * MESSAGES}


def large_tools() -> dict[str, Any]:
    # 512 tools of about 15 KB each: just under the body limit
    text = "d" * ((MAX_BODY - 64 * 1024) // TOOLS - 200)
    return {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {
                "name": f"tool_{i}", "description": text,
                "parameters": {"type": "object", "properties": {}}}}
                for i in range(TOOLS)]}


def long_arguments() -> dict[str, Any]:
    # short messages whose tool calls carry about 6 MiB of arguments
    args = json.dumps({"path": "p" * 60_000})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(100):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "read", "arguments": args}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    messages.append({"role": "user", "content": "and now?"})
    return {"messages": messages}


def anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """The same request in Anthropic's shape (tools as name, description, input_schema)."""
    out: dict[str, Any] = {"model": MODEL, "max_tokens": 4,
                           "messages": [m for m in body["messages"]
                                        if m["role"] in ("user", "assistant")
                                        and "tool_calls" not in m]}
    if "tools" in body:
        out["tools"] = [{"name": t["function"]["name"],
                         "description": t["function"]["description"],
                         "input_schema": t["function"]["parameters"]} for t in body["tools"]]
    return out


def openai(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, **body}


def responses(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 4, "input": body["messages"]}


def ollama(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "stream": False, **body}


def encoded(make: Callable[[], dict[str, Any]],
            shape: Callable[[dict[str, Any]], dict[str, Any]]) -> bytes:
    data = json.dumps(shape(make())).encode()
    assert len(data) <= MAX_BODY, len(data)  # within the head's limit: a real request
    return data


CASES = [
    ("/v1/chat/completions", empty_messages, openai),
    ("/v1/chat/completions", large_tools, openai),
    ("/v1/chat/completions", long_arguments, openai),
    ("/v1/messages", empty_messages, anthropic),
    ("/v1/messages/count_tokens", empty_messages, anthropic),
    ("/v1/messages/count_tokens", large_tools, anthropic),
    ("/v1/responses", empty_messages, responses),
    ("/api/chat", empty_messages, ollama),
]


@pytest.fixture(params=CASES, ids=[f"{p.rsplit('/', 1)[-1]}-{m.__name__}" for p, m, _ in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, bytes]:
    """The route and the encoded body, made before the test's loop runs (the client shares
    the head's loop, and encoding megabytes of JSON would hold it)."""
    path, make, shape = request.param
    return path, encoded(make, shape)


async def test_a_large_request_leaves_the_loop_free(case: tuple[str, bytes]) -> None:
    path, data = case
    async with live_head(model=mock_model(template=TOOLS_TEMPLATE)) as live, \
            aiohttp.ClientSession() as http:
        async with http.post(live.url(path), data=data,
                             headers={"Content-Type": "application/json"}) as r:
            status, answer = r.status, await r.json()
        # the prompt is far longer than the mock's 4096-token window, so a generation is
        # refused by name; a count is answered
        if path.endswith("count_tokens"):
            assert status == 200, answer
            assert answer["input_tokens"] > len(data) // 8, answer
        else:
            assert status == 400, answer
            assert "context" in json.dumps(answer), answer
        # and the head answers the next request as before
        async with http.post(live.url("/v1/chat/completions"),
                             json={"model": MODEL, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200, await r.text()
