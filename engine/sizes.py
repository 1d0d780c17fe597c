"""How much memory a node may use and how long it keeps an idle model, as people write
them: on the command line (``--memory-budget 6G``, ``--idle-unload 15``), in
``config.toml`` and in the app. Pure: this machine's RAM is given, never read here.

A budget is a size in binary units (``6G``, ``6GiB`` and ``6GB`` are all 6 x 2^30
bytes; ``4096M``, ``512MB``; K and T too; a fraction such as ``1.5G``), or a share of
this machine's RAM (``50%``), kept as a share until the node starts on a machine, so
that one config file suits every machine it is copied to. Under ``MIN_BUDGET`` no model
and cache fit, and a budget that small is refused in one line.

The idle unload is whole or fractional minutes; ``never`` or ``0`` keeps the model
loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

MiB = 1 << 20
GiB = 1 << 30
MIN_BUDGET = 256 * MiB  # the model and a usable KV pool need more than this
KvType = Literal["f16", "q8_0"]
KV_TYPES: tuple[KvType, ...] = ("f16", "q8_0")
IDLE_UNLOAD_DEFAULT_MIN = 15
IDLE_UNLOAD_DEFAULT_S = IDLE_UNLOAD_DEFAULT_MIN * 60.0
MAX_IDLE_UNLOAD_MIN = 7 * 24 * 60  # a week; beyond that, say never

BUDGET_FORMS = ("a size like 6G, 6GiB, 4096M or 512MB (binary units), or a share of this "
                "machine's RAM like 50%")
IDLE_FORMS = f"minutes from 0 to {MAX_IDLE_UNLOAD_MIN} (like 15), or never"

_UNITS = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}
_SIZE = re.compile(r"(\d{1,10}(?:\.\d{1,6})?)\s*([kmgt])(?:i?b)?", re.IGNORECASE)
_SHARE = re.compile(r"(\d{1,3}(?:\.\d{1,6})?)\s*%")
_MINUTES = re.compile(r"\d{1,6}(?:\.\d{1,6})?")


_SHOWN_UNITS = (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10))


def amount(n: float, places: int = 1) -> str:
    """A size as Shoal shows it everywhere (the window, the tray, the CLI, its messages):
    binary units with their own names, since budgets are given in them (``6G`` is 6 GiB),
    at most ``places`` decimals below 100 and none from 100: ``412 MiB``, ``1.5 GiB``,
    ``11.8 GiB``, ``6 GiB``, ``900 B``."""
    for unit, scale in _SHOWN_UNITS:
        if n >= scale:
            value = n / scale
            text = f"{value:.{places}f}" if round(value, places) < 100 else f"{value:.0f}"
            if "." in text:
                text = text.rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{max(int(n), 0)} B"


def _shown(text: str) -> str:
    """What was given, quoted on one short line."""
    return repr(text if len(text) <= 40 else text[:39] + "…")


@dataclass(frozen=True, slots=True)
class Share:
    """A share of this machine's RAM, in percent (above 0, at most 100)."""

    percent: float

    def __str__(self) -> str:
        return f"{self.percent:.6f}".rstrip("0").rstrip(".") + "%"


# bytes, a share of this machine's RAM, or None: the default share (the runtime's)
Budget = int | Share | None


def too_small(size: int) -> str:
    return (f"a memory budget of {size // MiB} MiB cannot hold a model and its KV cache; "
            f"give at least {MIN_BUDGET // MiB}M")


def parse_budget(text: str) -> int | Share:
    """``text`` as bytes or a share of RAM; ValueError (one line, naming the forms)."""
    value = text.strip()
    if share := _SHARE.fullmatch(value):
        percent = float(share.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"a memory budget of {value} is not a share of this machine's "
                             "RAM; give a percentage above 0 and at most 100, like 50%")
        return Share(percent)
    size = _SIZE.fullmatch(value)
    if size is None:
        raise ValueError(f"{_shown(text)} is not a memory budget; give {BUDGET_FORMS}")
    return check_bytes(int(Fraction(size.group(1)) * _UNITS[size.group(2).lower()]))


def check_bytes(size: int) -> int:
    """``size`` bytes as a budget; ValueError when it is under ``MIN_BUDGET``."""
    if size < MIN_BUDGET:
        raise ValueError(too_small(size))
    return size


def budget_bytes(budget: Budget, total: int) -> int | None:
    """The budget in bytes on a machine with ``total`` bytes of RAM (None: the default
    share). ValueError (one line) when a share of it is under ``MIN_BUDGET``."""
    if not isinstance(budget, Share):
        return budget
    size = int(total * Fraction(budget.percent) / 100)
    if size < MIN_BUDGET:
        raise ValueError(f"{budget} of this machine's {total // MiB} MiB of RAM is "
                         f"{size // MiB} MiB, too little for a model and its KV cache; give "
                         f"a larger share or a size of at least {MIN_BUDGET // MiB}M")
    return size


def budget_value(budget: int | Share) -> str | int:
    """The budget as ``config.toml`` keeps it: ``50%``, ``12GiB``, ``512MiB``, else bytes
    (`parse_budget` and a TOML integer of bytes read each back)."""
    if isinstance(budget, Share):
        return str(budget)
    if budget % GiB == 0:
        return f"{budget // GiB}GiB"
    if budget % MiB == 0:
        return f"{budget // MiB}MiB"
    return budget


def parse_idle_unload(text: str) -> float | None:
    """``text`` (minutes, or never) as seconds; None: never. ValueError (one line)."""
    value = text.strip().lower()
    if value == "never":
        return None
    if not _MINUTES.fullmatch(value):
        raise ValueError(f"{_shown(text)} is not an idle time; give {IDLE_FORMS}")
    return idle_unload_s(float(value))


def idle_unload_s(minutes: float) -> float | None:
    """``minutes`` as seconds (0: never, None); ValueError out of range."""
    if not math.isfinite(minutes) or not 0 <= minutes <= MAX_IDLE_UNLOAD_MIN:
        raise ValueError(f"an idle time of {minutes:g} minutes is out of range; give "
                         f"{IDLE_FORMS}")
    return minutes * 60.0 if minutes else None


def span(seconds: float) -> str:
    """A finite stretch of time for people: "1.5 h", "15 min", "90 s"."""
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def idle_unload_minutes(seconds: float | None) -> float | str:
    """What `parse_idle_unload` reads back: minutes, or ``never``."""
    if seconds is None:
        return "never"
    minutes = seconds / 60.0
    return int(minutes) if minutes.is_integer() else minutes
