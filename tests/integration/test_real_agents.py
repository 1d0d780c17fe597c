"""The coding agents people run, unchanged (the pinned binaries of scripts/lib/agents.py),
configured from the app's own snippets, against a head whose scripted node answers as a
model would: a call of the agent's own shell tool in the model's syntax, then, once the
tool's result is in the prompt, a final answer. The agent's whole loop runs: it sends the
request, runs the tool, sends the result back, prints the answer and exits.

With SHOAL_RECORD_AGENTS=1 each test writes the requests it saw as fixtures
(tests/fixtures/agents/), which tests/unit/test_agent_requests.py decodes."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.lib.agents import npm_prefix
from tests.agent_fixtures import offered_tools, text_of, tool_results
from tests.integration.real_agents import (
    MODEL,
    Bench,
    Recorded,
    Setup,
    git_repo,
    record_fixtures,
    recorded_head,
    run_agent,
    setup_agent,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True)
class Shell:
    """An agent's own shell tool: its name, the argument holding the command, and the
    route the agent speaks."""

    tool: str
    arg: str
    route: str
    extra: tuple[tuple[str, str], ...] = ()  # other arguments the tool requires
    many: bool = False  # the argument is a list of commands

    def call(self, command: str) -> dict[str, object]:
        return {self.arg: [command] if self.many else command, **dict(self.extra)}


SHELLS = {
    "claude": Shell("Bash", "command", "/v1/messages"),
    "codex": Shell("exec_command", "cmd", "/v1/responses"),
    "opencode": Shell("bash", "command", "/v1/chat/completions",
                      extra=(("description", "write the proof file"),)),
    "cn": Shell("Bash", "command", "/v1/chat/completions"),
    "pi": Shell("bash", "command", "/v1/chat/completions"),
    "cline": Shell("run_commands", "commands", "/v1/chat/completions", many=True),
    "kilo": Shell("bash", "command", "/v1/chat/completions",
                  extra=(("description", "write the proof file"),)),
    "qwen": Shell("run_shell_command", "command", "/v1/chat/completions"),
}


def args_for(name: str, prompt: str) -> list[str]:
    """The agent's one-shot command line, as its documentation gives it."""
    if name == "claude":  # as root Claude Code refuses --dangerously-skip-permissions
        return ["-p", prompt, "--allowedTools", "Bash"]
    if name == "codex":
        return ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", prompt]
    if name == "opencode":
        return ["run", prompt]
    if name == "cn":
        return ["-p", prompt, "--allow", "Bash"]
    if name == "pi":  # its snippet says which model to run
        return ["--model", f"shoal/{MODEL}", "-p", prompt]
    if name == "cline":  # a prompt runs headless, its tools approved
        return [prompt]
    if name == "kilo":
        return ["run", prompt]
    if name == "qwen":
        return ["-p", prompt, "--yolo"]
    raise AssertionError(name)


# -- the scripted model ---------------------------------------------------------------


@dataclass
class RoundTrip:
    """A model that calls ``shell`` once with a command that writes the nonce to
    proof.txt and prints a figure the command only computes (so the result cannot be
    mistaken for the call), then answers with the nonce once that result is in its
    prompt."""

    shell: Shell
    nonce: str = ""

    def __post_init__(self) -> None:
        self.nonce = secrets.token_hex(6)

    @property
    def prompt(self) -> str:
        return f"Run the check numbered {self.nonce} with your shell tool."

    @property
    def command(self) -> str:
        return f"echo {self.nonce} > proof.txt; echo result-$((40+2))-{self.nonce}"

    @property
    def result(self) -> str:
        return f"result-42-{self.nonce}"

    @property
    def answer(self) -> str:
        return f"The check passed: {self.nonce}"

    def __call__(self, prompt: str) -> str | None:
        if self.result in prompt:
            return self.answer
        # the tools template lists each tool as "NAME: description" on a line of its own
        if self.nonce in prompt and f"\n{self.shell.tool}: " in prompt:
            return "<tool_call>" + json.dumps({"name": self.shell.tool, "arguments":
                                               self.shell.call(self.command)}) + "</tool_call>"
        return "Shell check"  # a side request (a title, a topic): short and harmless


async def prepared(name: str, bench: Bench, binaries: dict[str, Path], tmp: Path) -> Setup:
    return await asyncio.to_thread(setup_agent, name, bench.base_url, binaries[name], tmp)


def parted_at(a: str, b: str) -> int:
    """How many characters two prompts share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def api_posts(bench: Bench, route: str) -> list[Recorded]:
    return bench.recorder.posts(route)


def offers(req: Recorded) -> dict[str, dict[str, Any]]:
    return offered_tools(req.path, req.body)


def results(req: Recorded) -> list[str]:
    return tool_results(req.path, req.body)


async def record(name: str, what: str, bench: Bench, tmp: Path) -> None:
    """The requests as fixtures (with SHOAL_RECORD_AGENTS=1), this run's folder (also as
    Claude Code's folder slug), port and agents' install folder (pi names its own docs)
    written as fixed ones."""
    fixed = "/tmp/agent-test"
    await asyncio.to_thread(record_fixtures, name, what, bench.recorder.requests, {
        str(tmp): fixed, re.sub(r"[^A-Za-z0-9]", "-", str(tmp)): re.sub(r"\W", "-", fixed),
        f"127.0.0.1:{bench.port}": "127.0.0.1:8453", str(npm_prefix()): "/opt/agents"})


@pytest.mark.parametrize("name", sorted(SHELLS))
async def test_shell_tool_round_trip(name: str, agent_binaries: dict[str, Path],
                                     tmp_path: Path):
    shell = SHELLS[name]
    model = RoundTrip(shell)
    async with recorded_head(model) as bench:
        setup = await prepared(name, bench, agent_binaries, tmp_path)
        ran = await run_agent(setup, args_for(name, model.prompt))
        await record(name, "tool", bench, tmp_path)
        prompts = list(bench.engine().prompts)
    why = f"{name}: {ran.tail()}\nrequests: {bench.recorder.summary()}"
    assert ran.rc == 0, why
    assert model.answer in ran.stdout, why
    # the snippet gave Claude Code the model's window (else it assumes 1M tokens, and says so)
    assert "doesn't recognize the model" not in ran.stdout + ran.stderr, why
    proof = setup.project / "proof.txt"
    assert proof.is_file() and proof.read_text().strip() == model.nonce, why
    posts = api_posts(bench, shell.route)
    assert [r for r in bench.recorder.requests if r.method == "POST" and r.status >= 400] == [], \
        why
    # the turn that called the tool offered it, with the argument the script fills in
    calling = [r for r in posts if model.nonce in json.dumps(r.body) and offers(r)
               and not results(r)]
    assert calling, why
    params = offers(calling[0]).get(shell.tool)
    assert params is not None, f"{shell.tool} not offered: {sorted(offers(calling[0]))}"
    assert shell.arg in params.get("properties", {}), params
    # the next request carried the tool's output back, and the model saw it
    carried = [r for r in posts if any(model.result in t for t in results(r))]
    assert carried, why
    # and the prompt that carried it extends the one that called the tool, unchanged: the
    # node can reuse that prefill (its prompt cache) for the next turn
    called = [p for p in prompts if model.nonce in p and model.result not in p
              and f"\n{shell.tool}: " in p]
    answered = [p for p in prompts if "<tool_response>" in p and model.result in p]
    assert called and answered, why
    same = parted_at(called[-1], answered[0])
    assert answered[0].startswith(called[-1]), \
        f"the prompts part at {same} of {len(called[-1])} characters: " \
        f"{called[-1][same - 80:same + 80]!r} / {answered[0][same - 80:same + 80]!r}"


AIDER_FILE = "greeting.py"


async def test_aider_applies_an_edit_in_a_git_repository(agent_binaries: dict[str, Path],
                                                         tmp_path: Path):
    nonce = secrets.token_hex(6)
    before = 'GREETING = "hello"\n'
    after = f'GREETING = "hello {nonce}"\n'

    def model(prompt: str) -> str | None:
        # aider's "whole" edit format (its default for a model it does not know): the
        # file's path on a line, then the whole new file in a fence
        if nonce in prompt and before.strip() in prompt:
            return f"Here it is.\n\n{AIDER_FILE}\n```\n{after}```\n"
        return "ok"

    async with recorded_head(model) as bench:
        setup = await prepared("aider", bench, agent_binaries, tmp_path)
        await asyncio.to_thread(git_repo, setup.project, setup.env, {AIDER_FILE: before})
        ran = await run_agent(setup, [
            "--yes-always", "--no-auto-commits", "--no-check-update", "--no-analytics",
            "--no-pretty", "--no-fancy-input",
            "--message", f"Add the word {nonce} to the greeting.", AIDER_FILE])
        await record("aider", "edit", bench, tmp_path)
    why = f"aider: {ran.tail()}\nrequests: {bench.recorder.summary()}"
    assert ran.rc == 0, why
    # the snippet's model metadata gave aider the window (else: "Unknown context window")
    assert "Unknown context window" not in ran.stdout + ran.stderr, why
    assert (setup.project / AIDER_FILE).read_text() == after, why
    (req,) = api_posts(bench, "/v1/chat/completions")
    assert req.status == 200 and req.body["model"] == "mock-m", why
    sent = "".join(text_of(m.get("content")) for m in req.body["messages"])
    assert before.strip() in sent and nonce in sent  # the file and the ask went to the model


# -- Claude Code's interactive start-up, in a terminal -----------------------------------


class Terminal:
    """A program in a tmux session of its own (a private socket, no config), read as the
    screen a person would see and typed into. The program runs under ``sh``, which writes
    its exit status to a file when it ends."""

    def __init__(self, setup: Setup, root: Path) -> None:
        self.setup = setup
        self.socket = str(root / "tmux.sock")
        self.status_file = root / "exit-status"

    async def tmux(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "tmux", "-S", self.socket, "-f", "/dev/null", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={"PATH": self.setup.env["PATH"], "HOME": self.setup.env["HOME"],
                 "TERM": "xterm-256color"})
        out, _ = await proc.communicate()
        return out.decode(errors="replace")

    async def start(self) -> None:
        env = [f"{k}={v}" for k, v in self.setup.env.items()
               if k not in ("TERM", "NO_COLOR", "FORCE_COLOR", "CI")]
        run = f'"$0" "$@"; echo $? > {shlex.quote(str(self.status_file))}'
        await self.tmux("new-session", "-d", "-x", "120", "-y", "40", "-c",
                        str(self.setup.project), "env", "-i", *env, "TERM=tmux-256color",
                        "sh", "-c", run, str(self.setup.binary), *self.setup.command)

    async def screen(self) -> str:
        return await self.tmux("capture-pane", "-p", "-t", "0")

    async def keys(self, *keys: str) -> None:
        await self.tmux("send-keys", "-t", "0", *keys)

    async def type(self, text: str) -> None:
        await self.tmux("send-keys", "-t", "0", "-l", text)

    async def exit_status(self) -> str:
        """'' while the program runs, else its exit status."""
        def read() -> str:
            try:
                return self.status_file.read_text().strip()
            except FileNotFoundError:
                return ""
        return await asyncio.to_thread(read)

    async def close(self) -> None:
        await self.tmux("kill-server")  # this socket's server only: the one we started


# what a new user is asked before Claude Code's prompt, answered with its default, except
# the folder's trust, whose default is now "No, exit": the cursor goes down to "Yes" first
FIRST_RUN = ("Choose the text style", "Press Enter to continue", "Yes, I trust this folder")


CURSOR = "\u276f"  # the heavy angle Claude Code marks the chosen answer and its prompt with


def distrusts(screen: str) -> bool:
    """The cursor is on the trust question's "No, exit"."""
    return any("No, exit" in line and CURSOR in line for line in screen.splitlines())


def ready(screen: str) -> bool:
    """Claude Code's prompt: an empty input line (its "? for shortcuts" hint is gone)."""
    return any(line.strip() == CURSOR for line in screen.splitlines())


async def test_claude_code_interactive_start_up(agent_binaries: dict[str, Path],
                                                tmp_path: Path):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: apt install tmux", pytrace=False)
    nonce = secrets.token_hex(6)
    answer = f"Hello from the fleet {nonce}"

    def model(prompt: str) -> str | None:
        return answer if nonce in prompt else "Greeting"

    async with recorded_head(model) as bench:
        setup = await prepared("claude", bench, agent_binaries, tmp_path)
        term = Terminal(setup, tmp_path)
        await term.start()
        try:
            seen: list[str] = []
            pressed: dict[str, float] = {}

            async def past_first_run() -> bool:
                screen = await term.screen()
                seen[:] = [screen]
                if ready(screen):
                    return True
                # a key a second on the same screen, as a person presses it (a burst of
                # keys is taken for a paste, and one sent before the question listens is lost)
                if time.monotonic() - pressed.get(screen, -1.0) < 1.0:
                    return False
                if distrusts(screen):
                    await term.keys("Down")
                elif any(step in screen for step in FIRST_RUN):
                    await term.keys("Enter")
                else:
                    return False
                pressed[screen] = time.monotonic()
                return False

            try:
                await until(past_first_run, "Claude Code's prompt, past its first-run "
                            "questions", timeout=60)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the screen:\n{''.join(seen)}") from None
            await term.type(f"Say hello, check {nonce}")
            await term.keys("Enter")
            await until(lambda: _shows(term, answer), "the answer on Claude Code's screen",
                        timeout=60)
            await term.type("/exit")
            await until(lambda: _shows(term, "Exit the CLI"), "the /exit command offered")
            await term.keys("Enter")
            last: list[str] = []

            async def exited() -> str:
                status = await term.exit_status()
                if not status:
                    last[:] = [await term.screen()]
                return status

            try:
                status = await until(exited, "Claude Code to exit", timeout=30)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; requests: {bench.recorder.summary()}; the "
                                     f"screen:\n{''.join(last)}") from None
            screen = await term.screen()
        finally:
            await term.close()
        await record("claude", "interactive", bench, tmp_path)
    why = f"screen:\n{screen}\nrequests: {bench.recorder.summary()}"
    assert status == "0", why
    turns = [r for r in api_posts(bench, "/v1/messages")
             if any(nonce in text_of(m.get("content")) for m in r.body.get("messages", []))]
    main = [r for r in turns if "Bash" in offers(r)]
    assert main and all(r.status == 200 for r in main), why


async def _shows(term: Terminal, text: str) -> bool:
    return text in await term.screen()


async def test_two_claude_code_sessions_share_the_prefill_of_their_system_prompt(
        agent_binaries: dict[str, Path], tmp_path: Path):
    """Two `claude -p` sessions in one folder, with different first prompts: their
    prompts agree up to the first user turn (the ~20,000-token system prompt and tools),
    so the second reuses the first's prefill. Claude Code's billing-header line, which
    differs between sessions, is what would part them."""
    asks = [f"First question {secrets.token_hex(6)}", f"Other question {secrets.token_hex(6)}"]

    def model(prompt: str) -> str | None:
        return "Answered." if any(a in prompt for a in asks) else "Title"

    async with recorded_head(model) as bench:
        setup = await prepared("claude", bench, agent_binaries, tmp_path)
        runs = [await run_agent(setup, ["-p", ask, "--allowedTools", "Bash"]) for ask in asks]
        prompts = list(bench.engine().prompts)
    why = f"{[r.tail() for r in runs]}\nrequests: {bench.recorder.summary()}"
    assert [r.rc for r in runs] == [0, 0], why
    first, second = (next(p for p in prompts if ask in p and "\nBash: " in p) for ask in asks)
    user_turn = first.rindex("<|im_start|>user\n", 0, first.index(asks[0]))
    same = parted_at(first, second)
    assert same >= user_turn, (f"the sessions' prompts part at {same} of the {user_turn} "
                               f"characters before the user's turn: "
                               f"{first[same - 60:same + 60]!r} / {second[same - 60:same + 60]!r}")
