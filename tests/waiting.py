"""Waiting in tests: on an observable condition, bounded, never a bare sleep(N)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.01
# how long a wait gives its condition by default: generous, since a busy machine (a build or
# another job on the other core) slows what the test waits for; only a failure waits it out
DEFAULT_TIMEOUT_S = 30.0


async def until(check: Callable[[], T | Awaitable[T]], what: str, *,
                timeout: float = DEFAULT_TIMEOUT_S) -> T:
    """Return ``check()``'s first truthy value; fail naming ``what`` after ``timeout``."""
    last: object = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                value = check()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return value  # type: ignore[return-value]
                last = value
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})") from None


async def until_result(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], *,
                       what: str = "the expected result", timeout: float = DEFAULT_TIMEOUT_S) -> T:
    """Probe until ``done(result)`` holds and return that result; fail after ``timeout``."""
    last: list[T] = []

    async def check() -> bool:
        result = await probe()
        last[:] = [result]
        return done(result)

    try:
        await until(check, what, timeout=timeout)
    except AssertionError:
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})") from None
    return last[0]


def until_sync(check: Callable[[], T], what: str, *, timeout: float = DEFAULT_TIMEOUT_S,
               poll: float = 0.05) -> T:
    """The same for tests outside a loop that watch other processes: return ``check()``'s
    first truthy value, polled every ``poll`` seconds; fail naming ``what`` after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        value = check()
        if value:
            return value
        last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
        time.sleep(poll)  # the poll interval, not a wait for the condition
