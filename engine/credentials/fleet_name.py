"""The fleet's name for people, kept in ``$SHOAL_HOME/fleet/name`` beside the token and
nowhere else (four keepers once disagreed, and the next start undid a rename). Blocking
file IO: from asyncio code call these through ``asyncio.to_thread``."""

from __future__ import annotations

import contextlib
from pathlib import Path

from engine.credentials.codes import MAX_FLEET_CHARS
from engine.files import write_private

FLEET_NAME_FILE = "name"


def load_fleet_name(home: Path) -> str | None:
    try:
        text = (home / "fleet" / FLEET_NAME_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text[:MAX_FLEET_CHARS] or None


def save_fleet_name(home: Path, name: str) -> None:
    with contextlib.suppress(OSError):
        write_private(home / "fleet" / FLEET_NAME_FILE, name.encode("utf-8"))
