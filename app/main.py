"""`shoal app`: the desktop app. One QApplication, one asyncio loop (qasync) that Qt and
the engine share, one `Shoal` running in process, and the tray in front of it.

    run(argv)      the process: single instance, Qt, the loop; returns the exit code
    main(...)      the life of the app: settings, the shell, Quit
    Shell          the composition: Shoal, its bridge, the tray, the window, the welcome

The shell renders what the engine reports and calls its commands; it holds no fleet
logic. Every file it touches is read or written off the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QApplication,
    QMainWindow,
    QMenu,
    QMessageBox,
    QSystemTrayIcon,
    QWidget,
)

from app import autostart
from app.bridge import ShoalBridge, describe, sentence
from app.collector import MainThreadCollector
from app.icons import app_icon, tray_icon
from app.instance import SingleInstance
from app.loop import make_loop
from app.notify import Notifier, say
from app.prefs import Prefs, load
from app.tray import Phase, Tray, TrayView
from engine import events as ev
from engine.config import ConfigError
from engine.errors import ShoalError
from engine.settings import Settings, default_home
from engine.tasks import TaskSet

if TYPE_CHECKING:
    from engine.service import Shoal

log = logging.getLogger("shoal.app")

QUIT_DRAIN_S = 10.0  # Quit waits this long for the requests under way, then cancels them
FIX_AND_RETRY = "fix that and choose Start again in Shoal's menu"
# a port in use: the one failure Settings fixes
FIX_PORT_AND_RETRY = "Settings has the ports; then choose Start again in Shoal's menu"


def fix_for(code: str) -> str:
    return FIX_PORT_AND_RETRY if code == "port_in_use" else FIX_AND_RETRY


def _progress(event: ev.PullProgress) -> str:
    if event.total_bytes:
        return f"preparing the model: {100 * event.done_bytes // event.total_bytes} %"
    return f"preparing the model: {event.message}" if event.message else "preparing the model"


class _CloseQuits(QObject):
    """Closing the window quits the app where there is no tray to keep it reachable."""

    def __init__(self, quit_: Callable[[], None]) -> None:
        super().__init__()
        self._quit = quit_

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Close:
            self._quit()
        return False


class Shell(QObject):
    def __init__(self, settings: Settings, prefs: Prefs, *,
                 system_tray: bool | None = None, icon: QSystemTrayIcon | None = None) -> None:
        from engine.service import Shoal  # the whole engine: after the early icon shows

        super().__init__()
        # Shoal owns config.toml, the app's choices in it included: the app reads them
        # from there and changes them through update_settings, never keeping a copy; the
        # fleet to come back to Shoal joins once the rest runs (its heads may be away)
        self.shoal: Shoal = Shoal(replace(settings, join=None), keep=True, app=asdict(prefs),
                                  rejoin=settings.join if settings.node else None)
        # subscribes now: the start's progress shows; commands wait for the start
        self.bridge = ShoalBridge(self.shoal, started=False)
        self.phase: Phase = "starting"
        self.problem: str | None = None
        self.progress: str | None = None
        self.system_tray = (QSystemTrayIcon.isSystemTrayAvailable() if system_tray is None
                            else system_tray)
        self.tray = Tray(self._view(), system_tray=self.system_tray, icon=icon,
                         fresh=self._fresh_view)
        self.tray.chosen.connect(self._chosen)
        self.notifier = Notifier(self.tray.notify)
        self.window: QMainWindow | None = None  # app.window.MainWindow, made when first shown
        self.welcome: QWidget | None = None
        self.quitting = asyncio.Event()
        self._tasks = TaskSet("the app")
        self.bridge.snapshot.connect(lambda _snap: self._render())
        self.bridge.event.connect(self._on_event)
        self.bridge.failed.connect(self.tell)

    # -- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Show the tray (or the window where there is none) at once, then start Shoal
        in the background: the tray tells how the start goes."""
        self.tray.show()
        if not self.system_tray:
            self._run_as_window()
        if not self.prefs.welcomed:
            self.show_welcome()
        self._tasks.spawn(self._open(), "app-open")

    async def _open(self) -> None:
        try:
            await self.shoal.open()
        except ShoalError as exc:
            self._failed(str(exc), exc.code)
            return
        except Exception as exc:  # a bug: one line here, the traceback in the log
            log.exception("Shoal did not start")
            self._failed(f"Shoal could not start ({type(exc).__name__}); the log has the "
                         "details")
            return
        self.bridge.start_ended()
        self.phase, self.progress = "running", None
        log.info("Shoal runs: the API is %s", f"at {self.shoal.api_url}" if self.shoal.api_url
                 else "off on this machine")
        self._render()

    def _failed(self, line: str, code: str = "") -> None:
        fix = fix_for(code)
        self.bridge.start_ended(error=f"Shoal is not running: {line}; {fix}")
        self.phase, self.problem = "failed", line
        self._render()
        box = say(line, parent=self.window if self.window is not None
                  and self.window.isVisible() else None,
                  title="Shoal could not start", icon=QMessageBox.Icon.Critical)
        box.setInformativeText(f"{sentence(fix)}.")

    def retry(self) -> None:
        """Start again after a failed start, from the settings as they are now (the
        user may have fixed the cause: another port in Settings)."""
        if self.phase != "failed":
            return
        self.phase, self.problem, self.progress = "starting", None, None
        self.bridge.starting()
        self._render()
        self._tasks.spawn(self._open(), "app-open")  # on the settings as changed meanwhile

    async def stop(self, drain: float = QUIT_DRAIN_S) -> None:
        """Finish the requests under way (at most ``drain`` seconds), stop Shoal, and
        leave no task, thread or window behind."""
        self.phase = "stopping"
        self._render()
        await self._tasks.close()
        await self.bridge.close(wait_s=drain)
        await self.shoal.stop(drain=drain)
        self.notifier.close()
        self.tray.close()
        for widget in (self.welcome, self.window):
            if widget is not None:
                widget.close()
                widget.deleteLater()
        self.welcome = self.window = None

    # -- what the user sees ------------------------------------------------------------

    @property
    def prefs(self) -> Prefs:
        """The app's choices as Shoal holds them now."""
        return Prefs.from_table(self.shoal.app_settings)

    def _view(self) -> TrayView:
        roles = self.bridge.last.roles
        return TrayView(snapshot=self.bridge.last, prefs=self.prefs, phase=self.phase,
                        problem=self.problem or (f"Not linked with the fleet: "
                                                 f"{roles.rejoin_error}"
                                                 if roles.rejoin_error else None),
                        progress=self.progress, autostart=autostart.supported(),
                        rejoining=roles.rejoining)

    def _fresh_view(self) -> TrayView:
        """The menu opens on the fleet as it is now, not as of the last second's snapshot."""
        self.bridge.refresh()
        return self._view()

    def _render(self) -> None:
        view = self._view()
        self.tray.render(view)
        if self.window is None:
            return
        bar = self.window.statusBar()
        if self.phase == "starting":
            bar.showMessage(f"Starting: {self.progress or 'loading the model'}…")
        elif bar.currentMessage().startswith("Starting"):
            bar.clearMessage()

    def tell(self, line: str) -> None:
        """A command failed, or something needs the user: the tray says it (the window's
        status bar where there is no tray)."""
        if self.system_tray:
            self.tray.notify(line, critical=True)
        else:
            self.tray.sent.append(line)
            if self.window is not None:
                self.window.statusBar().showMessage(line, 15000)

    def _on_event(self, event: ev.ShoalEvent) -> None:
        if isinstance(event, ev.PullProgress) and self.phase == "starting":
            self.progress = _progress(event)
            self._render()
        if self.prefs.notify and _worth_a_notification(event):
            self.notifier.offer(describe(event))

    # -- windows -----------------------------------------------------------------------

    def window_(self) -> QMainWindow:
        if self.window is None:
            from app.window import MainWindow

            self.window = MainWindow(self.bridge)
            self.window.setWindowIcon(app_icon())
        return self.window

    def open_window(self, page: str | None = None) -> None:
        """Bring the window forward (a second launch, Open Shoal), on ``page``."""
        target: QWidget
        if page is None and self.welcome is not None and self.welcome.isVisible():
            target = self.welcome
        else:
            target = self.window_()
            if page is not None:
                target.show_page(page)  # type: ignore[attr-defined]
        target.showNormal()
        target.raise_()
        target.activateWindow()

    def show_welcome(self) -> None:
        from app.welcome import Welcome

        welcome = Welcome(self.bridge)
        welcome.setWindowIcon(app_icon())
        welcome.finished.connect(self._welcome_done)
        self.welcome = welcome
        welcome.show()

    def _welcome_done(self, result: int) -> None:
        if result and not self.prefs.welcomed:
            self.set_prefs(welcomed=True)
        if result:  # finished: Shoal goes on in the tray; its window shows where it is
            self.open_window("fleet")

    def _run_as_window(self) -> None:
        """No system tray here: the window is the app, with the tray's menu in its menu
        bar, and closing it quits. Said once."""
        window = self.window_()
        window.menuBar().addMenu(self.tray.menu)
        self._close_quits = _CloseQuits(self.quitting.set)
        window.installEventFilter(self._close_quits)
        window.show()
        if not self.prefs.told_no_tray:
            say("There is no system tray here, so Shoal runs as this window: its menu is "
                "Shoal in the menu bar, and closing the window quits Shoal.",
                parent=window, icon=QMessageBox.Icon.Information)
            self.set_prefs(told_no_tray=True)

    # -- what the user chose -------------------------------------------------------------

    def _chosen(self, key: str, checked: bool) -> None:
        shoal, bridge = self.shoal, self.bridge
        if key == "open":
            self.open_window()
        elif key == "copy_api_url":
            url = bridge.refresh().roles.api_url
            if url:
                QGuiApplication.clipboard().setText(url)
        elif key == "join":
            from app.join import open_join_dialog

            parent = self.window if self.window is not None and self.window.isVisible() \
                else None
            open_join_dialog(bridge, parent)
        elif key == "pair":
            self.open_window("pairing")
        elif key == "leave":
            bridge.run(shoal.leave())
        elif key == "api":
            bridge.run(shoal.set_head(checked))
        elif key == "pause":
            bridge.run(shoal.pause_serving(checked))
        elif key == "login":
            self._tasks.spawn(self._start_at_login(checked), "app-autostart")
        elif key == "retry":
            self.retry()
        elif key == "quit":
            self.quitting.set()

    def set_prefs(self, **changes: bool) -> None:
        """Change the app's choices (Shoal keeps and writes them)."""
        self.bridge.run(self.shoal.update_settings(app=changes), anytime=True,
                        failed=self.tell)

    async def _start_at_login(self, on: bool) -> None:
        """The choice kept, then the login entry written (or removed) to match it."""
        try:
            await self.shoal.update_settings(app={"start_at_login": on})
            await autostart.set_enabled(on)
        except ShoalError as exc:
            self.tell(sentence(str(exc)))
        except OSError as exc:
            await self.shoal.update_settings(app={"start_at_login": not on})
            self.tell(f"cannot {'turn on' if on else 'turn off'} start at login "
                      f"({exc.strerror or exc}); check that your config folder is writable")
        self._render()


def _worth_a_notification(event: ev.ShoalEvent) -> bool:
    if isinstance(event, (ev.NodeLinked, ev.NodeLeft)):
        return event.key != "local"  # this machine's own node coming up is no news
    if isinstance(event, ev.SessionFinished):
        return event.error is not None
    return isinstance(event, ev.Notice) and event.level == "error"


# -- the process ---------------------------------------------------------------------------


async def _wait_closed(box: QMessageBox) -> None:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def closed(_result: int) -> None:
        if not done.done():
            done.set_result(None)

    box.finished.connect(closed)
    await done


def early_icon() -> QSystemTrayIcon | None:
    """The tray icon, in its starting look, shown before the engine is even imported (a
    second or so): the app is there at once. `Tray` takes it over."""
    if not QSystemTrayIcon.isSystemTrayAvailable():
        return None
    icon = QSystemTrayIcon(tray_icon("busy"))
    icon.setToolTip("Shoal\nStarting…")
    # with its menu from the start: a StatusNotifierItem host reads the menu's path when
    # the icon registers, and one that read "no menu" never asked again (its right-click
    # did nothing); `Tray` fills this same menu
    menu = QMenu("&Shoal")
    menu.addAction("Starting…").setEnabled(False)
    icon.setContextMenu(menu)
    icon.early_menu = menu  # type: ignore[attr-defined]  # kept alive with the icon
    icon.show()
    return icon


async def main(home: Path, guard: SingleInstance | None = None, *,
               system_tray: bool | None = None, icon: QSystemTrayIcon | None = None) -> int:
    """The app's life on the running qasync loop; returns the exit code."""
    try:
        settings, prefs = await load(home)  # a few turns of the loop: the early icon docks
    except ConfigError as exc:
        if icon is not None:
            icon.hide()
        await _wait_closed(say(str(exc), title="Shoal cannot read its settings",
                               icon=QMessageBox.Icon.Critical))
        return 1
    shell = Shell(settings, prefs, system_tray=system_tray, icon=icon)
    if guard is not None:
        guard.activated.connect(shell.open_window)
    _on_signals(shell.quitting.set)
    shell.start()
    await shell.quitting.wait()
    await shell.stop()
    return 0


def _on_signals(quit_: Callable[[], None]) -> None:
    """SIGINT and SIGTERM quit as Quit does (draining), not with a traceback."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, quit_)
        except (NotImplementedError, RuntimeError, ValueError):
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(quit_))


def application() -> QApplication:
    existing = QApplication.instance()
    # argv[0] names the windows' WM_CLASS: "shoal", as the desktop file's StartupWMClass
    qapp = existing if isinstance(existing, QApplication) else QApplication(["shoal"])
    qapp.setApplicationName("Shoal")
    qapp.setApplicationDisplayName("Shoal")
    qapp.setOrganizationName("Shoal")
    qapp.setDesktopFileName("shoal")
    qapp.setWindowIcon(app_icon())
    qapp.setQuitOnLastWindowClosed(False)  # the tray keeps running with no window open
    return qapp


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shoal app",
                                     description="Shoal's tray app (the desktop app)")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    home = default_home()
    qapp = application()
    guard = SingleInstance(home)
    try:
        if not guard.claim():
            print("Shoal is already running: its window was brought forward",
                  file=sys.stderr)
            return 0
    except RuntimeError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 1
    collector = MainThreadCollector(qapp)
    collector.start()
    icon = early_icon()
    try:
        with asyncio.Runner(loop_factory=lambda: make_loop(qapp)) as runner:
            return runner.run(main(home, guard, icon=icon))
    finally:
        collector.stop()
        guard.release()
