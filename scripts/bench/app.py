"""The desktop app's speed (issue 10): start-up, idle cost against the headless engine, and
how smooth the window stays while the fleet streams.

Three processes, one after the other, each on a fresh SHOAL_HOME holding only config.toml
and the embedded default model (SmolLM2-135M-Instruct Q4_1, copied from the test cache:
no network):

  * app: `shoal app` as a user starts it (this script with ``--child``, which runs the
    app's own `application()`, `make_loop()` and `Shell` and prints a time stamp at each
    milestone), under Xvfb with Debian's `trayer` as the tray host where both are
    installed (else offscreen, where the app falls back to its window). Milestones, from
    just before the process is spawned: the tray icon shown (Qt), the icon docked in
    trayer's panel (seen by `xwininfo` from outside), the model loaded, and the first
    token and the whole answer of a question asked in the Try it page (the page's own
    code, through the API, as a click on Send does). The first-run welcome is marked
    done: its time is the user's, not ours.
  * the app idle: the window closed, the tray only; CPU over ``--idle-s`` seconds from
    /proc (utime+stime), resident memory (VmRSS) at the end.
  * headless: `shoal serve` on the same home layout and model, asked the same question
    once, then the same idle measurement.

Frame time: the app's window open on the Fleet page while 8 streams (8 lanes) run
through its API from this process; a 16 ms Qt timer in the app records how late each
tick fires (the time Qt could not draw), and every stall over 50 ms is counted.

Run: .venv/bin/python scripts/bench/app.py [--idle-s 20] [--out docs/benchmarks.md]
Smoke (seconds: 1 s idle, 2 short streams, figures checked, the report to a temp folder):
     .venv/bin/python scripts/bench/app.py --smoke
Only the processes started here are ended, by their ids; traffic stays on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# this file is app.py: its own folder must not shadow the `app` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
sys.path.insert(0, str(ROOT))

from scripts.lib import xvfb  # noqa: E402

HEADING = "## The app"
QUESTION = "Name three colours."
ANSWER_TOKENS = 32
STREAMS = 8
STREAM_TOKENS = 160
TICK_MS = 16
STALL_MS = 50.0
CACHE = Path(os.environ.get("SHOAL_TEST_MODELS", "/tmp/shoal-test-models"))
CLK_TCK = os.sysconf("SC_CLK_TCK")
KEEP_LOGS: Path | None = None  # --keep-logs: copy the processes' logs here


# -- the child: the app itself, with milestones -------------------------------------------

def _mark(name: str, **extra: Any) -> None:
    print(json.dumps({"mark": name, "t": time.time(), **extra}), flush=True)


def child(home: Path) -> int:
    """`shoal app` as app/main.py's run() does it, with milestones on stdout and commands
    from this script on stdin."""
    os.environ["SHOAL_HOME"] = str(home)
    import asyncio

    from app.collector import MainThreadCollector
    from app.main import Shell, application, early_icon, make_loop
    from app.prefs import load

    qapp = application()
    collector = MainThreadCollector(qapp)
    collector.start()
    icon = early_icon()  # as run() does: the icon before the engine is imported
    _mark("tray", system_tray=icon is not None, visible=bool(icon and icon.isVisible()))

    async def until(check: Callable[[], Any], what: str, within: float = 120.0) -> Any:
        async with asyncio.timeout(within):
            while not (value := check()):  # noqa: ASYNC110 - polling what the app shows
                await asyncio.sleep(0.005)
        return value

    async def commands() -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(queue.put_nowait, line.strip())
            loop.call_soon_threadsafe(queue.put_nowait, "quit")

        threading.Thread(target=read, name="bench-stdin", daemon=True).start()
        return queue

    async def life() -> None:
        settings, prefs = await load(home)
        shell = Shell(settings, prefs, icon=icon)
        shell.start()
        await until(lambda: shell.phase != "starting", "the start")
        if shell.phase != "running":
            _mark("failed", line=shell.problem)
            await shell.stop(drain=1)
            return
        await until(lambda: shell.bridge.refresh().ready_nodes, "the node ready")
        _mark("ready")
        window = shell.window_()
        window.show_page("try")  # type: ignore[attr-defined]
        page = window.try_it  # type: ignore[attr-defined]
        await until(lambda: page.model.currentData(), "a model to ask")
        page.max_tokens = ANSWER_TOKENS
        page.prompt.setPlainText(QUESTION)
        _mark("asked")
        page.send()
        await until(lambda: page._answer, "the first token")
        _mark("first_token")
        await until(lambda: not page.streaming, "the answer")
        _mark("answer", text="".join(page._answer), status=page.status.text())
        window.close()
        queue = await commands()
        _mark("idle", pid=os.getpid(), api=shell.bridge.last.roles.api_url)
        while (command := await queue.get()) != "quit":
            if command == "frames":
                window.show_page("fleet")  # type: ignore[attr-defined]
                await frames(window, queue)
        await shell.stop(drain=1)

    async def frames(window: Any, queue: asyncio.Queue[str]) -> None:
        """Tick every 16 ms until told to stop; report how late the ticks were."""
        from PySide6.QtCore import Qt, QTimer

        late: list[float] = []
        last = [time.perf_counter()]

        def tick() -> None:
            now = time.perf_counter()
            late.append(max(0.0, (now - last[0]) * 1000 - TICK_MS))
            last[0] = now

        timer = QTimer()
        timer.setTimerType(Qt.TimerType.PreciseTimer)
        timer.timeout.connect(tick)
        timer.start(TICK_MS)
        watch = None
        if os.environ.get("SHOAL_BENCH_WHY"):  # where the loop's thread was when it stalled
            from tests.loopwatch import LoopWatch

            watch = LoopWatch(asyncio.get_running_loop(), bound_s=STALL_MS / 1000)
            watch.start()
        _mark("frames_on")
        while await queue.get() != "frames_off":
            pass
        timer.stop()
        if watch is not None:
            watch.stop()
            print(watch.report(), file=sys.stderr, flush=True)
        window.close()
        _mark("frames", late=late)

    with asyncio.Runner(loop_factory=lambda: make_loop(qapp)) as runner:
        runner.run(life())
    collector.stop()
    return 0


# -- the parent: processes, displays, measurements --------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepared_home(root: Path, name: str, port: int) -> Path:
    """A SHOAL_HOME with the embedded model in place and this machine's settings."""
    from engine.config import save_machine_settings
    from engine.models.embedded import ensure_embedded_default
    from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings

    source = ensure_embedded_default(CACHE / "home")
    home = root / name
    target = home / "models" / "embedded" / source.name
    target.parent.mkdir(parents=True)
    shutil.copy2(source, target)
    for sidecar in source.parent.iterdir():  # the checksum record, if the cache keeps one
        if sidecar != source and sidecar.name.startswith(source.name):
            shutil.copy2(sidecar, target.parent / sidecar.name)
    save_machine_settings(Settings(home=home, discovery=DiscoverySettings(mode="none"),
                                   head=HeadSettings(http=f"127.0.0.1:{port}"),
                                   node=NodeSettings()), {"welcomed": True})
    return home


class Display:
    """Xvfb on a free display number with trayer's panel on it (both ended by id)."""

    def __init__(self) -> None:
        self.server: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env: dict[str, str] = {}

    def start(self) -> bool:
        if not all(shutil.which(t) for t in ("Xvfb", "trayer", "xwininfo")):
            return False
        self.server, display = xvfb.start("1280x800x24")
        self.env = {"DISPLAY": display, "QT_QPA_PLATFORM": "xcb"}
        trayer = subprocess.Popen(
            ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
             "--height", "32", "--SetDockType", "true", "--transparent", "false",
             "--expand", "true"], env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(trayer)
        deadline = time.monotonic() + 20
        while '"panel": ("panel" "trayer")' not in self.tree():
            if time.monotonic() > deadline or trayer.poll() is not None:
                raise RuntimeError("trayer's panel did not appear")
            time.sleep(0.05)
        return True

    def tree(self) -> str:
        return subprocess.run(["xwininfo", "-root", "-tree"], env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=20).stdout

    def icon_docked(self) -> bool:
        """The app's window inside trayer's panel (indented, icon-sized)."""
        for line in self.tree().splitlines():
            m = re.match(r'^(\s*)0x[0-9a-f]+ "[^"]*": \("shoal" "Shoal"\)\s+(\d+)x(\d+)', line)
            if m and len(m.group(1)) > 8 and int(m.group(2)) <= 64:
                return True
        return False

    def stop(self) -> None:
        for proc in reversed(self.procs):
            end(proc)
        if self.server is not None:
            xvfb.stop(self.server)


def end(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def idle(pid: int, seconds: float) -> tuple[float, float]:
    """(CPU % of one core over ``seconds``, resident MB at the end)."""
    time.sleep(2.0)  # let the answer's after-work settle
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    return 100 * (cpu1 - cpu0) / (t1 - t0), rss_mb(pid)


def model_name(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        return str(json.loads(conn.getresponse().read())["data"][0]["id"])
    finally:
        conn.close()


class Lines:
    """The child's stdout as milestones, read on a thread (the child runs on)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.marks: dict[str, dict[str, Any]] = {}
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                mark = json.loads(line)
                with self.cond:
                    self.marks[mark["mark"]] = mark
                    self.cond.notify_all()

    def wait(self, name: str, within: float = 180.0) -> dict[str, Any]:
        with self.cond:
            if not self.cond.wait_for(lambda: name in self.marks or "failed" in self.marks,
                                      timeout=within):
                raise RuntimeError(f"the app did not reach {name!r}")
            if "failed" in self.marks:
                raise RuntimeError(f"the app did not start: {self.marks['failed']}")
            return self.marks[name]


def run_app(home: Path, display: Display | None, idle_s: float, streams: int = STREAMS,
            stream_tokens: int = STREAM_TOKENS) -> dict[str, Any]:
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONPATH": str(ROOT),
           "XDG_CONFIG_HOME": str(home / "xdg"), "PYTHON_KEYRING_BACKEND":
           "keyring.backends.null.Keyring",
           # no session bus: the XEmbed tray (trayer) and no bus of Qt's own
           "DBUS_SESSION_BUS_ADDRESS": f"unix:path={home / 'no-bus'}"}
    env.update(display.env if display else {"QT_QPA_PLATFORM": "offscreen"})
    log = (home / "app.log").open("w")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(home)], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    out: dict[str, Any] = {"streams": streams, "stream_tokens": stream_tokens}
    try:
        lines = Lines(proc)
        if display is not None:
            deadline = time.monotonic() + 60
            while not display.icon_docked():
                if time.monotonic() > deadline:
                    raise RuntimeError("the icon never docked in trayer's panel")
                time.sleep(0.02)
            out["docked_s"] = time.time() - t0
        tray = lines.wait("tray")
        out["tray_s"] = tray["t"] - t0
        out["system_tray"] = tray["system_tray"]
        out["ready_s"] = lines.wait("ready")["t"] - t0
        out["asked_s"] = lines.wait("asked")["t"] - t0
        out["first_token_s"] = lines.wait("first_token")["t"] - t0
        answer = lines.wait("answer")
        out["answer_s"] = answer["t"] - t0
        out["answer"] = answer["text"]
        idle_mark = lines.wait("idle")
        pid = int(idle_mark["pid"])
        port = int(idle_mark["api"].rsplit(":", 1)[1].split("/")[0])
        out["cpu"], out["rss"] = idle(pid, idle_s)

        assert proc.stdin is not None
        proc.stdin.write("frames\n")
        proc.stdin.flush()
        lines.wait("frames_on")
        name = model_name(port)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                body = json.dumps({"model": name, "max_tokens": stream_tokens,
                                   "stream": True, "seed": i, "messages": [
                                       {"role": "user", "content": f"Tell story {i} "
                                                                   "about the sea."}]})
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                conn.request("POST", "/v1/chat/completions", body,
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                conn.close()
            except BaseException as exc:
                errors.append(exc)

        started = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        out["stream_s"] = time.monotonic() - started
        if errors:
            raise RuntimeError(f"a stream failed: {errors[0]!r}")
        proc.stdin.write("frames_off\n")
        proc.stdin.flush()
        out["late"] = lines.wait("frames")["late"]
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(60)
    finally:
        end(proc)
        log.close()
        if KEEP_LOGS is not None:
            shutil.copy2(home / "app.log", KEEP_LOGS / "app.log")
    return out


def run_headless(home: Path, port: int, idle_s: float) -> dict[str, Any]:
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONPATH": str(ROOT),
           "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring"}
    log = (home / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "app.launch", "serve", "--http",
                             f"127.0.0.1:{port}"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                r = conn.getresponse()
                # the node is ready once its model is listed as ready (a model still
                # loading is listed too, and a request then would wait in the queue)
                if r.status == 200 and any(m.get("status") == "ready"
                                           for m in json.loads(r.read())["data"]):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"shoal serve did not start: {(home / 'serve.log')}")
            time.sleep(0.1)
        body = json.dumps({"model": model_name(port), "max_tokens": ANSWER_TOKENS,
                           "messages": [{"role": "user", "content": QUESTION}]})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
        cpu, rss = idle(proc.pid, idle_s)
        return {"cpu": cpu, "rss": rss}
    finally:
        end(proc)
        log.close()
        if KEEP_LOGS is not None:
            shutil.copy2(home / "serve.log", KEEP_LOGS / "serve.log")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def section(app: dict[str, Any], headless: dict[str, Any], idle_s: float,
            load: tuple[float, float]) -> str:
    late = app["late"]
    streams, stream_tokens = app["streams"], app["stream_tokens"]
    stalls = [x for x in late if x > STALL_MS]
    tray_line = ("Xvfb with Debian's `trayer` as the tray host (XEmbed)"
                 if app["system_tray"] else "offscreen, no tray host (the app's window)")
    lines = [
        HEADING + " (`scripts/bench/app.py`)", "",
        f"`shoal app` started as a user starts it, on a fresh SHOAL_HOME holding only its "
        f"settings and the embedded model (SmolLM2-135M-Instruct Q4_1, no network), under "
        f"{tray_line}; the first-run welcome marked done. Times are from just before the "
        f"process is spawned, so interpreter start-up and imports count. The Try it question "
        f"is \"{QUESTION}\" ({ANSWER_TOKENS} tokens at most), asked through the page's own "
        f"code. Idle: the window closed, {idle_s:.0f} s of CPU from /proc after the answer, "
        f"against `shoal serve` on the same model, asked the same question once. Frame time: "
        f"the window on the Fleet page while {streams} streams of {stream_tokens} tokens run "
        f"through the app's API on its {streams} lanes, a {TICK_MS} ms Qt timer in the app "
        f"recording how late each tick fires. One run; {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other work (load average {load[0]:.2f} at the "
        f"start, {load[1]:.2f} at the end), Python {platform.python_version()}.", "",
        "| measure | value | target | |", "|:--|---:|:--|:--|",
        f"| tray icon shown (Qt) | {app['tray_s']:.2f} s | under 2 s | "
        f"{verdict(app['tray_s'] < 2)} |",
    ]
    if "docked_s" in app:
        lines.append(f"| icon docked in the tray host (seen from outside) | "
                     f"{app['docked_s']:.2f} s | under 2 s | {verdict(app['docked_s'] < 2)} |")
    lines += [
        f"| model loaded, node ready | {app['ready_s']:.2f} s | | |",
        f"| Try it open with the model listed, question sent | {app['asked_s']:.2f} s | | |",
        f"| first token in Try it | {app['first_token_s']:.2f} s | | |",
        f"| whole first answer in Try it | {app['answer_s']:.2f} s | under 10 s | "
        f"{verdict(app['answer_s'] < 10)} |",
        f"| idle CPU, app | {app['cpu']:.2f} % | under 1 % | {verdict(app['cpu'] < 1)} |",
        f"| idle CPU, headless `shoal serve` | {headless['cpu']:.2f} % | | |",
        f"| resident memory, app | {app['rss']:.0f} MB | | |",
        f"| resident memory, headless | {headless['rss']:.0f} MB | | |",
        f"| app minus headless | {app['rss'] - headless['rss']:.0f} MB | within 150 MB | "
        f"{verdict(app['rss'] - headless['rss'] <= 150)} |",
        f"| UI tick lateness while {streams} lanes stream: median / p99 / max | "
        f"{statistics.median(late):.1f} / {pct(late, 0.99):.1f} / {max(late):.1f} ms | "
        f"no stall over {STALL_MS:.0f} ms | {verdict(not stalls)} |",
        f"| stalls over {STALL_MS:.0f} ms (of {len(late)} ticks, {app['stream_s']:.1f} s "
        f"of streaming) | {len(stalls)} | 0 | |",
        "",
        f"The answer shown: “{' '.join(app['answer'].split())[:160]}”.", "",
    ]
    return "\n".join(lines)


def write(out: Path, text: str) -> None:
    doc = out.read_text() if out.exists() else "# Benchmarks\n"
    start = doc.find(HEADING)
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end_at = doc.find("\n## ", start + 1)
        doc = doc[:start] + text + ("\n" + doc[end_at + 1:] if end_at >= 0 else "")
    out.write_text(doc.rstrip("\n") + "\n")


@contextlib.contextmanager
def maybe_display(use: bool) -> Iterator[Display | None]:
    display = Display()
    try:
        yield display if use and display.start() else None
    finally:
        display.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--offscreen", action="store_true", help="no Xvfb and trayer")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--keep-logs", type=Path, help="copy the app's and serve's logs here")
    ap.add_argument("--smoke", action="store_true",
                    help="1 s idle, 2 short streams, the report to a temp folder; exit 1 if "
                    "the figures make no sense")
    args = ap.parse_args(argv)
    global KEEP_LOGS
    KEEP_LOGS = args.keep_logs
    if KEEP_LOGS is not None:
        KEEP_LOGS.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        return child(args.child)
    streams, stream_tokens = STREAMS, STREAM_TOKENS
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.idle_s, streams, stream_tokens = 1.0, 2, 16
        args.out = scratch("app") / "benchmarks.md"
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shoal-bench-app-") as tmp, \
            maybe_display(not args.offscreen) as display:
        app = run_app(prepared_home(Path(tmp), "app", free_port()), display, args.idle_s,
                      streams, stream_tokens)
        print("app:", {k: v for k, v in app.items() if k != "late"}, flush=True)
        port = free_port()
        headless = run_headless(prepared_home(Path(tmp), "headless", port), port,
                                args.idle_s)
        print(f"headless: idle {headless['cpu']:.2f} % {headless['rss']:.0f} MB", flush=True)
    text = section(app, headless, args.idle_s, (load0, os.getloadavg()[0]))
    write(args.out, text)
    print(text)
    if args.smoke:
        smoke_verdict(app, headless)
    return 0


def smoke_verdict(app: dict[str, Any], headless: dict[str, Any]) -> None:
    from scripts.bench.smoke import verdict

    ratio = app["rss"] / headless["rss"] if headless["rss"] else float("nan")
    verdict({"tray_s": app["tray_s"], "docked_s": app.get("docked_s"),
             "answer_s": app["answer_s"], "answer": app["answer"], "ticks": len(app["late"]),
             "idle_cpu": [app["cpu"], headless["cpu"]], "rss_mb": [app["rss"], headless["rss"]],
             "rss_app_over_headless": ratio},
            {"the milestones came in order": 0 < app["tray_s"] <= app["ready_s"]
             <= app["asked_s"] <= app["first_token_s"] <= app["answer_s"],
             "Try it showed an answer": bool(app["answer"].strip()),
             "the UI ticked while the lanes streamed": len(app["late"]) > 0
             and app["stream_s"] > 0,
             "idle CPU was measured": app["cpu"] >= 0 and headless["cpu"] >= 0,
             "the memory ratio was computed": 0.5 < ratio < 20})


if __name__ == "__main__":
    sys.exit(main())
