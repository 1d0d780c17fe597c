"""The coding agents people run, as they ship (pinned, installed by scripts/lib/agents.py),
run as subprocesses against an in-process head on 127.0.0.1 whose scripted mock nodes
answer as a model would (tests/integration/agents.py).

Each agent is configured from the very snippet the app's "Connect your editor" panel
shows (app/editors.py): a shell snippet's ``export K=V`` lines become the agent's
environment and its command line the agent's command; a file snippet is written where
its ``where`` says, under the agent's temporary HOME. So a snippet that stops working
fails a test.

A recorder on the head's app keeps every request the agent sent (method, path, query,
headers without credentials, JSON body) and the status it was answered with; with
``SHOAL_RECORD_AGENTS=1`` those of a test are written as the fixtures that
tests/unit/test_agent_requests.py decodes (tests/fixtures/agents/<agent>-<version>/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from app.editors import (
    Offer,
    Snippet,
    aider_shell,
    claude_code_shell,
    cline_cli_json,
    codex_toml,
    continue_yaml,
    kilo_json,
    opencode_json,
    pi_json,
    qwen_json,
)
from engine.api.app import build_app
from scripts.lib.agents import BY_NAME
from tests.agent_fixtures import RECORD_ENV
from tests.agent_fixtures import fixture_dir as _fixture_dir
from tests.integration.agents import TOOLS_TEMPLATE, Script, ScriptedEngine
from tests.integration.test_api_surface import MODEL, Live, live_head, mock_model
from tests.waiting import until

# Claude Code's prompt is ~85 KB, and the mock tokenizer is byte-level: ~85k tokens
WINDOW = 262_144
RUN_TIMEOUT_S = 90.0
_SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "cookie"})
SnippetFor = Callable[[str, Sequence[Offer]], Snippet]
SNIPPETS: dict[str, SnippetFor] = {
    "claude": claude_code_shell, "codex": codex_toml, "opencode": opencode_json,
    "cn": continue_yaml, "aider": aider_shell, "pi": pi_json, "cline": cline_cli_json,
    "kilo": kilo_json, "qwen": qwen_json}


# -- the recorder ---------------------------------------------------------------------


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any  # the JSON body, None when there was none (or it was not JSON)
    status: int = 0  # what the head answered; 0 while the answer is under way
    error: str = ""  # the error's body, when the head refused it

    def as_fixture(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "query": self.query,
                "headers": self.headers, "status": self.status, "body": self.body}


@dataclass
class Recorder:
    """Keeps each request the head's app was sent, in order of arrival."""

    requests: list[Recorded] = field(default_factory=list)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        raw = await request.read() if request.body_exists else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        entry = Recorded(request.method, request.path, dict(request.query),
                         {k.lower(): v for k, v in request.headers.items()
                          if k.lower() not in _SECRET_HEADERS}, body)
        self.requests.append(entry)
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            entry.status = exc.status
            raise
        entry.status = resp.status
        if resp.status >= 400 and isinstance(resp, web.Response) and resp.text is not None:
            entry.error = resp.text[:2000]
        return resp

    def posts(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST" and r.path == path]

    def summary(self) -> str:
        return "; ".join(f"{r.method} {r.path} -> {r.status}{' ' + r.error if r.error else ''}"
                         for r in self.requests)


@dataclass
class Bench:
    """A head with scripted nodes, served through an app that records its requests."""

    live: Live
    recorder: Recorder
    port: int

    @property
    def base_url(self) -> str:
        """The API URL the app's snippets are built from (what its panel shows)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def engine(self) -> ScriptedEngine:
        return self.live.agents[0].engine  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def recorded_head(script: Script, *, lanes: int = 2) -> AsyncIterator[Bench]:
    """A head (one scripted node with a window big enough for any agent's prompt) and a
    second app of its own, built like the first, with the recorder outermost."""
    model = mock_model(template=TOOLS_TEMPLATE)
    async with live_head(model=model, make_engine=lambda name: ScriptedEngine(
            script, model=name, lanes=lanes, context_window=WINDOW)) as live:
        recorder = Recorder()
        app = build_app(live.head)
        app.middlewares.insert(0, recorder.middleware)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield Bench(live, recorder, port)
        finally:
            await runner.cleanup()


# -- configuring an agent from its snippet ----------------------------------------------


def offers() -> list[Offer]:
    return [Offer(MODEL, WINDOW, tools=True, fim=False)]


def shell_snippet(text: str, home: Path | None = None) -> tuple[dict[str, str], list[str]]:
    """A shell snippet's ``export K=V`` lines as an environment, and its last command;
    a ``printf '%s\\n' TEXT > ~/PATH`` line writes TEXT to PATH under ``home``, and a
    word ``~/...`` is a path under ``home``, as sh reads them."""
    env: dict[str, str] = {}
    command: list[str] = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if home is not None:
            words = [str(home / w[2:]) if w.startswith("~/") else w for w in words]
        if words[0] == "export":
            for word in words[1:]:
                key, eq, value = word.partition("=")
                assert eq, f"not K=V in the snippet: {line!r}"
                env[key] = value
        elif words[0] == "printf":
            assert words[1] == "%s\\n" and words[3] == ">" and len(words) == 5, line
            assert home is not None and words[4].startswith(str(home)), line
            Path(words[4]).write_text(words[2] + "\n")
        else:
            command = words
    return env, command


def snippet_path(snippet: Snippet, home: Path) -> Path:
    """Where a file snippet goes: the ``~/...`` path its ``where`` starts with."""
    first = snippet.where.split()[0]
    assert first.startswith("~/"), f"no ~/ path in where: {snippet.where!r}"
    return home / first.removeprefix("~/")


@dataclass
class Setup:
    """One agent, ready to run: its binary, its environment and its folders."""

    name: str
    binary: Path
    env: dict[str, str]
    home: Path
    project: Path
    command: list[str]  # the snippet's command line after the program's name, if any
    snippet: Snippet


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: none of the developer's keys, proxies or settings."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", "FORCE_COLOR": "0",
           "CI": "1", "TMPDIR": str(home / "tmp"), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".local" / "share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local" / "state"),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           # nothing but the head: no update checks, telemetry or error reports
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_ERROR_REPORTING": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
           "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
           "KILO_DISABLE_AUTOUPDATE": "1", "KILO_DISABLE_MODELS_FETCH": "1",
           "KILO_DISABLE_LSP_DOWNLOAD": "1", "KILO_TELEMETRY_LEVEL": "off",
           "PI_OFFLINE": "1", "PI_TELEMETRY": "0",
           # cline runs its session in process: by default it starts a hub daemon that
           # leaves the agent's process group and outlives the test
           "CLINE_SESSION_BACKEND_MODE": "local",
           "CONTINUE_TELEMETRY_ENABLED": "0", "AIDER_CHECK_UPDATE": "false",
           "AIDER_ANALYTICS": "false", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def setup_agent(name: str, base_url: str, binary: Path, root: Path,
                models: Sequence[Offer] | None = None) -> Setup:
    """A temporary HOME and project folder for ``name``, configured from its snippet for
    ``models`` (default: the scripted head's one)."""
    home, project = root / "home", root / "project"
    home.mkdir(parents=True, exist_ok=True)
    project.mkdir(parents=True, exist_ok=True)
    env = base_env(home)
    snippet = SNIPPETS[name](base_url, offers() if models is None else models)
    command: list[str] = []
    if snippet.kind == "shell":
        exports, words = shell_snippet(snippet.text, home)
        env.update(exports)
        assert words and words[0] == BY_NAME[name].binary, \
            f"the {snippet.client} snippet runs {words!r}, not {BY_NAME[name].binary}"
        command = words[1:]
    else:
        path = snippet_path(snippet, home)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(snippet.text)
    if name == "aider":
        # aider fetches a price list from GitHub unless its cache of it is fresh
        cache = home / ".aider" / "caches" / "model_prices_and_context_window.json"
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text("{}")
        env.update({"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
                    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"})
    return Setup(name, binary, env, home, project, command, snippet)


def git_repo(project: Path, env: dict[str, str], files: dict[str, str]) -> None:
    """A git repository in ``project`` with ``files`` committed (blocking: off the loop)."""
    for rel, text in files.items():
        (project / rel).write_text(text)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "start"]):
        subprocess.run(["git", *args], cwd=project, env=env, check=True, timeout=30,
                       capture_output=True)


# -- running one ---------------------------------------------------------------------


@dataclass
class Ran:
    rc: int | None  # None: it ran past its timeout and was killed
    stdout: str
    stderr: str

    def tail(self, n: int = 1500) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-n:]}\n--- stderr\n{self.stderr[-n:]}"


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the agent's own group: it and its children


async def run_agent(setup: Setup, args: Sequence[str], *,
                    timeout: float = RUN_TIMEOUT_S) -> Ran:
    """Run the agent (in its own process group, stdin closed) until it exits, or kill
    the group after ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        str(setup.binary), *setup.command, *args, cwd=setup.project, env=setup.env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
        rc: int | None = proc.returncode
    except TimeoutError:
        _kill_group(proc)
        out, err = await proc.communicate()
        rc = None
    finally:
        if proc.returncode is None:
            _kill_group(proc)
            await proc.wait()
    # whatever the agent left running in its group (a shell it spawned) ends with it
    _kill_group(proc)
    # and nothing of it lives on outside its group (cline's hub daemon once did)
    try:
        await until(lambda: not left_running(setup.project),
                    f"no process of {setup.binary.name} left running in {setup.project}",
                    timeout=10)
    finally:
        for pid in left_running(setup.project):  # the test's own, started by the agent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return Ran(rc, out.decode(errors="replace"), err.decode(errors="replace"))


def left_running(project: Path) -> list[int]:
    """Live processes whose command line names ``project`` (a zombie's names nothing)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(project).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


# -- fixtures of what the agents sent ------------------------------------------------------


def fixture_dir(name: str) -> Path:
    return _fixture_dir(name, BY_NAME[name].version)


_UNSAFE = re.compile(r"[^a-z0-9]+")


def record_fixtures(name: str, what: str, requests: Sequence[Recorded],
                    replace: dict[str, str] | None = None) -> list[Path]:
    """With SHOAL_RECORD_AGENTS=1, write the API requests (POSTs) as
    ``NN-<what>-<route>.json`` in the agent's fixture folder, each string of ``replace``
    replaced (the test's temporary folder and port, so that a re-recording differs where
    the agent changed); otherwise nothing. Blocking: call it off the loop."""
    if os.environ.get(RECORD_ENV) != "1":
        return []
    folder = fixture_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"[0-9][0-9]-{what}-*.json"):
        old.unlink()
    out = []
    posts = [r for r in requests if r.method == "POST"]
    for n, req in enumerate(posts, 1):
        route = _UNSAFE.sub("-", req.path.lower()).strip("-")
        path = folder / f"{n:02d}-{what}-{route}.json"
        text = json.dumps(req.as_fixture(), indent=1, ensure_ascii=False) + "\n"
        for old, new in (replace or {}).items():
            text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
        path.write_text(text)
        out.append(path)
    return out


__all__ = ["MODEL", "RECORD_ENV", "Bench", "Ran", "Recorded", "Recorder",
           "Setup", "fixture_dir", "git_repo", "record_fixtures", "recorded_head",
           "run_agent", "setup_agent", "shell_snippet"]
