"""The app's asyncio loop: qasync's, on the one QApplication, with two things fixed.

qasync 0.28's `run_until_complete` stops the Qt loop, unsets asyncio's running loop and
then processes Qt's pending events once more: a task step or timer due at that moment
runs with no running loop and fails ("no running event loop" in `asyncio.sleep`). An
`asyncio.Runner` calls `run_until_complete` several times as the app quits (the main
coroutine, cancelling what is left, the executor), and every async UI test's phases
do too. Here the running loop stays set until that last pass is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import qasync
from PySide6.QtWidgets import QApplication


class ShoalLoop(qasync.QEventLoop):  # type: ignore[misc]
    """qasync's loop whose last pass after `run_until_complete` runs as the running loop."""

    _completing = False

    def run_forever(self) -> Any:
        try:
            return super().run_forever()
        finally:
            if self._completing:  # qasync unset it; its last pass comes next
                asyncio.events._set_running_loop(self)

    def run_until_complete(self, future: Any) -> Any:
        if self.is_running():
            return super().run_until_complete(future)  # raises: already running
        self._completing = True
        try:
            return super().run_until_complete(future)
        finally:
            self._completing = False
            asyncio.events._set_running_loop(None)


def make_loop(qapp: QApplication) -> asyncio.AbstractEventLoop:
    """The loop on ``qapp``, with a plain thread pool for work moved off it."""
    loop = ShoalLoop(qapp)
    # a plain pool, named as asyncio names its own, instead of qasync's QThreads
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
        thread_name_prefix="asyncio"))
    return loop
