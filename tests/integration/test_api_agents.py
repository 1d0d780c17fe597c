"""The routes agents speak besides Chat Completions, through their real SDKs against an
in-process head with mock nodes: Anthropic Messages (`anthropic`), the Responses API
(`openai`), and session affinity without a header."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
import prometheus_client.parser  # noqa: F401  # keepalives_sent imports it, here not in a loop
import pytest

from engine.head.access import keys
from tests.integration.agents import (
    MODEL,
    agent_head,
    all_prompts,
    anthropic_client,
    call,
    engines,
    openai_client,
)
from tests.integration.test_api_surface import keepalives_sent, live_head
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
SECRET = bytes(range(100, 132))
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
OPENER = '<tool_call>\n{"name": "get_weather", "arguments": '
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "the weather in a city",
                    "input_schema": {"type": "object",
                                     "properties": {"city": {"type": "string"}}}}]
FUNCTION_TOOLS = [{"type": "function", "name": "get_weather",
                   "description": "the weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def weather(prompt: str) -> str:
    """The script of a model that calls the weather tool, then reads its answer."""
    if "<tool_response>" in prompt:
        return "It is sunny in Paris."
    if prompt.endswith(OPENER):
        return '{"city": "Paris"}}</tool_call>'  # the head opened the call
    return CALL


def sse(raw: str) -> list[tuple[str | None, dict[str, Any] | str]]:
    """(event name, data) of each event of an SSE body; comments are left out."""
    out: list[tuple[str | None, dict[str, Any] | str]] = []
    for block in raw.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((name, json.loads(data) if data.startswith("{") else data))
    return out


def message_stream(client: anthropic.Anthropic, **kw: Any) -> tuple[list[Any], Any]:
    """``messages.stream``: every event the SDK yields, and its final message."""
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def response_stream(client: openai.OpenAI, **kw: Any) -> tuple[list[Any], Any]:
    """``responses.stream``: every event the SDK yields, and its final response."""
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


# -- Anthropic Messages --------------------------------------------------------------


async def test_anthropic_messages_create_stream_and_count():
    async with agent_head() as live, anthropic_client(live.url("")) as client, \
            aiohttp.ClientSession() as http:
        turns = [{"role": "user", "content": "Name three colours."},
                 {"role": "assistant", "content": "Red, green"},
                 {"role": "user", "content": [{"type": "text", "text": "And one more?"}]}]
        greedy = {"temperature": 0, "top_k": 40, "top_p": 0.9}
        one = await call(client.messages.create, model=MODEL, max_tokens=24, system="Be brief.",
                         messages=turns, extra_body=greedy)
        assert one.type == "message" and one.role == "assistant" and one.model == MODEL
        assert one.id.startswith("msg_")
        (block,) = one.content
        assert block.type == "text" and len(block.text) == 24
        assert one.stop_reason == "max_tokens" and one.stop_sequence is None
        assert one.usage.output_tokens == 24
        # the system prompt and every turn reached the node, in order, through the template
        prompt = all_prompts(live)[-1]
        assert prompt.index("<|im_start|>system\nBe brief.") < prompt.index(
            "Name three colours.") < prompt.index("Red, green") < prompt.index(
            "And one more?") < prompt.rindex("<|im_start|>assistant\n")
        counted = await call(client.messages.count_tokens, model=MODEL, system="Be brief.",
                             messages=turns)
        assert counted.input_tokens == one.usage.input_tokens == engines(live)[0].sizes[-1]
        # streamed: the same answer through the SDK's own accumulation
        events, final = await call(message_stream, client, model=MODEL, max_tokens=24,
                                   system="Be brief.", messages=turns, extra_body=greedy)
        kinds = [event.type for event in events]
        assert final.content[0].text == block.text
        assert final.stop_reason == "max_tokens"
        assert final.usage.output_tokens == 24
        assert final.usage.input_tokens == one.usage.input_tokens
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "text" in kinds and "message_delta" in kinds
        # the wire itself: Anthropic's event sequence, each event named as its data's type
        body = {"model": MODEL, "max_tokens": 6, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(live.url("/v1/messages"), json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith(
                "text/event-stream")
            events = sse(await r.text())
        names = [name for name, _ in events]
        assert all(isinstance(d, dict) and d["type"] == name for name, d in events)
        deltas = names.count("content_block_delta")
        assert names == ["message_start", "content_block_start",
                         *["content_block_delta"] * deltas, "content_block_stop",
                         "message_delta", "message_stop"]
        start = events[0][1]
        assert isinstance(start, dict) and start["message"]["content"] == []
        assert start["message"]["stop_reason"] is None
        delta = events[-2][1]
        assert isinstance(delta, dict) and delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] == 6
        # a stop sequence ends the answer, and the message says which
        cut = block.text[5:7]
        stopped = await call(client.messages.create, model=MODEL, max_tokens=24, system="Be brief.",
                             messages=turns, stop_sequences=["zzzz", cut], extra_body=greedy)
        assert stopped.content[0].text == block.text.split(cut)[0]
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut


async def test_anthropic_prefill_continues_the_answer():
    async with agent_head(lambda p: " world." if p.endswith("Hello") else None) as live, \
            anthropic_client(live.url("")) as client:
        one = await call(client.messages.create, model=MODEL, max_tokens=20,
                         messages=[{"role": "user", "content": "Greet the world."},
                                   {"role": "assistant", "content": "Hello"}])
        assert one.content[0].text == " world." and one.stop_reason == "end_turn"
        assert all_prompts(live)[-1].endswith("<|im_start|>assistant\nHello")


async def test_anthropic_tool_use_round_trip_and_tool_choice():
    async with agent_head(weather) as live, anthropic_client(live.url("")) as client:
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = await call(client.messages.create, model=MODEL, max_tokens=100, messages=ask,
                           tools=ANTHROPIC_TOOLS)
        assert first.stop_reason == "tool_use"
        (use,) = first.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.id
        assert use.input == {"city": "Paris"}
        # the tool definitions reached the template
        assert "get_weather: the weather in a city" in all_prompts(live)[-1]
        # streamed: the call comes as one input_json_delta in its block
        raw, streamed = await call(message_stream, client, model=MODEL, max_tokens=100,
                                   messages=ask, tools=ANTHROPIC_TOOLS)
        assert [b.type for b in streamed.content] == ["tool_use"]
        assert streamed.content[0].input == {"city": "Paris"}
        assert streamed.stop_reason == "tool_use"
        json_deltas = [e.delta.partial_json for e in raw
                       if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        assert json.loads("".join(json_deltas)) == {"city": "Paris"}
        # the result goes back as a tool_result block; the answer reads it
        back = [*ask, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id,
                     "content": [{"type": "text", "text": "sunny, 21 C"}]},
                    {"type": "text", "text": "Thanks."}]}]
        final = await call(client.messages.create, model=MODEL, max_tokens=100, messages=back,
                           tools=ANTHROPIC_TOOLS)
        assert final.content[0].text == "It is sunny in Paris."
        assert final.stop_reason == "end_turn"
        prompt = all_prompts(live)[-1]
        assert CALL in prompt  # the earlier call, rendered as the model wrote it
        assert prompt.index("<tool_response>sunny, 21 C</tool_response>") < prompt.index(
            "Thanks.")
        # tool_choice: a named tool is opened for the model; "any" opens a call
        forced = await call(client.messages.create, model=MODEL, max_tokens=100,
                            messages=[{"role": "user", "content": "Hi!"}], tools=ANTHROPIC_TOOLS,
                            tool_choice={"type": "tool", "name": "get_weather"})
        assert all_prompts(live)[-1].endswith(OPENER)
        assert forced.content[0].type == "tool_use"
        assert forced.content[0].input == {"city": "Paris"}
        await call(client.messages.count_tokens, model=MODEL, messages=ask, tools=ANTHROPIC_TOOLS,
                   tool_choice={"type": "any"})
        none = await call(client.messages.create, model=MODEL, max_tokens=100, messages=ask,
                          tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
        assert "get_weather: the weather" not in all_prompts(live)[-1]
        assert none.content[0].type == "text" and none.stop_reason == "end_turn"
        with pytest.raises(anthropic.BadRequestError) as err:
            await call(client.messages.create, model=MODEL, max_tokens=10, messages=ask,
                       tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"})
        assert "'nope', which is not among the request's tools" in str(err.value)


async def test_anthropic_one_call_when_parallel_calls_are_off():
    async with agent_head(lambda p: CALL + CALL.replace("Paris", "Rome")) as live, \
            anthropic_client(live.url("")) as client:
        ask = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        both = await call(client.messages.create, model=MODEL, max_tokens=200, messages=ask,
                          tools=ANTHROPIC_TOOLS)
        assert [b.input["city"] for b in both.content] == ["Paris", "Rome"]
        one = await call(client.messages.create, model=MODEL, max_tokens=200, messages=ask,
                         tools=ANTHROPIC_TOOLS,
                         tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [b.input["city"] for b in one.content] == ["Paris"]
        assert one.stop_reason == "tool_use"


async def test_anthropic_errors_in_its_shape():
    async with agent_head() as live, anthropic_client(live.url("")) as client, \
            aiohttp.ClientSession() as http:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "aGk="}}
        with pytest.raises(anthropic.BadRequestError) as err:
            await call(client.messages.create, model=MODEL, max_tokens=8,
                       messages=[{"role": "user", "content": [
                           {"type": "text", "text": "what is it?"}, image]}])
        body = err.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(
            "messages[0].content[1]: image blocks are not supported;")
        with pytest.raises(anthropic.NotFoundError) as missing:
            await call(client.messages.create, model="claude-unknown-1", max_tokens=8,
                       messages=[{"role": "user", "content": "hi"}])
        assert missing.value.body["error"]["type"] == "not_found_error"
        assert "GET /v1/models lists" in missing.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError) as server_tool:
            await call(client.messages.create, model=MODEL, max_tokens=8,
                       messages=[{"role": "user", "content": "hi"}],
                       tools=[{"type": "web_search_20250305", "name": "web_search"}])
        assert "server tool" in server_tool.value.body["error"]["message"]
        for bad in ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                    {"model": MODEL, "max_tokens": 5, "messages": []},
                    {"model": MODEL, "max_tokens": 5,
                     "messages": [{"role": "system", "content": "x"}]}):
            async with http.post(live.url("/v1/messages"), json=bad) as r:
                assert r.status == 400, bad
                got = await r.json()
            assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
        async with http.get(live.url("/v1/messages")) as r:
            assert r.status == 405 and (await r.json())["type"] == "error"


async def test_anthropic_key_in_x_api_key():
    alice = keys.issue_key(SECRET, "alice")
    async with agent_head(keys_secret=SECRET) as live, \
            anthropic_client(live.url(""), alice) as client, \
            anthropic_client(live.url(""), "sk-shoal-mallory-0000") as wrong, \
            aiohttp.ClientSession() as http:
        one = await call(client.messages.create, model=MODEL, max_tokens=4,
                         messages=[{"role": "user", "content": "hi"}])
        assert len(one.content[0].text) == 4
        with pytest.raises(anthropic.AuthenticationError) as err:
            await call(wrong.messages.count_tokens, model=MODEL,
                       messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["error"]["type"] == "authentication_error"
        # OpenAI's clients send the same key as a bearer token, on every route
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(live.url("/v1/messages"), json=body,
                             headers={"Authorization": f"Bearer {alice}"}) as r:
            assert r.status == 200
        async with http.get(live.url("/v1/models"), headers={"x-api-key": alice}) as r:
            assert r.status == 200
        async with http.post(live.url("/v1/messages"), json=body) as r:
            assert r.status == 401
            assert "'x-api-key: <key>'" in (await r.json())["error"]["message"]


async def test_anthropic_pings_behind_a_full_fleet():
    async with live_head(lanes=1, speed=40.0, keepalive_s=0.2) as live, \
            aiohttp.ClientSession() as http, anthropic_client(live.url("")) as client:
        hog_body = {"model": MODEL, "max_tokens": 50, "seed": 1,
                    "messages": [{"role": "user", "content": "hog"}]}
        body = {"model": MODEL, "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        hog = asyncio.create_task(http.post(live.url("/v1/chat/completions"), json=hog_body))
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the hog to take the only lane")
        async with http.post(live.url("/v1/messages"), json=body) as r:
            assert r.status == 200
            events = sse(await r.text())
        (await hog).release()
        names = [name for name, _ in events]
        # message_start first, then pings while it waits, then the answer
        assert names[0] == "message_start" and names[1] == "ping"
        assert "ping" not in names[names.index("content_block_start"):]
        assert names[-1] == "message_stop"
        # the SDK reads an answer behind pings
        hog = asyncio.create_task(http.post(live.url("/v1/chat/completions"), json=hog_body))
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the hog to take the only lane again")
        before = await keepalives_sent(http, live)
        # greedy: the mock model's answer is then fixed (sampled, one in a few hundred of
        # its tokens is an end of text, and the answer came back short by chance)
        _events, final = await call(message_stream, client, model=MODEL, max_tokens=4,
                                    extra_body={"temperature": 0}, messages=body["messages"])
        text = final.content[0].text
        assert len(text) == 4 and await keepalives_sent(http, live) > before
        (await hog).release()


# -- OpenAI Responses ----------------------------------------------------------------


async def test_responses_create_and_stream():
    async with agent_head(lambda p: "Paris is the capital of France.") as live, \
            openai_client(live.url("")) as client, aiohttp.ClientSession() as http:
        one = await call(client.responses.create, model=MODEL, instructions="Answer in one line.",
                         input="What is the capital of France?")
        assert one.object == "response" and one.id.startswith("resp_")
        assert one.status == "completed" and one.store is False
        assert one.output_text == "Paris is the capital of France."
        (item,) = one.output
        assert item.type == "message" and item.role == "assistant"
        assert item.status == "completed"
        assert one.usage.output_tokens == len(one.output_text)
        assert one.usage.total_tokens == one.usage.input_tokens + one.usage.output_tokens
        prompt = all_prompts(live)[-1]
        assert prompt.startswith("<|im_start|>system\nAnswer in one line.<|im_end|>")
        assert one.usage.input_tokens == engines(live)[0].sizes[-1]
        events, final = await call(response_stream, client, model=MODEL,
                                   instructions="Answer in one line.",
                                   input="What is the capital of France?")
        assert final.output_text == one.output_text
        assert final.usage.output_tokens == one.usage.output_tokens
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events)))
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == one.output_text
        kinds = [e.type for e in events if e.type != "response.output_text.delta"]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
        # input items: a conversation, developer messages read as system
        turns = [{"role": "developer", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                 {"type": "message", "role": "assistant",
                  "content": [{"type": "output_text", "text": "Hello!"}]},
                 {"role": "user", "content": "Capital of France?"}]
        await call(client.responses.create, model=MODEL, input=turns)
        prompt = all_prompts(live)[-1]
        assert prompt.index("system\nBe brief.") < prompt.index("user\nHi") < prompt.index(
            "assistant\nHello!") < prompt.index("Capital of France?")
        # max_output_tokens cuts it: incomplete, as OpenAI says it
        cut = await call(client.responses.create, model=MODEL, input="Capital?",
                         max_output_tokens=5)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == \
            "max_output_tokens"
        assert cut.output_text == "Paris"
        body = {"model": MODEL, "input": "Capital?", "max_output_tokens": 5, "stream": True}
        async with http.post(live.url("/v1/responses"), json=body) as r:
            events = sse(await r.text())
        assert events[-1][0] == "response.incomplete"
        assert [d["sequence_number"] for _, d in events if isinstance(d, dict)] == \
            list(range(len(events)))


async def test_responses_function_tools_round_trip():
    async with agent_head(weather) as live, openai_client(live.url("")) as client:
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = await call(client.responses.create, model=MODEL, input=ask, tools=FUNCTION_TOOLS)
        (fcall,) = first.output
        assert fcall.type == "function_call" and fcall.name == "get_weather"
        assert json.loads(fcall.arguments) == {"city": "Paris"} and fcall.call_id
        assert first.status == "completed"
        assert "get_weather: the weather in a city" in all_prompts(live)[-1]
        events, streamed = await call(response_stream, client, model=MODEL, input=ask,
                                      tools=FUNCTION_TOOLS)
        (scall,) = streamed.output
        assert scall.type == "function_call" and json.loads(scall.arguments) == \
            {"city": "Paris"}
        kinds = [e.type for e in events]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
        # the output goes back as input items, with the tool's result
        back = [*ask, *[item.model_dump(exclude_none=True) for item in first.output],
                {"type": "function_call_output", "call_id": fcall.call_id,
                 "output": "sunny, 21 C"}]
        final = await call(client.responses.create, model=MODEL, input=back, tools=FUNCTION_TOOLS)
        assert final.output_text == "It is sunny in Paris."
        prompt = all_prompts(live)[-1]
        assert CALL in prompt and "<tool_response>sunny, 21 C</tool_response>" in prompt
        # tool_choice: a named function is opened for the model
        forced = await call(client.responses.create, model=MODEL, input="Hi!", tools=FUNCTION_TOOLS,
                            tool_choice={"type": "function", "name": "get_weather"})
        assert all_prompts(live)[-1].endswith(OPENER)
        assert forced.output[0].type == "function_call"
        # and Chat Completions' tool_choice means the same
        chat = await call(client.chat.completions.create, model=MODEL,
                          messages=[{"role": "user", "content": "Hi!"}],
                          tools=[{"type": "function", "function": {
                              k: v for k, v in FUNCTION_TOOLS[0].items() if k != "type"}}],
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert all_prompts(live)[-1].endswith(OPENER)
        assert chat.choices[0].message.tool_calls[0].function.name == "get_weather"


async def test_responses_refusals():
    async with agent_head() as live, openai_client(live.url("")) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await call(client.responses.create, model=MODEL, input="hi",
                       previous_response_id="resp_123")
        assert "keeps no responses" in err.value.message
        assert err.value.param == "previous_response_id"
        for kw, words in (({"tools": [{"type": "custom", "name": "apply_patch"}]},
                           "tools of type 'custom' are not supported"),
                          # a hosted tool is left out: offered alone, there is nothing
                          ({"tools": [{"type": "web_search"}], "tool_choice": "required"},
                           "offers no tools"),
                          ({"input": [{"role": "user", "content": [
                              {"type": "input_image", "image_url": "data:,"}]}]},
                           "image input is not supported"),
                          ({"input": [{"type": "item_reference", "id": "msg_1"}]},
                           "keeps none"),
                          ({"tool_choice": "required"}, "offers no tools"),
                          ({"text": {"format": {"type": "json_object"}}}, "text.format"),
                          ({"input": ""}, "input is empty")):
            args = {"model": MODEL, "input": "hi", **kw}
            with pytest.raises(openai.BadRequestError) as err:
                await call(client.responses.create, **args)
            assert words in err.value.message, (kw, err.value.message)
        with pytest.raises(openai.NotFoundError):
            await call(client.responses.create, model="gpt-5", input="hi")


async def test_responses_keepalive_follows_response_created():
    async with live_head(lanes=1, speed=40.0, keepalive_s=0.2) as live, \
            aiohttp.ClientSession() as http:
        hog = asyncio.create_task(http.post(live.url("/v1/chat/completions"), json={
            "model": MODEL, "max_tokens": 50, "seed": 1,
            "messages": [{"role": "user", "content": "hog"}]}))
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the hog to take the only lane")
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": True}
        async with http.post(live.url("/v1/responses"), json=body) as r:
            raw = await r.text()
        (await hog).release()
        assert raw.startswith("event: response.created\n")
        assert raw.index(": keepalive") < raw.index("response.output_item.added")
        events = sse(raw)
        assert [d["sequence_number"] for _, d in events if isinstance(d, dict)] == \
            list(range(len(events)))


# -- session affinity without a header -----------------------------------------------


async def test_conversations_keep_their_node_without_a_session_header():
    async with agent_head(nodes=3, policy="round-robin") as live, \
            aiohttp.ClientSession() as http:

        async def node_of(path: str, body: dict[str, Any],
                          headers: dict[str, str] | None = None) -> str:
            async with http.post(live.url(path), json={"model": MODEL, **body},
                                 headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
                return r.headers["X-Shoal-Node"]

        system = "You are a coding agent."
        turns = [{"role": "user", "content": "Fix the bug."}]
        seen = []
        for i in range(3):  # an agent's conversation, one turn longer each time
            seen.append(await node_of("/v1/messages", {
                "max_tokens": 3, "system": system, "messages": turns}))
            turns = [*turns, {"role": "assistant", "content": f"Step {i}."},
                     {"role": "user", "content": "Go on."}]
        assert len(set(seen)) == 1, seen
        # another conversation is placed by the policy (round-robin: the next node)
        other = await node_of("/v1/messages", {
            "max_tokens": 3, "system": system,
            "messages": [{"role": "user", "content": "Write the tests."}]})
        assert other != seen[0]
        # so is a first turn that opens as another conversation did: many conversations
        # open with the same words, and only their later turns have a node to go back to
        again = await node_of("/v1/messages", {
            "max_tokens": 3, "system": system,
            "messages": [{"role": "user", "content": "Write the tests."}]})
        assert again != other
        # the Responses API and Chat Completions keep theirs the same way
        for path, first, later in (
                ("/v1/responses", {"input": "Plan it.", "max_output_tokens": 3},
                 {"input": [{"role": "user", "content": "Plan it."},
                            {"role": "assistant", "content": "Done."},
                            {"role": "user", "content": "More."}], "max_output_tokens": 3}),
                ("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Review it."}], "max_tokens": 3},
                 {"messages": [{"role": "user", "content": "Review it."},
                               {"role": "assistant", "content": "Ok."},
                               {"role": "user", "content": "Again."}], "max_tokens": 3})):
            a = await node_of(path, first)
            b = await node_of(path, later)
            assert a == b, path
        # a header still wins: two conversations under one X-Session-Id share a node
        pinned = await node_of("/v1/messages", {"max_tokens": 3, "messages": [
            {"role": "user", "content": "one"}]}, {"X-Session-Id": "agent-7"})
        again = await node_of("/v1/messages", {"max_tokens": 3, "messages": [
            {"role": "user", "content": "two"}]}, {"X-Session-Id": "agent-7"})
        assert pinned == again
        # and prompt_cache_key is the Responses API's own name for it
        keyed = [await node_of("/v1/responses", {"input": text, "max_output_tokens": 3,
                                                 "prompt_cache_key": "repo-1"})
                 for text in ("alpha", "beta", "gamma")]
        assert len(set(keyed)) == 1, keyed


async def test_the_same_conversation_under_two_keys_is_two_sessions():
    alice, bob = keys.issue_key(SECRET, "alice"), keys.issue_key(SECRET, "bob")
    async with agent_head(nodes=3, policy="round-robin", keys_secret=SECRET) as live, \
            aiohttp.ClientSession() as http:
        opening = [{"role": "user", "content": "The same first turn."}]
        later = [*opening, {"role": "assistant", "content": "Ok."},
                 {"role": "user", "content": "Go on."}]

        async def node_of(key: str, messages: list[dict[str, Any]]) -> str:
            async with http.post(live.url("/v1/messages"), headers={"x-api-key": key},
                                 json={"model": MODEL, "max_tokens": 3,
                                       "messages": messages}) as r:
                assert r.status == 200
                return r.headers["X-Shoal-Node"]

        # round-robin puts the two first turns on two nodes; each later turn goes back
        # to its own key's node (one key for both would send both to bob's, the last)
        a1, b1 = await node_of(alice, opening), await node_of(bob, opening)
        a2, b2 = await node_of(alice, later), await node_of(bob, later)
        assert a1 != b1 and a2 == a1 and b2 == b1
