"""An in-process head whose mock nodes can follow a script: the answer as a function of
the prompt the node receives, so that tool calls and their results can be driven
through the real client SDKs without a real model; and those SDKs' clients, run in
worker threads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai

from engine.head.fleet.placement import Policy
from engine.head.prompt.model import HeadModel
from engine.runtimes.base import EngineStats, GenerationRequest, GenerationResult
from engine.runtimes.mock import EOS, MockEngine, MockGeneration, MockTokenizer
from tests.integration.test_api_surface import MODEL, Live, live_head, mock_model

TOKEN = bytes(range(32))
TOOLS_TEMPLATE = (Path(__file__).parents[1] / "e2e" / "data" / "tools_chatml.jinja").read_text()
Script = Callable[[str], str | None]  # prompt text -> the answer, or None: the mock's own


def prompt_text(ids: list[int] | Any) -> str:
    tok = MockTokenizer()
    return "".join(tok.special_text(i) for i in ids)


class ScriptedGeneration(MockGeneration):
    """Yields ``reply``'s bytes (one token each), then ends as the model would: at its
    end (stop) or at max_tokens (length)."""

    def __init__(self, engine: MockEngine, request: GenerationRequest, reply: str) -> None:
        super().__init__(engine, request)
        self._reply = MockTokenizer().encode(reply, special=False)

    async def _run(self) -> AsyncIterator[list[int]]:  # type: ignore[override]
        eng, req = self._engine, self._req
        eng.lane_enter(len(req.prompt))
        start = time.monotonic()
        out = self._reply[:req.max_tokens]
        held = len(req.prompt)
        try:
            for i in range(0, len(out), 4):
                if self._cancelled:
                    break
                await asyncio.sleep(0)
                eng.kv_add(len(out[i:i + 4]))
                held += len(out[i:i + 4])
                yield out[i:i + 4]
        finally:
            eng.lane_leave(held, 0.0, len(out), time.monotonic() - start)
            reason = "length" if len(out) < len(self._reply) or \
                len(out) == req.max_tokens else "stop"
            self._result = GenerationResult(
                finish_reason="cancelled" if self._cancelled else reason,
                prompt_tokens=len(req.prompt), completion_tokens=len(out))


class ScriptedEngine(MockEngine):
    """A mock engine that answers by ``script`` (when it returns text) and records every
    prompt it was given."""

    def __init__(self, script: Script | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.script = script
        self.prompts: list[str] = []
        self.sizes: list[int] = []  # the prompts' lengths in tokens

    def stats(self) -> EngineStats:
        # steady rates, the same on every node: placement then weighs load alone, never
        # the noise of timing a mock that answers in microseconds
        return dataclasses.replace(super().stats(), prefill_tps=1000.0, decode_tps=100.0,
                                   ttft_ms=1.0)

    def generate(self, request: GenerationRequest) -> MockGeneration:
        gen = super().generate(request)  # the lane and prompt checks
        text = prompt_text(request.prompt)
        self.prompts.append(text)
        self.sizes.append(len(request.prompt))
        reply = self.script(text) if self.script is not None else None
        return gen if reply is None else ScriptedGeneration(self, request, reply)


assert EOS not in MockTokenizer().encode("<tool_call>", special=False)


def agent_head(script: Script | None = None, *, nodes: int = 1, lanes: int = 4,
               speed: float = 0.0, model: HeadModel | None = None,
               policy: Policy = "load-aware",
               **attrs: Any) -> contextlib.AbstractAsyncContextManager[Live]:
    """A head, its app on 127.0.0.1 and ``nodes`` scripted mock nodes, in this loop."""
    return live_head(nodes=nodes, model=model or mock_model(template=TOOLS_TEMPLATE),
                     policy=policy,
                     make_engine=lambda name: ScriptedEngine(script, model=name, lanes=lanes,
                                                             speed=speed),
                     **attrs)


def engines(live: Live) -> list[ScriptedEngine]:
    return [a.engine for a in live.agents]  # type: ignore[misc]


def all_prompts(live: Live) -> list[str]:
    return [p for e in engines(live) for p in e.prompts]


# The SDKs' clients run in worker threads, as a client program would run apart from the
# head: their first-use costs (the CA bundle, pydantic building validators for their
# event types) are theirs, and never stall the loop the head runs in.
call = asyncio.to_thread


@contextlib.asynccontextmanager
async def anthropic_client(url: str, key: str = "unused") -> AsyncIterator[anthropic.Anthropic]:
    client = await call(anthropic.Anthropic, base_url=url, api_key=key, max_retries=0)
    await call(lambda: client.messages)  # its resources are imported on first use
    try:
        yield client
    finally:
        await call(client.close)


@contextlib.asynccontextmanager
async def openai_client(url: str, key: str = "unused") -> AsyncIterator[openai.OpenAI]:
    client = await call(openai.OpenAI, base_url=url + "/v1", api_key=key, max_retries=0)
    await call(lambda: (client.responses, client.chat.completions, client.models))
    try:
        yield client
    finally:
        await call(client.close)


@contextlib.asynccontextmanager
async def ollama_client(url: str) -> AsyncIterator[ollama.Client]:
    client = await call(ollama.Client, host=url)
    try:
        yield client
    finally:
        await call(client.close)


__all__ = ["MODEL", "TOOLS_TEMPLATE", "ScriptedEngine", "agent_head", "all_prompts",
           "anthropic_client", "call", "engines", "ollama_client", "openai_client",
           "prompt_text"]

