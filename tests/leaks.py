"""What a test leaves behind: threads, asyncio tasks and sockets it started and did not end.

Taken inside the test's event loop at the start and again at the end (after its other
fixtures are torn down), with a short grace for threads and sockets that are closing.
The loop's own parts (its self-pipe, its default executor's workers) are not counted.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from dataclasses import dataclass, field

GRACE_S = 2.0  # a closing thread or socket may take this long
POLL_S = 0.02
# threads that belong to the loop or to the interpreter, not to the test
_OWN_THREADS = ("asyncio_", "loop-watch")


def _threads() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate()
            if t.ident is not None and t.is_alive() and not t.name.startswith(_OWN_THREADS)}


def _sockets() -> set[int]:
    """Inode numbers of this process's open sockets (Linux: /proc/self/fd)."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.add(st.st_ino)
    return out


@dataclass
class Baseline:
    threads: dict[int, str] = field(default_factory=_threads)
    sockets: set[int] = field(default_factory=_sockets)
    tasks: set[asyncio.Task[object]] = field(default_factory=set)

    @classmethod
    def now(cls) -> Baseline:
        base = cls()
        base.tasks = set(asyncio.all_tasks())
        return base

    async def leaks(self) -> list[str]:
        """What is still there that was not at the start, after the grace period."""
        current = asyncio.current_task()
        deadline = time.monotonic() + GRACE_S
        while True:
            tasks = [t for t in asyncio.all_tasks()
                     if t not in self.tasks and t is not current and not t.done()]
            threads = {i: n for i, n in _threads().items() if i not in self.threads}
            sockets = _sockets() - self.sockets
            if not (tasks or threads or sockets) or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_S)
        out = [f"task {t.get_name()!r} ({t.get_coro()!r})" for t in tasks]
        out += [f"thread {name!r}" for name in threads.values()]
        if sockets:
            out.append(f"{len(sockets)} socket(s)")
        return out
