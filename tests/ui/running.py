"""Shoal in process for the window's tests: the mock runtime on 127.0.0.1, and the app's
widgets on top of it, all stopped again at the end of each test."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from PySide6.QtWidgets import QApplication, QWidget

from app.bridge import ShoalBridge
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.integration.test_service import ready  # noqa: F401  (for the UI tests)
from tests.integration.test_service import running as _running

QUIET = DiscoverySettings(mode="none")
MODEL = "mock-m"


def both(home: Path, *, lanes: int = 2, speed: float = 200.0, **head: object) -> Settings:
    """A head with its local node, as the app runs them (mock model, port 0)."""
    return Settings(home=home, discovery=QUIET,
                    head=HeadSettings(model=MODEL, runtime="mock", http="127.0.0.1:0",
                                      **head),  # type: ignore[arg-type]
                    node=NodeSettings(model=MODEL, runtime="mock", lanes=lanes,
                                      mock_speed=speed))


def node_only(home: Path, identity: str, **node: object) -> Settings:
    values: dict[str, object] = {"mock_speed": 200.0, **node}
    return Settings(home=home, discovery=QUIET,
                    node=NodeSettings(model=MODEL, runtime="mock", lanes=2, identity=identity,
                                      **values))  # type: ignore[arg-type]


def token_file(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "token"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def running(settings: Settings) -> contextlib.AbstractAsyncContextManager[Shoal]:
    """Shoal in process for a UI test; stopped with no drain (nothing runs by then)."""
    return _running(settings, drain=0)


@dataclass
class Ui:
    bridge: ShoalBridge


@contextlib.asynccontextmanager
async def bridged(shoal: Shoal) -> AsyncIterator[Ui]:
    """The bridge the app puts between Shoal and its widgets; every top-level widget the
    test opened is closed and freed at the end."""
    before = set(QApplication.topLevelWidgets())
    bridge = ShoalBridge(shoal)
    try:
        yield Ui(bridge)
    finally:
        for widget in QApplication.topLevelWidgets():
            if widget not in before:
                widget.close()
                widget.deleteLater()
        await bridge.close()


async def chat(shoal: Shoal, *, model: str = MODEL, max_tokens: int = 5,
               key: str | None = None) -> int:
    assert shoal.api_url is not None
    body = {"model": model, "max_tokens": max_tokens, "seed": 3,
            "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, \
            http.post(shoal.api_url + "/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


def visible(widget: QWidget) -> bool:
    """Shown on screen (the widget and every parent)."""
    return widget.isVisibleTo(widget.window()) and widget.window().isVisible()
