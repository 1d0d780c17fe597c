"""The loop-lag probe itself: it must catch a blocked loop and say where."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.loopwatch import LoopWatch, busy_cpu


@pytest.mark.blocking_ok  # it blocks its loop on purpose, to see the probe catch it
async def test_the_probe_catches_a_blocking_call_and_names_it() -> None:
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
    watch.start()
    await asyncio.sleep(0.05)
    time.sleep(0.5)  # the blocking call the probe must catch
    await asyncio.sleep(0.05)
    watch.stop()
    assert len(watch.stalls) == 1
    assert watch.stalls[0].slept > 0.25 and watch.stalls[0].cpu < 0.1
    assert "time.sleep(0.5)" in watch.stalls[0].stack
    assert "blocked" in watch.report()


@pytest.mark.blocking_ok  # it blocks its loop on purpose, to see the probe catch it
async def test_the_probe_catches_150_ms_of_real_work_in_one_callback() -> None:
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
    watch.start()
    await asyncio.sleep(0.05)
    busy_cpu(0.15)  # the work the probe must catch
    await asyncio.sleep(0.05)
    busy_cpu(0.4)  # long enough for the watchdog, which needs the GIL, to take its stack
    await asyncio.sleep(0.05)
    watch.stop()
    assert len(watch.stalls) == 2, watch.report()
    assert 0.1 < watch.stalls[0].cpu < 0.4 and watch.stalls[1].cpu > 0.35
    assert "busy_cpu(0.4)" in watch.stalls[1].stack


@pytest.mark.blocking_ok  # its callbacks are slow on purpose
async def test_many_short_callbacks_are_not_one_stall() -> None:
    """A burst of the test's own work, each piece short, keeps the loop turning."""
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
    watch.start()

    async def piece() -> None:
        busy_cpu(0.01)

    await asyncio.gather(*(piece() for _ in range(30)))  # 300 ms of work in one turn
    watch.stop()
    assert watch.stalls == [], watch.report()


def _starved_loop(cpu: int) -> tuple[list[float], float]:
    """On a thread of its own, pinned to ``cpu`` at the lowest priority (the spinners beside
    it take nearly all of that CPU): a loop whose callbacks do 5 ms of work each. Returns
    the stalls' seconds and the longest wall time one callback took."""
    os.sched_setaffinity(0, {cpu})  # this thread only
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    longest = 0.0

    async def main() -> list[float]:
        nonlocal longest
        watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
        watch.start()
        try:
            # until one callback took longer than the bound in wall-clock time (a bounded count)
            for _ in range(40):
                t0 = time.monotonic()
                busy_cpu(0.005)
                longest = max(longest, time.monotonic() - t0)
                await asyncio.sleep(0)
                if longest > 0.2:
                    break
        finally:
            watch.stop()
        return [s.seconds for s in watch.stalls]

    return asyncio.run(main()), longest


@pytest.mark.blocking_ok  # it runs its own loop on a thread of its own
async def test_a_loop_starved_of_cpu_by_other_processes_is_not_blocked() -> None:
    """What a busy machine does to a test: other processes hold the CPU, and the loop's
    callbacks take long in wall-clock time while their own work is short."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    spin = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); print('spinning', flush=True)"
            "\nwhile True: pass")
    spinners = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        for p in spinners:  # each is on the CPU before the loop starts there
            assert p.stdout is not None and p.stdout.readline().strip() == "spinning"
        with ThreadPoolExecutor(1) as pool:
            stalls, longest = await asyncio.get_running_loop().run_in_executor(
                pool, _starved_loop, cpu)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
    # the wall clock alone would have called it blocked...
    assert longest > 0.1, f"the spinners did not starve the loop ({longest * 1000:.0f} ms)"
    # ...its own work was 5 ms a callback
    assert stalls == []


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
