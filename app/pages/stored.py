"""Changes a person makes in the window that should outlive this run, written to
``config.toml`` (off the loop, through `app.prefs`).

Each change is applied to what the file holds now, not to the running Shoal's settings:
the file may hold changes that apply only at the next start (a new port), and the app's
own table is kept as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from app import prefs as app_prefs
from engine.settings import Settings


async def update_stored(home: Path, change: Callable[[Settings], Settings]) -> Settings:
    """Read this machine's settings, apply ``change``, write them back; returns them."""
    settings, prefs = await app_prefs.load(home)
    changed = change(settings)
    await app_prefs.save(changed, prefs)
    return changed
