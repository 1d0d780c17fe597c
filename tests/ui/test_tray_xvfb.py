"""The tray under a real X server with a real tray host: `shoal app` runs in Xvfb beside
Debian's `trayer` (an XEmbed system tray), its icon docks in trayer's panel, a real
click (xdotool) opens its menu, the keyboard picks Copy API URL and the X clipboard
(xclip) holds the URL of the API that answers; then Quit from the same menu ends the
app cleanly. A screenshot of the open menu is kept as a test artifact.

Xvfb and trayer are started here, each on a display of its own (Xvfb picks a free
number, -displayfd), and exactly those processes are ended by their ids.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from engine.config import save_machine_settings
from scripts.lib import xvfb as xvfb_server
from tests.ui.conftest import settings_for
from tests.waiting import until_sync

pytestmark = [pytest.mark.ui, pytest.mark.processes, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"Xvfb": "xvfb", "trayer": "trayer", "xdotool": "xdotool", "xclip": "xclip",
         "xwininfo": "x11-utils"}
MISSING = [name for name in TOOLS if shutil.which(name) is None]
T = TypeVar("T")
ARTIFACTS = Path(os.environ.get("SHOAL_TEST_ARTIFACTS", ROOT / "test-artifacts"))
# a window of the app in `xwininfo -root -tree`: id, WM_CLASS ("shoal" "Shoal"), geometry
WINDOW = re.compile(r'^(?P<indent>\s*)(?P<id>0x[0-9a-f]+) "[^"]*": \("shoal" "Shoal"\)\s+'
                    r'(?P<w>\d+)x(?P<h>\d+)\+-?\d+\+-?\d+\s+\+(?P<x>-?\d+)\+(?P<y>-?\d+)')

if MISSING:
    pytestmark.append(pytest.mark.skip(
        reason=f"{', '.join(MISSING)} not installed: apt install "
               f"{' '.join(sorted({TOOLS[n] for n in MISSING}))} (scripts/lib/apt.sh does)"))


def steady(look: Callable[[], T | None]) -> Callable[[], T | None]:
    """A check for ``until_sync``: what ``look()`` sees once two looks in a row agree (a
    window that has stopped moving and resizing)."""
    seen: list[T | None] = []

    def check() -> T | None:
        seen.append(look())
        return seen[-1] if len(seen) > 1 and seen[-1] == seen[-2] else None

    return check


class X:
    """One X display: run X clients on it."""

    def __init__(self, display: str) -> None:
        self.env = {**os.environ, "DISPLAY": display}
        self.env.pop("WAYLAND_DISPLAY", None)

    def run(self, *argv: str) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=20)
        return done.stdout

    def app_windows(self) -> list[dict[str, str]]:
        return [m.groupdict() for line in self.run("xwininfo", "-root", "-tree").splitlines()
                if (m := WINDOW.match(line))]

    def tray_icon(self) -> dict[str, str] | None:
        """The app's window docked in the tray (a child of trayer's panel, icon-sized)."""
        return next((w for w in self.app_windows()
                     if len(w["indent"]) > 8 and int(w["w"]) <= 64 and int(w["h"]) <= 64),
                    None)

    def menu(self) -> dict[str, str] | None:
        """The app's menu: a top-level popup of the app (override-redirect, shown) big
        enough to hold the items; not the app's window, which may be open too."""
        return next((w for w in self.app_windows()
                     if len(w["indent"]) <= 8 and int(w["h"]) > 150 and self.popup(w["id"])),
                    None)

    def popup(self, window: str) -> bool:
        info = self.run("xwininfo", "-id", window)
        return "Map State: IsViewable" in info and "Override Redirect State: yes" in info

    def screenshot(self, path: Path, area: tuple[int, int, int, int] = (0, 0, -1, -1),
                   zoom: int = 1) -> None:
        """The screen (or ``area``: x, y, width, height) as a PNG, through Qt."""
        grab = ("from PySide6.QtGui import QGuiApplication\n"
                "app = QGuiApplication(['shoal-screenshot'])\n"
                f"shot = app.primaryScreen().grabWindow(0, *{area!r})\n"
                f"shot.scaled(shot.width() * {zoom}, shot.height() * {zoom}).save({str(path)!r})\n")
        subprocess.run([sys.executable, "-c", grab], env={**self.env, "QT_QPA_PLATFORM": "xcb"},
                       capture_output=True, timeout=30, check=True)


def end(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture
def display(tmp_path: Path) -> Iterator[X]:
    """Xvfb on a free display number, and trayer's panel on it."""
    xvfb, number = xvfb_server.start()
    try:
        x = X(number)
        trayer_log = tmp_path / "trayer.log"
        with trayer_log.open("wb") as out:
            trayer = subprocess.Popen(
                ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
                 "--height", "32", "--SetDockType", "true", "--transparent", "false",
                 "--expand", "true"], env=x.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            until_sync(lambda: trayer.poll() is not None or '"panel": ("panel" "trayer")'
                       in x.run("xwininfo", "-root", "-tree"), "trayer's panel", timeout=20)
            assert trayer.poll() is None, f"trayer ended: {trayer_log.read_text()}"
            yield x
        finally:
            end(trayer)
    finally:
        xvfb_server.stop(xvfb)


def test_the_tray_icon_docks_and_its_menu_works(display: X, tmp_path: Path):
    home = tmp_path / "home"
    save_machine_settings(settings_for(home), {"welcomed": True})
    env = {**display.env, "SHOAL_HOME": str(home), "QT_QPA_PLATFORM": "xcb",
           "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           # no session bus: Qt uses the XEmbed tray (trayer), and starts no bus of its own
           "DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path / 'no-bus'}"}
    log = (tmp_path / "app.log").open("wb")
    app = subprocess.Popen([sys.executable, "-m", "app.launch", "app"], cwd=ROOT, env=env,
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        # the icon once it stays put: the panel grows and moves as the icon docks
        icon = until_sync(steady(display.tray_icon), "the icon in trayer's panel",
                          timeout=20, poll=0.2)
        x = int(icon["x"]) + int(icon["w"]) // 2
        y = int(icon["y"]) + int(icon["h"]) // 2

        def open_menu() -> dict[str, str]:
            display.run("xdotool", "mousemove", str(x), str(y), "click", "1")
            # the menu is rebuilt from a snapshot as it opens (a new window): use it only
            # once the same window, place and size read the same twice in a row
            return until_sync(steady(display.menu), "the tray menu to open and settle",
                              timeout=20)

        # before the start is done the menu offers only Open, Start at login and Quit
        until_sync(lambda: b"Shoal runs" in (tmp_path / "app.log").read_bytes(),
                   "the app to say it runs", timeout=20)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        display.screenshot(ARTIFACTS / "tray-icon-xvfb.png", zoom=4,
                           area=(int(icon["x"]) - 40, 0, int(icon["w"]) + 40, 32))
        menu = open_menu()
        display.screenshot(ARTIFACTS / "tray-menu-xvfb.png")
        # clicks, not keys: a key press can come before the menu has the keyboard. Rows
        # are 22 px: the status line, a separator, Open Shoal, then Copy API URL
        display.run("xdotool", "mousemove", str(int(menu["x"]) + int(menu["w"]) // 2),
                    str(int(menu["y"]) + 56), "click", "1")
        until_sync(lambda: display.menu() is None, "the menu to close", timeout=20)
        url = until_sync(lambda: display.run("xclip", "-o", "-selection", "clipboard").strip(),
                         "the URL on the X clipboard", timeout=20)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url), url
        with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
            assert r.status == 200 and b"mock-m" in r.read()

        menu = open_menu()
        # a click on the last item, Quit Shoal
        display.run("xdotool", "mousemove", str(int(menu["x"]) + int(menu["w"]) // 2),
                    str(int(menu["y"]) + int(menu["h"]) - 14), "click", "1")
        try:
            code = app.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("Quit did not end the app: " + (tmp_path / "app.log").read_text())
        assert code == 0, (tmp_path / "app.log").read_text()
        assert display.tray_icon() is None
    finally:
        end(app)
        log.close()
