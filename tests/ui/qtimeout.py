"""pytest-timeout for tests on the Qt loop.

pytest-timeout's SIGALRM raises its failure in whatever Python the main thread runs next.
On a qasync loop that is always a callback of the loop, whose exception handler logs the
failure and carries on: a UI test that hangs hung the whole run (72 minutes in CI). Here a
thread watches the test instead. At the timeout it cancels every task of the test's loop
from the loop's own thread, printing where each one waited, so the test fails and the run
goes on; if the test has not ended GRACE_S later (a task that swallows its cancellation,
or Qt stuck in C++), pytest-timeout's thread method dumps every thread's stack and ends
the run, as it would for any test.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from typing import Any

import pytest
import pytest_timeout

GRACE_S = 15.0  # for the teardown of a test whose tasks were cancelled

_loops: list[asyncio.AbstractEventLoop] = []  # the loop of the test running now


def track(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    _loops[:] = [loop]
    return loop


def set_timer(item: pytest.Item, settings: Any) -> bool | None:
    if not inspect.iscoroutinefunction(getattr(item, "obj", None)):
        return None  # a test whose Python runs in the main thread: SIGALRM works there
    ended = threading.Event()

    def watch() -> None:
        if ended.wait(settings.timeout):
            return
        loop = _loops[0] if _loops else None
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(_cancel_every_task, loop, settings.timeout)
            if ended.wait(GRACE_S):
                return
        pytest_timeout.timeout_timer(item, settings)  # stacks, then os._exit(1)

    watcher = threading.Thread(target=watch, name=f"timeout {item.nodeid}", daemon=True)

    def cancel() -> None:
        ended.set()
        watcher.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's cancel hook calls it
    watcher.start()
    return True


def _cancel_every_task(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    why = f"Timeout: the test ran over {timeout:g} s"
    print(f"\n{'+' * 20} {why}; its tasks were waiting here:", file=sys.stderr)
    for task in asyncio.all_tasks(loop):
        task.print_stack(file=sys.stderr)
        task.cancel(why)
