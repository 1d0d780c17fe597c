"""The app's icons: the application icon and one tray icon per state, each a QIcon holding
every PNG size rendered from its SVG source (`scripts/icons.py`), so a tray host picks a
pixel-exact size instead of scaling one."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import Literal

from PySide6.QtCore import QSize
from PySide6.QtGui import QIcon

TrayLook = Literal["serving", "busy", "paused", "error", "lonely"]
SIZES = (16, 22, 24, 32, 48, 64, 128, 256)


def icons_dir() -> Path:
    """resources/icons/ beside the app package, or inside a bundle (PyInstaller's
    ``sys._MEIPASS``)."""
    bundle = getattr(sys, "_MEIPASS", None)
    root = Path(bundle) if bundle else Path(__file__).resolve().parents[1]
    return root / "resources" / "icons"


@cache
def _icon(name: str) -> QIcon:
    icon = QIcon()
    folder = icons_dir()
    for size in SIZES:
        path = folder / f"{name}-{size}.png"
        if path.exists():
            icon.addFile(str(path), QSize(size, size))
    return icon


def app_icon() -> QIcon:
    return _icon("shoal")


def tray_icon(look: TrayLook) -> QIcon:
    return _icon(f"tray-{look}")
