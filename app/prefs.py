"""The app's own choices, kept in the ``[app]`` table of ``$SHOAL_HOME/config.toml`` beside
the machine's settings (the head, the node, the fleet, discovery) that the engine reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine.config import config_path, machine_settings, save_machine_settings
from engine.settings import Settings

log = logging.getLogger("shoal.app")


@dataclass(frozen=True, slots=True)
class Prefs:
    welcomed: bool = False  # the first-run welcome was completed
    start_at_login: bool = False
    notify: bool = True  # notifications when nodes join or leave, or a request fails
    told_no_tray: bool = False  # "no system tray here" was said once

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> Prefs:
        known = {f.name: f.type for f in fields(cls)}
        return cls(**{k: v for k, v in table.items() if k in known and isinstance(v, bool)})


async def load(home: Path) -> tuple[Settings, Prefs]:
    """This machine's settings and the app's choices (read off the loop)."""
    settings, table = await asyncio.to_thread(machine_settings, home)
    return settings, Prefs.from_table(table)


async def save(settings: Settings, prefs: Prefs) -> None:
    await asyncio.to_thread(save_machine_settings, settings, asdict(prefs))


def with_(prefs: Prefs, **changes: bool) -> Prefs:
    return replace(prefs, **changes)


class ConfigWriter:
    """Writes the latest settings and prefs, off the loop and one write at a time: what
    changes while a write runs is written right after it, so the file always ends up
    holding the last state and two writes never race on it."""

    def __init__(self, on_error: Callable[[str], None]) -> None:
        self._want: tuple[Settings, Prefs] | None = None
        self._task: asyncio.Task[None] | None = None
        self._on_error = on_error

    def save(self, settings: Settings, prefs: Prefs) -> None:
        self._want = (settings, prefs)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(),
                                                                name="app-save-config")

    async def _write(self) -> None:
        while self._want is not None:
            settings, prefs = self._want
            self._want = None
            try:
                await save(settings, prefs)
            except OSError as exc:
                path = config_path(settings.home)
                log.warning("cannot save %s: %s", path, exc)
                self._on_error(f"cannot save your settings to {path} ({exc.strerror or exc}); "
                               "check that the folder is writable")

    async def flush(self) -> None:
        """Wait for the last change to be on disk."""
        if self._task is not None:
            await self._task
