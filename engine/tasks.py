"""Ending the asyncio tasks a component owns, within a bound.

A component's close cancels its tasks and waits for them. A task that swallows its
cancellation (Python 3.11's `asyncio.wait_for` did, when the cancel raced its result)
would hold that close, and so the app's quit, forever. Here the wait is bounded and such
a task is named in the log, so the stop goes on and the bug is seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("shoal.tasks")

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
