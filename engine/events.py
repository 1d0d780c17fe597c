"""What changes in a running Shoal, as typed events, and the bus that carries them.

Every subscriber has a bounded buffer of its own. A subscriber that falls behind loses
its oldest events, never stalls the engine: the next event it reads is a `Dropped`
saying how many it missed, and a fresh `Shoal.snapshot()` tells it where things stand.
Publishing never blocks and never awaits.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

# -- the events ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    at: float = field(default_factory=time.time)  # wall-clock seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLinked(Event):
    """A node is ready for sessions (first link, or back after being away)."""

    key: str
    identity: str
    address: str
    model: str
    lanes: int
    context_window: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLeft(Event):
    """A node that joined this head closed its links (it is waited for)."""

    key: str
    identity: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeUnreachable(Event):
    key: str
    address: str
    reason: str  # one line: the cause and the fix


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionPlaced(Event):
    session: str
    model: str
    node: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionMoved(Event):
    session: str
    from_node: str
    to_node: str
    after_tokens: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFinished(Event):
    """A request ended: answered (``error`` None) or failed (its one-line error)."""

    session: str
    model: str
    requested: str  # the name the client asked for (an alias, a loose name)
    node: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    duration_ms: float
    moves: int
    finish_reason: str
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AliasChanged(Event):
    name: str
    target: str | None  # None: removed
    fallbacks: tuple[str, ...]
    version: int
    heads_holding: int
    heads_total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PullProgress(Event):
    """A model download or assembly; ``total_bytes`` 0 while unknown."""

    model: str
    done_bytes: int
    total_bytes: int
    state: Literal["running", "done", "failed", "cancelled"] = "running"
    message: str = ""
    rate_bps: float = 0.0  # bytes a second lately; 0.0 while not known
    eta_s: float | None = None  # seconds left at that rate; None while not known


@dataclass(frozen=True, slots=True, kw_only=True)
class RolesChanged(Event):
    """This machine's roles: head on or off, the node serving, paused or off, the fleet."""

    head: bool
    node: str
    fleet: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingsChanged(Event):
    """This machine's settings changed (`Shoal.update_settings`): read `Shoal.settings`,
    `Shoal.pending` and `Shoal.app_settings` again. ``restart_needed``: some of what
    changed waits for the next start."""

    restart_needed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice(Event):
    """A warning or an error, with the one line the CLI prints."""

    level: Literal["info", "warning", "error"]
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Dropped(Event):
    """This subscriber fell behind and lost ``count`` events; read a fresh snapshot."""

    count: int


ShoalEvent = (NodeLinked | NodeLeft | NodeUnreachable | SessionPlaced | SessionMoved
              | SessionFinished | AliasChanged | PullProgress | RolesChanged | SettingsChanged
              | Notice | Dropped)
Emit = Callable[[ShoalEvent], None]


def ignore(_event: ShoalEvent) -> None:
    """An `Emit` for parts built without a bus (tests of one part)."""


# -- the bus -------------------------------------------------------------------------

DEFAULT_BUFFER = 1024


class Subscription:
    """One subscriber's view of the bus: ``async for event in subscription``."""

    def __init__(self, bus: EventBus, buffer: int) -> None:
        self._bus = bus
        self._buffer: deque[ShoalEvent] = deque()
        self._limit = max(1, buffer)
        self._dropped = 0
        self._wake = asyncio.Event()
        self._closed = False

    def _offer(self, event: ShoalEvent) -> None:
        if len(self._buffer) >= self._limit:
            self._buffer.popleft()
            self._dropped += 1
        self._buffer.append(event)
        self._wake.set()

    def get_nowait(self) -> ShoalEvent | None:
        """The next event if one is waiting (a `Dropped` first, when some were lost)."""
        if self._dropped:
            count, self._dropped = self._dropped, 0
            return Dropped(count=count)
        return self._buffer.popleft() if self._buffer else None

    async def get(self) -> ShoalEvent:
        while True:
            event = self.get_nowait()
            if event is not None:
                return event
            if self._closed:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()

    def __aiter__(self) -> AsyncIterator[ShoalEvent]:
        return self

    async def __anext__(self) -> ShoalEvent:
        return await self.get()

    def close(self) -> None:
        """Stop receiving; a reader waiting in ``get`` ends its iteration."""
        self._closed = True
        self._bus._subscribers.discard(self)
        self._wake.set()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    def __init__(self) -> None:
        self._subscribers: set[Subscription] = set()

    def subscribe(self, *, buffer: int = DEFAULT_BUFFER) -> Subscription:
        sub = Subscription(self, buffer)
        self._subscribers.add(sub)
        return sub

    def publish(self, event: ShoalEvent) -> None:
        for sub in list(self._subscribers):
            sub._offer(event)

    def close(self) -> None:
        for sub in list(self._subscribers):
            sub.close()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
