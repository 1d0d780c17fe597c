"""Models on demand (issue 32) against llama-server, side by side in one run.

Issue 32's benchmark has five parts; each is one function here, chosen with ``--parts``:

  * ``embeddings`` (built): inputs per second of ``POST /v1/embeddings`` for batches of
    1, 16 and 64 short texts, Shoal against llama-server ``--embeddings`` on the same
    model (all-MiniLM-L6-v2 as an F16 GGUF, made from its PyPI wheel by tests/minilm.py)
    and the same machine; target: ours at least 0.95x llama-server's at every batch size.
  * ``load``, ``interleaved``, ``memory``, ``estimate`` (waiting): the time to the first
    token of a kept, unloaded model, two loaded models interleaved, resident memory with
    two models loaded, and the speed estimate against measured tokens/s. They need a
    node that keeps several models, which nodes do not do yet; asking for one says so.

The embeddings part runs real processes as a user runs them, all on 127.0.0.1: ``shoal
node --runtime llamacpp --model GGUF --max-batch N`` and ``shoal serve GGUF --fleet
NODE`` (a SHOAL_HOME of their own in a temporary folder, with a fleet token made by
``shoal fleet token`` there), and ``llama-server --embeddings --pooling mean -t T -np N
-c 512*N -b 512 -ub 512`` (the ubatch holds the model's longest input, 512 tokens: a
non-causal model runs each input in one micro-batch). N is the largest batch, so that
llama-server has a slot for every input of a request; T is the CPUs this process may use,
which is what the node takes by itself. Both are loaded for the whole part and take turns,
never running at the same time (the idle side waits on a socket): per batch size a warm-up
request each, then ``--rounds`` rounds, alternating which side goes first, both sides
getting the same new texts in a round (varied sentences of 8-20 words, made
deterministically from a word list). A round's figure is the batch's inputs over the wall
time of its request (sent to the whole body read, with ``encoding_format: float``; the
client parses the JSON afterwards, outside the timing). The two sides' vectors for each
text must agree (cosine at least 0.99, both of length 1). Then, both idle, the resident
memory (VmRSS, and the peak VmHWM, from /proc) of the node, the head and llama-server.
Last, where the time goes on our side: the head's tokenizing of a batch and our embedder
(``LlamaCppEmbedder``, the node's engine) run in this process on the same batches, with
the same threads, nothing else running.

The report is the section "Models on demand (issue 32)" of docs/benchmarks.md (replaced
when it is there, else added at the end), naming the parts that ran, with a plot of
inputs/s per batch size (docs/models_on_demand.png).

Run: .venv/bin/python scripts/bench/models_on_demand.py [--parts embeddings] [--rounds 7]
     [--batches 1,16,64] [--model GGUF] [--cache ~/.cache/shoal-bench]
     [--llama-server PATH] [--out docs/benchmarks.md] [--plot docs/models_on_demand.png]
Smoke (seconds: batches of 1 and 4, 1 round, figures checked, the report and the plot to
a temp folder): .venv/bin/python scripts/bench/models_on_demand.py --smoke
Traffic goes only to 127.0.0.1; every loop is bounded in count and time; the only
processes ended are those this script started, by their pids (on Ctrl-C and on failure
too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import importlib.metadata
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.node_lanes import cpu_name, replace_section, server_binary  # noqa: E402
from scripts.bench.node_lanes import server_version as llama_server_version  # noqa: E402

DEFAULT_CACHE = Path(os.environ.get("SHOAL_BENCH_CACHE", "~/.cache/shoal-bench")).expanduser()
HEADING = "## Models on demand (issue 32)"
SHOAL = ROOT / ".venv" / "bin" / "shoal"
BATCHES = (1, 16, 64)
ROUNDS = 7
TARGET_EMBED = 0.95  # ours / llama-server inputs/s, at least, at every batch size
MIN_COSINE = 0.99  # the two sides' vectors for one text
WINDOW = 512  # all-MiniLM-L6-v2's trained window: llama-server's context per slot
UBATCH = 512  # llama-server's -b and -ub: holds the longest input (a non-causal model)
START_TIMEOUT = 120.0  # s, a process until it is ready
REQUEST_TIMEOUT = 300.0  # s, one request
STOP_TIMEOUT = 15.0  # s, a process after SIGTERM, before SIGKILL
MiB = 1024 * 1024


# ----------------------------------------------------------------------------
# the parts


@dataclass
class Outcome:
    """What a part measured: its report (a ``### `` subsection), its figures for the
    smoke line, the checks a smoke run makes of them, and whether its targets held."""

    markdown: str
    figures: dict[str, Any]
    checks: dict[str, bool]
    met: bool


@dataclass(frozen=True)
class Part:
    name: str
    what: str  # the wording of the measure
    run: Callable[[Bench], Outcome] | None  # None: waits for several models per node


# ----------------------------------------------------------------------------
# processes this script started, each ended by its pid


@dataclass
class Started:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid


class Processes:
    """Starts processes (each in a session of its own, so a Ctrl-C at the terminal goes
    to this script alone) and ends exactly those, by their pids, newest first."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Started] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Started:
        log = self.logs / f"{name}.log"
        with log.open("wb") as fh:
            popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        proc = Started(name, popen, log)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            stop(proc.popen)
        self.started.clear()


def stop(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(STOP_TIMEOUT)


def wait_for_line(proc: Started, pattern: re.Pattern[str], what: str) -> re.Match[str]:
    """The first match of ``pattern`` in the process's log, polled until START_TIMEOUT."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        found = pattern.search(proc.log.read_text(errors="replace"))
        if found:
            return found
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before "
                               f"{what}; see {proc.log}")
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} did not show {what} in {START_TIMEOUT:.0f} s; "
                       f"see {proc.log}")


def wait_until(check: Callable[[], bool], what: str, proc: Started) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            if check():
                return
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before "
                               f"{what}; see {proc.log}")
        time.sleep(0.2)
    raise RuntimeError(f"no {what} in {START_TIMEOUT:.0f} s; see {proc.log}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if body else None
    finally:
        conn.close()


def memory_of(pid: int) -> tuple[int, int]:
    """Resident bytes now and at the peak (VmRSS, VmHWM) of ``pid`` and its children."""
    rss = hwm = 0
    for p in (pid, *children(pid)):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    kib = int(value.split()[0]) * 1024
                    if key == "VmRSS":
                        rss += kib
                    else:
                        hwm += kib
    return rss, hwm


def cpu_seconds(pid: int) -> float:
    """The time ``pid``'s threads have run on a CPU (schedstat: nanoseconds, not ticks)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


SETTLE_WINDOW_S = 0.02  # a process that ran under 1 ms of CPU in this long is idle
SETTLE_MAX_S = 2.0


def settle(pids: list[int]) -> None:
    """Wait (bounded) until every process of ``pids`` is idle: llama-server's threads poll
    for work for a while after a request (its --poll), and a request of the other side sent
    meanwhile would share the CPUs with them."""
    deadline = time.monotonic() + SETTLE_MAX_S
    before = sum(cpu_seconds(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_WINDOW_S)
        now = sum(cpu_seconds(pid) for pid in pids)
        if now - before < 0.001:
            return
        before = now


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for c in (task / "children").read_text().split():
                    out += [int(c), *children(int(c))]
    return out


# ----------------------------------------------------------------------------
# the run


@dataclass
class Bench:
    args: argparse.Namespace
    procs: Processes
    work: Path  # a temporary folder: logs, the fleet's SHOAL_HOME
    threads: int
    versions: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)  # what a reader runs to reproduce


# ---- texts

_SUBJECTS = (
    "the old ferry", "a quiet librarian", "our build server", "the northern orchard",
    "a tired courier", "the city council", "this small bakery", "the night train",
    "a curious student", "the harbour crane", "my neighbour's dog", "the research team",
    "a winter storm", "the village choir", "an early customer", "the copper mill",
)
_VERBS = (
    "carried", "repaired", "described", "ignored", "measured", "painted", "sold",
    "found", "moved", "counted", "followed", "announced", "delayed", "cleaned",
)
_OBJECTS = (
    "three crates of apples", "the broken lantern", "a long list of names",
    "every ticket for the concert", "the map of the valley", "two hundred letters",
    "the results of the test", "a box of old photographs", "the new bridge",
    "the recipe for rye bread", "a cracked violin", "the budget for next year",
)
_TAILS = (
    "before the rain started", "near the river station", "after a long meeting",
    "on a cold Tuesday morning", "without telling anyone", "for the third time this week",
    "while the market was closing", "at the edge of the forest", "with great care",
    "because the road was flooded", "during the summer festival", "in less than an hour",
    "and nobody noticed until the evening", "as the tower bells rang",
)


def sentence(seed: int) -> str:
    """A short sentence of 8-20 words, the same for the same seed."""
    rng = random.Random(seed)
    for _ in range(100):  # bounded: almost every draw fits at once
        parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        parts += rng.sample(_TAILS, rng.randint(0, 3))
        text = " ".join(parts)
        if 8 <= len(text.split()) <= 20:
            return text[0].upper() + text[1:] + "."
    return "The old ferry carried three crates of apples before the rain started."


class Texts:
    """Fresh sentences on each call: no text is sent twice to a side."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[str]:
        out = [sentence(self.next + i) for i in range(n)]
        self.next += n
        return out


# ---- the two sides


@dataclass
class Side:
    name: str
    port: int
    model: str
    pids: dict[str, int]  # its processes, by what they are
    conn: http.client.HTTPConnection | None = None
    rates: dict[int, list[float]] = field(default_factory=dict)  # batch -> inputs/s per round
    walls: dict[int, list[float]] = field(default_factory=dict)  # batch -> s per request
    # batch -> process -> CPU seconds it ran per request (all its threads)
    cpu: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    last_cpu: dict[str, float] = field(default_factory=dict)  # of the last request
    last_bytes: int = 0  # the last answer's body

    def embed(self, texts: list[str]) -> tuple[float, list[list[float]]]:
        """One request: its wall time (sent to the whole body read) and the vectors."""
        body = json.dumps({"model": self.model, "input": texts,
                           "encoding_format": "float"}).encode()
        for attempt in range(2):  # a kept-alive connection the server has closed: once more
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                       timeout=REQUEST_TIMEOUT)
            before = {k: cpu_seconds(pid) for k, pid in self.pids.items()}
            t0 = time.perf_counter()
            try:
                self.conn.request("POST", "/v1/embeddings", body=body,
                                  headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                raw = r.read()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self.close()
                if reused and attempt == 0:
                    continue  # embedding is idempotent: asking again changes nothing
                raise
            wall = time.perf_counter() - t0
            break
        self.last_cpu = {k: cpu_seconds(pid) - before[k] for k, pid in self.pids.items()}
        self.last_bytes = len(raw)
        if r.status != 200:
            raise RuntimeError(f"{self.name} answered {r.status}: {raw[:300]!r}")
        data = sorted(json.loads(raw)["data"], key=lambda d: d["index"])
        if len(data) != len(texts):
            raise RuntimeError(f"{self.name} gave {len(data)} vectors for {len(texts)} texts")
        return wall, [d["embedding"] for d in data]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def start_llama_server(bench: Bench, gguf: Path, n: int) -> Side:
    from tests.llama_server_proc import same_repacking

    binary = server_binary(bench.args)
    bench.versions["llama-server"] = llama_server_version(binary)
    port = free_port()
    flags = ["--embeddings", "--pooling", "mean", "--host", "127.0.0.1", "--port", str(port),
             "-t", str(bench.threads), "-np", str(n), "-c", str(WINDOW * n),
             "-b", str(UBATCH), "-ub", str(UBATCH), *same_repacking()]
    proc = bench.procs.start("llama-server", [str(binary), "-m", str(gguf), *flags])
    proc.port = port

    def healthy() -> bool:
        return get_json(port, "/health")[0] == 200

    wait_until(healthy, "llama-server answering /health", proc)
    bench.commands.append("llama-server -m GGUF " + " ".join(
        "PORT" if f == str(port) else f for f in flags))
    return Side("llama-server", port, gguf.stem, {"llama-server": proc.pid})


def start_shoal(bench: Bench, gguf: Path, n: int) -> tuple[Side, Started, Started]:
    """A node and a head dialing it, as processes of the CLI, in a SHOAL_HOME of their own."""
    home = bench.work / "home"
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONUNBUFFERED": "1",
           # never the user's keychain: the token lives in the temporary home's file
           "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}
    subprocess.run([str(SHOAL), "fleet", "token"], env=env, capture_output=True, text=True,
                   timeout=60, check=True)
    node = bench.procs.start("shoal-node", [
        str(SHOAL), "node", "--runtime", "llamacpp", "--model", str(gguf),
        "--listen", "127.0.0.1:0", "--max-batch", str(n)], env=env)
    node.port = int(wait_for_line(node, re.compile(r" on 127\.0\.0\.1:(\d+) \(link"),
                                  "its ready line").group(1))
    head = bench.procs.start("shoal-head", [
        str(SHOAL), "serve", str(gguf), "--runtime", "llamacpp",
        "--fleet", f"127.0.0.1:{node.port}", "--http", "127.0.0.1:0"], env=env)
    head.port = int(wait_for_line(head, re.compile(r"at http://127\.0\.0\.1:(\d+)/v1"),
                                  "its ready line").group(1))

    def node_ready() -> bool:
        status, state = get_json(head.port, "/v1/fleet")
        return status == 200 and any(x["state"] == "ready" and x["connections"] > 0
                                     for x in state["nodes"])

    wait_until(node_ready, "node ready in the head's /v1/fleet", head)
    status, models = get_json(head.port, "/v1/models")
    name = models["data"][0]["id"] if status == 200 and models.get("data") else gguf.stem
    bench.commands += [
        "SHOAL_HOME=$(mktemp -d) sh -c '.venv/bin/shoal fleet token >/dev/null; "
        f".venv/bin/shoal node --runtime llamacpp --model GGUF --listen 127.0.0.1:NODE_PORT "
        f"--max-batch {n} & .venv/bin/shoal serve GGUF --runtime llamacpp --fleet "
        "127.0.0.1:NODE_PORT --http 127.0.0.1:0'"]
    return Side("Shoal", head.port, name, {"head": head.pid, "node": node.pid}), node, head


# ---- measures


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


@dataclass
class Agreement:
    cosines: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)  # both sides'

    def add(self, ours: list[list[float]], theirs: list[list[float]]) -> None:
        for a, b in zip(ours, theirs, strict=True):
            self.cosines.append(cosine(a, b))
            self.norms += [norm(a), norm(b)]

    @property
    def holds(self) -> bool:
        return (bool(self.cosines) and min(self.cosines) >= MIN_COSINE
                and all(abs(n - 1.0) < 1e-3 for n in self.norms))


def measure(sides: list[Side], batches: list[int], rounds: int, texts: Texts,
            agreement: Agreement, sizes: dict[int, dict[str, int]]) -> dict[int, list[str]]:
    """Per batch size: a warm-up request each, then ``rounds`` rounds, alternating which
    side goes first, both getting the same new texts in a round. The texts of each batch
    size's rounds, for the in-process breakdown; ``sizes`` gets each side's answer body
    (bytes) per batch size."""
    used: dict[int, list[str]] = {}
    for b in batches:
        sizes[b] = {}
        for side in sides:
            side.embed(texts.take(b))
            side.rates[b], side.walls[b] = [], []
            side.cpu[b] = {k: [] for k in side.pids}
        used[b] = []
        for r in range(rounds):
            batch = texts.take(b)
            used[b] += batch
            got: dict[str, list[list[float]]] = {}
            for side in sides if r % 2 == 0 else sides[::-1]:
                settle([pid for other in sides for pid in other.pids.values()])
                wall, vectors = side.embed(batch)
                side.rates[b].append(b / wall)
                side.walls[b].append(wall)
                for k, v in side.last_cpu.items():
                    side.cpu[b][k].append(v)
                got[side.name] = vectors
                sizes[b][side.name] = side.last_bytes
            agreement.add(got[sides[0].name], got[sides[1].name])
        print(f"batch {b}: " + "; ".join(
            f"{s.name} {statistics.median(s.rates[b]):,.1f} inputs/s (rounds "
            + " ".join(f"{x:.0f}" for x in s.rates[b]) + ")" for s in sides), flush=True)
    return used


@dataclass
class Breakdown:
    """Our side's time per request of each batch size, in this process: the head's
    tokenizing and the node's embedder alone (medians, s)."""

    tokenize: dict[int, float] = field(default_factory=dict)
    embed: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, float] = field(default_factory=dict)  # median tokens per input


def breakdown(gguf: Path, used: dict[int, list[str]], threads: int, lanes: int) -> Breakdown:
    """The head's tokenizer and the node's embedder on the texts the rounds sent, in
    batches of the same sizes, one at a time (the processes measured before sit idle)."""
    from engine.head.prompt.model import load_head_model
    from engine.runtimes.llamacpp_embed import LlamaCppEmbedder

    model = load_head_model("llamacpp", str(gguf), name=gguf.stem)
    out = Breakdown()
    ids: dict[int, list[list[list[int]]]] = {}
    for b, texts in used.items():
        batches = [texts[i:i + b] for i in range(0, len(texts), b)]
        walls: list[float] = []
        ids[b] = []
        for batch in batches:
            t0 = time.perf_counter()
            ids[b].append([model.vocab.encode_input(t) for t in batch])
            walls.append(time.perf_counter() - t0)
        out.tokenize[b] = statistics.median(walls)
        out.tokens[b] = statistics.median(len(x) for one in ids[b] for x in one)

    async def embed_all() -> None:
        engine = LlamaCppEmbedder(gguf, n_threads=threads, lanes=lanes)
        await engine.start()
        try:
            for b, batches in ids.items():
                await engine.embed(batches[0])  # warm-up
                walls = []
                for one in batches:
                    t0 = time.perf_counter()
                    await engine.embed(one)
                    walls.append(time.perf_counter() - t0)
                out.embed[b] = statistics.median(walls)
        finally:
            await engine.close()

    asyncio.run(embed_all())
    return out


def run_embeddings(bench: Bench) -> Outcome:
    args = bench.args
    gguf = embedding_model(args)
    batches: list[int] = args.batch_sizes
    n = max(batches)
    ours: Side | None = None
    theirs: Side | None = None
    try:
        theirs = start_llama_server(bench, gguf, n)
        ours, node, head = start_shoal(bench, gguf, n)
        agreement = Agreement()
        sizes: dict[int, dict[str, int]] = {}
        used = measure([ours, theirs], batches, args.rounds, Texts(), agreement, sizes)
        server = next(p for p in bench.procs.started if p.name == "llama-server")
        memory = {"Shoal node": memory_of(node.pid), "Shoal head": memory_of(head.pid),
                  "llama-server": memory_of(server.pid)}
    finally:
        for side in (ours, theirs):
            if side is not None:
                side.close()
    parts = breakdown(gguf, used, bench.threads, n)
    assert ours is not None and theirs is not None
    return embeddings_report(bench, gguf, ours, theirs, agreement, memory, parts, sizes)


def embedding_model(args: argparse.Namespace) -> Path:
    """``--model``, else all-MiniLM-L6-v2 made into a GGUF under ``--cache`` once."""
    if args.model is not None:
        return Path(args.model)
    from tests.minilm import ensure_minilm_gguf

    print(f"model: making or reusing all-MiniLM-L6-v2's GGUF under {args.cache}", flush=True)
    return ensure_minilm_gguf(args.cache)


# ---- its report


def verdict_word(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def embeddings_report(bench: Bench, gguf: Path, ours: Side, theirs: Side,
                      agreement: Agreement, memory: dict[str, tuple[int, int]],
                      parts: Breakdown, sizes: dict[int, dict[str, int]]) -> Outcome:
    args = bench.args
    med = statistics.median
    rows: list[dict[str, Any]] = []
    for b in args.batch_sizes:
        o, s = med(ours.rates[b]), med(theirs.rates[b])
        paired = [x / y for x, y in zip(ours.rates[b], theirs.rates[b], strict=True) if y]
        rows.append({"batch": b, "ours": o, "server": s, "ratio": o / s if s else 0.0,
                     "paired": med(paired) if paired else 0.0,
                     "ours_span": (min(ours.rates[b]), max(ours.rates[b])),
                     "server_span": (min(theirs.rates[b]), max(theirs.rates[b])),
                     "ours_ms": med(ours.walls[b]) * 1000,
                     "server_ms": med(theirs.walls[b]) * 1000,
                     "tokenize_ms": parts.tokenize[b] * 1000,
                     "embed_ms": parts.embed[b] * 1000,
                     "engine": b / parts.embed[b] if parts.embed[b] else 0.0,
                     "tokens": parts.tokens[b],
                     "head_cpu_ms": med(ours.cpu[b]["head"]) * 1000,
                     "node_cpu_ms": med(ours.cpu[b]["node"]) * 1000,
                     "server_cpu_ms": med(theirs.cpu[b]["llama-server"]) * 1000})
    met = all(r["ratio"] >= TARGET_EMBED for r in rows) and agreement.holds
    n = max(args.batch_sizes)
    lines = [
        "### Embeddings", "",
        f"Model: {gguf.name} (all-MiniLM-L6-v2, BERT, mean pooling, 384 dimensions, made "
        "from its PyPI wheel by tests/minilm.py). Both sides loaded for the whole part, "
        "taking turns, never running at the same time (each request waits until both "
        "sides' processes are idle: llama-server's threads poll for work for a while after "
        "a request, `--poll`, and shared the CPUs with our side's next request in an "
        "earlier version of this benchmark): per batch size a warm-up request "
        f"each, then {args.rounds} rounds, alternating which side goes first, both getting "
        "the same new texts in a round (sentences of 8-20 words made from a word list, "
        "none sent twice). A round's figure is the batch's inputs over the wall time of "
        "its `POST /v1/embeddings` (`encoding_format: float`, one kept-alive connection "
        "per side, from sending to the whole answer read); the table gives the median of "
        "the rounds' figures, their ratio, and the median of each round's own ratio (the "
        "two requests of a round run back to back, so a burst of other work on the "
        f"machine tends to hit both). llama-server has {n} slots (`-np {n}`), so every "
        f"input of a request gets one, and decodes at most {UBATCH} tokens at a time "
        "(`-b`/`-ub`); our node's embedder puts up to 64 inputs or 2,048 tokens in one "
        "`llama_decode`. CPU ms: the time each process ran on a CPU during a request, "
        "all its threads (/proc's schedstat). The last three columns are our side's parts "
        "timed alone in this process afterwards, on the same batches with the same "
        "threads: the head's tokenizing and the node's embedder (`LlamaCppEmbedder`).", "",
        f"Target: inputs/s at least {TARGET_EMBED}x llama-server `--embeddings` at every "
        f"batch size, the two sides' vectors agreeing (cosine at least {MIN_COSINE}). "
        f"**{'Met' if met else 'Not met'}.**", "",
        "| batch | Shoal inputs/s | llama-server inputs/s | ratio | | median of each round's "
        "ratio | rounds min-max Shoal "
        "/ llama-server | ms per request Shoal / llama-server | CPU ms per request: Shoal "
        "head + node / llama-server | of ours: head tokenizing ms | of ours: embedder ms "
        "(its inputs/s) | tokens per input (median) |",
        "|---:|---:|---:|---:|:--|---:|:--|:--|:--|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['ours']:,.1f} | {r['server']:,.1f} | {r['ratio']:.2f} | "
            f"{verdict_word(r['ratio'] >= TARGET_EMBED)} | {r['paired']:.2f} | "
            f"{r['ours_span'][0]:,.0f}-"
            f"{r['ours_span'][1]:,.0f} / {r['server_span'][0]:,.0f}-{r['server_span'][1]:,.0f}"
            f" | {r['ours_ms']:,.1f} / {r['server_ms']:,.1f} | {r['head_cpu_ms']:,.1f} + "
            f"{r['node_cpu_ms']:,.1f} / {r['server_cpu_ms']:,.1f} | {r['tokenize_ms']:,.2f} | "
            f"{r['embed_ms']:,.1f} ({r['engine']:,.0f}) | {r['tokens']:.0f} |")
    cos = agreement.cosines
    big = max(sizes)
    lines += [
        "",
        f"Answer size at {big} texts (`encoding_format: float`): Shoal "
        f"{sizes[big]['Shoal'] / 1024:,.1f} KiB, llama-server "
        f"{sizes[big]['llama-server'] / 1024:,.1f} KiB.", "",
        f"Agreement: {len(cos)} texts embedded by both, cosine of the two sides' vectors "
        f"{min(cos):.5f} at the least (median {med(cos):.5f}); lengths "
        f"{min(agreement.norms):.5f}-{max(agreement.norms):.5f} "
        f"({verdict_word(agreement.holds)}).", "",
        "Resident memory, both sides idle after the runs (VmRSS, and the peak VmHWM, "
        "from /proc):", "",
        "| process | RSS MiB | peak MiB |", "|:--|---:|---:|",
    ]
    for name, (rss, hwm) in memory.items():
        lines.append(f"| {name} | {rss / MiB:,.1f} | {hwm / MiB:,.1f} |")
    node_head = memory["Shoal node"][0] + memory["Shoal head"][0]
    lines.append(f"| Shoal node + head | {node_head / MiB:,.1f} | |")
    lines += ["", where_the_time_goes(rows)]
    text = "\n".join(lines) + "\n"
    if args.plot is not None:
        text += "\n" + plot(rows, args, gguf)
    figures = {
        "inputs_per_s": {str(r["batch"]): [round(r["ours"], 2), round(r["server"], 2)]
                         for r in rows},
        "ratio": [round(r["ratio"], 3) for r in rows],
        "min_cosine": round(min(cos), 5),
        "rss_mib": {k: round(v[0] / MiB, 1) for k, v in memory.items()},
        "embedder_ms": [round(r["embed_ms"], 2) for r in rows],
    }
    checks = {
        "both sides made inputs/s above 0 at every batch size": all(
            r["ours"] > 0 and r["server"] > 0 for r in rows),
        f"the two sides' vectors agreed (cosine at least {MIN_COSINE}, length 1)":
            agreement.holds,
        "every process's resident memory was read": all(v[0] > 0 for v in memory.values()),
        "our embedder was timed in-process": all(r["embed_ms"] > 0 for r in rows),
    }
    return Outcome(markdown=text, figures=figures, checks=checks, met=met)


def where_the_time_goes(rows: list[dict[str, Any]]) -> str:
    """A sentence per missed batch size: how our request's time splits."""
    said = []
    for r in rows:
        if r["ratio"] >= TARGET_EMBED:
            continue
        rest = r["ours_ms"] - r["tokenize_ms"] - r["embed_ms"]
        split = (f"which leaves {rest:,.1f} ms outside them: the HTTP route, the link to the "
                 f"node, the JSON of {r['batch']} vectors, the hand-overs between threads "
                 "and any wait for a CPU that other work held" if rest > 0 else
                 "more than the whole request took, so other work on the machine slowed "
                 "the two measurements unequally and the rest cannot be told apart")
        said.append(
            f"batch {r['batch']}: of our {r['ours_ms']:,.1f} ms per request (median), "
            f"{r['embed_ms']:,.1f} ms is the embedder itself (llama.cpp, in-process) and "
            f"{r['tokenize_ms']:,.2f} ms the head's tokenizing, {split}; the head ran "
            f"{r['head_cpu_ms']:,.1f} ms on a CPU per request and the node "
            f"{r['node_cpu_ms']:,.1f} ms (llama-server "
            f"{r['server_cpu_ms']:,.1f} ms); llama-server takes {r['server_ms']:,.1f} ms in all")
    if not said:
        return ("Where our time goes: the CPU time each process ran per request (all its "
                "threads, from /proc's schedstat; the node's includes llama.cpp's threads), "
                "and the head's tokenizing and the node's embedder, each timed alone in this "
                "process on the same batches; the rest of a request is the HTTP route, the "
                "link and the JSON.")
    return "Where our time goes (missed): " + "; ".join(said) + "."


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, gguf: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)\n"
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    w = 0.38
    idx = list(range(len(rows)))
    ax.bar([i - w / 2 for i in idx], [r["ours"] for r in rows], w, label="Shoal (head + node)")
    ax.bar([i + w / 2 for i in idx], [r["server"] for r in rows], w,
           label="llama-server --embeddings")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ratio']:.2f}x", (i, max(r["ours"], r["server"])), ha="center",
                    va="bottom", fontsize=8)
    ax.margins(y=0.12)
    ax.set_xticks(idx, [str(r["batch"]) for r in rows])
    ax.set_xlabel("texts per request")
    ax.set_ylabel("inputs/s (median of rounds)")
    ax.set_title(f"POST /v1/embeddings, {gguf.stem}, ours/theirs", fontsize=9)
    ax.legend(fontsize=8)
    from scripts.bench.node_lanes import save_plot

    return save_plot(fig, args, "embeddings: inputs/s, Shoal against llama-server")


# ----------------------------------------------------------------------------
# the parts and the section


WAITING = "nodes keep one model each; it waits for several models per node"

PARTS = (
    Part("load", "time from a request for a kept, unloaded model to its first token, at "
         "most llama-server router's", None),
    Part("interleaved", "interleaved requests across two loaded models: tokens/s at least "
         "0.95x of the same requests on two single-model nodes", None),
    Part("embeddings", "inputs per second for batches of 1, 16 and 64 short texts at least "
         "0.95x llama-server `--embeddings`", run_embeddings),
    Part("memory", "resident memory with two models loaded: at most the sum of each "
         "served alone plus 50 MB, and never above the budget", None),
    Part("estimate", "the speed estimate against the measured tokens/s for both models: "
         "within 30%", None),
)


def setup_text(bench: Bench, load: tuple[float, float]) -> str:
    args = bench.args
    v = bench.versions
    reproduce = (f"`.venv/bin/python scripts/bench/models_on_demand.py --parts "
                 f"{','.join(args.parts)} --rounds {args.rounds} --batches "
                 f"{','.join(map(str, args.batch_sizes))}`")
    run = "; ".join(f"`{c}`" for c in bench.commands)
    return (
        f"Shoal {v.get('shoal', '?')} (llama-cpp-python {v.get('llama-cpp-python', '?')}) "
        "against llama-server built from the llama.cpp that the same llama-cpp-python sdist "
        f"carries (build {v.get('llama-server', '?')}), one after the other on the same "
        f"{os.cpu_count()}-core machine ({cpu_name()}; 1-minute load average "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end, other work included), "
        f"{bench.threads} threads each (llama-server `-t`; the node takes the CPUs it may "
        "use). The processes, as a user runs them: " + run + ". Reproduce: " + reproduce
        + ". Each part below says how it measures.")


def write_report(bench: Bench, ran: list[tuple[Part, Outcome]],
                 load: tuple[float, float]) -> str:
    args = bench.args
    names = {p.name for p, _ in ran}
    waiting = [p for p in PARTS if p.name not in names]
    lines = [
        HEADING, "",
        "`scripts/bench/models_on_demand.py`: issue 32's benchmark, Shoal side by side with "
        "llama-server on the same models and machine. Parts run here: "
        + ", ".join(f"**{p.name}** ({p.what})" for p, _ in ran) + ".",
    ]
    if waiting:
        lines[-1] += (" Not run: " + "; ".join(f"{p.name} ({p.what})" for p in waiting)
                      + f". Those {len(waiting)} wait for several models per node, which "
                      "nodes do not keep yet (each serves one model).")
    lines += ["", setup_text(bench, load), ""]
    section = "\n".join(lines) + "\n" + "\n".join(o.markdown for _, o in ran)
    replace_section(args.out, HEADING, section)
    print(section, flush=True)
    print(f"wrote {args.out}", flush=True)
    return section


# ----------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--parts", default="embeddings",
                    help="comma-separated, of " + ", ".join(p.name for p in PARTS)
                    + " (only embeddings runs yet)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="measured rounds per side")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="texts per request, comma-separated")
    ap.add_argument("--model", type=Path, default=None,
                    help="the embedding GGUF (default: all-MiniLM-L6-v2, made under --cache)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the model goes")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="use this llama-server binary instead of building one")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "models_on_demand.png")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the processes' logs (their folder is printed)")
    ap.add_argument("--smoke", action="store_true",
                    help="batches of 1 and 4, 1 round, the report and the plot to a temp "
                    "folder; exit 1 if the figures make no sense")
    args = ap.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = {p.name: p for p in PARTS}
    unknown = [p for p in args.parts if p not in known]
    if unknown or not args.parts:
        ap.error(f"--parts: {', '.join(unknown) or 'none given'}; choose from "
                 + ", ".join(known))
    waits = [p for p in args.parts if known[p].run is None]
    if waits:
        ap.error(f"--parts {', '.join(waits)}: {WAITING}; run --parts embeddings")
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.batches, args.rounds = "1,4", 1
        args.out = scratch("models-on-demand") / "benchmarks.md"
        args.plot = args.out.with_name("models_on_demand.png")
    args.batch_sizes = [int(x) for x in args.batches.split(",") if x.strip()]
    if not args.batch_sizes or min(args.rounds, *args.batch_sizes) < 1:
        ap.error("--rounds and --batches must be positive")
    if max(args.batch_sizes) > 256:
        ap.error("--batches: at most 256 texts per request (the API's limit)")
    args.cache = args.cache.expanduser()
    args.cache.mkdir(parents=True, exist_ok=True)
    return args


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def workspace(keep: bool) -> Iterator[Path]:
    """A temporary folder for the logs and the fleet's home: removed after a run that
    went well unless ``keep``, kept after a failure (its path printed)."""
    work = Path(tempfile.mkdtemp(prefix="shoal-models-on-demand-"))
    try:
        yield work
    except BaseException:
        print(f"failed; the processes' logs are in {work}", flush=True)
        raise
    if keep:
        print(f"logs kept in {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # a kill ends what we started, too
    from engine.runtimes.llamacpp import usable_cpus

    load0 = os.getloadavg()[0]
    print(f"parts {', '.join(args.parts)}, batches {args.batch_sizes}, {args.rounds} rounds, "
          f"load average {load0:.2f}", flush=True)
    ran: list[tuple[Part, Outcome]] = []
    with workspace(args.keep_logs) as work:
        procs = Processes(work)
        bench = Bench(args, procs, work, threads=usable_cpus(), versions={
            "shoal": importlib.metadata.version("shoal"),
            "llama-cpp-python": importlib.metadata.version("llama-cpp-python")})
        try:
            for part in PARTS:
                if part.name in args.parts and part.run is not None:
                    ran.append((part, part.run(bench)))
                    procs.stop_all()  # each part starts what it needs
        except Exception:  # a failure, not an interrupt: show why
            for proc in procs.started:
                with contextlib.suppress(OSError):
                    print(f"--- {proc.name} (last lines) ---\n"
                          + "\n".join(proc.log.read_text(errors="replace").splitlines()[-15:]),
                          flush=True)
            raise
        finally:
            procs.stop_all()
    write_report(bench, ran, (load0, os.getloadavg()[0]))
    if args.smoke:
        from scripts.bench.smoke import verdict

        figures: dict[str, object] = {}
        checks: dict[str, bool] = {}
        for part, outcome in ran:
            figures.update({f"{part.name}.{k}": v for k, v in outcome.figures.items()})
            checks.update(outcome.checks)
        figures["parts"] = [p.name for p, _ in ran]
        verdict(figures, checks)


if __name__ == "__main__":
    main()
