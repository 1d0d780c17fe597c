"""Join a fleet: paste the join URL, open a picture of its QR code (the engine reads it), or
scan it with the camera where Qt Multimedia and a camera are present. A wrong or stale code
shows the engine's one line.

PySide6-Essentials has no QtMultimedia: there the camera button says "no camera here" and
the other two ways work as ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QImage
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.widgets import choose_file, inline_error, note, ok_line, run, say
from engine.errors import ShoalError
from engine.service import JoinResult

SCAN_EVERY_MS = 700
IMAGES = "Images (*.png *.jpg *.jpeg *.gif *.bmp *.webp);;All files (*)"
NO_MULTIMEDIA = ("No camera here: this Shoal was built without camera support. Paste the "
                 "URL or open a picture of the code instead.")
NO_CAMERA = "No camera found on this machine. Paste the URL or open a picture of the code."
_open: set[QDialog] = set()  # dialogs without a parent, kept until they close


def camera_state() -> tuple[bool, str]:
    """(a camera can scan here, the line saying why not)."""
    try:
        from PySide6.QtMultimedia import QMediaDevices
    except ImportError:
        return False, NO_MULTIMEDIA
    if not QMediaDevices.videoInputs():
        return False, NO_CAMERA
    return True, ""


# the engine's join refusals end on a fix for the terminal; the app names its own way there
IN_THE_APP = (
    ("pair again: `shoal fleet pair` on the head, then `shoal node join --code URL` here",
     "pair again: open Shoal's Pairing page on that machine and use its code here"),
    ("make the token on the head (`shoal fleet token`) and pair again",
     "start a fleet on that machine (Shoal's Pairing page) and use its code here"),
    ("pair with `shoal node join --code URL` (from `shoal fleet pair` on the head)",
     "use the code from Shoal's Pairing page on that machine"),
    ("start the head with --fleet-listen, or check the address",
     "check that Shoal runs there in a fleet, and the address"),
    # the model's words for a terminal: in the app the user chooses it again
    ("run again to resume from there", "choose it again to resume from there"),
    ("then run again", "then choose it again"),
    ("run once without --offline to pull it", "turn off offline mode to pull it"),
    ("; run again", "; choose it again"),
)


def in_the_app(line: str) -> str:
    """An engine line with its terminal commands put as the app's own steps."""
    for terminal, app in IN_THE_APP:
        line = line.replace(terminal, app)
    return line


def joined_line(result: JoinResult) -> str:
    heads = len(result.heads)
    fleet = f"“{result.fleet}”" if result.fleet else "the fleet"
    return (f"Joined {fleet}: linked with {heads} head{'s' if heads != 1 else ''}; this "
            f"machine now serves the fleet, which runs {result.model}.")


def _save_frame(image: QImage) -> str:
    """A camera frame as a PNG file for the engine to read (in a worker thread)."""
    fd, path = tempfile.mkstemp(prefix="shoal-scan-", suffix=".png")
    os.close(fd)
    image.save(path, "PNG")
    return path


class CameraScan(QWidget):
    """A live camera view that hands a frame to the engine every so often, until a frame
    holds a join code (Qt Multimedia only)."""

    found = Signal(object)  # a JoinResult
    failed = Signal(str)

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        from PySide6.QtMultimedia import QCamera, QMediaCaptureSession, QVideoSink
        from PySide6.QtMultimediaWidgets import QVideoWidget

        self._bridge = bridge
        self._frame: QImage | None = None
        self._trying = False
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.view = QVideoWidget()
        self.view.setMinimumSize(320, 240)
        layout.addWidget(self.view)
        self.session = QMediaCaptureSession(self)
        self.camera = QCamera(self)
        self.session.setCamera(self.camera)
        self.sink: Any = QVideoSink(self)
        self.session.setVideoSink(self.sink)
        self.sink.videoFrameChanged.connect(self._frame_in)
        self.session.setVideoOutput(self.view)
        self.timer = QTimer(self)
        self.timer.setInterval(SCAN_EVERY_MS)
        self.timer.timeout.connect(self._try)
        self.camera.start()
        self.timer.start()

    def _frame_in(self, frame: Any) -> None:
        self._frame = frame.toImage()

    def _try(self) -> None:
        if self._trying or self._frame is None:
            return
        self._trying, image, self._frame = True, self._frame, None

        async def attempt() -> JoinResult | None:
            path = await asyncio.to_thread(_save_frame, image)
            try:
                return await self._bridge.shoal.join(path)
            except ShoalError as exc:
                if exc.code == "bad_join_code":  # no code in this frame (yet)
                    return None
                raise
            finally:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(os.unlink, path)

        def done(result: JoinResult | None) -> None:
            self._trying = False
            if result is not None:
                self.stop()
                self.found.emit(result)

        def failed(line: str) -> None:
            self._trying = False
            self.stop()
            self.failed.emit(line)

        run(self, self._bridge, attempt(), done=done, failed=failed)

    def stop(self) -> None:
        self.timer.stop()
        self.camera.stop()


class JoinPanel(QWidget):
    """The three ways in, and the outcome (the Join dialog and the welcome show it)."""

    joined = Signal(object)  # a JoinResult
    changed = Signal()  # a line appeared or went: a dialog may need to grow

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        self._busy = False
        self.scanner: CameraScan | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(8)
        layout.addWidget(note("On a machine already in the fleet, open Shoal → Pairing. Then "
                              "paste its join URL here, open a picture of its QR code, or "
                              "scan the code with this machine's camera."))
        self.code = QLineEdit()
        self.code.setObjectName("joinCode")
        self.code.setPlaceholderText("shoal://join?head=…&token=…&fleet=…")
        self.code.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.code.returnPressed.connect(self.join_pasted)
        self.join_button = QPushButton("Join")
        self.join_button.setObjectName("joinPasted")
        self.join_button.clicked.connect(self.join_pasted)
        paste = QHBoxLayout()
        paste.addWidget(self.code, 1)
        paste.addWidget(self.join_button)
        layout.addLayout(paste)
        self.image_button = QPushButton("Open a picture of the code…")
        self.image_button.setObjectName("joinImage")
        self.image_button.clicked.connect(self.choose_image)
        self.camera_button = QPushButton("Scan with the camera")
        self.camera_button.setObjectName("joinCamera")
        self.camera_button.clicked.connect(self.scan)
        others = QHBoxLayout()
        others.addWidget(self.image_button)
        others.addWidget(self.camera_button)
        others.addStretch(1)
        layout.addLayout(others)
        self.camera_note = note("")
        self.camera_note.setObjectName("cameraNote")
        self.camera_note.hide()
        layout.addWidget(self.camera_note)
        self.camera_box = QVBoxLayout()
        layout.addLayout(self.camera_box)
        self.progress = note("")
        self.progress.hide()
        layout.addWidget(self.progress)
        self.error = inline_error()
        layout.addWidget(self.error)
        self.ok = ok_line()
        layout.addWidget(self.ok)
        can, why = camera_state()
        if not can:
            self.camera_button.setEnabled(False)
            self.camera_button.setToolTip(why)
            say(self.camera_note, why)

    @property
    def busy(self) -> bool:
        return self._busy

    def join_pasted(self) -> None:
        text = self.code.text().strip()
        if not text:
            say(self.error, "Paste the join URL first (it starts with shoal://join).")
            return
        self.join(text)

    def choose_image(self) -> None:
        choose_file(self, "Open a picture of the join code", IMAGES, self.join)

    def scan(self) -> None:
        can, why = camera_state()
        if not can:
            say(self.camera_note, why)
            return
        if self.scanner is None:
            self.scanner = CameraScan(self._bridge)
            self.scanner.found.connect(self._joined)
            self.scanner.failed.connect(self._failed)
            self.camera_box.addWidget(self.scanner)
        say(self.progress, "Hold the code up to the camera…")

    def join(self, code: str) -> None:
        """Join by a join URL or the path of a picture of its QR code."""
        if self._busy:
            return
        self._busy = True
        for w in (self.join_button, self.image_button):
            w.setEnabled(False)
        say(self.error, "")
        say(self.ok, "")
        say(self.progress, "Checking the code with the fleet's head…")
        run(self, self._bridge, self._bridge.shoal.join(code), done=self._joined,
            failed=self._failed)

    def _settle(self) -> None:
        self._busy = False
        for w in (self.join_button, self.image_button):
            w.setEnabled(True)
        say(self.progress, "")
        QTimer.singleShot(0, self.changed.emit)

    def _joined(self, result: JoinResult) -> None:
        self._settle()
        self.code.clear()
        say(self.ok, joined_line(result))
        self.joined.emit(result)

    def _failed(self, line: str) -> None:
        self._settle()
        say(self.error, in_the_app(line))

    def close_camera(self) -> None:
        if self.scanner is not None:
            self.scanner.stop()


class JoinDialog(QDialog):
    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("joinDialog")
        self.setWindowTitle("Join a fleet")
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.setMinimumWidth(600)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 18, 20, 16)
        layout.setSpacing(12)
        title = QLabel("Join a fleet")
        font = title.font()
        font.setPointSizeF(font.pointSizeF() * 1.4)
        font.setBold(True)
        title.setFont(font)
        layout.addWidget(title)
        self.panel = JoinPanel(bridge)
        layout.addWidget(self.panel)
        layout.addStretch(1)  # room the dialog gains goes above the buttons, not between lines
        self.close_button = QPushButton("Close")
        self.close_button.setObjectName("closeJoin")
        self.close_button.clicked.connect(self.close)
        bottom = QHBoxLayout()
        bottom.addStretch(1)
        bottom.addWidget(self.close_button)
        layout.addLayout(bottom)
        self.panel.joined.connect(lambda _r: self.close_button.setText("Done"))
        self.finished.connect(lambda _r: self.panel.close_camera())
        self.panel.changed.connect(self.adjustSize)


def open_join_dialog(bridge: ShoalBridge, parent: QWidget | None) -> None:
    """Show the Join dialog (without blocking: the loop keeps running)."""
    dialog = JoinDialog(bridge, parent)
    if parent is None:
        _open.add(dialog)
        dialog.finished.connect(lambda _r: _open.discard(dialog))
    dialog.show()
    dialog.raise_()
    dialog.activateWindow()
