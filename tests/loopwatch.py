"""A loop-lag probe: fails a test whose event loop was blocked for longer than a bound.

The loop beats every ``BEAT_S``; a watchdog thread checks the last beat and, when the
loop has not beaten for ``bound_s``, records where the loop's thread is stuck (its
stack), once per stall. Blocking work in a coroutine (tokenizing a long prompt, a
keychain call, reading a file) shows up as a stall with the culprit's frame on top.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

BEAT_S = 0.01


class _GcClock:
    """Total seconds spent in garbage collection so far (gc.callbacks)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.monotonic()
        elif self._started:
            self.total += time.monotonic() - self._started
            self._started = 0.0

    def now(self) -> float:
        running = time.monotonic() - self._started if self._started else 0.0
        return self.total + running


def _waiting(frame: object) -> bool:
    """The loop's thread is inside the selector's wait (idle), not running code."""
    code = getattr(frame, "f_code", None)
    return code is not None and code.co_name in ("select", "poll") and \
        code.co_filename.endswith("selectors.py")


@dataclass
class Stall:
    seconds: float
    stack: str


@dataclass
class LoopWatch:
    loop: asyncio.AbstractEventLoop
    bound_s: float = 0.1
    stalls: list[Stall] = field(default_factory=list)
    _last: float = 0.0
    _loop_thread: int = 0
    _gc: _GcClock = field(default_factory=_GcClock)
    _gc_at_beat: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        gc.callbacks.append(self._gc)
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._last = time.monotonic()
        self._gc_at_beat = self._gc.now()
        self._handle = self.loop.call_later(BEAT_S, self._beat)

    def _watch(self) -> None:
        current: Stall | None = None
        current_for = -1.0  # the beat the current stall started after
        while not self._stop.wait(BEAT_S):
            if not self.loop.is_running():
                # between a test's coroutines (sync fixtures run then): nothing to watch
                self._last = time.monotonic()
                self._gc_at_beat = self._gc.now()
                continue
            last = self._last
            lag = time.monotonic() - last - (self._gc.now() - self._gc_at_beat)
            if lag <= self.bound_s:
                continue
            if current is not None and last == current_for:
                current.seconds = max(current.seconds, lag)
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is not None and _waiting(frame):
                # the loop sits in select, due to wake: this process is short of CPU (a
                # loaded machine), no code of the test is blocking it
                continue
            stack = "".join(traceback.format_stack(frame)) if frame else "(no stack)"
            current, current_for = Stall(lag, stack), last
            self.stalls.append(current)

    def stop(self) -> None:
        self._stop.set()
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(1)

    def report(self) -> str:
        parts = [f"the event loop was blocked {len(self.stalls)} time(s) for more than "
                 f"{self.bound_s * 1000:.0f} ms:"]
        for stall in self.stalls[:3]:
            parts.append(f"--- blocked {stall.seconds * 1000:.0f} ms in:\n{stall.stack}")
        return "\n".join(parts)
