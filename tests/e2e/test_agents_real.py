"""One real-model run per API: Claude Code over Anthropic Messages, Codex over the
Responses API and opencode over Chat Completions, the pinned binaries configured from the
app's snippets, against a head with a real node. A model this small answers poorly; what
is held is that each round trip completes: the agent exits 0 with an answer printed and
no API error.

Claude Code and Codex take an answer cut at its token limit for an error (Claude Code:
"response exceeded the N output token maximum"; Codex: "Incomplete response returned,
reason: max_output_tokens"), so the model must end its answer itself. Gemma 3 270M (its
32,768-token window holds Claude Code's ~20,000-token prompt) is a base model that never
does; SmolLM2-135M-Instruct does, in a window of 16,384 tokens (twice what it was trained
on), enough for Codex's prompt. So: Claude Code and opencode on Gemma, their answers kept
short by their own output caps (opencode takes a cut answer); Codex on SmolLM2."""

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


async def run_real(name: str, served: tuple[Proc, Path, int], binaries: dict[str, Path],
                   tmp: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    head, gguf, window = served
    setup = await asyncio.to_thread(
        setup_agent, name, f"http://127.0.0.1:{head.port}/v1", binaries[name], tmp / name,
        [Offer(gguf.name.removesuffix(".gguf"), window, tools=True, fim=False)])
    setup.env.update(env or {})
    ran = await run_agent(setup, args, timeout=RUN_TIMEOUT_S)
    why = f"{name}: {ran.tail()}\nhead log:\n{head.log_text()[-3000:]}"
    assert ran.rc == 0, why
    assert ran.stdout.strip(), why
    assert ERRORS[name] not in ran.stdout + ran.stderr, why
    return ran.stdout


async def test_claude_code_over_messages(served: tuple[Proc, Path, int], tmp_path: Path,
                                         agent_binaries: dict[str, Path]):
    await run_real("claude", served, agent_binaries, tmp_path,
                   ["-p", "Say hello.", "--allowedTools", "Bash"],
                   {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ANSWER_TOKENS)})


@pytest.mark.parametrize("served", [SMOLLM2], indirect=True, ids=["smollm2"])
async def test_codex_over_responses(served: tuple[Proc, Path, int], tmp_path: Path,
                                    agent_binaries: dict[str, Path]):
    await run_real("codex", served, agent_binaries, tmp_path,
                   ["exec", "--skip-git-repo-check", "Say hello."])


async def test_opencode_over_chat_completions(served: tuple[Proc, Path, int], tmp_path: Path,
                                              agent_binaries: dict[str, Path]):
    await run_real("opencode", served, agent_binaries, tmp_path, ["run", "Say hello."],
                   {"OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX": str(ANSWER_TOKENS)})
