"""What a node tells its heads of its machine beside its engine's stats: what a fit
estimate of another model there needs (its RAM, the disk free where it keeps models) and
a pull under way. The node's owner supplies them (:class:`MachineFacts`); the disk is read
in a worker thread, at most every ``DISK_EVERY_S``, never per stats record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.models.pulls import disk

DISK_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class MachineFacts:
    """Bytes; 0 and "" where not said."""

    ram_total: int = 0
    disk_free: int = 0
    pull_model: str = ""  # a pull under way on the node, and how far it is
    pull_done: int = 0
    pull_total: int = 0
    # why the last model a head chose for this node could not be served ("" none): the
    # head that asked hears the outcome, not only the node's own log
    serve_failed: str = ""
    mem_bandwidth: int = 0  # bytes/s its RAM reads at, measured once per machine


def free_bytes(folder: Path) -> int:
    """Bytes free on the filesystem of ``folder`` (its nearest existing parent: the models
    folder is made on the first pull), as the pulls' disk check reads it; 0 when it cannot
    be told. Blocking IO."""
    try:
        return int(disk.free_bytes(folder))
    except OSError:
        return 0


class DiskFree:
    """The disk free at ``folder``, as last read: :meth:`now` answers at once and starts a
    new reading in the loop's worker threads when the last is older than ``every_s`` (no
    task to own: a reading that ends after its owner is gone is dropped)."""

    def __init__(self, folder: Path, *, every_s: float = DISK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = folder
        self._every = every_s
        self._clock = clock
        self._free = 0
        self._read_at: float | None = None
        self._reading: asyncio.Future[int] | None = None

    def now(self) -> int:
        at = self._clock()
        if self._reading is None and (self._read_at is None or at - self._read_at >= self._every):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # asked outside the loop: the last reading stands
                return self._free
            self._read_at = at
            self._reading = loop.run_in_executor(None, free_bytes, self.folder)
            self._reading.add_done_callback(self._took)
        return self._free

    def _took(self, reading: asyncio.Future[int]) -> None:
        self._reading = None
        if not reading.cancelled() and reading.exception() is None:
            self._free = reading.result()
