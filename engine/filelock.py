"""One writer at a time for a file that is read, changed and written back.

`exclusive(path)` holds ``path`` for a read-modify-write: against the other threads of
this process (a lock per path) and against other processes (an OS file lock, ``flock``,
on ``<name>.lock`` beside the file, which Linux and macOS both honour and release when
the holder exits, however it ends). The file itself is still written through
`engine.files.write_private`, so a reader that takes no lock sees the old file or the
new one, never half of one. The lock file stays: removing it would let two processes
lock two different files of the same name.

Blocking: call it from a worker thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_guard = threading.Lock()
_locks: dict[str, threading.Lock] = {}  # one per file locked in this process


def lock_path(path: Path) -> Path:
    """The lock file of ``path``."""
    return path.with_name(f"{path.name}.lock")


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold ``path`` until the block ends: one holder at a time among this process's
    threads and every process of this machine. Raises OSError when the lock file cannot
    be made or opened."""
    with _guard:
        lock = _locks.setdefault(os.path.abspath(path), threading.Lock())
    with lock:
        # flock alone would also keep threads apart (each open is its own lock), but
        # the thread lock lets a thread wait without holding a descriptor
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock
