"""Node memory against llama.cpp's own ``llama-server``: one KV pool, a budget, a host cache.

Side by side in one run, on the same model, threads and budget (llama-server's
``--cache-ram`` set to what our host-memory prompt cache may hold in it):

  1. Resident memory, SmolLM2-135M with 8 lanes: our engine alone in a child
     process (``node_memory_runner.py``, which imports what a node's process
     does), its ``VmRSS`` idle after load, its peak during 8 concurrent streams
     (sampled every 20 ms, median of rounds) and ``VmHWM`` at the end; against
     ``llama-server -np 8 -c 8192 --kv-unified`` and, as the second reference,
     ``-np 8 -c 65536 --no-kv-unified`` (8 x 8,192: what our node held before one
     pool). Each pool's size in cells and MiB is read from llama.cpp's own log
     line (``llama_kv_cache: size = ...``), ours and the server's alike.
  2. The longest prompt one session takes with 8 lanes under a 4 GiB budget, on
     Gemma 3 270M (a 32,768-token model): ``engine.info.context_window``; with
     ``--long-prompt`` a prompt that fills the window is run too (minutes of
     prefill on a small CPU), its TTFT and the process's peak memory reported.
  3. A conversation that returns after its lane was reused: 1 lane, each of
     ``--conversations`` ~1,500-token first turns (a fresh prefill) pushes the one
     before out of the lane (ours into its host cache; llama-server's idle slot into
     its ``--cache-ram`` cache), then each conversation's second turn comes back
     and is restored from there. TTFT of the returning turn over the fresh one
     (medians), and the prompt tokens our stats say came from the host cache.
  4. Tokens/s at 1, 2, 4 and 8 lanes against llama-server with its unified KV,
     one pool of 8,192 cells on both sides (``node_lanes.py``'s rounds, reused); then
     at 8 lanes against llama-server without its host cache (``--cache-ram 0``: it then
     keeps idle slots in the pool instead of saving and clearing them at each new task)
     and with one stream of 8,192 cells per slot (``-c 65536 --no-kv-unified``).
  5. ``--kv-type q8_0``: tokens/s at 8 lanes and the pool's size, f16 and q8_0,
     ours and llama-server (``-ctk q8_0 -ctv q8_0 -fa on``).

It writes its section of docs/benchmarks.md (medians, ratios, PASS/FAIL per
target) and the plot docs/node_memory.png.

Run: .venv/bin/python scripts/bench/node_memory.py [--rounds 4] [--mem-rounds 3]
     [--long-prompt] [--model SMOLLM2.gguf] [--gemma GEMMA.gguf] [--llama-server PATH]
     [--cache ~/.cache/shoal-bench] [--out docs/benchmarks.md] [--plot docs/node_memory.png]
Smoke (every part once at its smallest: 1 lane for the tokens/s table, a round of 8 tokens,
two short conversations; figures checked, the report and plot to a temp folder):
     .venv/bin/python scripts/bench/node_memory.py --smoke
Traffic goes only to 127.0.0.1; every wait is bounded; the only processes ended are
the llama-server processes and engine runners this script started, by their pids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.head.prompt.model import HeadModel, load_head_model  # noqa: E402
from engine.models.embedded import ensure_test_gemma  # noqa: E402
from engine.runtimes.llamacpp import LlamaCppVocab, usable_cpus  # noqa: E402
from engine.sizes import GiB, MiB  # noqa: E402
from scripts.bench import node_lanes as nl  # noqa: E402

HEADING = "## Node memory against llama-server"
RUNNER = Path(__file__).with_name("node_memory_runner.py")
LANES = 8
WINDOW = 8192  # SmolLM2's trained window
LONG_BUDGET = 4 * GiB
TARGET_RSS = 500 * MiB  # our process's peak at 8 streams, at most
TARGET_WINDOW = 32768  # Gemma 3 270M's whole window, with 8 lanes in 4 GiB
TARGET_RETURN = 0.15  # returning TTFT / fresh TTFT, at most
TARGET_TPS = 0.98  # ours / llama-server tokens/s: the lowest of the earlier runs (0.98-1.06x)
START_TIMEOUT = 180.0  # s, a runner until its model is loaded
ROUND_TIMEOUT = 300.0  # s, one round of requests
LONG_TIMEOUT = 1800.0  # s, one window-long prefill on a small CPU
SAMPLE_S = 0.02
VERBOSE_SERVER = ("-lv", "4")  # llama-server logs its KV pool's size (a few lines a request)
_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*\d+ layers,"
                      r"\s*\d+/(\d+) seqs")
_SLOT_CTX = re.compile(r"n_ctx_slot = (\d+)")

T = TypeVar("T")


# ----------------------------------------------------------------------------
# memory of a process


def proc_mem(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes, from /proc/PID/status; (0, 0) once it is gone."""
    rss = hwm = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


async def peak_while(pid: int, work: Awaitable[T]) -> tuple[T, int]:
    """``work``'s result and the highest VmRSS of ``pid`` seen while it ran."""
    peak = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc_mem(pid)[0])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), SAMPLE_S)

    sampler = asyncio.create_task(sample())
    try:
        result = await work
    finally:
        done.set()
        await sampler
    return result, max(peak, proc_mem(pid)[0])


def kv_pool(log: Path) -> tuple[float, list[int]]:
    """The KV pool llama.cpp made, from its log: MiB over all its caches (Gemma's sliding-
    window layers have one of their own), and each cache's cells over all its streams
    (``--no-kv-unified``: one stream of ``-c / N`` cells per slot)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = _KV_LINE.findall(text)
    return (sum(float(m) for m, _, _ in found),
            [int(c) * int(streams) for _, c, streams in found])


# ----------------------------------------------------------------------------
# our engine in a process of its own


class Ours:
    """``node_memory_runner.py`` in a child process that this script started; ended by
    its pid (``quit``, then SIGTERM, then SIGKILL)."""

    def __init__(self, conf: dict[str, Any], log: Path) -> None:
        self.conf = conf
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> dict[str, Any]:
        env = {**os.environ, "SHOAL_LLAMA_LOG": "1"}
        with self.log.open("wb") as fh:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, str(RUNNER), json.dumps(self.conf),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh, env=env,
                start_new_session=True, limit=1 << 24)
        self.ready = (await self._answer(START_TIMEOUT))["ready"]
        return self.ready

    async def ask(self, cmd: dict[str, Any], limit_s: float = ROUND_TIMEOUT) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._answer(limit_s)

    async def _answer(self, limit_s: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), limit_s)
        if not line:
            tail = self.log.read_text(errors="replace").splitlines()[-5:]
            raise RuntimeError(f"our runner ended ({self.proc.returncode}): {' | '.join(tail)}")
        out: dict[str, Any] = json.loads(line)
        return out

    async def gen(self, prompts: list[list[int]], max_tokens: int, *,
                  sessions: list[str] | None = None, stop_ids: frozenset[int] = frozenset(),
                  limit_s: float = ROUND_TIMEOUT) -> dict[str, Any]:
        return await self.ask({"op": "gen", "prompts": prompts, "max_tokens": max_tokens,
                               "sessions": sessions, "stop_ids": sorted(stop_ids)}, limit_s)

    async def close(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(OSError, RuntimeError):
            assert proc.stdin is not None
            proc.stdin.write(b'{"op": "quit"}\n')
            await proc.stdin.drain()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def ours(conf: dict[str, Any], log: Path) -> Any:
    runner = Ours(conf, log)
    try:
        await runner.start()
        yield runner
    finally:
        await runner.close()


@contextlib.asynccontextmanager
async def server(binary: Path, model: Path, n: int, ctx: int, args: argparse.Namespace,
                 log: str, *, unified: bool = True, cache_ram: int = 0,
                 extra: tuple[str, ...] = ()) -> Any:
    srv = nl.Server(binary, model, n, ctx, args.threads, args.cache / log, unified=unified,
                    cache_ram=cache_ram, extra=(*VERBOSE_SERVER, *extra))
    srv.start()
    try:
        await srv.wait_healthy()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as http:
            yield srv, http
    finally:
        srv.stop()


# ----------------------------------------------------------------------------
# 1. resident memory at 8 lanes


@dataclass
class Memory:
    name: str
    cells: int = 0
    pool_mib: float = 0.0
    idle: int = 0  # VmRSS after load, bytes
    peaks: list[int] = field(default_factory=list)  # per round, during the streams
    hwm: int = 0  # VmHWM at the end
    tps: list[float] = field(default_factory=list)
    window: int = 0  # tokens one session may hold
    note: str = ""
    caches: list[int] = field(default_factory=list)  # cells of each of llama.cpp's caches
    base: int = 0  # ours: the process before the model loaded (interpreter, modules)

    @property
    def peak(self) -> int:
        return int(statistics.median(self.peaks)) if self.peaks else 0


async def memory(binary: Path, smol: Path, args: argparse.Namespace,
                 prompts: list[list[int]]) -> tuple[list[Memory], int]:
    """Ours (f16 with streams, then q8_0 idle: its pool), llama-server with one pool and
    with 8 (streams), then with one q8_0 pool (idle); and the host-cache size that
    llama-server's --cache-ram was given (MiB)."""
    rows: list[Memory] = []
    conf = {"model": str(smol), "lanes": LANES, "memory_budget": args.budget,
            "threads": args.threads}
    cache_mib = 0
    for kv in ("f16", "q8_0"):
        log = args.cache / f"node-memory-ours-{kv}.log"
        async with ours({**conf, "kv_type": kv}, log) as me:
            row = Memory(f"ours, 8 lanes, {kv}", cells=me.ready["pool_cells"],
                         window=me.ready["info"]["context_window"])
            row.idle = proc_mem(me.pid)[0]
            row.base = me.ready["rss_before_load"]
            if kv == "f16":
                cache_mib = me.ready["stats"]["host_cache_limit"] // MiB
                for r in range(args.mem_rounds):
                    block = prompts[LANES * r: LANES * (r + 1)]
                    t0 = time.perf_counter()
                    got, peak = await peak_while(me.pid, me.gen(block, args.tokens))
                    row.tps.append(sum(x["tokens"] for x in got["replies"])
                                   / (time.perf_counter() - t0))
                    row.peaks.append(peak)
                stats = (await me.ask({"op": "stats"}))["stats"]
                row.note = (f"budget {stats['mem_budget'] // MiB} MiB, host cache "
                            f"{stats['host_cache_bytes'] / MiB:.0f} of "
                            f"{stats['host_cache_limit'] // MiB} MiB")
            row.hwm = proc_mem(me.pid)[1]
        row.pool_mib = kv_pool(log)[0]
        rows.append(row)
        print(f"memory {row.name}: pool {row.cells} cells {row.pool_mib:.1f} MiB, idle "
              f"{row.idle / MiB:.0f} MiB, 8 streams {row.peak / MiB:.0f} MiB, "
              f"peak {row.hwm / MiB:.0f} MiB", flush=True)
    one = f"llama-server -np 8 -c {WINDOW} --kv-unified"
    for ctx, unified, name, extra in (
            (WINDOW, True, one, ()),
            (WINDOW * LANES, False, f"llama-server -np 8 -c {WINDOW * LANES} --no-kv-unified",
             ()),
            (WINDOW, True, f"{one} {' '.join(nl.Q8_SERVER)}", nl.Q8_SERVER)):
        log = f"node-memory-server-{ctx}{'-q8_0' if extra else ''}.log"
        async with server(binary, smol, LANES, ctx, args, log, unified=unified,
                          cache_ram=cache_mib, extra=extra) as (srv, http):
            row = Memory(name, window=WINDOW)
            row.idle = proc_mem(srv.pid)[0]
            for r in range(0 if extra else args.mem_rounds):
                block = prompts[LANES * r: LANES * (r + 1)]
                t0 = time.perf_counter()
                got, peak = await peak_while(srv.pid, asyncio.wait_for(asyncio.gather(
                    *(nl.server_one(http, srv.url, p, args.tokens) for p in block)),
                    ROUND_TIMEOUT))
                row.tps.append(sum(x[0].tokens for x in got) / (time.perf_counter() - t0))
                row.peaks.append(peak)
            row.hwm = proc_mem(srv.pid)[1]
        row.pool_mib, cells = kv_pool(args.cache / log)
        row.cells = sum(cells)
        row.note = f"--cache-ram {cache_mib}"
        rows.append(row)
        print(f"memory {row.name}: pool {row.cells} cells {row.pool_mib:.1f} MiB, idle "
              f"{row.idle / MiB:.0f} MiB, 8 streams {row.peak / MiB:.0f} MiB, "
              f"peak {row.hwm / MiB:.0f} MiB", flush=True)
    return rows, cache_mib


# ----------------------------------------------------------------------------
# 2. the longest prompt under 4 GiB


@dataclass
class Long:
    window: int = 0
    cells: int = 0
    pool_mib: float = 0.0
    idle: int = 0
    host_limit: int = 0
    ran: bool = False
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    finish: str = ""
    ttft: float = 0.0
    peak: int = 0
    mem_used: int = 0
    caches: list[int] = field(default_factory=list)
    refs: list[Memory] = field(default_factory=list)


_LONG_WORDS = nl._WORDS  # the notes of node_lanes.conversation


def long_prompt(vocab: LlamaCppVocab, n: int) -> list[int]:
    """``n`` token ids of varied notes (Gemma is a base model: plain text)."""
    rng = random.Random(7)
    ids: list[int] = []
    for _ in range(64):  # bounded: each pass adds ~200 notes (~6,000 tokens)
        notes = []
        for _ in range(200):
            a, b, c = rng.sample(_LONG_WORDS, 3)
            notes.append(f"The {a} by the {b} counted {rng.randint(2, 990)} {c} on day "
                         f"{rng.randint(1, 365)}.")
        more = vocab.encode(" ".join(notes) + "\n", add_bos=not ids)
        ids.extend(more)
        if len(ids) >= n:
            break
    return ids[:n]


async def longest(binary: Path, gemma: Path, args: argparse.Namespace) -> Long:
    out = Long()
    log = args.cache / "node-memory-gemma.log"
    conf = {"model": str(gemma), "lanes": LANES, "memory_budget": LONG_BUDGET,
            "threads": args.threads}
    async with ours(conf, log) as me:
        out.window = me.ready["info"]["context_window"]
        out.cells = me.ready["pool_cells"]
        out.idle = proc_mem(me.pid)[0]
        out.host_limit = me.ready["stats"]["host_cache_limit"]
        print(f"gemma, 8 lanes, 4 GiB: window {out.window}, pool {out.cells} cells, idle "
              f"{out.idle / MiB:.0f} MiB", flush=True)
        if args.long_prompt:
            vocab = LlamaCppVocab(gemma)
            try:
                prompt = long_prompt(vocab, out.window - args.long_answer)
            finally:
                vocab.close()
            print(f"long prompt: {len(prompt)} tokens, prefilling (minutes)...", flush=True)
            got, out.peak = await peak_while(
                me.pid, me.gen([prompt], args.long_answer, limit_s=LONG_TIMEOUT))
            reply = got["replies"][0]
            out.ran = True
            out.prompt, out.cached = reply["prompt"], reply["cached"]
            out.completion, out.finish = reply["tokens"], reply["finish"]
            out.ttft = reply["ttft"]
            out.mem_used = got["stats"]["mem_used"]
            print(f"long prompt: TTFT {out.ttft:.1f} s, {out.completion} tokens "
                  f"({out.finish}), peak {out.peak / MiB:.0f} MiB", flush=True)
    out.pool_mib, out.caches = kv_pool(log)
    for extra, name in (((), f"llama-server -np 8 -c {TARGET_WINDOW} --kv-unified"),
                        (("--swa-full",), f"llama-server -np 8 -c {TARGET_WINDOW} "
                                          "--kv-unified --swa-full")):
        slog = f"node-memory-gemma-server{'-swa' if extra else ''}.log"
        async with server(binary, gemma, LANES, TARGET_WINDOW, args, slog, extra=extra,
                          cache_ram=out.host_limit // MiB) as (srv, _http):
            ref = Memory(name)
            ref.idle = proc_mem(srv.pid)[0]
            ref.hwm = proc_mem(srv.pid)[1]
        text = (args.cache / slog).read_text(errors="replace")
        slot = _SLOT_CTX.search(text)
        ref.window = int(slot.group(1)) if slot else 0
        ref.pool_mib, ref.caches = kv_pool(args.cache / slog)
        ref.cells = max(ref.caches, default=0)
        out.refs.append(ref)
    return out


# ----------------------------------------------------------------------------
# 3. a conversation returning after its lane was reused


@dataclass
class Return:
    fresh: list[float] = field(default_factory=list)  # first-turn TTFT, a fresh prefill
    back: list[float] = field(default_factory=list)  # second turn, after the lane was reused
    prompt1: list[int] = field(default_factory=list)
    prompt2: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # of the second turn
    from_host: list[int] = field(default_factory=list)  # ours: prompt_from_host's growth

    @property
    def ratio(self) -> float:
        if not self.fresh or not self.back:
            return float("nan")
        return statistics.median(self.back) / statistics.median(self.fresh)


async def returning(binary: Path, smol: Path, model: HeadModel, args: argparse.Namespace,
                    ) -> tuple[Return, Return, int]:
    """Ours and llama-server on 1 lane: every first turn, then every second turn."""
    convs = [nl.conversation(model, seed, args.turn_tokens)
             for seed in range(args.conversations)]
    warm = nl.lane_prompts(model, 1)[0]
    mine, theirs = Return(), Return()
    conf = {"model": str(smol), "lanes": 1, "memory_budget": args.budget,
            "threads": args.threads}
    async with ours(conf, args.cache / "node-memory-return.log") as me:
        cache_mib = me.ready["stats"]["host_cache_limit"] // MiB
        await me.gen([warm], 8)
        answers: list[list[int]] = []
        for i, messages in enumerate(convs):
            p1 = model.render(messages, tools=None)
            got = await me.gen([p1], args.answer, sessions=[f"conv{i}"],
                               stop_ids=model.stop_ids)
            reply = got["replies"][0]
            mine.fresh.append(reply["ttft"])
            mine.prompt1.append(len(p1))
            answers.append(reply["ids"])
        before = got["stats"]["prompt_from_host"]
        for i, messages in enumerate(convs):
            p2 = nl.second_prompt(model, messages, answers[i])
            got = await me.gen([p2], args.answer, sessions=[f"conv{i}"],
                               stop_ids=model.stop_ids)
            reply = got["replies"][0]
            mine.back.append(reply["ttft"])
            mine.prompt2.append(len(p2))
            mine.cached.append(reply["cached"])
            mine.from_host.append(got["stats"]["prompt_from_host"] - before)
            before = got["stats"]["prompt_from_host"]
    async with server(binary, smol, 1, WINDOW, args, "node-memory-return-server.log",
                      cache_ram=cache_mib) as (srv, http):
        await nl.server_one(http, srv.url, warm, 8)
        answers = []
        for messages in convs:
            p1 = model.render(messages, tools=None)
            r1, answer = await asyncio.wait_for(
                nl.server_one(http, srv.url, p1, args.answer, ignore_eos=False), ROUND_TIMEOUT)
            theirs.fresh.append(r1.ttft)
            theirs.prompt1.append(len(p1))
            answers.append(answer)
        for i, messages in enumerate(convs):
            p2 = nl.second_prompt(model, messages, answers[i])
            r2, _ = await asyncio.wait_for(
                nl.server_one(http, srv.url, p2, args.answer, ignore_eos=False), ROUND_TIMEOUT)
            theirs.back.append(r2.ttft)
            theirs.prompt2.append(len(p2))
            theirs.cached.append(r2.cached)
    for name, t in (("ours", mine), ("llama-server", theirs)):
        print(f"returning ({name}): fresh {statistics.median(t.fresh) * 1000:,.0f} ms, back "
              f"{statistics.median(t.back) * 1000:,.0f} ms, ratio {t.ratio:.3f}, cached "
              f"{t.cached}, from host {t.from_host}", flush=True)
    return mine, theirs, cache_mib


# ----------------------------------------------------------------------------
# 4. and 5. tokens/s, through node_lanes' rounds


def lanes_args(args: argparse.Namespace) -> argparse.Namespace:
    """What node_lanes' rounds read: one pool of WINDOW cells on both sides."""
    return argparse.Namespace(kv="unified", window=WINDOW, threads=args.threads,
                              tokens=args.tokens, rounds=args.rounds, cache=args.cache,
                              memory_budget=args.budget // MiB, smoke=args.smoke)


# ----------------------------------------------------------------------------
# main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=4,
                    help="measured rounds per side for tokens/s")
    ap.add_argument("--mem-rounds", type=int, default=3,
                    help="rounds of 8 concurrent streams for resident memory")
    ap.add_argument("--budget", type=int, default=1024, metavar="MIB",
                    help="our memory budget on SmolLM2 (llama-server's --cache-ram gets "
                    "what our host cache may hold in it)")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="threads of each engine (default: the CPUs this process may use)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=1500,
                    help="length of a conversation's first turn")
    ap.add_argument("--answer", type=int, default=32, help="tokens of a conversation's answer")
    ap.add_argument("--long-prompt", action="store_true",
                    help="also run a prompt that fills Gemma's whole window (slow)")
    ap.add_argument("--long-answer", type=int, default=16)
    ap.add_argument("--lanes", default=",".join(map(str, nl.LEVELS)))
    ap.add_argument("--model", type=Path, default=None,
                    help="the SmolLM2 GGUF (default: the embedded one, under --cache)")
    ap.add_argument("--gemma", type=Path, default=None,
                    help="the Gemma 3 270M GGUF (default: assembled under --cache once)")
    ap.add_argument("--cache", type=Path, default=nl.DEFAULT_CACHE,
                    help="where the models and the logs go")
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "node_memory.png")
    ap.add_argument("--smoke", action="store_true",
                    help="every part once at its smallest, the report and plot to a temp "
                    "folder; exit 1 if the figures make no sense")
    args = ap.parse_args()
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.tokens, args.rounds, args.mem_rounds, args.lanes = 8, 1, 1, "1"
        args.threads = 1  # no thread waits at a barrier for a core a busy machine lends late
        args.conversations, args.turn_tokens, args.answer = 2, 120, 8
        args.long_prompt = False
        args.out = scratch("node-memory") / "benchmarks.md"
        args.plot = args.out.with_name("node_memory.png")
    args.cache = args.cache.expanduser()
    args.cache.mkdir(parents=True, exist_ok=True)
    args.budget_mib = args.budget
    args.budget = args.budget * MiB
    levels = [int(x) for x in args.lanes.split(",") if x.strip()]
    if not levels or min(args.rounds, args.mem_rounds, args.tokens, *levels) < 1:
        raise SystemExit("--rounds, --mem-rounds, --tokens and --lanes must be positive")
    if args.conversations < 2:
        raise SystemExit("--conversations must be at least 2 (one takes the other's lane)")
    binary = nl.server_binary(args)
    smol = nl.bench_model(args)
    gemma = args.gemma or ensure_test_gemma(args.cache / "home")
    model = load_head_model("llamacpp", str(smol), name="bench")
    prompts = nl.lane_prompts(model, max(max(levels), LANES) * (args.rounds + 1)
                              + LANES * args.mem_rounds)
    load0 = os.getloadavg()
    t0 = time.monotonic()
    print(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)

    mem, cache_mib = asyncio.run(memory(binary, smol, args, prompts[-LANES * args.mem_rounds:]))
    long = asyncio.run(longest(binary, gemma, args))
    back, back_ref, back_mib = asyncio.run(returning(binary, smol, model, args))
    largs = lanes_args(args)
    rows: list[dict[str, Any]] = []
    nl.run_levels(binary, smol, levels, largs, prompts, rows)
    variants: list[tuple[str, nl.Run, nl.Run]] = []
    # the smoke compares on 2 lanes: the same rounds and processes, a quarter of the tokens
    n_lanes = 2 if args.smoke else LANES
    for name, unified, tag in (("`-c 8192 --kv-unified --cache-ram 0`", True, "-nocache"),
                               ("`-c 65536 --no-kv-unified --cache-ram 0`", False,
                                "-streams")):
        mine, theirs = asyncio.run(nl.lanes(binary, smol, n_lanes, largs, prompts,
                                            server_unified=unified, server_cache_ram=0,
                                            tag=tag))
        print(f"{n_lanes} lanes against llama-server {name}: ours {mine.tps_median:,.1f} tok/s, "
              f"TTFT {mine.ttft_median * 1000:,.0f} ms; llama-server "
              f"{theirs.tps_median:,.1f} tok/s, TTFT {theirs.ttft_median * 1000:,.0f} ms",
              flush=True)
        variants.append((name, mine, theirs))
    q8, q8_ref = asyncio.run(nl.lanes(binary, smol, n_lanes, largs, prompts, kv_type="q8_0"))
    print(f"q8_0, {n_lanes} lanes: ours {q8.tps_median:,.1f} tok/s, llama-server "
          f"{q8_ref.tps_median:,.1f} tok/s", flush=True)
    load1 = os.getloadavg()
    minutes = (time.monotonic() - t0) / 60
    report = Report(mem=mem, cache_mib=cache_mib, long=long, back=back, back_ref=back_ref,
                    back_mib=back_mib, rows=rows, variants=variants, q8=q8, q8_ref=q8_ref,
                    load=(load0, load1), minutes=minutes, version=nl.server_version(binary))
    write(report, args)
    if args.smoke:
        smoke_verdict(report)


def smoke_verdict(rep: Report) -> None:
    from scripts.bench.smoke import verdict

    runs = [r[k] for r in rep.rows for k in ("ours", "server")]
    runs += [run for _, o, s in rep.variants for run in (o, s)] + [rep.q8, rep.q8_ref]
    verdict({"pools": [(m.name, m.cells, round(m.pool_mib, 1)) for m in rep.mem],
             "peak_mib": [m.hwm // MiB for m in rep.mem],
             "gemma_window": rep.long.window, "gemma_refs": [r.window for r in rep.long.refs],
             "returning_ratio": [rep.back.ratio, rep.back_ref.ratio],
             "from_host": rep.back.from_host, "tps": [r.tps_median for r in runs]},
            {"every KV pool was read from llama.cpp's log": all(
                m.cells > 0 and m.pool_mib > 0 for m in rep.mem),
             "every process's memory was read": all(m.idle > 0 and m.hwm > 0
                                                    for m in rep.mem),
             "Gemma's windows were read": rep.long.window > 0 and rep.long.pool_mib > 0
             and all(r.window > 0 for r in rep.long.refs),
             "returning turns came from our host cache": bool(rep.back.from_host)
             and min(rep.back.from_host) > 0,
             "the returning ratios were computed": 0 < rep.back.ratio < 100
             and 0 < rep.back_ref.ratio < 100,
             "every side generated": all(r.tps_median > 0 for r in runs)})


# ----------------------------------------------------------------------------
# report


@dataclass
class Report:
    mem: list[Memory]
    cache_mib: int
    long: Long
    back: Return
    back_ref: Return
    back_mib: int
    rows: list[dict[str, Any]]
    variants: list[tuple[str, nl.Run, nl.Run]]
    q8: nl.Run
    q8_ref: nl.Run
    load: tuple[tuple[float, float, float], tuple[float, float, float]]
    minutes: float
    version: str


def ok(b: bool) -> str:
    return "PASS" if b else "FAIL"


def streams_note(rep: Report) -> str:
    """What the table of llama-server's settings says against one stream per slot."""
    for name, o, s in rep.variants:
        if "--no-kv-unified" in name and s.tps_median:
            return (f" Against llama-server with one KV stream per slot (below) ours is "
                    f"{o.tps_median / s.tps_median:.2f}x at {LANES} lanes.")
    return ""


def variant_line(name: str, o: nl.Run, s: nl.Run) -> str:
    tr = o.tps_median / s.tps_median if s.tps_median else float("nan")
    lr = o.ttft_median / s.ttft_median if s.ttft_median else float("nan")
    return (f"| {name} | {o.tps_median:,.1f} | {s.tps_median:,.1f} | {tr:.2f} | "
            f"{o.ttft_median * 1000:,.1f} | {s.ttft_median * 1000:,.1f} | {lr:.2f} |")


def caches(cells: list[int]) -> str:
    return " / ".join(f"{c:,}" for c in cells)


def mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def write(rep: Report, args: argparse.Namespace) -> None:
    med = statistics.median
    mine, q8_mine, ref_one, ref_eight, q8_srv = rep.mem
    ours_peak = max(mine.hwm, mine.peak)
    rss_ok = ours_peak <= TARGET_RSS
    pool_ok = mine.cells <= ref_one.cells and mine.pool_mib <= ref_one.pool_mib + 0.05
    long = rep.long
    window_ok = long.window >= TARGET_WINDOW
    host_ok = all(h > 0 for h in rep.back.from_host)
    return_ok = rep.back.ratio <= TARGET_RETURN and host_ok
    table, _misses = nl.lanes_table(rep.rows, split=False)
    tps_ok = all(r["tps_ratio"] >= TARGET_TPS for r in rep.rows)
    f16 = next((r for r in rep.rows if r["lanes"] == LANES), None)
    load0, load1 = rep.load
    cmd = ("`.venv/bin/python scripts/bench/node_memory.py"
           + (" --long-prompt" if long.ran else "")
           + f" --rounds {args.rounds} --mem-rounds {args.mem_rounds}`")
    lines = [
        f"{HEADING} (`scripts/bench/node_memory.py`)", "",
        "What one KV pool shared by all lanes, a memory budget and a host-memory prompt "
        "cache (issue 23) cost and give, against llama.cpp's `llama-server` (build "
        f"{rep.version}, the llama.cpp of our llama-cpp-python) run side by side: same "
        f"models, {args.threads} threads, `--no-repack` on this AMX CPU as our engine does, "
        f"our budget {args.budget_mib} MiB on SmolLM2-135M-Instruct Q4_1 and llama-server's "
        f"`--cache-ram` set to what our host cache may hold in it ({rep.cache_mib} MiB at "
        f"8 lanes, {rep.back_mib} MiB at 1). {os.cpu_count()}-core machine "
        f"({nl.cpu_name()}); 1-minute load average {load0[0]:.2f} at the start, "
        f"{load1[0]:.2f} at the end (5-minute {load0[1]:.2f} and {load1[1]:.2f}; the end "
        f"figures include this benchmark's own {args.threads} threads); the run took "
        f"{rep.minutes:.0f} minutes. Reproduce: {cmd}"
        + (" (with `--model` and `--gemma` naming the two GGUF files where they are not in "
           "the bench cache)."), "",
        "MB here are MiB. Resident memory is the process's `VmRSS` from `/proc/PID/status`: "
        "ours is our engine alone in a child process (`scripts/bench/node_memory_runner.py`, "
        "which imports what a node's process does), idle after load, at 8 concurrent streams "
        f"of {args.tokens} tokens (the peak sampled every 20 ms, median of "
        f"{args.mem_rounds} rounds) and its `VmHWM` at the end. The pools are llama.cpp's "
        "own figures (`llama_kv_cache: size = ...` in each process's log). Both map the "
        "model file, whose pages count in the resident memory as they are read.", "",
        "### Resident memory, SmolLM2 with 8 lanes", "",
        "| | KV pool cells | KV pool MB | window per session | idle MB | 8 streams MB | "
        "peak (VmHWM) MB | tok/s at 8 streams | |",
        "|:--|---:|---:|---:|---:|---:|---:|---:|:--|",
    ]
    for row in (mine, ref_one, ref_eight):
        tps = f"{med(row.tps):,.1f}" if row.tps else ""
        lines.append(f"| {row.name} | {row.cells:,} | {row.pool_mib:,.1f} | {row.window:,} | "
                     f"{mib(row.idle)} | {mib(row.peak)} | {mib(row.hwm)} | {tps} | "
                     f"{row.note} |")
    lines += [
        "",
        f"- Our peak at 8 streams at most {TARGET_RSS // MiB} MB: {mib(ours_peak)} MB, "
        f"{ok(rss_ok)} ({mib(mine.idle)} MB idle, of which {mib(mine.base)} MB is the "
        "interpreter and the node's modules before llama.cpp and the model load; llama-server "
        "with one pool "
        f"{mib(ref_one.hwm)} MB, with 8 pools {mib(ref_eight.hwm)} MB).",
        f"- Our pool no larger than llama-server's at 8 lanes and an {WINDOW:,}-token window: "
        f"{mine.cells:,} cells, {mine.pool_mib:,.1f} MB against {ref_one.cells:,} cells, "
        f"{ref_one.pool_mib:,.1f} MB, {ok(pool_ok)} (8 pools, what our node held before: "
        f"{ref_eight.cells:,} cells, {ref_eight.pool_mib:,.1f} MB). Our engine picks "
        "this pool by itself (no `pool_cells`): one whole window, shared.",
        "",
        "### The longest prompt under 4 GB, Gemma 3 270M with 8 lanes", "",
        f"Our engine with `memory_budget=4 GiB, lanes=8` plans a pool of {long.cells:,} "
        f"cells ({long.pool_mib:,.1f} MB, sliding-window layers kept whole so that a parked "
        f"prefix stays complete), so one session may take {long.window:,} tokens: "
        f"`engine.info.context_window` = {long.window:,}; target the model's whole window, "
        f"{TARGET_WINDOW:,}: {ok(window_ok)}. Idle it holds {mib(long.idle)} MB; its host "
        f"cache may hold {mib(long.host_limit)} MB more within the budget.",
        "",
    ]
    if long.ran:
        lines += [
            f"With `--long-prompt` a prompt of {long.prompt:,} tokens ran in one session: "
            f"first token after {long.ttft:,.1f} s of prefill, {long.completion} tokens "
            f"generated (finish `{long.finish}`), the process's peak {mib(long.peak)} MB "
            f"(its own reading {mib(long.mem_used)} MB, budget {LONG_BUDGET // MiB} MB).", ""]
    else:
        lines += [
            "The window-long prompt itself did not run in this run (it takes minutes of "
            "prefill here; `--long-prompt` runs it).", ""]
    lines += [
        "| Gemma 3 270M, 8 lanes, idle | window per session | KV cells, global / "
        "sliding-window layers | KV pool MB | idle MB |", "|:--|---:|---:|---:|---:|",
        f"| ours, `memory_budget` 4 GiB | {long.window:,} | {caches(long.caches)} | "
        f"{long.pool_mib:,.1f} | {mib(long.idle)} |",
    ]
    for ref in long.refs:
        lines.append(f"| {ref.name} | {ref.window:,} | {caches(ref.caches)} | "
                     f"{ref.pool_mib:,.1f} | {mib(ref.idle)} |")
    b, r = rep.back, rep.back_ref
    lines += [
        "",
        "### A conversation returning after its lane was reused", "",
        f"1 lane, {args.conversations} conversations: each first turn (about "
        f"{int(med(b.prompt1)):,} prompt tokens, a fresh prefill) takes the lane from the "
        "one before, which moves to the host cache (llama-server: its idle slot to its "
        f"`--cache-ram` cache); then each comes back with its second turn (about "
        f"{int(med(b.prompt2)):,} tokens: first prompt + a {args.answer}-token answer + a "
        "new user message). Medians; target: the returning turn's TTFT at most "
        f"{TARGET_RETURN}x the fresh one's, its prefix from the host cache.", "",
        "| | fresh TTFT ms | returning TTFT ms | ratio | prompt tokens reused | from our host "
        "cache (stats) | |",
        "|:--|---:|---:|---:|:--|:--|:--|",
        f"| ours | {med(b.fresh) * 1000:,.1f} | {med(b.back) * 1000:,.1f} | {b.ratio:.3f} | "
        f"{', '.join(map(str, b.cached))} | {', '.join(map(str, b.from_host))} | "
        f"{ok(return_ok)} |",
        f"| llama-server `--cache-ram {rep.back_mib}` | {med(r.fresh) * 1000:,.1f} | "
        f"{med(r.back) * 1000:,.1f} | {r.ratio:.3f} | {', '.join(map(str, r.cached))} | | |",
        "",
        "### Tokens/s with one pool on both sides", "",
        f"`node_lanes.py`'s rounds: one pool of {WINDOW:,} cells shared by N lanes on both "
        f"sides (ours `pool_cells={WINDOW}`, llama-server `-c {WINDOW} --kv-unified`), "
        f"a warm-up round each then {args.rounds} rounds each of N concurrent requests of "
        f"{args.tokens} tokens, alternating which side goes first. Target: at least "
        f"{TARGET_TPS}x llama-server's tokens/s at every lane count (the lowest ratio of the "
        "earlier runs, with one pool per lane, was 0.98x): "
        f"{ok(tps_ok)}.{streams_note(rep)} The TTFT column's own target (node_lanes: 1.2x) "
        "is marked there.",
        "", *table, "",
        f"At {LANES} lanes against other llama-server settings (the same rounds; ours as "
        f"above, the first row is the table's {LANES}-lane row). With its host cache on, "
        "llama-server saves its idle slots to it and clears them from the pool at every new "
        "task, which is what its TTFT pays above; one KV stream per slot (what the earlier "
        "runs compared with) lets each lane attend to its own cells only, where one shared "
        "pool attends over every lane's cells.", "",
        "| llama-server | ours tok/s | llama-server tok/s | ratio | ours TTFT ms | "
        "llama-server TTFT ms | ratio |", "|:--|---:|---:|---:|---:|---:|---:|",
    ]
    if f16 is not None:
        lines.append(variant_line(f"`-c {WINDOW} --kv-unified --cache-ram {rep.cache_mib}`",
                                  f16["ours"], f16["server"]))
    lines += [variant_line(name, o, s) for name, o, s in rep.variants]
    lines += [
        "",
        "### `--kv-type q8_0`", "",
        f"8 lanes, the same pool of {WINDOW:,} cells and rounds; llama-server with `-ctk "
        "q8_0 -ctv q8_0 -fa on` (our engine turns flash attention on for q8_0 too, which "
        "llama.cpp needs to quantize V). No target: what halving the pool costs, or gives, "
        "in tokens/s.", "",
        "| | ours KV pool MB | llama-server KV pool MB | ours tok/s | llama-server tok/s | "
        "ratio |", "|:--|---:|---:|---:|---:|---:|",
    ]
    if f16 is not None:
        o, s = f16["ours"], f16["server"]
        lines.append(f"| f16 | {mine.pool_mib:,.1f} | {ref_one.pool_mib:,.1f} | "
                     f"{o.tps_median:,.1f} | {s.tps_median:,.1f} | {f16['tps_ratio']:.2f} |")
    q8r = rep.q8.tps_median / rep.q8_ref.tps_median if rep.q8_ref.tps_median else float("nan")
    lines.append(f"| q8_0 | {q8_mine.pool_mib:,.1f} | {q8_srv.pool_mib:,.1f} | "
                 f"{rep.q8.tps_median:,.1f} | {rep.q8_ref.tps_median:,.1f} | {q8r:.2f} |")
    if f16 is not None and f16["ours"].tps_median and f16["server"].tps_median:
        lines.append(
            f"| q8_0 / f16 | {q8_mine.pool_mib / max(mine.pool_mib, 1e-9):.2f} | "
            f"{q8_srv.pool_mib / max(ref_one.pool_mib, 1e-9):.2f} | "
            f"{rep.q8.tps_median / f16['ours'].tps_median:.2f} | "
            f"{rep.q8_ref.tps_median / f16['server'].tps_median:.2f} | |")
    lines.append("")
    lines.append(plot(rep, args))
    section = "\n".join(lines)
    nl.replace_section(args.out, HEADING, section)
    print(section, flush=True)
    print(f"wrote {args.out}")


def plot(rep: Report, args: argparse.Namespace) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)\n"
    med = statistics.median
    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(11, 7.4))
    w = 0.38
    mine, q8, ref_one, ref_eight, q8_srv = rep.mem
    rows = (mine, ref_one, ref_eight)
    names = ["Shoal\n1 pool", "llama-server\n1 pool", "llama-server\n8 pools"]
    idx = list(range(len(rows)))
    ax1.bar([i - w / 2 for i in idx], [r.idle / MiB for r in rows], w, label="idle")
    ax1.bar([i + w / 2 for i in idx], [r.hwm / MiB for r in rows], w, label="peak, 8 streams")
    for i, r in enumerate(rows):
        ax1.annotate(f"KV {r.pool_mib:.0f}", (i, r.hwm / MiB), ha="center", va="bottom",
                     fontsize=8)
    ax1.axhline(TARGET_RSS / MiB, color="grey", ls="--", lw=0.8)
    ax1.set_xticks(idx, names, fontsize=8)
    ax1.set_ylabel("resident MB")
    ax1.set_title("SmolLM2, 8 lanes: resident memory (KV pool MB)")
    ax1.margins(y=0.12)
    ax1.legend(fontsize=8)
    ret, ref = rep.back, rep.back_ref
    ax2.bar([-w / 2, 1 - w / 2], [med(ret.fresh) * 1000, med(ret.back) * 1000], w,
            label="Shoal")
    ax2.bar([w / 2, 1 + w / 2], [med(ref.fresh) * 1000, med(ref.back) * 1000], w,
            label="llama-server")
    ax2.annotate(f"{ret.ratio:.3f}x", (1 - w / 2, med(ret.back) * 1000), ha="center",
                 va="bottom", fontsize=8)
    ax2.annotate(f"{ref.ratio:.3f}x", (1 + w / 2, med(ref.back) * 1000), ha="center",
                 va="bottom", fontsize=8)
    ax2.set_xticks([0, 1], ["fresh prefill", "returning (host cache)"])
    ax2.set_ylabel("TTFT ms")
    ax2.set_title(f"TTFT, {int(med(ret.prompt1))}-token conversation, 1 lane")
    ax2.legend(fontsize=8)
    nl.tps_bars(ax3, rep.rows, f"Tokens/s, one pool of {WINDOW} cells on both sides")
    f16 = next((row for row in rep.rows if row["lanes"] == LANES), None)
    if f16 is not None:
        vals_o = [f16["ours"].tps_median, rep.q8.tps_median]
        vals_s = [f16["server"].tps_median, rep.q8_ref.tps_median]
        ax4.bar([-w / 2, 1 - w / 2], vals_o, w, label="Shoal")
        ax4.bar([w / 2, 1 + w / 2], vals_s, w, label="llama-server")
        pools = [(mine.pool_mib, ref_one.pool_mib), (q8.pool_mib, q8_srv.pool_mib)]
        for i, (po, ps) in enumerate(pools):
            ax4.annotate(f"KV {po:.0f} / {ps:.0f} MB", (i, max(vals_o[i], vals_s[i])),
                         ha="center", va="bottom", fontsize=8)
        ax4.set_xticks([0, 1], ["f16", "q8_0"])
        ax4.margins(y=0.12)
        ax4.set_ylabel("aggregate tokens/s")
        ax4.set_title("KV type at 8 lanes (pool MB ours / theirs)")
        ax4.legend(fontsize=8)
    fig.suptitle(f"Node memory against llama-server, {args.threads} threads", fontsize=9)
    return nl.save_plot(fig, args, "node memory against llama-server")


if __name__ == "__main__":
    main()
