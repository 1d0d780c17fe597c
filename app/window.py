"""The Shoal window: a sidebar of pages (Fleet, Models and aliases, Pairing, Activity, Try
it, Connect your editor, Settings), a banner for the one line of a command that failed, and
a status bar with the fleet at a glance. It renders the bridge's snapshots and events and
calls commands through it; it holds no fleet logic."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QScrollArea,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.editors import EditorsPanel
from app.join import open_join_dialog
from app.pages.activity import ActivityPage
from app.pages.fleet import FleetPage
from app.pages.models import ModelsPage
from app.pages.pairing import PairingPage
from app.pages.settings import SettingsPage
from app.pages.try_it import TryPage
from app.prefs import Prefs
from app.widgets import STYLE, Banner, heading, muted
from engine.snapshot import FleetSnapshot

PAGES = (("fleet", "Fleet"), ("models", "Models and aliases"), ("pairing", "Pairing"),
         ("activity", "Activity"), ("try", "Try it"), ("editors", "Connect your editor"),
         ("settings", "Settings"))
SIDEBAR_WIDTH = 210
SIZE = (1280, 800)


def summary(snap: FleetSnapshot) -> str:
    """The fleet at a glance, for the status bar."""
    fleet = f"Fleet “{snap.fleet_name}”" if snap.fleet_name else "Not in a fleet"
    nodes = f"{snap.ready_nodes} of {len(snap.nodes)} nodes ready"
    lanes = f"{snap.lanes_busy}/{snap.lanes} lanes busy"
    queued = f" · {snap.queued} queued" if snap.queued else ""
    api = "" if snap.roles.api_url else " · API off here"
    return f"{fleet} · {nodes} · {lanes}{queued}{api}"


def scrolled(page: QWidget) -> QScrollArea:
    area = QScrollArea()
    area.setWidget(page)
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    return area


class MainWindow(QMainWindow):
    def __init__(self, bridge: ShoalBridge, prefs: Prefs, *,
                 save_prefs: Callable[[Prefs], None]) -> None:
        super().__init__()
        self.bridge = bridge
        self.setObjectName("shoalWindow")
        self.setWindowTitle("Shoal")  # never the token, never the join URL
        self.setStyleSheet(STYLE)
        self.resize(*SIZE)

        central = QWidget()
        outer = QHBoxLayout(central)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(0)
        side = QWidget()
        side.setObjectName("side")
        side.setFixedWidth(SIDEBAR_WIDTH)
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 18, 0, 12)
        side_layout.setSpacing(2)
        title = heading("Shoal", 1.5)
        title.setContentsMargins(22, 0, 0, 0)
        self.side_fleet = muted(QLabel())
        self.side_fleet.setContentsMargins(22, 0, 0, 6)
        self.sidebar = QListWidget()
        self.sidebar.setObjectName("sidebar")
        self.sidebar.setFrameShape(QFrame.Shape.NoFrame)
        self.sidebar.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.sidebar.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        for key, label in PAGES:
            item = QListWidgetItem(label)
            item.setData(Qt.ItemDataRole.UserRole, key)
            self.sidebar.addItem(item)
        side_layout.addWidget(title)
        side_layout.addWidget(self.side_fleet)
        side_layout.addWidget(self.sidebar, 1)
        line = QFrame()
        line.setFrameShape(QFrame.Shape.VLine)
        line.setObjectName("sideLine")
        line.setStyleSheet("color: palette(midlight);")

        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 0, 0, 0)
        right_layout.setSpacing(0)
        self.banner = Banner()
        banner_box = QWidget()
        banner_layout = QVBoxLayout(banner_box)
        banner_layout.setContentsMargins(20, 12, 20, 0)
        banner_layout.addWidget(self.banner)
        self.stack = QStackedWidget()
        right_layout.addWidget(banner_box)
        right_layout.addWidget(self.stack, 1)
        outer.addWidget(side)
        outer.addWidget(line)
        outer.addWidget(right, 1)
        self.setCentralWidget(central)

        self.fleet = FleetPage(bridge)
        self.models = ModelsPage(bridge)
        self.pairing = PairingPage(bridge)
        self.activity = ActivityPage(bridge)
        self.try_it = TryPage(bridge)
        self.editors = EditorsPanel(bridge)
        self.settings = SettingsPage(bridge, prefs, save_prefs=save_prefs)
        self.pages: dict[str, QWidget] = {
            "fleet": self.fleet, "models": self.models, "pairing": self.pairing,
            "activity": self.activity, "try": self.try_it, "editors": self.editors,
            "settings": self.settings}
        for key, _label in PAGES:
            self.stack.addWidget(scrolled(self.pages[key]))
        self.sidebar.currentRowChanged.connect(self.stack.setCurrentIndex)
        self.sidebar.setCurrentRow(0)
        self.fleet.navigate.connect(self.show_page)
        self.fleet.join.connect(lambda: open_join_dialog(bridge, self))

        self.status = QLabel()
        self.status.setObjectName("statusSummary")
        self.working = muted(QLabel())
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.working)
        bridge.failed.connect(self.banner.show_line)
        bridge.busy.connect(lambda on: self.working.setText("Working…" if on else ""))
        bridge.snapshot.connect(self.render)
        self.render(bridge.last)

    @property
    def current_page(self) -> str:
        return PAGES[self.stack.currentIndex()][0]

    def show_page(self, page: str) -> None:
        """Bring the window forward on ``page`` (one of PAGES' keys)."""
        keys = [k for k, _ in PAGES]
        if page not in keys:
            raise ValueError(f"no page {page!r}; one of {', '.join(keys)}")
        self.sidebar.setCurrentRow(keys.index(page))
        if self.isMinimized():
            self.showNormal()
        self.show()
        self.raise_()
        self.activateWindow()

    def render(self, snap: FleetSnapshot) -> None:
        self.status.setText(summary(snap))
        self.side_fleet.setText(snap.fleet_name or "Not in a fleet")

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's name
        # the window hides; an answer streaming into it stops
        self.try_it.stop()
        super().closeEvent(event)
