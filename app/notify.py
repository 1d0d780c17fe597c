"""Telling the user things: desktop notifications, rate-limited so that a burst (ten nodes
joining at once, a failing client retrying) becomes one message, and one-line dialogs
that never block the event loop."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer
from PySide6.QtWidgets import QMessageBox, QWidget

GAP_S = 10.0  # at most one notification this often


class Coalescer:
    """At most one message per ``gap_s``: a line offered within the gap waits, and the
    lines that waited are shown as one when it has passed (the latest, and how many more).
    Pure: time is passed in; memory stays the same however long the burst."""

    def __init__(self, gap_s: float = GAP_S) -> None:
        self.gap_s = gap_s
        self._last = -math.inf
        self._latest = ""
        self._count = 0

    def offer(self, line: str, now: float) -> str | None:
        """The text to show now, or None when the line waits for `flush`."""
        if not self._count and now - self._last >= self.gap_s:
            self._last = now
            return line
        self._latest = line
        self._count += 1
        return None

    @property
    def due_at(self) -> float | None:
        """When the waiting lines may be shown (None: none wait)."""
        return self._last + self.gap_s if self._count else None

    def flush(self, now: float) -> str | None:
        due = self.due_at
        if due is None or now < due:
            return None
        latest, count = self._latest, self._count
        self._count, self._last = 0, now
        if count == 1:
            return latest
        return f"{latest} (and {count - 1} more: Open Shoal to see them)"


class Notifier(QObject):
    """A `Coalescer` on a Qt timer: ``send(text)`` is called at most once per gap."""

    def __init__(self, send: Callable[[str], None], *, gap_s: float = GAP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._send = send
        self._clock = clock
        self._lines = Coalescer(gap_s)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self._flush)

    def offer(self, line: str) -> None:
        text = self._lines.offer(line, self._clock())
        if text is not None:
            self._send(text)
        elif not self._timer.isActive():
            self._arm()

    def _arm(self) -> None:
        due = self._lines.due_at
        if due is not None:  # a timer may fire a little early: round up, check again then
            self._timer.start(max(1, math.ceil((due - self._clock()) * 1000)))

    def _flush(self) -> None:
        text = self._lines.flush(self._clock())
        if text is not None:
            self._send(text)
        else:
            self._arm()

    def close(self) -> None:
        self._timer.stop()


def say(line: str, *, parent: QWidget | None = None, title: str = "Shoal",
        icon: QMessageBox.Icon = QMessageBox.Icon.Warning) -> QMessageBox:
    """One line in a dialog, shown without a nested event loop (``exec`` would run the
    asyncio loop re-entrantly); it deletes itself when closed."""
    box = QMessageBox(icon, title, line, QMessageBox.StandardButton.Ok, parent)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    box.setTextFormat(Qt.TextFormat.PlainText)
    box.setObjectName("shoal-say")
    _showing.add(box)  # a box with no parent lives as long as Python holds it
    box.finished.connect(lambda _result: _showing.discard(box))
    box.open()
    return box


_showing: set[QMessageBox] = set()
