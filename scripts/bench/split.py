"""Issue 33's benchmark: a model split across two machines, and a model copied from one.

Two "machines": two network namespaces joined by a veth pair (made here, as
tests/netns/conftest.py makes them, and removed at the end whatever happens), when run as
root with ``ip``; otherwise this machine's loopback, and the output says so. The lending
machine is namespace A, the serving one B (the benchmark itself enters B, so its requests
go to B's loopback). Side by side in one run, the same model and the same layer split:

- **whole**: ``shoal serve MODEL`` in B alone (``SHOAL_LLAMA_REPACK=0``: the kernels a
  split runs, so the answers compare);
- **llama.cpp RPC**: ``llama-server --rpc A_ADDR:PORT -ngl K+1 -ot
  "^(output|token_embd)=CPU"`` in B (the placement Shoal's split makes: K layers there,
  the output layer here; llama.cpp's own RPC
  client, over plain TCP across the veth) against llama.cpp's RPC server in A bound on A's
  veth address: ``ggml_backend_rpc_start_server``, the function llama.cpp's ``rpc-server``
  binary runs (no such binary is built here), called by this script's ``_rpc`` helper as
  ``engine.runtimes.rpc.serve`` calls it, less serve's 127.0.0.1-only check (Shoal's own
  lender keeps it on 127.0.0.1). No forwarder sits in llama.cpp's path. ``K`` is the
  number of layers Shoal's split put on the lender;
- **Shoal split**: ``shoal node --lend`` in A and ``shoal serve MODEL --split-with`` it
  in B: the same RPC server code on A's 127.0.0.1, reached through the fleet's encrypted
  link across the veth.

**Added latency** (``--delays``, ms each way, default 0,2,5): the split sides run at each
one, the whole side once. ``tc netem`` on both ends of the veth when the kernel has it;
otherwise (no ``sch_netem``, or on the loopback) a relay in user space (this script's
``_relay`` helper, asyncio, in A): each direction's bytes go on D ms after they arrived,
in order, each chunk scheduled at its own arrival + D. Both split sides dial a relay
of their own, the one before Shoal's node and the one before llama.cpp's RPC server, so
both paths gain the same hop (none at 0 ms). The round trip across, with the delay, is
measured through an echo in A and printed. ``--smoke`` runs one delay: the first above 0,
so that the relay's path runs too.

Per side: the time to the first token of a streamed completion (one stream), and the
completion tokens per second of 1 and of 4 streams at once (greedy, ``--tokens`` each),
medians over ``--rounds``; sides take turns. Targets, at every delay: Shoal's split at
least 0.9x llama.cpp's RPC in tokens/s, its first token at most 1.1x.

**copy**: the model file taken from a machine of the fleet (``FleetPeers`` and the pull's
own writer, sha256-checked, in B, from a node in A that keeps it in its hub cache),
against a plain TCP copy of the same file from A to B (``socket.sendfile`` into a file).
No added latency. Target: at least 0.8x.

    .venv/bin/python scripts/bench/split.py [--rounds 5] [--tokens 64] [--delays 0,2,5]
        [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import hashlib
import http.client
import json
import os
import queue
import random
import re
import secrets
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench import smoke as smoke_mode  # noqa: E402
from scripts.bench.node_lanes import replace_section, save_plot, server_binary  # noqa: E402

HEADING = "## A model split across machines, and a model copied from one"
SHOAL = [sys.executable, "-m", "engine.cli"]
HELPER = [sys.executable, str(Path(__file__).resolve())]
PROMPT = "The history of the printing press begins"
READY_S = 180.0
STOP_S = 10.0
IP_S = 10.0
SOCKET_S = 60.0
PINGS = 20
TARGET_TPS, TARGET_TTFT, TARGET_COPY = 0.9, 1.1, 0.8
CLONE_NEWNET = 0x40000000
WHOLE, SPLIT, RPC = ("Shoal, whole on one machine", "Shoal split, through the link",
                     "llama.cpp RPC, plain TCP")
T = TypeVar("T")


# -- the two machines ------------------------------------------------------------------


def _setns(fd: int) -> None:
    """Move the calling thread (and the threads and processes it starts later) into the
    network namespace ``fd`` names."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def enter(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_S,
                          check=False)


def _must(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Net:
    """Where the two machines are. ``lender``/``server``: namespaces A and B (None on the
    loopback); ``addr``: where A's listeners are reached from B; ``method``: how latency
    is added (``netem`` or ``relay``); ``note``: why the loopback, if it is."""

    lender: str | None = None
    server: str | None = None
    addr: str = "127.0.0.1"
    veths: tuple[str, str] = ("", "")
    method: str = "relay"
    note: str = ""
    made: list[str] = field(default_factory=list)
    home_fd: int | None = None

    def in_lender(self, cmd: list[str]) -> list[str]:
        """``cmd`` run in A (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.lender, *cmd] if self.lender else cmd

    def where(self) -> str:
        if self.lender is None:
            return (f"two processes on this machine's loopback stand for the two machines "
                    f"(no network namespaces: {self.note})")
        return (f"two network namespaces joined by a veth pair ({self.addr} the lending "
                "side's address) stand for the two machines; they share this machine's "
                f"{len(os.sched_getaffinity(0))} cores")

    def latency(self) -> str:
        if self.method == "netem":
            return "`tc netem` delay on both ends of the veth (D ms each way)"
        why = ("the kernel has no `sch_netem`" if self.lender else "on the loopback")
        return (f"a user-space relay ({why}): each direction's bytes forwarded D ms after "
                "they arrived, one relay before Shoal's node and one before llama.cpp's RPC "
                "server, so both paths gain the same hop")


@contextlib.contextmanager
def two_machines() -> Iterator[Net]:
    """Namespaces A and B and the veth between them, this process in B; removed (this
    process back where it was) on the way out. The loopback where they cannot be made."""
    if shutil.which("ip") is None:
        yield Net(note="`ip` (iproute2) is not installed")
        return
    if os.geteuid() != 0:
        yield Net(note="not run as root")
        return
    tag = secrets.token_hex(3)
    net = Net(lender=f"shoal-bench-{tag}-a", server=f"shoal-bench-{tag}-b",
              addr=f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.1",
              veths=(f"sb{tag}a", f"sb{tag}b"))
    try:
        failed = make(net)
        if failed:
            remove(net)
            yield Net(note=f"cannot make them: {failed}")
            return
        net.method = "netem" if set_delay(net, 0.0, probe=True) else "relay"
        net.home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        enter(str(net.server))
        yield net
    finally:
        remove(net)


def make(net: Net) -> str:
    """Make ``net``'s namespaces and veth pair; what went wrong ("" when nothing)."""
    assert net.lender is not None and net.server is not None
    b_addr = net.addr.rsplit(".", 1)[0] + ".2"
    try:
        for ns in (net.lender, net.server):
            _must("netns", "add", ns)
            net.made.append(ns)
        _must("link", "add", net.veths[0], "netns", net.lender, "type", "veth",
              "peer", "name", net.veths[1], "netns", net.server)
        for ns, dev, addr in ((net.lender, net.veths[0], net.addr),
                              (net.server, net.veths[1], b_addr)):
            _must("-n", ns, "link", "set", "lo", "up")
            _must("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _must("-n", ns, "link", "set", dev, "up")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return ""


def remove(net: Net) -> None:
    if net.home_fd is not None:
        _setns(net.home_fd)
        os.close(net.home_fd)
        net.home_fd = None
    for ns in net.made:  # deleting a namespace removes its end of the veth, so the pair
        _ip("netns", "del", ns)
    net.made.clear()


def set_delay(net: Net, ms: float, *, probe: bool = False) -> bool:
    """``tc netem`` delay ``ms`` on both ends of the veth (none at 0); whether it took."""
    ok = True
    for ns, dev in ((net.lender, net.veths[0]), (net.server, net.veths[1])):
        if ns is None:
            return False
        if ms or probe:
            cmd = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                   f"{ms}ms", "limit", "100000"]  # the default 1000 packets drop at speed
        else:
            cmd = ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        ok = ok and (done.returncode == 0 or not (ms or probe))
        if not ok:
            return False
    if probe:
        set_delay(net, 0.0)
    return ok


def in_netns(ns: str | None, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own in namespace ``ns`` (here when None)."""
    if ns is None:
        return fn()

    def there() -> T:
        enter(ns)
        return fn()

    with ThreadPoolExecutor(1) as pool:  # the thread ends with the pool: A ends with it
        return pool.submit(there).result(timeout=SOCKET_S)


# -- the processes -----------------------------------------------------------------------


@dataclass
class Side:
    name: str
    port: int
    model: str


class Bench:
    def __init__(self, args: argparse.Namespace, net: Net) -> None:
        self.args = args
        self.net = net
        self.work = Path(tempfile.mkdtemp(prefix="shoal-bench-split-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}
        token = self.home("token-maker")
        subprocess.run([*SHOAL, "fleet", "token"], env=self.env_of(token), check=True,
                       capture_output=True, timeout=60, cwd=ROOT)
        self.token = token / "fleet" / "token"

    def home(self, name: str) -> Path:
        home = self.work / name
        (home / "fleet").mkdir(parents=True, exist_ok=True)
        if hasattr(self, "token"):
            shutil.copyfile(self.token, home / "fleet" / "token")
            (home / "fleet" / "token").chmod(0o600)
        (home / "config.toml").write_text('[node]\ngpu = "off"\n')
        return home

    def env_of(self, home: Path, **extra: str) -> dict[str, str]:
        return {**self.env, "SHOAL_HOME": str(home), **extra}

    def start(self, cmd: list[str], env: dict[str, str], ready: str, log: str, *,
              lender: bool = False) -> tuple[subprocess.Popen[bytes], re.Match[str], str]:
        """Start ``cmd`` (in A when ``lender``); wait for the line ``ready`` matches in its
        output (logged). Its stdin is a pipe that stays open while it should run."""
        path = self.work / f"{log}.log"
        proc = subprocess.Popen(self.net.in_lender(cmd) if lender else cmd, env=env, cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=path.open("wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + READY_S
        pattern = re.compile(ready)
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace")
            found = pattern.search(text)
            if found:
                return proc, found, text
            if proc.poll() is not None:
                raise SystemExit(f"{log} ended before it was ready:\n{text[-2000:]}")
            time.sleep(0.1)
        raise SystemExit(f"{log} was not ready in {READY_S:.0f} s")

    def stop(self, procs: list[subprocess.Popen[bytes]] | None = None) -> None:
        """End ``procs`` (all this run started when None), by their pids."""
        chosen = list(self.procs if procs is None else procs)
        for proc in reversed(chosen):
            if proc.poll() is None:
                proc.terminate()
        for proc in chosen:
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_S)
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            self.procs.remove(proc)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def free_port(ns: str | None, host: str) -> int:
    def pick() -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])

    return in_netns(ns, pick)


def link_address(text: str, host: str) -> str:
    found = re.search(rf" on ({re.escape(host)}:\d+) \(link", text)
    if found is None:
        raise SystemExit(f"no link address in:\n{text[-2000:]}")
    return found.group(1)


def relays(bench: Bench, delay_ms: float, targets: dict[str, str], log: str) -> dict[str, str]:
    """A ``_relay`` helper in A: for each name, a listener on A's address that forwards
    to its target (``echo``: answers back) with ``delay_ms`` each way; name: address."""
    specs = [f"{bench.net.addr}:0={target}" for target in targets.values()]
    _, _, text = bench.start([*HELPER, "_relay", str(delay_ms), *specs], bench.env,
                             r"relays ready", log, lender=True)
    bound = re.findall(r"relay \S+=(\S+) on (\S+)", text)
    return {name: bound[i][1] for i, name in enumerate(targets)}


def ping(address: str) -> float:
    """Median ms of a byte's round trip to the echo at ``address``."""
    host, _, port = address.rpartition(":")
    times = []
    with socket.create_connection((host, int(port)), timeout=SOCKET_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(PINGS):
            t0 = time.perf_counter()
            s.sendall(b"x")
            if not s.recv(1):
                break
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times) if times else 0.0


# -- the sides ---------------------------------------------------------------------------


SERVE_ARGS = ["--gpu", "off", "--max-batch", "4", "--max-context", "1024", "--discovery",
              "none", "--http", "127.0.0.1:0"]
AT = r"at http://127\.0\.0\.1:(\d+)/v1"


def whole_side(bench: Bench, model: Path) -> Side:
    _, found, _ = bench.start([*SHOAL, "serve", str(model), *SERVE_ARGS],
                              bench.env_of(bench.home("whole"), SHOAL_LLAMA_REPACK="0"),
                              AT, "whole")
    return Side(WHOLE, int(found.group(1)), model.stem)


@dataclass
class Group:
    """The split sides at one added latency, the processes they run on, and the round
    trip measured across the veth (with the delay) in ms."""

    delay_ms: float
    split: Side
    rpc: Side
    layers: int
    rtt_ms: float
    procs: list[subprocess.Popen[bytes]]


def split_sides(bench: Bench, model: Path, delay_ms: float) -> Group:
    """Shoal's split and llama-server over llama.cpp's RPC, ``delay_ms`` added each way."""
    net, tag = bench.net, f"{delay_ms:g}ms"
    before = list(bench.procs)
    _, found, _ = bench.start(
        [*SHOAL, "node", "--runtime", "mock", "--model", "mock-a", "--lend", "--discovery",
         "none", "--memory-budget", bench.args.lend, "--listen", f"{net.addr}:0"],
        bench.env_of(bench.home(f"lender-{tag}")), rf" on {re.escape(net.addr)}:\d+ \(link",
        f"lender-{tag}", lender=True)
    node = link_address(found.string, net.addr)
    rpc_at = f"{net.addr}:{free_port(net.lender, net.addr)}"
    threads = str(len(os.sched_getaffinity(0)))
    bench.start([*HELPER, "_rpc", rpc_at, str(bench.work / f"rpc-cache-{tag}"), threads], bench.env,
                r"transport", f"rpc-server-{tag}", lender=True)
    user_space = delay_ms > 0 and net.method == "relay"
    targets = {"echo": "echo", **({"node": node, "rpc": rpc_at} if user_space else {})}
    via = relays(bench, delay_ms if user_space else 0.0, targets, f"relay-{tag}")
    if net.method == "netem":
        set_delay(net, delay_ms)
    rtt = ping(via["echo"])
    _, _, text = bench.start(
        [*SHOAL, "serve", str(model), "--split-with", via.get("node", node), *SERVE_ARGS],
        bench.env_of(bench.home(f"split-{tag}")), AT, f"split-{tag}")
    layers = re.search(r"lends: (\d+) of (\d+) layers", text)
    if layers is None:
        raise SystemExit(f"the split's log names no layers:\n{text[-2000:]}")
    split = Side(SPLIT, int(re.findall(AT, text)[0]), model.stem)
    rpc = llama_rpc_side(bench, model, int(layers.group(1)), via.get("rpc", rpc_at), tag)
    return Group(delay_ms, split, rpc, int(layers.group(1)), rtt,
                 [p for p in bench.procs if p not in before])


def llama_rpc_side(bench: Bench, model: Path, layers: int, rpc_at: str, tag: str) -> Side:
    """llama-server with llama.cpp's RPC module beside it, against the server at
    ``rpc_at``."""
    binary = server_binary(bench.args)
    folder = bench.work / "llama-server"
    if not folder.exists():
        shutil.copytree(binary.parent, folder)
        from engine.runtimes.rpc import rpc_library

        lib = rpc_library()
        if lib is None:
            raise SystemExit("no libggml-rpc.so: run scripts/lib/rpc_backend.py --install")
        shutil.copy2(lib, folder / lib.name)
    port = free_port(None, "127.0.0.1")
    bench.start(
        # the same placement as Shoal's: K layers there, the output layer here
        [str(folder / binary.name), "-m", str(model), "--rpc", rpc_at, "-ngl", str(layers + 1),
         "-ot", "^(output|token_embd)=CPU",
         "-np", "4", "-c", "4096", "-t", str(len(os.sched_getaffinity(0))), "--no-repack",
         "--host", "127.0.0.1", "--port", str(port)], bench.env, r"listening on http://",
        f"llama-server-{tag}")
    return Side(RPC, port, model.stem)


# -- measures ------------------------------------------------------------------------------


def complete(side: Side, tokens: int) -> tuple[float, int, str]:
    """One streamed greedy completion: (seconds to its first text, tokens, text)."""
    conn = http.client.HTTPConnection("127.0.0.1", side.port, timeout=300)
    body = json.dumps({"model": side.model, "prompt": PROMPT, "max_tokens": tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    first, text, count = 0.0, "", 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        piece = json.loads(line[6:])["choices"][0].get("text", "")
        if piece and not first:
            first = time.perf_counter() - t0
        text += piece
        count += 1 if piece else 0
    conn.close()
    return first, count, text


def measure(sides: list[Side], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {s.name: {"ttft": [], "tps1": [], "tps4": []}
                                      for s in sides}
    for side in sides:  # warm-up: the RPC server's tensors, the first graphs
        complete(side, 4)
    for r in range(args.rounds):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        for side in order:
            t0 = time.perf_counter()
            first, _count, text = complete(side, args.tokens)
            out[side.name]["ttft"].append(first)
            out[side.name]["tps1"].append(args.tokens / (time.perf_counter() - t0))
            out[side.name].setdefault("text", text)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(complete, [side] * 4, [args.tokens] * 4))
            out[side.name]["tps4"].append(4 * args.tokens / (time.perf_counter() - t0))
    return out


def copy_rates(bench: Bench, model: Path) -> tuple[float, float]:
    """(MB/s taken in B from a machine of the fleet in A, MB/s of a plain TCP copy)."""
    from engine.models.pulls.pull import pull_files
    from engine.node.files import FleetPeers

    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    desk = bench.home("desk")
    repo = desk / "models" / "hub" / "models--bench--Model-GGUF"
    (repo / "blobs").mkdir(parents=True)
    shutil.copyfile(model, repo / "blobs" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    snap = repo / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (snap / "model-Q4_K_M.gguf").symlink_to(os.path.relpath(repo / "blobs" / sha, snap))
    addr = bench.net.addr
    _, found, _ = bench.start([*SHOAL, "node", "--runtime", "mock", "--model", "mock-a",
                               "--discovery", "none", "--listen", f"{addr}:0"],
                              bench.env_of(desk), rf" on {re.escape(addr)}:\d+ \(link", "desk",
                              lender=True)
    node = link_address(found.string, addr)
    peers = FleetPeers(lambda: [node], lambda: bytes.fromhex(bench.token.read_text().strip()))
    size = model.stat().st_size
    fleet: list[float] = []
    plain: list[float] = []
    for r in range(max(bench.args.rounds // 2, 1)):
        home = bench.home(f"taker-{r}")
        cache = home / "models" / "hub"
        t0 = time.perf_counter()
        offer = peers.offer("bench/Model-GGUF", "Q4_K_M", lambda: False)
        if offer is None:
            raise SystemExit("the desk offered no files")
        pull_files(offer.wanted, home=home, cache=cache, what="bench", source=offer.source)
        fleet.append(size / (time.perf_counter() - t0) / 1e6)
        plain.append(size / plain_copy(bench.net, model, home / "plain.gguf") / 1e6)
    return statistics.median(fleet), statistics.median(plain)


def plain_copy(net: Net, src: Path, dst: Path) -> float:
    """Seconds to send ``src`` from A (a thread there) over TCP into ``dst`` here (B)."""
    ports: queue.Queue[int | BaseException] = queue.Queue()

    def send() -> None:
        try:
            if net.lender:
                enter(net.lender)
            server = socket.create_server((net.addr, 0))
        except OSError as exc:
            ports.put(exc)
            return
        with server:
            server.settimeout(SOCKET_S)
            ports.put(int(server.getsockname()[1]))
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.settimeout(SOCKET_S)
                with conn, src.open("rb") as f:
                    conn.sendfile(f)

    sender = threading.Thread(target=send, daemon=True)  # it leaves A with the thread
    t0 = time.perf_counter()
    sender.start()
    port = ports.get(timeout=SOCKET_S)
    if isinstance(port, BaseException):
        raise SystemExit(f"the plain copy's sender: {port}")
    with socket.create_connection((net.addr, port), timeout=SOCKET_S) as c, \
            dst.open("wb") as out:
        while data := c.recv(1 << 20):
            out.write(data)
    sender.join(SOCKET_S)
    return time.perf_counter() - t0


# -- report ------------------------------------------------------------------------------


@dataclass
class Run:
    """What a run measured: per delay (ms) its split sides' figures, the whole side's,
    the layers lent, the round trips, the copy's rates."""

    net: Net
    layers: int
    whole: dict[str, Any]
    split: dict[float, dict[str, Any]]
    rpc: dict[float, dict[str, Any]]
    rtt: dict[float, float]
    copy: tuple[float, float]


def med(m: dict[str, Any]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in m.items() if k != "text"}


def report(args: argparse.Namespace, model: Path, run: Run) -> tuple[str, dict[str, Any]]:
    word = {True: "PASS", False: "MISS"}
    delays = list(run.split)
    whole = med(run.whole)
    rows = [f"| — | — | {WHOLE} | {whole['ttft'] * 1000:,.0f} | {whole['tps1']:,.1f} | "
            f"{whole['tps4']:,.1f} |"]
    verdicts, ratios, checks = [], {}, {}
    for d in delays:
        s, r = med(run.split[d]), med(run.rpc[d])
        for name, m in ((SPLIT, s), (RPC, r)):
            rows.append(f"| {d:g} | {run.rtt[d]:.2f} | {name} | {m['ttft'] * 1000:,.0f} | "
                        f"{m['tps1']:,.1f} | {m['tps4']:,.1f} |")
        ratio = {k: s[k] / r[k] if r[k] else 0.0 for k in ("tps1", "tps4", "ttft")}
        ok = {"tps1": ratio["tps1"] >= TARGET_TPS, "tps4": ratio["tps4"] >= TARGET_TPS,
              "ttft": ratio["ttft"] <= TARGET_TTFT}
        ratios[d], checks[d] = ratio, ok
        verdicts.append(f"| {d:g} | {ratio['tps1']:.2f}x {word[ok['tps1']]} | "
                        f"{ratio['tps4']:.2f}x {word[ok['tps4']]} | "
                        f"{ratio['ttft']:.2f}x {word[ok['ttft']]} |")
    same = all(run.whole["text"] == run.split[d]["text"] for d in delays)
    same_rpc = all(run.split[d]["text"] == run.rpc[d]["text"] for d in delays)
    copy_ok = run.copy[0] >= TARGET_COPY * run.copy[1]
    size_mb = model.stat().st_size / 1e6
    lines = [
        HEADING, "",
        f"`scripts/bench/split.py` ({__doc__.splitlines()[0] if __doc__ else ''}), "
        f"{model.name}: {run.layers} of its layers on the lending machine in both split "
        f"sides. {args.rounds} rounds, {args.tokens} greedy tokens a completion, the sides "
        f"taking turns; {run.net.where()}. llama-server reaches llama.cpp's RPC server (the "
        "function its `rpc-server` runs) at the lending machine's address, with nothing "
        "between; Shoal's node keeps the same server on its 127.0.0.1 and carries it over "
        f"the link. Added latency: {run.net.latency()}; the whole model runs once, with "
        "none. Reproduce: `.venv/bin/python scripts/bench/split.py "
        f"--rounds {args.rounds} --tokens {args.tokens} "
        f"--delays {','.join(f'{d:g}' for d in delays)}` (as root, for the namespaces).", "",
        "| added ms each way | round trip ms | side | first token ms | tokens/s, 1 stream | "
        "tokens/s, 4 streams |",
        "|--:|--:|:--|--:|--:|--:|", *rows, "",
        f"Shoal's split against llama.cpp's plain RPC (targets: tokens/s at least "
        f"{TARGET_TPS}x, first token at most {TARGET_TTFT}x):", "",
        "| added ms each way | tokens/s, 1 stream | tokens/s, 4 streams | first token |",
        "|--:|--:|--:|--:|", *verdicts, "",
        f"Shoal's split's greedy text {'is' if same else 'is not'} the same as the model's "
        f"whole, and {'is' if same_rpc else 'is not'} the same as llama-server's over RPC.",
        "",
        f"Copy of {model.name} ({size_mb:,.0f} MB) from the lending machine to the serving "
        f"one, no added latency: from a machine of the fleet {run.copy[0]:,.0f} MB/s (the "
        f"link, written and sha256-checked as a pull does), a plain TCP copy "
        f"{run.copy[1]:,.0f} MB/s: {run.copy[0] / run.copy[1]:.2f}x "
        f"({word[copy_ok]}, target {TARGET_COPY}x).",
    ]

    def key(name: str, d: float) -> str:
        return f"{name}, +{d:g} ms"

    figures = {
        "net": "netns" if run.net.lender else "loopback", "latency_by": run.net.method,
        "ttft_ms": {WHOLE: whole["ttft"] * 1000,
                    **{key(n, d): med(g[d])["ttft"] * 1000
                       for d in delays for n, g in ((SPLIT, run.split), (RPC, run.rpc))}},
        "tps1": {WHOLE: whole["tps1"], **{key(n, d): med(g[d])["tps1"] for d in delays
                                          for n, g in ((SPLIT, run.split), (RPC, run.rpc))}},
        "tps4": {WHOLE: whole["tps4"], **{key(n, d): med(g[d])["tps4"] for d in delays
                                          for n, g in ((SPLIT, run.split), (RPC, run.rpc))}},
        "rtt_ms": {f"{d:g}": run.rtt[d] for d in delays}, "layers": run.layers,
        "ratios": {f"{d:g}": ratios[d] for d in delays},
        "same_text": same, "same_as_llama_rpc": same_rpc, "copy_mb_s": list(run.copy)}
    if not args.smoke:
        lines += ["", plot(args, run)]
    return "\n".join(lines) + "\n", figures


def plot(args: argparse.Namespace, run: Run) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delays = list(run.split)
    whole = med(run.whole)
    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(8.4, 3.2))
    for name, got, color in ((SPLIT, run.split, "tab:blue"), (RPC, run.rpc, "tab:orange")):
        for k, label, style in (("tps1", "1 stream", "o--"), ("tps4", "4 streams", "s-")):
            tps.plot(delays, [med(got[d])[k] for d in delays], style, color=color,
                     label=f"{name}, {label}")
        ttft.plot(delays, [med(got[d])["ttft"] * 1000 for d in delays], "o-", color=color,
                  label=name)
    for k, label in (("tps1", "whole, 1 stream"), ("tps4", "whole, 4 streams")):
        tps.axhline(whole[k], color="grey", linestyle=":", linewidth=1)
        tps.annotate(label, (delays[0], whole[k]), fontsize=6, color="grey")
    ttft.axhline(whole["ttft"] * 1000, color="grey", linestyle=":", linewidth=1)
    ttft.annotate("whole", (delays[0], whole["ttft"] * 1000), fontsize=6, color="grey")
    tps.set(xlabel="added ms each way", ylabel="tokens/s", xticks=delays)
    ttft.set(xlabel="added ms each way", ylabel="first token ms", xticks=delays)
    tps.legend(fontsize=6)
    ttft.legend(fontsize=6)
    fig.suptitle(f"a model split across two machines (latency by {run.net.method})",
                 fontsize=9)
    return save_plot(fig, args, "split: tokens/s and first token against added latency, "
                     "Shoal's split against llama.cpp's RPC")


# -- helpers run as processes in A -------------------------------------------------------


def _end_with_stdin() -> None:
    """A thread: the benchmark ended (even killed outright) when our stdin closes."""
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


RELAY_CHUNK = 1 << 16
RELAY_QUEUE = 1024  # chunks in flight a direction (64 MiB at most)
RELAY_LIFE_S = 6 * 3600.0  # the benchmark ends it long before


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay_s: float) -> None:
    """``reader``'s bytes to ``writer``, each chunk ``delay_s`` after it arrived: a task
    reads and stamps, this one writes each at its stamp (waits overlap, order kept)."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(RELAY_QUEUE)

    async def feed() -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(RELAY_CHUNK):
                await chunks.put((loop.time() + delay_s, data))
        await chunks.put((loop.time() + delay_s, b""))

    feeder = asyncio.create_task(feed())
    try:
        while True:
            due, data = await chunks.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass
    finally:
        feeder.cancel()


async def _forward(target: str, delay_s: float, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
    _nodelay(writer)
    if target == "echo":  # both ways' delays on the way back
        try:
            await _pump(reader, writer, 2 * delay_s)
        finally:
            writer.close()
        return
    try:
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*_host_port(target)),
                                            SOCKET_S)
    except (OSError, TimeoutError):
        writer.close()
        return
    _nodelay(up_w)
    try:
        await asyncio.gather(_pump(reader, up_w, delay_s), _pump(up_r, writer, delay_s))
    finally:
        up_w.close()
        writer.close()


async def _relays(delay_s: float, specs: list[str]) -> None:
    servers = []
    for spec in specs:
        listen, _, target = spec.partition("=")
        server = await asyncio.start_server(functools.partial(_forward, target, delay_s),
                                            *_host_port(listen))
        host, port = server.sockets[0].getsockname()[:2]
        print(f"relay {listen}={target} on {host}:{port}", flush=True)
        servers.append(server)
    print(f"relays ready, {delay_s * 1000:g} ms each way", flush=True)
    await asyncio.sleep(RELAY_LIFE_S)


def relay_main(argv: list[str]) -> int:
    """``_relay DELAY_MS LISTEN=TARGET ...``: TCP relays, TARGET a HOST:PORT or ``echo``."""
    threading.Thread(target=_end_with_stdin, daemon=True).start()
    # select() waits to the microsecond; epoll rounds each wait up to a whole millisecond
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        loop.run_until_complete(_relays(float(argv[0]) / 1000, argv[1:]))
    finally:
        loop.close()
    return 0


def rpc_main(argv: list[str]) -> int:
    """``_rpc HOST:PORT CACHE THREADS``: llama.cpp's RPC server on this machine's CPU at
    HOST:PORT (any address: llama.cpp's plain RPC, as its ``rpc-server`` runs it)."""
    from engine.runtimes import rpc

    threading.Thread(target=_end_with_stdin, daemon=True).start()
    endpoint, cache_dir, threads = argv
    lib = rpc._load()
    devices = (ctypes.c_void_p * 1)(lib.g.ggml_backend_dev_by_type(0))  # the CPU
    lib.start_server(endpoint.encode(), cache_dir.encode(), max(int(threads), 1), 1,
                     ctypes.cast(devices, ctypes.c_void_p))
    return 1  # it returns only when it could not serve


# -- main --------------------------------------------------------------------------------


def delays_of(text: str) -> list[float]:
    try:
        out = sorted({float(d) for d in text.split(",") if d.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ms,ms,...") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError("give one or more delays of 0 ms or more")
    return out


def bench_run(args: argparse.Namespace, net: Net) -> Run:
    bench = Bench(args, net)
    try:
        whole_side_ = whole_side(bench, args.model)
        whole: dict[str, Any] = {}
        split: dict[float, dict[str, Any]] = {}
        rpc: dict[float, dict[str, Any]] = {}
        rtt: dict[float, float] = {}
        layers = 0
        for i, d in enumerate(args.delays):
            try:
                group = split_sides(bench, args.model, d)
                print(f"+{d:g} ms each way: round trip {group.rtt_ms:.2f} ms, "
                      f"{group.layers} layers lent", flush=True)
                sides = [group.split, group.rpc] + ([whole_side_] if i == 0 else [])
                got = measure(sides, args)
            finally:
                if net.method == "netem":
                    set_delay(net, 0.0)
            if i == 0:
                whole = got[WHOLE]
                bench.stop([p for p in bench.procs if p not in group.procs])  # the whole's
            layers = layers or group.layers
            if group.layers != layers:
                raise SystemExit(f"the split lent {group.layers} layers at +{d:g} ms, "
                                 f"{layers} before")
            split[d], rpc[d], rtt[d] = got[SPLIT], got[RPC], group.rtt_ms
            bench.stop(group.procs)
        copy = copy_rates(bench, args.model)
    finally:
        bench.close()
    return Run(net, layers, whole, split, rpc, rtt, copy)


def main() -> None:
    helpers = {"_relay": relay_main, "_rpc": rpc_main}
    if len(sys.argv) > 1 and sys.argv[1] in helpers:
        sys.exit(helpers[sys.argv[1]](sys.argv[2:]))
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--delays", type=delays_of, default=[0.0, 2.0, 5.0],
                    help="added latency each way, ms,ms,... (default 0,2,5)")
    ap.add_argument("--lend", default="400M", help="the lending machine's memory budget")
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "split.png")
    ap.add_argument("--smoke", action="store_true", help="seconds, figures checked, no docs")
    args = ap.parse_args()
    if args.smoke:  # one delay: the first above 0 (the latency's path runs), else 0
        args.rounds, args.tokens = 1, 8
        args.delays = [next((d for d in args.delays if d > 0), args.delays[0])]
        scratch = smoke_mode.scratch("split")
        args.out, args.plot = scratch / "benchmarks.md", scratch / "split.png"
    if args.model is None:
        from engine.models.embedded import ensure_test_gemma

        args.model = ensure_test_gemma(Path(tempfile.gettempdir()) / "shoal-test-models" / "home")
    with two_machines() as net:
        print(f"machines: {net.where()}; added latency: {net.latency()}", flush=True)
        run = bench_run(args, net)
    section, figures = report(args, args.model, run)
    if args.smoke:
        smoke_mode.verdict(figures, {
            "every side answered": all(v > 0 for v in figures["tps1"].values()),
            "some layers went to the lender": run.layers > 0,
            "the copies moved bytes": min(run.copy) > 0})
        return
    replace_section(args.out, HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
