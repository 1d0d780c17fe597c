"""The desktop app under test: Qt offscreen, every async test on the app's own loop (qasync
on the one QApplication, as `shoal app` runs it), an in-process Shoal on the mock runtime,
and no window left open at the end.

Fixtures for every UI test:
    ui_home        a SHOAL_HOME (and XDG_CONFIG_HOME) of the test's own
    mock_settings  Settings for an in-process Shoal: the API on 127.0.0.1:0, a mock node
    shoal          a running Shoal on those settings (stopped at the end)
    bridge         a ShoalBridge on it
    shell          the whole app (tray, bridge, Shoal) on those settings, started
    smollm2_gguf   the real embedded model (cached across runs)
    loop_watch     tests/conftest.py's probe and leak check, with room for Qt's painting

tests/ui/running.py has the window tests' helpers (Shoal in process, a bridge, a chat).
"""

from __future__ import annotations

import gc
import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytestqt.plugin
from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QAction
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QMenu, QMessageBox, QWidget

from app.bridge import ShoalBridge
from app.main import Shell, make_loop
from app.prefs import Prefs
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.ui import qtimeout
from tests.waiting import until

pytestmark = pytest.mark.ui
QUIET = DiscoverySettings(mode="none")
MODEL = "mock-m"
# Qt lays out and paints in the loop's own thread, in C++ between two Python callbacks; on a
# loaded two-core machine a window's first paint can take 100-200 ms. The probe still catches
# Python code that blocks (files, sockets, decoding) above this bound.
UI_LOOP_BOUND_S = 0.3


@pytest.fixture
def loop_watch(loop_watch: Any) -> Any:
    """tests/conftest.py's probe and leak check, with room for Qt's own painting."""
    loop_watch.bound_s = UI_LOOP_BOUND_S
    return loop_watch


def _no_events_between_phases() -> None:
    """pytest-qt processes Qt's events between a test's phases, where no asyncio loop
    runs: a qasync loop's pending callbacks (a task's next step, the settings being saved)
    would run there with no running loop and fail. They run in the loop instead."""


pytestqt.plugin._process_events = _no_events_between_phases


def qapp_instance() -> QApplication:
    existing = QApplication.instance()
    if isinstance(existing, QApplication):
        return existing
    app = QApplication(["shoal-tests"])
    app.setApplicationName("Shoal")
    app.setQuitOnLastWindowClosed(False)
    return app


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
    """Async UI tests run on a qasync loop: Qt's events and asyncio's in one thread."""
    return {"qasync": lambda: qtimeout.track(make_loop(qapp_instance()))}


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """A timeout that fails a hung test on the Qt loop (tests/ui/qtimeout.py)."""
    return qtimeout.set_timer(item, settings)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.ui)


@pytest.fixture(scope="session", autouse=True)
def _qt_warm() -> None:
    """Load fonts, styles and the platform plugin once, before any loop-lag probe runs:
    the first text layout of a process reads the font database (slow once, not a stall
    of the app's loop as a user meets it twice)."""
    from PySide6.QtWidgets import QLabel, QTableView

    from app.icons import app_icon, tray_icon

    app = qapp_instance()
    menu = QMenu("warm")
    menu.addAction("Warm up the font cache").setEnabled(False)
    menu.addSeparator()
    checked = menu.addAction("A checked item")
    checked.setCheckable(True)
    checked.setChecked(True)
    menu.popup(QPoint(0, 0))
    box = QMessageBox(QMessageBox.Icon.Warning, "Shoal", "warm")
    box.show()
    app.processEvents()
    menu.grab()  # paint once: styles, check marks, glyphs
    box.grab()
    for widget in (QLabel("warm up"), QTableView()):
        widget.grab()
    for look in ("serving", "busy", "paused", "error", "lonely"):
        tray_icon(look).pixmap(22)  # type: ignore[arg-type]
    app_icon().pixmap(64)
    box.close()
    menu.close()
    box.deleteLater()
    menu.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


@pytest.fixture(autouse=True)
def _collect_on_the_qt_thread() -> Iterator[None]:
    """As the app does (app/collector.py): Python's garbage collector runs on the Qt
    thread only, never in llama.cpp's thread, where freeing a Qt object crashes Qt; what a
    test left is collected here, after it, and the tests after these collect as usual."""
    from app.collector import MainThreadCollector

    collector = MainThreadCollector()
    collector.start()
    yield
    collector.stop()
    gc.collect()
    collector.deleteLater()


def visible_windows() -> list[QWidget]:
    return [w for w in QApplication.topLevelWidgets() if w.isVisible()]


@pytest.fixture(autouse=True)
def _no_window_left() -> Iterator[None]:
    yield
    left = visible_windows()
    for widget in left:
        widget.close()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    if left:
        pytest.fail("the test left windows open: "
                    + ", ".join(f"{type(w).__name__} {w.windowTitle()!r}" for w in left),
                    pytrace=False)


@pytest.fixture
def ui_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SHOAL_HOME and XDG_CONFIG_HOME of the test's own: nothing reaches the user's."""
    home = tmp_path / "shoal"
    home.mkdir()
    monkeypatch.setenv("SHOAL_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return home


def settings_for(home: Path, *, lanes: int = 2, mock_speed: float = 0.0,
                 http: str = "127.0.0.1:0", **head: object) -> Settings:
    return Settings(home=home, discovery=QUIET,
                    head=HeadSettings(http=http, **head),  # type: ignore[arg-type]
                    node=NodeSettings(model=MODEL, runtime="mock", lanes=lanes,
                                      mock_speed=mock_speed))


@pytest.fixture
def mock_settings(ui_home: Path) -> Settings:
    return settings_for(ui_home)


@pytest.fixture
async def shoal(mock_settings: Settings) -> AsyncIterator[Shoal]:
    running = await Shoal.start(mock_settings)
    try:
        yield running
    finally:
        await running.stop(drain=1)


@pytest.fixture
async def bridge(shoal: Shoal) -> AsyncIterator[ShoalBridge]:
    made = ShoalBridge(shoal)
    try:
        yield made
    finally:
        await made.close(wait_s=1)


async def started(settings: Settings, prefs: Prefs | None = None, *,
                  system_tray: bool = True) -> Shell:
    """The app on ``settings``, once Shoal runs and its node is ready."""
    shell = Shell(settings, prefs or Prefs(welcomed=True), system_tray=system_tray)
    shell.start()
    await until(lambda: shell.phase != "starting", "Shoal to start")
    if shell.phase == "running":
        # ready, or paused (a pause kept from the last run: linked, taking no session)
        await until(lambda: any(n.state in ("ready", "paused")
                                for n in shell.bridge.refresh().nodes)
                    or not shell.bridge.last.roles.head, "the node to be ready")
    return shell


@pytest.fixture
async def shell(mock_settings: Settings) -> AsyncIterator[Shell]:
    app = await started(mock_settings)
    try:
        yield app
    finally:
        await app.stop(drain=1)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, the embedded default model (cached across runs)."""
    from engine.models.embedded import ensure_embedded_default
    from tests.e2e.conftest import CACHE

    return ensure_embedded_default(CACHE / "home")


# -- a user at the menu ------------------------------------------------------------------


async def open_menu(menu: QMenu) -> QMenu:
    """Open ``menu`` as a click on the tray icon does (rebuilt from the latest snapshot)."""
    menu.popup(QPoint(40, 40))
    await until(menu.isVisible, "the menu to open")
    return menu


def item(menu: QMenu, key: str) -> QAction:
    for action in menu.actions():
        if action.objectName() == key:
            return action
    raise AssertionError(f"no {key!r} item in the menu: {[a.text() for a in menu.actions()]}")


async def read_menu(menu: QMenu) -> dict[str, tuple[str, bool, bool]]:
    """What the open menu shows: key -> (text, enabled, checked); then it closes."""
    await open_menu(menu)
    shown = {a.objectName(): (a.text(), a.isEnabled(), a.isChecked())
             for a in menu.actions() if not a.isSeparator()}
    menu.close()
    return shown


async def choose(menu: QMenu, key: str) -> None:
    """Open the menu and click the item ``key`` with the mouse."""
    await open_menu(menu)
    action = item(menu, key)
    assert action.isEnabled(), f"{action.text()!r} is disabled"
    QTest.mouseClick(menu, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier,
                     menu.actionGeometry(action).center())
    await until(lambda: not menu.isVisible(), "the menu to close after the click")
