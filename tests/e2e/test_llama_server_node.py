"""A node fronting a real llama-server (SmolLM2, --parallel 4 --metrics) behind a head,
all in process but llama-server: answers streamed and not, a conversation returning to
the slot that holds its prefix, no more sessions than slots at once, a SIGKILL of
llama-server mid-stream failing over to a llama.cpp node, and an engine on another
model refused under the head's model name."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.llama_server_proc import LlamaServer, running_llama_server
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
QUIET = DiscoverySettings(mode="none")
NAME = "SmolLM2-135M-Instruct.Q4_1"  # the head's name for the GGUF, and llama-server's
ASK = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@contextlib.asynccontextmanager
async def server(binary: Path, model: Path, tmp: Path) -> AsyncIterator[LlamaServer]:
    async with running_llama_server(binary, model, parallel=4, log=tmp / "llama-server.log",
                                    extra=("--metrics",)) as srv:
        yield srv


async def start_node(tmp: Path, url: str, *, name: str | None = None) -> Shoal:
    return await Shoal.start(Settings(home=tmp / "node", discovery=QUIET, node=NodeSettings(
        runtime="llama-server", upstream=url, lanes=0, listen="127.0.0.1:0",
        identity="gpu-box", model_name=name)))


async def start_head(tmp: Path, model: Path, nodes: list[Shoal]) -> Shoal:
    fleet = tuple(n.snapshot().roles.node.address for n in nodes)  # type: ignore[union-attr]
    return await Shoal.start(Settings(home=tmp / "head", discovery=QUIET, head=HeadSettings(
        model=str(model), http="127.0.0.1:0", fleet=fleet, queue_timeout_s=120.0)))


async def chat(head: Shoal, messages: list[dict[str, str]], *, stream: bool = False,
               max_tokens: int = 24, session: str | None = None) -> tuple[str, dict]:
    """The answer's text and its usage (streamed: gathered from the chunks)."""
    assert head.api_url is not None
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "seed": 7, "stream": stream, "stream_options": {"include_usage": True}}
    headers = {"X-Session-Id": session} if session else {}
    async with aiohttp.ClientSession() as http, \
            http.post(head.api_url + "/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        if not stream:
            got = await r.json()
            return got["choices"][0]["message"]["content"], got["usage"]
        text, usage = "", {}
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
        return text, usage


async def cached_total(url: str) -> float:
    """llama-server's count of prompt tokens it took from a slot's cache."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("llamacpp:prompt_tokens_cached_total "):
                return float(line.split()[1])
    raise AssertionError("llama-server's /metrics has no prompt_tokens_cached_total")


async def stop_all(*shoals: Shoal) -> None:
    for s in shoals:
        await s.stop(drain=1)


async def test_answers_streamed_and_not_and_a_session_keeps_its_slot(
        tmp_path: Path, llama_server_binary: Path, smollm2_gguf: Path) -> None:
    async with server(llama_server_binary, smollm2_gguf, tmp_path) as srv:
        node = await start_node(tmp_path, srv.url)
        head = await start_head(tmp_path, smollm2_gguf, [node])
        try:
            local = node.snapshot().roles.node
            assert local is not None and (local.model, local.runtime, local.lanes,
                                          local.context_window) == (NAME, "llama-server", 4,
                                                                    1024)
            await until(lambda: head.snapshot().ready_nodes == 1, "the node linked")
            plain, _ = await chat(head, ASK)
            streamed, _ = await chat(head, ASK, stream=True)
            assert len(plain.split()) >= 3 and streamed == plain  # greedy: the same text

            # turn two carries turn one: llama-server reuses the slot that holds it
            turn = [*ASK, {"role": "assistant", "content": plain},
                    {"role": "user", "content": "Now give it a title."}]
            _, first = await chat(head, turn[:1], session="conv", max_tokens=8)
            before = await cached_total(srv.url)
            _, second = await chat(head, turn, session="conv", max_tokens=8)
            cached = second["prompt_tokens_details"]["cached_tokens"]
            assert cached >= first["prompt_tokens"] - 1  # the whole first prompt, reused
            assert second["prompt_tokens"] - cached < second["prompt_tokens"] // 2
            # and llama-server's own count says so
            assert await cached_total(srv.url) - before >= first["prompt_tokens"] - 1
        finally:
            await stop_all(head, node)


async def test_no_more_sessions_than_slots(tmp_path: Path, llama_server_binary: Path,
                                           smollm2_gguf: Path) -> None:
    async with server(llama_server_binary, smollm2_gguf, tmp_path) as srv:
        node = await start_node(tmp_path, srv.url)
        head = await start_head(tmp_path, smollm2_gguf, [node])
        try:
            await until(lambda: head.snapshot().ready_nodes == 1, "the node linked")
            answers = await asyncio.gather(*(
                chat(head, [{"role": "user", "content": f"Count to {n + 20}."}],
                     max_tokens=48, session=f"s{n}") for n in range(5)))
            assert all(text for text, _ in answers)  # the fifth waited its turn
            await until(lambda: head.snapshot().nodes[0].peak_busy > 0, "the node's stats")
            assert head.snapshot().nodes[0].peak_busy == 4  # never a fifth at once
        finally:
            await stop_all(head, node)


async def test_killing_llama_server_mid_stream_fails_over_with_the_same_text(
        tmp_path: Path, llama_server_binary: Path, smollm2_gguf: Path) -> None:
    spare = await Shoal.start(Settings(home=tmp_path / "spare", discovery=QUIET,
                                       node=NodeSettings(model=str(smollm2_gguf), lanes=1,
                                                         max_context=1024, identity="spare",
                                                         listen="127.0.0.1:0", paused=True)))
    async with server(llama_server_binary, smollm2_gguf, tmp_path) as srv:
        node = await start_node(tmp_path, srv.url)
        head = await start_head(tmp_path, smollm2_gguf, [node, spare])
        try:
            await until(lambda: sorted(n.state for n in head.snapshot().nodes)
                        == ["paused", "ready"], "both nodes linked, the spare paused")
            assert head.api_url is not None
            body = {"model": NAME, "messages": ASK, "max_tokens": 64, "temperature": 0,
                    "seed": 7, "stream": True}
            text = ""
            async with aiohttp.ClientSession() as http, \
                    http.post(head.api_url + "/chat/completions", json=body) as r:
                assert r.status == 200
                killed = False
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
                    if not killed and len(text) > 20:
                        await spare.pause_serving(False)  # somewhere to go
                        srv.kill()
                        killed = True
                assert killed
            reference, _ = await chat(head, ASK, max_tokens=64)  # now on the spare alone
            assert text == reference
        finally:
            await stop_all(head, node, spare)


async def test_an_engine_on_another_model_is_refused_under_the_heads_name(
        tmp_path: Path, llama_server_binary: Path, smollm2_gguf: Path, gemma_gguf: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with server(llama_server_binary, gemma_gguf, tmp_path) as srv:
        node = await start_node(tmp_path, srv.url, name=NAME)  # claims the head's model
        head = await start_head(tmp_path, smollm2_gguf, [node])
        try:
            await until(lambda: "tokenizes differently" in (head.snapshot().nodes[0].error
                                                            or ""), "the refusal")
            error = head.snapshot().nodes[0].error or ""
            assert f"tokenizes differently from the head's model '{NAME}'" in error
            assert "run the same model on both, or give this node another --model-name" in error
            assert srv.url in error
            refusals = [r for r in caplog.records if "refused this head" in r.getMessage()]
            assert len(refusals) == 1  # once, however many connections were refused
        finally:
            await stop_all(head, node)
