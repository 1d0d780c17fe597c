"""The first-run welcome's "which model" step, walked as a user walks it (issue 25): the
clicks and the seconds from the step's start to the chosen model serving, its first
answer through the API included, with the download from a local hub.

The app runs as `shoal app` does (this script with ``--child``: the app's own
`application()`, `make_loop()` and `Shell`), under Xvfb with Debian's `trayer` as the tray
host where both are installed (else offscreen), on a fresh SHOAL_HOME holding only its
settings and the embedded default model (as `scripts/run` leaves a machine; the welcome
not done yet). A Hugging Face hub of our own (tests/fakehub.py) runs in this process on
127.0.0.1 and serves the catalog's two tiny models (SmolLM2-135M-Instruct from the embedded
GGUF, Gemma 3 270M from the test GGUF where it is cached), and the app's HF_ENDPOINT points
at it: nothing leaves the machine.

The child clicks with QTest on the real widgets: "Start a fleet here", "Start the fleet",
Next; then, from the model step's start (the clock starts when the step shows): the
suggestion is taken with the step's button when the hub serves it, else the tiny model's
row is clicked first. The clock stops at the first answer of the served model through the
app's API. Two walks, each on a fresh home: the first writes the screenshots
(welcome-3-model.png, which scripts/screenshots.py also writes from its mock demo fleet,
and welcome-3-model-pulling.png, its download held half-way by the hub while it is shot),
the second is the one measured.

Run: .venv/bin/python scripts/bench/welcome_model.py [--out docs/benchmarks.md]
     [--shots docs/screenshots] [--memory-budget SIZE] [--offscreen]
Smoke (one walk, no screenshots, figures checked, the report to a temp folder):
     .venv/bin/python scripts/bench/welcome_model.py --smoke
Only the processes started here are ended, by their ids; traffic stays on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# this folder holds app.py: it must not shadow the `app` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
sys.path.insert(0, str(ROOT))

from scripts.bench.app import (  # noqa: E402
    CACHE,
    Display,
    Lines,
    end,
    free_port,
    maybe_display,
    prepared_home,
)
from scripts.bench.discovery import replace_section  # noqa: E402

HEADING = "## The welcome's model step (`scripts/bench/welcome_model.py`)"
SHOTS = ROOT / "docs" / "screenshots"
QUESTION = "Name three colours."
ANSWER_TOKENS = 16
TINY_B = 0.5  # catalog entries at most this many billion parameters: the hub serves them


# -- the child: the app, walked through its welcome -------------------------------------

def _mark(name: str, **extra: Any) -> None:
    print(json.dumps({"mark": name, "t": time.time(), **extra}), flush=True)


def child(home: Path, shots: Path | None, hub_specs: list[str]) -> int:
    os.environ["SHOAL_HOME"] = str(home)
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QWidget

    from app.collector import MainThreadCollector
    from app.main import Shell, application, early_icon, make_loop
    from app.prefs import load
    from scripts.screenshots import until

    qapp = application()
    collector = MainThreadCollector(qapp)
    collector.start()
    icon = early_icon()
    clicks: list[str] = []
    grabbing = [0.0]  # seconds spent writing screenshots while the clock ran

    def click(widget: QWidget, what: str) -> None:
        clicks.append(what)
        QTest.mouseClick(widget, Qt.MouseButton.LeftButton)

    async def grab(widget: QWidget, name: str) -> None:
        if shots is None:
            return
        t = time.monotonic()
        await asyncio.sleep(0.15)  # let Qt lay out and paint what changed
        widget.grab().save(str(shots / name), "PNG")
        grabbing[0] += time.monotonic() - t

    def ask(api: str, model: str) -> str:
        host, port = api.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
        body = json.dumps({"model": model, "max_tokens": ANSWER_TOKENS, "messages": [
            {"role": "user", "content": QUESTION}]})
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = json.loads(r.read())
            if r.status != 200:
                raise RuntimeError(f"the API answered {r.status}: {data}")
            return str(data["choices"][0]["message"]["content"])
        finally:
            conn.close()

    pulled: dict[str, float] = {}  # when the download began and ended, and its bytes

    def on_event(event: Any) -> None:
        from engine.events import PullProgress

        if isinstance(event, PullProgress):
            if event.state == "running" and event.done_bytes and "began" not in pulled:
                pulled["began"] = time.time()
            if event.state == "done":
                pulled["ended"] = time.time()
            pulled["bytes"] = max(pulled.get("bytes", 0), event.total_bytes)

    async def life() -> None:
        settings, prefs = await load(home)
        shell = Shell(settings, prefs, icon=icon)
        shell.bridge.event.connect(on_event)
        shell.start()
        welcome = await until(lambda: shell.welcome, "the welcome")
        await until(lambda: shell.phase != "starting", "the start", within=300)
        if shell.phase != "running":
            _mark("failed", line=shell.problem)
            await shell.stop(drain=1)
            return
        await until(lambda: shell.bridge.refresh().ready_nodes, "the embedded model ready",
                    within=300)
        _mark("ready")
        click(welcome.start_choice, "Start a fleet here")  # type: ignore[attr-defined]
        click(welcome.start_button, "Start the fleet")  # type: ignore[attr-defined]
        await until(lambda: welcome.pairing_view.pairing, "the fleet's code")  # type: ignore
        click(welcome.next, "Next")  # type: ignore[attr-defined]
        before = len(clicks)
        # -- the model step: the clock runs from here
        t0 = time.time()
        _mark("model_step")
        options = welcome.options  # type: ignore[attr-defined]
        await until(lambda: any(o.kind == "catalog" for o in (r.option for r in options.rows)),
                    "the catalog's models listed", within=120)
        listed = time.time()
        await grab(welcome, "welcome-3-model.png")
        first = options.rows[0].option
        suggested = first.spec if first.suggested else None
        served_specs = [s.lower() for s in hub_specs]
        if suggested is None or suggested.lower() not in served_specs:
            row = next(r for r in options.rows
                       if r.option.spec and r.option.spec.lower() in served_specs)
            click(row, f"the row of {row.option.title}")
        chosen = options.chosen()
        clicked = time.time()
        click(welcome.next, welcome.next.text())  # type: ignore[attr-defined]
        serve = welcome.serve  # type: ignore[attr-defined]
        if shots is not None:  # the hub holds the download half-way until this is shot
            await until(lambda: serve.progress.maximum() == 1000 and serve.progress.value() > 0,
                        "the download's progress", within=300)
            await grab(welcome, "welcome-3-model-pulling.png")
            _mark("pulling_shot")
        await until(lambda: welcome.step == "editor" or serve.error.isVisible(),  # type: ignore
                    "the model served", within=600)
        if serve.error.isVisible():
            _mark("failed", line=serve.error.text())
            await shell.stop(drain=1)
            return
        served = time.time()
        api = shell.bridge.last.roles.api_url
        answer = await asyncio.to_thread(ask, api, chosen.spec)
        answered = time.time()
        model_clicks = clicks[before:]
        _mark("answered", t0=t0, listed=listed, served=served, answered=answered,
              grabbing=grabbing[0], clicks=model_clicks, before=clicks[:before],
              chosen=chosen.title, spec=chosen.spec, download=chosen.download,
              suggested=suggested, suggested_title=first.title if first.suggested else "",
              answer=answer, facts=welcome.model_facts.text(),  # type: ignore[attr-defined]
              pulled=pulled, clicked=clicked)
        click(welcome.next, "Finish")  # type: ignore[attr-defined]
        await shell.stop(drain=1)

    with asyncio.Runner(loop_factory=lambda: make_loop(qapp)) as runner:
        runner.run(life())
    collector.stop()
    return 0


# -- the parent: the hub, the display, the walks ------------------------------------------

class HubThread:
    """tests/fakehub.py's hub on its own loop in a thread, serving ``repos``."""

    def __init__(self, repos: dict[str, dict[str, Path]], hold_after: int | None) -> None:
        from tests.fakehub import FakeHub

        self.hub = FakeHub(repos=repos, hold_after=hold_after)
        self.loop = asyncio.new_event_loop()
        self._up = threading.Event()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, name="fake-hub", daemon=True)

    def _run(self) -> None:
        from tests.fakehub import serving

        async def main() -> None:
            self._stop = asyncio.Event()
            async with serving(self.hub):
                self._up.set()
                await self._stop.wait()

        self.loop.run_until_complete(main())

    def __enter__(self) -> HubThread:
        self.thread.start()
        if not self._up.wait(60):
            raise RuntimeError("the local hub did not start")
        return self

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.hub.release.set)

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


def tiny_repos(home: Path) -> dict[str, dict[str, Path]]:
    """The catalog's tiny entries, each quantisation's files served from a test GGUF."""
    from engine.models.catalog import load_catalog
    from engine.models.embedded import ensure_embedded_default

    catalog, _ = load_catalog(home)
    smollm2 = ensure_embedded_default(CACHE / "home")
    gemma: Path | None = None
    with contextlib.suppress(Exception):  # cached by the e2e tests; never fetched here
        gemma = next((CACHE / "home").rglob("*gemma*270m*.gguf"), None)
    repos: dict[str, dict[str, Path]] = {}
    for e in catalog.entries:
        if e.params_b > TINY_B:
            continue
        source = gemma if "gemma" in e.id.lower() else smollm2
        if source is None:
            continue
        files = repos.setdefault(e.gguf_repo, {})
        for q in e.quants:
            for name in q.files:
                files[name] = source
    return repos


def hub_specs(home: Path, repos: dict[str, dict[str, Path]]) -> list[str]:
    from engine.models.catalog import load_catalog

    catalog, _ = load_catalog(home)
    return [e.spec(q.name) for e in catalog.entries if e.gguf_repo in repos for q in e.quants]


def fresh_home(root: Path, name: str, budget: str | None) -> Path:
    """A first run's SHOAL_HOME: the embedded model in place, the welcome not done."""
    from dataclasses import replace

    from engine.config import machine_settings, save_machine_settings
    from engine.sizes import parse_budget

    home = prepared_home(root, name, free_port())
    settings, _ = machine_settings(home)
    if budget and settings.node is not None:
        settings = settings.with_node(replace(settings.node,
                                              memory_budget=parse_budget(budget)))
    save_machine_settings(settings, {})
    return home


def walk(home: Path, display: Display | None, hub: HubThread, specs: list[str],
         shots: Path | None) -> dict[str, Any]:
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONPATH": str(ROOT),
           "XDG_CONFIG_HOME": str(home / "xdg"), "HF_ENDPOINT": hub.hub.url,
           "PYTHON_KEYRING_BACKEND": "keyring.backends.null.Keyring",
           "DBUS_SESSION_BUS_ADDRESS": f"unix:path={home / 'no-bus'}"}
    env.pop("HF_HUB_OFFLINE", None)
    env.update(display.env if display else {"QT_QPA_PLATFORM": "offscreen"})
    args = [sys.executable, __file__, "--child", str(home), "--specs", json.dumps(specs)]
    if shots is not None:
        args += ["--child-shots", str(shots)]
    log = (home / "app.log").open("w")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        lines = Lines(proc)
        if shots is not None:
            lines.wait("pulling_shot", within=600)
            hub.release()
        out = lines.wait("answered", within=900)
        proc.wait(120)
    except BaseException:
        log.flush()
        print((home / "app.log").read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        end(proc)
        log.close()
    return out


def default_suggestion(home: Path) -> str:
    """What the step suggests at this machine's own budget, for people."""
    from engine.models.catalog import load_catalog
    from engine.models.choice import fleet_split
    from engine.models.machine import this_machine

    catalog, _ = load_catalog(home)
    machine, _ = this_machine(home, name="this machine")
    split = fleet_split(catalog, [machine])
    if not split:
        return "no catalog model"
    c = split[0].candidate
    entry = catalog.get(c.entry_id)
    assert entry is not None
    return f"{entry.name} {c.quant} (a {entry.quant(c.quant).size / (1 << 30):.1f} GB download)"


def section(m: dict[str, Any], budget: str | None, tray: str, load: tuple[float, float],
            default: str) -> str:
    total = m["answered"] - m["t0"] - m["grabbing"]
    served = m["served"] - m["t0"] - m["grabbing"]
    listed = m["listed"] - m["t0"]
    clicks = m["clicks"]
    pulled = m["pulled"]
    got = pulled.get("bytes", 0) / (1 << 20)
    took_s = pulled.get("ended", 0) - pulled.get("began", 0)
    download = (f"{took_s:.2f} s ({got:.0f} MB, {got / took_s:.0f} MB/s)"
                if "began" in pulled and "ended" in pulled and took_s > 0 else "not seen")
    loaded = m["served"] - pulled["ended"] if "ended" in pulled else None
    suggested = m["suggested_title"] or "none"
    took = ("the suggestion, with the step's button" if len(clicks) == 1
            else f"not the suggestion ({suggested}, which the local hub does not serve): "
                 f"{', then '.join(clicks)}")
    size = m["download"] / (1 << 20)
    budget_text = f"a node budget of {budget}" if budget else "the default node budget"
    lines = [
        HEADING, "",
        f"The first run of `shoal app` on a fresh SHOAL_HOME (only its settings and the "
        f"embedded model, as `scripts/run` leaves it; {budget_text}), under {tray}, its "
        f"welcome clicked through with QTest on the real widgets: Start a fleet here, Start "
        f"the fleet, Next ({len(m['before'])} clicks before the model step). From the model "
        f"step's start: the catalog's models that fit this machine listed, one chosen, "
        f"pulled from a local Hugging Face hub (tests/fakehub.py on 127.0.0.1, HF_ENDPOINT "
        f"pointed at it; it serves the tests' GGUFs, SmolLM2 135M Q4_1 and Gemma 3 270M "
        f"Q4_K_M, under every file name of their catalog entries, so the bytes pulled may "
        f"be another quantisation's) and served, then its first answer through the app's API "
        f"(\"{QUESTION}\", {ANSWER_TOKENS} tokens at most). The walk clicks as soon as "
        f"the step shows: a person's reading time is not counted. One measured walk (a second, "
        f"earlier walk on another fresh home wrote the screenshots, its download held "
        f"half-way while shot); {platform.machine()}, {os.cpu_count()} cores shared with "
        f"other work (load average {load[0]:.2f} at the start, {load[1]:.2f} at the end). "
        f"This machine, as the step said: {m['facts'].removeprefix('This machine: ').rstrip('.')}"
        + (f" (at its default budget the step would suggest {default}; the budget given "
           "here makes the suggestion a model the local hub serves)." if budget else "."),
        "",
        "| measure | value |", "|:--|--:|",
        f"| clicks from the step's start to the model serving | {len(clicks)} |",
        f"| the catalog's models listed, from the step's start | {listed:.2f} s |",
        f"| the step's button clicked | {m['clicked'] - m['t0']:.2f} s |",
        f"| the download from the local hub, first byte to checked file | {download} |",
        "| the model loaded and the head moved to it, after the download | "
        + (f"{loaded:.2f} s |" if loaded is not None else "not seen |"),
        f"| the chosen model serving, from the step's start | {served:.2f} s |",
        f"| its first answer through the API, from the step's start | {total:.2f} s |",
        "",
        f"Chosen: {m['chosen']} (`{m['spec']}`, a {size:.0f} MB download): {took}. The "
        f"answer: “{' '.join(m['answer'].split())[:120]}”. Screenshots of the walk: "
        "`docs/screenshots/welcome-3-model.png` and `welcome-3-model-pulling.png`.", "",
        "Run: `.venv/bin/python scripts/bench/welcome_model.py"
        + (f" --memory-budget {budget}" if budget else "") + "`", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--specs", help=argparse.SUPPRESS)
    ap.add_argument("--child-shots", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--shots", type=Path, default=SHOTS, help="where the PNGs go")
    ap.add_argument("--no-shots", action="store_true", help="measure only")
    ap.add_argument("--memory-budget", help="the node budget of the walked machine "
                    "(default: Shoal's own for this machine)")
    ap.add_argument("--offscreen", action="store_true", help="no Xvfb and trayer")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--smoke", action="store_true",
                    help="the measured walk only, no screenshots, the report to a temp "
                    "folder; exit 1 if the figures make no sense")
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.child_shots, json.loads(args.specs or "[]"))
    if args.smoke:
        from scripts.bench.smoke import scratch

        args.no_shots = True
        args.out = scratch("welcome") / "benchmarks.md"
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shoal-bench-welcome-") as tmp, \
            maybe_display(not args.offscreen) as display:
        root = Path(tmp)
        probe = fresh_home(root, "probe", args.memory_budget)
        default = default_suggestion(probe)
        repos = tiny_repos(probe)
        specs = hub_specs(probe, repos)
        smallest = min(p.stat().st_size for files in repos.values() for p in files.values())
        if not args.no_shots:
            args.shots.mkdir(parents=True, exist_ok=True)
            with HubThread(repos, hold_after=smallest // 2) as hub:
                walk(fresh_home(root, "shots", args.memory_budget), display, hub, specs,
                     args.shots)
            print(f"screenshots in {args.shots}", flush=True)
        with HubThread(repos, hold_after=None) as hub:
            measured = walk(fresh_home(root, "measured", args.memory_budget), display, hub,
                            specs, None)
        tray = ("Xvfb with Debian's `trayer` as the tray host" if display is not None
                else "offscreen (no tray host)")
    text = section(measured, args.memory_budget, tray, (load0, os.getloadavg()[0]), default)
    replace_section(args.out, HEADING, text)
    print(text)
    if args.smoke:
        smoke_verdict(measured)
    return 0


def smoke_verdict(m: dict[str, Any]) -> None:
    from scripts.bench.smoke import verdict

    listed, served, total = (m[k] - m["t0"] for k in ("listed", "served", "answered"))
    pulled = m["pulled"]
    verdict({"clicks": m["clicks"], "chosen": m["spec"], "listed_s": listed,
             "served_s": served, "answered_s": total, "pulled_bytes": pulled.get("bytes"),
             "answer": m["answer"], "served_over_answered": served / total if total else None},
            {"a model was chosen with at most two clicks": 1 <= len(m["clicks"]) <= 2,
             "the steps came in order": 0 <= listed <= served <= total,
             "the download was seen to its end": "began" in pulled and "ended" in pulled
             and pulled.get("bytes", 0) > 0,
             "the served model answered": bool(m["answer"].strip())})


if __name__ == "__main__":
    sys.exit(main())
