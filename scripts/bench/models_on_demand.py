"""Models on demand (issue 32) against llama-server, side by side in one run.

Issue 32's benchmark has five parts; each is one function here, chosen with ``--parts``:

  * ``embeddings`` (built): inputs per second of ``POST /v1/embeddings`` for batches of
    1, 16 and 64 short texts, Shoal against llama-server ``--embeddings`` on the same
    model (all-MiniLM-L6-v2 as an F16 GGUF, made from its PyPI wheel by tests/minilm.py)
    and the same machine; target: ours at least 0.95x llama-server's at every batch size.
  * ``load``: time from a streamed request for a kept, unloaded model to its first token,
    ours (``shoal serve MINILM --serve-kept`` keeping Gemma 3 270M and SmolLM2 135M) against
    llama-server's router (``--models-dir``, one llama-server per model), each round
    starting with the model unloaded on both sides (ours: a request with ``keep_alive: 0``,
    then until /api/ps leaves it out; theirs: ``POST /models/unload``, then until ``GET
    /models`` says unloaded); the same lanes and context (2 x 1024) on both; then, alone
    in this process, the node's engine start and its warm-up, where our load's time goes.
    Target: ours at most the router's.
  * ``interleaved``: rounds of 4 greedy completions at once, alternating SmolLM2 and Gemma,
    on one node holding both, against the same requests on two single-model ``shoal
    serve`` processes (as a user starts them, and each pinned to a core with taskset;
    the target against the faster pair) and, for context, the router. Target: 0.95x.
  * ``memory``: VmRSS of ``shoal serve`` with both models loaded, idle, against each
    served alone, and against the node's budget (the default, and ``--budget``).
    Target: at most the sum alone plus 50 MB, never above the budget.
  * ``estimate``: engine/models/speed.py's decode estimate (the GGUF's shape, this
    machine's RAM bandwidth measured here) against the node's measured decode_tps
    (/v1/fleet, after 128-token greedy answers on one lane). Target: within 30%.

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
when it is there, else added at the end), naming the parts that ran, with a table per
part and plots: inputs/s per batch size (docs/models_on_demand.png), the first token of
an unloaded model (docs/models_on_demand_load.png) and tokens/s interleaved
(docs/models_on_demand_interleaved.png).

Run: .venv/bin/python scripts/bench/models_on_demand.py [--parts load,interleaved,...]
     [--rounds 7] [--batches 1,16,64] [--tokens 32] [--budget 1G] [--model MINILM.gguf]
     [--smollm2 GGUF] [--gemma GGUF] [--cache ~/.cache/shoal-bench]
     [--llama-server PATH] [--out docs/benchmarks.md] [--plot docs/models_on_demand.png]
Smoke (under a minute: 1 round, small requests, Gemma only for load, SmolLM2 only for the
estimate, no budgeted node, figures checked, the report and the plots to a temp folder):
.venv/bin/python scripts/bench/models_on_demand.py --smoke
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
    run: Callable[[Bench], Outcome]


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
# several models on one node: load, interleaved, memory, estimate

CONTEXT = 1024  # tokens a lane holds, on every side (--max-context; llama-server -c / -np)
LANES = 2  # lanes a model has (--max-batch; llama-server -np)
LOAD_TOKENS = 4  # what a load round asks for: its first token is what counts
TARGET_INTERLEAVED = 0.95  # ours / two single-model nodes, tokens/s, at least
MEMORY_SLACK = 50 * 1000 * 1000  # bytes: "the sum of each served alone plus 50 MB"
TARGET_ESTIMATE = (0.7, 1.3)  # estimate / measured decode tokens/s
UNLOAD_TIMEOUT = 30.0  # s, a model until its side says it is unloaded
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
         "who told the children long stories every evening. One of them began like this:")


@dataclass
class Serve:
    """A ``shoal serve`` process (head and node in one) or llama-server's router."""

    label: str
    proc: Started
    names: dict[str, str]  # our key of a model (smollm2, gemma) -> its name on the API
    budget: str = ""  # what the node said at start: "within a memory budget of ..."
    flags: str = ""  # how it was started, for the report

    @property
    def port(self) -> int:
        return self.proc.port

    @property
    def pid(self) -> int:
        return self.proc.pid


def generation_models(args: argparse.Namespace) -> dict[str, Path]:
    """SmolLM2 135M and Gemma 3 270M: ``--smollm2`` / ``--gemma``, else the project's
    test copies under ``--cache``."""
    from engine.models.embedded import ensure_embedded_default, ensure_test_gemma

    home = args.cache / "home"
    smollm2 = args.smollm2 or ensure_embedded_default(home)
    gemma = args.gemma or ensure_test_gemma(home)
    return {"smollm2": Path(smollm2), "gemma": Path(gemma)}


def shoal_env(bench: Bench, label: str) -> dict[str, str]:
    home = bench.work / label
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "SHOAL_HOME": str(home), "PYTHONUNBUFFERED": "1",
            "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring",
            # one RAM measurement for all the homes, not one per process start
            "SHOAL_MACHINE_CACHE": str(bench.work / "machine")}


def start_serve(bench: Bench, label: str, first: Path, kept: dict[str, Path] | None = None,
                *, lanes: int = LANES, budget: str | None = None,
                cpus: str | None = None) -> Serve:
    """``shoal serve FIRST`` in a SHOAL_HOME of its own, with ``kept`` imported there first
    (``shoal models import FILE --name NAME``) and ``--serve-kept`` where there are any.
    Started, not waited for: :func:`ready` waits."""
    env = shoal_env(bench, label)
    (bench.work / "machine").mkdir(exist_ok=True)
    for name, path in (kept or {}).items():
        subprocess.run([str(SHOAL), "models", "import", str(path), "--name", name], env=env,
                       capture_output=True, text=True, timeout=60, check=True)
    flags = ["--max-batch", str(lanes), "--max-context", str(CONTEXT)]
    if kept:
        flags.append("--serve-kept")
    if budget:
        flags += ["--memory-budget", budget]
    pin = ["taskset", "-c", cpus] if cpus is not None else []  # it execs: the same pid
    proc = bench.procs.start(label, [*pin, str(SHOAL), "serve", str(first), "--http",
                                     "127.0.0.1:0", *flags], env=env)
    names = {name: name for name in kept or {}}
    return Serve(label, proc, names, flags=" ".join(flags))


def ready(serve: Serve) -> Serve:
    """Wait for ``shoal serve``'s ready line; learn its port, budget and first model's name."""
    proc = serve.proc
    proc.port = int(wait_for_line(proc, re.compile(r"at http://127\.0\.0\.1:(\d+)/v1"),
                                  "its ready line").group(1))
    found = re.search(r"within a memory budget of (.+?) \(", proc.log.read_text(
        errors="replace"))
    serve.budget = found.group(1) if found else "?"
    status, _ = get_json(proc.port, "/v1/models")
    if status != 200:
        raise RuntimeError(f"{serve.label}: /v1/models answered {status}")
    return serve


def start_router(bench: Bench, models: dict[str, Path], lanes: int = LANES) -> Serve:
    """llama-server's router on a folder of links named ``KEY.gguf`` (it names a model by
    its file's stem), autoload on (its default), at most 4 models loaded at once."""
    from tests.llama_server_proc import same_repacking

    binary = server_binary(bench.args)
    bench.versions["llama-server"] = llama_server_version(binary)
    folder = bench.work / "router-models"
    folder.mkdir(exist_ok=True)
    for key, path in models.items():
        link = folder / f"{key}.gguf"
        if not link.exists():
            link.symlink_to(path.resolve())
    port = free_port()
    flags = ["--models-dir", "DIR", "--models-max", "4", "-c", str(CONTEXT * lanes),
             "-np", str(lanes), "-t", str(bench.threads), *same_repacking()]
    cmd = [str(binary), *(str(folder) if f == "DIR" else f for f in flags),
           "--host", "127.0.0.1", "--port", str(port)]
    proc = bench.procs.start("llama-server-router", cmd)
    proc.port = port

    def listed() -> bool:
        status, body = get_json(port, "/models")
        return status == 200 and {m["id"] for m in body["data"]} >= set(models)

    wait_until(listed, "the router listing the models", proc)
    return Serve("llama-server router", proc, {k: k for k in models}, flags=" ".join(flags))


def post(port: int, path: str, body: dict[str, Any],
         timeout: float = REQUEST_TIMEOUT) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, raw[:300]
    finally:
        conn.close()


@dataclass
class Answer:
    ttft: float  # s, sent to the first chunk with text (streamed); the wall when not
    wall: float  # s, sent to the whole answer read
    tokens: int  # completion tokens (usage when it says, else chunks with text)


def complete(port: int, model: str, prompt: str, max_tokens: int, *,
             stream: bool) -> Answer:
    """One greedy ``POST /v1/completions``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"port {port}, {model}: {r.status} {r.read()[:300]!r}")
        if not stream:
            raw = r.read()
            wall = time.perf_counter() - t0
            data = json.loads(raw)
            usage = data.get("usage") or {}
            n = usage.get("completion_tokens", (data.get("timings") or {}).get("predicted_n"))
            if n is None:
                raise RuntimeError(f"port {port}, {model}: an answer without usage: "
                                   f"{raw[:300]!r}")
            return Answer(wall, wall, int(n))
        ttft = 0.0
        chunks = 0
        for _ in range(max_tokens * 4 + 64):  # bounded: a chunk a token, and a few more
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            choices = json.loads(payload).get("choices") or [{}]
            if choices[0].get("text"):
                chunks += 1
                if not ttft:
                    ttft = time.perf_counter() - t0
        r.read()
        wall = time.perf_counter() - t0
        if not ttft:
            raise RuntimeError(f"port {port}, {model}: a streamed answer without text")
        return Answer(ttft, wall, chunks)
    finally:
        conn.close()


def shoal_loaded(serve: Serve) -> set[str]:
    status, body = get_json(serve.port, "/api/ps")
    if status != 200:
        raise RuntimeError(f"{serve.label}: /api/ps answered {status}")
    return {m["name"] for m in body["models"]}


def router_loaded(serve: Serve) -> dict[str, str]:
    status, body = get_json(serve.port, "/models")
    if status != 200:
        raise RuntimeError(f"{serve.label}: /models answered {status}")
    return {m["id"]: m["status"]["value"] for m in body["data"]}


def poll(check: Callable[[], bool], what: str, timeout: float = UNLOAD_TIMEOUT) -> float:
    """Seconds until ``check`` holds, polled every 20 ms, at most ``timeout``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if check():
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not happen in {timeout:.0f} s")


def unload(serve: Serve, key: str, router: bool) -> float:
    """Unload a model and wait until its side says so: ours with a request that has
    ``keep_alive: 0`` (Ollama's API), then until /api/ps leaves it out; the router with
    ``POST /models/unload``, then until ``GET /models`` says unloaded. Seconds waited."""
    name = serve.names[key]
    if router:
        if router_loaded(serve).get(name) == "unloaded":
            return 0.0
        status, body = post(serve.port, "/models/unload", {"model": name})
        if status != 200:
            raise RuntimeError(f"router unload {name}: {status} {body!r}")
        return poll(lambda: router_loaded(serve).get(name) == "unloaded",
                    f"the router unloading {name}")
    if name not in shoal_loaded(serve):
        return 0.0
    # a prompt of its own: an empty one answers "load" and leaves the model loaded
    status, body = post(serve.port, "/api/generate", {
        "model": name, "prompt": "Hi", "raw": True, "stream": False, "keep_alive": 0,
        "options": {"num_predict": 1, "temperature": 0}})
    if status != 200:
        raise RuntimeError(f"{serve.label}: unload {name}: {status} {body!r}")
    return poll(lambda: name not in shoal_loaded(serve), f"{serve.label} unloading {name}")


def all_pids(serves: list[Serve]) -> list[int]:
    return [p for s in serves for p in (s.pid, *children(s.pid))]


# ---- load


@dataclass
class LoadRun:
    cold: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # side -> key -> s
    warm: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    unload_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    engine: dict[str, tuple[float, float]] = field(default_factory=dict)  # start, warm-up s
    stayed: list[bool] = field(default_factory=list)  # ours: loaded after the cold answer


def reload(serve: Serve, key: str, router: bool) -> None:
    """Make sure the model is loaded for the warm request. Ours: a request with
    ``keep_alive: "10m"`` (a 1-token answer), which also ends the ``keep_alive: 0`` of the
    unload request: that one sticks to the model and unloads it after every later answer
    until a request names another keep_alive. The router: a 1-token answer."""
    name = serve.names[key]
    if router:
        complete(serve.port, name, "Hi", 1, stream=False)
        return
    status, body = post(serve.port, "/api/generate", {
        "model": name, "prompt": "Hi", "raw": True, "stream": False, "keep_alive": "10m",
        "options": {"num_predict": 1, "temperature": 0}})
    if status != 200:
        raise RuntimeError(f"{serve.label}: reload {name}: {status} {body!r}")


def engine_start(gguf: Path, threads: int, passes: int) -> tuple[float, float]:
    """Where a load's time goes on our side: the node's engine (``LlamaCppEngine``, as
    the node makes it for a kept model loaded for a waiting request: 2 lanes of 1024
    tokens, no start-up rate measurement where the engine has that switch) started in this
    process, and the part of it that is a start-up warm-up (a measured prefill and decode,
    timed by wrapping its ``_warm_up``; 0 where none ran). Medians of ``passes``, s."""
    import inspect

    from engine.runtimes.llamacpp import LlamaCppEngine

    warm: list[float] = []
    original = LlamaCppEngine._warm_up

    def timed(self: LlamaCppEngine, lib: Any) -> None:
        t0 = time.perf_counter()
        try:
            original(self, lib)
        finally:
            warm.append(time.perf_counter() - t0)

    async def once() -> float:
        extra: dict[str, Any] = {}
        if "measure_at_start" in inspect.signature(LlamaCppEngine).parameters:
            extra["measure_at_start"] = False  # as engine/runtimes/registry.py loads one
        engine = LlamaCppEngine(gguf, model_name=gguf.stem, lanes=LANES,
                                max_context=CONTEXT, n_threads=threads, **extra)
        t0 = time.perf_counter()
        await engine.start()
        took = time.perf_counter() - t0
        await engine.close()
        return took

    LlamaCppEngine._warm_up = timed  # type: ignore[method-assign]
    try:
        starts = [asyncio.run(once()) for _ in range(passes)]
    finally:
        LlamaCppEngine._warm_up = original  # type: ignore[method-assign]
    return statistics.median(starts), sum(warm) / passes


def run_load(bench: Bench) -> Outcome:
    args = bench.args
    models = generation_models(args)
    keys = ["gemma"] if args.smoke else ["gemma", "smollm2"]
    first = embedding_model(args)
    ours = ready(start_serve(bench, "shoal-load", first, {k: models[k] for k in keys}))
    theirs = start_router(bench, {k: models[k] for k in keys})
    sides = [(ours, False), (theirs, True)]
    run = LoadRun()
    for serve, _ in sides:
        for d in (run.cold, run.warm, run.unload_s):
            d[serve.label] = {k: [] for k in keys}
    texts = Texts()
    for key in keys:
        for r in range(args.rounds):
            prompt, again = texts.take(2)
            for serve, router in sides if r % 2 == 0 else sides[::-1]:
                run.unload_s[serve.label][key].append(unload(serve, key, router))
                settle(all_pids([ours, theirs]))
                cold = complete(serve.port, serve.names[key], prompt, LOAD_TOKENS,
                                stream=True)
                if not router:
                    # does the model stay loaded after an answer to a request that names
                    # no keep_alive? (it should: only the unload request said 0)
                    time.sleep(0.5)
                    run.stayed.append(serve.names[key] in shoal_loaded(serve))
                reload(serve, key, router)
                settle(all_pids([ours, theirs]))
                warm = complete(serve.port, serve.names[key], again, LOAD_TOKENS, stream=True)
                run.cold[serve.label][key].append(cold.ttft)
                run.warm[serve.label][key].append(warm.ttft)
            print(f"load {key} round {r + 1}: " + "; ".join(
                f"{s.label} {run.cold[s.label][key][-1] * 1000:,.0f} ms cold, "
                f"{run.warm[s.label][key][-1] * 1000:,.0f} ms warm" for s, _ in sides),
                flush=True)
    loaded_line = re.findall(r"loaded (\S+) for a request \(it holds about ([^)]+)\)",
                             ours.proc.log.read_text(errors="replace"))
    bench.procs.stop_all()  # the breakdown runs alone
    if not args.smoke:  # a smoke run checks the rounds only
        run.engine = {k: engine_start(models[k], bench.threads, 3) for k in keys}
    bench.commands.append(f"shoal serve MINILM.gguf --http 127.0.0.1:0 {ours.flags} (SHOAL_HOME "
                          "with " + ", ".join(keys) + " imported by `shoal models import`)")
    bench.commands.append(f"llama-server {theirs.flags} --host 127.0.0.1 --port PORT "
                          "(DIR: links " + ", ".join(f"{k}.gguf" for k in keys) + ")")
    return load_report(bench, keys, models, ours, theirs, run, dict(loaded_line))


def load_report(bench: Bench, keys: list[str], models: dict[str, Path], ours: Serve,
                theirs: Serve, run: LoadRun, holds: dict[str, str]) -> Outcome:
    med = statistics.median
    rows: list[dict[str, Any]] = []
    for key in keys:
        o, t = med(run.cold[ours.label][key]), med(run.cold[theirs.label][key])
        ow, tw = med(run.warm[ours.label][key]), med(run.warm[theirs.label][key])
        rows.append({"key": key, "ours": o, "theirs": t, "ratio": o / t if t else 0.0,
                     "ours_warm": ow, "theirs_warm": tw,
                     "ours_span": (min(run.cold[ours.label][key]),
                                   max(run.cold[ours.label][key])),
                     "theirs_span": (min(run.cold[theirs.label][key]),
                                     max(run.cold[theirs.label][key])),
                     "ours_unload": med(run.unload_s[ours.label][key]),
                     "theirs_unload": med(run.unload_s[theirs.label][key])})
    met = all(r["ours"] <= r["theirs"] for r in rows)
    lines = [
        "### Load", "",
        "A kept, unloaded model's first token. Ours: one `shoal serve` whose first model "
        "is all-MiniLM-L6-v2 (an embeddings model, resident throughout) and which keeps "
        + " and ".join(f"{k} ({models[k].name})" for k in keys) + " in its store "
        f"(`shoal models import FILE --name NAME`, `--serve-kept`), started with "
        f"`{ours.flags}`; each kept model gets {LANES} lanes of {CONTEXT} tokens in a pool "
        f"of {LANES * CONTEXT} cells. Theirs: llama-server's router on a folder of links "
        f"to the same files, started with `{theirs.flags}` (autoload on, its default), "
        f"which starts one llama-server per model with {LANES} slots and a context of "
        f"{LANES * CONTEXT} tokens ({CONTEXT} a slot), the same threads. Per model "
        f"{bench.args.rounds} rounds, alternating which side goes first; each starts with "
        "the model unloaded on both sides: ours by a request with `keep_alive: 0` "
        "(`POST /api/generate`), then until `GET /api/ps` leaves the model out; theirs by "
        "`POST /models/unload`, then until `GET /models` says `unloaded`; then, both sides' "
        "processes idle, a streamed `POST /v1/completions` (`stream: true`, greedy, "
        f"{LOAD_TOKENS} tokens, a new sentence as the prompt) timed from sending to the "
        "first chunk with text; then, the model loaded again where it had unloaded (see "
        "below) and both sides idle, a second one with another prompt (warm), which "
        "gives what the load itself added.", "",
        "Target: ours at most llama-server router's time to the first token of an "
        f"unloaded model. **{'Met' if met else 'Not met'}.**", "",
        "| model | Shoal ms | router ms | ratio | | rounds min-max Shoal / router | "
        "warm ms Shoal / router | load's share: cold - warm, Shoal / router | "
        "unloading took, ms Shoal / router |",
        "|:--|---:|---:|---:|:--|:--|:--|:--|:--|",
    ]
    for r in rows:
        lines.append(
            f"| {r['key']} | {r['ours'] * 1000:,.0f} | {r['theirs'] * 1000:,.0f} | "
            f"{r['ratio']:.2f} | {verdict_word(r['ours'] <= r['theirs'])} | "
            f"{r['ours_span'][0] * 1000:,.0f}-{r['ours_span'][1] * 1000:,.0f} / "
            f"{r['theirs_span'][0] * 1000:,.0f}-{r['theirs_span'][1] * 1000:,.0f} | "
            f"{r['ours_warm'] * 1000:,.0f} / {r['theirs_warm'] * 1000:,.0f} | "
            f"{(r['ours'] - r['ours_warm']) * 1000:,.0f} / "
            f"{(r['theirs'] - r['theirs_warm']) * 1000:,.0f} | "
            f"{r['ours_unload'] * 1000:,.0f} / {r['theirs_unload'] * 1000:,.0f} |")
    if run.stayed:
        gone = run.stayed.count(False)
        lines += ["", f"Ours, after the cold answer (a `/v1/completions` request that names no "
                  f"keep_alive): the model was still loaded half a second later in "
                  f"{run.stayed.count(True)} of {len(run.stayed)} rounds"
                  + (f"; in {gone} it had unloaded again: the `keep_alive: 0` of the unload "
                     "request sticks to the model, and every later answer unloads it until a "
                     "request names another keep_alive (Ollama applies a request's "
                     "keep_alive to that request; one that names none gets the default). "
                     "The warm request therefore follows a 1-token `POST /api/generate` with "
                     "`keep_alive: \"10m\"` on our side (a 1-token completion on the "
                     "router's), which loads the model and ends that." if gone else ".")]
    if holds:
        lines += ["", "Our node said, loading: " + "; ".join(
            f"{k} holds about {v}" for k, v in holds.items()) + "."]
    if run.engine:
        lines += ["", "Where our load's time goes: the node's engine for the model "
                  "(`LlamaCppEngine`, 2 lanes of 1024 tokens, the same threads) started in "
                  "this process afterwards, nothing else running, takes "
                  + "; ".join(f"{k} {s * 1000:,.0f} ms" + (
                      f", of which {w * 1000:,.0f} ms is its start-up warm-up (a measured "
                      "32-token prefill and 3 decode steps, after an unmeasured pass of the "
                      "same shapes, run before it serves)" if w > 0 else
                      " (no start-up warm-up: a model loaded for a waiting request skips it)")
                      for k, (s, w) in run.engine.items())
                  + "; the rest of a cold first token is the head's placing, the shelf's "
                  "room-making (it reads the process's RSS before and after the load), "
                  "the request's own prefill and first decode (the warm figure) and the "
                  "hand-overs. The router's load is a llama-server process starting, whose "
                  "own warm-up (its default `--warmup`) is one empty run. Against the gap "
                  "to the router (our cold first token less theirs, medians): "
                  + "; ".join(f"{r['key']} {(r['ours'] - r['theirs']) * 1000:+,.0f} ms, "
                              f"our engine's start {run.engine[r['key']][0] * 1000:,.0f} ms"
                              for r in rows if r["key"] in run.engine) + "."]
    text = "\n".join(lines) + "\n"
    if bench.args.plot is not None:
        text += "\n" + load_plot(rows, bench.args)
    figures = {"ttft_ms": {r["key"]: [round(r["ours"] * 1000, 1), round(r["theirs"] * 1000, 1)]
                           for r in rows},
               "warm_ms": {r["key"]: [round(r["ours_warm"] * 1000, 1),
                                      round(r["theirs_warm"] * 1000, 1)] for r in rows},
               "ratio": {r["key"]: round(r["ratio"], 3) for r in rows},
               "engine_ms": {k: [round(x * 1000, 1) for x in v] for k, v in run.engine.items()},
               "stayed_loaded": [run.stayed.count(True), len(run.stayed)]}
    checks = {"both sides gave a first token for every model, cold and warm": all(
        r["ours"] > 0 and r["theirs"] > 0 and r["ours_warm"] > 0 and r["theirs_warm"] > 0
        for r in rows),
        "a cold first token took longer than a warm one on both sides (the model loaded)":
            all(r["ours"] > r["ours_warm"] and r["theirs"] > r["theirs_warm"] for r in rows)}
    return Outcome(markdown=text, figures=figures, checks=checks, met=met)


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def part_plot(fig: Any, args: argparse.Namespace, suffix: str, alt: str) -> str:
    """Save ``fig`` beside ``--plot`` as ``<its stem>_<suffix>.png``."""
    from scripts.bench.node_lanes import save_plot

    path = args.plot.with_name(f"{args.plot.stem}_{suffix}{args.plot.suffix}")
    return save_plot(fig, argparse.Namespace(plot=path, out=args.out), alt)


def load_plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    plt = _plt()
    if plt is None:
        return "(matplotlib not installed: no plot)\n"
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    w = 0.38
    idx = list(range(len(rows)))
    for off, side, warm, label in ((-w / 2, "ours", "ours_warm", "Shoal --serve-kept"),
                                   (w / 2, "theirs", "theirs_warm", "llama-server router")):
        xs = [i + off for i in idx]
        ax.bar(xs, [r[side] * 1000 for r in rows], w, label=f"{label}: unloaded")
        ax.bar(xs, [r[warm] * 1000 for r in rows], w * 0.5, color="black", alpha=0.55,
               label=f"{label}: loaded" if off > 0 else "loaded (either side)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ratio']:.2f}x", (i, max(r["ours"], r["theirs"]) * 1000),
                    ha="center", va="bottom", fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    keep = [i for i, lab in enumerate(labels) if not lab.startswith("llama-server router: l")]
    ax.legend([handles[i] for i in keep], [labels[i] for i in keep], fontsize=8)
    ax.margins(y=0.12)
    ax.set_xticks(idx, [r["key"] for r in rows])
    ax.set_ylabel("ms to the first token (median)")
    ax.set_title("a kept model's first token, unloaded and loaded, ours/theirs", fontsize=9)
    return part_plot(fig, args, "load", "load: time to the first token of an unloaded model")


# ---- interleaved


def interleaved_requests(texts: Texts) -> list[tuple[str, str]]:
    """A round's requests, alternating models: 2 streams per model at once."""
    return [(key, prompt) for key, prompt in zip(("smollm2", "gemma") * LANES,
                                                 texts.take(2 * LANES), strict=True)]


def run_round(targets: dict[str, Serve], requests: list[tuple[str, str]],
              tokens: int) -> tuple[float, dict[str, int]]:
    """All of a round's requests at once (started in order, alternating models), each
    to the process that serves its model: the wall from the first sent to the last
    answered, and the completion tokens per model."""
    from concurrent.futures import ThreadPoolExecutor

    got: dict[str, int] = {}
    with ThreadPoolExecutor(len(requests)) as pool:
        t0 = time.perf_counter()
        futures = [(key, pool.submit(complete, targets[key].port, targets[key].names[key],
                                     prompt, tokens, stream=False))
                   for key, prompt in requests]
        for key, fut in futures:
            got[key] = got.get(key, 0) + fut.result(REQUEST_TIMEOUT).tokens
        wall = time.perf_counter() - t0
    return wall, got


OURS_TWO = "Shoal, one node, two models"
PINNED = "Shoal, two single-model nodes, a core each"
SHARED = "Shoal, two single-model nodes, sharing the cores"
ROUTER = "llama-server router"
CONTEXT_ROUNDS = 2  # rounds of the sides that are there for context (slow: see the report)


@dataclass
class InterleavedSide:
    name: str
    targets: dict[str, Serve]  # model key -> the process its requests go to
    rounds: int
    rates: list[float] = field(default_factory=list)  # tokens/s per round
    counts: list[dict[str, int]] = field(default_factory=list)  # tokens per model per round
    failed: list[str] = field(default_factory=list)  # rounds that got no answer (context)


def single_nodes(bench: Bench, models: dict[str, Path], tag: str,
                 cpus: list[str | None]) -> dict[str, Serve]:
    """One ``shoal serve`` per model, started, not waited for (:func:`ready`)."""
    serves = {k: start_serve(bench, f"shoal-{k}-{tag}", p, cpus=c)
              for (k, p), c in zip(models.items(), cpus, strict=True)}
    for k, s in serves.items():
        s.names[k] = models[k].stem
    return serves


def run_interleaved(bench: Bench) -> Outcome:
    args = bench.args
    models = generation_models(args)
    tokens = 8 if args.smoke else args.tokens
    rounds = args.rounds
    context_rounds = min(rounds, CONTEXT_ROUNDS)
    two = start_serve(bench, "shoal-two", models["smollm2"], {"gemma": models["gemma"]})
    two.names["smollm2"] = models["smollm2"].stem
    sides = [InterleavedSide(OURS_TWO, {"smollm2": two, "gemma": two}, rounds)]
    pin = bench.threads >= 2 and shutil.which("taskset") is not None
    if pin:  # each process on a core of its own: no two llama.cpp thread pools on one core
        cores = sorted(os.sched_getaffinity(0))
        sides.append(InterleavedSide(PINNED, single_nodes(
            bench, models, "pinned", [str(cores[0]), str(cores[1])]), rounds))
    if not args.smoke or not pin:
        sides.append(InterleavedSide(SHARED, single_nodes(bench, models, "shared",
                                                          [None, None]),
                                     context_rounds if pin else rounds))
    if not args.smoke:
        router = start_router(bench, models)
        sides.append(InterleavedSide(ROUTER, {"smollm2": router, "gemma": router},
                                     context_rounds))
    serves = list({id(s): s for side in sides for s in side.targets.values()}.values())
    for s in serves:  # all started at once, then waited for
        if s.label != ROUTER:
            ready(s)
    texts = Texts()
    for side in sides:  # warm-up: both models loaded, every lane used once (1 token each)
        run_round(side.targets, interleaved_requests(texts), 1)
    for r in range(rounds):
        requests = interleaved_requests(texts)
        now = [s for s in sides if r < s.rounds]
        for side in now[r % len(now):] + now[:r % len(now)]:
            settle(all_pids(serves))
            try:
                wall, got = run_round(side.targets, requests, tokens)
            except RuntimeError as exc:
                if side.name not in (SHARED, ROUTER):
                    raise
                side.failed.append(str(exc))  # a side for context: say so, go on
                print(f"interleaved round {r + 1}: {side.name} failed: {exc}", flush=True)
                continue
            side.rates.append(sum(got.values()) / wall)
            side.counts.append(got)
        print(f"interleaved round {r + 1}: " + "; ".join(
            f"{s.name} {s.rates[-1]:,.1f} tok/s" for s in now if s.rates), flush=True)
    sides = [s for s in sides if s.rates]
    loaded = shoal_loaded(two)
    bench.commands.append(
        f"shoal serve SMOLLM2.gguf --http 127.0.0.1:0 {two.flags} (gemma imported) and, for "
        f"the single-model nodes, `shoal serve GGUF --http 127.0.0.1:0 --max-batch {LANES} "
        f"--max-context {CONTEXT}` once per model, each in a SHOAL_HOME of its own"
        + (" (once as they are, once each under `taskset -c CORE`)" if pin else ""))
    return interleaved_report(bench, tokens, sides, loaded, two)


def interleaved_report(bench: Bench, tokens: int, sides: list[InterleavedSide],
                       loaded: set[str], two: Serve) -> Outcome:
    med = statistics.median
    ours = sides[0]
    singles = [s for s in sides if s.name in (PINNED, SHARED)]
    base = max(singles, key=lambda s: med(s.rates))  # the stricter baseline
    ratio = med(ours.rates) / med(base.rates) if med(base.rates) else 0.0
    met = ratio >= TARGET_INTERLEAVED
    both = {two.names["smollm2"], "gemma"} <= loaded
    names = [s.name for s in sides]
    lines = [
        "### Interleaved", "",
        "Requests across two loaded models on one node: SmolLM2 135M (the node's first "
        f"model) and Gemma 3 270M (kept, loaded by the warm-up), {LANES} lanes of "
        f"{CONTEXT} tokens each. A round is {2 * LANES} greedy `POST /v1/completions` "
        f"({tokens} tokens each, new sentences as prompts) sent at once, alternating "
        f"models (SmolLM2, Gemma, SmolLM2, Gemma: {LANES} streams per model); every side "
        "gets the same requests, taking turns (rotating which goes first), each waiting "
        "until all the processes are idle; a warm-up round of 1-token requests first (it "
        "loads the kept model, and the router's two). The figure is the completion "
        "tokens of the round (their `usage`) over its wall time, first request sent to "
        "last answer read. The baseline is the same requests on two single-model Shoal "
        "nodes (two `shoal serve` processes, one per model, each with its own SHOAL_HOME "
        "and port, the same flags), the client sending each model's requests to its "
        "process. Two such pairs: as a user starts them (each process takes every CPU: "
        f"{bench.threads} llama.cpp threads each), and each pinned to a core of its own "
        "(`taskset -c 0` and `-c 1`: one thread each). The target is checked against the "
        "faster of them, which here is "
        f"\"{base.name}\"."
        + (f" llama-server's router (as in the load part: one llama-server per model, "
           f"`-t {bench.threads}` each) is there for context." if ROUTER in names else ""),
        "",
        f"Target: tokens/s at least {TARGET_INTERLEAVED}x the two single-model nodes'. "
        f"**{'Met' if met else 'Not met'}** ({ratio:.2f}x). Both models loaded on our node "
        f"at the end: {'yes' if both else 'no'}.", "",
        "| side | rounds | tokens/s (median) | rounds min-max | tokens a round (SmolLM2 + "
        "Gemma) | ours / this side |",
        "|:--|---:|---:|:--|:--|---:|",
    ]
    for s in sides:
        c = s.counts[-1]
        r = med(ours.rates) / med(s.rates) if med(s.rates) else 0.0
        lines.append(f"| {s.name} | {len(s.rates)} | {med(s.rates):,.1f} | "
                     f"{min(s.rates):,.1f}-{max(s.rates):,.1f} | {c.get('smollm2', 0)} + "
                     f"{c.get('gemma', 0)} | {'' if s is ours else f'{r:.2f}'} |")
    paired = [a / b for a, b in zip(ours.rates, base.rates, strict=False) if b]
    lines += ["", f"Median of each round's own ratio (ours / {base.name}): "
              f"{med(paired):.2f}."]
    shared = next((s for s in sides if s.name == SHARED), None)
    if shared is not None and shared is not base:
        lines[-1] += (
            f" The pair sharing the cores is {med(base.rates) / med(shared.rates):.0f}x "
            "slower than the pinned pair: two llama.cpp contexts decoding at once, each "
            f"with {bench.threads} threads that spin at every layer's barrier, on "
            f"{bench.threads} cores, wait for a scheduler slice at the barriers whenever "
            "the other's threads hold the cores. It and the router (one llama-server per "
            f"model, `-t {bench.threads}` each: the same) ran {len(shared.rates)} rounds only, "
            "for that reason.")
    for s in sides:
        if s.failed:
            lines += ["", f"{s.name}: {len(s.failed)} round(s) failed and are left out: "
                      + "; ".join(f"`{x[:200]}`" for x in s.failed)]
    if not met:
        lines += ["", "Where our time goes (missed): each loaded model is an engine of its "
                  "own, a llama.cpp context with its own threads; when both models decode "
                  "at once and each takes every CPU, the node oversubscribes the cores as "
                  f"the pair sharing them does (rounds {min(ours.rates):,.1f}-"
                  f"{max(ours.rates):,.1f} tok/s: fast only when the scheduler happens to "
                  "let one context run its barriers uncontended)."]
    else:
        lines += ["", "Our node's engines share the CPUs while both decode "
                  "(engine/runtimes/cpu_share.py: alone an engine uses them all, two busy "
                  "ones take an equal part each), which is what the pinned pair gets from "
                  "its pinning."]
    text = "\n".join(lines) + "\n"
    if bench.args.plot is not None:
        text += "\n" + interleaved_plot(sides, base, bench.args)
    figures = {"tokens_per_s": {s.name: round(med(s.rates), 2) for s in sides},
               "ratio": round(ratio, 3)}
    checks = {"every side made tokens/s above 0": all(med(s.rates) > 0 for s in sides),
              "both models were loaded on our two-model node": both}
    return Outcome(markdown=text, figures=figures, checks=checks, met=met)


def interleaved_plot(sides: list[InterleavedSide], base: InterleavedSide,
                     args: argparse.Namespace) -> str:
    plt = _plt()
    if plt is None:
        return "(matplotlib not installed: no plot)\n"
    med = statistics.median
    fig, ax = plt.subplots(figsize=(7.6, 0.6 * len(sides) + 1.5))
    ys = list(range(len(sides)))[::-1]
    colors = {OURS_TWO: "C0", PINNED: "C2", SHARED: "C7", ROUTER: "C1"}
    mids = [med(s.rates) for s in sides]
    spans = [[m - min(s.rates) for m, s in zip(mids, sides, strict=True)],
             [max(s.rates) - m for m, s in zip(mids, sides, strict=True)]]
    ax.barh(ys, mids, 0.6, color=[colors[s.name] for s in sides], xerr=spans,
            error_kw={"elinewidth": 1, "capsize": 3, "ecolor": "0.3"})
    for y, s in zip(ys, sides, strict=True):
        ax.annotate(f" {med(s.rates):,.0f} tok/s ({med(s.rates) / med(base.rates):.2f}x)",
                    (max(s.rates), y), va="center", fontsize=8)
    ax.set_yticks(ys, [s.name for s in sides], fontsize=8)
    ax.margins(x=0.3)
    ax.set_xlabel("tokens/s (median of rounds; whiskers: the rounds' min-max)", fontsize=9)
    ax.set_title(f"SmolLM2 and Gemma interleaved, {2 * LANES} greedy requests at once\n"
                 f"(x: of {base.name.removeprefix('Shoal, ')})", fontsize=9)
    return part_plot(fig, args, "interleaved",
                     "interleaved: tokens/s of two models on one node")


# ---- memory


def idle_memory(serve: Serve) -> tuple[int, int]:
    time.sleep(0.5)
    settle([serve.pid, *children(serve.pid)])
    return memory_of(serve.pid)


def sampled(serve: Serve, key: str, prompt: str) -> int:
    """One request (16 tokens) to ``key`` on ``serve``, its RSS sampled every 20 ms while
    it runs (a kept model loads meanwhile): the most seen."""
    from concurrent.futures import ThreadPoolExecutor

    peak = 0
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, serve.port, serve.names[key], prompt, 16, stream=False)
        deadline = time.monotonic() + REQUEST_TIMEOUT
        while not fut.done() and time.monotonic() < deadline:
            peak = max(peak, memory_of(serve.pid)[0])
            time.sleep(0.02)
        fut.result(REQUEST_TIMEOUT)
    return max(peak, memory_of(serve.pid)[0])


def run_memory(bench: Bench) -> Outcome:
    args = bench.args
    models = generation_models(args)
    alone = {k: start_serve(bench, f"shoal-alone-{k}", p) for k, p in models.items()}
    two = start_serve(bench, "shoal-both", models["smollm2"], {"gemma": models["gemma"]})
    both = {"both": two}
    if not args.smoke:  # the smoke run checks the default budget only
        both["both, budgeted"] = start_serve(bench, "shoal-budget", models["smollm2"],
                                             {"gemma": models["gemma"]}, budget=args.budget)
    for s in (*alone.values(), *both.values()):
        ready(s)
    for k, s in alone.items():
        s.names[k] = models[k].stem
    for s in both.values():
        s.names["smollm2"] = models["smollm2"].stem
    texts = Texts()
    rss: dict[str, tuple[int, int]] = {}
    for k, s in alone.items():
        complete(s.port, s.names[k], texts.take(1)[0], 16, stream=False)
        rss[f"{k} alone"] = idle_memory(s)
    seen: dict[str, int] = {}
    loaded: dict[str, set[str]] = {}
    for label, s in both.items():
        seen[label] = max(sampled(s, k, texts.take(1)[0]) for k in ("smollm2", "gemma"))
        loaded[label] = shoal_loaded(s)
        rss[label] = idle_memory(s)
    budgets = {label: fleet_budget(s) for label, s in both.items()}
    said = {label: s.budget for label, s in both.items()}
    bench.commands.append(
        f"shoal serve SMOLLM2.gguf --http 127.0.0.1:0 {two.flags} (gemma imported), the same "
        f"with `--memory-budget {args.budget}`, and `shoal serve GGUF --http 127.0.0.1:0 "
        f"{alone['gemma'].flags}` for each model alone")
    return memory_report(bench, rss, seen, loaded, budgets, said, two)


def fleet_budget(serve: Serve) -> int:
    status, state = get_json(serve.port, "/v1/fleet")
    node = (state or {}).get("roles", {}).get("node") or {}
    return int(node.get("memory_budget") or 0) if status == 200 else 0


def memory_report(bench: Bench, rss: dict[str, tuple[int, int]], seen: dict[str, int],
                  loaded: dict[str, set[str]], budgets: dict[str, int],
                  said: dict[str, str], two: Serve) -> Outcome:
    alone_sum = rss["smollm2 alone"][0] + rss["gemma alone"][0]
    limit = alone_sum + MEMORY_SLACK
    both_names = {two.names["smollm2"], "gemma"}
    rows: list[dict[str, Any]] = []
    for label in budgets:
        now, hwm = rss[label]
        budget = budgets[label]
        rows.append({"label": label, "rss": now, "hwm": hwm, "seen": seen[label],
                     "budget": budget, "said": said[label],
                     "both": both_names <= loaded[label],
                     "under_sum": now <= limit,
                     "under_budget": budget > 0 and max(now, hwm, seen[label]) <= budget})
    met = all(r["under_sum"] and r["under_budget"] and r["both"] for r in rows)
    lines = [
        "### Memory", "",
        "Resident memory (VmRSS from /proc, summed over the process and its children: "
        "`shoal serve` has none, head and node run in one process) of our serve process "
        f"with SmolLM2 135M (its first model) and Gemma 3 270M (kept) loaded, idle after "
        "one request to each, against the same `shoal serve` of each model alone, idle "
        f"after one request (the same flags: `{two.flags.replace(' --serve-kept', '')}`), "
        "each in a SHOAL_HOME of its own. Once with the default budget (the node's share "
        "of this machine's RAM), once with `--memory-budget "
        f"{bench.args.budget}`, which holds both; the peak is the larger of VmHWM and the "
        "RSS sampled every 20 ms while the requests ran (and the kept model loaded).", "",
        "Target: at most the sum of each served alone plus 50 MB, never above the "
        f"node's budget. **{'Met' if met else 'Not met'}.**", "",
        "| process | budget (its start-up line / /v1/fleet) | both loaded | RSS idle MiB | "
        "peak MiB | sum alone + 50 MB, MiB | | under the budget | |",
        "|:--|:--|:--|---:|---:|---:|:--|:--|:--|",
    ]
    for name in ("smollm2 alone", "gemma alone"):
        lines.append(f"| {name} | | | {rss[name][0] / MiB:,.1f} | {rss[name][1] / MiB:,.1f} "
                     "| | | | |")
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['said']} / {r['budget'] / MiB:,.0f} MiB | "
            f"{'yes' if r['both'] else 'no'} | {r['rss'] / MiB:,.1f} | "
            f"{max(r['hwm'], r['seen']) / MiB:,.1f} | {limit / MiB:,.1f} | "
            f"{verdict_word(r['under_sum'])} | "
            f"{'yes' if r['under_budget'] else 'no'} | {verdict_word(r['under_budget'])} |")
    text = "\n".join(lines) + "\n"
    figures = {"rss_mib": {k: round(v[0] / MiB, 1) for k, v in rss.items()},
               "budget_mib": {r["label"]: round(r["budget"] / MiB) for r in rows}}
    checks = {"every process's resident memory was read": all(v[0] > 0 for v in rss.values()),
              "both models were loaded on the two-model nodes": all(r["both"] for r in rows),
              "each node said its budget": all(r["budget"] > 0 for r in rows)}
    return Outcome(markdown=text, figures=figures, checks=checks, met=met)


# ---- estimate


def gguf_shape(path: Path) -> Any:
    """The speed estimate's view of a GGUF (engine.models.fit.ModelShape) from its header:
    the shape the catalog gives its entries (the test models have none there)."""
    import gguf

    from engine.models.fit import ModelShape

    reader = gguf.GGUFReader(str(path))

    def value(key: str, default: int = 0) -> int:
        f = reader.fields.get(key)
        return int(f.parts[f.data[0]][0]) if f is not None else default

    af = reader.fields["general.architecture"]
    arch = bytes(af.parts[af.data[0]]).decode()
    layers = value(f"{arch}.block_count")
    embd = value(f"{arch}.embedding_length")
    heads = max(value(f"{arch}.attention.head_count", 1), 1)
    kv_heads = max(value(f"{arch}.attention.head_count_kv", heads), 1)
    k = value(f"{arch}.attention.key_length", embd // heads)
    v = value(f"{arch}.attention.value_length", embd // heads)
    return ModelShape(size=path.stat().st_size, layers=layers, embedding=embd,
                      kv_bytes_per_token=layers * (k + v) * kv_heads * 2,
                      context=value(f"{arch}.context_length", 2048))


def run_estimate(bench: Bench) -> Outcome:
    from engine.models.bandwidth import measure_memory_bandwidth
    from engine.models.speed import decode_tps

    args = bench.args
    models = generation_models(args)
    answers = 1 if args.smoke else max(3, min(args.rounds, 5))
    tokens = 32 if args.smoke else 128
    if args.smoke:  # one model shows the path works
        models = {"smollm2": models["smollm2"]}
    rows = []
    for key, path in models.items():
        bench.procs.stop_all()  # nothing else of ours on the CPUs
        bw = [measure_memory_bandwidth()]
        serve = ready(start_serve(bench, f"shoal-estimate-{key}", path, lanes=1))
        name = path.stem
        evals: list[float] = []
        context = 0
        for _ in range(answers):
            settle([serve.pid])
            status, body = post(serve.port, "/api/generate", {
                "model": name, "prompt": STORY, "raw": True, "stream": False,
                "options": {"num_predict": tokens, "temperature": 0}})
            if status != 200:
                raise RuntimeError(f"{serve.label}: {status} {body!r}")
            if body["eval_count"] > 1 and body["eval_duration"] > 0:
                evals.append(body["eval_count"] / (body["eval_duration"] / 1e9))
            context = body["prompt_eval_count"] + body["eval_count"]
        status, state = get_json(serve.port, "/v1/fleet")
        node_tps = float(state["nodes"][0]["decode_tps"]) if status == 200 else 0.0
        stop(serve.proc.popen)
        if not args.smoke:
            bw.append(measure_memory_bandwidth())
        shape = gguf_shape(path)
        est = decode_tps(shape, mem_bandwidth=int(statistics.median(bw)), context=context)
        span = sorted(decode_tps(shape, mem_bandwidth=b, context=context) or 0.0 for b in bw)
        typical = decode_tps(shape, mem_bandwidth=int(statistics.median(bw)))
        rows.append({"key": key, "file": path.name, "layers": shape.layers,
                     "size": shape.size, "bw": bw, "context": context,
                     "estimate": est or 0.0, "span": span, "typical": typical or 0.0,
                     "node": node_tps, "evals": evals,
                     "ratio": (est or 0.0) / node_tps if node_tps else 0.0})
        print(f"estimate {key}: node {node_tps:.1f} tok/s, answers "
              + " ".join(f"{x:.1f}" for x in evals) + f", estimate {est or 0:.1f} tok/s at "
              + " / ".join(f"{b / 1e9:.1f}" for b in bw) + " GB/s", flush=True)
    bench.commands.append("shoal serve GGUF --http 127.0.0.1:0 --max-batch 1 --max-context "
                          f"{CONTEXT} (one model at a time, for the estimate)")
    return estimate_report(bench, rows, answers, tokens)


def estimate_report(bench: Bench, rows: list[dict[str, Any]], answers: int,
                    tokens: int) -> Outcome:
    from engine.models.speed import CPU_EFFICIENCY, CPU_LAYER_S

    lo, hi = TARGET_ESTIMATE
    met = all(lo <= r["ratio"] <= hi for r in rows)
    lines = [
        "### Estimate", "",
        "Shoal's speed estimate (`engine/models/speed.py`'s `decode_tps`: CPU efficiency "
        f"{CPU_EFFICIENCY}, {CPU_LAYER_S * 1000:g} ms a layer) for each model's shape "
        "(read from its GGUF header: the file's size, layers, and KV bytes a token; the "
        "catalog has no entries for these test models), with this machine's RAM bandwidth "
        "measured in this process (`engine/models/bandwidth.py`'s "
        "`measure_memory_bandwidth`) just before the model's node started and just after "
        "it stopped, at the context the answers reached; against the decode tokens/s the "
        f"node measured: `/v1/fleet` `nodes[].decode_tps` after {answers} greedy answers "
        f"of {tokens} tokens on one lane (`shoal serve GGUF --max-batch 1 --max-context "
        f"{CONTEXT}`, one model at a time, nothing else of this benchmark running; the "
        "node's figure is the median of its start-up warm-up and the answers). The answers' "
        "own rate (`/api/generate`'s `eval_count` / `eval_duration`) is there as a check; "
        "the estimate at the 4K context the app assumes, for reference.", "",
        f"Target: estimate / measured between {lo} and {hi}. "
        f"**{'Met' if met else 'Not met'}.**", "",
        "| model | layers | file MiB | RAM GB/s before / after | context | node's decode "
        "tok/s | answers' tok/s | estimate tok/s (over the two bandwidths) | estimate / "
        "node | | estimate at 4K context |",
        "|:--|---:|---:|:--|---:|---:|:--|:--|---:|:--|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['key']} ({r['file']}) | {r['layers']} | {r['size'] / MiB:,.1f} | "
            + " / ".join(f"{b / 1e9:.1f}" for b in r["bw"])
            + f" | {r['context']} | {r['node']:.1f} | "
            + " ".join(f"{x:.1f}" for x in r["evals"])
            + f" | {r['estimate']:.1f} ({r['span'][0]:.1f}-{r['span'][-1]:.1f}) | "
            f"{r['ratio']:.2f} | {verdict_word(lo <= r['ratio'] <= hi)} | "
            f"{r['typical']:.1f} |")
    text = "\n".join(lines) + "\n"
    figures = {"ratio": {r["key"]: round(r["ratio"], 3) for r in rows},
               "node_tps": {r["key"]: round(r["node"], 1) for r in rows},
               "estimate_tps": {r["key"]: round(r["estimate"], 1) for r in rows}}
    checks = {"the node measured a decode rate for each model": all(r["node"] > 0
                                                                    for r in rows),
              "the RAM bandwidth was measured": all(min(r["bw"]) > 0 for r in rows),
              "there is an estimate for each model": all(r["estimate"] > 0 for r in rows)}
    return Outcome(markdown=text, figures=figures, checks=checks, met=met)


# ----------------------------------------------------------------------------
# the parts and the section


PARTS = (
    Part("load", "time from a request for a kept, unloaded model to its first token, at "
         "most llama-server router's", run_load),
    Part("interleaved", "interleaved requests across two loaded models: tokens/s at least "
         "0.95x of the same requests on two single-model nodes", run_interleaved),
    Part("embeddings", "inputs per second for batches of 1, 16 and 64 short texts at least "
         "0.95x llama-server `--embeddings`", run_embeddings),
    Part("memory", "resident memory with two models loaded: at most the sum of each "
         "served alone plus 50 MB, and never above the budget", run_memory),
    Part("estimate", "the speed estimate against the measured tokens/s for both models: "
         "within 30%", run_estimate),
)


def setup_text(bench: Bench, load: tuple[float, float]) -> str:
    args = bench.args
    v = bench.versions
    reproduce = (f"`.venv/bin/python scripts/bench/models_on_demand.py --parts "
                 f"{','.join(args.parts)} --rounds {args.rounds} --batches "
                 f"{','.join(map(str, args.batch_sizes))} --tokens {args.tokens} --budget "
                 f"{args.budget}`")
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
        lines[-1] += (" Not run this time (`--parts`): "
                      + "; ".join(f"{p.name} ({p.what})" for p in waiting) + ".")
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
    ap.add_argument("--parts", default=",".join(p.name for p in PARTS),
                    help="comma-separated, of " + ", ".join(p.name for p in PARTS)
                    + " (default: all)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="measured rounds per side")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="texts per request, comma-separated")
    ap.add_argument("--model", type=Path, default=None,
                    help="the embedding GGUF (default: all-MiniLM-L6-v2, made under --cache)")
    ap.add_argument("--smollm2", type=Path, default=None,
                    help="SmolLM2 135M's GGUF (default: the project's copy under --cache)")
    ap.add_argument("--gemma", type=Path, default=None,
                    help="Gemma 3 270M's GGUF (default: the project's copy under --cache)")
    ap.add_argument("--tokens", type=int, default=32,
                    help="tokens of each interleaved request")
    ap.add_argument("--budget", default="1G",
                    help="the memory part's --memory-budget that holds both models")
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
                if part.name in args.parts:
                    t0 = time.monotonic()
                    ran.append((part, part.run(bench)))
                    print(f"part {part.name}: {time.monotonic() - t0:.0f} s", flush=True)
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
