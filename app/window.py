"""The Shoal window: a sidebar of pages (Fleet, Models and aliases, Pairing, Activity, Try
it, Connect your editor, Settings), a banner for the one line of a command that failed, and
a status bar with the fleet at a glance. It renders the bridge's snapshots and events and
calls commands through it; it holds no fleet logic."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QCloseEvent, QPainter, QPalette, QShowEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QScrollArea,
    QStackedWidget,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
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
from app.widgets import Banner, heading, muted
from engine.events import ShoalEvent
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


class SidebarDelegate(QStyledItemDelegate):
    """A sidebar entry: roomy, with a rounded highlight when chosen."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        rect = QRectF(option.rect).adjusted(8, 1, -8, -1)
        pal = option.palette
        chosen = bool(option.state & QStyle.StateFlag.State_Selected)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        if chosen:
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(pal.color(QPalette.ColorRole.Highlight))
            painter.drawRoundedRect(rect, 6, 6)
        painter.setPen(pal.color(QPalette.ColorRole.HighlightedText if chosen
                                 else QPalette.ColorRole.WindowText))
        painter.setFont(option.font)
        painter.drawText(rect.adjusted(12, 0, -6, 0),
                         int(Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft),
                         str(index.data()))
        painter.restore()

    def sizeHint(self, option: QStyleOptionViewItem,
                 index: QModelIndex | QPersistentModelIndex) -> QSize:
        return QSize(SIDEBAR_WIDTH - 8, option.fontMetrics.height() + 16)


def scrolled(page: QWidget) -> QScrollArea:
    area = QScrollArea()
    area.setWidget(page)
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    return area


class MainWindow(QMainWindow):
    def __init__(self, bridge: ShoalBridge) -> None:
        super().__init__()
        self.bridge = bridge
        self.setObjectName("shoalWindow")
        self.setWindowTitle("Shoal")  # never the token, never the join URL
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
        self.sidebar.setItemDelegate(SidebarDelegate(self.sidebar))
        side.setAutoFillBackground(True)
        side_pal = side.palette()
        side_pal.setColor(QPalette.ColorRole.Window,
                          side_pal.color(QPalette.ColorRole.Window).darker(104))
        side_pal.setColor(QPalette.ColorRole.Base, side_pal.color(QPalette.ColorRole.Window))
        side.setPalette(side_pal)
        self.sidebar.setPalette(side_pal)
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

        # pages are built one per turn of the loop, so opening the window never holds the
        # loop for long (show_page builds a page that is not there yet); events that come
        # before the Activity page is built wait for it
        self._builders: dict[str, Callable[[], QWidget]] = {
            "fleet": lambda: FleetPage(bridge), "models": lambda: ModelsPage(bridge),
            "pairing": lambda: PairingPage(bridge), "activity": lambda: ActivityPage(bridge),
            "try": lambda: TryPage(bridge), "editors": lambda: EditorsPanel(bridge),
            "settings": lambda: SettingsPage(bridge)}
        self.pages: dict[str, QWidget] = {}
        for _key in PAGES:
            self.stack.addWidget(QWidget())
        self._early: list[ShoalEvent] = []
        bridge.event.connect(self._early_event)
        self.page("fleet")
        self.sidebar.currentRowChanged.connect(self._row_chosen)
        self.sidebar.setCurrentRow(0)

        self.status = QLabel()
        self.status.setContentsMargins(14, 2, 0, 2)  # in line with the sidebar's text
        self.status.setObjectName("statusSummary")
        self.working = muted(QLabel())
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.working)
        bridge.failed.connect(self.banner.show_line)
        # a failed start stays said at the top until Shoal starts (the tray and its box
        # said it once; the window once showed only "The API is off on this machine")
        bridge.start_changed.connect(self._start_changed)
        if bridge.start_error:
            self.banner.show_line(bridge.start_error)
        bridge.busy.connect(self._busy)
        bridge.snapshot.connect(self.render)
        self.render(bridge.last)

    def _start_changed(self, error: str | None) -> None:
        if error:
            self.banner.show_line(error)
        elif self.banner.label.text().startswith("Shoal is not running"):
            self.banner.clear()
        self.bridge.snapshot.emit(self.bridge.last)  # the pages say it too

    def page(self, key: str) -> QWidget:
        """The page ``key``, built now if it was not yet."""
        if key not in self.pages:
            built = self._builders[key]()
            if isinstance(built, FleetPage):
                built.navigate.connect(self.show_page)
                built.join.connect(self.open_join)
            index = [k for k, _ in PAGES].index(key)
            placeholder = self.stack.widget(index)
            self.stack.insertWidget(index, scrolled(built))
            self.stack.removeWidget(placeholder)
            placeholder.deleteLater()
            self.pages[key] = built
            self.stack.setCurrentIndex(self.sidebar.currentRow())
            if isinstance(built, ActivityPage):
                self.bridge.event.disconnect(self._early_event)
                for event in self._early:
                    built.add(event)
                self._early.clear()
        return self.pages[key]

    def _early_event(self, event: ShoalEvent) -> None:
        self._early.append(event)

    def _build_next(self) -> None:
        if not self.isVisible():  # a hidden window builds pages when shown (or asked for)
            return
        missing = sorted((k for k, _ in PAGES if k not in self.pages),
                         key=lambda k: k != "activity")
        if missing:
            self.page(missing[0])
            if len(missing) > 1:
                QTimer.singleShot(0, self, self._build_next)

    def _row_chosen(self, row: int) -> None:
        if row >= 0:
            self.page(PAGES[row][0])
            self.stack.setCurrentIndex(row)

    def open_join(self) -> None:
        open_join_dialog(self.bridge, self)

    def _busy(self, on: bool) -> None:
        self.working.setText("Working…" if on else "")

    @property
    def fleet(self) -> FleetPage:
        return cast(FleetPage, self.page("fleet"))

    @property
    def models(self) -> ModelsPage:
        return cast(ModelsPage, self.page("models"))

    @property
    def pairing(self) -> PairingPage:
        return cast(PairingPage, self.page("pairing"))

    @property
    def activity(self) -> ActivityPage:
        return cast(ActivityPage, self.page("activity"))

    @property
    def try_it(self) -> TryPage:
        return cast(TryPage, self.page("try"))

    @property
    def editors(self) -> EditorsPanel:
        return cast(EditorsPanel, self.page("editors"))

    @property
    def settings(self) -> SettingsPage:
        return cast(SettingsPage, self.page("settings"))

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

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        QTimer.singleShot(0, self, self._build_next)

    def closeEvent(self, event: QCloseEvent) -> None:
        # the window hides; an answer streaming into it stops
        if "try" in self.pages:
            self.try_it.stop()
        super().closeEvent(event)
