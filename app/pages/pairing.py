"""Pairing: the join code of this fleet as a QR code to scan from the new machine, the join
URL and the command to copy, starting a fleet when there is none, and rotating the token.

The join URL holds the fleet token: it is shown with the token masked (the Copy button
copies it whole), and never goes into a window title or a log.
"""

from __future__ import annotations

import re

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QImage, QPixmap, qGray
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.widgets import (
    Card,
    CopyField,
    PageHeader,
    heading,
    inline_error,
    note,
    page_layout,
    run,
    say,
)
from engine.service import Pairing
from engine.snapshot import FleetSnapshot

QR_SIDE = 232  # pixels on screen: readable by a phone or a webcam at arm's length
JOIN_COMMAND = "shoal node join --code -"
ROTATE_TEXT = ("Rotate the fleet token?\n\nEvery other machine of this fleet stops "
               "working with it until it pairs again with the new code.")


def masked(url: str) -> str:
    """The join URL with its token hidden, for showing."""
    return re.sub(r"(token=)[0-9A-Fa-f]+", r"\1" + "•" * 12, url)


def module_px(image: QImage) -> int:
    """Pixels per module of a QR image: the top-left finder's outer ring is 7 modules wide."""
    side = min(image.width(), image.height())
    for d in range(side):
        if qGray(image.pixel(d, d)) < 128:
            x = d
            while x < image.width() and qGray(image.pixel(x, d)) < 128:
                x += 1
            return max(1, round((x - d) / 7))
    return 1


def qr_pixmap(png: bytes, side: int) -> QPixmap:
    """The QR code at a whole number of pixels per module, as large as fits in ``side``:
    every module stays a crisp square (a fractional scale would blur or skew them)."""
    image = QImage.fromData(png)
    if image.isNull():
        return QPixmap()
    module = module_px(image)
    grid = max(1, image.width() // module)
    factor = max(1, side // grid)
    ignore, fast = Qt.AspectRatioMode.IgnoreAspectRatio, Qt.TransformationMode.FastTransformation
    modules = image.scaled(grid, grid, ignore, fast)
    return QPixmap.fromImage(modules.scaled(grid * factor, grid * factor, ignore, fast))


class PairingView(QWidget):
    """The QR code, the fleet's name and the copy buttons (the Pairing page and the
    welcome's "Start a fleet here" step show it)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.pairing: Pairing | None = None
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(20)
        self.qr = QLabel()
        self.qr.setObjectName("qr")
        self.qr.setFixedSize(QSize(QR_SIDE, QR_SIDE))
        self.qr.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.qr.setStyleSheet("background: white; border-radius: 8px;")
        layout.addWidget(self.qr, 0, Qt.AlignmentFlag.AlignTop)
        side = QVBoxLayout()
        side.setSpacing(8)
        self.fleet = heading("", 1.2)
        self.fleet.setObjectName("pairFleet")
        self.head = note("")
        self.steps = note("On the new machine: open Shoal, choose Join a fleet, and scan this "
                          "code with its camera, or open a picture of it, or paste the URL.")
        self.url = CopyField(label="Copy URL")
        self.url.setObjectName("joinUrl")
        self.command = CopyField(JOIN_COMMAND, label="Copy command")
        self.command.setObjectName("joinCommand")
        side.addWidget(self.fleet)
        side.addWidget(self.head)
        side.addWidget(self.steps)
        side.addSpacing(4)
        side.addWidget(QLabel("Join URL (it holds the fleet's key: share it only with your "
                              "own machines)"))
        side.addWidget(self.url)
        side.addWidget(QLabel("Or, in a terminal on the new machine (it asks for the URL):"))
        side.addWidget(self.command)
        side.addStretch(1)
        layout.addLayout(side, 1)

    def show_pairing(self, pairing: Pairing) -> None:
        self.pairing = pairing
        self.qr.setPixmap(qr_pixmap(pairing.png, QR_SIDE))
        self.fleet.setText(f"Fleet “{pairing.fleet}”")
        self.head.setText(f"New machines join the head at {pairing.head}.")
        self.url.set_text(pairing.url, shown=masked(pairing.url))


class PairingPage(QWidget):
    paired = Signal(object)  # a Pairing, when one is shown

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        self._had_token: bool | None = None
        self._asked = False
        layout = page_layout(self)
        layout.addWidget(PageHeader("Pairing", "Add a machine to your fleet by scanning a "
                                    "code; no accounts, no servers."))

        self.start_card = Card("Start a fleet here")
        self.start_card.add(note("This machine has no fleet yet. Start one: Shoal makes a "
                                 "fleet key, keeps it in this computer's keychain, and shows "
                                 "the code other machines scan to join."))
        self.name = QLineEdit()
        self.name.setObjectName("fleetNameInput")
        self.name.setPlaceholderText("a name people will see, like “desk”")
        self.start = QPushButton("Start a fleet here")
        self.start.setObjectName("startFleet")
        self.start.clicked.connect(self.start_fleet)
        self.start_card.row(QLabel("Name"), self.name, self.start)
        layout.addWidget(self.start_card)

        self.code_card = Card()
        self.view = PairingView()
        self.code_card.add(self.view)
        layout.addWidget(self.code_card)

        self.rotate_card = Card("Rotate the fleet token")
        self.rotate_card.add(note("If a join code went somewhere it should not have, make a new "
                                  "token. Every machine must then pair again."))
        self.rotate = QPushButton("Rotate token…")
        self.rotate.setObjectName("rotateToken")
        self.rotate.clicked.connect(self.ask_rotate)
        self.rotate_card.row(self.rotate, None)
        layout.addWidget(self.rotate_card)
        self.error = inline_error()
        layout.addWidget(self.error)
        layout.addStretch(1)
        self.confirm: QMessageBox | None = None
        bridge.snapshot.connect(self.render)
        self.render(bridge.last)

    def render(self, snap: FleetSnapshot) -> None:
        has = snap.has_token
        self.start_card.setVisible(not has)
        self.code_card.setVisible(has)
        self.rotate_card.setVisible(has)
        if has and (self._had_token is not True) and not self._asked:
            self.refresh()
        self._had_token = has

    def showEvent(self, event: object) -> None:
        super().showEvent(event)  # type: ignore[arg-type]
        if self._bridge.last.has_token and not self._asked:
            self.refresh()

    def refresh(self) -> None:
        """Ask the engine for the current join code (its addresses may have changed)."""
        self._asked = True
        run(self, self._bridge, self._bridge.shoal.pairing(), done=self._show, failed=self._failed)

    def _show(self, pairing: Pairing) -> None:
        self._asked = False
        say(self.error, "")
        self.view.show_pairing(pairing)
        self.paired.emit(pairing)

    def _failed(self, line: str) -> None:
        self._asked = False
        say(self.error, line)

    def start_fleet(self) -> None:
        name = self.name.text().strip() or None
        self._asked = True
        run(self, self._bridge, self._bridge.shoal.create_fleet(name), done=self._show,
            failed=self._failed)

    def ask_rotate(self) -> None:
        box = QMessageBox(QMessageBox.Icon.Warning, "Rotate the fleet token", ROTATE_TEXT,
                          QMessageBox.StandardButton.Cancel, self)
        box.setObjectName("confirmRotate")
        rotate = box.addButton("Rotate token", QMessageBox.ButtonRole.DestructiveRole)
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)

        def answered(_result: int) -> None:
            self.confirm = None
            if box.clickedButton() is rotate:
                self.rotate_token()

        box.finished.connect(answered)
        self.confirm = box
        box.open()

    def rotate_token(self) -> None:
        self._asked = True
        run(self, self._bridge, self._bridge.shoal.rotate_token(), done=self._show,
            failed=self._failed)
