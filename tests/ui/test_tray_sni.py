"""The tray under a real StatusNotifierItem host: `shoal app` on a private D-Bus session
bus beside Debian's `status-notifier-watcher` and `gtk-sni-tray-standalone` (a GTK panel
that shows the app's menu from com.canonical.dbusmenu, as KDE's and GNOME's trays do), on
Xvfb. Qt exports the icon and its menu over that bus; the host reads the menu's layout
and sends the clicks back by item id.

What is checked: once the app runs, opening the menu (the host's right-click menu, the
app's own left-click popup, and AboutToShow / Event "opened" as a host sends them) sends
the host nothing: no LayoutUpdated (a menu rebuilt on each open sent 28), no changed
items. A state change (Pause serving, clicked in the host's menu) reaches the layout the
host reads before any open, as changed items with the same ids and no layout change.
Items clicked through the host and in the popup after state changes take effect (Copy API
URL lands on the X clipboard, Quit ends the app with code 0).

A monitor connection on the private bus sees every dbusmenu call, answer and signal in
the bus's own order. Every process is started here and ended by its id.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from engine.config import save_machine_settings
from scripts.lib import xvfb
from tests.ui.conftest import settings_for
from tests.ui.test_tray_xvfb import X, end, steady
from tests.waiting import until_sync

pytestmark = [pytest.mark.ui, pytest.mark.processes, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"Xvfb": "xvfb", "dbus-daemon": "dbus", "status-notifier-watcher":
         "haskell-status-notifier-item-utils", "gtk-sni-tray-standalone":
         "haskell-gtk-sni-tray-utils", "xdotool": "xdotool", "xclip": "xclip",
         "xwininfo": "x11-utils"}
MISSING = [name for name in TOOLS if shutil.which(name) is None]
if MISSING:
    pytestmark.append(pytest.mark.skip(
        reason=f"{', '.join(MISSING)} not installed: apt install "
               f"{' '.join(sorted({TOOLS[n] for n in MISSING}))} (scripts/lib/apt.sh does)"))
# a D-Bus client in Python: keyring's Secret Service client brings it on Linux
jeepney = pytest.importorskip("jeepney", reason="jeepney not installed: pip install jeepney")
from jeepney import DBusAddress, Properties, new_method_call  # noqa: E402
from jeepney.bus_messages import Monitoring  # noqa: E402
from jeepney.io.blocking import DBusConnection, open_dbus_connection  # noqa: E402

MENU = "com.canonical.dbusmenu"
OPENS = ("AboutToShow", "AboutToShowGroup")  # what a host calls as a menu opens
# a top-level window in `xwininfo -root -tree`: id, class, geometry
WINDOW = re.compile(r'^ {5}(?P<id>0x[0-9a-f]+) "[^"]*": \("(?P<cls>[^"]+)" "[^"]*"\)\s+'
                    r'(?P<w>\d+)x(?P<h>\d+)\+-?\d+\+-?\d+\s+\+(?P<x>-?\d+)\+(?P<y>-?\d+)')
HOST = "gtk-sni-tray-standalone"


class Seen(NamedTuple):
    layouts: int
    changes: int
    opened: int
    answered: int


@dataclass
class Watch:
    """What a monitor connection saw of the dbusmenu traffic, in the bus's order."""

    address: str
    layouts: int = 0  # LayoutUpdated signals: items added or removed
    changes: int = 0  # ItemsPropertiesUpdated signals: items changed in place
    opened: int = 0  # AboutToShow(Group) calls (a host sends them with no reply expected)
    answered: int = 0  # and answers to them
    readers: set[str] = field(default_factory=set)  # who called GetLayout
    _calls: dict[tuple[str, int], str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        conn = open_dbus_connection(bus=self.address)
        rules = [f"type='method_call',interface='{MENU}'", f"type='signal',interface='{MENU}'",
                 "type='method_return'"]
        conn.send_and_get_reply(Monitoring().BecomeMonitor(rules))
        try:
            while not self._stop.is_set():
                try:
                    msg = conn.receive(timeout=0.1)
                except TimeoutError:
                    continue
                self._saw(msg)
        finally:
            conn.close()

    def _saw(self, msg: Any) -> None:
        fields = {f.name: v for f, v in msg.header.fields.items()}
        kind = msg.header.message_type.name
        with self._lock:
            if kind == "signal":
                self.layouts += fields.get("member") == "LayoutUpdated"
                self.changes += fields.get("member") == "ItemsPropertiesUpdated"
            elif kind == "method_call":
                self._calls[(fields["sender"], msg.header.serial)] = fields["member"]
                self.opened += fields["member"] in OPENS
                if fields["member"] == "GetLayout":
                    self.readers.add(fields["sender"])
            elif kind == "method_return":
                called = self._calls.pop((fields.get("destination", ""),
                                          fields.get("reply_serial", 0)), None)
                self.answered += called in OPENS

    def stop(self) -> None:
        self._stop.set()

    def now(self) -> Seen:
        with self._lock:
            return Seen(self.layouts, self.changes, self.opened, self.answered)


class Menu:
    """The app's StatusNotifierItem and its dbusmenu, as a host reads and drives them."""

    def __init__(self, conn: DBusConnection, name: str, path: str) -> None:
        self.conn = conn
        self.menu = DBusAddress(path, bus_name=name, interface=MENU)

    @staticmethod
    def path(conn: DBusConnection, name: str) -> str | None:
        """The item's menu, once it has one (the icon shows before the menu is set)."""
        item = DBusAddress("/StatusNotifierItem", bus_name=name,
                           interface="org.kde.StatusNotifierItem")
        path = str(conn.send_and_get_reply(Properties(item).get("Menu")).body[0][1])
        return None if path == "/NO_DBUSMENU" else path

    def call(self, method: str, signature: str | None = None, body: tuple = ()) -> Any:
        reply = self.conn.send_and_get_reply(
            new_method_call(self.menu, method, signature, body), timeout=10)
        assert reply.header.message_type.name == "method_return", (method, reply.body)
        return reply.body

    def layout(self) -> list[tuple[int, dict[str, Any]]]:
        """The items as the host reads them: (id, properties), separators included."""
        _rev, (_id, _props, children) = self.call("GetLayout", "iias", (0, -1, []))
        return [(c[1][0], {k: v[1] for k, v in c[1][1].items()}) for c in children]

    def labels(self) -> dict[str, tuple[int, dict[str, Any]]]:
        return {p["label"]: (i, p) for i, p in self.layout() if "label" in p}

    def status(self) -> str:
        return str(self.layout()[0][1]["label"])

    def open(self) -> None:
        """As a host opens the menu: AboutToShow, then Event "opened" (and "closed")."""
        self.call("AboutToShow", "i", (0,))
        for event in ("opened", "closed"):
            self.call("Event", "isvu", (0, event, ("i", 0), 0))


def top_windows(x: X, cls: str) -> list[dict[str, str]]:
    return [m.groupdict() for line in x.run("xwininfo", "-root", "-tree").splitlines()
            if (m := WINDOW.match(line)) and m["cls"] == cls]


def popup(x: X, cls: str) -> dict[str, str] | None:
    """A menu of ``cls`` on screen: shown, override-redirect, big enough for the items."""
    return next((w for w in top_windows(x, cls) if int(w["h"]) > 150 and x.popup(w["id"])),
                None)


def daemon(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


@dataclass
class Desktop:
    x: X
    bus: str  # the private session bus's address
    conn: DBusConnection
    watch: Watch

    def watcher(self, prop: str) -> Any:
        addr = DBusAddress("/StatusNotifierWatcher", bus_name="org.kde.StatusNotifierWatcher",
                           interface="org.kde.StatusNotifierWatcher")
        reply = self.conn.send_and_get_reply(Properties(addr).get(prop), timeout=10)
        return reply.body[0][1] if reply.header.message_type.name == "method_return" else None


@pytest.fixture
def desktop(tmp_path: Path) -> Iterator[Desktop]:
    """Xvfb, a private session bus, the SNI watcher on it, and the GTK SNI panel."""
    started: list[subprocess.Popen[bytes]] = []
    server: subprocess.Popen[bytes] | None = None
    try:
        server, number = xvfb.start()
        x = X(number)
        read, write = os.pipe()
        started.append(subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--address=unix:tmpdir=/tmp",
             f"--print-address={write}"], pass_fds=(write,), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        os.close(write)
        with os.fdopen(read) as lines:
            bus = lines.readline().strip()
        assert bus.startswith("unix:"), "dbus-daemon did not start (it wrote no address)"
        x.env["DBUS_SESSION_BUS_ADDRESS"] = bus
        x.env["NO_AT_BRIDGE"] = "1"  # GTK starts no accessibility bus of its own
        watch = Watch(bus)
        watching = threading.Thread(target=watch.run, daemon=True)
        watching.start()
        conn = open_dbus_connection(bus=bus)
        try:
            d = Desktop(x, bus, conn, watch)
            started.append(daemon(["status-notifier-watcher"], x.env, tmp_path / "watcher.log"))
            until_sync(lambda: d.watcher("IsStatusNotifierHostRegistered") is not None,
                       "the StatusNotifierWatcher on the bus", timeout=20)
            started.append(daemon([HOST, "--top", "--end", "--size", "32"], x.env,
                                  tmp_path / "host.log"))
            # Qt takes the SNI route only once a host has registered with the watcher
            until_sync(lambda: d.watcher("IsStatusNotifierHostRegistered"),
                       "gtk-sni-tray to register as a host", timeout=20)
            yield d
        finally:
            watch.stop()
            watching.join(10)
            conn.close()
    finally:
        for process in reversed(started):
            end(process)
        if server is not None:
            xvfb.stop(server)


def test_the_menu_through_a_status_notifier_host(desktop: Desktop, tmp_path: Path):
    x, watch = desktop.x, desktop.watch
    home = tmp_path / "home"
    save_machine_settings(settings_for(home), {"welcomed": True})
    env = {**x.env, "SHOAL_HOME": str(home), "QT_QPA_PLATFORM": "xcb",
           "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    log_path = tmp_path / "app.log"
    log = log_path.open("wb")
    app = subprocess.Popen([sys.executable, "-m", "app.launch", "app"], cwd=ROOT, env=env,
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        names = until_sync(lambda: desktop.watcher("RegisteredStatusNotifierItems"),
                           "the app's StatusNotifierItem with the watcher", timeout=30)
        name = names[0].split("/")[0]
        menu = Menu(desktop.conn, name, until_sync(lambda: Menu.path(desktop.conn, name),
                                                   "the item's menu", timeout=30))
        until_sync(lambda: watch.readers - {desktop.conn.unique_name},
                   "the host to read the menu", timeout=20)
        panel = until_sync(lambda: next((w for w in top_windows(x, HOST)
                                         if int(w["w"]) >= 1000), None), "the panel")
        icon = (int(panel["x"]) + int(panel["w"]) - 16, int(panel["y"]) + int(panel["h"]) // 2)

        def click(px: int, py: int, button: int = 1) -> None:
            x.run("xdotool", "mousemove", str(px), str(py), "click", str(button))

        def host_menu() -> dict[str, str]:
            """Right-click the icon: the host's own (GTK) menu, once it has settled."""
            opened = watch.now().opened

            def answered() -> bool:
                return watch.now().opened > opened or popup(x, HOST) is not None

            def asked() -> bool:
                # again while nothing came of it: the icon may not be drawn yet
                click(*icon, button=3)
                try:
                    return until_sync(answered, "", timeout=10)
                except AssertionError:
                    return False

            # generous: on a busy machine the host draws its icon and reads the menu late
            until_sync(asked, "the host to open its menu", timeout=60)
            until_sync(lambda: watch.now().opened > opened, "the host's AboutToShow")
            return until_sync(steady(lambda: popup(x, HOST)), "the host's menu", timeout=20)

        def app_menu() -> dict[str, str]:
            """Left-click the icon: the app's own popup (Qt), once it has settled."""
            click(*icon)
            return until_sync(steady(lambda: popup(x, "shoal")), "the app's popup", timeout=20)

        def close(cls: str) -> None:
            x.run("xdotool", "key", "Escape")
            until_sync(lambda: popup(x, cls) is None, "the menu to close")

        def host_row(shown: dict[str, str], row: int) -> tuple[int, int]:
            """The middle of the host menu's ``row``-th item (10 items of one height;
            its separators are a pixel or two, its frame 4 px above and below)."""
            return (int(shown["x"]) + 60,
                    int(shown["y"]) + 4 + (2 * row + 1) * (int(shown["h"]) - 8) // 20)

        def signals() -> tuple[int, int]:
            """The layout changes and item changes so far. The app answers an AboutToShow
            of ours after it has handled every call the bus gave it before (the host's), and
            the monitor sees the changes those made before that answer."""
            answered = watch.now().answered
            menu.open()
            until_sync(lambda: watch.now().answered > answered, "the monitor to see the answer")
            return watch.now()[:2]

        def settled(check: Callable[[str], bool], what: str) -> None:
            """Wait for the status line to pass ``check`` and stay the same across a
            snapshot (one a second)."""
            def passing() -> str | None:
                status = menu.status()
                return status if check(status) else None

            until_sync(steady(passing), what, timeout=30, poll=1.2)

        settled(lambda s: "1 node ready" in s, "the app to run")
        host_menu()  # the first open may still bring the layout up to date
        close(HOST)
        ids = [i for i, _ in menu.layout()]
        before = signals()
        for _ in range(3):  # after that, no open changes anything
            host_menu()
            close(HOST)
            menu.open()
        app_menu()
        close("shoal")
        assert signals() == before, "opening the menu changed it"
        assert [i for i, _ in menu.layout()] == ids

        # a state change through the host: Pause serving (the 8th item)
        click(*host_row(host_menu(), 7))
        until_sync(lambda: popup(x, HOST) is None, "the host's menu to close")
        # the layout the host reads follows the change before any open, with the same ids
        settled(lambda s: s.endswith("paused"), "the layout to say paused")
        assert menu.labels()["Pause serving"][1]["toggle-state"] == 1
        assert [i for i, _ in menu.layout()] == ids
        changed = signals()
        assert changed[0] == before[0], "the same items, yet a layout change"
        assert changed[1] > before[1], "the host was not told of the changed items"
        for _ in range(2):
            host_menu()
            close(HOST)
        app_menu()
        close("shoal")
        assert signals() == changed, "opening the menu after a change changed it again"

        # the app's popup after that change: Pause serving again (its rows are 22 px, the
        # last two groups 2 px apart), then the host's menu: Copy API URL, then Quit
        shown = app_menu()
        click(int(shown["x"]) + 60, int(shown["y"]) + int(shown["h"]) - 14 - 46)
        until_sync(lambda: not menu.status().endswith("paused"), "the popup's click to unpause")
        click(*host_row(host_menu(), 2))
        url = until_sync(lambda: x.run("xclip", "-o", "-selection", "clipboard").strip(),
                         "the URL on the X clipboard", timeout=20)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url), url
        with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
            assert r.status == 200 and b"mock-m" in r.read()
        click(*host_row(host_menu(), 9))
        try:
            code = app.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("Quit in the host's menu did not end the app: " + log_path.read_text())
        assert code == 0, log_path.read_text()
    finally:
        end(app)
        log.close()
