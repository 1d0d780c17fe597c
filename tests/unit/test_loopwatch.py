"""The loop-lag probe itself: it must catch a blocked loop and say where."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import pytest

from tests.loopwatch import LoopWatch


@pytest.mark.blocking_ok  # it blocks its loop on purpose, to see the probe catch it
async def test_the_probe_catches_a_blocking_call_and_names_it() -> None:
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
    watch.start()
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # the blocking call the probe must catch
    await asyncio.sleep(0.05)
    watch.stop()
    assert len(watch.stalls) == 1
    assert watch.stalls[0].seconds > 0.2
    assert "time.sleep(0.3)" in watch.stalls[0].stack
    assert "blocked" in watch.report()


@pytest.mark.blocking_ok
async def test_a_quiet_loop_and_garbage_collection_are_not_stalls() -> None:
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
    watch.start()
    junk = [[i] for i in range(300_000)]
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0.05)
    del junk
    watch.stop()
    assert watch.stalls == []


@pytest.mark.blocking_ok  # it makes leaks on purpose, and checks them itself
async def test_the_leak_check_sees_tasks_threads_and_sockets_left_behind() -> None:
    import socket
    import threading

    from tests.leaks import Baseline

    base = Baseline.now()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running", daemon=True)
    thread.start()
    task = asyncio.create_task(asyncio.sleep(30), name="left-pending")
    sock = socket.socket()
    try:
        leaks = await base.leaks()
        assert any("left-pending" in leak for leak in leaks)
        assert any("left-running" in leak for leak in leaks)
        assert any("socket" in leak for leak in leaks)
    finally:
        task.cancel()
        stop.set()
        thread.join(1)
        sock.close()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await base.leaks() == []
