"""The one place where the engine meets Qt: a running `Shoal` seen as Qt signals, and its
commands run as tasks on the same asyncio loop (qasync), with their outcome reported.

The app holds no fleet logic: it renders `FleetSnapshot`s and `ShoalEvent`s and calls
`Shoal`'s commands. Everything here runs on the GUI thread, which is the loop's thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from PySide6.QtCore import QObject, QTimer, Signal

from engine.errors import ShoalError
from engine.events import ShoalEvent
from engine.snapshot import FleetSnapshot
from engine.tasks import TaskSet, cancel_and_wait

if TYPE_CHECKING:  # the service (and all the engine behind it) is imported once the tray shows
    from engine.service import Shoal

log = logging.getLogger("shoal.app")
T = TypeVar("T")
REFRESH_MS = 1000  # live tables: lanes, KV and rates change without an event


class ShoalBridge(QObject):
    """Signals: ``snapshot`` (a fresh FleetSnapshot, at least once a second and after
    every event), ``event`` (each ShoalEvent as it comes), ``failed`` (the one line of a
    command that failed), ``busy`` (a command is under way: True/False)."""

    snapshot = Signal(object)
    event = Signal(object)
    failed = Signal(str)
    busy = Signal(bool)
    start_changed = Signal(object)  # the line of a failed start, or None once it starts

    def __init__(self, shoal: Shoal, parent: QObject | None = None, *,
                 started: bool = True) -> None:
        super().__init__(parent)
        self.shoal = shoal
        # commands wait for Shoal's start (the welcome shows while the model loads)
        self._started = asyncio.Event()
        self._start_error: str | None = None
        if started:
            self._started.set()
        self._tasks = TaskSet("the app's commands")
        self._events = shoal.events()
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="app-events")
        self._timer = QTimer(self)
        self._timer.setInterval(REFRESH_MS)
        self._timer.timeout.connect(self.refresh)
        self._timer.start()
        self.last: FleetSnapshot = shoal.snapshot()

    def refresh(self) -> FleetSnapshot:
        self.last = self.shoal.snapshot()
        self.snapshot.emit(self.last)
        return self.last

    async def _read(self) -> None:
        async for event in self._events:
            self.event.emit(event)
            self.refresh()

    def start_ended(self, error: str | None = None) -> None:
        """Shoal's start is over (``error``: the line saying why it failed and what to
        do): the commands asked for meanwhile run now, or fail with that line, as do
        those asked for later, until `starting` says Shoal is starting again."""
        self._start_error = error
        self._started.set()
        self.start_changed.emit(error)

    def starting(self) -> None:
        """Shoal starts again (after a failed start): commands wait for it once more."""
        self._start_error = None
        self._started.clear()
        self.start_changed.emit(None)

    @property
    def start_error(self) -> str | None:
        return self._start_error

    def run(self, work: Awaitable[T], *, done: Callable[[T], None] | None = None,
            failed: Callable[[str], None] | None = None, anytime: bool = False) -> None:
        """Run a command (a coroutine from `Shoal`) without blocking the UI, once Shoal
        has started (``anytime``: at once, for a command that needs no running role, such
        as a settings change); its result goes to ``done``, a ShoalError's line to
        ``failed`` (else the ``failed`` signal). A command that cannot run (the start
        failed) is closed, never left unawaited."""
        async def go() -> None:
            self.busy.emit(True)
            try:
                if not anytime:
                    await self._started.wait()
                    if self._start_error is not None:
                        raise ShoalError(self._start_error)
                result = await work
            except ShoalError as exc:
                (failed or self.failed.emit)(sentence(str(exc)))
            except Exception as exc:  # a bug: say so in one line, keep the app alive
                log.exception("a command failed")
                (failed or self.failed.emit)(f"something went wrong ({type(exc).__name__}); "
                                             "the log has the details")
            else:
                if done is not None:
                    done(result)
            finally:
                self.busy.emit(False)
                self.refresh()

        def ended(_task: asyncio.Task[None]) -> None:
            # not run (the start failed, or the task was cancelled before its first step)
            if inspect.iscoroutine(work) and \
                    inspect.getcoroutinestate(work) == inspect.CORO_CREATED:
                work.close()

        self._tasks.spawn(go()).add_done_callback(ended)

    async def close(self, *, wait_s: float = 10.0) -> None:
        """Stop listening and wait up to ``wait_s`` for the commands under way, cancelling
        those still running then (the caller stops Shoal)."""
        self._timer.stop()
        self._events.close()
        await cancel_and_wait([self._reader], "the app's event reader")
        if not self._tasks:
            return
        _, late = await asyncio.wait(list(self._tasks), timeout=wait_s)
        await cancel_and_wait(late, "the app's commands")


def sentence(line: str) -> str:
    """An engine's one line as the window shows it: it starts in lower case, since a
    terminal prints it after "shoal: "."""
    return line[:1].upper() + line[1:]


def describe(event: ShoalEvent) -> str:
    """One line for a person (notifications, the activity list)."""
    from engine import events as ev

    if isinstance(event, ev.NodeLinked):
        lanes = "1 lane" if event.lanes == 1 else f"{event.lanes} lanes"
        return f"{event.identity} joined: {event.model}, {lanes}"
    if isinstance(event, ev.NodeLeft):
        return f"{event.identity} left the fleet"
    if isinstance(event, ev.NodeUnreachable):
        return f"{event.address} is unreachable: {event.reason}"
    if isinstance(event, ev.SessionFinished):
        if event.error:
            return f"a request for {event.requested} failed: {event.error}"
        return (f"{event.requested} on {event.node}: {event.completion_tokens} tokens in "
                f"{event.duration_ms / 1000:.1f} s")
    if isinstance(event, ev.Notice):
        return event.text
    return type(event).__name__
