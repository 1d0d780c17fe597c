"""The tray icon and its menu.

What the tray shows is a pure function of a `TrayView` (the latest snapshot, the app's
prefs, and how the start went): `look` picks the icon, `status_line` the first line of
the menu and the tooltip (saying when this machine's model sleeps or wakes),
`menu_entries` the items with their texts and check states.
`Tray` renders that with Qt: the icon and the menu follow every view (and the menu the
view as of now each time it is about to show), and a chosen item comes out as
``chosen(key, checked)`` for the app to carry out. Where there is no system tray the same
menu goes into the window's menu bar.

The menu's items are made once and changed in place: under a StatusNotifierItem host Qt
exports the menu over D-Bus (com.canonical.dbusmenu), where every added or removed item
is a layout change with new item ids. A menu rebuilt on each open made the host re-read
it every time, show a stale layout on the first open after a change, and drop clicks
sent to the ids it had just read; now a layout change goes out only when an item does.
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QCursor
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.icons import TrayLook, tray_icon
from app.prefs import Prefs
from engine.models.pulls.text import progress
from engine.snapshot import FleetSnapshot, PullSnapshot

Phase = Literal["starting", "running", "failed", "stopping"]
Key = Literal["status", "problem", "pull", "retry", "open", "copy_api_url", "join", "pair", "leave",
              "api", "pause", "login", "quit"]
Slot = tuple[Key, int]  # an item of the menu: its key, and which one of that key
MAX_LINE = 90  # characters of a menu line; a longer one is cut with an ellipsis


@dataclass(frozen=True, slots=True)
class TrayView:
    snapshot: FleetSnapshot
    prefs: Prefs
    phase: Phase = "running"
    problem: str | None = None  # a one-line error the user should see until it clears
    progress: str | None = None  # what the start is doing (preparing the model: 40 %)
    autostart: bool = True  # start at login is offered on this system
    rejoining: bool = False  # in a fleet whose heads are not reachable yet


@dataclass(frozen=True, slots=True)
class Entry:
    key: Key
    text: str
    enabled: bool = True
    checkable: bool = False
    checked: bool = False
    separator_before: bool = False


def in_fleet(view: TrayView) -> bool:
    roles = view.snapshot.roles
    return roles.member or roles.fleet_listen is not None or view.rejoining


def look(view: TrayView) -> TrayLook:
    """The icon: error, then paused, then busy, then not in a fleet, else serving."""
    snap = view.snapshot
    node = snap.roles.node
    if view.phase == "failed" or view.problem or (node is not None and node.state == "failed"):
        return "error"
    if node is not None and node.state == "paused":
        return "paused"
    working = view.phase in ("starting", "stopping") or bool(snap.pulls)
    if working or snap.lanes_busy or snap.queued or (node is not None and node.lanes_busy):
        return "busy"
    if not in_fleet(view):
        return "lonely"
    return "serving"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def status_line(view: TrayView) -> str:
    """The fleet, its nodes and lanes at a glance, or what the start is doing."""
    if view.phase == "starting":
        return f"Starting: {view.progress or 'loading the model'}…"
    if view.phase == "stopping":
        return "Quitting: finishing the requests under way…"
    if view.phase == "failed":
        return "Shoal is not running"
    snap = view.snapshot
    fleet = snap.fleet_name if (in_fleet(view) and snap.fleet_name) else (
        "In a fleet" if in_fleet(view) else "Not in a fleet")
    parts = [fleet]
    node = snap.roles.node
    if snap.roles.head:
        parts.append(f"{_plural(snap.ready_nodes, 'node')} ready")
        parts.append(f"{snap.lanes_busy}/{snap.lanes} lanes busy")
    elif node is not None:
        parts.append("API off here")
        parts.append(f"{node.lanes_busy}/{node.lanes} lanes busy")
    else:
        parts.append("API off here")
    if node is not None and node.state == "paused":
        parts.append("paused")
    mine = next((n for n in snap.nodes if n.link == "local"), None)
    if node is not None and mine is not None and mine.sleep:  # unloaded while idle
        parts.append(f"model {mine.sleep}")
    loading = [k.name for k in node.kept if k.state == "loading"] if node is not None else []
    if loading:  # a kept model loading for a request
        parts.append(f"loading {', '.join(loading)}")
    return " · ".join(parts)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 1].rstrip() + "…"


def tooltip(view: TrayView) -> str:
    lines = ["Shoal", status_line(view)]
    if view.problem:
        lines.append(view.problem)
    return "\n".join(lines)


def pull_line(pull: PullSnapshot) -> str:
    """A download under way: ``Downloading org/repo:Q4_K_M: 40% of 1.2 GiB, 12 MiB/s,
    1 min 20 s left`` (what is known of it)."""
    return _cut(f"Downloading {pull.model}: "
                + progress(pull.done_bytes, pull.total_bytes, pull.rate_bps, pull.eta_s))


def menu_entries(view: TrayView) -> list[Entry]:
    snap = view.snapshot
    roles = snap.roles
    node = roles.node
    running = view.phase == "running"
    api = roles.api_url
    entries = [Entry("status", _cut(status_line(view)), enabled=False)]
    if view.problem:
        entries.append(Entry("problem", _cut(view.problem), enabled=False))
    entries += [Entry("pull", pull_line(p), enabled=False)
                for p in snap.pulls if p.state == "running"]
    if view.phase == "failed":  # the cause fixed (another port in Settings), start again
        entries.append(Entry("retry", "Start again"))
    entries += [
        Entry("open", "Open Shoal", separator_before=True),
        Entry("copy_api_url", f"Copy API URL ({_host_port(api)})" if api
              else "Copy API URL (the API is off here)", enabled=running and api is not None),
        Entry("join", "Join a fleet…", enabled=running and node is not None,
              separator_before=True),
        Entry("pair", "Pair a new machine…", enabled=running),
        Entry("leave", "Leave fleet", enabled=running and in_fleet(view)),
        Entry("api", "Run the API on this machine", enabled=running, checkable=True,
              checked=roles.head, separator_before=True),
        Entry("pause", "Pause serving",
              enabled=running and node is not None and node.state in ("serving", "paused"),
              checkable=True, checked=node is not None and node.state == "paused"),
        Entry("login", "Start at login", enabled=view.autostart, checkable=True,
              checked=view.prefs.start_at_login),
        Entry("quit", "Quit Shoal", enabled=view.phase != "stopping", separator_before=True),
    ]
    return entries


def _update(action: QAction, entry: Entry) -> None:
    """Set what differs: each change is a message to a D-Bus menu host."""
    if action.text() != entry.text:
        action.setText(entry.text)
    if action.isEnabled() != entry.enabled:
        action.setEnabled(entry.enabled)
    if entry.checkable and action.isChecked() != entry.checked:
        action.setChecked(entry.checked)


def _host_port(url: str | None) -> str:
    if not url:
        return ""
    return url.split("://", 1)[-1].removesuffix("/v1")


class Tray(QObject):
    """The icon (None where there is no system tray) and the menu."""

    chosen = Signal(str, bool)  # an Entry key, and the new check state of a checkable one

    def __init__(self, view: TrayView, *, system_tray: bool,
                 icon: QSystemTrayIcon | None = None,
                 fresh: Callable[[], TrayView] | None = None) -> None:
        super().__init__()
        self.view = view
        self._fresh = fresh  # the view as of now, asked for each time the menu opens
        # the early icon's menu, when it has one: the host keeps the path it read first
        early = icon.contextMenu() if icon is not None else None
        self.menu = early if early is not None else QMenu("&Shoal")
        self.menu.clear()
        self.menu.setObjectName("shoal-tray-menu")
        self.menu.aboutToShow.connect(self._opening)
        self._items: dict[Slot, tuple[QAction, QAction | None]] = {}  # the item, its separator
        self.sent: deque[str] = deque(maxlen=20)  # the notifications shown, newest last
        self._look: TrayLook = look(view)
        self._tip = tooltip(view)
        self.icon: QSystemTrayIcon | None = None
        if system_tray:  # the icon shown early (app.main.early_icon), or a new one
            self.icon = icon if icon is not None else QSystemTrayIcon(self)
            self.icon.setParent(self)
            self.icon.setIcon(tray_icon(self._look))
            self.icon.setToolTip(self._tip)
            if self.icon.contextMenu() is not self.menu:
                self.icon.setContextMenu(self.menu)
            self.icon.activated.connect(self._activated)
        self._sync(menu_entries(view))

    def show(self) -> None:
        if self.icon is not None:
            self.icon.show()

    @property
    def look(self) -> TrayLook:
        return self._look

    def render(self, view: TrayView) -> None:
        """Follow a new view; the icon and tooltip change only when what they show does
        (a snapshot arrives every second, and an idle app should stay idle)."""
        self.view = view
        new_look, new_tip = look(view), tooltip(view)
        if new_look != self._look:
            self._look = new_look
            if self.icon is not None:
                self.icon.setIcon(tray_icon(new_look))
        if new_tip != self._tip:
            self._tip = new_tip
            if self.icon is not None:
                self.icon.setToolTip(new_tip)
        # kept current, not only on opening: a StatusNotifierItem host shows the layout it
        # already has while it asks for a new one
        self._sync(menu_entries(view))

    def _opening(self) -> None:
        if self._fresh is not None:
            self.render(self._fresh())

    def _sync(self, entries: list[Entry]) -> None:
        """Make the menu show ``entries``: an item gone is removed, a new one inserted in
        its place, and the rest keep their QAction with only what changed set on it."""
        seen: Counter[Key] = Counter()
        slots: list[tuple[Slot, Entry]] = []
        for entry in entries:  # the n-th item of a key (downloads share one) is one slot
            slots.append(((entry.key, seen[entry.key]), entry))
            seen[entry.key] += 1
        wanted = {slot for slot, _ in slots}
        for slot in [s for s in self._items if s not in wanted]:
            for gone in self._items.pop(slot):
                if gone is not None:
                    self.menu.removeAction(gone)
                    gone.deleteLater()
        following: QAction | None = None  # back to front: a new item goes before the next
        for slot, entry in reversed(slots):
            if slot not in self._items:
                self._items[slot] = self._add(entry, following)
            action, separator = self._items[slot]
            _update(action, entry)
            following = separator if separator is not None else action

    def _add(self, entry: Entry, before: QAction | None) -> tuple[QAction, QAction | None]:
        action = QAction(entry.text, self.menu)
        action.setObjectName(entry.key)
        action.setCheckable(entry.checkable)
        action.triggered.connect(lambda checked=False, key=entry.key:
                                 self.chosen.emit(key, bool(checked)))
        self.menu.insertAction(before, action)  # type: ignore[arg-type]  # None: at the end
        separator = None
        if entry.separator_before:
            separator = QAction(self.menu)
            separator.setSeparator(True)
            self.menu.insertAction(action, separator)
        return action, separator

    def action(self, key: Key) -> QAction:
        """The menu's item for ``key`` (the first, for downloads)."""
        for action in self.menu.actions():
            if action.objectName() == key:
                return action
        raise KeyError(key)

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.DoubleClick:
            self.chosen.emit("open", False)
        elif reason == QSystemTrayIcon.ActivationReason.Trigger and sys.platform != "darwin":
            # a left click opens the menu too: the menu is the app's front door
            self.menu.popup(QCursor.pos())

    def notify(self, text: str, *, critical: bool = False) -> None:
        self.sent.append(text)
        if self.icon is not None and self.icon.isVisible():
            kind = (QSystemTrayIcon.MessageIcon.Critical if critical
                    else QSystemTrayIcon.MessageIcon.Information)
            self.icon.showMessage("Shoal", text, kind, 8000)

    def close(self) -> None:
        if self.icon is not None:
            self.icon.hide()
            self.icon.setContextMenu(None)  # type: ignore[arg-type]
            self.icon.deleteLater()
            self.icon = None
        self.menu.close()
        self.menu.deleteLater()
