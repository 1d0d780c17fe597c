"""engine/head/fleet/alarm.py: one timer for a run of deadlines, moved only earlier."""

from __future__ import annotations

import asyncio

from engine.head.fleet.alarm import Alarm

BOUND_S = 10.0  # a bound on the waits, never asserted on


async def test_a_later_deadline_keeps_the_earlier_one() -> None:
    loop = asyncio.get_running_loop()
    rang: list[float] = []
    alarm = Alarm(loop.time, lambda: rang.append(loop.time()))
    now = loop.time()
    alarm.set_by(now + 0.02)
    alarm.set_by(now + BOUND_S * 100)  # not moved: it still rings at the first deadline
    async with asyncio.timeout(BOUND_S):
        while not rang:
            await asyncio.sleep(0.005)
    assert len(rang) == 1


async def test_an_earlier_deadline_moves_it_and_a_rung_alarm_sets_again() -> None:
    loop = asyncio.get_running_loop()
    rang = asyncio.Queue[str]()
    alarm = Alarm(loop.time, lambda: rang.put_nowait("rang"))
    alarm.set_by(loop.time() + BOUND_S * 100)
    alarm.set_by(loop.time())  # earlier: moved
    assert await asyncio.wait_for(rang.get(), BOUND_S) == "rang"
    alarm.set_by(loop.time() + BOUND_S * 100)  # rung, so unset: a later deadline sets it
    alarm.set_by(loop.time())
    assert await asyncio.wait_for(rang.get(), BOUND_S) == "rang"
    assert rang.empty()


async def test_a_cancelled_alarm_does_not_ring() -> None:
    loop = asyncio.get_running_loop()
    rang: list[str] = []
    alarm = Alarm(loop.time, lambda: rang.append("cancelled one"))
    alarm.set_by(loop.time())
    alarm.cancel()
    after = Alarm(loop.time, lambda: rang.append("after"))
    after.set_by(loop.time())  # due with the cancelled one, set after it
    async with asyncio.timeout(BOUND_S):
        while not rang:
            await asyncio.sleep(0)
    assert rang == ["after"]
