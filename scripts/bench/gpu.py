"""A node on llama.cpp's Vulkan backend: its own CPU path, and llama-server on the same GPU.

Side by side in one run, on the same model, threads, KV pool (one pool of ``--window``
cells shared by all lanes), batch size and prompts (chat prompts as token ids, new to
every side in each round), at 1 and 8 concurrent streams (``--streams``):

  * node, ``--gpu off``: ``LlamaCppEngine(gpu="off")`` in this process, what
    ``shoal node --gpu off`` runs (no device, prompts kept off the GPU too);
  * node, ``--gpu auto``: ``LlamaCppEngine(gpu="auto")``, the Vulkan backend loaded from
    ``llama_cpp/lib`` (``engine/runtimes/gpu.py``), every layer that fits on the device;
  * llama-server ``-ngl 99``: built from the same llama.cpp with the Vulkan backend
    linked in (``scripts/lib/vulkan_backend.py --server``), every layer on the device;
  * llama-server ``-ngl 0 -dev none``: the same binary, CPU only (the CPU column).

All four are loaded once with as many lanes (``--parallel``) as the most streams, and
take turns, never generating at the same time: a warm-up round each, then ``--rounds``
rounds each at every stream count, the side going first rotating from round to round.
Tokens/s of a round is the completion tokens over its wall time (median of rounds);
TTFT is from submitting a request to its first token (median of requests). Greedy;
llama-server ignores EOS, ours stops only at an end-of-generation token (the prompts
ask for long answers), and the tokens actually generated are counted.

``--device N`` sets ``GGML_VK_VISIBLE_DEVICES=N`` for this process and the servers: it
picks a device, and it is how ggml lists a CPU-type Vulkan device (Mesa's lavapipe) at
all. The chosen device's Vulkan type is read from the Vulkan loader; on a CPU-type one
the output and the report say that the run checks the plumbing only.

Targets, on a real GPU: the node's ``--gpu auto`` tokens/s at least 0.95x llama-server's
on the same backend at every stream count, and at least 5x its own ``--gpu off`` at 8
streams on Gemma 3 270M; printed as PASS/FAIL lines. The results go into
docs/benchmarks.md as the subsection ``--title`` (default: the device and the model) of
the "GPU" section, replaced when it is there, with a plot when ``--plot`` names one;
``--out -`` only prints.

Run: .venv/bin/python scripts/bench/gpu.py [--model smollm2|gemma|PATH] [--streams 1,8]
     [--tokens 64] [--rounds 4] [--device N] [--window 4096] [--threads N]
     [--llama-server PATH] [--cache ~/.cache/shoal-bench] [--out docs/benchmarks.md]
     [--title T] [--plot docs/gpu_vulkan.png]
Smoke (SmolLM2, 1 stream, one round of 4 tokens and no warm-up round, figures checked,
the report and a plot to a temp folder; ``--device 0`` runs it on lavapipe, where the
shaders' compiling and first use take about two minutes):
     .venv/bin/python scripts/bench/gpu.py --smoke [--device 0] [--llama-server PATH]
Traffic goes only to 127.0.0.1; every loop is bounded in count and time; the only
processes ended are the llama-server processes this script started, by their pids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.head.prompt.model import load_head_model  # noqa: E402
from engine.models.embedded import ensure_embedded_default, ensure_test_gemma  # noqa: E402
from engine.runtimes.llamacpp import LlamaCppEngine, usable_cpus  # noqa: E402
from engine.sizes import MiB  # noqa: E402
from scripts.bench import node_lanes as nl  # noqa: E402
from scripts.lib import vulkan_backend as vb  # noqa: E402

HEADING = "## GPU: a node on llama.cpp's Vulkan backend (`scripts/bench/gpu.py`)"
TARGET_SERVER = 0.95  # node --gpu auto / llama-server -ngl 99 tokens/s, at least
TARGET_SPEEDUP = 5.0  # node --gpu auto / node --gpu off tokens/s at 8 streams, at least
SPEEDUP_STREAMS = 8
WINDOW = 4096  # the pool both sides share: room for 8 streams of these prompts
ROUND_TIMEOUT = 600.0  # s, one round of requests (lavapipe: about a token a second)
START_TIMEOUT = 600.0  # s, one side until it answers (lavapipe compiles its shaders)
MODELS = {"smollm2": "SmolLM2-135M-Instruct Q4_1", "gemma": "Gemma 3 270M Q4_K_M"}
# VkPhysicalDeviceType; CPU-type devices (lavapipe, SwiftShader) render in software
VK_TYPES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
VK_CPU = 4
SOFTWARE_NAMES = ("llvmpipe", "lavapipe", "swiftshader")


# ----------------------------------------------------------------------------
# the Vulkan device's type


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p),
                ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


def vulkan_types() -> dict[str, int]:
    """Each Vulkan device's name (what ggml gives as its description) and its
    ``VkPhysicalDeviceType``, from the loader; empty when there is no loader or driver."""
    try:
        vk = ctypes.CDLL(ctypes.util.find_library("vulkan") or "libvulkan.so.1")
    except OSError:
        return {}
    vp, u32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)
    vk.vkCreateInstance.argtypes = [ctypes.POINTER(_InstanceInfo), vp, ctypes.POINTER(vp)]
    vk.vkCreateInstance.restype = ctypes.c_int
    vk.vkEnumeratePhysicalDevices.argtypes = [vp, u32p, ctypes.POINTER(vp)]
    vk.vkEnumeratePhysicalDevices.restype = ctypes.c_int
    vk.vkGetPhysicalDeviceProperties.argtypes = [vp, ctypes.c_void_p]
    vk.vkGetPhysicalDeviceProperties.restype = None
    vk.vkDestroyInstance.argtypes = [vp, vp]
    vk.vkDestroyInstance.restype = None
    info = _InstanceInfo(sType=1)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, Vulkan 1.0
    inst = vp()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(inst)) != 0:
        return {}
    out: dict[str, int] = {}
    try:
        count = ctypes.c_uint32(0)
        if vk.vkEnumeratePhysicalDevices(inst, ctypes.byref(count), None) != 0:
            return {}
        devs = (vp * count.value)()
        vk.vkEnumeratePhysicalDevices(inst, ctypes.byref(count), devs)
        for dev in devs[:count.value]:
            # VkPhysicalDeviceProperties: 4 uint32, deviceType, char deviceName[256], ...
            props = ctypes.create_string_buffer(4096)  # the struct is 824 bytes
            vk.vkGetPhysicalDeviceProperties(dev, props)
            kind = int.from_bytes(props.raw[16:20], sys.byteorder)
            name = props.raw[20:276].split(b"\0", 1)[0].decode(errors="replace")
            out[name] = kind
    finally:
        vk.vkDestroyInstance(inst, None)
    return out


def device_type(description: str) -> tuple[str, bool]:
    """(the Vulkan type's words, whether it is a CPU-type device) for ggml's description."""
    kind = vulkan_types().get(description)
    software = any(n in description.lower() for n in SOFTWARE_NAMES)
    if kind is None:
        return ("CPU (software)" if software else "unknown"), software
    return VK_TYPES.get(kind, "unknown"), kind == VK_CPU or software


# ----------------------------------------------------------------------------
# the sides


@dataclass
class Run:
    tps: list[float] = field(default_factory=list)  # one per round
    replies: list[nl.Reply] = field(default_factory=list)

    @property
    def tps_median(self) -> float:
        return statistics.median(self.tps) if self.tps else 0.0

    @property
    def ttft_median(self) -> float:
        return statistics.median(r.ttft for r in self.replies) if self.replies else 0.0


One = Callable[[list[int]], Awaitable[nl.Reply]]


@dataclass
class Side:
    key: str
    label: str
    one: One
    runs: dict[int, Run] = field(default_factory=dict)  # per stream count
    note: str = ""  # where its layers are


SIDES = (("off", "node --gpu off"), ("auto", "node --gpu auto"),
         ("server", "llama-server -ngl 99"), ("server_cpu", "llama-server -ngl 0 -dev none"))


def server_devices(binary: Path) -> str:
    """The devices llama-server lists (``--list-devices``, this process's environment)."""
    try:
        r = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True,
                           timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    found = [line.strip() for line in (r.stdout + r.stderr).splitlines()
             if re.match(r"\s+\S+: ", line)]
    return "; ".join(found) or "none"


@contextlib.asynccontextmanager
async def sides(binary: Path, path: Path, args: argparse.Namespace,
                ) -> AsyncIterator[tuple[list[Side], LlamaCppEngine]]:
    """The four sides loaded (ours first, then the servers), each with ``max(streams)``
    lanes; the caller runs one at a time. Yields them and our ``--gpu auto`` engine."""
    lanes = max(args.streams)
    engines: list[LlamaCppEngine] = []
    servers: list[nl.Server] = []
    try:
        for gpu in ("off", "auto"):
            engine = LlamaCppEngine(str(path), model_name="bench", lanes=lanes,
                                    pool_cells=args.window, n_threads=args.threads, gpu=gpu)
            engines.append(engine)
            t0 = time.perf_counter()
            await asyncio.wait_for(engine.start(), START_TIMEOUT)
            print(f"node --gpu {gpu}: started in {time.perf_counter() - t0:.1f} s; "
                  f"{engine.device_why}"
                  + (f"; {engine.offload.describe()} on it" if engine.device is not None
                     and engine.offload is not None else ""), flush=True)
        cache_ram = engines[0].host_cache_limit // MiB
        for tag, extra in (("gpu", ("-ngl", "99")), ("cpu", ("-ngl", "0", "-dev", "none"))):
            srv = nl.Server(binary, path, lanes, args.window, args.threads,
                            args.cache / f"gpu-llama-server-{tag}.log", cache_ram=cache_ram,
                            extra=(*extra, "--swa-full"))  # ours keeps SWA layers whole
            servers.append(srv)
            t0 = time.perf_counter()
            srv.start()
            await asyncio.wait_for(srv.wait_healthy(), START_TIMEOUT + 10)
            print(f"llama-server {' '.join(extra)}: started in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=lanes)) as http:
            def ours(engine: LlamaCppEngine) -> One:
                async def one(p: list[int]) -> nl.Reply:
                    return (await nl.ours_one(engine, p, args.tokens))[0]
                return one

            def theirs(srv: nl.Server) -> One:
                async def one(p: list[int]) -> nl.Reply:
                    return (await nl.server_one(http, srv.url, p, args.tokens))[0]
                return one

            ones = (ours(engines[0]), ours(engines[1]), theirs(servers[0]), theirs(servers[1]))
            out = [Side(key, label, one) for (key, label), one in zip(SIDES, ones, strict=True)]
            auto = engines[1]
            out[0].note = "CPU"
            out[1].note = (f"{auto.offload.describe()} on {auto.device.name}"
                           if auto.device is not None and auto.offload is not None else "CPU")
            out[2].note = f"on what it lists: {args.server_devices}"
            out[3].note = "CPU"
            yield out, auto
    finally:
        for engine in engines:
            await engine.close()
        for srv in servers:
            srv.stop()


async def round_of(one: One, prompts: list[list[int]]) -> tuple[float, list[nl.Reply]]:
    t0 = time.perf_counter()
    replies = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), ROUND_TIMEOUT)
    return sum(r.tokens for r in replies) / (time.perf_counter() - t0), list(replies)


async def measure(binary: Path, path: Path, args: argparse.Namespace,
                  prompts: list[list[int]]) -> tuple[list[Side], dict[str, str]]:
    """Every side's runs at every stream count, and what our ``--gpu auto`` ran on."""
    async with sides(binary, path, args) as (all_sides, auto):
        dev = auto.device
        where = {"name": dev.name if dev else "", "description": dev.description if dev else "",
                 "why": auto.device_why}
        used = 0
        for n in args.streams:
            # warm-up: the first round pays for first-use work (a smoke run's one round does)
            for side in () if args.smoke else all_sides:
                await round_of(side.one, prompts[used:used + n])
            used += n
            for r in range(args.rounds):
                block = prompts[used:used + n]
                used += n
                k = r % len(all_sides)
                for side in all_sides[k:] + all_sides[:k]:
                    tps, replies = await round_of(side.one, block)
                    run = side.runs.setdefault(n, Run())
                    run.tps.append(tps)
                    run.replies.extend(replies)
            print(f"{n} stream{'s' * (n != 1)}: " + "; ".join(
                f"{s.label} {s.runs[n].tps_median:,.1f} tok/s, TTFT "
                f"{s.runs[n].ttft_median * 1000:,.0f} ms" for s in all_sides), flush=True)
    return all_sides, where


# ----------------------------------------------------------------------------
# report


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def target_lines(by: dict[str, Side], args: argparse.Namespace, *, software: bool) -> list[str]:
    """One PASS/FAIL line per target."""
    caveat = " (a CPU-type device: not a GPU figure)" if software else ""
    out: list[str] = []
    for n in args.streams:
        r = ratio(by["auto"].runs[n].tps_median, by["server"].runs[n].tps_median)
        out.append(f"{verdict(r >= TARGET_SERVER)}: node --gpu auto / llama-server -ngl 99 at "
                   f"{n} stream{'s' * (n != 1)}: {r:.2f}x tokens/s (target at least "
                   f"{TARGET_SERVER}x)"
                   f"{caveat}")
    if SPEEDUP_STREAMS in args.streams:
        r = ratio(by["auto"].runs[SPEEDUP_STREAMS].tps_median,
                  by["off"].runs[SPEEDUP_STREAMS].tps_median)
        model = "" if args.model == "gemma" else (
            f"; the target is set for Gemma 3 270M, this is {args.model_label}")
        out.append(f"{verdict(r >= TARGET_SPEEDUP)}: node --gpu auto / node --gpu off at "
                   f"{SPEEDUP_STREAMS} streams: {r:.2f}x tokens/s (target at least "
                   f"{TARGET_SPEEDUP:g}x{model}){caveat}")
    return out


def device_words(where: dict[str, str], kind: str, software: bool) -> str:
    if not where["name"]:
        return where["why"]
    words = f"{where['name']} ({where['description']}, Vulkan type: {kind})"
    if software:
        words += (": a CPU-type Vulkan device (software rendering, e.g. Mesa's lavapipe), so "
                  "this run checks the plumbing only and its GPU speeds mean nothing")
    return words


def write_report(all_sides: list[Side], where: dict[str, str], args: argparse.Namespace, *,
                 kind: str, software: bool, version: str, load: tuple[float, float]) -> None:
    by = {s.key: s for s in all_sides}
    lcp = importlib.metadata.version("llama-cpp-python")
    env = f"`GGML_VK_VISIBLE_DEVICES={args.device}`" if args.device is not None else (
        "the machine's own driver (no `GGML_VK_VISIBLE_DEVICES`)")
    setup = (
        f"Device: {device_words(where, kind, software)}; {env}. Our `LlamaCppEngine` "
        f"(llama-cpp-python {lcp}, in-process, what `shoal node --gpu off|auto` runs) against "
        f"`llama-server` built from the same llama.cpp (build {version}) with the Vulkan "
        "backend linked in (`scripts/lib/vulkan_backend.py --server`), on the "
        f"{os.cpu_count()}-core {nl.cpu_name()} (1-minute load average {load[0]:.2f} at "
        f"the start, {load[1]:.2f} at the end). {args.model_label}, {args.threads} threads, "
        f"one KV pool of {args.window} cells shared by {max(args.streams)} lanes on every side "
        f"(ours `pool_cells={args.window}`, llama-server `-c {args.window} --kv-unified "
        f"--parallel {max(args.streams)} --swa-full`), loaded once; greedy, {args.tokens} "
        "tokens per request, each request its own chat prompt (token ids). A warm-up round "
        f"each, then {args.rounds} rounds each per stream count, the side going first "
        "rotating, all four never running at the same time. Tokens/s: completion tokens over "
        "a round's wall time (median of rounds); TTFT: submit to first token (median of "
        f"requests). Where the layers were: {by['auto'].label} {by['auto'].note}; "
        f"{by['server'].label} {by['server'].note}. Reproduce: `.venv/bin/python "
        f"scripts/bench/gpu.py --model {args.model} --streams "
        f"{','.join(map(str, args.streams))} --tokens {args.tokens} --rounds {args.rounds}"
        + (f" --device {args.device}" if args.device is not None else "") + "`.")
    head = ("| streams | " + " | ".join(f"{s.label} tok/s" for s in all_sides)
            + " | auto / server | auto / off | "
            + " | ".join(f"{s.label} TTFT ms" for s in all_sides) + " |")
    rule = "|---:|" + "---:|" * (len(all_sides) * 2 + 2)
    table = [head, rule]
    for n in args.streams:
        runs = [s.runs[n] for s in all_sides]
        table.append(
            f"| {n} | " + " | ".join(f"{r.tps_median:,.1f}" for r in runs)
            + f" | {ratio(by['auto'].runs[n].tps_median, by['server'].runs[n].tps_median):.2f}"
            f" | {ratio(by['auto'].runs[n].tps_median, by['off'].runs[n].tps_median):.2f} | "
            + " | ".join(f"{r.ttft_median * 1000:,.1f}" for r in runs) + " |")
    targets = target_lines(by, args, software=software)
    lines = [f"### {args.title}", ""]
    if software:
        lines += ["**A CPU-type Vulkan device (lavapipe): plumbing only; the GPU columns' "
                  "speeds mean nothing.**", ""]
    lines += [setup, "", *table, "", *(f"- {t}" for t in targets)]
    section = "\n".join(lines) + "\n"
    print(section, flush=True)
    if args.out is None:
        return
    if args.plot is not None:
        section += plot(all_sides, args, software=software)
    nl.replace_subsection(args.out, HEADING, f"### {args.title}", section)
    print(f"wrote {args.out}")


def plot(all_sides: list[Side], args: argparse.Namespace, *, software: bool) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n(matplotlib not installed: no plot)\n"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    idx = list(range(len(args.streams)))
    w = 0.8 / len(all_sides)
    by = {s.key: s for s in all_sides}
    for ax, what, unit in ((ax1, "tps", "aggregate tokens/s"), (ax2, "ttft", "TTFT ms")):
        for j, s in enumerate(all_sides):
            vals = [s.runs[n].tps_median if what == "tps" else s.runs[n].ttft_median * 1000
                    for n in args.streams]
            ax.bar([i + (j - (len(all_sides) - 1) / 2) * w for i in idx], vals, w,
                   label=s.label)
        ax.set_xticks(idx, [str(n) for n in args.streams])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    for i, n in enumerate(args.streams):
        auto = by["auto"].runs[n].tps_median
        ax1.annotate(f"auto/server {ratio(auto, by['server'].runs[n].tps_median):.2f}x\n"
                     f"auto/off {ratio(auto, by['off'].runs[n].tps_median):.2f}x",
                     (i, max(s.runs[n].tps_median for s in all_sides)), ha="center",
                     va="bottom", fontsize=7)
    ax1.set_title("Throughput (median of rounds)")
    ax2.set_title("Median time to first token")
    title = (args.title if args.model_label in args.title
             else f"{args.model_label}: {args.title}")
    fig.suptitle(title
                 + (" — CPU-type device: plumbing only" if software else ""), fontsize=9)
    return "\n" + nl.save_plot(fig, args, "a node on llama.cpp's Vulkan backend")


# ----------------------------------------------------------------------------
# main


def bench_model(args: argparse.Namespace) -> Path:
    home = args.cache / "home"
    if args.model == "smollm2":
        return ensure_embedded_default(home)
    if args.model == "gemma":
        return ensure_test_gemma(home)
    return Path(args.model).expanduser()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None,
                    help="smollm2 (the embedded SmolLM2-135M), gemma (Gemma 3 270M) or a "
                    "GGUF's path (default gemma; smollm2 with --smoke)")
    ap.add_argument("--streams", default=f"1,{SPEEDUP_STREAMS}",
                    help="concurrent streams to measure at, comma-separated")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=4,
                    help="measured rounds per side and stream count")
    ap.add_argument("--device", default=None,
                    help="GGML_VK_VISIBLE_DEVICES for this run (0: lavapipe on a machine "
                    "without a GPU); default: the machine's own")
    ap.add_argument("--window", type=int, default=WINDOW, help="the shared KV pool's cells")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="threads of each engine (default: the CPUs this process may use)")
    ap.add_argument("--cache", type=Path, default=nl.DEFAULT_CACHE,
                    help="where the models and the logs go")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="a llama-server with the Vulkan backend (default: build it once)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="the report to write its subsection into; - only prints")
    ap.add_argument("--title", default=None,
                    help="the subsection of the GPU section (default: the device and model)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="write a plot there and show it in the subsection (default: none)")
    ap.add_argument("--smoke", action="store_true",
                    help="SmolLM2, 1 stream, a round of 4 tokens, the report and a plot to a "
                    "temp folder; exit 1 if the figures make no sense")
    args = ap.parse_args()
    args.model = args.model or ("smollm2" if args.smoke else "gemma")
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.streams, args.tokens, args.rounds, args.window = "1", 4, 1, 1024
        args.threads = 1  # no thread waits at a barrier for a core a busy machine lends late
        args.out = str(scratch("gpu") / "benchmarks.md")
        args.plot = Path(args.out).with_name("gpu_vulkan.png")
    args.streams = sorted({int(x) for x in args.streams.split(",") if x.strip()})
    if not args.streams or min(args.rounds, args.tokens, *args.streams) < 1:
        raise SystemExit("--rounds, --tokens and --streams must be positive")
    args.out = None if args.out == "-" else Path(args.out)
    args.cache = args.cache.expanduser()
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.device is not None:
        # before anything loads the Vulkan backend; the servers inherit it
        os.environ["GGML_VK_VISIBLE_DEVICES"] = str(args.device)
    args.model_label = MODELS.get(args.model, Path(args.model).name)

    # say first what the device is: everything after depends on it
    from engine.runtimes.gpu import gpu_backends
    from engine.runtimes.llamacpp import _lib

    found = gpu_backends(_lib())
    if not found.devices:
        raise SystemExit(f"gpu: no GPU for --gpu auto: {found.unavailable or 'none listed'}; "
                         "run on a GPU machine, or pass --device 0 for lavapipe (plumbing only)")
    best = max(found.devices, key=lambda d: (d.kind == "gpu", d.free))
    kind, software = device_type(best.description)
    print(f"device: {best.label()}, Vulkan type {kind}"
          + ("\nA CPU-type Vulkan device (software rendering): this run checks the plumbing "
             "only; its GPU speeds mean nothing." if software else ""), flush=True)
    args.title = args.title or f"{best.description}, {args.model_label}"

    try:
        binary = args.llama_server or vb.ensure_vulkan_server()
    except vb.BuildFailed as exc:  # its own: it imports llama_server as a top module
        raise SystemExit(f"llama-server: {exc}") from None
    args.server_devices = server_devices(binary)
    print(f"llama-server lists: {args.server_devices}", flush=True)
    path = bench_model(args)
    model = load_head_model("llamacpp", str(path), name="bench")
    prompts = nl.lane_prompts(model, sum(args.streams) * (args.rounds + 1))
    longest = max(len(p) for p in prompts)
    if max(args.streams) * (longest + args.tokens) > args.window:
        raise SystemExit(f"--window {args.window} is too small for {max(args.streams)} streams "
                         f"of {longest} prompt tokens + {args.tokens} generated; raise it")
    load = os.getloadavg()[0]
    print(f"{args.model_label}: {len(prompts)} prompts of {min(map(len, prompts))}-{longest} "
          f"tokens, {args.tokens} tokens each, streams {args.streams}, {args.rounds} rounds, "
          f"{args.threads} threads, load average {load:.2f}", flush=True)
    all_sides, where = asyncio.run(measure(binary, path, args, prompts))
    if where["description"] and where["description"] != best.description:
        kind, software = device_type(where["description"])
    write_report(all_sides, where, args, kind=kind, software=software,
                 version=nl.server_version(binary), load=(load, os.getloadavg()[0]))
    if args.smoke:
        smoke_verdict(all_sides, where, args.streams)


def smoke_verdict(all_sides: list[Side], where: dict[str, str], streams: list[int]) -> None:
    from scripts.bench.smoke import verdict

    by = {s.key: s for s in all_sides}
    ratios = [(ratio(by["auto"].runs[n].tps_median, by["server"].runs[n].tps_median),
               ratio(by["auto"].runs[n].tps_median, by["off"].runs[n].tps_median))
              for n in streams]
    verdict({"device": where["name"], "tok_s": {s.key: [s.runs[n].tps_median for n in streams]
                                                for s in all_sides}, "ratios": ratios},
            {"node --gpu auto ran on a Vulkan device": bool(where["name"]),
             "every side generated at every stream count": all(
                 s.runs[n].tps_median > 0 for s in all_sides for n in streams),
             "the ratios were computed": all(0 < r < 1000 for pair in ratios for r in pair)})


if __name__ == "__main__":
    main()
