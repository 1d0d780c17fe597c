"""A component's close ends its tasks within a bound (engine.tasks)."""

from __future__ import annotations

import asyncio
import logging

from engine.tasks import TaskSet, cancel_and_wait
from tests.waiting import until


async def test_tasks_end_cancelled_and_one_that_raises_does_not_stop_the_close(caplog):
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(asyncio.Event().wait(), name="waiting")

    async def fail() -> None:
        raise ValueError("failed before the close")

    failed = asyncio.create_task(fail(), name="failed")

    async def raise_at_cancel() -> None:
        try:
            await loop.create_future()
        except asyncio.CancelledError:
            raise RuntimeError("raised while closing") from None

    raising = asyncio.create_task(raise_at_cancel(), name="raising")
    await until(lambda: failed.done(), "a task already ended")
    await cancel_and_wait([waiting, failed, raising, None], "the test")
    assert waiting.cancelled()
    assert isinstance(failed.exception(), ValueError)
    assert isinstance(raising.exception(), RuntimeError)
    assert "did not end" not in caplog.text


async def test_a_task_that_swallows_its_cancellation_is_named_and_left(caplog):
    loop = asyncio.get_running_loop()
    cancels = 0
    give_in = False

    async def stubborn() -> None:
        nonlocal cancels
        while not give_in:
            try:
                await loop.create_future()
            except asyncio.CancelledError:
                cancels += 1

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="shoal.tasks"):
        await cancel_and_wait([task], "the test's owner", bound_s=0.05)
    assert cancels == 1 and not task.done()
    assert "the test's owner: the task 'stubborn' did not end 0.05 s after" in caplog.text
    give_in = True  # the test's own teardown ends it
    task.cancel()
    await task


async def test_a_close_that_is_itself_cancelled_while_it_waits_ends_cancelled():
    """What `with suppress(CancelledError): await task` got wrong: the closer's own
    cancellation was swallowed with the task's, and the closer ran on."""
    slow_to_end = asyncio.Event()

    async def cleans_up_slowly() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await slow_to_end.wait()

    task = asyncio.create_task(cleans_up_slowly())
    await asyncio.sleep(0)
    closer = asyncio.create_task(cancel_and_wait([task], "the test"))
    await until(lambda: task.cancelling(), "the task cancelled")
    closer.cancel()
    await asyncio.wait([closer])
    assert closer.cancelled()
    slow_to_end.set()
    await asyncio.wait([task])
    assert task.cancelled()


async def test_a_task_set_keeps_its_tasks_until_they_end_and_cancels_the_rest_at_close():
    tasks = TaskSet("the test")
    go = asyncio.Event()

    async def quick() -> int:
        await go.wait()
        return 7

    done = tasks.spawn(quick(), "quick")
    waiting = tasks.spawn(asyncio.Event().wait(), "waiting")
    assert len(tasks) == 2 and done.get_name() == "quick"
    go.set()
    assert await done == 7
    await until(lambda: len(tasks) == 1, "the ended task dropped")
    assert list(tasks) == [waiting]
    await tasks.close()
    assert waiting.cancelled()
    await until(lambda: len(tasks) == 0, "the cancelled task dropped")
