"""Discovery: time from a node's start to the head placing a session on it.

Two scenarios, each with one head started once and N fresh joining nodes
(mock runtime, default lanes, a new ``--identity`` per run), one at a time:

  * mdns: two network namespaces joined by a veth pair stand for two machines
    on a LAN. The head (``--fleet-listen 0.0.0.0:8454 --discovery lan``)
    announces itself over mDNS in one; ``shoal node join --discovery lan`` runs
    in the other with no address. Needs root (or CAP_SYS_ADMIN) and iproute2;
    skipped, with the reason, where namespaces cannot be made.
  * tailnet: a fake tailscaled LocalAPI on a unix socket (tests/fake_tailscaled.py,
    on its own thread loop) lists this machine as an online peer at 127.0.0.1;
    ``shoal node join --discovery tailnet --tailscale-socket PATH --head-port PORT``
    finds the head there over loopback.

One run is timed from just before the node process is spawned (so Python
interpreter start-up and imports are part of "a node's start") until a chat
completion PINNED to that node (``POST /v1/chat/completions?host=<identity>``)
returns 200 from the head *and* the head's ``X-Shoal-Node`` header names that
node: the head placed a session on it. A 200 from any other node counts as a
failed run (pinning broken), never as a success.

How it polls: a prober process (this script with ``--probe``, inside the head's
namespace for mdns) sends the pinned request again and again, one at a time,
50 ms apart, each bounded. The head runs with ``--queue-timeout 1``: a request
pinned to a node that is not there yet waits in the head's queue for up to 1 s
and is placed the moment the node's hello arrives (a join wakes the queue), then
answers 503 so the next one is sent; so the poll adds at most ~50 ms and no
request is left parked in the head. Each run gives up after ``--budget`` s
(default 20) and is recorded as a failure. The node is then stopped (SIGTERM,
waited for) before the next run.

Breakdown (medians): spawn -> the node prints "joining" (interpreter start,
imports, discovery, the token check against the head, the runtime built);
"joining" -> the head logs the node (links dialed, Noise handshakes, hello);
head logs it -> the pinned 200 (placement and a 4-token mock generation, plus
the poll). Interpreter start + the join path's imports are timed separately.

Run: sudo .venv/bin/python scripts/bench/discovery.py [--runs 7] [--budget 20]
     [--scenarios mdns,tailnet] [--out docs/benchmarks.md] [--keep-logs]
Smoke (seconds, no root: one tailnet run, figures checked, the report to a temp folder):
     .venv/bin/python scripts/bench/discovery.py --smoke
Traffic stays on loopback and inside the namespaces made here, which are
deleted at the end; every loop is bounded in time; the only processes ended
are the ones this script started, by their process ids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import queue
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Discovery (`scripts/bench/discovery.py`)"
TARGET_S = 2.0
POLL_S = 0.05
HEAD_QUEUE_TIMEOUT_S = 1.0
MODEL = "mock-m"
MDNS_PORT = 8454
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LINE_WAIT_S = 10.0  # a line already written, still on its way through a reader thread
IP_TIMEOUT_S = 10.0


# -- the prober: runs where the head's HTTP port is reachable (its namespace) ----------


def _chat(port: int, host: str | None, timeout: float) -> dict[str, Any]:
    path = "/v1/chat/completions" + (f"?host={host}" if host else "")
    body = json.dumps({"model": MODEL, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode(errors="replace")
        return {"status": r.status, "node": r.getheader("X-Shoal-Node"), "body": text[:300]}
    except (OSError, http.client.HTTPException) as exc:
        return {"status": 0, "node": None, "body": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()


def _fleet(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v1/fleet")
        out: dict[str, Any] = json.loads(conn.getresponse().read())
        return out
    finally:
        conn.close()


def _measure(port: int, identity: str, until: float) -> dict[str, Any]:
    attempts, last = 0, ""
    while time.monotonic() < until:
        attempts += 1
        # a pinned request waits in the head's queue up to its queue timeout
        got = _chat(port, identity, timeout=max(0.2, min(until - time.monotonic(),
                                                          HEAD_QUEUE_TIMEOUT_S + 5)))
        now = time.monotonic()
        if got["status"] == 200:
            return {"ok": got["node"] == identity, "t_done": now, "node": got["node"],
                    "attempts": attempts,
                    "error": "" if got["node"] == identity else
                    f"200 from node {got['node']!r}, not the pinned {identity!r}"}
        last = f"{got['status']}: {got['body']}"
        time.sleep(POLL_S)
    return {"ok": False, "t_done": None, "node": None, "attempts": attempts,
            "error": f"no pinned 200 in time; last answer {last[:200]}"}


def probe_main(port: int) -> None:
    """Answer one JSON command per stdin line with one JSON line (bounded by the parent)."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "measure":
                out = _measure(port, cmd["identity"], float(cmd["until"]))
            elif cmd["cmd"] == "chat":
                out = _chat(port, cmd.get("host"), timeout=float(cmd.get("timeout", 15)))
            elif cmd["cmd"] == "fleet":
                out = _fleet(port)
            else:
                out = {"error": f"unknown command {cmd['cmd']!r}"}
        except Exception as exc:  # report, never hang the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


# -- processes this script starts ------------------------------------------------------


class Proc:
    """A process with its stdout and stderr lines timestamped (time.monotonic) as they come."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
                 logdir: Path, stdin: bool = False) -> None:
        self.name = name
        self.lines: dict[str, list[tuple[float, str]]] = {"out": [], "err": []}
        self.log = logdir / f"{name}.log"
        self._logf = self.log.open("w")
        self._lock = threading.Lock()
        self.popen = subprocess.Popen(argv, env=env, cwd=cwd, text=True,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True)
        self.replies: queue.Queue[str] = queue.Queue()
        self._threads = [threading.Thread(target=self._read, args=(s, f), daemon=True)
                         for s, f in (("out", self.popen.stdout), ("err", self.popen.stderr))]
        for t in self._threads:
            t.start()

    def _read(self, stream: str, f: IO[str] | None) -> None:
        assert f is not None
        for line in f:
            now = time.monotonic()
            self.lines[stream].append((now, line))
            if stream == "out":
                self.replies.put(line)
            with self._lock:
                self._logf.write(f"{stream} {now:.3f} {line}")
                self._logf.flush()

    def wait_line(self, stream: str, pattern: str, timeout: float) -> tuple[float, re.Match[str]]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:  # looks at least once, so a timeout of 0 is a plain look-up
            fresh = self.lines[stream][seen:]  # a reader may append meanwhile: count these
            for t, line in fresh:
                m = rx.search(line)
                if m:
                    return t, m
            seen += len(fresh)
            if self.popen.poll() is not None and seen == len(self.lines[stream]):
                time.sleep(0.1)  # let the readers drain
                if len(self.lines[stream]) == seen:
                    break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        raise RuntimeError(f"{self.name}: no {pattern!r} within {timeout:g} s "
                           f"(exit code {self.popen.poll()}); see {self.log}")

    def first(self, stream: str, pattern: str, wait: float = 0.0) -> float | None:
        """When the first line matching ``pattern`` came, waiting up to ``wait`` s for it:
        a line the process has written may still be on its way through the reader thread
        (a busy machine), so a line that must be there is waited for, not looked up once."""
        try:
            return self.wait_line(stream, pattern, wait)[0]
        except RuntimeError:
            return None

    def ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One command to a prober, one JSON reply, within ``timeout`` s."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        try:
            out: dict[str, Any] = json.loads(self.replies.get(timeout=timeout))
        except queue.Empty:
            raise RuntimeError(f"{self.name} did not answer within {timeout:g} s") from None
        return out

    def stop(self) -> None:
        """SIGTERM this process (by its id), wait; SIGKILL if it does not end."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.popen.kill()
                self.popen.wait(5)
        for t in self._threads:
            t.join(2)
        if self.popen.stdin:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()
        with self._lock:
            self._logf.close()


# -- network namespaces (as tests/netns/conftest.py) -------------------------------------


@dataclass
class Pair:
    a: str
    b: str
    addr_a: str
    addr_b: str
    made: list[str] = field(default_factory=list)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          check=False)


class Skip(Exception):
    """The scenario cannot run here; the message says why."""


@contextlib.contextmanager
def netns_pair() -> Iterator[Pair]:
    if shutil.which("ip") is None:
        raise Skip("iproute2 (`ip`) is not installed; network namespaces cannot be made")
    tag = secrets.token_hex(3)
    net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    pair = Pair(f"shoal-bench-{tag}-a", f"shoal-bench-{tag}-b", f"{net}.1", f"{net}.2")
    veth_a, veth_b = f"sb{tag}a", f"sb{tag}b"  # not "veth*": mDNS skips those as non-LAN
    try:
        first = _ip("netns", "add", pair.a)
        if first.returncode != 0:
            raise Skip(f"cannot make a network namespace (`ip netns add` said: "
                       f"{first.stderr.strip()}); run as root or with CAP_SYS_ADMIN")
        pair.made.append(pair.a)
        steps: list[tuple[str, ...]] = [("netns", "add", pair.b),
                                        ("link", "add", veth_a, "netns", pair.a, "type", "veth",
                                         "peer", "name", veth_b, "netns", pair.b)]
        for ns, dev, addr in ((pair.a, veth_a, pair.addr_a), (pair.b, veth_b, pair.addr_b)):
            steps += [("-n", ns, "link", "set", "lo", "up"),
                      ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                      ("-n", ns, "link", "set", dev, "up", "multicast", "on"),
                      ("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                raise Skip(f"cannot join two network namespaces with a veth pair "
                           f"(`ip {' '.join(step)}`: {done.stderr.strip()})")
            if step[:2] == ("netns", "add"):
                pair.made.append(step[2])
        yield pair
    finally:
        for ns in pair.made:  # deleting a namespace removes its end of the veth pair
            _ip("netns", "del", ns)


# -- the fake tailscaled, on its own loop (as tests/integration/test_join.py) ------------


@contextlib.contextmanager
def fake_tailscaled(path: Path, peers: list[dict[str, Any]]) -> Iterator[None]:
    sys.path.insert(0, str(ROOT))
    from tests.fake_tailscaled import serve_fake_tailscaled

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        runner = asyncio.run_coroutine_threadsafe(serve_fake_tailscaled(path, peers),
                                                  loop).result(10)
        try:
            yield
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


# -- one scenario ----------------------------------------------------------------------


@dataclass
class Run:
    identity: str
    ok: bool
    total: float | None = None
    to_joining: float | None = None
    joining_to_head: float | None = None
    head_to_200: float | None = None
    attempts: int = 0
    error: str = ""


@dataclass
class Scenario:
    name: str
    title: str
    runs: list[Run] = field(default_factory=list)
    skipped: str = ""
    pin_checks: list[str] = field(default_factory=list)
    pin_broken: list[str] = field(default_factory=list)


@dataclass
class Setup:
    head_prefix: list[str]  # argv prefix for processes on the head's side
    node_prefix: list[str]  # ... and on the node's side
    head_args: list[str]
    node_args: Callable[[Proc], list[str]]  # from the running head; without --identity
    head_home: Path
    node_home: Path


def make_home(path: Path, token: str) -> Path:
    (path / "fleet").mkdir(parents=True)
    (path / "fleet" / "token").write_text(token)
    (path / "fleet" / "token").chmod(0o600)
    return path


def base_env(code: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(code),
            "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}


def run_scenario(sc: Scenario, setup: Setup, args: argparse.Namespace, logdir: Path,
                 procs: list[Proc], ready_head: str) -> None:
    code: Path = args.code
    env = base_env(code)
    shoal = [sys.executable, "-m", "engine.cli"]
    head = Proc(f"{sc.name}-head", [*setup.head_prefix, *shoal, *setup.head_args],
                {**env, "SHOAL_HOME": str(setup.head_home)}, code, logdir)
    procs.append(head)
    _, m = head.wait_line("out", r"at http://127\.0\.0\.1:(\d+)/v1", START_TIMEOUT_S)
    http_port = int(m.group(1))
    head.wait_line("err", ready_head, START_TIMEOUT_S)
    prober = Proc(f"{sc.name}-prober",
                  [*setup.head_prefix, sys.executable, str(Path(__file__).resolve()),
                   "--probe", str(http_port)], env, code, logdir, stdin=True)
    procs.append(prober)
    try:  # its first line says it is ready; every later line answers one command
        prober.replies.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(f"the prober did not start; see {prober.log}") from None
    node_args = setup.node_args(head)
    tag = secrets.token_hex(2)
    for i in range(args.runs):
        identity = f"bench-{sc.name}-{tag}-{i + 1}"
        node_env = {**env, "SHOAL_HOME": str(setup.node_home)}
        argv = [*setup.node_prefix, *shoal, *node_args, "--identity", identity]
        t0 = time.monotonic()
        until = t0 + args.budget
        node = Proc(f"{sc.name}-node-{i + 1}", argv, node_env, code, logdir)
        procs.append(node)
        try:
            res = prober.ask({"cmd": "measure", "identity": identity, "until": until},
                             timeout=args.budget + HEAD_QUEUE_TIMEOUT_S + 15)
            run = Run(identity, bool(res.get("ok")), attempts=int(res.get("attempts", 0)),
                      error=str(res.get("error") or ""))
            if res.get("node") and res["node"] != identity:
                sc.pin_broken.append(f"run {i + 1}: {run.error}")
            t_done = res.get("t_done")
            # both lines were written before the 200 could come; give their readers time
            wait = LINE_WAIT_S if run.ok else 0.0
            t_join = node.first("out", r"node '.*' joining ", wait)
            t_head = head.first("err", rf"fleet node '{re.escape(identity)}' at ", wait)
            if run.ok and t_done is not None:
                run.total = t_done - t0
                if t_join is not None:
                    run.to_joining = t_join - t0
                    if t_head is not None:
                        run.joining_to_head = t_head - t_join
                        run.head_to_200 = t_done - t_head
            elif node.popen.poll() is not None:
                run.error += f"; the node exited with {node.popen.returncode} (see {node.log})"
            if run.ok and i == 0:
                # a second node beside this one, so that a pin has a choice to get wrong
                other = f"{identity}-other"
                extra = Proc(f"{sc.name}-node-other", [*setup.node_prefix, *shoal, *node_args,
                                                       "--identity", other],
                             node_env, code, logdir)
                procs.append(extra)
                try:
                    head.wait_line("err", rf"fleet node '{re.escape(other)}' at ",
                                   args.budget)
                    pin_checks(sc, prober, identity, other)
                finally:
                    extra.stop()
        except RuntimeError as exc:
            run = Run(identity, False, error=str(exc))
        finally:
            node.stop()
        sc.runs.append(run)
        print(f"  {sc.name} run {i + 1}: " + (
            f"{run.total:.3f} s (spawn->joining {run.to_joining or 0:.3f}, "
            f"->head {run.joining_to_head or 0:.3f}, ->200 {run.head_to_200 or 0:.3f}; "
            f"{run.attempts} request(s))" if run.ok else f"FAILED: {run.error}"), flush=True)


def pin_checks(sc: Scenario, prober: Proc, identity: str, other: str) -> None:
    """With two joined nodes up: does ``?host=`` send each request to the named one only?"""
    for name in (identity, other, identity, other):
        got = prober.ask({"cmd": "chat", "host": name}, timeout=20)
        ok = got["status"] == 200 and got["node"] == name
        if not ok:
            sc.pin_broken.append(f"pinned to '{name}': {got['status']} from '{got['node']}'")
    sc.pin_checks.append("pinned to each of two ready nodes, twice each: "
                         + ("all served by the named node" if not sc.pin_broken else "WRONG"))
    bogus = f"no-such-node-{secrets.token_hex(2)}"
    got = prober.ask({"cmd": "chat", "host": bogus}, timeout=HEAD_QUEUE_TIMEOUT_S + 20)
    ok = got["status"] != 200
    sc.pin_checks.append(f"pinned to an unknown name: {got['status']}"
                         f" ({'ok' if ok else 'WRONG: served by ' + str(got['node'])})")
    if not ok:
        sc.pin_broken.append(sc.pin_checks[-1])
    served = []
    for _ in range(6):
        got = prober.ask({"cmd": "chat", "host": None}, timeout=20)
        served.append(got["node"] if got["status"] == 200 else f"status {got['status']}")
    sc.pin_checks.append("unpinned, 6 requests: served by " + ", ".join(
        f"{name} x{served.count(name)}" for name in sorted(set(map(str, served)))))


def mdns_scenario(args: argparse.Namespace, logdir: Path, token: str,
                  procs: list[Proc]) -> Scenario:
    sc = Scenario("mdns", "mDNS across two network namespaces (veth pair)")
    try:
        with netns_pair() as pair:
            setup = Setup(
                head_prefix=["ip", "netns", "exec", pair.a],
                node_prefix=["ip", "netns", "exec", pair.b],
                head_args=["serve", MODEL, "--runtime", "mock", "--http", "127.0.0.1:0",
                           "--fleet-listen", f"0.0.0.0:{MDNS_PORT}", "--discovery", "lan",
                           "--queue-timeout", str(HEAD_QUEUE_TIMEOUT_S)],
                node_args=lambda _head: ["node", "join", "--discovery", "lan", "--runtime",
                                         "mock", "--model", "x"],
                head_home=make_home(logdir / "mdns-head-home", token),
                node_home=make_home(logdir / "mdns-node-home", token))
            started = len(procs)
            try:
                run_scenario(sc, setup, args, logdir, procs, r"announced on the LAN")
            finally:  # end the processes inside the namespaces before deleting them
                for p in reversed(procs[started:]):
                    p.stop()
    except Skip as exc:
        sc.skipped = str(exc)
        print(f"mdns scenario skipped: {exc}", flush=True)
    return sc


def tailnet_scenario(args: argparse.Namespace, logdir: Path, token: str,
                     procs: list[Proc]) -> Scenario:
    sc = Scenario("tailnet", "fake tailnet (LocalAPI on a unix socket), loopback")
    sock = logdir / "tailscaled.sock"
    head_home = make_home(logdir / "tailnet-head-home", token)
    node_home = make_home(logdir / "tailnet-node-home", token)
    peers = [{"HostName": "desk", "TailscaleIPs": ["127.0.0.1"], "Online": True},
             {"HostName": "laptop", "TailscaleIPs": ["127.0.0.9"], "Online": False}]

    def node_args(head: Proc) -> list[str]:
        _, m = head.wait_line("err", r"taking nodes that join on [\d.]+:(\d+)", 10)
        return ["node", "join", "--discovery", "tailnet", "--tailscale-socket", str(sock),
                "--head-port", m.group(1), "--runtime", "mock", "--model", "x"]

    setup = Setup(head_prefix=[], node_prefix=[],
                  head_args=["serve", MODEL, "--runtime", "mock", "--http", "127.0.0.1:0",
                             "--fleet-listen", "127.0.0.1:0", "--discovery", "none",
                             "--queue-timeout", str(HEAD_QUEUE_TIMEOUT_S)],
                  node_args=node_args, head_home=head_home, node_home=node_home)
    with fake_tailscaled(sock, peers):
        started = len(procs)
        try:
            run_scenario(sc, setup, args, logdir, procs, r"taking nodes that join on")
        finally:
            for p in reversed(procs[started:]):
                p.stop()
    return sc


def start_up(code: Path, n: int) -> dict[str, list[float]]:
    """Wall times of a bare interpreter, and of one importing what `shoal node join` imports."""
    mods = ("engine.cli, engine.discovery.service, engine.discovery.tailscale, "
            "engine.runtimes.mock")
    out: dict[str, list[float]] = {"bare": [], "imports": []}
    for _ in range(n):
        for key, src in (("bare", "pass"), ("imports", f"import {mods}")):
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-c", src], cwd=code, env=base_env(code),
                           check=True, timeout=60, capture_output=True)
            out[key].append(time.monotonic() - t0)
    return out


# -- report ----------------------------------------------------------------------------


def _med(xs: list[float | None]) -> str:
    vals = [x for x in xs if x is not None]
    return f"{statistics.median(vals):.2f}" if vals else "-"


def report(scenarios: list[Scenario], startup: dict[str, list[float]],
           args: argparse.Namespace) -> str:
    lines = [
        HEADING, "",
        f"Time from a node's start to the head placing a session on it: {args.runs} runs per "
        "scenario, a fresh `shoal node join` process each (mock runtime, 8 lanes, a new "
        "`--identity`), the head started once. Clock: from just before the node process is "
        "spawned (so **Python interpreter start-up and imports count**) until a chat "
        "completion pinned to that node (`?host=<identity>`) returns 200 with "
        "`X-Shoal-Node: <identity>`. The pinned request is re-sent 50 ms apart; the head runs "
        f"with `--queue-timeout {HEAD_QUEUE_TIMEOUT_S:g}`, so a request waiting for the node "
        f"is placed the moment it joins. Target: median at most {TARGET_S:g} s. "
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, head, node and client on "
        "the same machine.", "",
        "| scenario | ok runs | median s | min s | max s | target | spawn → \"joining\" | "
        "\"joining\" → head has it | head has it → 200 |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for sc in scenarios:
        if sc.skipped:
            lines.append(f"| {sc.title} | skipped: {sc.skipped} | | | | | | | |")
            continue
        ok = [r for r in sc.runs if r.ok and r.total is not None]
        totals = [r.total for r in ok if r.total is not None]
        if totals:
            med = statistics.median(totals)
            verdict = "PASS" if med <= TARGET_S and len(ok) == len(sc.runs) else "MISS"
            lines.append(
                f"| {sc.title} | {len(ok)}/{len(sc.runs)} | {med:.2f} | {min(totals):.2f} | "
                f"{max(totals):.2f} | {verdict} (≤ {TARGET_S:g} s) | "
                f"{_med([r.to_joining for r in ok])} | {_med([r.joining_to_head for r in ok])} "
                f"| {_med([r.head_to_200 for r in ok])} |")
        else:
            lines.append(f"| {sc.title} | 0/{len(sc.runs)} | - | - | - | MISS | | | |")
    lines.append("")
    if startup.get("imports"):
        lines.append(
            "Start-up, measured apart (median of "
            f"{len(startup['imports'])}): a bare `python -c pass` takes "
            f"{statistics.median(startup['bare']):.2f} s; `python -c 'import engine.cli, "
            "engine.discovery.service, engine.discovery.tailscale, engine.runtimes.mock'` "
            f"{statistics.median(startup['imports']):.2f} s. So most of \"spawn → joining\" is "
            "imports; the rest is argument parsing, discovery (an mDNS query and its answer, "
            "or one LocalAPI status call), the token check against the head (one Noise "
            "handshake) and building the mock runtime. The mdns node also goes through "
            "`ip netns exec`.")
        lines.append("")
    for sc in scenarios:
        if sc.skipped:
            continue
        per_run = ", ".join(f"{r.total:.2f}" if r.ok and r.total is not None else "fail"
                            for r in sc.runs)
        lines.append(f"- {sc.name}, per run (s): {per_run}")
        for r in sc.runs:
            if not r.ok:
                lines.append(f"  - {r.identity}: {r.error}")
        if sc.pin_checks:
            lines.append(f"  - `?host=` checks: {'; '.join(sc.pin_checks)}")
    broken = [b for sc in scenarios for b in sc.pin_broken]
    lines.append("")
    checked = any(r.ok for sc in scenarios for r in sc.runs)
    lines.append("`?host=` pinning: " + (
        "BROKEN: " + "; ".join(broken) if broken else
        "every pinned 200 came from the pinned node (checked with `X-Shoal-Node`)." if checked
        else "not checked (no run got a 200)."))
    return "\n".join(lines) + "\n"


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace this benchmark's own "## " section (or append it); the rest stays as read now."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if text.startswith(heading):
        start = 0
    else:
        found = text.find("\n" + heading)
        start = found + 1 if found != -1 else -1
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("\n" + text[end + 1:] if end != -1 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="fresh nodes per scenario (default 7)")
    ap.add_argument("--budget", type=float, default=20.0,
                    help="seconds a run may take before it counts as a failure (default 20)")
    ap.add_argument("--scenarios", default="mdns,tailnet")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    ap.add_argument("--code", type=Path, default=ROOT,
                    help="the Shoal checkout the head and nodes run from (default: this one)")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="one tailnet run, the report to a temp folder; exit 1 if the "
                    "figures make no sense")
    args = ap.parse_args()
    if args.probe is not None:
        probe_main(args.probe)
        return
    if args.smoke:
        sys.path.insert(0, str(ROOT))
        from scripts.bench.smoke import scratch

        args.runs, args.scenarios, args.no_write = 1, "tailnet", False
        args.out = scratch("discovery") / "benchmarks.md"
    if not 1 <= args.runs <= 100 or not 1 <= args.budget <= 120:
        ap.error("--runs must be 1..100 and --budget 1..120")
    args.code = args.code.resolve()
    logdir = Path(tempfile.mkdtemp(prefix="shoal-bench-discovery-"))
    token = secrets.token_hex(32)
    procs: list[Proc] = []
    scenarios: list[Scenario] = []
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    try:
        for name in wanted:
            print(f"{name}:", flush=True)
            if name == "mdns":
                scenarios.append(mdns_scenario(args, logdir, token, procs))
            elif name == "tailnet":
                scenarios.append(tailnet_scenario(args, logdir, token, procs))
            else:
                ap.error(f"unknown scenario {name!r}")
        startup = start_up(args.code, args.runs)
    finally:
        for p in reversed(procs):
            p.stop()
    section = report(scenarios, startup, args)
    print()
    print(section)
    failed = any(not r.ok for sc in scenarios for r in sc.runs)
    if args.keep_logs or failed:
        print(f"logs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    if not args.no_write:
        replace_section(args.out, HEADING, section)
        print(f"wrote the section {HEADING!r} of {args.out}")
    if args.smoke:
        smoke_verdict(scenarios, startup, args.budget)


def smoke_verdict(scenarios: list[Scenario], startup: dict[str, list[float]],
                  budget: float) -> None:
    from scripts.bench.smoke import verdict

    runs = [r for sc in scenarios for r in sc.runs]
    totals = [r.total for r in runs if r.ok and r.total is not None]
    parts = [(r.to_joining, r.joining_to_head, r.head_to_200) for r in runs if r.ok]
    verdict({"runs": len(runs), "ok": len(totals), "total_s": totals, "parts_s": parts,
             "imports_s": startup.get("imports"), "pin_broken": [
                 b for sc in scenarios for b in sc.pin_broken]},
            {"every run placed a session on its node": bool(runs) and len(totals) == len(runs),
             "each run took a sane time": all(0 < t < budget for t in totals),
             "each run's parts were timed": all(None not in p for p in parts),
             "?host= pinning held": not any(sc.pin_broken for sc in scenarios),
             "start-up was timed": bool(startup.get("imports"))})


if __name__ == "__main__":
    main()
