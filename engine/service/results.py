"""What `Shoal`'s commands return: frozen values the CLI prints and the app renders."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from engine.runtimes.budget import default_budget_bytes, total_memory_bytes
from engine.settings import Settings


@dataclass(frozen=True, slots=True)
class Pairing:
    """What a new machine needs to join this fleet: the join URL (it holds the token: show
    it only to the user), its QR code as PNG bytes and as terminal text."""

    url: str
    fleet: str
    head: str
    png: bytes
    text: str


@dataclass(frozen=True, slots=True)
class SettingsChange:
    """What `Shoal.update_settings` did: the settings for the next start, and whether
    some of them wait for it (the running parts keep their ports until then)."""

    pending: Settings
    restart_needed: bool


@dataclass(frozen=True, slots=True)
class MachineMemory:
    """This machine's RAM, and the share of it a node uses unless told otherwise."""

    total: int  # bytes
    default_budget: int  # bytes



@dataclass(frozen=True, slots=True)
class JoinResult:
    fleet: str
    heads: tuple[str, ...]
    model: str  # the model the head announced


@functools.cache
def machine_memory() -> MachineMemory:
    """This machine's, read once (a small file: /proc/meminfo, or sysctl)."""
    total = total_memory_bytes()
    return MachineMemory(total=total, default_budget=default_budget_bytes(total))
