"""The head's HTTP surface: completions, Ollama's routes, metrics, OpenAPI, keepalives,
model names and headers. Mock nodes: real `shoal` processes (Cluster) for the routes,
an in-process head where a test needs settings the CLI does not have."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from engine.api.app import build_app
from engine.api.schemas import ChatRequest, Message
from engine.api.turns import chat_request_turn
from engine.events import SessionFinished
from engine.head.fleet.links import Fleet
from engine.head.fleet.placement import Policy
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.prompt.model import HeadModel, load_head_model
from engine.head.prompt.templates import load_chat_template
from engine.head.prompt.turn import Routing
from engine.node.agent import NodeAgent
from engine.runtimes.mock import CHATML_TEMPLATE, MockEngine, MockTokenizer
from tests.integration.conftest import Cluster, Proc, sse_text
from tests.integration.test_fleet import wait_ready
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
TOKEN = bytes(range(32))
MODEL = "mock-m"


# -- an in-process head ----------------------------------------------------------------


@dataclass
class Live:
    head: Head
    port: int
    agents: list[NodeAgent] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def mock_model(name: str = MODEL, template: str | None = None) -> HeadModel:
    if template is None:
        return load_head_model("mock", name, name=name)
    vocab = MockTokenizer()
    tpl = load_chat_template(vocab.metadata(), chat_template=template, bos_text="",
                             eos_text=vocab.eos_text)
    return HeadModel(name=name, runtime="mock", vocab=vocab, template=tpl,
                     stop_ids=frozenset(vocab.eos_ids))


@contextlib.asynccontextmanager
async def serving(head: Head) -> AsyncIterator[int]:
    """The head's app on 127.0.0.1 until the block ends; yields its port."""
    runner = web.AppRunner(build_app(head), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def live_head(*, nodes: int = 1, lanes: int = 4, speed: float = 0.0,
                    queue_timeout_s: float = 20.0, model: HeadModel | None = None,
                    policy: Policy = "load-aware",
                    make_engine: Callable[[str], MockEngine] | None = None,
                    **attrs: Any) -> AsyncIterator[Live]:
    """A head, its app on 127.0.0.1 and ``nodes`` mock nodes, all in this event loop;
    ``make_engine(model_name)`` makes each node's engine (default: a MockEngine with
    ``lanes`` and ``speed``); ``attrs`` are set on the Head (api_key, keepalive_s, ...)."""
    hm = model or mock_model()
    fleet = Fleet(model=hm.name, head_id="h-" + secrets.token_hex(4), psk=TOKEN)
    agents = []
    for i in range(nodes):
        engine = (make_engine(hm.name) if make_engine
                  else MockEngine(model=hm.name, lanes=lanes, speed=speed))
        agent = NodeAgent(engine, identity=f"n{i}", psk=TOKEN)
        _h, port = await agent.listen("127.0.0.1", 0)
        agents.append(agent)
        fleet.add_dialed("127.0.0.1", port)
    head = Head([hm], fleet, SessionRunner(fleet, policy=policy,
                                           queue_timeout_s=queue_timeout_s))
    for key, value in attrs.items():
        setattr(head, key, value)
    try:
        async with serving(head) as port:
            await until(lambda: sum(1 for p in fleet.pools.values() if p.state == "ready")
                        >= nodes, f"{nodes} node(s) ready")
            yield Live(head, port, agents)
    finally:
        await head.close()
        for agent in agents:
            await agent.close()
            await agent.engine.close()


def chat_body(content: str = "hello", **kw: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def read_lines(resp: aiohttp.ClientResponse) -> list[str]:
    return [line.decode() async for line in resp.content]


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, bytes]:
    async with http.post(url, json=body) as r:
        return r.status, await r.read()


# -- routes against a real head process ---------------------------------------------------


def url(head: Proc, path: str) -> str:
    return f"http://127.0.0.1:{head.port}{path}"


async def test_completions_and_openai_routes(cluster: Cluster):
    cluster.token()
    head = cluster.head([cluster.node("n0")])
    await wait_ready(head, 1)
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "seed": 5,
                "temperature": 0.5}
        async with http.post(url(head, "/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Shoal-Model"] == MODEL and "X-Shoal-Alias" not in r.headers
            one = await r.json()
        assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
        choice = one["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["text"]) == 12
        assert one["usage"]["completion_tokens"] == 12
        assert one["usage"]["prompt_tokens"] == len(b"def add(a, b):")
        # a list of one prompt, streamed, gives the same text
        body = {**body, "prompt": [body["prompt"]], "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.post(url(head, "/v1/completions"), json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = "".join(await read_lines(r))
        events = [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
        assert raw.rstrip().endswith("data: [DONE]")
        assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
        assert events[-1]["usage"]["completion_tokens"] == 12
        assert [c["finish_reason"] for c in events[-2]["choices"]] == ["length"]
        # stop strings
        cut = choice["text"][4:6]
        async with http.post(url(head, "/v1/completions"),
                             json={**body, "stream": False, "stop": cut}) as r:
            stopped = (await r.json())["choices"][0]
        assert stopped["text"] == choice["text"].split(cut)[0]
        assert stopped["finish_reason"] == "stop"
        # fill-in-the-middle on a model without FIM tokens: a clear 400
        async with http.post(url(head, "/v1/completions"),
                             json={"model": MODEL, "prompt": "a", "suffix": "b"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert err["message"].startswith(f"model {MODEL} has no fill-in-the-middle tokens;")
        # an empty suffix is a plain completion there
        async with http.post(url(head, "/v1/completions"),
                             json={"model": MODEL, "prompt": "a", "suffix": "",
                                   "max_tokens": 2}) as r:
            assert r.status == 200
        for bad, words in (({"model": MODEL, "prompt": ["a", "b"]}, "exactly one string"),
                           ({"model": MODEL, "prompt": "a", "echo": True}, "echo"),
                           ({"model": MODEL, "prompt": 5}, "prompt"),
                           ({"model": MODEL, "prompt": ""}, "empty")):
            async with http.post(url(head, "/v1/completions"), json=bad) as r:
                assert r.status == 400, bad
                assert words in (await r.json())["error"]["message"]
        # loose names: case and a hyphen for the colon-free name both resolve
        async with http.post(url(head, "/v1/completions"),
                             json={"model": "MOCK-M", "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 200 and r.headers["X-Shoal-Model"] == MODEL
            assert (await r.json())["model"] == "MOCK-M"  # echoed as asked
        async with http.post(url(head, "/v1/completions"),
                             json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with http.get(url(head, "/v1/models")) as r:
            models = await r.json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        async with http.get(url(head, "/v1/models/Mock-M")) as r:
            assert r.status == 200 and (await r.json())["id"] == MODEL
        async with http.get(url(head, "/v1/models/unknown")) as r:
            assert r.status == 404
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body(max_tokens=3)) as r:
            assert r.status == 200 and r.headers["X-Shoal-Model"] == MODEL


def sse_events(raw: str) -> list[str]:
    return [line[6:] for line in raw.split("\n") if line.startswith("data: ")]


async def test_ollama_routes(cluster: Cluster):
    cluster.token()
    head = cluster.head([cluster.node("n0")])
    await wait_ready(head, 1)
    async with aiohttp.ClientSession() as http:
        # /api/chat streams NDJSON by default
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "options": {"num_predict": 10, "seed": 3, "temperature": 0.5}}
        async with http.post(url(head, "/api/chat"), json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("application/x-ndjson")
            assert r.headers["X-Shoal-Model"] == MODEL
            lines = [json.loads(line) for line in await read_lines(r)]
        assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"]
        text = "".join(x["message"]["content"] for x in lines)
        assert len(text) == 10
        last = lines[-1]
        assert last["done_reason"] == "length" and last["eval_count"] == 10
        assert last["prompt_eval_count"] > 0 and last["message"]["role"] == "assistant"
        for key in ("total_duration", "load_duration", "prompt_eval_duration",
                    "eval_duration"):
            assert isinstance(last[key], int) and last[key] >= 0
        assert last["total_duration"] >= last["eval_duration"]
        assert last["created_at"].endswith("Z") and last["model"] == MODEL
        # not streamed: one object with the same text
        async with http.post(url(head, "/api/chat"), json={**body, "stream": False}) as r:
            assert r.headers["Content-Type"].startswith("application/json")
            one = await r.json()
        assert one["done"] and one["message"]["content"] == text and one["eval_count"] == 10
        # the same conversation through /v1/chat/completions gives the same text
        async with http.post(url(head, "/v1/chat/completions"),
                             json=chat_body("hi", max_tokens=10, seed=3,
                                            temperature=0.5)) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == text
        # /api/generate applies the chat template unless raw
        gen = {"model": MODEL, "prompt": "hi", "options": {"num_predict": 10, "seed": 3,
                                                           "temperature": 0.5}}
        async with http.post(url(head, "/api/generate"), json=gen) as r:
            lines = [json.loads(line) for line in await read_lines(r)]
        assert "".join(x["response"] for x in lines) == text
        assert lines[-1]["done"] and lines[-1]["done_reason"] == "length"
        async with http.post(url(head, "/api/generate"),
                             json={**gen, "raw": True, "stream": False}) as r:
            raw = await r.json()
        assert raw["done"] and raw["prompt_eval_count"] == 2  # "hi", no template
        # stop in the options
        cut = text[3:5]
        async with http.post(url(head, "/api/generate"),
                             json={**gen, "stream": False,
                                   "options": {**gen["options"], "stop": [cut]}}) as r:
            stopped = await r.json()
        assert stopped["response"] == text.split(cut)[0] and stopped["done_reason"] == "stop"
        # nothing to generate: Ollama's "load" answer
        async with http.post(url(head, "/api/generate"), json={"model": MODEL}) as r:
            assert (await r.json())["done_reason"] == "load"
        async with http.post(url(head, "/api/chat"),
                             json={"model": MODEL, "messages": []}) as r:
            assert (await r.json())["done_reason"] == "load"
        # ":latest" is accepted for a name without a tag
        async with http.post(url(head, "/api/generate"),
                             json={**gen, "model": f"{MODEL}:latest", "stream": False}) as r:
            assert r.status == 200 and r.headers["X-Shoal-Model"] == MODEL
        # errors in Ollama's shape
        async with http.post(url(head, "/api/chat"), json={"model": "nope", "messages": [
                {"role": "user", "content": "x"}]}) as r:
            assert r.status == 404 and isinstance((await r.json())["error"], str)
        for bad in ({"model": MODEL, "prompt": "x", "images": ["aGk="]},
                    {"model": MODEL, "prompt": "x", "format": "json"},
                    {"model": MODEL, "prompt": "x", "options": {"num_predict": "many"}},
                    {"model": MODEL, "prompt": "x", "suffix": "y"}):
            async with http.post(url(head, "/api/generate"), json=bad) as r:
                assert r.status == 400, bad
                assert isinstance((await r.json())["error"], str)
        async with http.get(url(head, "/api/tags")) as r:
            tags = await r.json()
        (entry,) = tags["models"]
        assert entry["name"] == entry["model"] == MODEL and entry["details"]["family"]
        async with http.post(url(head, "/api/show"), json={"model": MODEL}) as r:
            shown = await r.json()
            assert r.headers["X-Shoal-Model"] == MODEL
        assert "completion" in shown["capabilities"] and "insert" not in shown["capabilities"]
        assert "model_info" in shown and shown["template"]
        async with http.post(url(head, "/api/show"), json={"name": "nope"}) as r:
            assert r.status == 404
        async with http.get(url(head, "/api/version")) as r:
            assert (await r.json())["version"].count(".") == 2


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text page: through prometheus_client's parser when it is
    installed (which also checks the format), else line by line."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        out = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)', line)
            assert m, line
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
        return out
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def check_openapi(spec: dict) -> None:
    try:
        from openapi_spec_validator import validate
    except ImportError:
        assert spec["openapi"].startswith("3.1") and spec["paths"]
        return
    validate(spec)


async def test_metrics_and_openapi(cluster: Cluster):
    cluster.token()
    head = cluster.head([cluster.node("n0", lanes=3)])
    await wait_ready(head, 1)
    async with aiohttp.ClientSession() as http:
        produced = 0
        for _ in range(2):
            async with http.post(url(head, "/v1/chat/completions"),
                                 json=chat_body(max_tokens=5)) as r:
                assert r.status == 200
                # the mock may end an answer early: count what it really produced
                produced += (await r.json())["usage"]["completion_tokens"]
        async with http.post(url(head, "/v1/completions"),
                             json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404
        # the node's stats after the last release (they carry the KV gauges)
        await until(node_idle(head), "the node's stats after the last request")
        async with http.get(url(head, "/metrics")) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
        async with http.get(url(head, "/openapi.json")) as r:
            spec = await r.json()
    samples = parse_metrics(text)

    def values(name: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, v) for n, labels, v in samples if n == name]

    reqs = {(lb["route"], lb["status"]): v for lb, v in values("shoal_requests_total")}
    assert reqs[("/v1/chat/completions", "200")] == 2
    assert reqs[("/v1/completions", "404")] == 1
    assert {lb["model"]: v for lb, v in values("shoal_completion_tokens_total")} == {
        MODEL: produced}
    assert values("shoal_time_to_first_token_seconds_count") == [({}, 2)]
    buckets = values("shoal_time_to_first_token_seconds_bucket")
    assert buckets[-1] == ({"le": "+Inf"}, 2)
    assert {lb["node"]: v for lb, v in values("shoal_node_lanes")} == {"n0": 3}
    assert values("shoal_queue_length") == [({}, 0)]
    ((_, kv_total),) = values("shoal_node_kv_total")
    assert kv_total > 0
    assert values("shoal_node_kv_used") and values("shoal_lanes_busy") == [({}, 0)]
    assert values("shoal_node_up") == [({"node": "n0", "address": values(
        "shoal_node_up")[0][0]["address"], "model": MODEL}, 1)]

    check_openapi(spec)
    ops = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    app = build_app(Head([mock_model()], Fleet(model=MODEL, head_id="x", psk=None),
                         SessionRunner(Fleet(model=MODEL, head_id="y", psk=None))))
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        info = route.resource.get_info() if route.resource else {}
        path = (info.get("path") or info.get("formatter", "")).replace("{model:.+}", "{model}")
        assert (route.method, path) in ops, (route.method, path)
    schema = spec["components"]["schemas"]["CompletionRequest"]
    assert {"model", "prompt", "suffix", "max_tokens"} <= set(schema["properties"])


# -- in-process heads ----------------------------------------------------------------------


@pytest.mark.slow  # seconds of waiting: out of the quick selection
async def test_keepalives_while_waiting_in_the_queue():
    # one lane, slow tokens: the second request waits for the first
    async with live_head(lanes=1, speed=40.0, keepalive_s=0.2) as live, \
            aiohttp.ClientSession() as http:
        async def hog() -> None:
            async with http.post(live.url("/v1/chat/completions"),
                                 json=chat_body(max_tokens=60, seed=1)) as r:
                await r.read()

        first = asyncio.create_task(hog())
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first request to take the only lane")
        body = chat_body(max_tokens=4, seed=2, stream=True)
        async with http.post(live.url("/v1/chat/completions"), json=body) as r:
            assert r.status == 200
            lines = await read_lines(r)
        raw = "".join(lines)
        head_part = raw.split("data: ")[0]
        assert head_part.count(": keepalive\n\n") >= 3, raw[:300]
        text, finish, _ = sse_text(raw)
        assert len(text) == 4 and finish == "length"
        await first

        # a non-streaming answer: leading whitespace, then the JSON
        first = asyncio.create_task(hog())
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first request to take the only lane")
        async with http.post(live.url("/v1/chat/completions"),
                             json=chat_body(max_tokens=4, seed=2)) as r:
            assert r.status == 200
            raw_bytes = await r.read()
        assert raw_bytes.startswith(b"   ")
        assert json.loads(raw_bytes)["choices"][0]["message"]["content"] == text
        await first

        # Ollama's NDJSON stream: spaces before the first line (each line still parses)
        first = asyncio.create_task(hog())
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first request to take the only lane")
        async with http.post(live.url("/api/chat"), json={
                "model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "options": {"num_predict": 4, "seed": 2}}) as r:
            lines = await read_lines(r)
        assert lines[0].startswith("   ")
        assert "".join(json.loads(x)["message"]["content"] for x in lines) == text
        await first
        async with http.get(live.url("/metrics")) as r:
            metrics = await r.text()
        assert "shoal_keepalives_total 0\n" not in metrics


@pytest.mark.slow  # seconds of waiting: out of the quick selection
async def test_refusal_status_before_commit_and_in_band_after():
    # the refusal comes before the commit time: the status tells it
    async with live_head(lanes=1, speed=40.0, queue_timeout_s=0.4, keepalive_s=0.2,
                         commit_s=3.0) as live, aiohttp.ClientSession() as http:
        hog = asyncio.create_task(post(http, live.url("/v1/chat/completions"),
                                       chat_body(max_tokens=80, seed=1)))
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first request to take the only lane")
        async with http.post(live.url("/v1/chat/completions"),
                             json=chat_body(max_tokens=4, stream=True)) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "fleet_busy"
        await hog
    # after the commit: 200, keepalives, then the failure inside the answer
    async with live_head(lanes=1, speed=40.0, queue_timeout_s=0.8, keepalive_s=0.2) as live, \
            aiohttp.ClientSession() as http:
        hog = asyncio.create_task(post(http, live.url("/v1/chat/completions"),
                                       chat_body(max_tokens=200, seed=1)))
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first request to take the only lane")
        async with http.post(live.url("/v1/chat/completions"),
                             json=chat_body(max_tokens=4, stream=True)) as r:
            assert r.status == 200
            raw = "".join(await read_lines(r))
        assert ": keepalive" in raw
        (event,) = sse_events(raw)
        assert json.loads(event)["error"]["code"] == "fleet_busy"
        async with http.post(live.url("/v1/chat/completions"),
                             json=chat_body(max_tokens=4)) as r:
            assert r.status == 200
            data = await r.read()
        assert data.startswith(b" ") and json.loads(data)["error"]["code"] == "fleet_busy"
        async with http.post(live.url("/api/generate"),
                             json={"model": MODEL, "prompt": "x"}) as r:
            lines = await read_lines(r)
        assert "fleet" in json.loads(lines[-1])["error"]
        await hog


async def test_client_that_leaves_while_queued_frees_its_place():
    async with live_head(lanes=1, speed=40.0, keepalive_s=0.2) as live, \
            aiohttp.ClientSession() as http:
        hog = asyncio.create_task(post(http, live.url("/v1/chat/completions"),
                                       chat_body(max_tokens=400, seed=1)))
        await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                    "the first request to take the only lane")
        async with http.post(live.url("/v1/chat/completions"),
                             json=chat_body(max_tokens=4, stream=True)) as r:
            assert await r.content.readline() == b": keepalive\n"
            assert live.head.runner.queued == 1
        # leaving the block closed the connection; the head notices within a poll
        await until(lambda: live.head.runner.queued == 0, "the queue to let it go")
        assert not hog.done()
        hog.cancel()


THINKING_TEMPLATE = CHATML_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined "
    "and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


async def test_thinking_is_off_unless_the_request_asks():
    model = mock_model(template=THINKING_TEMPLATE)
    runner = SessionRunner(Fleet(model=MODEL, head_id="h", psk=None))

    async def prompt(**kw: Any) -> str:
        req = ChatRequest(model=MODEL, messages=[Message(role="user", content="2+2?")], **kw)
        turn = await chat_request_turn(model, runner, req, Routing())
        return bytes(t for t in turn.prompt if t < 256).decode()

    assert (await prompt()).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in await prompt(reasoning_effort="high")
    assert (await prompt(reasoning_effort="none")).endswith("</think>\n\n")
    assert "<think>" not in await prompt(chat_template_kwargs={"enable_thinking": True})
    # the head's own arguments cannot be overridden
    assert (await prompt(chat_template_kwargs={"tools": 5, "add_generation_prompt": False})) \
        .endswith("</think>\n\n")


async def test_ollama_think_and_template_over_http():
    async with live_head(model=mock_model(template=THINKING_TEMPLATE)) as live, \
            aiohttp.ClientSession() as http:
        base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "stream": False, "options": {"num_predict": 1}}
        counts = {}
        for think in (None, True, False):
            body = base if think is None else {**base, "think": think}
            async with http.post(live.url("/api/chat"), json=body) as r:
                counts[think] = (await r.json())["prompt_eval_count"]
        assert counts[None] == counts[False] == counts[True] + len("<think>\n\n</think>\n\n")
        async with http.post(live.url("/api/show"), json={"model": MODEL}) as r:
            assert "thinking" in (await r.json())["capabilities"]


class FimTokenizer(MockTokenizer):
    """The mock vocabulary with fill-in-the-middle markers (bytes 250-252 stand in)."""

    def fim_ids(self) -> tuple[int, int, int] | None:
        return (250, 251, 252)


def test_fill_in_the_middle_prompt_layout():
    from engine.head.prompt.turn import completion_prompt_ids

    model = mock_model()
    fim = HeadModel(name=MODEL, runtime="mock", vocab=FimTokenizer(), template=model.template,
                    stop_ids=model.stop_ids)
    assert completion_prompt_ids(fim, "ab", "cd") == [250, 97, 98, 251, 99, 100, 252]
    assert completion_prompt_ids(fim, "ab", "") == [250, 97, 98, 251, 252]
    assert completion_prompt_ids(fim, "ab", None) == [97, 98]
    assert completion_prompt_ids(model, "ab", "") == [97, 98]  # no FIM tokens: plain


async def test_fim_over_http_and_aliases_in_headers():
    plain = mock_model()
    fim = HeadModel(name=MODEL, runtime="mock", vocab=FimTokenizer(), template=plain.template,
                    stop_ids=plain.stop_ids)
    async with live_head(model=fim) as live, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "def f(", "suffix": "\n", "max_tokens": 3}
        async with http.post(live.url("/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        assert usage["prompt_tokens"] == len("def f(") + len("\n") + 3
        async with http.post(live.url("/api/generate"), json={
                "model": MODEL, "prompt": "def f(", "suffix": "\n", "stream": False,
                "options": {"num_predict": 3}}) as r:
            assert (await r.json())["prompt_eval_count"] == usage["prompt_tokens"]
        async with http.post(live.url("/api/show"), json={"model": MODEL}) as r:
            assert "insert" in (await r.json())["capabilities"]
        # an alias: both names in the headers of every route that takes a model
        live.head.aliases.set("coder", MODEL, [], time.time(), "test")
        routes = [("/v1/completions", {"model": "coder", "prompt": "x", "max_tokens": 1}),
                  ("/v1/chat/completions", {**chat_body(max_tokens=1), "model": "coder"}),
                  ("/api/chat", {"model": "coder", "stream": False, "messages": [
                      {"role": "user", "content": "x"}], "options": {"num_predict": 1}}),
                  ("/api/generate", {"model": "coder", "prompt": "x",
                                     "options": {"num_predict": 1}}),
                  ("/api/show", {"model": "coder"})]
        finished: list[SessionFinished] = []
        live.head.fleet.emit = lambda e: finished.append(e) if isinstance(
            e, SessionFinished) else None
        for path, body in routes:
            async with http.post(live.url(path), json=body) as r:
                assert r.status == 200, (path, await r.text())
                assert r.headers["X-Shoal-Alias"] == "coder", path
                assert r.headers["X-Shoal-Model"] == MODEL, path
                await r.read()
        # each generating route names the alias the client asked for in SessionFinished
        assert [(e.requested, e.model, e.error) for e in finished] == [("coder", MODEL, None)] * 4
        async with http.get(live.url("/v1/models/coder")) as r:
            assert r.headers["X-Shoal-Alias"] == "coder"
            assert (await r.json())["alias_for"] == MODEL
        async with http.get(live.url("/v1/models")) as r:
            ids = {m["id"]: m for m in (await r.json())["data"]}
        assert ids["coder"]["resolves_to"] == MODEL and MODEL in ids
        async with http.get(live.url("/api/tags")) as r:
            assert {m["name"] for m in (await r.json())["models"]} == {MODEL, "coder"}


async def keepalives_sent(http: aiohttp.ClientSession, live: Live) -> float:
    async with http.get(live.url("/metrics")) as r:
        text = await r.text()
    return next(v for n, _lb, v in parse_metrics(text) if n == "shoal_keepalives_total")


def node_idle(head: Proc):  # type: ignore[no-untyped-def]
    """A check for `until`: every node of ``head`` reports no busy lane."""
    async def check() -> bool:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{head.port}/v1/fleet") as r:
            nodes = (await r.json())["nodes"]
        return bool(nodes) and all(n["lanes_busy"] == 0 and n["kv_total"] for n in nodes)
    return check


async def test_real_clients_read_answers_behind_keepalives():
    async with live_head(lanes=1, speed=40.0, keepalive_s=0.2) as live, \
            aiohttp.ClientSession() as http, \
            await asyncio.to_thread(  # it loads the CA bundle: off the loop
                openai.AsyncOpenAI, base_url=live.url("/v1"), api_key="unused",
                max_retries=0) as client:
        msgs = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            hog = asyncio.create_task(post(http, live.url("/v1/chat/completions"),
                                           chat_body(max_tokens=50, seed=1)))
            await until(lambda: live.agents[0].stats_record().lanes_busy == 1,
                        "the hog to take the only lane")
            before = await keepalives_sent(http, live)
            got = await client.chat.completions.create(model=MODEL, messages=msgs,
                                                       max_tokens=4, seed=2, stream=stream)
            if stream:
                text = "".join([c.choices[0].delta.content or "" async for c in got
                                if c.choices])
            else:
                text = got.choices[0].message.content
            # it waited behind the hog, and the client read the answer behind keepalives
            assert len(text) == 4
            assert await keepalives_sent(http, live) > before
            await hog
