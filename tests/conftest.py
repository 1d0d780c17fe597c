"""Fixtures for every level of the suite."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.loopwatch import LoopWatch

LOOP_BOUND_S = 0.1


@pytest_asyncio.fixture
async def loop_watch() -> AsyncIterator[LoopWatch]:
    """Fails the test if its event loop was blocked for more than LOOP_BOUND_S."""
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=LOOP_BOUND_S)
    watch.start()
    yield watch
    watch.stop()
    if watch.stalls:
        pytest.fail(watch.report(), pytrace=False)


@pytest.fixture(autouse=True)
def _no_blocked_loop(request: pytest.FixtureRequest) -> None:
    """Every async test that runs engine code in its loop is under the loop-lag probe.

    Left out: tests that drive Shoal as processes (the ``cluster`` fixture, or the mark
    ``processes``: they start and stop processes with blocking calls, and no engine code
    runs in the test's loop, only a client), and tests marked ``blocking_ok`` (they say
    why)."""
    test = getattr(request.node, "obj", None)
    if not inspect.iscoroutinefunction(test) or "cluster" in request.fixturenames:
        return
    node = request.node
    if not node.get_closest_marker("blocking_ok") and not node.get_closest_marker("processes"):
        request.getfixturevalue("loop_watch")
