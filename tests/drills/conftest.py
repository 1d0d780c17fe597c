"""Fault drills: real `shoal` processes under load, disturbed on purpose.

The ``cluster`` fixture starts heads and nodes as processes and ends exactly those, by
their process ids (and is what exempts these tests from the in-process loop probe). A
node may run in a network namespace of its own, joined to this one by a veth pair
whose link a drill sets down and up; the fixture makes and removes both, and skips
what needs it, with the reason, where namespaces cannot be made.

Streams are read as raw SSE, so that a stream cut short (no ``[DONE]``, no error
event) is told apart from one that ended with a clear error; their text is compared
with the mock model's own output for the same prompt and seed, computed here with
its pure ``next_token``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from engine.head.prompt.model import load_head_model
from engine.runtimes.mock import EOS, next_token
from tests.integration.conftest import Cluster, Proc

MODEL = "mock-m"
WINDOW = 4096
IP_TIMEOUT_S = 10.0


# -- processes ---------------------------------------------------------------------------


class DrillCluster(Cluster):
    """A Cluster that can also start a node inside a network namespace."""

    def netns_node(self, ns: NetnsLink, identity: str, *, lanes: int, speed: float,
                   port: int = 0) -> Proc:
        args = ["node", "--runtime", "mock", "--model", MODEL, "--identity", identity,
                "--listen", f"{ns.inner}:{port}", "--max-batch", str(lanes),
                "--mock-speed", str(speed)]
        ready = re.compile(rf" on {re.escape(ns.inner)}:(\d+) \(link")
        return self._start(identity, args, ready, prefix=["ip", "netns", "exec", ns.name])

    def head(self, nodes: list[Proc] | list[str], *, model: str = MODEL,
             runtime: str = "mock", extra: tuple[str, ...] = (), port: int = 0) -> Proc:
        """A head process dialing ``nodes``, its HTTP API on ``port`` (0: any)."""
        args = ["serve", model, "--runtime", runtime, "--http", f"127.0.0.1:{port}", *extra]
        if nodes:
            args += ["--fleet", ",".join(n if isinstance(n, str) else n.address for n in nodes)]
        return self._start("head", args, re.compile(r"at http://127\.0\.0\.1:(\d+)/v1"))

    def restart(self, proc: Proc, ns: NetnsLink | None = None) -> Proc:
        """The same node again, on the same port (its process must have ended)."""
        assert proc.popen.poll() is not None, "restart a node only once it has ended"
        if proc.popen.stdout:
            proc.popen.stdout.close()
        args = proc.args
        identity = args[args.index("--identity") + 1]
        lanes = int(args[args.index("--max-batch") + 1])
        speed = float(args[args.index("--mock-speed") + 1])
        if ns is not None:
            return self.netns_node(ns, identity, lanes=lanes, speed=speed, port=proc.port)
        return self.node(identity, lanes=lanes, speed=speed, port=proc.port)

    def logs_text(self) -> dict[str, str]:
        return {p.log.name: p.log_text() for p in self.procs}


def stop_gracefully(proc: Proc, timeout: float = 20.0) -> None:
    """SIGTERM and wait for the process to end (killed after ``timeout``)."""
    proc.signal(signal.SIGTERM)
    try:
        proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait(5)
        raise AssertionError(f"{proc.name} did not end within {timeout} s of SIGTERM") \
            from None


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DrillCluster]:
    logs = tmp_path / "logs"
    logs.mkdir()
    c = DrillCluster(tmp_path / "home", logs)
    yield c
    c.close()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for p in c.procs:
            print(f"--- {p.name} ({p.log.name}) log, last 6000 chars ---\n"
                  f"{p.log_text()[-6000:]}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


# -- a node's own network namespace ------------------------------------------------------


@dataclass
class NetnsLink:
    """Namespace ``name`` holding address ``inner``, joined to this namespace (address
    ``outer``) by the veth pair ``outer_dev``/``inner_dev``."""

    name: str
    outer_dev: str
    inner: str
    outer: str

    def set_link(self, up: bool) -> None:
        _must("link", "set", self.outer_dev, "up" if up else "down")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S, check=False)


def _must(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def made_netns() -> Iterator[NetnsLink | str]:
    """A namespace for one node linked to this one, or the reason it cannot be made."""
    if shutil.which("ip") is None:
        yield "iproute2 (`ip`) is not installed; network namespaces cannot be made"
        return
    tag = secrets.token_hex(3)
    name, outer_dev, inner_dev = f"shoal-drill-{tag}", f"sd{tag}o", f"sd{tag}i"
    # a /30 of 10.254/16 that exists only on this veth pair
    third, fourth = int(tag[:2], 16), (int(tag[2:4], 16) & 0x3F) * 4
    outer, inner = f"10.254.{third}.{fourth + 1}", f"10.254.{third}.{fourth + 2}"
    made_ns = made_dev = False
    try:
        first = _ip("netns", "add", name)
        if first.returncode != 0:
            yield (f"cannot make a network namespace (`ip netns add` said: "
                   f"{first.stderr.strip()}); run as root or with CAP_SYS_ADMIN")
            return
        made_ns = True
        try:
            _must("link", "add", outer_dev, "type", "veth", "peer", "name", inner_dev,
                  "netns", name)
            made_dev = True
            _must("addr", "add", f"{outer}/30", "dev", outer_dev)
            _must("link", "set", outer_dev, "up")
            _must("-n", name, "link", "set", "lo", "up")
            _must("-n", name, "addr", "add", f"{inner}/30", "dev", inner_dev)
            _must("-n", name, "link", "set", inner_dev, "up")
        except RuntimeError as exc:
            yield f"cannot link a network namespace by a veth pair ({exc})"
            return
        yield NetnsLink(name, outer_dev, inner, outer)
    finally:
        if made_dev:
            _ip("link", "del", outer_dev)
        if made_ns:
            _ip("netns", "del", name)


# -- the reference: what an undisturbed run gives ----------------------------------------


_HEAD_MODEL = load_head_model("mock", MODEL, name=MODEL)


def reference(content: str, seed: int, max_tokens: int) -> tuple[str, str]:
    """The text and finish reason of an uninterrupted run: the mock model's pure
    ``next_token`` over the head's own rendering of the prompt."""
    context = _HEAD_MODEL.render([{"role": "user", "content": content}], tools=None)
    stops = _HEAD_MODEL.stop_ids
    out: list[int] = []
    finish = "length"
    while len(out) < max_tokens and len(context) < WINDOW:
        tok = next_token(seed, context)
        if tok == EOS or tok in stops:
            finish = "stop"
            break
        context.append(tok)
        out.append(tok)
    return bytes(out).decode("latin-1"), finish


def long_seeds(content: str, max_tokens: int, count: int, start: int = 0) -> list[int]:
    """The first ``count`` seeds from ``start`` whose answer runs to ``max_tokens``."""
    seeds: list[int] = []
    seed = start
    while len(seeds) < count:
        if reference(content, seed, max_tokens)[1] == "length":
            seeds.append(seed)
        seed += 1
    return seeds


# -- streams -----------------------------------------------------------------------------


@dataclass
class StreamResult:
    """How one SSE stream ended. ``done``: ``[DONE]`` came; ``error``: the error event's
    ``error`` object; ``broken``: the connection ended without either."""

    text: str = ""
    finish: str | None = None
    usage: dict | None = None
    error: dict | None = None
    done: bool = False
    broken: str | None = None
    status: int = 0
    chunks: int = 0
    events: list[str] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.broken is None

    @property
    def clear_error(self) -> bool:
        """An error event naming a code and a one-line message."""
        err = self.error
        return (err is not None and bool(err.get("code")) and bool(err.get("message"))
                and "\n" not in str(err.get("message")))


def chat_body(content: str, seed: int, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "seed": seed, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream(http: aiohttp.ClientSession, base: str, body: dict, *,
                 on_chunk=None, timeout: float = 120.0) -> StreamResult:
    """POST a streaming chat and read it to its end, whatever that end is."""
    res = StreamResult()
    try:
        async with asyncio.timeout(timeout), \
                http.post(f"{base}/v1/chat/completions", json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.json(content_type=None)).get("error")
                return res
            buf = b""
            async for raw in r.content.iter_any():
                buf += raw
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    for line in block.decode().split("\n"):
                        if line.startswith("data: "):
                            _event(res, line[6:])
                if on_chunk is not None:
                    await on_chunk(res)
    except (aiohttp.ClientError, ConnectionError) as exc:
        res.broken = f"{type(exc).__name__}: {exc}"
        return res
    if not res.done and res.error is None:
        res.broken = "the stream ended without [DONE] or an error event"
    return res


def _event(res: StreamResult, data: str) -> None:
    res.events.append(data[:200])
    if data == "[DONE]":
        res.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        res.error = obj["error"]
        return
    res.chunks += 1
    if obj.get("usage"):
        res.usage = obj["usage"]
    for choice in obj.get("choices", []):
        res.text += choice["delta"].get("content") or ""
        res.finish = choice.get("finish_reason") or res.finish


async def fleet(http: aiohttp.ClientSession, base: str) -> dict:
    async with http.get(f"{base}/v1/fleet") as r:
        assert r.status == 200
        return await r.json()


async def ready_nodes(http: aiohttp.ClientSession, base: str) -> set[str]:
    state = await fleet(http, base)
    return {n["identity"] for n in state["nodes"]
            if n["state"] == "ready" and n["connections"] > 0}
