"""One download per blob in this process, whoever asks for it.

Callers that want the same blob (its sha256 is the key) share one transfer: the first
starts it in a thread of its own, every caller receives its progress reports, and each
gets the same path or the same error. A caller that cancels leaves at once; the transfer
stops only when every caller has cancelled, and the last of them waits for it to have
removed its part (unless it never began: it was waiting for another process's download,
which it then finds finished); a block comes within `transfer.TIMEOUT_S` or the
connection counts as broken, so that wait is bounded. A caller that comes while a
transfer is stopping starts the next one, which waits for the first to be gone (the
part's lock).

Blocking: `Shared.run` is called from a worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.models.errors import CANCELLED, CancelFlag, ModelMissing, PullCancelled, one_line
from engine.models.pulls.transfer import Report

log = logging.getLogger("shoal.pulls")


class Handle(Protocol):
    """What a transfer's work sees of the callers."""

    def report(self, line: str, done: int, total: int) -> None: ...
    def stopped(self) -> bool: ...
    def keeps_part(self) -> bool: ...
    def holding(self) -> None: ...


Work = Callable[[Handle], Path]
"""Downloads and installs the blob; calls `holding()` once it owns the part."""


@dataclass(eq=False)
class _Caller:
    report: Report
    cancel: CancelFlag


class _Transfer:
    def __init__(self, key: str, work: Work, on_end: Callable[[_Transfer], None]) -> None:
        self._work = work
        self._on_end = on_end
        self._cond = threading.Condition()
        self._callers: list[_Caller] = []
        # every caller cancelled: the work stops at its next block (kept under _cond)
        self.stopping = False
        self._keep_part = False  # a caller that left asked to keep the part
        self._holding = False
        self._finished = False
        self._result: Path | None = None
        self._error: ModelMissing | None = None
        self._thread = threading.Thread(target=self._run, name=f"shoal-pull-{key[:12]}",
                                        daemon=True)

    # -- the work's side (its thread) --------------------------------------------------

    def report(self, line: str, done: int, total: int) -> None:
        with self._cond:
            callers = list(self._callers)
        for caller in callers:
            caller.report(line, done, total)

    def stopped(self) -> bool:
        with self._cond:
            return self.stopping

    def keeps_part(self) -> bool:
        with self._cond:
            return self._keep_part

    def holding(self) -> None:
        with self._cond:
            self._holding = True

    def callers(self) -> int:
        with self._cond:
            return len(self._callers)

    def _run(self) -> None:
        result: Path | None = None
        error: ModelMissing | None = None
        try:
            result = self._work(self)
        except ModelMissing as exc:
            error = exc
        except Exception as exc:  # a bug: every caller hears of it in one line, the log has it
            log.exception("a pull failed unexpectedly")
            error = ModelMissing(f"the pull failed ({one_line(exc)}); run again, and report "
                                 "it if it fails the same way")
        self._on_end(self)
        with self._cond:
            self._result, self._error, self._finished = result, error, True
            self._cond.notify_all()

    # -- a caller's side (its own thread) -----------------------------------------------

    def add(self, caller: _Caller) -> bool:
        """Join ``caller`` to this transfer; False when it is stopping (too late)."""
        with self._cond:
            if self.stopping:
                return False
            self._callers.append(caller)
            return True

    def start(self) -> None:
        self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, caller: _Caller) -> Path:
        undo = caller.cancel.on_set(self._wake)
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._finished or caller.cancel.requested)
                finished = self._finished
                if not finished:
                    self._callers.remove(caller)
                    self.stopping = not self._callers
                    self._keep_part = self._keep_part or caller.cancel.keep_part
                join = finished or (self.stopping and self._holding)
        finally:
            undo()
        if join:
            self._thread.join()
        if not finished:
            raise PullCancelled(CANCELLED)
        if self._error is not None:  # a copy each: one exception raised in many threads
            raise type(self._error)(str(self._error))
        assert self._result is not None
        return self._result


class Shared:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}

    def run(self, key: str, work: Work, report: Report, cancel: CancelFlag) -> Path:
        """``work``'s result, from this caller's transfer or one under way for ``key``."""
        caller = _Caller(report, cancel)
        with self._lock:
            transfer = self._transfers.get(key)
            fresh = transfer is None or not transfer.add(caller)
            if transfer is None or fresh:
                transfer = _Transfer(key, work, lambda t: self._forget(key, t))
                self._transfers[key] = transfer
                transfer.add(caller)
        if fresh:
            transfer.start()
        return transfer.wait(caller)

    def callers(self, key: str) -> int:
        """How many callers wait on the transfer of ``key`` (0: none under way)."""
        with self._lock:
            transfer = self._transfers.get(key)
        return transfer.callers() if transfer is not None else 0

    def _forget(self, key: str, transfer: _Transfer) -> None:
        with self._lock:
            if self._transfers.get(key) is transfer:
                del self._transfers[key]


REGISTRY = Shared()
"""This process's downloads (a test of a restart gives a pull a fresh one)."""
