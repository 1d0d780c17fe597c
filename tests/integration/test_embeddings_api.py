"""Embeddings through the head: OpenAI's /v1/embeddings and Ollama's /api/embed and
/api/embeddings, driven by the real OpenAI and Ollama clients, on mock embedding nodes over
real links on 127.0.0.1 (the real model's vectors: tests/e2e/test_embeddings_e2e.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import secrets
from array import array
from collections.abc import AsyncIterator, Sequence

import aiohttp
import numpy  # noqa: F401  (the OpenAI client decodes base64 with it: not in the loop)
import ollama
import openai
import pytest

from engine.head.fleet.links import Fleet
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.prompt.model import load_head_model
from engine.link import messages as m
from engine.link.transport import Link, dial
from engine.node.agent import NodeAgent
from engine.runtimes.base import Embeddings, Engine
from engine.runtimes.embedding import pack, unpack
from engine.runtimes.mock import MockEngine
from engine.runtimes.mock_embed import DIMS, MockEmbedder, vector
from tests.integration.test_api_surface import Live, serving
from tests.integration.test_fleet import fleet_state, url, wait_ready
from tests.integration.test_node_and_sessions import recv_skipping_stats
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
TOKEN = bytes(range(32))
CHAT = "mock-chat"
EMBED = "mini-embed"


class Failing(MockEmbedder):
    """An embedding node whose runtime fails every request."""

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        raise RuntimeError("the decode thread died")


@contextlib.asynccontextmanager
async def live(*engines: Engine) -> AsyncIterator[Live]:
    """A head knowing the chat and the embedding model, and one node per engine."""
    fleet = Fleet(model=CHAT, head_id="h-" + secrets.token_hex(4), psk=TOKEN, also=(EMBED,))
    agents = []
    for i, engine in enumerate(engines):
        agent = NodeAgent(engine, identity=f"n{i}", psk=TOKEN)
        _h, port = await agent.listen("127.0.0.1", 0)
        agents.append(agent)
        fleet.add_dialed("127.0.0.1", port)
    head = Head([load_head_model("mock", CHAT, name=CHAT),
                 load_head_model("mock", EMBED, name=EMBED)], fleet, SessionRunner(fleet))
    try:
        async with serving(head) as port:
            await until(lambda: all(p.state == "ready" for p in fleet.pools.values()),
                        "every node ready")
            yield Live(head, port, agents)
    finally:
        await head.close()
        for agent in agents:
            await agent.close()


async def raw_link(port: int) -> tuple[Link, m.NodeHello]:
    """A link to a node as a head opens it, and the node's hello."""
    link = await dial("127.0.0.1", port, psk=TOKEN)
    hello = await asyncio.wait_for(link.recv(), 10)
    assert isinstance(hello, m.NodeHello)
    link.send(m.HeadHello(head_id="h", model=CHAT))
    return link, hello


def expected(text: str) -> list[float]:
    """The mock model's vector of ``text``, computed here from its bytes."""
    return vector(list(text.encode()))


def close_to(got: Sequence[float], want: Sequence[float]) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, abs_tol=1e-6)
                                         for a, b in zip(got, want, strict=True))


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_openai_client_gets_each_inputs_vector_in_order_as_base64_and_floats():
    texts = ["the cat sat", "a dog ran", "über straße 東京"]
    async with live(MockEngine(model=CHAT), MockEmbedder(model=EMBED)) as h:
        async with openai.AsyncOpenAI(base_url=h.url("/v1"), api_key="x") as client:
            got = await client.embeddings.create(model=EMBED, input=texts)  # base64 by default
        assert [d.index for d in got.data] == [0, 1, 2]
        for d, text in zip(got.data, texts, strict=True):
            assert close_to(d.embedding, expected(text)), text
        assert got.usage.prompt_tokens == sum(len(t.encode()) for t in texts)
        assert got.usage.total_tokens == got.usage.prompt_tokens
        # the raw wire: base64 of float32 little-endian, and plain floats
        status, raw = await post(h.url("/v1/embeddings"),
                                 {"model": EMBED, "input": texts[0],
                                  "encoding_format": "base64"})
        assert status == 200, raw
        floats = array("f", base64.b64decode(raw["data"][0]["embedding"]))
        assert close_to(list(floats), expected(texts[0]))
        status, raw = await post(h.url("/v1/embeddings"),
                                 {"model": EMBED, "input": texts[0], "encoding_format": "float"})
        assert status == 200 and raw["object"] == "list" and raw["model"] == EMBED, raw
        assert close_to(raw["data"][0]["embedding"], expected(texts[0]))


async def test_token_id_inputs_and_fewer_dimensions():
    async with live(MockEmbedder(model=EMBED)) as h:
        status, raw = await post(h.url("/v1/embeddings"),
                                 {"model": EMBED, "input": [[104, 105], [33]],
                                  "encoding_format": "float", "dimensions": 8})
        assert status == 200, raw
        first = raw["data"][0]["embedding"]
        assert len(first) == 8
        assert math.isclose(math.fsum(x * x for x in first), 1.0, rel_tol=1e-5)
        cut = vector([104, 105])[:8]
        norm = math.sqrt(math.fsum(x * x for x in cut))
        assert close_to(first, [x / norm for x in cut])
        status, raw = await post(h.url("/v1/embeddings"),
                                 {"model": EMBED, "input": "hi", "dimensions": DIMS + 1})
        assert status == 400 and "at most that many" in raw["error"]["message"], raw


async def test_a_large_batch_spreads_over_the_nodes_lanes_and_keeps_its_order():
    texts = [f"input number {i}" for i in range(150)]  # three records of at most 64
    a, b = MockEmbedder(model=EMBED, lanes=1), MockEmbedder(model=EMBED, lanes=1)
    async with live(a, b) as h:
        status, raw = await post(h.url("/v1/embeddings"),
                                 {"model": EMBED, "input": texts, "encoding_format": "float"})
        assert status == 200, raw
        assert len(raw["data"]) == 150
        for i in (0, 63, 64, 149):
            assert close_to(raw["data"][i]["embedding"], expected(texts[i])), i
        assert a.inputs + b.inputs == 150
        assert a.inputs > 0 and b.inputs > 0  # one lane each: the records took both


async def test_a_failing_node_is_passed_over_for_one_that_answers():
    async with live(Failing(model=EMBED), MockEmbedder(model=EMBED)) as h:
        for _ in range(3):  # whichever placement tries first, the answer comes
            status, raw = await post(h.url("/v1/embeddings"),
                                     {"model": EMBED, "input": "x", "encoding_format": "float"})
            assert status == 200, raw
            assert close_to(raw["data"][0]["embedding"], expected("x"))


async def test_ollama_client_embed_and_the_older_embeddings():
    async with live(MockEmbedder(model=EMBED)) as h:
        client = ollama.AsyncClient(host=h.url(""))
        try:
            got = await client.embed(model=EMBED, input=["one", "two"])
            assert len(got.embeddings) == 2
            assert close_to(got.embeddings[1], expected("two"))
            assert got.prompt_eval_count == 6
            old = await client.embeddings(model=EMBED, prompt="one")
            assert close_to(old.embedding, expected("one"))
            # Ollama's clients may add :latest
            got = await client.embed(model=EMBED + ":latest", input="one")
            assert close_to(got.embeddings[0], expected("one"))
        finally:
            await client.close()


async def test_too_long_inputs_are_refused_by_openai_and_cut_by_ollama():
    long = "y" * 600  # 600 tokens of the mock vocabulary, over its window of 512
    async with live(MockEmbedder(model=EMBED)) as h:
        status, raw = await post(h.url("/v1/embeddings"), {"model": EMBED, "input": long})
        assert status == 400, raw
        assert raw["error"]["code"] == "context_length_exceeded"
        assert "600 tokens" in raw["error"]["message"]
        status, raw = await post(h.url("/api/embed"), {"model": EMBED, "input": long})
        assert status == 200, raw
        assert close_to(raw["embeddings"][0], expected("y" * 512))
        status, raw = await post(h.url("/api/embed"),
                                 {"model": EMBED, "input": long, "truncate": False})
        assert status == 400 and "600 tokens" in raw["error"], raw


async def test_each_route_refuses_the_other_kind_of_model_in_one_line():
    async with live(MockEngine(model=CHAT), MockEmbedder(model=EMBED)) as h:
        status, raw = await post(h.url("/v1/embeddings"), {"model": CHAT, "input": "x"})
        assert status == 400, raw
        assert raw["error"]["code"] == "model_not_embedding"
        assert f"embedding models: {EMBED}" in raw["error"]["message"]
        status, raw = await post(h.url("/v1/chat/completions"),
                                 {"model": EMBED, "messages": [{"role": "user",
                                                                "content": "hi"}]})
        assert status == 400 and "/v1/embeddings" in raw["error"]["message"], raw
        status, raw = await post(h.url("/v1/embeddings"), {"model": "nope", "input": "x"})
        assert status == 404, raw
        for bad in ([], "", [1.5], [[]], {"a": 1}, ["ok", 3]):
            status, raw = await post(h.url("/v1/embeddings"), {"model": EMBED, "input": bad})
            assert status == 400, (bad, raw)
        status, raw = await post(h.url("/v1/embeddings"),
                                 {"model": EMBED, "input": "x", "encoding_format": "int8"})
        assert status == 400 and "encoding_format" in raw["error"]["message"], raw
        # Ollama's keep_alive is a duration or a number: anything else is the request's fault
        for path, body in (("/api/embed", {"model": EMBED, "input": "x", "keep_alive": [1]}),
                           ("/api/embeddings", {"model": EMBED, "prompt": "x",
                                                "keep_alive": {"a": 1}}),
                           ("/api/embed", {"model": EMBED, "input": "x",
                                           "keep_alive": "five minutes"})):
            status, raw = await post(h.url(path), body)
            assert status == 400, (path, body, raw)


async def test_the_models_list_says_which_model_embeds():
    async with live(MockEngine(model=CHAT), MockEmbedder(model=EMBED)) as h:
        async with aiohttp.ClientSession() as http:
            async with http.get(h.url("/api/tags")) as r:
                tags = await r.json()
            async with http.post(h.url("/api/show"), json={"model": EMBED}) as r:
                shown = await r.json()
            async with http.get(h.url("/v1/models")) as r:
                listed = {m["id"]: m for m in (await r.json())["data"]}
        assert {t["name"].split(":")[0] for t in tags["models"]} >= {CHAT, EMBED}, tags
        assert shown["capabilities"] == ["embedding"], shown
        assert listed[EMBED]["capabilities"]["embeddings"] is True
        assert listed[EMBED]["capabilities"]["chat"] is False
        assert listed[CHAT]["capabilities"]["embeddings"] is False


async def test_shoal_processes_serve_chat_and_embeddings_from_two_nodes(cluster):
    """`shoal node` on an embedding model says so in its hello, and a head that knows the
    model (--also-model) sends embeddings there and chats to the other node."""
    cluster.token()
    chat_node = cluster.node("chat", model=CHAT)
    embed_node = cluster.node("embed", model=EMBED)
    head = cluster.head([chat_node, embed_node], model=CHAT,
                        extra=("--also-model", EMBED))
    await wait_ready(head, 2)
    status, raw = await post(url(head, "/v1/embeddings"),
                             {"model": EMBED, "input": ["hello"], "encoding_format": "float"})
    assert status == 200, raw
    assert close_to(raw["data"][0]["embedding"], expected("hello"))
    status, raw = await post(url(head, "/v1/chat/completions"),
                             {"model": CHAT, "max_tokens": 3,
                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, raw
    fleet = await fleet_state(head)
    by_name = {n["identity"]: n for n in fleet["nodes"]}
    assert by_name["embed"]["model"] == EMBED and by_name["embed"]["sessions_total"] == 1
    assert by_name["chat"]["sessions_total"] == 1


async def test_a_node_answers_embed_records_as_its_model_allows():
    """On the link itself: an embedding node says so in its hello and answers each Embed
    with its vectors in input order; a chat node refuses one in one line; a full node says
    busy; a second record on a connection that holds one is refused."""
    chat = NodeAgent(MockEngine(model=CHAT), identity="c", psk=TOKEN)
    embedder = NodeAgent(MockEmbedder(model=EMBED, lanes=1), identity="e", psk=TOKEN)
    _h, chat_port = await chat.listen("127.0.0.1", 0)
    _h, embed_port = await embedder.listen("127.0.0.1", 0)
    try:
        link, hello = await raw_link(embed_port)
        assert hello.embeds is True
        link.send(m.Embed(session="s1", inputs=[[104, 105], [33]]))
        got = await recv_skipping_stats(link)
        assert isinstance(got, m.Embedded) and got.session == "s1", got
        assert (got.count, got.dims, got.prompt_tokens) == (2, DIMS, 3)
        assert unpack(got.vectors, DIMS) == [
            unpack(pack([vector([104, 105])]), DIMS)[0], unpack(pack([vector([33])]), DIMS)[0]]
        link.send(m.Embed(session="s2", inputs=[[999]]))  # outside the mock's vocabulary
        refused = await recv_skipping_stats(link)
        assert isinstance(refused, m.Error) and refused.code == "bad_request", refused
        link.close()

        other, hello = await raw_link(chat_port)
        assert hello.embeds is False
        other.send(m.Embed(session="s3", inputs=[[1]]))
        refused = await recv_skipping_stats(other)
        assert isinstance(refused, m.Error) and refused.code == "bad_request"
        assert "makes no embeddings" in refused.message
        other.close()
    finally:
        await chat.close()
        await embedder.close()
