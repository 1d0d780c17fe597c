"""A loop-block probe: fails a test whose event loop was blocked by one callback.

What it measures is the work of one callback of the loop (a task's step, a protocol's
``data_received``, a timer), not the wall clock between two beats of the loop: wall clock
also counts the time the OS gave to other processes, so a busy machine made "stalls" of
code that blocked nothing. A callback blocks the loop when, in that one callback, the
loop's thread either

- spent more than ``bound_s`` of its own CPU time (real work: tokenizing a long prompt,
  decoding a large body, hashing a file), or
- slept in the kernel for more than ``SLEEP_BOUND_S`` (a blocking call: ``time.sleep``, a
  keychain or subprocess call, a read that waits on a disk or a socket).

Time the thread was runnable but not given a CPU counts as neither. Garbage collection
that runs inside the callback is not counted either (it is no fault of the callback's code).
A watchdog thread samples the running callback every ``BEAT_S`` and records where the
loop's thread is (its stack), once per blocking callback.

A Qt loop (qasync) also runs Python outside asyncio's callbacks: Qt's slots, its layout and
painting. There the watch beats every ``BEAT_S`` too and counts as blocked the loop thread's
CPU time spent outside asyncio's callbacks while a beat is late, over the same bound.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

BEAT_S = 0.01
# a blocking wait in the kernel; longer than the CPU bound, since a thread of this process
# that waits for the GIL also sleeps in the kernel, and on a loaded machine the GIL's holder
# may itself wait for a CPU
SLEEP_BOUND_S = 0.25


class _GcClock:
    """CPU seconds the loop's thread spent in garbage collection so far (gc.callbacks)."""

    def __init__(self, thread: int, clock: int) -> None:
        self.thread = thread
        self.clock = clock  # the loop thread's CPU clock
        self.total = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._started = time.clock_gettime(self.clock)
        elif self._started:
            self.total += time.clock_gettime(self.clock) - self._started
            self._started = 0.0

    def at(self, cpu: float) -> float:
        """The total when the loop thread's CPU clock reads ``cpu`` (from any thread)."""
        started = self._started
        return self.total + (cpu - started if started else 0.0)


def busy_cpu(seconds: float) -> None:
    """Real work for the watch's own tests: this thread's CPU time, whatever else runs."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def _state(native_id: int) -> str:
    """The kernel's state letter of a thread of this process (R, S, D...), "" if unknown."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    # pid (comm) STATE ...: comm may hold spaces and parentheses, so cut at the last ")"
    rest = stat[stat.rfind(b")") + 2:]
    return rest[:1].decode()


@dataclass
class Stall:
    seconds: float  # wall clock of the blocking callback, as far as the watch saw it
    cpu: float  # CPU time the loop's thread spent in it
    slept: float  # time the loop's thread slept in the kernel in it
    stack: str


@dataclass
class _Callback:
    """The callback the loop's thread is running now."""

    handle: asyncio.Handle
    wall0: float
    cpu0: float
    gc0: float
    slept: float = 0.0
    sampled: float = 0.0  # when the watchdog last looked at it
    stall: Stall | None = None
    ended: bool = False


# the loop's thread -> its watch; Handle._run is patched once while any watch runs
_watches: dict[int, LoopWatch] = {}
_original_run: Callable[[asyncio.Handle], None] | None = None
_patch_lock = threading.Lock()


def _run_watched(handle: asyncio.Handle) -> None:
    assert _original_run is not None
    watch = _watches.get(threading.get_ident())
    if watch is None:
        _original_run(handle)
        return
    watch._enter(handle)
    try:
        _original_run(handle)
    finally:
        watch._leave()


@dataclass
class LoopWatch:
    loop: asyncio.AbstractEventLoop
    bound_s: float = 0.1
    sleep_bound_s: float = SLEEP_BOUND_S
    stalls: list[Stall] = field(default_factory=list)
    _loop_thread: int = 0
    _native_id: int = 0
    _cpu_clock: int = 0
    _gc: _GcClock | None = None
    _current: _Callback | None = None
    _in_callbacks: float = 0.0  # CPU seconds the loop thread spent inside callbacks so far
    # the beats on a Qt loop: when the last one ran, and the thread's CPU then
    _beats: bool = False
    _handle: asyncio.TimerHandle | None = None
    _beat_cpu: float = 0.0
    _beat_inside: float = 0.0
    _beat_stall: Stall | None = None
    # held only to decide who records a callback's stall (never while reading /proc or a
    # stack, which would make the loop's thread wait on this one)
    _claim: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching; call it from the loop's own thread."""
        global _original_run
        self._loop_thread = threading.get_ident()
        self._native_id = threading.get_native_id()
        self._cpu_clock = time.pthread_getcpuclockid(self._loop_thread)
        self._gc = _GcClock(self._loop_thread, self._cpu_clock)
        gc.callbacks.append(self._gc)
        with _patch_lock:
            if not _watches:
                _original_run = asyncio.Handle._run  # type: ignore[attr-defined]
                asyncio.Handle._run = _run_watched  # type: ignore[attr-defined,method-assign]
            _watches[self._loop_thread] = self
        self._beats = any(c.__module__.split(".")[0] == "qasync" for c in type(self.loop).__mro__)
        if self._beats:
            self._beat()
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beat_cpu, self._beat_inside = time.thread_time(), self._in_callbacks
        self._beat_stall = None
        self._handle = self.loop.call_later(BEAT_S, self._beat)

    # -- in the loop's thread, around each callback --

    def _enter(self, handle: asyncio.Handle) -> None:
        assert self._gc is not None
        cpu = time.thread_time()
        cb = _Callback(handle, time.monotonic(), cpu, self._gc.at(cpu))
        cb.sampled = cb.wall0
        self._current = cb

    def _leave(self) -> None:
        assert self._gc is not None
        cb, self._current = self._current, None
        if cb is None:
            return
        now_cpu = time.thread_time()
        self._in_callbacks += now_cpu - cb.cpu0
        cpu = now_cpu - cb.cpu0 - (self._gc.at(now_cpu) - cb.gc0)
        wall = time.monotonic() - cb.wall0
        with self._claim:
            cb.ended = True
            stall = cb.stall
        if stall is not None:
            stall.seconds, stall.cpu = wall, max(stall.cpu, cpu)
        elif cpu > self.bound_s:
            # over before the watchdog looked (it samples every BEAT_S): no stack to show
            self.stalls.append(Stall(wall, cpu, cb.slept, f"{cb.handle!r} (it ended before the "
                                     "watch could take its stack)"))

    # -- the watchdog thread --

    def _watch(self) -> None:
        # no lock is shared with the loop's thread: it would wait on this thread, which waits
        # on the GIL, and the watch would see its own wait as a blocked loop. Each field is
        # written by one thread and read whole by the other (the GIL makes that atomic)
        assert self._gc is not None
        while not self._stop.wait(BEAT_S):
            if self._beats:
                self._outside_callbacks()
            cb = self._current
            if cb is None:
                continue
            now = time.monotonic()
            since, cb.sampled = now - cb.sampled, now
            if now - cb.wall0 <= min(self.bound_s, self.sleep_bound_s):
                continue
            now_cpu = time.clock_gettime(self._cpu_clock)
            cpu = now_cpu - cb.cpu0 - (self._gc.at(now_cpu) - cb.gc0)
            if cb.stall is not None:
                cb.stall.seconds, cb.stall.cpu, cb.stall.slept = now - cb.wall0, cpu, cb.slept
                continue
            if cpu <= self.bound_s:
                # reading /proc lets the GIL go: only where the CPU has not decided already
                if _state(self._native_id) in ("S", "D") and self._current is cb:
                    cb.slept += since
                if cb.slept <= self.sleep_bound_s:
                    continue
            # where the thread is now, quickly (no source lines read yet): the callback may
            # end while this thread waits for the GIL
            frame = sys._current_frames().get(self._loop_thread)
            where = (traceback.StackSummary.extract(traceback.walk_stack(frame),
                                                    lookup_lines=False) if frame else None)
            with self._claim:
                if cb.ended:
                    continue  # it ended meanwhile: its own end judged it by its CPU
                cb.stall = stall = Stall(now - cb.wall0, cpu, cb.slept, "(no stack)")
            self.stalls.append(stall)
            if where is not None:
                where.reverse()  # walk_stack goes from the innermost frame out
                stall.stack = "".join(where.format())

    def _outside_callbacks(self) -> None:
        """On a Qt loop: the loop thread's CPU outside asyncio's callbacks since the last
        beat."""
        now_cpu = time.clock_gettime(self._cpu_clock)
        if not self.loop.is_running():
            # between two runs of the loop the thread runs pytest and the fixtures' plain
            # code, which blocks no loop: the count starts again when the loop does
            self._beat_cpu, self._beat_inside = now_cpu, self._in_callbacks
            self._beat_stall = None
            return
        inside = self._in_callbacks - self._beat_inside
        current = self._current
        if current is not None:
            inside += now_cpu - current.cpu0
        outside = now_cpu - self._beat_cpu - inside
        if outside <= self.bound_s:
            return
        if self._beat_stall is not None:
            self._beat_stall.cpu = outside
            return
        frame = sys._current_frames().get(self._loop_thread)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no stack)"
        self._beat_stall = Stall(outside, outside, 0.0, "outside asyncio's callbacks (Qt):\n"
                                 + stack)
        self.stalls.append(self._beat_stall)

    def stop(self) -> None:
        global _original_run
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(1)
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        with _patch_lock:
            if _watches.get(self._loop_thread) is self:
                del _watches[self._loop_thread]
            if not _watches and _original_run is not None:
                asyncio.Handle._run = _original_run  # type: ignore[attr-defined,method-assign]
                _original_run = None

    def report(self) -> str:
        parts = [f"the event loop was blocked by {len(self.stalls)} callback(s): more than "
                 f"{self.bound_s * 1000:.0f} ms of the loop thread's CPU, or "
                 f"{self.sleep_bound_s * 1000:.0f} ms asleep in a blocking call:"]
        for stall in self.stalls[:3]:
            parts.append(f"--- blocked {stall.seconds * 1000:.0f} ms ({stall.cpu * 1000:.0f} ms "
                         f"of CPU, {stall.slept * 1000:.0f} ms asleep) in:\n{stall.stack}")
        return "\n".join(parts)
