"""The app's loop (app/loop.py): what runs in qasync's last pass after
`run_until_complete` runs with asyncio's running loop set, as everything else does."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import QTimer

from app.loop import make_loop
from tests.loopwatch import LoopWatch, busy_cpu
from tests.ui.conftest import qapp_instance


def test_a_task_stepped_in_the_last_pass_still_has_its_running_loop() -> None:
    loop = make_loop(qapp_instance())
    seen: list[str] = []

    async def sleeper() -> None:
        # the step a stats loop takes when its sleep ends as the loop stops
        try:
            seen.append("running" if asyncio.get_running_loop() is loop else "another")
        except RuntimeError as exc:  # qasync alone: "no running event loop"
            seen.append(str(exc))

    async def main() -> None:
        # run after run_until_complete's own stop callback: the Qt loop is told to exit
        # first, so this task's first step comes in the last pass
        task = asyncio.current_task()
        assert task is not None
        task.add_done_callback(lambda _: loop.create_task(sleeper()))

    try:
        for _ in range(3):
            loop.run_until_complete(main())
        assert seen == ["running"] * 3
        assert asyncio.events._get_running_loop() is None  # unset once it returns
    finally:
        loop.close()


def test_run_until_complete_on_a_running_loop_still_refuses() -> None:
    loop = make_loop(qapp_instance())
    refused: list[str] = []

    async def nested() -> None:
        inner = asyncio.sleep(0)
        try:
            loop.run_until_complete(inner)
        except RuntimeError as exc:
            refused.append(str(exc))
        finally:
            inner.close()
        asyncio.get_running_loop()  # still set after the refusal

    try:
        loop.run_until_complete(nested())
        assert refused == ["Event loop already running"]
    finally:
        loop.close()


@pytest.mark.blocking_ok  # it blocks the loop on purpose, to see the probe catch it
async def test_the_loop_watch_catches_a_qt_slot_that_blocks_the_loop() -> None:
    """Qt runs its slots outside asyncio's callbacks: the watch sees them too."""
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=0.1)
    watch.start()
    ran = asyncio.Event()

    def slot() -> None:  # a Qt timer's slot, called by Qt, not by asyncio
        busy_cpu(0.4)
        ran.set()

    QTimer.singleShot(0, slot)
    await asyncio.wait_for(ran.wait(), 30)
    await asyncio.sleep(0.05)
    watch.stop()
    assert len(watch.stalls) == 1, watch.report()
    assert watch.stalls[0].cpu > 0.1
    assert "outside asyncio's callbacks" in watch.stalls[0].stack
    assert "busy_cpu(0.4)" in watch.stalls[0].stack


def test_the_loop_watch_counts_no_work_done_while_the_qt_loop_is_not_running() -> None:
    """A fixture's teardown runs the loop again after plain code ran between the two runs
    (pytest's own, a synchronous fixture's): that code blocked no loop."""
    loop = make_loop(qapp_instance())
    watch = LoopWatch(loop, bound_s=0.1)
    ran: list[str] = []

    async def started() -> None:
        watch.start()
        await asyncio.sleep(0.05)  # a few beats

    async def again() -> None:
        await asyncio.sleep(0.05)
        ran.append("again")

    try:
        loop.run_until_complete(started())
        busy_cpu(0.4)  # between the runs, with the loop stopped
        loop.run_until_complete(again())
        assert ran == ["again"]
        assert watch.stalls == [], watch.report()
        # and the watch still counts a slot once the loop runs again

        async def blocked() -> None:
            QTimer.singleShot(0, lambda: busy_cpu(0.4))
            await asyncio.sleep(0.6)

        loop.run_until_complete(blocked())
        assert len(watch.stalls) == 1, watch.report()
    finally:
        watch.stop()
        loop.close()
