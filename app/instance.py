"""One app per user and per ``SHOAL_HOME``: a second launch asks the running one to bring
its window forward, then exits.

The first launch holds a lock file in ``SHOAL_HOME`` (Qt's QLockFile: a lock left by a
process that died is taken over) and listens on a local socket whose name is derived
from the user and the home; a later launch that cannot take the lock connects there and
sends ``show``. The lock, not the socket, decides who runs, so two launches at the same
moment cannot both start (nor remove each other's socket).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

log = logging.getLogger("shoal.app")

HANDOVER_S = 5.0  # how long a second launch keeps trying while the first starts up
SHOW = b"show\n"
OK = b"ok\n"


def server_name(home: Path) -> str:
    """The local socket's name: per user and per home, nothing a person typed in it."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    digest = hashlib.sha256(str(home.expanduser().resolve()).encode()).hexdigest()[:16]
    return f"shoal-app-{uid}-{digest}"


class SingleInstance(QObject):
    """``claim()`` once at start: True when this process is the app (it now answers later
    launches; ``activated`` fires when one asks), False when it handed over to another."""

    activated = Signal()

    def __init__(self, home: Path) -> None:
        super().__init__()
        self.name = server_name(home)
        home.mkdir(parents=True, exist_ok=True)
        self._lock = QLockFile(str(home / "app.lock"))
        self._server: QLocalServer | None = None

    def claim(self, handover_s: float = HANDOVER_S) -> bool:
        """Blocking (called before the event loop runs)."""
        if self._lock.tryLock(0):
            self._listen()
            return True
        deadline = time.monotonic() + handover_s
        while time.monotonic() < deadline:
            if self._hand_over():
                return False
            if self._lock.tryLock(100):  # the other one quit meanwhile
                self._listen()
                return True
        raise RuntimeError(f"another Shoal holds {self._lock.fileName()} but does not "
                           "answer; quit it (or end its process) and start Shoal again")

    def _hand_over(self) -> bool:
        sock = QLocalSocket()
        sock.connectToServer(self.name)
        try:
            if not sock.waitForConnected(500):
                return False
            sock.write(SHOW)
            sock.waitForBytesWritten(1000)
            answer = b""
            while not answer.endswith(b"\n") and sock.waitForReadyRead(2000):
                answer += bytes(sock.readAll().data())
            return answer == OK
        finally:
            sock.abort()

    def _listen(self) -> None:
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        QLocalServer.removeServer(self.name)  # a socket file a crashed app left behind
        if not server.listen(self.name):
            log.warning("cannot listen on %s (%s): a second launch will start another app",
                        self.name, server.errorString())
            return
        server.newConnection.connect(self._accept)
        self._server = server

    def _accept(self) -> None:
        assert self._server is not None
        while (sock := self._server.nextPendingConnection()) is not None:
            sock.readyRead.connect(lambda s=sock: self._read(s))
            sock.disconnected.connect(sock.deleteLater)

    def _read(self, sock: QLocalSocket) -> None:
        if not sock.canReadLine():
            if sock.bytesAvailable() > 64:  # not one of ours
                sock.abort()
            return
        line = bytes(sock.readLine(64).data())
        if line == SHOW:
            sock.write(OK)
            sock.flush()
            self.activated.emit()
        sock.disconnectFromServer()

    def release(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server.deleteLater()
            self._server = None
        self._lock.unlock()
