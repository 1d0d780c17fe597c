"""A serving engine called directly against the same engine through a Shoal head and node.

The engine is llama.cpp's ``llama-server --parallel 8`` on SmolLM2-135M-Instruct Q4_1
(built once per machine by scripts/lib/llama_server.py; started here on 127.0.0.1), or
with ``--engine vllm --upstream URL`` a vLLM server already running (scripts/gpu/vllm-node.sh).
In front of it, as processes: ``shoal node --runtime llama-server|vllm --upstream URL``
and ``shoal serve MODEL --fleet NODE`` (a head that loads only the vocabulary), linked
with a fleet token (encrypted, as in a real fleet).

At 1, 4 and 8 concurrent streams, both sides get the same chat prompts (the head renders
them; directly they go as the same token ids: llama-server ``/completion``, vLLM
``/v1/completions``), the same length (``--tokens``, greedy, both stop at the model's end
token), a warm-up round each, then ``--rounds`` rounds each, alternating which side goes
first. Each request's prompt is new to the engine (a numbered request), so neither side
gets the other's prompt cache. Tokens/s is completion tokens over a round's wall time
(median of rounds); TTFT is from sending a request to its first token (median).

Second turn: ``CONVERSATIONS`` chats of ~``--turn-tokens`` tokens through the head with
``X-Session-Id``: the first turn's TTFT against the second turn's (first prompt + answer
+ a new message), which the node sends to the slot that holds the first turn.

Run: .venv/bin/python scripts/bench/engine_node.py [--rounds 6] [--tokens 128]
     [--engine vllm --upstream http://127.0.0.1:8000 --head-model SPEC] [--out FILE]
     [--llama-server PATH]
Smoke (seconds: 1 stream, a round, 8 tokens, one short conversation, figures checked,
the report to a temp folder): .venv/bin/python scripts/bench/engine_node.py --smoke
Traffic goes only to 127.0.0.1 (and to the --upstream given); every loop is bounded; the
only processes ended are those this script started, by their pids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.credentials.tokens import ensure_token, token_path  # noqa: E402
from engine.head.prompt.model import HeadModel, load_head_model  # noqa: E402
from engine.models.embedded import ensure_embedded_default  # noqa: E402
from engine.runtimes.llamacpp import usable_cpus  # noqa: E402
from scripts.bench import node_lanes  # noqa: E402
from scripts.bench.node_lanes import (  # noqa: E402
    DEFAULT_CACHE,
    conversation,
    cpu_name,
    replace_section,
    server_version,
    stop_process,
)
from scripts.lib.llama_server import BuildFailed, ensure_llama_server  # noqa: E402
from tests.llama_server_proc import LlamaServer  # noqa: E402

LEVELS = (1, 4, 8)
PARALLEL = 8
HEADING = "## A serving engine behind a node"
TARGET_TPS = 0.95  # through head and node / direct, tokens/s, at least
TARGET_TURN = 0.1  # second-turn TTFT / first-turn TTFT through the head, at most
REQUEST_TIMEOUT = 300.0  # s, one round
START_TIMEOUT = 60.0  # s, a shoal process until its ready line
CONVERSATIONS = 3
FOLLOW_UP = "Thank you. Now list three questions a visitor might ask about these places."
TOPICS = ("a lighthouse keeper on a remote island", "the history of the printing press",
          "how bees build their hives", "a journey across the Sahara by camel",
          "the life cycle of a star", "a small bakery in Lisbon", "how volcanoes form",
          "a robot learning to paint", "the migration of monarch butterflies",
          "a detective in Victorian London", "a deep-sea expedition", "a storm at sea")


def prompt_messages(i: int) -> list[dict[str, str]]:
    """Request ``i``: a long-answer prompt that no earlier request began with."""
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Request {i:04d}. Write a long, detailed story "
             f"about {topic}. Use many paragraphs and vivid details."}]


# ---------------------------------------------------------------------------- processes


@dataclass
class Started:
    proc: subprocess.Popen[str]
    port: int


def start_shoal(args: list[str], env: dict[str, str], ready: str, log: Path) -> Started:
    """A ``shoal`` process; its port from the ready line on its stdout (bounded)."""
    err = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=err, text=True,
                            start_new_session=True)
    err.close()
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    deadline = time.monotonic() + START_TIMEOUT
    seen = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if not line:
            time.sleep(0.05)
            continue
        seen += line
        m = re.search(ready, seen)
        if m:
            return Started(proc, int(m.group(1)))
    stop_process(proc)  # type: ignore[arg-type]
    raise SystemExit(f"shoal {args[0]} did not start: {seen.strip()[-300:]} "
                     f"{log.read_text(errors='replace').strip()[-500:]}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- clients


@dataclass
class Reply:
    ttft: float
    tokens: int
    text: str = ""




class Sides:
    """How to ask the engine directly, and how to ask it through the head."""

    def __init__(self, engine: str, upstream: str, head_url: str, model: HeadModel,
                 model_name: str, tokens: int) -> None:
        self.engine = engine
        self.upstream = upstream
        self.head_url = head_url
        self.model = model
        self.model_name = model_name
        self.tokens = tokens

    async def direct(self, http: aiohttp.ClientSession, messages: list[dict[str, str]],
                     max_tokens: int | None = None) -> Reply:
        ids = self.model.render(messages, tools=None)
        n = max_tokens or self.tokens
        t0 = time.perf_counter()
        ttft = 0.0
        count = 0
        if self.engine == "llama-server":
            url = f"{self.upstream}/completion"
            body: dict[str, Any] = {"prompt": ids, "n_predict": n, "stream": True,
                                    "return_tokens": True, "cache_prompt": True,
                                    "temperature": 0.0}
        else:
            url = f"{self.upstream}/v1/completions"
            body = {"model": self.model_name, "prompt": ids, "max_tokens": n, "stream": True,
                    "temperature": 0.0, "stream_options": {"include_usage": True}}
        async with http.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.engine} answered {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                msg = json.loads(line[6:])
                if self.engine == "llama-server":
                    if (msg.get("tokens") or msg.get("content")) and not ttft:
                        ttft = time.perf_counter() - t0
                    if msg.get("stop"):
                        count = int(msg.get("tokens_predicted", 0))
                else:
                    if any(c.get("text") for c in msg.get("choices", ())) and not ttft:
                        ttft = time.perf_counter() - t0
                    if msg.get("usage"):
                        count = int(msg["usage"]["completion_tokens"])
        return Reply(ttft or time.perf_counter() - t0, count)

    async def head(self, http: aiohttp.ClientSession, messages: list[dict[str, str]],
                   max_tokens: int | None = None, session: str | None = None) -> Reply:
        body = {"model": self.model_name, "messages": messages,
                "max_tokens": max_tokens or self.tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        headers = {"X-Session-Id": session} if session else {}
        t0 = time.perf_counter()
        ttft = 0.0
        count = 0
        text: list[str] = []
        async with http.post(f"{self.head_url}/v1/chat/completions", json=body,
                             headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"the head answered {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    raise RuntimeError(f"the head failed the stream: {msg['error']}")
                for choice in msg.get("choices", ()):
                    if choice["delta"].get("content"):
                        ttft = ttft or time.perf_counter() - t0
                        text.append(choice["delta"]["content"])
                if msg.get("usage"):
                    count = int(msg["usage"]["completion_tokens"])
        return Reply(ttft or time.perf_counter() - t0, count, "".join(text))


# ---------------------------------------------------------------------------- measures


@dataclass
class Run:
    tps: list[float] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # why requests failed, one line each
    cpu_head: float = 0.0  # s of CPU of the head, the node, the engine in this side's rounds
    cpu_node: float = 0.0
    cpu_engine: float = 0.0

    @property
    def tps_median(self) -> float:
        return statistics.median(self.tps) if self.tps else 0.0

    @property
    def ttft_median(self) -> float:
        return statistics.median(r.ttft for r in self.replies) if self.replies else 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)


async def round_of(send: Callable[[list[dict[str, str]]], Awaitable[Reply]],
                   batch: list[list[dict[str, str]]]
                   ) -> tuple[float, list[Reply], list[str]]:
    """Tokens/s of the round, the answers, and why any request failed (counted apart)."""
    t0 = time.perf_counter()
    got = await asyncio.wait_for(asyncio.gather(*(send(p) for p in batch),
                                                return_exceptions=True), REQUEST_TIMEOUT)
    wall = time.perf_counter() - t0
    replies = [r for r in got if isinstance(r, Reply)]
    failed = [str(r)[:300] for r in got if not isinstance(r, Reply)]
    for r in got:
        if isinstance(r, BaseException) and not isinstance(r, RuntimeError | aiohttp.ClientError):
            raise r
    return sum(r.tokens for r in replies) / wall, replies, failed


async def level(sides: Sides, n: int, rounds: int, first: int,
                pids: tuple[int, int, int]) -> tuple[Run, Run, int]:
    """Warm-up, then ``rounds`` rounds of ``n`` streams each side; new prompts every time."""
    direct, through = Run(), Run()
    nxt = first
    # a new connection per request on both sides: llama-server closes a connection after a
    # streamed answer (while announcing keep-alive), so a pooled one can be dead on reuse
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        order: list[tuple[Callable[[list[dict[str, str]]], Awaitable[Reply]], Run]] = [
            (lambda p: sides.direct(http, p), direct), (lambda p: sides.head(http, p), through)]
        for send, _ in order:  # warm-up
            await round_of(send, [prompt_messages(nxt + i) for i in range(n)])
            nxt += n
        for r in range(rounds):
            for send, run in order if r % 2 == 0 else order[::-1]:
                batch = [prompt_messages(nxt + i) for i in range(n)]
                nxt += n
                c0 = [cpu_seconds(p) for p in pids]
                tps, replies, failed = await round_of(send, batch)
                c1 = [cpu_seconds(p) for p in pids]
                run.cpu_head += c1[0] - c0[0]
                run.cpu_node += c1[1] - c0[1]
                run.cpu_engine += c1[2] - c0[2]
                run.tps.append(tps)
                run.replies.extend(replies)
                run.failed.extend(failed)
    return direct, through, nxt


@dataclass
class Turns(node_lanes.Turns):
    """node_lanes' two-turn figures, plus the requests that failed."""

    failed: list[str] = field(default_factory=list)


async def turns(sides: Sides, convs: list[list[dict[str, str]]], tokens: int) -> Turns:
    """Two turns of each conversation through the head, one session each."""
    out = Turns()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
                                     connector=aiohttp.TCPConnector(force_close=True)) as http:
        for i, messages in enumerate(convs):
            session = f"bench-turns-{os.getpid()}-{i}"
            try:
                r1 = await sides.head(http, messages, max_tokens=tokens, session=session)
                follow = [*messages, {"role": "assistant", "content": r1.text},
                          {"role": "user", "content": FOLLOW_UP}]
                r2 = await sides.head(http, follow, max_tokens=tokens, session=session)
            except (RuntimeError, aiohttp.ClientError) as exc:
                out.failed.append(str(exc)[:300])
                continue
            out.first.append(r1.ttft)
            out.second.append(r2.ttft)
            out.prompt1.append(len(sides.model.render(messages, tools=None)))
            out.prompt2.append(len(sides.model.render(follow, tools=None)))
    return out


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--engine", choices=("llama-server", "vllm"), default="llama-server")
    ap.add_argument("--upstream", default=None,
                    help="an engine already running (required with --engine vllm); "
                         "without it a llama-server is started here")
    ap.add_argument("--head-model", default=None,
                    help="the head's model (GGUF path or org/repo:QUANT) with the engine's "
                         "tokenizer; default the embedded SmolLM2")
    ap.add_argument("--model-name", default=None,
                    help="the name the node announces (default: the engine's)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per side and level")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--turn-tokens", type=int, default=1500,
                    help="length of a conversation's first turn")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="threads of each engine (default: the CPUs this process may use)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="where the model and the logs go")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                    help="the report (the section is replaced); '-' prints only")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "engine_node.png")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="this llama-server binary (default: the one built for this machine, "
                    "built once if need be)")
    ap.add_argument("--smoke", action="store_true",
                    help="1 stream, a round of 8 tokens, one short conversation, the report "
                    "to a temp folder; exit 1 if the figures make no sense")
    args = ap.parse_args()
    conversations = CONVERSATIONS
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.levels, args.rounds, args.tokens, args.turn_tokens = "1", 1, 8, 120
        args.threads = 1  # no thread waits at a barrier for a core a busy machine lends late
        conversations = 1
        args.out = scratch("engine-node") / "benchmarks.md"
        args.plot = args.out.with_name("engine_node.png")
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if args.engine == "vllm" and not args.upstream:
        raise SystemExit("--engine vllm needs --upstream URL of a running vLLM "
                         "(scripts/gpu/vllm-node.sh starts one)")
    if not levels or min(args.rounds, args.tokens, *levels) < 1:
        raise SystemExit("--rounds, --tokens and --levels must be positive")
    args.cache = args.cache.expanduser()
    args.cache.mkdir(parents=True, exist_ok=True)
    head_spec = args.head_model or str(ensure_embedded_default(args.cache / "home"))
    model = load_head_model("llamacpp", head_spec, name="bench")
    home = Path(tempfile.mkdtemp(prefix="shoal-bench-engine-node-"))
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONPATH": str(ROOT),
           "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}
    ensure_token(token_path(home))  # an encrypted link, as in a real fleet
    server: LlamaServer | None = None
    procs: list[subprocess.Popen[str]] = []
    version = "(running elsewhere)"
    try:
        upstream = args.upstream
        if upstream is None:
            try:
                binary = args.llama_server or ensure_llama_server()
            except BuildFailed as exc:
                raise SystemExit(f"llama-server: {exc}") from None
            version = server_version(binary)
            window = max(2048, args.turn_tokens + 2 * args.tokens + 200)
            server = LlamaServer(binary, Path(head_spec), parallel=PARALLEL,
                                 ctx_per_slot=window, threads=args.threads,
                                 log=args.cache / "engine-node-llama-server.log",
                                 extra=("--no-kv-unified", "--cache-ram", "0", "--metrics"))
            server.start()
            server.wait_ready_sync()
            upstream = server.url
        node_args = ["node", "--runtime", args.engine, "--upstream", upstream,
                     "--listen", "127.0.0.1:0", "--identity", "engine"]
        if args.engine == "vllm":
            node_args += ["--max-batch", str(PARALLEL)]
        if args.model_name:
            node_args += ["--model-name", args.model_name]
        node = start_shoal(node_args, env, r" on 127\.0\.0\.1:(\d+) \(link",
                           args.cache / "engine-node-node.log")
        procs.append(node.proc)
        head = start_shoal(["serve", head_spec, "--http", "127.0.0.1:0", "--fleet",
                            f"127.0.0.1:{node.port}"], env, r"at http://127\.0\.0\.1:(\d+)/v1",
                           args.cache / "engine-node-head.log")
        procs.append(head.proc)
        head_url = f"http://127.0.0.1:{head.port}"
        name = asyncio.run(served_model(head_url))
        sides = Sides(args.engine, upstream, head_url, model, name, args.tokens)
        load0 = os.getloadavg()[0]
        print(f"{args.engine} at {upstream}, model {name}; head {head_url}; "
              f"load average {load0:.2f}", flush=True)
        rows = []
        nxt = 0
        for n in levels:
            engine_pid = server.pid if server is not None else 0
            direct, through, nxt = asyncio.run(level(sides, n, args.rounds, nxt,
                                                     (head.proc.pid, node.proc.pid,
                                                      engine_pid)))
            rows.append({"n": n, "direct": direct, "head": through})
            print(f"{n} streams: direct {direct.tps_median:,.1f} tok/s TTFT "
                  f"{direct.ttft_median * 1000:,.0f} ms; through head and node "
                  f"{through.tps_median:,.1f} tok/s TTFT {through.ttft_median * 1000:,.0f} ms; "
                  f"ratio {through.tps_median / direct.tps_median:.3f}; head+node CPU "
                  f"{cpu_per_k(through):.2f} s per 1k tokens; engine CPU per 1k tokens direct "
                  f"{engine_per_k(direct):.1f} s, through {engine_per_k(through):.1f} s; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            print("  rounds tok/s direct: " + " ".join(f"{x:.0f}" for x in direct.tps)
                  + "; through: " + " ".join(f"{x:.0f}" for x in through.tps)
                  + f"; failed direct {len(direct.failed)}, through {len(through.failed)}"
                  + (f" ({through.failed[0]})" if through.failed else ""), flush=True)
        convs = [conversation(model, seed, args.turn_tokens) for seed in range(conversations)]
        turn = asyncio.run(turns(sides, convs, args.tokens))
        print(f"second turn: first {statistics.median(turn.first or [0]) * 1000:,.0f} ms, "
              f"second {statistics.median(turn.second or [0]) * 1000:,.0f} ms, ratio "
              f"{turn.ratio:.3f}; failed {len(turn.failed)}", flush=True)
        load = (load0, os.getloadavg()[0])
    finally:
        for proc in reversed(procs):
            stop_process(proc)  # type: ignore[arg-type]
        if server is not None:
            server.stop_sync()
        shutil.rmtree(home, ignore_errors=True)  # the fleet's token; the logs are in --cache
    report(rows, turn, args, engine=args.engine, version=version, load=load)
    if args.smoke:
        smoke_verdict(rows, turn)


def smoke_verdict(rows: list[dict[str, Any]], turn: Turns) -> None:
    from scripts.bench.smoke import verdict

    verdict({"ratio": [r["ratio"] for r in rows],
             "tok_s": [(r["direct"].tps_median, r["head"].tps_median) for r in rows],
             "failed": [len(r["direct"].failed) + len(r["head"].failed) for r in rows],
             "turn_ratio": turn.ratio, "turn_failed": len(turn.failed)},
            {"both sides streamed at every level": all(
                r["direct"].tokens > 0 and r["head"].tokens > 0 for r in rows),
             "no request failed": not any(r["direct"].failed or r["head"].failed
                                          for r in rows) and not turn.failed,
             "the ratio through head and node was computed": all(
                 0 < r["ratio"] < 10 for r in rows),
             "the second turn was timed": bool(turn.first) and 0 < turn.ratio < 100})


async def served_model(head_url: str) -> str:
    """The model the head serves, once its node is linked (bounded wait)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            async with http.get(f"{head_url}/v1/fleet") as r:
                fleet = await r.json()
            nodes = [n for n in fleet.get("nodes", ()) if n.get("state") == "ready"]
            if nodes:
                return str(nodes[0]["model"])
            await asyncio.sleep(0.1)
    raise SystemExit("the node did not link with the head within 20 s")


def cpu_per_k(run: Run) -> float:
    return (run.cpu_head + run.cpu_node) / max(run.tokens, 1) * 1000


def engine_per_k(run: Run) -> float:
    return run.cpu_engine / max(run.tokens, 1) * 1000


# ---------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(rows: list[dict[str, Any]], turn: Turns, args: argparse.Namespace, *,
           engine: str, version: str, load: tuple[float, float]) -> None:
    med = statistics.median
    what = (f"llama-server `--parallel {PARALLEL}` (build {version}, "
            f"{args.threads} threads, `--no-kv-unified --cache-ram 0 --metrics`)"
            if engine == "llama-server" else f"vLLM at {args.upstream}")
    lines = [
        f"{HEADING} (`scripts/bench/engine_node.py`)", "",
        f"The same engine, {what} on SmolLM2-135M-Instruct Q4_1, called directly, "
        "against the same engine called through a head and a node (`shoal serve MODEL "
        f"--fleet NODE` and `shoal node --runtime {engine} --upstream URL`, processes on "
        "127.0.0.1, encrypted link), on "
        f"the same {os.cpu_count()}-core machine ({cpu_name()}; 1-minute load average "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end: other work shares these "
        "cores). Both sides get the same chat prompts (directly as the token ids the head's "
        f"template renders), greedy, up to {args.tokens} tokens each, stopping at the "
        "model's end token; every request's prompt is new to the engine. Per level a "
        f"warm-up round each, then {args.rounds} rounds each, alternating which side goes "
        "first. Tokens/s: completion tokens over a round's wall time (median of rounds); "
        "TTFT: from sending to the first token (median of requests). Head+node CPU: "
        "seconds of CPU the two Shoal processes used per thousand tokens relayed (the same "
        "as ms per token); engine CPU likewise for llama-server. The machine is shared with "
        "other work, so single rounds can be several times slower than their neighbours "
        "(min-max column): read the medians and ratios with that spread in mind.", "",
        f"Target: through head and node at least {TARGET_TPS}x direct tokens/s at every "
        f"level; second-turn TTFT with affinity at most {TARGET_TURN}x the first's.", "",
        "| streams | direct tok/s | through tok/s | ratio | | direct TTFT ms | through "
        "TTFT ms | TTFT ratio | tokens/request direct / through | head+node CPU s per 1k "
        "tokens | engine CPU s per 1k tokens direct / through | rounds tok/s min-max "
        "direct / through | failed direct / through |",
        "|---:|---:|---:|---:|:--|---:|---:|---:|:--|---:|:--|:--|:--|",
    ]
    misses = []
    for row in rows:
        d, h = row["direct"], row["head"]
        row["ratio"] = tr = h.tps_median / d.tps_median if d.tps_median else float("nan")
        row["ttft_ratio"] = lr = (h.ttft_median / d.ttft_median if d.ttft_median
                                  else float("nan"))
        if not tr >= TARGET_TPS:
            misses.append(f"tokens/s at {row['n']} streams")
        per = (f"{med(r.tokens for r in d.replies or [Reply(0, 0)]):.0f} / "
               f"{med(r.tokens for r in h.replies or [Reply(0, 0)]):.0f}")
        lines.append(
            f"| {row['n']} | {d.tps_median:,.1f} | {h.tps_median:,.1f} | {tr:.3f} | "
            f"{verdict(tr >= TARGET_TPS)} | {d.ttft_median * 1000:,.1f} | "
            f"{h.ttft_median * 1000:,.1f} | {lr:.2f} | {per} | {cpu_per_k(h):.2f} | "
            f"{engine_per_k(d):.1f} / {engine_per_k(h):.1f} | "
            f"{min(d.tps):.0f}-{max(d.tps):.0f} / {min(h.tps):.0f}-{max(h.tps):.0f} | "
            f"{len(d.failed)} / {len(h.failed)} |")
        if h.failed:
            misses.append(f"{len(h.failed)} failed requests through the head at {row['n']} "
                          f"streams ({h.failed[0]})")
    ok_turn = turn.ratio <= TARGET_TURN
    if not ok_turn:
        misses.append("second-turn TTFT")
    if turn.failed:
        misses.append(f"{len(turn.failed)} failed conversations ({turn.failed[0]})")
    if not turn.first:
        turn.first, turn.second, turn.prompt1, turn.prompt2 = [0.0], [0.0], [0], [0]
    lines += [
        "",
        f"Second turn through the head ({len(turn.first)} conversations, `X-Session-Id`, "
        f"median): a first turn of {int(med(turn.prompt1))} prompt tokens, then the same "
        f"session's second turn of {int(med(turn.prompt2))} tokens (first prompt + answer + "
        "a new message), which the node sends to the slot holding the first turn "
        f"(`id_slot`, `cache_prompt`): first {med(turn.first) * 1000:,.1f} ms, second "
        f"{med(turn.second) * 1000:,.1f} ms, ratio {turn.ratio:.3f} "
        f"({verdict(ok_turn)}).",
    ]
    if misses:
        lines += ["", "Missed: " + ", ".join(misses) + ". " + explain(rows)]
    text = "\n".join(lines) + "\n" + plot(rows, turn, args)
    print("\n".join(lines), flush=True)
    if str(args.out) != "-":
        replace_section(args.out, HEADING, text)
        print(f"wrote {args.out}")


def explain(rows: list[dict[str, Any]]) -> str:
    """What the measures say about a missed tokens/s target: the relay's own CPU and the
    engine's extra CPU per token against direct, and how far rounds of one side spread."""
    parts = []
    for row in rows:
        if row["ratio"] >= TARGET_TPS:
            continue
        d, h = row["direct"], row["head"]
        relay = cpu_per_k(h) / engine_per_k(h) if engine_per_k(h) else 0.0
        extra = engine_per_k(h) / engine_per_k(d) - 1 if engine_per_k(d) else 0.0
        spread = min(max(d.tps) / min(d.tps), max(h.tps) / min(h.tps))
        parts.append(
            f"At {row['n']} streams the head and node used {cpu_per_k(h):.2f} ms of CPU per "
            f"token ({relay:.1%} of the engine's), and the engine used "
            f"{engine_per_k(h):.1f} ms per token through them against {engine_per_k(d):.1f} "
            f"ms directly ({extra:+.1%}): on this {os.cpu_count()}-core machine the engine's "
            "threads, the relay and the client share the cores, so each relay wakeup takes a "
            "core from one engine thread while the other waits at their barrier. Together "
            f"these account for a ratio of about {1 / (1 + relay + max(extra, 0.0)):.2f}; the "
            f"rest is within the spread of rounds of one side (fastest/slowest {spread:.1f}x) "
            "from other work on the machine.")
    return " ".join(parts)


def plot(rows: list[dict[str, Any]], turn: Turns, args: argparse.Namespace) -> str:
    if str(args.out) == "-":
        return ""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n(matplotlib not installed: no plot)\n"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(11, 3.6),
                                        gridspec_kw={"width_ratios": [3, 3, 2]})
    idx = list(range(len(rows)))
    xs = [str(r["n"]) for r in rows]
    w = 0.38
    for ax, key, scale, title, unit in (
            (ax1, "tps_median", 1.0, "Throughput (median of rounds)", "aggregate tokens/s"),
            (ax2, "ttft_median", 1000.0, "Median time to first token", "ms")):
        d = [getattr(r["direct"], key) * scale for r in rows]
        h = [getattr(r["head"], key) * scale for r in rows]
        ax.bar([i - w / 2 for i in idx], d, w, label="direct")
        ax.bar([i + w / 2 for i in idx], h, w, label="through head + node")
        for i in idx:
            ax.annotate(f"{h[i] / d[i]:.2f}x" if d[i] else "", (i, max(d[i], h[i])),
                        ha="center", va="bottom", fontsize=8)
        ax.margins(y=0.25)
        ax.set_xticks(idx, xs)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    med = statistics.median
    ax3.bar([0, 1], [med(turn.first) * 1000, med(turn.second) * 1000], 0.5)
    ax3.set_xticks([0, 1], ["turn 1", "turn 2"])
    ax3.set_ylabel("ms")
    ax3.set_title(f"Affinity: TTFT, {int(med(turn.prompt1))}-token chat", fontsize=10)
    fig.suptitle(f"{args.engine}, SmolLM2-135M Q4_1, {args.tokens} tokens/request", fontsize=9)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    rel = os.path.relpath(args.plot, args.out.parent)
    return f"\n![a serving engine behind a node]({rel})\n"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
