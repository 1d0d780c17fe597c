"""One loop timer for a run of deadlines that mostly move later (a keepalive or a lease
renewal after each token): it is moved only when a deadline comes earlier than the one
it is set for, so a deadline per token costs no timer per token. One that rings before
its owner's current deadline is the owner's to set again.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class Alarm:
    def __init__(self, clock: Callable[[], float], on_ring: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._clock = clock
        self._on_ring = on_ring
        self._handle: asyncio.TimerHandle | None = None
        # kept here: under qasync's loop, call_later returns a Handle without when()
        self._due = math.inf

    def set_by(self, due: float) -> None:
        """Ring at ``due`` (``clock``'s time), or earlier if already set so."""
        if self._handle is not None:
            if self._due <= due:
                return
            self._handle.cancel()
        self._due = due
        self._handle = self._loop.call_later(max(0.0, due - self._clock()), self._ring)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._due = math.inf

    def _ring(self) -> None:
        self._handle = None
        self._due = math.inf
        self._on_ring()
