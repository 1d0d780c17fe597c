"""The app's loop (app/loop.py): what runs in qasync's last pass after
`run_until_complete` runs with asyncio's running loop set, as everything else does."""

from __future__ import annotations

import asyncio

from app.loop import make_loop
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
