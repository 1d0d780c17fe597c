#!/usr/bin/env python3
"""Write PNG screenshots of the tray menu and the tray icon's looks, every page of the Shoal
window, the first-run welcome's steps, the Join dialog and the editor panel to
docs/screenshots/ (or --out DIR).

It starts Shoal in this process on the mock runtime: a head with its own node and three
more mock nodes in the same process, linked with one fleet token, with some traffic so the
tables have something to show. Rendering is offscreen (``QT_QPA_PLATFORM=offscreen``), at a
fixed size, with ``widget.grab()``. Nothing touches the network or the user's keychain.

    .venv/bin/python scripts/screenshots.py [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# the fleet token stays in the temporary home, never in the desktop's keychain
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.null.Keyring"
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from PySide6.QtWidgets import QApplication, QWidget  # noqa: E402

from app.bridge import ShoalBridge  # noqa: E402
from app.prefs import Prefs  # noqa: E402
from engine.service import Shoal  # noqa: E402
from engine.settings import (  # noqa: E402
    DiscoverySettings,
    HeadSettings,
    NodeSettings,
    Settings,
)

OUT = ROOT / "docs" / "screenshots"
MAIN_MODEL = "qwen2.5-coder-7b-instruct"
SECOND_MODEL = "llama-3.2-3b-instruct"
NODES = (("studio-mac", MAIN_MODEL, 8), ("thinkpad", MAIN_MODEL, 4),
         ("mini", SECOND_MODEL, 4))
QUIET = DiscoverySettings(mode="none")
SETTLE_S = 0.15  # lets Qt lay out and paint what changed before a grab
WAIT_S = 20.0
QUESTION = "Write a haiku about a shoal of fish."


@dataclass
class DemoFleet:
    head: Shoal
    nodes: list[Shoal]
    home: Path
    background: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def api(self) -> str:
        assert self.head.api_url is not None
        return self.head.api_url


async def until(check: Callable[[], Any], what: str, within: float = WAIT_S) -> Any:
    """``check()``'s first truthy value, polled (the widgets signal nothing to wait on)."""
    try:
        async with asyncio.timeout(within):
            while not (value := check()):  # noqa: ASYNC110 - polling what the screen shows
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise RuntimeError(f"timed out waiting for {what}") from None
    return value


def _token_file(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    token = home / "token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    return token


@contextlib.asynccontextmanager
async def demo_fleet(home: Path) -> AsyncIterator[DemoFleet]:
    """A head with its own node and three mock nodes it dials, all on one fleet token."""
    token = await asyncio.to_thread(_token_file, home)
    nodes: list[Shoal] = []
    head: Shoal | None = None
    try:
        for identity, model, lanes in NODES:
            nodes.append(await Shoal.start(Settings(
                home=home / identity, discovery=QUIET, auth_file=token,
                node=NodeSettings(model=model, runtime="mock", identity=identity, lanes=lanes,
                                  listen="127.0.0.1:0", mock_speed=60.0,
                                  model_name=model))))
        addresses = []
        for n in nodes:
            address = n.node_address
            assert address is not None
            addresses.append(f"{address[0]}:{address[1]}")
        head = await Shoal.start(Settings(
            home=home / "desk", discovery=QUIET, auth_file=token, fleet_name="desk",
            head=HeadSettings(model=MAIN_MODEL, runtime="mock", http="127.0.0.1:0",
                              fleet=tuple(addresses), fleet_listen="127.0.0.1:0",
                              also_models=(SECOND_MODEL,)),
            node=NodeSettings(model=MAIN_MODEL, runtime="mock", lanes=8, mock_speed=80.0,
                              identity="desk (this machine)")))
        fleet = DemoFleet(head, nodes, home)
        await until(lambda: head is not None and head.snapshot().ready_nodes == len(NODES) + 1,
                    "every demo node ready")
        yield fleet
    finally:
        if head is not None:
            await head.stop(drain=0)
        for n in nodes:
            await n.stop(drain=0)


async def chat(fleet: DemoFleet, model: str, text: str, max_tokens: int) -> None:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.7, "seed": 7,
            "messages": [{"role": "user", "content": text}]}
    async with aiohttp.ClientSession() as http, \
            http.post(fleet.api + "/chat/completions", json=body) as r:
        await r.read()


def in_background(fleet: DemoFleet, work: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(work)
    fleet.background.add(task)
    task.add_done_callback(fleet.background.discard)


async def settle() -> None:
    await asyncio.sleep(SETTLE_S)


async def grab(widget: QWidget, path: Path) -> Path:
    await settle()
    if not widget.grab().save(str(path), "PNG"):
        raise RuntimeError(f"could not write {path}")
    return path


async def write_screenshots(out: Path, try_model: Path | None = None) -> list[Path]:
    """Every screenshot into ``out``; returns the files written. With ``try_model`` (a GGUF
    file), the Try it page asks that model on llama.cpp instead of the mock runtime, whose
    answers are not words."""
    from app.join import JoinDialog
    from app.welcome import Welcome
    from app.window import MainWindow

    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="shoal-shots-") as tmp:
        async with demo_fleet(Path(tmp)) as fleet:
            bridge = ShoalBridge(fleet.head)
            window = MainWindow(bridge)
            try:
                written += await _tray_shots(bridge, out)
                if try_model is not None:  # first: the demo's traffic would slow it down
                    written.append(await _real_try(fleet, try_model, out))
                written += await _window_shots(fleet, bridge, window, out,
                                               real=try_model is None)
                welcome = Welcome(bridge)
                try:
                    written += await _welcome_shots(welcome, out)
                finally:
                    welcome.close()
                    welcome.deleteLater()
                dialog = JoinDialog(bridge, window)
                try:
                    dialog.show()
                    dialog.panel.code.setText("shoal://join?head=192.168.1.20:8454&token="
                                              + "ab" * 32 + "&fleet=desk")
                    dialog.panel.join_pasted()
                    await until(lambda: dialog.panel.error.isVisible(), "the join to fail")
                    written.append(await grab(dialog, out / "join-dialog.png"))
                finally:
                    dialog.close()
            finally:
                window.try_it.stop()
                for task in list(fleet.background):
                    task.cancel()
                await asyncio.gather(*fleet.background, return_exceptions=True)
                window.close()
                window.deleteLater()
                await bridge.close()
    return written


async def _ask(window: Any, model: str, question: str) -> None:
    window.show_page("try")
    page = window.try_it
    page.model.setCurrentIndex(max(page.model.findData(model), 0))
    page.prompt.setPlainText(question)
    page.send()
    await until(lambda: not page.streaming, "the answer", within=120)


async def _real_try(fleet: DemoFleet, model: Path, out: Path) -> Path:
    """The Try it page of a Shoal serving ``model`` (llama.cpp)."""
    from app.window import MainWindow

    shoal = await Shoal.start(Settings(
        home=fleet.home / "real", discovery=QUIET, auth_file=fleet.home / "token",
        fleet_name="desk", head=HeadSettings(http="127.0.0.1:0"),
        node=NodeSettings(model=str(model), lanes=2, max_context=2048,
                          identity="desk (this machine)")))
    bridge = ShoalBridge(shoal)
    window = MainWindow(bridge, Prefs(welcomed=True), save_prefs=lambda _p: None)
    try:
        window.show()
        await until(lambda: bridge.refresh().ready_nodes == 1, "the real model loaded", within=120)
        await _ask(window, model.stem, QUESTION)
        return await grab(window, out / "window-try.png")
    finally:
        window.try_it.stop()
        window.close()
        window.deleteLater()
        await bridge.close()
        await shoal.stop(drain=0)


async def _window_shots(fleet: DemoFleet, bridge: ShoalBridge, window: Any,
                        out: Path, *, real: bool) -> list[Path]:
    shoal = fleet.head
    await shoal.aliases.set("coder", MAIN_MODEL, (SECOND_MODEL,))
    await shoal.aliases.set("chat", SECOND_MODEL)
    await shoal.aliases.set("coder", MAIN_MODEL, (SECOND_MODEL,))  # a second version
    window.show()
    for i, (model, words) in enumerate([(MAIN_MODEL, 40), ("coder", 60), (SECOND_MODEL, 30),
                                        ("chat", 25), (MAIN_MODEL, 80), ("coder", 35)]):
        await chat(fleet, model, f"question {i}", words)
    await until(lambda: window.activity.requests.rowCount() >= 6, "the requests listed")
    # long answers under way, so lanes are busy and the KV caches fill while we look
    for i in range(9):
        in_background(fleet, chat(fleet, MAIN_MODEL if i % 3 else SECOND_MODEL,
                                  "write a long story " * (20 + 12 * i), 2000))
    await until(lambda: bridge.refresh().lanes_busy >= 6, "lanes busy")
    await until(lambda: sum(n.kv_used > 0 for n in bridge.refresh().nodes) >= 3,
                "KV caches in use")
    shots = []
    for page in ("fleet", "models", "pairing", "activity"):
        window.show_page(page)
        if page == "pairing":
            await until(lambda: window.pairing.view.pairing is not None, "the QR code")
        if page == "models":
            window.models.alias_view.selectRow(0)
            await until(lambda: window.models.catalog.catalog.rowCount() > 0,
                        "the catalog with each machine's fit")
        shots.append(await grab(window, out / f"window-{page}.png"))
    if real:
        await _ask(window, "coder", QUESTION)
        shots.append(await grab(window, out / "window-try.png"))
    window.show_page("editors")
    shots.append(await grab(window, out / "window-editors.png"))
    window.editors.tabs.setCurrentIndex(1)
    shots.append(await grab(window.editors, out / "editor-panel-zed.png"))
    window.editors.tabs.setCurrentIndex(0)
    window.show_page("settings")
    await settle()
    shots.append(await grab(window, out / "window-settings.png"))
    window.show_page("fleet")
    return shots


async def _tray_shots(bridge: ShoalBridge, out: Path) -> list[Path]:
    """The tray menu as it opens on the demo fleet, and the icon in each of its looks."""
    from PySide6.QtCore import QPoint, QRect, Qt
    from PySide6.QtGui import QColor, QPainter, QPixmap

    from app.icons import tray_icon
    from app.tray import Tray, TrayView

    await until(lambda: bridge.refresh().ready_nodes >= len(NODES) + 1, "every node ready")
    tray = Tray(TrayView(snapshot=bridge.last, prefs=Prefs(welcomed=True,
                                                           start_at_login=True)),
                system_tray=False)
    try:
        tray.menu.popup(QPoint(0, 0))  # rebuilt from the view as it opens
        await until(tray.menu.isVisible, "the tray menu")
        shots = [await grab(tray.menu, out / "tray-menu.png")]
    finally:
        tray.close()
    looks = (("serving", "Serving"), ("busy", "Busy"), ("paused", "Paused"),
             ("error", "Needs you"), ("lonely", "Not in a fleet"))
    cell, icon = 132, 48
    strip = QPixmap(cell * len(looks), 96)
    strip.fill(QColor("#ffffff"))
    painter = QPainter(strip)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    for i, (look, label) in enumerate(looks):
        painter.drawPixmap((cell - icon) // 2 + i * cell, 10,
                           tray_icon(look).pixmap(icon))  # type: ignore[arg-type]
        painter.setPen(QColor("#333333"))
        painter.drawText(QRect(i * cell, 64, cell, 24), int(Qt.AlignmentFlag.AlignCenter),
                         label)
    painter.end()
    path = out / "tray-icons.png"
    if not strip.save(str(path), "PNG"):
        raise RuntimeError(f"could not write {path}")
    return [*shots, path]


async def _welcome_shots(welcome: Any, out: Path) -> list[Path]:
    welcome.show()
    shots = [await grab(welcome, out / "welcome-1-choose.png")]
    welcome.join_choice.click()
    shots.append(await grab(welcome, out / "welcome-2-join.png"))
    welcome.go_back()
    welcome.start_choice.click()
    welcome.fleet_name.setText("desk")
    welcome.start_fleet()
    await until(lambda: welcome.pairing_view.pairing is not None, "the welcome's QR code")
    shots.append(await grab(welcome, out / "welcome-2-start.png"))
    welcome.go_next()
    await until(lambda: any(r.option.kind == "catalog" for r in welcome.options.rows),
                "the catalog's models that fit this machine")
    shots.append(await grab(welcome, out / "welcome-3-model.png"))
    welcome.options.choose("current")  # keep the demo's model: the suggestion pulls
    welcome.go_next()
    shots.append(await grab(welcome, out / "welcome-4-editor.png"))
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the PNGs")
    parser.add_argument("--try-model", type=Path, help="a GGUF file to answer on the Try it "
                        "page (the README's shots use the embedded SmolLM2)")
    args = parser.parse_args(argv)
    import qasync
    from PySide6.QtCore import QEvent

    app = QApplication.instance() or QApplication([])
    app.setQuitOnLastWindowClosed(False)  # as the tray app runs: closing a window is not quitting
    from app.collector import MainThreadCollector

    collector = MainThreadCollector(app)  # Qt objects are freed on Qt's thread only
    collector.start()
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    started = time.monotonic()
    with loop:
        written = loop.run_until_complete(write_screenshots(args.out, args.try_model))
    app.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
    for path in written:
        print(path)
    print(f"{len(written)} screenshots in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
