"""Which models a node holds loaded within its memory budget, and when one unloads (pure:
sizes and times in, decisions out; the node's adapter loads and frees the engines).

A node keeps several models on disk and some of them loaded, each with its own KV pool
inside the one budget. A request for a kept model that is not loaded loads it, first
unloading the least recently used models that answer nothing now until the new one fits;
a model that cannot fit even so is refused with the numbers. A loaded model unloads once it
has been idle for its keep-alive (Ollama's ``keep_alive``: a duration, ``0`` at once after
the request, a negative one never)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.sizes import MiB, amount, span

FOREVER = math.inf
# what a model not loaded before is taken to need beyond its file: llama.cpp's buffers and
# a small pool (the engine then sizes its pool within what the budget leaves)
LOAD_MARGIN = 96 * MiB
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: five minutes
MAX_KEEP_ALIVE_TEXT = 64
# Go's time.ParseDuration units, which Ollama's keep_alive strings use
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class BadKeepAlive(ValueError):
    """A keep_alive that is no duration; the message says what is accepted."""


def keep_alive_seconds(value: float | int | str | None, default: float) -> float:
    """Seconds a model stays loaded after a request, from Ollama's ``keep_alive``: None the
    ``default``; a number of seconds or a duration string ("5m", "1h30m", "90s"); 0 unload
    at once; negative: never unload (FOREVER)."""
    if value is None:
        return default
    if isinstance(value, bool):
        raise BadKeepAlive("keep_alive must be a duration such as \"5m\", a number of "
                           "seconds, 0 to unload at once or -1 to keep the model loaded")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise BadKeepAlive("keep_alive must be a finite number of seconds")
        return FOREVER if value < 0 else float(value)
    text = value.strip()
    if len(text) > MAX_KEEP_ALIVE_TEXT or not text:
        raise BadKeepAlive("keep_alive must be a short duration such as \"5m\" or \"1h\"")
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        seconds = float(body)  # a plain number of seconds, as a string
    except ValueError:
        parts = _PART.findall(body)
        if not parts or "".join(n + u for n, u in parts) != body:
            raise BadKeepAlive(f"keep_alive {text[:MAX_KEEP_ALIVE_TEXT]!r} is not a duration; "
                               "write it as \"5m\", \"1h30m\", \"90s\", 0 or -1") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    return FOREVER if sign < 0 and seconds > 0 else seconds


def idle_words(seconds: float | None) -> str:
    """What an idle time set for a model means, after its name: "stays loaded 15 min once
    idle" (None: the node's own idle time)."""
    if seconds is None:
        return "unloads after the node's idle time (Settings: Unload the model when idle)"
    if math.isinf(seconds):
        return "stays loaded until you unload it"
    if seconds <= 0:
        return "unloads after each request"
    return f"stays loaded {span(seconds)} once idle"


@dataclass(frozen=True, slots=True)
class Held:
    """A loaded model as the node's adapter sees it now."""

    name: str
    bytes: int  # what it holds of the budget: weights, pool and buffers
    last_used: float  # when its last request ended (or began, while one runs)
    busy: int = 0  # requests it answers now
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S

    def unload_at(self) -> float:
        return self.last_used + self.keep_alive_s


@dataclass(frozen=True, slots=True)
class Load:
    """Load the model after unloading ``evict`` (least recently used first)."""

    evict: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Refuse:
    message: str  # one line: the numbers, the cause and the fix


def need_of(file_size: int, measured: int) -> int:
    """What a model is taken to hold once loaded: what its last load measured, else its
    file and ``LOAD_MARGIN``."""
    return measured or file_size + LOAD_MARGIN


def evictable(held: Iterable[Held]) -> list[Held]:
    """The models that answer nothing now, the least recently used first: the order in
    which they make room."""
    return sorted((h for h in held if not h.busy), key=lambda h: (h.last_used, h.name))


def plan_load(name: str, need: int, held: Sequence[Held], budget: int,
              base: int = 0) -> Load | Refuse:
    """How to make room for ``name``, which needs ``need`` bytes, among ``held``, in
    ``budget`` of which the process itself holds ``base`` (its interpreter, libraries)."""
    if need > budget - base:
        beside = f" beside the {amount(base)} the process holds" if base else ""
        return Refuse(f"{name} needs {amount(need)}, more than this node's memory budget of "
                      f"{amount(budget)} leaves{beside}; raise the budget (--memory-budget) "
                      "or serve a smaller quantisation")
    free = budget - base - sum(h.bytes for h in held)
    evict: list[str] = []
    for h in evictable(held):
        if free >= need:
            break
        evict.append(h.name)
        free += h.bytes
    if free < need:
        busy = ", ".join(f"{h.name} ({amount(h.bytes)})" for h in held if h.busy)
        return Refuse(f"{name} needs {amount(need)} and only {amount(max(free, 0))} of this "
                      f"node's {amount(budget)} budget can be freed while {busy} answer "
                      "requests; try again when they finish, or raise --memory-budget")
    return Load(tuple(evict))


def due_to_unload(held: Iterable[Held], now: float) -> list[str]:
    """The idle models whose keep-alive has run out at ``now``, the oldest first."""
    due = [h for h in held if not h.busy and now >= h.unload_at()]
    return [h.name for h in sorted(due, key=lambda h: (h.unload_at(), h.name))]


def next_unload(held: Iterable[Held]) -> float | None:
    """When the next idle model is due to unload (None: none is)."""
    times = [h.unload_at() for h in held if not h.busy and h.keep_alive_s != FOREVER]
    return min(times) if times else None
