"""The app's own choices, kept in the ``[app]`` table of ``$SHOAL_HOME/config.toml`` beside
the machine's settings (the head, the node, discovery) that the engine reads."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine.config import machine_settings, save_machine_settings
from engine.settings import Settings


@dataclass(frozen=True, slots=True)
class Prefs:
    welcomed: bool = False  # the first-run welcome was completed
    start_at_login: bool = False
    notify: bool = True  # notifications when nodes join or leave, or a request fails

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
