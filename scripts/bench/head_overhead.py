"""Head and link overhead: streamed tokens/s and added time per token.

Side by side in one run, at 1, 16 and 64 concurrent streams:
  * in-process: the mock engine called directly (no head, no link, no HTTP);
  * fleet: the same mock engine in 4 node processes, behind a head process,
    streamed over HTTP (SSE) to this client through the encrypted link.

Both use the mock at unlimited speed, so every cost measured is Shoal's own
plus the client's. "Added time per token" is, per stream, (duration / tokens)
through the fleet minus the same in-process, as a median over streams.

Run: .venv/bin/python scripts/bench/head_overhead.py [--tokens 400] [--out docs/benchmarks.md]
Traffic goes only to 127.0.0.1; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.runtimes.base import GenerationRequest, Sampling  # noqa: E402
from engine.runtimes.mock import MockEngine, MockTokenizer  # noqa: E402
from engine.secrets import ensure_token, token_path  # noqa: E402

LEVELS = (1, 16, 64)
NODES = 4
LANES = 16


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


def start_fleet(env: dict[str, str], tokens: int, speed: float,
                procs: list[subprocess.Popen[str]]) -> int:
    ports = []
    for i in range(NODES):
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
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "head_overhead.png")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONPATH": str(ROOT)}
    ensure_token(token_path(home))  # the link is encrypted, as in a real fleet
    procs: list[subprocess.Popen[str]] = []
    rows = []
    paced = []
    try:
        hport = start_fleet(env, args.tokens, 0.0, procs)
        asyncio.run(through_head(hport, 4, 50))  # warm connections
        for c in LEVELS:
            ref_tps, ref_per = asyncio.run(in_process(c, args.tokens))
            tps, per = asyncio.run(through_head(hport, c, args.tokens))
            added = [(a - b) * 1000 for a, b in zip(sorted(per), sorted(ref_per), strict=True)]
            rows.append({"streams": c, "inproc_tps": ref_tps, "fleet_tps": tps,
                         "ratio": tps / ref_tps, "added_ms": statistics.median(added),
                         "fleet_ms_per_token": statistics.median(per) * 1000})
            print(f"{c:>3} streams: in-process {ref_tps:,.0f} tok/s, through head "
                  f"{tps:,.0f} tok/s ({tps / ref_tps:.2f}x), added "
                  f"{statistics.median(added):.3f} ms/token", flush=True)
        stop_all(procs)
        hport = start_fleet(env, args.paced_tokens, args.paced_speed, procs)
        asyncio.run(paced_through_head(hport, 4, 20, args.paced_speed))
        for c in LEVELS:
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
    finally:
        stop_all(procs)
    write_report(rows, paced, args)


def write_report(rows: list[dict[str, float]], paced: list[dict[str, float]],
                 args: argparse.Namespace) -> None:
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
               label="head + link + 4 nodes")
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
        f"{NODES} mock nodes x {LANES} lanes, unlimited mock speed, {args.tokens} tokens per "
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
