"""Real processes on 127.0.0.1: nodes and heads started through the `shoal` CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.waiting import until_sync

SHOAL = [sys.executable, "-m", "engine.cli"]
READY_TIMEOUT = 30.0


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    log: Path
    port: int
    name: str
    args: list[str] = field(default_factory=list)
    banner: str = ""  # what it printed on stdout up to its ready line
    home: Path | None = None  # its SHOAL_HOME

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGCONT)
                self.popen.terminate()
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self.popen.stdout:
            self.popen.stdout.close()


class Cluster:
    """Starts shoal processes and ends exactly those, by their process ids."""

    def __init__(self, home: Path, logs: Path) -> None:
        self.home = home
        self.logs = logs
        self.procs: list[Proc] = []
        # never the developer's keychain: the token lives in the test home's file
        self.env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONUNBUFFERED": "1",
                    "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}

    def machine(self, name: str, **env: str) -> dict[str, str]:
        """The environment of another machine of the fleet: a home of its own holding the
        cluster's fleet token (made first), ``env`` over the cluster's."""
        token = self.home / "fleet" / "token"
        if not token.is_file():
            self.token()
        home = self.home.parent / name
        (home / "fleet").mkdir(parents=True)
        shutil.copyfile(token, home / "fleet" / "token")
        (home / "fleet" / "token").chmod(0o600)
        (home / "config.toml").write_text('[node]\ngpu = "off"\n')
        return {**self.env, "SHOAL_HOME": str(home), **env}

    def token(self, *extra: str) -> str:
        out = subprocess.run([*SHOAL, "fleet", "token", *extra], env=self.env,
                             capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.strip()

    def _start(self, name: str, args: list[str], ready: re.Pattern[str],
               env: dict[str, str] | None = None, prefix: Sequence[str] = (),
               ready_timeout: float = READY_TIMEOUT) -> Proc:
        """Start ``shoal ARGS`` (after ``prefix``, e.g. ``ip netns exec NS``) and wait for
        the line ``ready`` matches; its first group is the port."""
        log = self.logs / f"{name}-{len(self.procs)}.log"
        with log.open("w") as logf:
            popen = subprocess.Popen([*prefix, *SHOAL, *args], env=env or self.env,
                                     stdout=subprocess.PIPE, stderr=logf, text=True,
                                     start_new_session=True, cwd=os.getcwd())
        deadline = time.monotonic() + ready_timeout
        assert popen.stdout is not None
        os.set_blocking(popen.stdout.fileno(), False)
        buf = ""
        while time.monotonic() < deadline:
            chunk = popen.stdout.readline()
            if chunk:
                buf += chunk
                match = ready.search(buf)
                if match:
                    proc = Proc(popen, log, int(match.group(1)), name, args, banner=buf,
                                home=Path((env or self.env)["SHOAL_HOME"]))
                    self.procs.append(proc)
                    return proc
                continue
            if popen.poll() is not None:
                break
            time.sleep(0.05)
        popen.kill()
        popen.wait(5)
        raise AssertionError(f"{name} did not start: {buf}\n{log.read_text()}")

    def node(self, identity: str, *, model: str = "mock-m", runtime: str = "mock",
             lanes: int = 4, speed: float = 0.0, port: int = 0,
             extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
             ready_timeout: float = READY_TIMEOUT) -> Proc:
        """A node process; ``speed`` (tokens/s per lane) applies to the mock runtime;
        ``env``: the whole environment instead of the cluster's."""
        args = ["node", "--runtime", runtime, "--model", model, "--identity", identity,
                "--listen", f"127.0.0.1:{port}", "--max-batch", str(lanes), *extra]
        if runtime == "mock":
            args += ["--mock-speed", str(speed)]
        return self._start(identity, args, re.compile(r" on 127\.0\.0\.1:(\d+) \(link"),
                           env=env, ready_timeout=ready_timeout)

    def head(self, nodes: list[Proc] | list[str], *, model: str = "mock-m",
             runtime: str = "mock", extra: tuple[str, ...] = (),
             env: dict[str, str] | None = None, ready_timeout: float = READY_TIMEOUT) -> Proc:
        """A head process dialing ``nodes``; with no nodes, a head with its embedded node."""
        args = ["serve", model, "--runtime", runtime, "--http", "127.0.0.1:0", *extra]
        if nodes:
            args += ["--fleet", ",".join(n if isinstance(n, str) else n.address for n in nodes)]
        return self._start("head", args, re.compile(r"at http://127\.0\.0\.1:(\d+)/v1"),
                           env=env, ready_timeout=ready_timeout)

    def join_port(self, head: Proc, timeout: float = 10.0) -> int:
        """The port a head started with --fleet-listen takes joins on (from its log)."""
        found = until_sync(lambda: re.search(r"taking nodes that join on [\d.]+:(\d+)",
                                             head.log_text()),
                           "the join port in the head's log", timeout=timeout)
        return int(found.group(1))

    def joined_node(self, identity: str, *args: str, model: str = "anything", lanes: int = 2,
                    env: dict[str, str] | None = None) -> Proc:
        """`shoal node join ARGS` on the mock runtime; ready once it joins a head."""
        cmd = ["node", "join", *args, "--runtime", "mock", "--model", model,
               "--identity", identity, "--max-batch", str(lanes)]
        return self._start(identity, cmd, re.compile(r"joining [\d.]+:(\d+)"), env=env)

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    logs = tmp_path / "logs"
    logs.mkdir()
    c = Cluster(tmp_path / "home", logs)
    yield c
    c.close()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for p in c.procs:
            print(f"--- {p.name} log ---\n{p.log_text()}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def sse_events(raw: str) -> list[str]:
    return [line[6:] for line in raw.split("\n") if line.startswith("data: ")]


def sse_text(raw: str) -> tuple[str, str | None, dict | None]:
    """Concatenated content, the finish reason, and the usage chunk of an SSE body."""
    text, finish, usage = [], None, None
    events = sse_events(raw)
    assert events[-1] == "[DONE]", events[-3:]
    for ev in events[:-1]:
        obj = json.loads(ev)
        assert "error" not in obj, obj
        if obj.get("usage"):
            usage = obj["usage"]
        for choice in obj["choices"]:
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    return "".join(text), finish, usage
