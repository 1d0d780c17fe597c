"""Head and link overhead: streamed tokens/s and added time per token.

Side by side in one run, at 1, 16 and 64 concurrent streams:
  * in-process: the mock engine called directly (no head, no link, no HTTP);
  * fleet: the same mock engine in 4 node processes, behind a head process,
    streamed over HTTP (SSE) to this client through the encrypted link.

Both use the mock at unlimited speed, so every cost measured is Shoal's own
plus the client's. "Added time per token" is, per stream, (duration / tokens)
through the fleet minus the same in-process, as a median over streams.

Then the agents' routes against Chat Completions on the same fleets: the same
conversation streamed through /v1/chat/completions, /v1/messages (Anthropic) and
/v1/responses (OpenAI Responses), greedy so that all three relay the same tokens,
in rounds that rotate which route goes first: relayed tokens/s (unpaced) and the
added latency per token (paced).

Run: .venv/bin/python scripts/bench/head_overhead.py [--tokens 400] [--rounds 3]
     [--routes-only] [--out docs/benchmarks.md]
(--routes-only: the route comparison alone, written as its own subsection.)
Smoke (seconds; one node, 1 and 2 streams, short streams, figures checked, the report and
plot to a temp folder): .venv/bin/python scripts/bench/head_overhead.py --smoke
Traffic goes only to 127.0.0.1; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.credentials.tokens import ensure_token, token_path  # noqa: E402
from engine.runtimes.base import GenerationRequest, Sampling  # noqa: E402
from engine.runtimes.mock import MockEngine, MockTokenizer  # noqa: E402

LEVELS = (1, 16, 64)
NODES = 4
LANES = 16
ROUTES = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}
# greedy on the mock, this conversation runs 977 tokens before its end: every stream
# relays all the tokens it asks for, on every route
GREEDY_PROMPT = "bench!"
TAIL = 1 << 15  # bytes of a stream's end kept: its last event, with the usage, fits


def start(args: list[str], env: dict[str, str], pattern: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(pattern, line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise SystemExit(f"could not start {args}")


async def in_process(concurrency: int, tokens: int) -> tuple[float, list[float]]:
    engine = MockEngine(model="bench", lanes=concurrency, context_window=tokens + 512)
    tok = MockTokenizer()
    prompt = tok.encode("<|im_start|>user\nbench<|im_end|>\n<|im_start|>assistant\n")

    async def one(i: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        n = 0
        gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=tokens,
                                                sampling=Sampling(seed=i), stop_ids=frozenset()))
        async for ids in gen:
            n += len(ids)
        return n, time.perf_counter() - t0

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    total = sum(n for n, _ in results)
    return total / wall, [d / max(n, 1) for n, d in results]


async def through_head(port: int, concurrency: int, tokens: int) -> tuple[float, list[float]]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def one(i: int) -> tuple[int, float]:
            body = {"model": "bench", "stream": True, "max_tokens": tokens, "seed": i,
                    "messages": [{"role": "user", "content": "bench"}],
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            n = 0
            async with http.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"usage"' in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            return n, time.perf_counter() - t0

        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(concurrency))), 300)
        wall = time.perf_counter() - t0
    total = sum(n for n, _ in results)
    return total / wall, [d / max(n, 1) for n, d in results]


def lateness(arrivals: list[tuple[float, int]], speed: float) -> list[float]:
    """Per token: how long after its place in an ideal paced stream it arrived (ms).

    ``arrivals`` holds (time, tokens in that chunk). Token j's place is the stream's
    best offset plus j / speed, the best offset being that of the token that came
    soonest relative to its schedule, so lateness is never negative and measures
    the delays the path adds on top of the engine's own pace. The median through
    the head minus the median in-process is the head's added latency per token.
    """
    offsets: list[float] = []
    j = 0
    for t, n in arrivals:
        for _ in range(n):
            offsets.append(t - j / speed)
            j += 1
    if not offsets:
        return []
    best = min(offsets)
    return [(o - best) * 1000 for o in offsets]


async def paced_in_process(concurrency: int, tokens: int,
                           speed: float) -> tuple[float, list[float]]:
    engine = MockEngine(model="bench", lanes=concurrency, context_window=tokens + 512,
                        speed=speed)
    prompt = MockTokenizer().encode(
        "<|im_start|>user\nbench<|im_end|>\n<|im_start|>assistant\n")

    async def one(i: int) -> tuple[int, list[float]]:
        seen: list[tuple[float, int]] = []
        gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=tokens,
                                                sampling=Sampling(seed=i), stop_ids=frozenset()))
        async for ids in gen:
            seen.append((time.perf_counter(), len(ids)))
        return sum(n for _, n in seen), lateness(seen, speed)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    return sum(n for n, _ in results) / wall, [x for _, late in results for x in late]


async def paced_through_head(port: int, concurrency: int, tokens: int,
                             speed: float) -> tuple[float, list[float]]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def one(i: int) -> tuple[int, list[float]]:
            body = {"model": "bench", "stream": True, "max_tokens": tokens, "seed": i,
                    "messages": [{"role": "user", "content": "bench"}]}
            seen: list[tuple[float, int]] = []
            async with http.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        # the mock's tokens are single ASCII bytes: one character each
                        n = len(delta.get("content") or "")
                        if n:
                            seen.append((time.perf_counter(), n))
            return sum(n for _, n in seen), lateness(seen, speed)

        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(concurrency))), 300)
        wall = time.perf_counter() - t0
    return sum(n for n, _ in results) / wall, [x for _, late in results for x in late]


def route_body(route: str, tokens: int) -> dict[str, object]:
    """One streamed request of the same greedy conversation, in each route's shape."""
    messages = [{"role": "user", "content": GREEDY_PROMPT}]
    if route == "chat":
        return {"model": "bench", "stream": True, "max_tokens": tokens, "temperature": 0,
                "messages": messages, "stream_options": {"include_usage": True}}
    if route == "messages":
        return {"model": "bench", "stream": True, "max_tokens": tokens, "temperature": 0,
                "messages": messages}
    return {"model": "bench", "stream": True, "max_output_tokens": tokens, "temperature": 0,
            "input": messages}


def usage_of(route: str, line: bytes) -> int | None:
    """The completion tokens, from the one event of each route that carries them (the
    others are not parsed: the client should cost the same on every route)."""
    if route == "chat":
        if line.startswith(b"data: {") and b'"usage"' in line:
            return int(json.loads(line[6:])["usage"]["completion_tokens"])
    elif route == "messages":
        if line.startswith(b'data: {"type":"message_delta"'):
            return int(json.loads(line[6:])["usage"]["output_tokens"])
    elif line.startswith((b'data: {"type":"response.completed"',
                          b'data: {"type":"response.incomplete"')):
        return int(json.loads(line[6:])["response"]["usage"]["output_tokens"])
    return None


def delta_chars(route: str, line: bytes) -> int:
    """Characters of answer text in one event (the mock's tokens are one ASCII byte)."""
    if route == "chat":
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:])["choices"]
            return len(choices[0]["delta"].get("content") or "") if choices else 0
    elif route == "messages":
        if line.startswith(b'data: {"type":"content_block_delta"'):
            return len(json.loads(line[6:])["delta"].get("text") or "")
    elif line.startswith(b'data: {"type":"response.output_text.delta"'):
        return len(json.loads(line[6:])["delta"])
    return 0


async def through_route(port: int, route: str, concurrency: int,
                        tokens: int) -> tuple[float, list[float]]:
    """Unpaced: tokens/s relayed over all streams, and each stream's time per token."""
    url = f"http://127.0.0.1:{port}{PATHS[route]}"
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def one() -> tuple[int, float]:
            # the stream is read in whatever pieces arrive, and only its end is parsed:
            # the client costs the same on every route, whatever its events look like
            t0 = time.perf_counter()
            # the last pieces only, joined once at the end: no copy per piece, so that the
            # client's cost does not grow with the size of each route's events
            pieces: collections.deque[bytes] = collections.deque()
            held = 0
            async with http.post(url, json=route_body(route, tokens)) as r:
                assert r.status == 200, await r.text()
                async for chunk in r.content.iter_any():
                    pieces.append(chunk)
                    held += len(chunk)
                    while held - len(pieces[0]) >= TAIL:
                        held -= len(pieces.popleft())
            tail = b"".join(pieces)
            n = next(got for line in reversed(tail.split(b"\n"))
                     if (got := usage_of(route, line)) is not None)
            return n, time.perf_counter() - t0

        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one() for _ in range(concurrency))), 300)
        wall = time.perf_counter() - t0
    assert all(n == tokens for n, _ in results), [n for n, _ in results]
    return sum(n for n, _ in results) / wall, [d / max(n, 1) for n, d in results]


async def paced_route(port: int, route: str, concurrency: int, tokens: int,
                      speed: float) -> tuple[float, list[float]]:
    """Paced: tokens/s relayed, and every token's lateness (see `lateness`)."""
    url = f"http://127.0.0.1:{port}{PATHS[route]}"
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def one() -> tuple[int, list[float]]:
            seen: list[tuple[float, int]] = []
            async with http.post(url, json=route_body(route, tokens)) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    n = delta_chars(route, line)
                    if n:
                        seen.append((time.perf_counter(), n))
            return sum(n for _, n in seen), lateness(seen, speed)

        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(one() for _ in range(concurrency))), 300)
        wall = time.perf_counter() - t0
    return sum(n for n, _ in results) / wall, [x for _, late in results for x in late]


@dataclasses.dataclass
class RouteFigures:
    """One route at one level over the rounds: tokens/s relayed per round, every
    per-token figure of every round, and the head's CPU time per token per round."""

    rates: list[float] = dataclasses.field(default_factory=list)
    per: list[float] = dataclasses.field(default_factory=list)
    cpu_us: list[float] = dataclasses.field(default_factory=list)


def cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run, in nanoseconds' resolution (Linux
    /proc/PID/task/*/schedstat; /proc/PID/stat counts 10 ms ticks, too coarse for one
    stream's round)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def compare_routes(head_pid: int, levels: tuple[int, ...], rounds: int, tokens: int,
                   run: Callable[[str, int], tuple[float, list[float]]]
                   ) -> dict[tuple[int, str], RouteFigures]:
    """Each route at each level, ``rounds`` times, the order rotating every round."""
    out: dict[tuple[int, str], RouteFigures] = {}
    for c in levels:
        figs = {r: RouteFigures() for r in ROUTES}
        for k in range(rounds):
            for route in ROUTES[k % len(ROUTES):] + ROUTES[:k % len(ROUTES)]:
                before = cpu_s(head_pid)
                tps, per = run(route, c)
                figs[route].cpu_us.append((cpu_s(head_pid) - before) * 1e6 / (c * tokens))
                figs[route].rates.append(tps)
                figs[route].per += per
        for route in ROUTES:
            out[(c, route)] = figs[route]
            print(f"{c:>3} streams {route:>9}: {statistics.median(figs[route].rates):,.0f} "
                  f"tok/s, head CPU {statistics.median(figs[route].cpu_us):.1f} us/token",
                  flush=True)
    return out


def per_round_ratio(route: list[float], chat: list[float]) -> float:
    """The median over rounds of the route's figure over chat's in the same round (the
    machine's load drifts between rounds, much less within one)."""
    return statistics.median(r / c for r, c in zip(route, chat, strict=True))


def start_fleet(env: dict[str, str], tokens: int, speed: float,
                procs: list[subprocess.Popen[str]], nodes: int = NODES) -> int:
    ports = []
    for i in range(nodes):
        p, port = start(["node", "--runtime", "mock", "--model", "bench", "--identity",
                         f"b{i}", "--listen", "127.0.0.1:0", "--max-batch", str(LANES),
                         "--max-context", str(tokens + 512), "--mock-speed", str(speed)],
                        env, r" on 127\.0\.0\.1:(\d+) \(link")
        procs.append(p)
        ports.append(port)
    head, hport = start(["serve", "bench", "--runtime", "mock", "--http", "127.0.0.1:0",
                         "--fleet", ",".join(f"127.0.0.1:{p}" for p in ports),
                         "--fleet-policy", "least-loaded"],
                        env, r"at http://127\.0\.0\.1:(\d+)/v1")
    procs.append(head)
    time.sleep(1.0)
    return hport


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    procs.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400, help="tokens per stream")
    ap.add_argument("--paced-speed", type=float, default=400.0,
                    help="tokens/s per lane for the paced run (one token per message)")
    ap.add_argument("--paced-tokens", type=int, default=200, help="tokens per paced stream")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per route and level in the route comparison")
    ap.add_argument("--routes-only", action="store_true",
                    help="run the route comparison alone and rewrite only its subsection")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "head_overhead.png")
    ap.add_argument("--smoke", action="store_true",
                    help="one node, 1 and 2 streams, a round, short streams; the report to a "
                    "temp folder; exit 1 if the figures make no sense")
    args = ap.parse_args()
    args.levels, args.nodes = LEVELS, NODES
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.levels, args.nodes, args.rounds, args.routes_only = (1, 2), 1, 1, False
        args.tokens, args.paced_tokens, args.paced_speed = 60, 20, 200.0
        args.out = scratch("head-overhead") / "benchmarks.md"
        args.plot = args.out.with_name("head_overhead.png")
    home = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    atexit.register(shutil.rmtree, home, True)  # the fleet's token, nothing to keep
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    ensure_token(token_path(home))  # the link is encrypted, as in a real fleet
    procs: list[subprocess.Popen[str]] = []
    rows = []
    paced = []
    unpaced_routes: dict[tuple[int, str], RouteFigures] = {}
    paced_routes: dict[tuple[int, str], RouteFigures] = {}
    paced_ref: dict[int, float] = {}
    if args.routes_only:
        compare_only(env, args)
        return
    try:
        hport = start_fleet(env, args.tokens, 0.0, procs, args.nodes)
        asyncio.run(through_head(hport, 4, 50))  # warm connections
        for c in args.levels:
            ref_tps, ref_per = asyncio.run(in_process(c, args.tokens))
            tps, per = asyncio.run(through_head(hport, c, args.tokens))
            added = [(a - b) * 1000 for a, b in zip(sorted(per), sorted(ref_per), strict=True)]
            rows.append({"streams": c, "inproc_tps": ref_tps, "fleet_tps": tps,
                         "ratio": tps / ref_tps, "added_ms": statistics.median(added),
                         "fleet_ms_per_token": statistics.median(per) * 1000})
            print(f"{c:>3} streams: in-process {ref_tps:,.0f} tok/s, through head "
                  f"{tps:,.0f} tok/s ({tps / ref_tps:.2f}x), added "
                  f"{statistics.median(added):.3f} ms/token", flush=True)
        for route in ROUTES:  # warm every route's code path
            asyncio.run(through_route(hport, route, 4, 50))
        unpaced_routes = compare_routes(
            procs[-1].pid, args.levels, args.rounds, args.tokens,
            lambda route, c: asyncio.run(through_route(hport, route, c, args.tokens)))
        stop_all(procs)
        hport = start_fleet(env, args.paced_tokens, args.paced_speed, procs, args.nodes)
        asyncio.run(paced_through_head(hport, 4, 20, args.paced_speed))
        for c in args.levels:
            ref_tps, ref_late = asyncio.run(
                paced_in_process(c, args.paced_tokens, args.paced_speed))
            tps, late = asyncio.run(
                paced_through_head(hport, c, args.paced_tokens, args.paced_speed))
            added = statistics.median(late) - statistics.median(ref_late)
            paced.append({"streams": c, "inproc_tps": ref_tps, "fleet_tps": tps,
                          "late_inproc": statistics.median(ref_late),
                          "late_fleet": statistics.median(late), "added_ms": added,
                          "p90_fleet": statistics.quantiles(late, n=10)[-1]})
            print(f"{c:>3} paced streams: {tps:,.0f} tok/s relayed (in-process {ref_tps:,.0f}),"
                  f" added {added:.3f} ms/token (median)", flush=True)
            paced_ref[c] = statistics.median(ref_late)
        for route in ROUTES:
            asyncio.run(paced_route(hport, route, 4, 20, args.paced_speed))
        paced_routes = compare_routes(
            procs[-1].pid, args.levels, args.rounds, args.paced_tokens,
            lambda route, c: asyncio.run(paced_route(hport, route, c, args.paced_tokens,
                                                     args.paced_speed)))
    finally:
        stop_all(procs)
    write_report(rows, paced, args, route_table(unpaced_routes, paced_routes, paced_ref, args))
    if args.smoke:
        smoke_verdict(rows, paced, unpaced_routes, paced_routes)


def smoke_verdict(rows: list[dict[str, float]], paced: list[dict[str, float]],
                  unpaced_routes: dict[tuple[int, str], RouteFigures],
                  paced_routes: dict[tuple[int, str], RouteFigures]) -> None:
    from scripts.bench.smoke import verdict

    ratios = [r["ratio"] for r in rows]
    added = [r["added_ms"] for r in paced]
    routes = {f"{c} {route}": statistics.median(f.rates)
              for (c, route), f in unpaced_routes.items()}
    verdict({"ratio": ratios, "paced_added_ms": added, "route_tok_s": routes},
            {"every level streamed through the head": all(r["fleet_tps"] > 0 for r in rows),
             "a ratio to in-process was computed": all(0 < x < 10 for x in ratios),
             "the paced run measured lateness": len(added) == len(rows)
             and all(abs(x) < 1000 for x in added),
             "every route relayed tokens, paced and not": all(
                 f.rates and min(f.rates) > 0 for f in (*unpaced_routes.values(),
                                                        *paced_routes.values()))})


def compare_only(env: dict[str, str], args: argparse.Namespace) -> None:
    """The route comparison alone (both fleets), written as its own subsection."""
    procs: list[subprocess.Popen[str]] = []
    args.load_start = os.getloadavg()[0]
    try:
        hport = start_fleet(env, args.tokens, 0.0, procs, args.nodes)
        for route in ROUTES:  # warm every route's code path
            asyncio.run(through_route(hport, route, 4, 50))
        unpaced = compare_routes(
            procs[-1].pid, args.levels, args.rounds, args.tokens,
            lambda route, c: asyncio.run(through_route(hport, route, c, args.tokens)))
        stop_all(procs)
        hport = start_fleet(env, args.paced_tokens, args.paced_speed, procs, args.nodes)
        for route in ROUTES:
            asyncio.run(paced_route(hport, route, 4, 20, args.paced_speed))
        paced_ref = {c: statistics.median(asyncio.run(paced_in_process(
            c, args.paced_tokens, args.paced_speed))[1]) for c in args.levels}
        paced = compare_routes(
            procs[-1].pid, args.levels, args.rounds, args.paced_tokens,
            lambda route, c: asyncio.run(paced_route(hport, route, c, args.paced_tokens,
                                                     args.paced_speed)))
    finally:
        stop_all(procs)
    args.load_end = os.getloadavg()[0]
    lines = route_table(unpaced, paced, paced_ref, args)
    text = args.out.read_text()
    heading = "### Agent routes against Chat Completions"
    section = "\n".join(lines).lstrip("\n") + "\n"
    if heading not in text:  # at the end of the head overhead section
        start = text.find("## Head and link overhead")
        end = text.find("\n## ", start + 1) if start != -1 else -1
        at = len(text) if end == -1 else end + 1
        text = text[:at].rstrip("\n") + "\n\n" + section + ("\n" + text[at:] if end != -1
                                                            else "")
        args.out.write_text(text)
    else:
        replace_section(args.out, heading, section)
    print(f"wrote {args.out}")


def route_table(unpaced: dict[tuple[int, str], RouteFigures],
                paced: dict[tuple[int, str], RouteFigures],
                paced_ref: dict[int, float], args: argparse.Namespace) -> list[str]:
    """The agents' routes against Chat Completions, as markdown lines."""
    lines = [
        "", "### Agent routes against Chat Completions", "",
        f"The same fleet, the same greedy conversation streamed through each route (so all "
        f"three relay the same {args.tokens} tokens unpaced and {args.paced_tokens} paced), "
        f"{args.rounds} rounds per route and level, the order of the routes rotating every "
        "round. Relayed tok/s is the median of the rounds (unpaced: all tokens of all "
        "streams over the round's wall time; the client reads each stream in the pieces "
        "that arrive and parses only its last event, so it costs the same on every "
        "route). \"vs chat\" is the median over rounds of the route's figure divided by "
        "Chat Completions' in the same round (target: tok/s within 10 %, that is at least "
        "0.90). Head CPU is the time the head process's threads ran over the round (Linux "
        "schedstat) per relayed token, the cost that does not depend on what "
        "else the machine runs. ms/token is the median over every stream of every round; "
        "the added latency is the median lateness of every paced token minus the "
        "in-process median, as above."
        + (f" {os.cpu_count()} cores shared with other work; 1-minute load average "
           f"{args.load_start:.2f} at the start, {args.load_end:.2f} at the end: single "
           "rounds are noisy, the medians and ratios are what to read."
           if hasattr(args, "load_end") else ""), "",
        "| streams | route | relayed tok/s | vs chat | head CPU us/token | vs chat | "
        "ms/token through head | paced tok/s | added ms/token (paced) | "
        "vs chat (paced, ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"chat": "`/v1/chat/completions`", "messages": "`/v1/messages`",
             "responses": "`/v1/responses`"}
    for c in args.levels:
        chat = unpaced[(c, "chat")]
        chat_added = statistics.median(paced[(c, "chat")].per) - paced_ref[c]
        for route in ROUTES:
            fig = unpaced[(c, route)]
            pfig = paced[(c, route)]
            added = statistics.median(pfig.per) - paced_ref[c]
            lines.append(
                f"| {c} | {names[route]} | {statistics.median(fig.rates):,.0f} | "
                f"{per_round_ratio(fig.rates, chat.rates):.2f} | "
                f"{statistics.median(fig.cpu_us):.1f} | "
                f"{per_round_ratio(fig.cpu_us, chat.cpu_us):.2f} | "
                f"{statistics.median(fig.per) * 1000:.3f} | "
                f"{statistics.median(pfig.rates):,.0f} | {added:.3f} | "
                f"{added - chat_added:+.3f} |")
    only = " --routes-only" if args.routes_only else ""
    lines += ["", f"Command: `.venv/bin/python scripts/bench/head_overhead.py{only} --tokens "
              f"{args.tokens} --paced-tokens {args.paced_tokens} --paced-speed "
              f"{args.paced_speed:g} --rounds {args.rounds}`."]
    return lines


def write_report(rows: list[dict[str, float]], paced: list[dict[str, float]],
                 args: argparse.Namespace, routes: list[str] | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [str(int(r["streams"])) for r in rows]
        width = 0.38
        idx = range(len(xs))
        ax.bar([i - width / 2 for i in idx], [r["inproc_tps"] for r in rows], width,
               label="mock in-process")
        ax.bar([i + width / 2 for i in idx], [r["fleet_tps"] for r in rows], width,
               label=f"head + link + {args.nodes} nodes")
        ax.axhline(20000, color="grey", linestyle="--", linewidth=1, label="target 20k")
        ax.set_xticks(list(idx), xs)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("tokens/s")
        ax.set_title("Streamed tokens/s, 2 cores")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plot_line = f"\n![head overhead]({args.plot.name})\n"
    except ImportError:
        plot_line = "\n(matplotlib not installed: no plot)\n"
    lines = [
        "## Head and link overhead (`scripts/bench/head_overhead.py`)", "",
        f"{args.nodes} mock nodes x {LANES} lanes, unlimited mock speed, {args.tokens} tokens per "
        "stream, client, head and nodes on the same 2-core machine.", "",
        "| streams | mock in-process tok/s | through head tok/s | ratio | added ms/token "
        "(median) | ms/token through head |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {int(r['streams'])} | {r['inproc_tps']:,.0f} | {r['fleet_tps']:,.0f} | "
                     f"{r['ratio']:.2f} | {r['added_ms']:.3f} | {r['fleet_ms_per_token']:.3f} |")
    lines += [
        "", f"Paced: the same fleet with the mock at {args.paced_speed:g} tokens/s per lane, so "
        "every token crosses the link and the HTTP stream on its own; "
        f"{args.paced_tokens} tokens per stream. Lateness is how long after its place in an "
        "ideal paced stream a token reached the client (its place: the stream's best offset "
        "plus j / speed); the head's added latency per token is the median lateness through "
        "the head minus the median in-process. A delay that is the same for every token of a "
        "stream (one link hop and one HTTP write) shows in the unpaced table's ms/token, not "
        "here.", "",
        "| streams | relayed tok/s | in-process tok/s | median lateness in-process ms | "
        "through head ms | added ms/token | p90 through head ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in paced:
        lines.append(f"| {int(r['streams'])} | {r['fleet_tps']:,.0f} | {r['inproc_tps']:,.0f} | "
                     f"{r['late_inproc']:.3f} | {r['late_fleet']:.3f} | {r['added_ms']:.3f} | "
                     f"{r['p90_fleet']:.3f} |")
    section = "\n".join(lines) + "\n" + plot_line
    if routes:
        section += "\n".join(routes).lstrip("\n") + "\n"
    replace_section(args.out, "## Head and link overhead", section)
    print(f"wrote {args.out}")


def replace_section(path: Path, heading: str, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(heading)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1:] if end != -1 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    main()
