"""One real-model run per API: Claude Code over Anthropic Messages, Codex over the
Responses API and opencode over Chat Completions, the pinned binaries configured from the
app's snippets, against a head with a Gemma 3 270M node (its 32,768-token window holds
Claude Code's ~20,000-token prompt). A model this small answers poorly; what is held is
that each round trip completes: the agent exits 0 with an answer printed and no API
error.

Claude Code and Codex take an answer cut at its token limit for an error (Claude Code:
"response exceeded the N output token maximum"; Codex: "Incomplete response returned"),
so the model must end its answer itself. The answers are kept short: Claude Code and
opencode by their own output caps; Codex asks for no limit, so its node's window is only
a little larger than its ~9,100-token prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.editors import Offer
from tests.integration.conftest import Cluster, Proc
from tests.integration.real_agents import run_agent, setup_agent
from tests.integration.test_fleet import wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.processes,
              pytest.mark.timeout(900)]
ANSWER_TOKENS = 24
WINDOW = 32768
CODEX_WINDOW = 9728  # Codex 0.171.0's first prompt is ~9,100 Gemma tokens
RUN_TIMEOUT_S = 600.0


def gemma_head(tmp: Path, gguf: Path, window: int) -> Iterator[Proc]:
    logs = tmp / "logs"
    logs.mkdir()
    cluster = Cluster(tmp / "shoal", logs)
    try:
        node = cluster.node("g0", model=str(gguf), runtime="llamacpp", lanes=1,
                            extra=("--max-context", str(window)))
        head = cluster.head([node], model=str(gguf), runtime="llamacpp")
        asyncio.run(wait_ready(head, 1))
        yield head
    finally:
        cluster.close()


@pytest.fixture
def head(tmp_path: Path, gemma_gguf: Path, request: pytest.FixtureRequest) -> Iterator[Proc]:
    yield from gemma_head(tmp_path, gemma_gguf, getattr(request, "param", WINDOW))


ERRORS = {"claude": "API Error:", "codex": "ERROR: ", "opencode": "Error: "}  # their own


async def run_real(name: str, head: Proc, gguf: Path, binaries: dict[str, Path], tmp: Path,
                   args: list[str], window: int, env: dict[str, str] | None = None) -> str:
    model = gguf.name.removesuffix(".gguf")
    setup = await asyncio.to_thread(
        setup_agent, name, f"http://127.0.0.1:{head.port}/v1", binaries[name], tmp / name,
        [Offer(model, window, tools=True, fim=False)])
    setup.env.update(env or {})
    ran = await run_agent(setup, args, timeout=RUN_TIMEOUT_S)
    why = f"{name}: {ran.tail()}\nhead log:\n{head.log_text()[-3000:]}"
    assert ran.rc == 0, why
    assert ran.stdout.strip(), why
    assert ERRORS[name] not in ran.stdout + ran.stderr, why
    return ran.stdout


async def test_claude_code_over_messages(head: Proc, gemma_gguf: Path, tmp_path: Path,
                                         agent_binaries: dict[str, Path]):
    await run_real("claude", head, gemma_gguf, agent_binaries, tmp_path,
                   ["-p", "Say hello.", "--allowedTools", "Bash"], WINDOW,
                   {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ANSWER_TOKENS)})


@pytest.mark.parametrize("head", [CODEX_WINDOW], indirect=True)
async def test_codex_over_responses(head: Proc, gemma_gguf: Path, tmp_path: Path,
                                    agent_binaries: dict[str, Path]):
    await run_real("codex", head, gemma_gguf, agent_binaries, tmp_path,
                   ["exec", "--skip-git-repo-check", "Say hello."], CODEX_WINDOW)


async def test_opencode_over_chat_completions(head: Proc, gemma_gguf: Path, tmp_path: Path,
                                              agent_binaries: dict[str, Path]):
    await run_real("opencode", head, gemma_gguf, agent_binaries, tmp_path,
                   ["run", "Say hello."], WINDOW,
                   {"OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX": str(ANSWER_TOKENS)})
