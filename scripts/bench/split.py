"""Issue 33's benchmark: a model split across two machines, and a model copied from one.

Side by side in one run, on this machine's loopback (two "machines": two processes with
homes of their own), the same model and the same layer split:

- **whole**: ``shoal serve MODEL`` on one machine (``SHOAL_LLAMA_REPACK=0``: the kernels a
  split runs, so the answers compare);
- **llama.cpp RPC**: ``llama-server --rpc 127.0.0.1:PORT -ngl K`` (llama.cpp's own RPC
  client, over plain TCP) against llama.cpp's RPC server (``ggml_backend_rpc_start_server``,
  run by ``python -m engine.runtimes.rpc_lender``: the same server code ``rpc-server``
  runs), ``K`` the layers Shoal's split put on the lender;
- **Shoal split**: ``shoal node --lend`` and ``shoal serve MODEL --split-with`` it: the
  same RPC server, reached through the fleet's encrypted link.

Per side: the time to the first token of a streamed completion (one stream), and the
completion tokens per second of 1 and of 4 streams at once (greedy, ``--tokens`` each),
medians over ``--rounds``; sides take turns. Targets: Shoal's split at least 0.9x
llama.cpp's RPC in tokens/s, its first token at most 1.1x.

**copy**: the model file taken from a machine of the fleet (``FleetPeers`` and the pull's
own writer, sha256-checked, from a node that keeps it in its hub cache), against a plain
TCP copy of the same file between the same two processes' kind (``socket.sendfile`` into
a file). Target: at least 0.8x.

Not run yet: the same with 2 and 5 ms of added latency (``tc netem`` on a veth between two
network namespaces): the runs here share the loopback.

    .venv/bin/python scripts/bench/split.py [--rounds 5] [--tokens 64] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench import smoke as smoke_mode  # noqa: E402
from scripts.bench.node_lanes import replace_section, save_plot, server_binary  # noqa: E402

HEADING = "## A model split across machines, and a model copied from one"
SHOAL = [sys.executable, "-m", "engine.cli"]
PROMPT = "The history of the printing press begins"
READY_S = 180.0
TARGET_TPS, TARGET_TTFT, TARGET_COPY = 0.9, 1.1, 0.8


@dataclass
class Side:
    name: str
    port: int
    model: str
    procs: list[subprocess.Popen[bytes]]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
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

    def start(self, cmd: list[str], env: dict[str, str], ready: str, log: str) -> tuple[
            subprocess.Popen[bytes], re.Match[str], str]:
        """Start ``cmd``; wait for the line ``ready`` matches in its output (logged)."""
        path = self.work / f"{log}.log"
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=path.open("wb"),
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

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the three sides -------------------------------------------------------------------


def shoal_sides(bench: Bench, model: Path) -> tuple[Side, Side, int]:
    args = ["--gpu", "off", "--max-batch", "4", "--max-context", "1024", "--http"]
    whole, _, _ = bench.start([*SHOAL, "serve", str(model), *args, "127.0.0.1:0"],
                              bench.env_of(bench.home("whole"), SHOAL_LLAMA_REPACK="0"),
                              r"at http://127\.0\.0\.1:(\d+)/v1", "whole")
    whole_port = int(re.findall(r"at http://127\.0\.0\.1:(\d+)/v1",
                                (bench.work / "whole.log").read_text())[0])
    lender, found, _ = bench.start(
        [*SHOAL, "node", "--runtime", "mock", "--model", "mock-a", "--lend",
         "--memory-budget", bench.args.lend, "--listen", "127.0.0.1:0"],
        bench.env_of(bench.home("lender")), r" on 127\.0\.0\.1:(\d+) \(link", "lender")
    split, _, text = bench.start(
        [*SHOAL, "serve", str(model), "--split-with", f"127.0.0.1:{found.group(1)}", *args,
         "127.0.0.1:0"], bench.env_of(bench.home("split")),
        r"at http://127\.0\.0\.1:(\d+)/v1", "split")
    layers = re.search(r"lends: (\d+) of (\d+) layers", text)
    if layers is None:
        raise SystemExit(f"the split's log names no layers:\n{text[-2000:]}")
    split_port = int(re.findall(r"at http://127\.0\.0\.1:(\d+)/v1", text)[0])
    name = model.stem
    return (Side("Shoal, whole on one machine", whole_port, name, [whole]),
            Side("Shoal split, through the link", split_port, name, [split, lender]),
            int(layers.group(1)))


def llama_rpc_side(bench: Bench, model: Path, layers: int) -> Side:
    """llama-server with llama.cpp's RPC module beside it, and the RPC server."""
    binary = server_binary(bench.args)
    folder = bench.work / "llama-server"
    shutil.copytree(binary.parent, folder)
    from engine.runtimes.rpc import rpc_library

    lib = rpc_library()
    if lib is None:
        raise SystemExit("no libggml-rpc.so: run scripts/lib/rpc_backend.py --install")
    shutil.copy2(lib, folder / lib.name)
    rpc_port = free_port()
    bench.start([sys.executable, "-m", "engine.runtimes.rpc_lender", f"127.0.0.1:{rpc_port}",
                 str(bench.work / "rpc-cache"), str(len(os.sched_getaffinity(0)))],
                bench.env, r"transport", "rpc-server")
    port = free_port()
    server, _, _ = bench.start(
        [str(folder / binary.name), "-m", str(model), "--rpc", f"127.0.0.1:{rpc_port}",
         "-ngl", str(layers), "-np", "4", "-c", "4096", "-t",
         str(len(os.sched_getaffinity(0))), "--no-repack", "--host", "127.0.0.1",
         "--port", str(port)], bench.env, r"listening on http://", "llama-server")
    return Side("llama.cpp RPC, plain TCP", port, model.stem, [server])


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
    """(MB/s taken from a machine of the fleet, MB/s of a plain TCP copy)."""
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
    _, found, _ = bench.start([*SHOAL, "node", "--runtime", "mock", "--model", "mock-a",
                               "--listen", "127.0.0.1:0"], bench.env_of(desk),
                              r" on 127\.0\.0\.1:(\d+) \(link", "desk")
    peers = FleetPeers(lambda: [f"127.0.0.1:{found.group(1)}"],
                       lambda: bytes.fromhex(bench.token.read_text().strip()))
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
        plain.append(size / plain_copy(model, home / "plain.gguf") / 1e6)
    return statistics.median(fleet), statistics.median(plain)


def plain_copy(src: Path, dst: Path) -> float:
    """Seconds to send ``src`` over a loopback TCP connection into ``dst``."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        with conn, src.open("rb") as f:
            conn.sendfile(f)
        server.close()

    sender = threading.Thread(target=send)
    t0 = time.perf_counter()
    sender.start()
    with socket.create_connection(("127.0.0.1", port)) as c, dst.open("wb") as out:
        while data := c.recv(1 << 20):
            out.write(data)
    sender.join()
    return time.perf_counter() - t0


# -- report ------------------------------------------------------------------------------


def report(args: argparse.Namespace, model: Path, layers: int,
           got: dict[str, dict[str, Any]], copy: tuple[float, float]) -> tuple[str, dict[str, Any]]:
    med = {name: {k: statistics.median(v) for k, v in m.items() if k != "text"}
           for name, m in got.items()}
    names = list(got)
    split, rpc = names[1], names[2]
    ratio = {k: med[split][k] / med[rpc][k] if med[rpc][k] else 0.0
             for k in ("tps1", "tps4", "ttft")}
    same = got[names[0]]["text"] == got[split]["text"]  # the split answers as whole
    same_rpc = got[split]["text"] == got[rpc]["text"]
    ok = {"tokens/s at 1 stream": ratio["tps1"] >= TARGET_TPS,
          "tokens/s at 4 streams": ratio["tps4"] >= TARGET_TPS,
          "first token": ratio["ttft"] <= TARGET_TTFT,
          "copy": copy[0] >= TARGET_COPY * copy[1]}
    rows = [f"| {n} | {med[n]['ttft'] * 1000:,.0f} | {med[n]['tps1']:,.1f} | "
            f"{med[n]['tps4']:,.1f} |" for n in names]
    word = {True: "PASS", False: "MISS"}
    lines = [
        HEADING, "",
        f"`scripts/bench/split.py` ({__doc__.splitlines()[0] if __doc__ else ''}), "
        f"{model.name}: {layers} of its layers on the lending machine in both split sides. "
        f"{args.rounds} rounds, {args.tokens} greedy tokens a completion, the sides taking "
        "turns; two processes on this machine's loopback stand for the two machines (they "
        "share its cores). Reproduce: `.venv/bin/python scripts/bench/split.py --rounds "
        f"{args.rounds} --tokens {args.tokens}`.", "",
        "| side | first token ms | tokens/s, 1 stream | tokens/s, 4 streams |",
        "|:--|--:|--:|--:|", *rows, "",
        f"Shoal's split against llama.cpp's plain RPC: {ratio['tps1']:.2f}x at 1 stream "
        f"({word[ok['tokens/s at 1 stream']]}, target {TARGET_TPS}x), {ratio['tps4']:.2f}x "
        f"at 4 ({word[ok['tokens/s at 4 streams']]}), first token {ratio['ttft']:.2f}x "
        f"({word[ok['first token']]}, target at most {TARGET_TTFT}x). Shoal's split's greedy "
        f"text {'is' if same else 'is not'} the same as the model's whole, and "
        f"{'is' if same_rpc else 'is not'} the same as llama-server's over RPC.", "",
        f"Copy of {model.name} ({model.stat().st_size / 1e6:,.0f} MB): from a machine of the "
        f"fleet {copy[0]:,.0f} MB/s (the link, written and sha256-checked as a pull does), a "
        f"plain TCP copy {copy[1]:,.0f} MB/s: {copy[0] / copy[1]:.2f}x "
        f"({word[ok['copy']]}, target {TARGET_COPY}x).", "",
        "Not run yet: 2 and 5 ms of added latency (`tc netem` between network namespaces).",
    ]
    figures = {"ttft_ms": {n: med[n]["ttft"] * 1000 for n in names},
               "tps1": {n: med[n]["tps1"] for n in names},
               "tps4": {n: med[n]["tps4"] for n in names}, "layers": layers,
               "same_text": same, "same_as_llama_rpc": same_rpc, "copy_mb_s": list(copy)}
    if not args.smoke:
        lines += ["", plot(args, names, med)]
    return "\n".join(lines) + "\n", figures


def plot(args: argparse.Namespace, names: list[str], med: dict[str, dict[str, float]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.25
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in (0, 1)], [med[name]["tps1"], med[name]["tps4"]],
               width, label=name)
    ax.set_xticks([width, 1 + width], ["1 stream", "4 streams"])
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    ax.set_title("a model split across two machines", fontsize=9)
    return save_plot(fig, args, "split: tokens/s, Shoal's split against llama.cpp's RPC")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lend", default="400M", help="the lending machine's memory budget")
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "split.png")
    ap.add_argument("--smoke", action="store_true", help="seconds, figures checked, no docs")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.tokens = 1, 8
        scratch = smoke_mode.scratch("split")
        args.out, args.plot = scratch / "benchmarks.md", scratch / "split.png"
    if args.model is None:
        from engine.models.embedded import ensure_test_gemma

        args.model = ensure_test_gemma(Path(tempfile.gettempdir()) / "shoal-test-models" / "home")
    bench = Bench(args)
    try:
        whole, split, layers = shoal_sides(bench, args.model)
        rpc = llama_rpc_side(bench, args.model, layers)
        got = measure([whole, split, rpc], args)
        copy = copy_rates(bench, args.model)
    finally:
        bench.stop()
    section, figures = report(args, args.model, layers, got, copy)
    if args.smoke:
        smoke_mode.verdict(figures, {
            "every side answered": all(v > 0 for v in figures["tps1"].values()),
            "some layers went to the lender": layers > 0,
            "the copies moved bytes": min(copy) > 0})
        return
    replace_section(args.out, HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
