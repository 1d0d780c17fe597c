"""Try it: a chat that streams an answer from the fleet through this machine's API, the way
an editor would ask (OpenAI chat completions, ``stream: true``, over aiohttp)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QKeyEvent, QPalette, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QWidget,
)

from app.bridge import ShoalBridge
from app.editors import offers
from app.widgets import Card, PageHeader, inline_error, millis, note, page_layout, run, say
from engine.errors import ShoalError
from engine.snapshot import FleetSnapshot

log = logging.getLogger("shoal.app")
APP_KEY = "shoal_app"  # the key this page asks for when the API wants keys
CONNECT_S = 5.0
MAX_TOKENS = 512
API_OFF = "The API is off on this machine, so there is nothing to ask here."


class TryError(Exception):
    """The API refused or failed; the message is its one line."""


class Prompt(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    def keyPressEvent(self, event: QKeyEvent) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self._send()
            return
        super().keyPressEvent(event)


async def _error_line(response: aiohttp.ClientResponse) -> str:
    try:
        body = await response.json(content_type=None)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        return f"the API answered {response.status} {response.reason}"


class TryPage(QWidget):
    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        self._task: asyncio.Task[None] | None = None
        self._messages: list[dict[str, str]] = []
        self._answer: list[str] = []
        self._key: str | None = None
        self.max_tokens = MAX_TOKENS  # an answer's bound
        self.seed: int | None = None  # None: a new sample each time (tests pin one)
        layout = page_layout(self)
        layout.addWidget(PageHeader("Try it", "Ask the fleet something, as an editor would."))

        card = Card()
        top = QHBoxLayout()
        self.model = QComboBox()
        self.model.setObjectName("tryModel")
        self.model.setMinimumWidth(260)
        self.clear_button = QPushButton("New chat")
        self.clear_button.clicked.connect(self.new_chat)
        top.addWidget(QLabel("Model"))
        top.addWidget(self.model)
        top.addStretch(1)
        top.addWidget(self.clear_button)
        card.body.addLayout(top)
        self.off = inline_error()
        self.off.setText(API_OFF)
        self.off.show()
        self.api_on = QPushButton("Run the API here")
        self.api_on.clicked.connect(lambda: run(self, bridge, bridge.shoal.set_head(True)))
        self.off_row = QWidget()
        off = QHBoxLayout(self.off_row)
        off.setContentsMargins(0, 0, 0, 0)
        off.addWidget(self.off)
        off.addWidget(self.api_on)
        off.addStretch(1)
        card.add(self.off_row)
        self.transcript = QTextBrowser()
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenExternalLinks(False)
        self.transcript.setPlaceholderText("The answer streams here.")
        card.add(self.transcript, 1)
        self.prompt = Prompt(self.send)
        self.prompt.setObjectName("prompt")
        self.prompt.setPlaceholderText("Write a question, then press Enter "
                                       "(Shift+Enter for a new line)")
        self.prompt.setFixedHeight(self.prompt.fontMetrics().height() * 3 + 16)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        ask = QHBoxLayout()
        ask.addWidget(self.prompt, 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        ask.addLayout(buttons)
        card.body.addLayout(ask)
        self.status = note("")
        self.status.setObjectName("tryStatus")
        self.error = inline_error()
        card.add(self.status)
        card.add(self.error)
        layout.addWidget(card, 1)
        bridge.snapshot.connect(self.render)
        self.render(bridge.last)

    @property
    def streaming(self) -> bool:
        # until _finished has run (a done callback, a loop turn after the task ends): Send
        # is enabled again only then
        return self._task is not None

    def render(self, snap: FleetSnapshot) -> None:
        api = snap.roles.api_url is not None
        self.off_row.setVisible(not api)
        self.send_button.setEnabled(api and not self.streaming)
        names = [(o.label, o.name) for o in offers(snap) if not o.embeddings]  # chat only
        have = [(self.model.itemText(i), self.model.itemData(i))
                for i in range(self.model.count())]
        if have != names:
            current = self.model.currentData()
            self.model.clear()
            for label, name in names:
                self.model.addItem(label, name)
            keep = [n for _, n in names].index(current) if current in \
                [n for _, n in names] else 0
            self.model.setCurrentIndex(keep)

    def new_chat(self) -> None:
        self.stop()
        self._messages.clear()
        self.transcript.clear()
        say(self.status, "")
        say(self.error, "")

    def send(self) -> None:
        text = self.prompt.toPlainText().strip()
        url = self._bridge.last.roles.api_url
        if not text or self.streaming:
            return
        if url is None:
            say(self.error, API_OFF)
            return
        model = self.model.currentData()
        if not model:
            say(self.error, "No model is served right now; wait for a node, or choose a "
                            "model on the Models page.")
            return
        self.prompt.clear()
        say(self.error, "")
        self._messages.append({"role": "user", "content": text})
        self._write_turn("You", text)
        self._write_turn(model, "")
        self._answer = []
        self.send_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        say(self.status, "Waiting for the first token…")
        task = asyncio.get_running_loop().create_task(self._ask(url, model), name="try-it")
        task.add_done_callback(self._finished)
        self._task = task

    def stop(self) -> None:
        if self.streaming:
            assert self._task is not None
            self._task.cancel()

    def _write_turn(self, who: str, text: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if not self.transcript.document().isEmpty():
            cursor.insertBlock()
            cursor.insertBlock()
        name = QTextCharFormat()
        name.setFontWeight(QFont.Weight.DemiBold)
        name.setForeground(self.palette().color(QPalette.ColorRole.Highlight))
        cursor.insertText(who, name)
        cursor.insertBlock()
        cursor.insertText(text, QTextCharFormat())
        self.transcript.setTextCursor(cursor)

    def _write(self, text: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text, QTextCharFormat())
        self.transcript.setTextCursor(cursor)
        self.transcript.ensureCursorVisible()

    async def _ask(self, base: str, model: str) -> None:
        body = {"model": model, "messages": list(self._messages), "stream": True,
                "max_tokens": self.max_tokens, "stream_options": {"include_usage": True}}
        if self.seed is not None:
            body["seed"] = self.seed
        started = time.monotonic()
        first: float | None = None
        pieces = 0
        usage: dict[str, Any] | None = None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for attempt in (1, 2):
                headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
                async with http.post(base + "/chat/completions", json=body,
                                     headers=headers) as r:
                    if r.status == 401 and attempt == 1:
                        # keys are on: this machine may issue its own (the same every time)
                        self._key = await self._bridge.shoal.keys.issue(APP_KEY)
                        continue
                    if r.status != 200:
                        raise TryError(await _error_line(r))
                    async for raw in r.content:
                        line = raw.decode("utf-8", "replace").strip()
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            raise TryError(str(chunk["error"].get("message", chunk["error"])))
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices") or ():
                            piece = (choice.get("delta") or {}).get("content")
                            if piece:
                                if first is None:
                                    first = time.monotonic()
                                    say(self.status, "Answering…")
                                pieces += 1
                                self._answer.append(piece)
                                self._write(piece)
                    break
        took = time.monotonic() - started
        count = int(usage["completion_tokens"]) if usage else pieces
        ttft = millis((first - started) * 1000) if first else "—"
        say(self.status, f"{count} tokens in {took:.1f} s · first token after {ttft}")

    def _finished(self, task: asyncio.Task[None]) -> None:
        if self._task is task:
            self._task = None
        answer = "".join(self._answer)
        if answer:
            self._messages.append({"role": "assistant", "content": answer})
        elif self._messages and self._messages[-1]["role"] == "user":
            self._messages.pop()  # nothing came back: ask again from the same place
        self.stop_button.setEnabled(False)
        self.send_button.setEnabled(self._bridge.last.roles.api_url is not None)
        if task.cancelled():
            self._write(" [stopped]")
            say(self.status, "Stopped.")
            return
        exc = task.exception()
        if exc is None:
            return
        say(self.status, "")
        if isinstance(exc, TryError | ShoalError):
            say(self.error, str(exc))
        elif isinstance(exc, aiohttp.ClientConnectionError | TimeoutError):
            say(self.error, "Cannot reach this machine's API; check that Shoal's API is "
                            "running (Settings has its port).")
        else:
            say(self.error, f"Something went wrong ({type(exc).__name__}); the log has the "
                            "details.")
            log.error("Try it failed", exc_info=exc)
