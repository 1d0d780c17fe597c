"""Activity: the recent requests (newest first, bounded) and the fleet's comings and
goings, from the engine's events as they arrive."""

from __future__ import annotations

import itertools
import time

from PySide6.QtWidgets import QLabel, QPushButton, QWidget

from app.bridge import ShoalBridge, describe
from app.widgets import Card, Cell, PageHeader, RowsModel, millis, note, page_layout, table
from engine import events as ev

REQUEST_LIMIT = 500
EVENT_LIMIT = 200
REQUEST_COLUMNS = ("Time", "Model", "Asked for", "Node", "Tokens", "TTFT", "Duration", "Moves",
                   "Result")
EVENT_COLUMNS = ("Time", "What happened")


def clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def request_row(e: ev.SessionFinished) -> tuple[Cell, ...]:
    asked = e.requested if e.requested != e.model else "—"
    if e.error:
        result = Cell(e.error, tone="bad", tip=e.error)
    else:
        result = Cell(e.finish_reason or "done", tone="good")
    cached = f", {e.cached_tokens} cached" if e.cached_tokens else ""
    return (Cell(clock(e.at)), Cell(e.model), Cell(asked), Cell(e.node or "—"),
            Cell(f"{e.prompt_tokens} → {e.completion_tokens}", right=True,
                 tip=f"{e.prompt_tokens} in{cached}, {e.completion_tokens} out"),
            Cell(millis(e.ttft_ms), right=True), Cell(millis(e.duration_ms), right=True),
            Cell(str(e.moves), right=True, tone="warn" if e.moves else ""), result)


def event_line(e: ev.ShoalEvent) -> tuple[str, str] | None:
    """(tone, line) for the events worth a row; None for the rest."""
    if isinstance(e, ev.NodeLinked):
        return "good", describe(e)
    if isinstance(e, ev.NodeLeft):
        return "", describe(e)
    if isinstance(e, ev.NodeUnreachable):
        return "bad", describe(e)
    if isinstance(e, ev.SessionMoved):
        return "warn", (f"a session moved from {e.from_node} to {e.to_node} after "
                        f"{e.after_tokens} tokens: {e.reason}")
    if isinstance(e, ev.AliasChanged):
        target = "removed" if e.target is None else f"→ {e.target}"
        return "", (f"alias {e.name} {target} (ver {e.version}): "
                    f"{e.heads_holding}/{e.heads_total} heads")
    if isinstance(e, ev.Notice) and e.level != "info":
        return ("bad" if e.level == "error" else "warn"), e.text
    if isinstance(e, ev.Dropped):
        return "warn", f"{e.count} events were missed while the window was busy"
    return None


class ActivityPage(QWidget):
    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._ids = itertools.count()
        layout = page_layout(self)
        layout.addWidget(PageHeader("Activity", "Requests this machine's API answered, and "
                                    "what changed in the fleet."))
        requests = Card("Requests")
        self.requests = RowsModel(REQUEST_COLUMNS, self)
        self.request_view = table(self.requests, stretch=REQUEST_COLUMNS.index("Result"))
        self.request_view.setObjectName("requests")
        requests.add(self.request_view, 1)
        self.empty = note("No request yet. Try it, or point an editor at the API.")
        requests.add(self.empty)
        self.count = QLabel()
        clear = QPushButton("Clear")
        clear.clicked.connect(self.clear)
        requests.row(self.count, None, clear)
        layout.addWidget(requests, 3)
        fleet = Card("Fleet")
        self.events = RowsModel(EVENT_COLUMNS, self)
        self.event_view = table(self.events, stretch=1)
        self.event_view.setObjectName("fleetEvents")
        fleet.add(self.event_view, 1)
        layout.addWidget(fleet, 2)
        bridge.event.connect(self.add)
        self._counted()

    def add(self, e: ev.ShoalEvent) -> None:
        key = str(next(self._ids))
        if isinstance(e, ev.SessionFinished):
            self.requests.prepend(key, request_row(e), limit=REQUEST_LIMIT)
            self._counted()
        line = event_line(e)
        if line is not None:
            tone, text = line
            self.events.prepend(key, (Cell(clock(e.at)), Cell(text, tone=tone, tip=text)),
                                limit=EVENT_LIMIT)

    def clear(self) -> None:
        self.requests.clear()
        self.events.clear()
        self._counted()

    def _counted(self) -> None:
        n = self.requests.rowCount()
        self.empty.setVisible(n == 0)
        failed = sum(1 for row in self.requests.rows if row[-1].tone == "bad")
        self.count.setText(f"{n} requests, {failed} failed" if n else "")
