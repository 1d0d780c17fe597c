"""Small widgets every page shares: page headers and cards, a copyable field, the error
banner, a table model that updates rows in place, a bar drawn in a table cell, and the
helpers that run a command or open a file dialog without blocking the loop.

Nothing here opens a modal loop (`exec()`): Qt and asyncio share one thread (qasync), and a
nested loop would run other tasks inside the current one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import shiboken6
from PySide6.QtCore import (
    QAbstractTableModel,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    QRectF,
    QSize,
    Qt,
    QTimer,
    Signal,
)
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QTableView,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge

log = logging.getLogger("shoal.app")
T = TypeVar("T")

SPACING = 12  # between blocks of a page
MARGIN = 20  # around a page
COPIED_MS = 1500  # how long a copy button says "Copied"
GOOD, WARN, BAD = QColor("#2e9d57"), QColor("#d99a1e"), QColor("#d2453b")
ERROR_TEXT, OK_TEXT, WARN_TEXT = QColor("#b3261e"), QColor("#1e7b45"), QColor("#8a5a00")
BANNER_FILL, BANNER_EDGE, BANNER_TEXT = QColor("#fdecea"), QColor("#f1b5b1"), QColor("#8a1c13")
# No style sheets: a style sheet makes Qt restyle every widget under it, which costs more
# than a frame of the loop on a slow machine; palettes and a little painting do the same.
AnyIndex = QModelIndex | QPersistentModelIndex


# -- commands ------------------------------------------------------------------------

def run(owner: QObject, bridge: ShoalBridge, work: Awaitable[T], *,
        done: Callable[[T], None] | None = None,
        failed: Callable[[str], None] | None = None, anytime: bool = False) -> None:
    """Run an engine command through the bridge for the widget ``owner``: its result goes
    to ``done``; with ``failed``, a ShoalError's line goes there (a form shows it beside
    the field it concerns; also the line of a start that failed, so a button disabled
    while the command runs comes back), else to the window's banner. Neither is called
    once ``owner`` is gone (a window closed while its command ran). ``anytime``: see
    `ShoalBridge.run`."""

    def finish(value: T) -> None:
        if done is not None and shiboken6.isValid(owner):
            done(value)

    def fail(line: str) -> None:
        if failed is not None and shiboken6.isValid(owner):
            failed(line)

    bridge.run(work, done=finish, failed=fail if failed is not None else None,
               anytime=anytime)


def choose_file(parent: QWidget, title: str, name_filter: str,
                chosen: Callable[[str], None]) -> QFileDialog:
    """A file dialog that does not block the loop: ``chosen(path)`` when a file is picked."""
    dialog = QFileDialog(parent, title)
    dialog.setObjectName("chooseFile")
    dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
    dialog.setNameFilter(name_filter)
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.fileSelected.connect(chosen)
    dialog.open()
    return dialog


def copy_text(text: str) -> None:
    clipboard = QGuiApplication.clipboard()
    clipboard.setText(text)


# -- text ----------------------------------------------------------------------------

def ago(seconds: float) -> str:
    """``3 s ago``, ``2 min ago``, ``1 h ago``; ``never`` for no record."""
    if seconds < 0 or seconds != seconds:  # a clock step back, or NaN
        return "just now"
    if seconds < 1:
        return "just now"
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return f"{seconds // 86400:.0f} d ago"


def tokens(count: int) -> str:
    """A context window or a count: ``8,192``; ``32k`` when round."""
    if count >= 1024 and count % 1024 == 0:
        return f"{count // 1024}k"
    return f"{count:,}"


def millis(ms: float) -> str:
    if ms <= 0:
        return "—"
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


# -- layout pieces -------------------------------------------------------------------

def tone(widget: QWidget, color: QColor) -> None:
    pal = widget.palette()
    pal.setColor(QPalette.ColorRole.WindowText, color)
    pal.setColor(QPalette.ColorRole.Text, color)
    widget.setPalette(pal)


def muted(label: QLabel) -> QLabel:
    """A secondary line: the text colour halfway to the background."""
    pal = label.palette()
    text, back = pal.color(QPalette.ColorRole.WindowText), pal.color(QPalette.ColorRole.Window)
    mix = QColor((text.red() + back.red()) // 2, (text.green() + back.green()) // 2,
                 (text.blue() + back.blue()) // 2)
    pal.setColor(QPalette.ColorRole.WindowText, mix)
    label.setPalette(pal)
    return label


def note(text: str, *, wrap: bool = True) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(wrap)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return muted(label)


def heading(text: str, size: float = 1.0) -> QLabel:
    label = QLabel(text)
    font = QFont(label.font())
    font.setPointSizeF(font.pointSizeF() * size)
    font.setWeight(QFont.Weight.DemiBold)
    label.setFont(font)
    return label


class PageHeader(QWidget):
    """The title of a page and one line saying what it is for."""

    def __init__(self, title: str, subtitle: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 4)
        layout.setSpacing(2)
        self.title = heading(title, 1.6)
        self.title.setObjectName("pageTitle")
        self.subtitle = note(subtitle)
        layout.addWidget(self.title)
        layout.addWidget(self.subtitle)


class Card(QFrame):
    """A titled group of a page, drawn as a rounded panel."""

    def __init__(self, title: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("card")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, False)
        self.body = QVBoxLayout(self)
        self.body.setContentsMargins(16, 14, 16, 14)
        self.body.setSpacing(8)
        if title:
            self.title = heading(title, 1.1)
            self.body.addWidget(self.title)

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        painter.setPen(pal.color(QPalette.ColorRole.Mid).lighter(125))
        painter.setBrush(pal.color(QPalette.ColorRole.Base))
        painter.drawRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 8, 8)

    def add(self, widget: QWidget, stretch: int = 0) -> QWidget:
        self.body.addWidget(widget, stretch)
        return widget

    def row(self, *widgets: QWidget | None, stretch_last: bool = False) -> QHBoxLayout:
        """Widgets side by side (None: a stretch)."""
        line = QHBoxLayout()
        line.setSpacing(8)
        for w in widgets:
            if w is None:
                line.addStretch(1)
            else:
                line.addWidget(w)
        if stretch_last:
            line.addStretch(1)
        self.body.addLayout(line)
        return line


def page_layout(widget: QWidget) -> QVBoxLayout:
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(MARGIN, MARGIN, MARGIN, MARGIN)
    layout.setSpacing(SPACING)
    return layout


class CopyButton(QPushButton):
    """Copies ``text()`` of its source to the clipboard and says so for a moment."""

    def __init__(self, source: Callable[[], str], label: str = "Copy",
                 parent: QWidget | None = None) -> None:
        super().__init__(label, parent)
        self._source = source
        self._label = label
        self.clicked.connect(self._copy)

    def _copy(self) -> None:
        copy_text(self._source())
        self.setText("Copied")
        QTimer.singleShot(COPIED_MS, self._reset)

    def _reset(self) -> None:
        self.setText(self._label)


class CopyField(QWidget):
    """A read-only line with a Copy button. ``shown`` may differ from what is copied (a join
    URL is shown with its token masked)."""

    def __init__(self, text: str = "", *, label: str = "Copy",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._text = text
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(6)
        self.field = QLineEdit(text)
        self.field.setReadOnly(True)
        self.field.setMinimumWidth(260)
        self.button = CopyButton(lambda: self._text, label)
        layout.addWidget(self.field, 1)
        layout.addWidget(self.button)

    def set_text(self, text: str, shown: str | None = None) -> None:
        self._text = text
        want = text if shown is None else shown
        if self.field.text() != want:
            self.field.setText(want)
            self.field.setCursorPosition(0)

    def text(self) -> str:
        return self._text


class Banner(QFrame):
    """One line that says what went wrong, until it is dismissed or replaced."""

    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("banner")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        self.label = QLabel()
        self.label.setObjectName("bannerText")
        tone(self.label, BANNER_TEXT)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton()
        close.setObjectName("bannerClose")
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.clear)
        layout.addWidget(self.label, 1)
        layout.addWidget(close)
        self.hide()

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(BANNER_EDGE)
        painter.setBrush(BANNER_FILL)
        painter.drawRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 6, 6)

    def show_line(self, line: str) -> None:
        self.label.setText(line)
        self.show()

    def clear(self) -> None:
        self.label.clear()
        self.hide()
        self.dismissed.emit()

    def text(self) -> str:
        return self.label.text() if self.isVisible() else ""


def _status_line(name: str, colour: str, *, selectable: bool = True) -> QLabel:
    """A wrapped line in ``colour``, hidden until it has something to say."""
    label = QLabel()
    label.setObjectName(name)
    tone(label, colour)
    label.setWordWrap(True)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.hide()
    return label


def inline_error() -> QLabel:
    """A line under a form that says why it did not work (hidden until then)."""
    return _status_line("inlineError", ERROR_TEXT)


def ok_line() -> QLabel:
    """A line that says a change was made (hidden until then)."""
    return _status_line("okLine", OK_TEXT)


def warning_line() -> QLabel:
    """A limit worth knowing, not a failure (hidden until there is one)."""
    return _status_line("warningLine", WARN_TEXT, selectable=False)


def say(label: QLabel, text: str) -> None:
    label.setText(text)
    label.setVisible(bool(text))


# -- tables --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Cell:
    text: str
    bar: float | None = None  # 0-100: drawn as a bar (KV occupancy)
    tip: str = ""
    right: bool = False  # numbers align right
    tone: str = ""  # "good" | "warn" | "bad" | "muted"


Row = tuple[Cell, ...]
BAR_ROLE = Qt.ItemDataRole.UserRole + 1
TONES = {"good": GOOD, "warn": WARN, "bad": BAD}


class RowsModel(QAbstractTableModel):
    """Rows identified by a key, updated in place: a row that stays keeps its index (and so
    the selection and scroll position); only changed cells are reported."""

    def __init__(self, headers: Sequence[str], parent: Any = None) -> None:
        super().__init__(parent)
        self.headers = list(headers)
        self.keys: list[str] = []
        self.rows: list[Row] = []

    def rowCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.headers)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.headers[section]
        return None

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        cell = self.rows[index.row()][index.column()]
        if role == Qt.ItemDataRole.DisplayRole:
            return "" if cell.bar is not None else cell.text
        if role == BAR_ROLE:
            return cell.bar
        if role == Qt.ItemDataRole.ToolTipRole:
            return cell.tip or None
        if role == Qt.ItemDataRole.TextAlignmentRole:
            horizontal = Qt.AlignmentFlag.AlignRight if cell.right else Qt.AlignmentFlag.AlignLeft
            return int(horizontal | Qt.AlignmentFlag.AlignVCenter)
        if role == Qt.ItemDataRole.ForegroundRole and cell.tone in TONES:
            return TONES[cell.tone]
        return None

    def key_at(self, row: int) -> str:
        return self.keys[row]

    def set_rows(self, rows: Sequence[tuple[str, Row]]) -> None:
        new_keys = [k for k, _ in rows]
        wanted = dict(rows)
        # rows that went away, from the bottom so indexes stay right
        for i in range(len(self.keys) - 1, -1, -1):
            if self.keys[i] not in wanted:
                self.beginRemoveRows(QModelIndex(), i, i)
                del self.keys[i], self.rows[i]
                self.endRemoveRows()
        kept = [k for k in new_keys if k in self.keys]
        if kept != self.keys:  # the order of the rows that stay changed: rare, start over
            self.beginResetModel()
            self.keys, self.rows = new_keys, [wanted[k] for k in new_keys]
            self.endResetModel()
            return
        for target, key in enumerate(new_keys):
            if target < len(self.keys) and self.keys[target] == key:
                if self.rows[target] != wanted[key]:
                    old = self.rows[target]
                    self.rows[target] = wanted[key]
                    changed = [c for c, (a, b) in enumerate(zip(old, wanted[key], strict=True))
                               if a != b]
                    self.dataChanged.emit(self.index(target, min(changed)),
                                          self.index(target, max(changed)))
                continue
            self.beginInsertRows(QModelIndex(), target, target)
            self.keys.insert(target, key)
            self.rows.insert(target, wanted[key])
            self.endInsertRows()

    def prepend(self, key: str, row: Row, *, limit: int) -> None:
        """A newest-first log: the row goes on top, the oldest past ``limit`` goes."""
        self.beginInsertRows(QModelIndex(), 0, 0)
        self.keys.insert(0, key)
        self.rows.insert(0, row)
        self.endInsertRows()
        if len(self.rows) > limit:
            self.beginRemoveRows(QModelIndex(), limit, len(self.rows) - 1)
            del self.keys[limit:], self.rows[limit:]
            self.endRemoveRows()

    def clear(self) -> None:
        self.beginResetModel()
        self.keys, self.rows = [], []
        self.endResetModel()

    def text(self, row: int, column: int | str) -> str:
        col = self.headers.index(column) if isinstance(column, str) else column
        cell = self.rows[row][col]
        return f"{cell.bar:.0f}%" if cell.bar is not None else cell.text


class BarDelegate(QStyledItemDelegate):
    """A horizontal bar in a cell (0-100), green, amber past 70, red past 90, with the
    percentage beside it."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: AnyIndex) -> None:
        value = index.data(BAR_ROLE)
        if value is None:
            super().paint(painter, option, index)
            return
        self.initStyleOption(option, index)
        style = option.widget.style() if option.widget else None
        if style is not None:  # the selection background, as other cells draw it
            style.drawPrimitive(QStyle.PrimitiveElement.PE_PanelItemViewItem, option, painter,
                                option.widget)
        rect = option.rect.adjusted(6, 0, -6, 0)
        label_w = option.fontMetrics.horizontalAdvance("100%") + 6
        track = QRectF(rect.left(), rect.center().y() - 4, max(rect.width() - label_w, 10), 8)
        pal = option.palette
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(pal.color(QPalette.ColorRole.Mid).lighter(130))
        painter.drawRoundedRect(track, 4, 4)
        share = max(0.0, min(float(value), 100.0))
        if share > 0:
            fill = QRectF(track)
            fill.setWidth(max(track.width() * share / 100.0, 8))
            painter.setBrush(GOOD if share < 70 else WARN if share < 90 else BAD)
            painter.drawRoundedRect(fill, 4, 4)
        painter.setPen(pal.color(QPalette.ColorRole.Text))
        text_rect = QRectF(track.right() + 4, rect.top(), label_w, rect.height())
        painter.drawText(text_rect, int(Qt.AlignmentFlag.AlignRight
                                        | Qt.AlignmentFlag.AlignVCenter), f"{share:.0f}%")
        painter.restore()

    def sizeHint(self, option: QStyleOptionViewItem, index: AnyIndex) -> QSize:
        hint = super().sizeHint(option, index)
        return QSize(max(hint.width(), 120), hint.height())


def fit_rows(view: QTableView, rows: int, *, least: int = 2, most: int = 8) -> None:
    """Make ``view`` as tall as ``rows`` rows (within ``least`` and ``most``), so a short
    table does not leave a blank box and a long one scrolls."""
    shown = max(least, min(rows, most))
    height = (view.horizontalHeader().sizeHint().height()
              + view.verticalHeader().defaultSectionSize() * shown + 2 * view.frameWidth())
    if view.height() != height or view.minimumHeight() != height:
        view.setFixedHeight(height)


def table(model: RowsModel, *, stretch: int | None = None) -> QTableView:
    """A read-only table in the look every page uses: whole rows selected, no grid, the
    row height of one line, the given column taking the spare width."""
    view = QTableView()
    view.setModel(model)
    view.setSelectionBehavior(QTableView.SelectionBehavior.SelectRows)
    view.setSelectionMode(QTableView.SelectionMode.SingleSelection)
    view.setEditTriggers(QTableView.EditTrigger.NoEditTriggers)
    view.setShowGrid(False)
    view.setAlternatingRowColors(True)
    view.setWordWrap(False)
    view.verticalHeader().hide()
    view.verticalHeader().setDefaultSectionSize(view.fontMetrics().height() + 12)
    header = view.horizontalHeader()
    header.setHighlightSections(False)
    header.setDefaultAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    if stretch is not None:
        header.setSectionResizeMode(stretch, QHeaderView.ResizeMode.Stretch)
    else:
        header.setStretchLastSection(True)
    return view
