"""The app's own choices, kept in the ``[app]`` table of ``$SHOAL_HOME/config.toml`` beside
the machine's settings (the head, the node, the fleet, discovery) that the engine reads.

The running `Shoal` owns them, as it owns the rest of the file (``Shoal.app_settings``,
changed with ``Shoal.update_settings(app=...)``): the app reads them from there each
time and never keeps a copy of its own. `load` reads the file once, at launch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.config import machine_settings
from engine.settings import Settings


@dataclass(frozen=True, slots=True)
class Prefs:
    welcomed: bool = False  # the first-run welcome was completed
    start_at_login: bool = False
    notify: bool = True  # notifications when nodes join or leave, or a request fails
    told_no_tray: bool = False  # "no system tray here" was said once

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> Prefs:
        known = {f.name: f.type for f in fields(cls)}
        return cls(**{k: v for k, v in table.items() if k in known and isinstance(v, bool)})


async def load(home: Path) -> tuple[Settings, Prefs]:
    """This machine's settings and the app's choices (read off the loop)."""
    settings, table = await asyncio.to_thread(machine_settings, home)
    return settings, Prefs.from_table(table)
