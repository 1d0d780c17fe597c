"""One real-model run per API: Claude Code over Anthropic Messages, Codex over the
Responses API and opencode over Chat Completions, the pinned binaries configured from the
app's snippets, against a head with a real node. A model this small answers poorly; what
is held is that each round trip completes: the agent exits 0 with an answer printed and
no API error.

Claude Code and Codex take an answer cut at its token limit for an error (Claude Code:
"response exceeded the N output token maximum"; Codex: "Incomplete response returned,
reason: max_output_tokens"), so a model that never ends its answer never lets them exit 0.
Gemma 3 270M is such a base model: Claude Code runs on it with a small output cap, and what
is held is that every request was answered whole, the only complaint being Claude Code's own
about that cap. Claude Code runs here with one tool (Bash) and a one-line system prompt, a
prompt of about two thousand tokens: its default prompt of about 22,000 tokens takes minutes
of prefill on two cores, and is measured with the prompt cache across sessions on this model
in scripts/bench/agents.py (the full session, tool round trip included, runs on a scripted
model in tests/integration/test_real_agents.py). SmolLM2-135M-Instruct ends its answers, in
a window of 16,384 tokens (twice what it was trained on) that holds Codex's prompt: Codex
runs on it, through a pass-through of this test's own that pins temperature 0 where Codex
leaves it out (Codex sets no output cap, and a sampled answer of a 135M model now and then
runs on for the whole window, at minutes of decode here; greedy, it ends). opencode runs on
SmolLM2 too, with its own output cap (it takes a cut answer): its prompt of about ten
thousand tokens prefills in half the time Gemma takes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from app.editors import Offer
from tests.integration.conftest import Cluster, Proc
from tests.integration.real_agents import run_agent, setup_agent
from tests.integration.test_fleet import wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.processes,
              pytest.mark.timeout(900)]
ANSWER_TOKENS = 24
WINDOW = 32768
RUN_TIMEOUT_S = 600.0


def real_head(tmp: Path, gguf: Path, window: int) -> Iterator[Proc]:
    logs = tmp / "logs"
    logs.mkdir()
    cluster = Cluster(tmp / "shoal", logs)
    try:
        node = cluster.node("n0", model=str(gguf), runtime="llamacpp", lanes=1,
                            extra=("--max-context", str(window)))
        head = cluster.head([node], model=str(gguf), runtime="llamacpp")
        asyncio.run(wait_ready(head, 1))
        yield head
    finally:
        cluster.close()


GEMMA = ("gemma_gguf", WINDOW)
SMOLLM2 = ("smollm2_gguf", 16384)


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Proc, Path, int]]:
    """A head and node serving the model ``request.param`` names (its fixture, its window)."""
    fixture, window = getattr(request, "param", GEMMA)
    gguf: Path = request.getfixturevalue(fixture)
    for head in real_head(tmp_path, gguf, window):
        yield head, gguf, window


ERRORS = {"claude": "API Error:", "codex": "ERROR: ", "opencode": "Error: "}  # their own


@contextlib.asynccontextmanager
async def greedy(upstream: str) -> AsyncIterator[str]:
    """A pass-through to ``upstream`` on 127.0.0.1 that sets temperature 0 in a JSON body
    that leaves it out, streaming the answers back as they come; yields its base URL."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if body and request.content_type == "application/json":
                doc = json.loads(body)
                if isinstance(doc, dict) and doc.get("temperature") is None:
                    doc["temperature"] = 0
                body = json.dumps(doc).encode()
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in ("host", "content-length", "transfer-encoding")}
            async with http.request(request.method, upstream + request.path_qs, data=body,
                                    headers=headers) as up:
                out = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            await runner.cleanup()


async def run_real(name: str, served: tuple[Proc, Path, int], binaries: dict[str, Path],
                   tmp: Path, args: list[str], env: dict[str, str] | None = None,
                   capped: str | None = None, base: str | None = None) -> str:
    """Run the agent; it must exit 0 with an answer and no API error, or, where ``capped``
    is given, may instead stop with that complaint of its own alone. ``base``: where it
    reaches the head (a pass-through), else the head itself."""
    head, gguf, window = served
    base = base or f"http://127.0.0.1:{head.port}"
    setup = await asyncio.to_thread(
        setup_agent, name, f"{base}/v1", binaries[name], tmp / name,
        [Offer(gguf.name.removesuffix(".gguf"), window, tools=True, fim=False)])
    setup.env.update(env or {})
    ran = await run_agent(setup, args, timeout=RUN_TIMEOUT_S)
    why = f"{name}: {ran.tail()}\nhead log:\n{head.log_text()[-3000:]}"
    said = ran.stdout + ran.stderr
    assert "doesn't recognize the model" not in said, why  # Claude Code has the window
    if capped is not None and ran.rc != 0:
        # the agent read every answer to its end and stopped at its own output cap
        lines = [line for line in said.splitlines() if ERRORS[name] in line]
        assert lines and all(capped in line for line in lines), why
        return ran.stdout
    assert ran.rc == 0, why
    assert ran.stdout.strip(), why
    assert ERRORS[name] not in said, why
    return ran.stdout


async def test_claude_code_over_messages(served: tuple[Proc, Path, int], tmp_path: Path,
                                         agent_binaries: dict[str, Path]):
    head = served[0]
    await run_real("claude", served, agent_binaries, tmp_path,
                   ["-p", "Say hello.", "--tools", "Bash", "--allowedTools", "Bash",
                    "--system-prompt", "You are a terse assistant."],
                   {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ANSWER_TOKENS)},
                   capped=f"response exceeded the {ANSWER_TOKENS} output token maximum")
    assert "placed on 'n0'" in head.log_text()  # it reached the real node


@pytest.mark.parametrize("served", [SMOLLM2], indirect=True, ids=["smollm2"])
async def test_codex_over_responses(served: tuple[Proc, Path, int], tmp_path: Path,
                                    agent_binaries: dict[str, Path]):
    head = served[0]
    async with greedy(f"http://127.0.0.1:{head.port}") as base:
        await run_real("codex", served, agent_binaries, tmp_path,
                       ["exec", "--skip-git-repo-check", "Say hello."], base=base)
    assert "placed on 'n0'" in head.log_text()  # it reached the real node


@pytest.mark.parametrize("served", [SMOLLM2], indirect=True, ids=["smollm2"])
async def test_opencode_over_chat_completions(served: tuple[Proc, Path, int], tmp_path: Path,
                                              agent_binaries: dict[str, Path]):
    await run_real("opencode", served, agent_binaries, tmp_path, ["run", "Say hello."],
                   {"OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX": str(ANSWER_TOKENS)})
