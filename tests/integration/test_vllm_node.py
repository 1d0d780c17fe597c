"""A node fronting a vLLM server (`--runtime vllm --upstream URL`), behind a head.

vLLM cannot run on these machines, so the upstream is tests/fake_vllm.py: vLLM's request
and response shapes (version and sources in its docstring) around Shoal's mock model, so a
head on the mock model gets from it exactly the text a mock node writes for the same
seed. Head, nodes and fake run in this test's loop (in-process `Shoal` objects, real
sockets on 127.0.0.1), under the loop-lag probe and the leak check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from engine.link import messages as m
from engine.link.transport import Link, dial
from engine.runtimes.mock import EOS, IM_END, MockTokenizer, next_token
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.fake_vllm import KV_METRIC, LEGACY_KV_METRIC, FakeVLLM, running_fake_vllm
from tests.integration.test_service import running
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

QUIET = DiscoverySettings(mode="none")
TOKEN = bytes(range(32))
MODEL = "mock-m"
QUESTION = "Tell me a long story about a lighthouse."
PACE = 100.0  # tokens/s per request at the fake: streams last long enough to cut
HUNG_BOUND_S = 15.0  # the adapter's stall bound (3 s) plus failover, with room on 2 cores


def chatml(content: str) -> list[int]:
    """The head's prompt for one user message on the mock model (its ChatML template)."""
    return MockTokenizer().encode(
        f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")


def long_seed(prompt: list[int], length: int) -> int:
    """A seed for which the mock model writes at least ``length`` tokens after ``prompt``."""
    for seed in range(1, 500):
        context = list(prompt)
        for _ in range(length):
            tok = next_token(seed, context)
            if tok in (EOS, IM_END):
                break
            context.append(tok)
        else:
            return seed
    raise AssertionError("no seed gives a long answer")


PROMPT = chatml(QUESTION)
SEED = long_seed(PROMPT, 400)


# ---- Shoal objects in this loop


def token_file(home: Path) -> Path:
    path = home / "token"
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(TOKEN.hex())
    path.chmod(0o600)
    return path


def vllm_node(home: Path, upstream: str, *, lanes: int = 2, identity: str = "gpu",
              model_name: str | None = None) -> Settings:
    return Settings(home=home, discovery=QUIET, auth_file=token_file(home),
                    node=NodeSettings(runtime="vllm", upstream=upstream,  # type: ignore[call-arg]
                                      lanes=lanes, identity=identity, listen="127.0.0.1:0",
                                      model_name=model_name))


def mock_node(home: Path, *, lanes: int = 2, identity: str = "desk",
              paused: bool = False) -> Settings:
    return Settings(home=home, discovery=QUIET, auth_file=token_file(home),
                    node=NodeSettings(model=MODEL, runtime="mock", lanes=lanes,
                                      identity=identity, listen="127.0.0.1:0",
                                      mock_speed=200.0, paused=paused))


def head(home: Path, nodes: list[Shoal]) -> Settings:
    addresses = tuple(n.snapshot().roles.node.address for n in nodes)  # type: ignore[union-attr]
    return Settings(home=home, discovery=QUIET, auth_file=token_file(home),
                    head=HeadSettings(model=MODEL, runtime="mock", http="127.0.0.1:0",
                                      fleet=addresses))


async def ready(shoal: Shoal, count: int) -> None:
    """``count`` nodes linked: ready, or paused (linked, taking no session)."""
    await until(lambda: sum(1 for n in shoal.snapshot().nodes if n.state in ("ready", "paused"))
                >= count, f"{count} node(s) ready")


def node_view(shoal: Shoal, identity: str):  # type: ignore[no-untyped-def]
    return next((n for n in shoal.snapshot().nodes if n.identity == identity), None)


@dataclass
class Desk:
    """A head dialing a vLLM node (over the fake) and, when asked, a mock node."""

    fake: FakeVLLM
    head: Shoal
    gpu: Shoal
    desk: Shoal | None

    @property
    def api(self) -> str:
        assert self.head.api_url is not None
        return self.head.api_url.removesuffix("/v1")


@contextlib.asynccontextmanager
async def desk(tmp_path: Path, *, lanes: int = 2, with_mock: bool = False,
               **fake_options: object) -> AsyncIterator[Desk]:
    """The mock node starts paused (it refuses sessions), so the head places on the vLLM
    node; a test unpauses it when it wants somewhere to fail over to."""
    options = {"model": MODEL, "max_num_seqs": 4, "pace": PACE, **fake_options}
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(running_fake_vllm(**options))
        gpu = await stack.enter_async_context(
            running(vllm_node(tmp_path / "gpu", fake.url, lanes=lanes)))
        nodes = [gpu]
        other = None
        if with_mock:
            other = await stack.enter_async_context(
                running(mock_node(tmp_path / "desk", paused=True)))
            nodes.append(other)
        h = await stack.enter_async_context(running(head(tmp_path / "head", nodes)))
        await ready(h, len(nodes))
        yield Desk(fake, h, gpu, other)


# ---- HTTP clients of the head


def chat_body(max_tokens: int = 60, **kw: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "seed": SEED, "temperature": 0.7, **kw}


async def chat_whole(api: str, **kw: object) -> dict:
    async with aiohttp.ClientSession() as http, \
            http.post(f"{api}/v1/chat/completions", json=chat_body(**kw)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def chat_stream(api: str, *, progress: asyncio.Queue[int] | None = None,
                      **kw: object) -> tuple[str, str | None]:
    """The streamed text and finish reason; ``progress`` gets the count of text chunks."""
    text: list[str] = []
    finish = None
    body = {**chat_body(**kw), "stream": True}
    async with aiohttp.ClientSession() as http, \
            http.post(f"{api}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for choice in obj["choices"]:
                if choice["delta"].get("content"):
                    text.append(choice["delta"]["content"])
                    if progress is not None:
                        progress.put_nowait(len(text))
                finish = choice["finish_reason"] or finish
    return "".join(text), finish


def expected_text(max_tokens: int) -> str:
    """What the mock model writes for QUESTION with SEED: the text every node must give."""
    context = list(PROMPT)
    for _ in range(max_tokens):
        context.append(next_token(SEED, context))
    return bytes(context[len(PROMPT):]).decode()


async def wait_chunks(progress: asyncio.Queue[int], count: int) -> None:
    async with asyncio.timeout(20):
        while await progress.get() < count:
            pass


# ---- the fake itself follows vLLM's shapes (no Shoal involved)


async def test_the_fake_speaks_vllms_completions_with_the_mock_model():
    async with running_fake_vllm(model=MODEL, max_num_seqs=2) as fake, \
            aiohttp.ClientSession() as http:
        async with http.get(f"{fake.url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == MODEL
        async with http.post(f"{fake.url}/tokenize", json={"prompt": "hi<|im_end|>"}) as r:
            tok = await r.json()
        assert tok["tokens"] == [104, 105, IM_END] and tok["count"] == 3
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "seed": SEED,
                "temperature": 0.7, "return_token_ids": True, "stop_token_ids": [EOS, IM_END]}
        async with http.post(f"{fake.url}/v1/completions", json=body) as r:
            whole = await r.json()
        [choice] = whole["choices"]
        assert choice["text"] == expected_text(30) and choice["finish_reason"] == "length"
        assert bytes(choice["token_ids"]).decode() == choice["text"]
        assert whole["usage"]["completion_tokens"] == 30
        chunks = []
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with http.post(f"{fake.url}/v1/completions", json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: "):
                    chunks.append(line[6:].strip())
        assert chunks[-1] == b"[DONE]"
        events = [json.loads(c) for c in chunks[:-1]]
        assert events[0]["choices"][0]["prompt_token_ids"] == PROMPT
        assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:-1])
        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        assert bytes(ids).decode() == expected_text(30)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 30
        # a stop id is the last token of the output, with no text, as vLLM's check_stop does
        stop = ids[5]
        async with http.post(f"{fake.url}/v1/completions",
                             json={**body, "stream": False, "stop_token_ids": [stop]}) as r:
            [choice] = (await r.json())["choices"]
        assert choice["token_ids"][-1] == stop and choice["stop_reason"] == stop
        assert choice["finish_reason"] == "stop" and stop not in choice["text"].encode()


async def test_the_fake_queues_beyond_max_num_seqs_and_counts_aborts():
    async with running_fake_vllm(model=MODEL, max_num_seqs=2, pace=50.0) as fake, \
            aiohttp.ClientSession() as http:
        body = {"prompt": PROMPT, "max_tokens": 300, "seed": SEED, "temperature": 0.7,
                "stream": True, "return_token_ids": True}

        async def first_chunk() -> aiohttp.ClientResponse:
            r = await http.post(f"{fake.url}/v1/completions", json=body)
            await r.content.readline()
            return r

        streams = [await first_chunk() for _ in range(2)]
        third = asyncio.create_task(first_chunk())
        await until(lambda: fake.waiting == 1, "the third request to wait")
        async with http.get(f"{fake.url}/metrics") as r:
            metrics = await r.text()
        assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0' in metrics
        assert f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0' in metrics
        assert KV_METRIC in metrics and LEGACY_KV_METRIC not in metrics
        assert fake.running == 2 and fake.in_flight == 3
        streams[0].close()  # the client goes away: vLLM aborts it, the waiting one runs
        await until(lambda: fake.aborted == 1, "the abort to be counted")
        streams.append(await asyncio.wait_for(third, 10))
        assert fake.running == 2 and fake.waiting == 0
        for s in streams[1:]:
            s.close()
        await until(lambda: fake.in_flight == 0, "every request to end")
        assert fake.aborted == 3


# ---- a vLLM node behind a head


async def test_answers_through_a_vllm_node_equal_a_mock_nodes(tmp_path: Path):
    async with desk(tmp_path) as d:
        streamed, finish = await chat_stream(d.api, max_tokens=80)
        whole = await chat_whole(d.api, max_tokens=80)
        sent = d.fake.bodies[-1]
    assert streamed == expected_text(80) and finish == "length"
    assert whole["choices"][0]["message"]["content"] == expected_text(80)
    assert whole["usage"]["completion_tokens"] == 80
    # token ids in, token ids out: the head's prompt went to vLLM as ids
    assert sent["prompt"] == PROMPT and sent["return_token_ids"] is True
    assert sent["seed"] == SEED and sent["max_tokens"] == 80
    assert {EOS, IM_END} <= set(sent.get("stop_token_ids") or ())
    # and a plain mock node writes the same for the same seed
    async with running(Settings(home=tmp_path / "ref", discovery=QUIET,
                                head=HeadSettings(model=MODEL, runtime="mock",
                                                  http="127.0.0.1:0"),
                                node=NodeSettings(model=MODEL, runtime="mock"))) as ref:
        await ready(ref, 1)
        api = ref.api_url.removesuffix("/v1")  # type: ignore[union-attr]
        assert (await chat_stream(api, max_tokens=80))[0] == streamed


async def raw_link(address: str) -> tuple[Link, m.NodeHello]:
    host, port = address.rsplit(":", 1)
    link = await dial(host, int(port), psk=TOKEN)
    hello = await asyncio.wait_for(link.recv(), 5)
    assert isinstance(hello, m.NodeHello)
    link.send(m.HeadHello(head_id="raw", model=hello.model))
    return link, hello


async def next_record(link: Link) -> m.Record:
    while True:
        rec = await asyncio.wait_for(link.recv(), 10)
        if not isinstance(rec, m.Stats):
            return rec


async def test_the_node_admits_at_most_its_lanes_and_refuses_more_at_once(tmp_path: Path):
    async with running_fake_vllm(model=MODEL, max_num_seqs=8, pace=PACE) as fake, \
            running(vllm_node(tmp_path / "gpu", fake.url, lanes=2)) as gpu:
        address = gpu.snapshot().roles.node.address  # type: ignore[union-attr]
        links: list[Link] = []
        try:
            answers = []
            for i in range(3):  # one generation per link, as a head runs them
                link, hello = await raw_link(address)
                links.append(link)
                assert hello.lanes == 2 and hello.model == MODEL and hello.runtime == "vllm"
                link.send(m.Generate(session=f"s{i}", lease_ms=10_000, prompt=PROMPT,
                                     max_tokens=300, sampling=m.SamplingParams(seed=SEED)))
                answers.append(await next_record(link))
            # the third is refused at once, never queued at vLLM (which would take 8)
            assert [type(a) for a in answers] == [m.Accepted, m.Accepted, m.Error], answers
            assert answers[2].code == "busy"  # type: ignore[union-attr]
            await until(lambda: fake.running == 2, "two requests at vLLM")
            assert fake.in_flight == 2
        finally:
            for link in links:
                link.close()
        await until(lambda: fake.in_flight == 0, "the links' sessions to be aborted upstream")


async def test_a_client_cancel_aborts_the_upstream_request(tmp_path: Path):
    async with desk(tmp_path) as d:
        progress: asyncio.Queue[int] = asyncio.Queue()
        task = asyncio.create_task(chat_stream(d.api, progress=progress, max_tokens=300))
        await wait_chunks(progress, 5)
        assert d.fake.in_flight == 1 and d.fake.aborted == 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await until(lambda: d.fake.aborted == 1, "vLLM to see the request aborted",
                    timeout=1.0)
        await until(lambda: d.fake.in_flight == 0, "nothing left running at vLLM")


@pytest.mark.parametrize("fault", ["dies", "hangs"])
async def test_an_upstream_that_fails_mid_stream_fails_over_with_identical_text(
        tmp_path: Path, fault: str):
    """Killed (connections cut) or frozen (connections open, nothing sent): either way
    the session moves to the mock node within the hung bound, nothing twice, none lost."""
    async with desk(tmp_path, with_mock=True) as d:
        assert d.desk is not None
        progress: asyncio.Queue[int] = asyncio.Queue()
        task = asyncio.create_task(chat_stream(d.api, progress=progress, max_tokens=300))
        await wait_chunks(progress, 20)
        await d.desk.pause_serving(False)
        if fault == "dies":
            await d.fake.die()
        else:
            d.fake.hang()
        text, finish = await asyncio.wait_for(task, HUNG_BOUND_S)
        assert text == expected_text(300) and finish == "length"
        assert node_view(d.head, "desk").sessions_total == 1  # type: ignore[union-attr]
        if fault == "hangs":
            await d.fake.revive()  # its hung handlers end before it closes


async def test_an_upstream_that_comes_back_is_used_again(tmp_path: Path):
    async with desk(tmp_path, with_mock=True) as d:
        assert d.desk is not None
        await d.fake.die()
        # down: the node refuses at once, the head places on the mock node instead
        await d.desk.pause_serving(False)
        assert (await chat_stream(d.api, max_tokens=40))[0] == expected_text(40)
        assert d.fake.completed == 0
        await d.fake.revive()
        await d.desk.pause_serving(True)

        async def served_by_vllm() -> bool:
            text, _ = await chat_stream(d.api, max_tokens=40)
            assert text == expected_text(40)
            return d.fake.completed > 0

        await until(served_by_vllm, "a session placed on the vLLM node again", timeout=20)


@pytest.mark.parametrize("metric", [KV_METRIC, LEGACY_KV_METRIC])
async def test_lanes_and_kv_reach_the_heads_snapshot(tmp_path: Path, metric: str):
    async with desk(tmp_path, lanes=3, kv_metric=metric) as d:
        d.fake.kv_override = 0.5
        view = await until(lambda: (n := node_view(d.head, "gpu")) is not None
                           and abs(n.kv_percent - 50.0) < 1.0 and n, "KV 50% at the head")
        assert view.lanes == 3 and view.runtime == "vllm" and view.model == MODEL
        d.fake.kv_override = 0.25
        await until(lambda: abs(node_view(d.head, "gpu").kv_percent - 25.0) < 1.0,  # type: ignore[union-attr]
                    "KV 25% at the head")
        progress: asyncio.Queue[int] = asyncio.Queue()
        task = asyncio.create_task(chat_stream(d.api, progress=progress, max_tokens=300))
        await wait_chunks(progress, 3)
        await until(lambda: node_view(d.head, "gpu").lanes_busy == 1,  # type: ignore[union-attr]
                    "one busy lane at the head")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await until(lambda: d.fake.in_flight == 0, "the stream to end at vLLM")


async def test_a_tokenizer_mismatch_is_refused_in_one_line(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    tok = MockTokenizer()

    def other_tokenizer(text: str, special: bool) -> list[int]:
        return [t ^ 1 for t in tok.encode(text, special=special)]  # same vocab, other ids

    async with running_fake_vllm(model=MODEL, tokenize=other_tokenizer) as fake, \
            running(vllm_node(tmp_path / "gpu", fake.url)) as gpu, \
            running(head(tmp_path / "head", [gpu])) as h:
        view = await until(lambda: (n := node_view(h, "gpu")) is not None and n.error and n,
                           "the head to record why the node was refused")
        assert view.state != "ready"
        assert "tokeniz" in view.error.lower() and "\n" not in view.error
        assert not fake.bodies  # nothing was generated there
    lines = [r.getMessage() for r in caplog.records if "tokeniz" in r.getMessage().lower()]
    assert lines and all("\n" not in line for line in lines)



@pytest.mark.slow  # seconds of waiting: out of the quick selection
async def test_a_vllm_without_token_ids_fails_the_request_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """vLLM before 0.10.2 ignores return_token_ids: the node cannot relay ids it never gets,
    fails the generation and says why (the client gets the head's 5xx)."""
    caplog.set_level(logging.INFO)
    async with desk(tmp_path, return_token_ids=False) as d, aiohttp.ClientSession() as http:
        async with http.post(f"{d.api}/v1/chat/completions", json=chat_body()) as r:
            body = await r.json()
        assert r.status >= 500 and "error" in body, body
    why = [rec.getMessage() for rec in caplog.records if "0.10.2" in rec.getMessage()]
    assert why and all("\n" not in line for line in why), caplog.text
