"""How much disk the models a fleet's head chose for this node may take, and which of them
go to make room for another (pure: the sizes, the disk and the time are given).

Whoever holds the fleet token may ask a node to pull a model. Those pulls share a quota
the machine's owner sets (``[node] fleet_models_quota``: a size, or a share of the disk
that holds the models folder, half by default). Before refusing a new one, the fleet
models the owner never used go, least recently used first; the one being served never
goes, and the owner's own models are not fleet models, so they neither count nor go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from engine.sizes import MIN_BUDGET, Share, amount, budget_value, parse_budget

Quota = int | Share  # bytes, or a share of the disk that holds the models folder
DEFAULT_QUOTA = Share(50.0)
SETTING = "Fleet models may use"  # the Settings row a refusal sends the owner to
QUOTA_FORMS = ("a size like 20G, 500GB or 2T (binary units, at least 256M), or a share of "
               "the models folder's disk like 50%")


@dataclass(frozen=True, slots=True)
class FleetModel:
    """A model kept here because a head of the fleet chose it (the owner never used it)."""

    name: str
    size: int  # bytes on disk
    last_used: float  # wall-clock seconds it was last served or pulled (0: never known)
    serving: bool = False  # served now: it never goes


@dataclass(frozen=True, slots=True)
class Room:
    """What a new fleet model takes: the models to remove first (oldest first), or why it
    cannot be had (one line, the cause and the fix)."""

    evict: tuple[str, ...] = ()
    refusal: str | None = None


def quota_bytes(quota: Quota, disk_total: int) -> int:
    """The quota in bytes where the models folder's disk holds ``disk_total`` bytes."""
    if isinstance(quota, Share):
        return int(disk_total * Fraction(quota.percent) / 100)
    return max(0, quota)


def make_room(kept: Sequence[FleetModel], quota: int, need: int, what: str) -> Room:
    """Room for ``what`` (``need`` more bytes) among the fleet models ``kept`` within
    ``quota`` bytes: nothing to do, the models to evict, or the refusal."""
    used = sum(m.size for m in kept)
    over = used + need - quota
    if over <= 0:
        return Room()
    shared = f"fleet models may use {amount(quota)} here and {what} needs {amount(need)}"
    if need > quota:
        return Room(refusal=f"{shared}: raise '{SETTING}' in Settings on that machine")
    evict: list[str] = []
    for m in sorted((m for m in kept if not m.serving), key=lambda m: (m.last_used, m.name)):
        if over <= 0:
            break
        evict.append(m.name)
        over -= m.size
    if over > 0:
        held = [m for m in kept if m.serving]
        names = ", ".join(m.name for m in held)
        return Room(refusal=(f"{shared}, but {names} takes {amount(sum(m.size for m in held))}"
                             f" of it while it serves: raise '{SETTING}' in Settings on that "
                             "machine, or ask again once it serves another"))
    return Room(evict=tuple(evict))


def parse_quota(text: str) -> Quota:
    """``text`` as bytes or a share of the disk; ValueError (one line, naming the forms)."""
    try:
        return parse_budget(text)  # a memory budget's forms, read the same way
    except ValueError:
        shown = text.strip()[:40]
        raise ValueError(f"{shown!r} is not a limit for the fleet's models; give "
                         f"{QUOTA_FORMS}") from None


def quota_value(quota: Quota) -> str | int:
    """The quota as ``config.toml`` keeps it (read back by `parse_quota`, or as bytes)."""
    if isinstance(quota, Share) or quota >= MIN_BUDGET:
        return budget_value(quota)
    return quota
