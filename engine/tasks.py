"""Ending the asyncio tasks a component owns, within a bound.

A component's close cancels its tasks and waits for them. A task that swallows its
cancellation (Python 3.11's `asyncio.wait_for` did, when the cancel raced its result)
would hold that close, and so the app's quit, forever. Here the wait is bounded and such
a task is named in the log, so the stop goes on and the bug is seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("shoal.tasks")
T = TypeVar("T")

STOP_BOUND_S = 5.0  # far above any task's own cleanup (a link's close, a cancel sent)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None], owner: str, *,
                          bound_s: float = STOP_BOUND_S) -> None:
    """Cancel ``tasks`` and wait until they end, at most ``bound_s``; what they raised is
    taken (never "exception was never retrieved"), and a task still running is logged."""
    owned = {task for task in tasks if task is not None}
    for task in owned:
        task.cancel()
    still = {task for task in owned if not task.done()}
    if still:  # asyncio.wait raises if the caller is cancelled: never swallowed here
        _, still = await asyncio.wait(still, timeout=bound_s)
    for task in owned - still:
        if not task.cancelled():
            task.exception()  # taken here: the owner is closing, not acting on it
    for task in still:
        log.error("%s: the task %r did not end %g s after it was cancelled; stopping "
                  "without it (a bug: please report it with this log)", owner,
                  task.get_name(), bound_s)


class TaskSet:
    """The tasks a component starts in the background and owns until they end: each is
    kept (asyncio holds only a weak reference to a running task) and dropped when done,
    and `close` cancels those still running, as `cancel_and_wait` does."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # names the component in the log of a task that did not end
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def close(self, *, bound_s: float = STOP_BOUND_S) -> None:
        """Cancel the tasks still running and wait until they end (see cancel_and_wait)."""
        await cancel_and_wait(list(self._tasks), self.owner, bound_s=bound_s)
