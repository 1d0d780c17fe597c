"""A hundred mock nodes behind one head (then three): relayed tokens/s, the head's CPU,
added latency per token, placement time, memory per node and lost tokens.

The fleet, all on this machine and on 127.0.0.1:
  * ``--nodes`` mock nodes (default 100) of ``--lanes`` lanes (default 8), grouped into
    ``--groups`` processes; each node is a NodeAgent with its own listener, identity and
    engine, so each head links to each node on its own connections (one per lane);
  * ``--heads`` head processes (``shoal serve --runtime mock --fleet <every node>``);
  * ``--clients`` client processes holding ``--streams`` concurrent streams in all
    (default 800), each stream paced by the mock at ``--speed`` tokens/s (default 20),
    spread over the heads. A slot whose stream ends (the mock's EOS) starts another,
    with a new seed, until ``--duration`` seconds have passed; every stream asks for
    the tokens that fit before the end, so all end together and nothing is cut.

Added latency per token: the time the token reached the client minus the time the
node's engine produced it. Both are CLOCK_MONOTONIC (``time.monotonic``), which every
process on one machine shares: each node process gives its agents an observer (the
engine's public ``NodeObserver`` hook) that stamps every batch as the agent hands it to
the link (seed, index, count, time) in a side table, written out at the end; the client
stamps every piece it reads. A token's latency is thus the link,
the head and the HTTP write, plus the time the client process took to read it (its
own CPU is reported, since it shares the 2 cores).

Lost or duplicated tokens: the mock is a pure function of seed and context
(``engine.runtimes.mock.next_token``), so every stream's expected text is computed
here and compared with what the client received.

Run: .venv/bin/python scripts/bench/fleet_scale.py [--heads 1] [--streams 800]
     [--duration 30] [--engine-root PATH] [--json runs.jsonl --label after-800-h1]
     [--profile out.txt]   (py-spy on the head: pip install py-spy, not a dependency)
then: .venv/bin/python scripts/bench/fleet_scale.py summary runs.jsonl [--plot out.png]
Smoke (seconds; checks that streams complete, none lost, latencies measured; writes
nothing): .venv/bin/python scripts/bench/fleet_scale.py --smoke
``--engine-root`` runs the nodes and heads from another checkout (a worktree of
main, for a before/after comparison); the client and the analysis are this file's.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import marshal
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.link import messages as m

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TEXT = "<|im_start|>user\nbench<|im_end|>\n<|im_start|>assistant\n"
PROMPT_MARGIN = 64


# -- schedstat -------------------------------------------------------------------------


def cpu_s(pid: int, field: int = 0) -> float:
    """CPU seconds the process's threads have run (Linux schedstat, ns resolution); with
    ``field=1``, the seconds they were ready to run but waited for a core."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += int((task / "schedstat").read_text().split()[field])
    return total / 1e9


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- node group (a child process) -----------------------------------------------------------


class Stamps:
    """A NodeObserver (engine/node/agent.py) that stamps every Tokens record as the agent
    hands it to the link: (seed, index, count, time), kept in arrays, no object per
    token (the nodes share the cores with the head they are measured through)."""

    def __init__(self) -> None:
        self.arrays = (array.array("q"), array.array("l"), array.array("l"),
                       array.array("d"))

    def admitted(self, gen: m.Generate) -> None:
        return None

    def tokens(self, gen: m.Generate, record: m.Tokens) -> None:
        seeds, index, count, at = self.arrays
        seeds.append(gen.sampling.seed or 0)
        index.append(record.index)
        count.append(len(record.ids))
        at.append(time.monotonic())


def node_group(args: argparse.Namespace) -> None:
    import inspect

    from engine.credentials.tokens import read_token
    from engine.node.agent import NodeAgent
    from engine.runtimes.mock import MockEngine

    if "observer" not in inspect.signature(NodeAgent).parameters:
        raise SystemExit("this engine's NodeAgent takes no observer (it is older than the "
                         "hook that stamps its tokens); run --engine-root on a checkout that "
                         "has it")
    psk = read_token(Path(args.token))
    stamps = Stamps()

    async def run() -> None:
        agents = []
        ports = []
        for i in range(args.count):
            engine = MockEngine(model="bench", lanes=args.lanes,
                                context_window=args.window, speed=args.speed)
            agent = NodeAgent(engine, identity=f"n{args.first + i:03d}", psk=psk,
                              observer=stamps)
            _, port = await agent.listen("127.0.0.1", 0)
            agents.append(agent)
            ports.append(port)
        print("PORTS " + ",".join(map(str, ports)), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.max_life):
                await stop.wait()
        for agent in agents:
            await agent.close()

    asyncio.run(run())
    with open(args.stamps, "wb") as f:
        marshal.dump([a.tobytes() for a in stamps.arrays], f)


# -- client (a child process) ---------------------------------------------------------


class SSEStream(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection reading chunked SSE, as cheaply as Python can:
    no JSON parse unless the text holds an escape; every piece read is stamped once."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = "idle"
        self.chunk_left = 0
        self.body = bytearray()
        self.done: asyncio.Future[None] | None = None
        self.text: list[str] = []
        self.arrivals: list[tuple[float, int]] = []
        self.status = 0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def start(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.buf.clear()
        self.body.clear()
        self.text = []
        self.arrivals = []
        self.state = "head"
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.buf += data
        while True:
            if self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end])
                del self.buf[:end + 4]
                self.status = int(head.split(b" ", 2)[1])
                if b"chunked" not in head.lower():
                    self._finish(ConnectionError(f"status {self.status}: {head[:200]!r}"))
                    return
                self.state = "size"
            elif self.state == "size":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                self.chunk_left = int(bytes(self.buf[:end]).split(b";")[0], 16)
                del self.buf[:end + 2]
                self.state = "data" if self.chunk_left else "trailer"
            elif self.state == "data":
                if len(self.buf) < self.chunk_left + 2:
                    return
                self.body += self.buf[:self.chunk_left]
                del self.buf[:self.chunk_left + 2]
                self.state = "size"
                self._events(now)
            elif self.state == "trailer":
                if len(self.buf) < 2:
                    return
                del self.buf[:2]
                self._finish(None)
                return
            else:
                return

    def _events(self, now: float) -> None:
        body = self.body
        got = 0
        while True:
            end = body.find(b"\n\n")
            if end < 0:
                break
            event = bytes(body[:end])
            del body[:end + 2]
            at = event.find(b'"content":"')
            if at < 0:
                continue
            start = at + 11
            stop = event.find(b'"', start)
            piece = event[start:stop]
            if b"\\" in piece:  # an escape: let json read it
                text = json.loads(event[6:])["choices"][0]["delta"]["content"]
            else:
                text = piece.decode()
            if text:
                self.text.append(text)
                got += len(text)  # the mock's tokens are one ASCII character each
        if got:
            self.arrivals.append((now, got))

    def _finish(self, exc: Exception | None) -> None:
        self.state = "idle"
        if self.done is not None and not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


def client(args: argparse.Namespace) -> None:
    ports = [int(p) for p in args.ports.split(",")]
    results: list[tuple[Any, ...]] = []
    failures: list[str] = []
    end_at = args.start_at + args.duration

    async def slot(k: int) -> None:
        port = ports[k % len(ports)]
        rng = random.Random(args.client * 1_000_003 + k)
        await asyncio.sleep(max(0.0, args.start_at - time.monotonic())
                            + rng.random() * args.ramp)
        loop = asyncio.get_running_loop()
        proto: SSEStream | None = None
        n = 0
        while n < 10_000:  # bounded: a slot runs at most this many streams
            left = end_at - time.monotonic()
            want = int(left * args.speed)
            if want < args.speed:  # less than a second left: start no stream
                return
            if proto is None or proto.lost:
                _, proto = await loop.create_connection(SSEStream, "127.0.0.1", port)
            seed = (args.client * 100_000 + k) * 1000 + n
            n += 1
            body = json.dumps({"model": "bench", "stream": True, "max_tokens": want,
                               "seed": seed,
                               "messages": [{"role": "user", "content": "bench"}]}).encode()
            request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                       "\r\n").encode() + body
            sent = time.monotonic()
            try:
                async with asyncio.timeout(left + 30):
                    await proto.start(request)
            except (ConnectionError, TimeoutError) as exc:
                failures.append(f"seed {seed}: {exc}")
                if proto.transport is not None:
                    proto.transport.close()
                proto = None
                continue
            results.append((seed, port, want, sent, "".join(proto.text),
                            [t for t, _ in proto.arrivals], [c for _, c in proto.arrivals]))
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    async def run() -> None:
        slots = [asyncio.create_task(slot(k)) for k in range(args.slots)]
        async with asyncio.timeout(args.duration + args.ramp + 120):
            await asyncio.gather(*slots)

    asyncio.run(run())
    with open(args.out, "wb") as f:
        marshal.dump({"results": results, "failures": failures,
                      "cpu": cpu_s(os.getpid())}, f)


# -- the orchestrator -------------------------------------------------------------------


def _spawn(cmd: list[str], env: dict[str, str], pattern: str, cwd: Path
           ) -> tuple[subprocess.Popen[str], re.Match[str]]:
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        m = re.search(pattern, line)
        if m:
            return proc, m
    proc.kill()
    raise SystemExit(f"could not start {cmd}")


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from head_overhead import stop_all as stop_each  # SIGTERM, then SIGKILL after 10 s

    stop_each(procs)


def metrics_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sockets(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            n += os.readlink(fd).startswith("socket:")
    return n


def wait_linked(pid: int, port: int, nodes: int, lanes: int, timeout_s: float) -> float:
    """Seconds until the head reports ``lanes`` lanes ready and holds a socket per node
    (a node is ready once every lane has its connection or channel; one link per node,
    or, with an engine from before channels, one per lane)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(OSError):
            if metric(metrics_text(port), "shoal_lanes") >= lanes and sockets(pid) >= nodes:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit(f"the head on {port} did not link {lanes} lanes in {timeout_s:.0f} s")


def start_head(py: str, env: dict[str, str], root: Path, fleet: str, token: Path
               ) -> tuple[subprocess.Popen[str], int]:
    proc, m = _spawn([py, "-m", "engine.cli", "serve", "bench", "--runtime", "mock",
                      "--http", "127.0.0.1:0", "--fleet", fleet, "--fleet-auth", str(token),
                      "--discovery", "none", "--queue-timeout", "60"],
                     env, r"at http://127\.0\.0\.1:(\d+)/v1", root)
    return proc, int(m.group(1))


def expected_text(seed: int, want: int, window: int) -> str:
    from engine.runtimes.mock import EOS, MockTokenizer, next_token

    ctx = MockTokenizer().encode(PROMPT_TEXT)
    out = []
    while len(out) < want and len(ctx) < window:
        tok = next_token(seed, ctx)
        if tok == EOS:
            break
        ctx.append(tok)
        out.append(chr(tok))
    return "".join(out)


def lost_and_duplicated(got: str, want: str) -> tuple[int, int]:
    if got == want:
        return 0, 0
    import difflib

    lost = dup = 0
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, want, got, autojunk=False
                                                      ).get_opcodes():
        if op in ("delete", "replace"):
            lost += a1 - a0
        if op in ("insert", "replace"):
            dup += b1 - b0
    return lost, dup


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.engine_root).resolve() if args.engine_root else ROOT
    py = sys.executable
    home = Path(tempfile.mkdtemp(prefix="shoal-scale-"))
    # FLEET_SCALE_EXTRA_PATH (":/some/dir"): more of the fleet's PYTHONPATH, for a probe
    # such as a sitecustomize.py that counts garbage collections in the heads
    env = {**os.environ, "SHOAL_HOME": str(home),
           "PYTHONPATH": str(root) + os.environ.get("FLEET_SCALE_EXTRA_PATH", "")}
    sys.path.insert(0, str(ROOT))
    from engine.credentials.tokens import ensure_token, token_path

    token = token_path(home)
    ensure_token(token)
    window = int(args.duration * args.speed) + PROMPT_MARGIN + 64
    procs: list[subprocess.Popen[str]] = []
    out: dict[str, Any] = {"heads": args.heads, "nodes": args.nodes, "lanes": args.lanes,
                           "nice_nodes": args.nice_nodes,
                           "streams": args.streams, "speed": args.speed,
                           "duration": args.duration, "clients": args.clients,
                           "engine_root": str(root), "load_start": os.getloadavg()}
    try:
        groups = []
        per = -(-args.nodes // args.groups)
        for g in range(args.groups):
            first = g * per
            count = min(per, args.nodes - first)
            if count <= 0:
                break
            stamps = home / f"stamps-{g}.bin"
            nice = ["nice", "-n", str(args.nice_nodes)] if args.nice_nodes else []
            proc, m = _spawn([*nice, py, str(Path(__file__).resolve()), "--engine-root",
                              str(root), "node-group", "--first", str(first), "--count", str(count),
                              "--lanes", str(args.lanes), "--window", str(window),
                              "--speed", str(args.speed), "--token", str(token),
                              "--stamps", str(stamps),
                              "--max-life", str(args.duration + 600)],
                             env, r"PORTS ([\d,]+)", root)
            procs.append(proc)
            groups.append((proc, stamps))
            out.setdefault("ports", []).extend(m.group(1).split(","))
        fleet = ",".join(f"127.0.0.1:{p}" for p in out.pop("ports"))
        # the head's memory with no node linked, for the memory per node
        bare, _ = start_head(py, env, root, "127.0.0.1:9", token)
        procs.append(bare)
        heads = []
        for _ in range(args.heads):
            heads.append(start_head(py, env, root, fleet, token))
            procs.append(heads[-1][0])
        link_s = [wait_linked(p.pid, port, args.nodes, args.nodes * args.lanes, 180)
                  for p, port in heads]
        out["link_s"] = link_s
        time.sleep(2.0)
        rss_bare = rss_kib(bare.pid)
        rss_linked = [rss_kib(p.pid) for p, _ in heads]
        stop_all_one(bare, procs)
        out["rss_bare_kib"] = rss_bare
        out["rss_linked_kib"] = rss_linked
        # warm each head's code paths (a few short streams)
        asyncio.run(_warm([port for _, port in heads]))
        start_at = time.monotonic() + 3.0
        slots = [args.streams // args.clients + (1 if c < args.streams % args.clients else 0)
                 for c in range(args.clients)]
        clients = []
        ports = ",".join(str(port) for _, port in heads)
        for c in range(args.clients):
            res = home / f"client-{c}.bin"
            proc = subprocess.Popen(
                [py, str(Path(__file__).resolve()), "--engine-root", str(ROOT), "client",
                 "--client", str(c), "--slots", str(slots[c]), "--ports", ports,
                 "--start-at", repr(start_at), "--duration", str(args.duration),
                 "--ramp", str(args.ramp), "--speed", str(args.speed), "--out", str(res)],
                env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(proc)
            clients.append((proc, res))
        w0 = start_at + args.ramp + args.settle
        w1 = start_at + args.duration - 1.0
        time.sleep(max(0.0, w0 - time.monotonic()))
        watched = {"head": [p.pid for p, _ in heads], "nodes": [p.pid for p, _ in groups],
                   "clients": [p.pid for p, _ in clients]}
        cpu0 = {k: sum(cpu_s(pid) for pid in v) for k, v in watched.items()}
        wait0 = sum(cpu_s(p.pid, 1) for p, _ in heads)
        load_mid = os.getloadavg()
        spy = None
        if args.profile:  # py-spy (pip install py-spy; not a dependency) on the first head
            spy = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "-p",
                 str(groups[0][0].pid if args.profile_node else heads[0][0].pid), "-d",
                 str(int(w1 - w0)), "-f", "raw", "-o", str(args.profile), "-r", "200",
                 "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(max(0.0, w1 - time.monotonic()))
        cpu1 = {k: sum(cpu_s(pid) for pid in v) for k, v in watched.items()}
        out["head_waited_cores"] = (sum(cpu_s(p.pid, 1) for p, _ in heads) - wait0) / (w1 - w0)
        if spy is not None:
            spy.wait(60)
        out["load_mid"] = load_mid
        out["rss_loaded_kib"] = [rss_kib(p.pid) for p, _ in heads]
        for proc, _ in clients:
            try:
                _, err = proc.communicate(timeout=args.duration + 180)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise SystemExit("a client did not finish in time") from None
            if proc.returncode:
                raise SystemExit(f"a client failed: {err[-2000:]}")
        texts = [metrics_text(port) for _, port in heads]
        out["placements"] = sum(metric(t, "shoal_placement_seconds_count") for t in texts)
        out["placement_s"] = sum(metric(t, "shoal_placement_seconds_sum") for t in texts)
        out["moves"] = sum(metric(t, "shoal_session_moves_total") for t in texts)
        for proc in [p for p, _ in heads]:
            stop_all_one(proc, procs)
        for proc, _ in groups:
            stop_all_one(proc, procs)
    finally:
        stop_all(procs)
    out["load_end"] = os.getloadavg()
    window_s = w1 - w0
    # production times per (seed, index)
    produced: dict[int, list[tuple[int, int, float]]] = {}
    for _, path in groups:
        with open(path, "rb") as f:
            raw = marshal.load(f)
        seeds, idx, cnt, ts = (array.array(code) for code in "qlld")
        for arr, data in zip((seeds, idx, cnt, ts), raw, strict=True):
            arr.frombytes(data)
        for s, i, c, t in zip(seeds, idx, cnt, ts, strict=True):
            produced.setdefault(s, []).append((i, c, t))
    results = []
    failures: list[str] = []
    client_cpu = 0.0
    for _, path in clients:
        with open(path, "rb") as f:
            data = marshal.load(f)
        results += data["results"]
        failures += data["failures"]
        client_cpu += data["cpu"]
    lat: list[float] = []
    in_window = 0
    lost = dup = 0
    for seed, _port, want, _sent, text, times, counts in results:
        exp = expected_text(seed, want, window)
        a, b = lost_and_duplicated(text, exp)
        lost += a
        dup += b
        made = sorted(produced.get(seed, []))
        # the production time of every token index
        prod: list[float] = []
        for i, c, t in made:
            if i == len(prod):
                prod += [t] * c
        j = 0
        for t, c in zip(times, counts, strict=True):
            for _ in range(c):
                if w0 <= t < w1:
                    in_window += 1
                    if j < len(prod):
                        lat.append((t - prod[j]) * 1000)
                j += 1
    lat.sort()
    shutil.rmtree(home, ignore_errors=True)  # the fleet token, the stamps, the clients' files
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    out.update({
        "streams_run": len(results), "failures": len(failures), "failure_sample": failures[:5],
        "lost": lost, "duplicated": dup, "window_s": window_s,
        "tokens_per_s": in_window / window_s,
        "head_cpu_s_per_1k": cpu["head"] / max(in_window, 1) * 1000,
        "head_cpu_cores": cpu["head"] / window_s,
        "node_cpu_cores": cpu["nodes"] / window_s,
        "client_cpu_cores": cpu["clients"] / window_s,
        "client_cpu_total_s": client_cpu,
        "added_ms_p50": lat[len(lat) // 2] if lat else float("nan"),
        "added_ms_p90": lat[int(len(lat) * 0.90)] if lat else float("nan"),
        "added_ms_p99": lat[int(len(lat) * 0.99)] if lat else float("nan"),
        "latency_samples": len(lat),
        "mem_per_node_kib": (statistics.mean(out["rss_linked_kib"]) - out["rss_bare_kib"])
        / args.nodes,
        "placement_us": (out["placement_s"] / out["placements"] * 1e6
                         if out.get("placements") else None),
        "placement_inproc_us": placement_inproc_us(args.nodes, args.lanes),
    })
    return out


def stop_all_one(proc: subprocess.Popen[str], procs: list[subprocess.Popen[str]]) -> None:
    stop_all([proc])
    with contextlib.suppress(ValueError):
        procs.remove(proc)


async def _warm(ports: list[int]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for port in ports:
            for i in range(4):
                body = {"model": "bench", "stream": True, "max_tokens": 8, "seed": -1 - i,
                        "messages": [{"role": "user", "content": "bench"}]}
                async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await r.read()


def placement_inproc_us(nodes: int, lanes: int) -> float:
    """The pure placement over ``nodes`` views of a half-busy fleet, in process."""
    from engine.head.fleet.placement import NodeView, PlacementRequest, place

    rng = random.Random(1)
    views = [NodeView(key=f"127.0.0.1:{40000 + i}", identity=f"n{i:03d}", model="bench",
                      context_window=4096, lanes=lanes, idle_conns=lanes,
                      own_sessions=rng.randrange(lanes), reported_busy=rng.randrange(lanes),
                      kv_used=1000, kv_total=4096 * lanes, prefill_tps=0.0,
                      decode_tps=20.0, full_until=0.0, ready=True) for i in range(nodes)]
    req = PlacementRequest(model="bench", prompt_tokens=20, max_tokens=600)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        place(req, views, now=1.0, policy="load-aware")
    return (time.perf_counter() - t0) / n * 1e6


def summarize(runs_file: Path) -> dict[str, dict[str, float]]:
    """Per label, the median over its runs of every figure (a label is one configuration
    and checkout, e.g. ``after-800-h1``; runs of a label alternate with the other's)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for line in runs_file.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            runs.setdefault(d["label"], []).append(d)
    out: dict[str, dict[str, float]] = {}
    for label, rows in runs.items():
        figs: dict[str, float] = {"runs": len(rows)}
        for key in ("tokens_per_s", "head_cpu_s_per_1k", "head_cpu_cores", "node_cpu_cores",
                    "client_cpu_cores", "added_ms_p50", "added_ms_p99", "mem_per_node_kib",
                    "placement_us", "placement_inproc_us", "lost", "duplicated", "moves",
                    "failures", "streams_run"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            if vals:
                figs[key] = statistics.median(vals)
        figs["lost_total"] = sum(r["lost"] + r["duplicated"] for r in rows)
        figs["load_min"] = min(r["load_mid"][0] for r in rows)
        figs["load_max"] = max(r["load_mid"][0] for r in rows)
        out[label] = figs
    return out


def plot(summary: dict[str, dict[str, float]], configs: list[tuple[str, str]],
         path: Path) -> None:
    """Before/after bars per configuration: relayed tokens/s, head CPU per token, median
    added latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = (("tokens_per_s", "relayed tokens/s", 1.0),
              ("head_cpu_s_per_1k", "head CPU us/token", 1000.0),
              ("added_ms_p50", "median added ms/token (log)", 1.0))
    width = 0.38
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        xs = range(len(configs))
        for k, side in enumerate(("before", "after")):
            vals = [summary.get(f"{side}-{c}", {}).get(key, float("nan")) * scale
                    for c, _ in configs]
            ax.bar([x + (k - 0.5) * width for x in xs], vals, width, label=side)
        ax.set_xticks(list(xs), [name.replace(" / ", "\n") for _, name in configs],
                      fontsize=7)
        ax.set_xlabel("streams", fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "added_ms_p50":
            ax.set_yscale("log")
            ax.axhline(2.0, color="grey", linestyle="--", linewidth=1)
        if key == "tokens_per_s":
            ax.axhline(16000, color="grey", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=8)
    fig.suptitle("100 mock nodes x 8 lanes behind Shoal heads, paced 20 tok/s per stream, "
                 "2 shared cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def smoke_verdict(figures: dict[str, Any]) -> None:
    from scripts.bench.smoke import verdict

    p50 = figures["added_ms_p50"]
    verdict({k: figures[k] for k in ("streams_run", "failures", "lost", "duplicated", "moves",
                                     "tokens_per_s", "latency_samples", "added_ms_p50",
                                     "head_cpu_s_per_1k")},
            {"streams ran": figures["streams_run"] > 0,
             "no stream failed": figures["failures"] == 0,
             "no token lost or duplicated": figures["lost"] == figures["duplicated"] == 0,
             "no session moved": figures["moves"] == 0,
             "tokens were relayed in the window": figures["tokens_per_s"] > 0,
             "the nodes' stamps matched the tokens received": figures["latency_samples"] > 0,
             "the added latency is a sane number of ms": 0 <= p50 < 1000,
             "the head's CPU per token was measured": figures["head_cpu_s_per_1k"] > 0})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-root", default="")
    sub = ap.add_subparsers(dest="mode")
    ng = sub.add_parser("node-group")
    for name, kind in (("--first", int), ("--count", int), ("--lanes", int),
                       ("--window", int), ("--speed", float), ("--token", str),
                       ("--stamps", str), ("--max-life", float)):
        ng.add_argument(name, type=kind, required=True)
    rp = sub.add_parser("summary", help="medians per label of a --json runs file")
    rp.add_argument("runs", type=Path)
    rp.add_argument("--plot", type=Path)
    rp.add_argument("--configs", default="400-h1:400 streams,800-h1:800 streams,"
                    "800-h3:800 streams 3 heads")
    cl = sub.add_parser("client")
    for name, kind in (("--client", int), ("--slots", int), ("--ports", str),
                       ("--start-at", float), ("--duration", float), ("--ramp", float),
                       ("--speed", float), ("--out", str)):
        cl.add_argument(name, type=kind, required=True)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="node processes")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=800)
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--speed", type=float, default=20.0, help="tokens/s per stream")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    ap.add_argument("--ramp", type=float, default=2.0, help="streams start over this long")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds after the ramp before the measured window")
    ap.add_argument("--nice-nodes", type=int, default=10,
                    help="niceness of the node processes: they stand in for other "
                    "machines, and would otherwise take the head's share of the cores")
    ap.add_argument("--json", type=Path, help="append the figures to this JSON lines file")
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", type=Path, help="py-spy the first head into this file")
    ap.add_argument("--profile-node", action="store_true",
                    help="profile the first node process instead")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny fleet for a few seconds (whatever the sizes given); check "
                    "its figures, exit 1 if they make no sense")
    args = ap.parse_args()
    if args.smoke and args.mode is None:
        args.nodes, args.lanes, args.groups, args.heads = 2, 2, 1, 1
        args.streams, args.clients, args.duration, args.ramp, args.settle = 4, 1, 5.0, 0.5, 0.5
        args.nice_nodes, args.json, args.profile = 0, None, None
    root = Path(args.engine_root).resolve() if args.engine_root else ROOT
    sys.path.insert(0, str(root))
    if args.mode == "node-group":
        node_group(args)
        return
    if args.mode == "client":
        client(args)
        return
    if args.mode == "summary":
        summary = summarize(args.runs)
        print(json.dumps(summary, indent=1))
        if args.plot:
            configs = [tuple(c.split(":", 1)) for c in args.configs.split(",")]
            plot(summary, configs, args.plot)  # type: ignore[arg-type]
        return
    figures = run(args)
    figures["label"] = args.label
    print(json.dumps(figures, indent=1, default=str))
    if args.smoke:
        smoke_verdict(figures)
        return
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(figures, default=str) + "\n")


if __name__ == "__main__":
    main()
