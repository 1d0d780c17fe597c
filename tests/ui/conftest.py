"""Qt widget tests: offscreen, each async test on a qasync loop (Qt and asyncio on one
thread, as the app runs them), under the loop-lag probe and the leak check of
tests/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from tests.e2e.conftest import smollm2_gguf  # noqa: F401 - the real model, as e2e has it

_warm = False
# Qt lays out and paints in the loop's own thread, in C++ between two Python callbacks; on a
# loaded two-core machine a window's first paint can take 100-200 ms. The probe still catches
# Python code that blocks (files, sockets, decoding) above this bound.
UI_LOOP_BOUND_S = 0.3


@pytest.fixture
def loop_watch(loop_watch: Any) -> Any:
    """tests/conftest.py's probe and leak check, with room for Qt's own painting."""
    loop_watch.bound_s = UI_LOOP_BOUND_S
    return loop_watch


def _application() -> Any:
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    app.setQuitOnLastWindowClosed(False)  # as the tray app runs: closing a window is not quitting
    global _warm
    if not _warm:  # fonts and styles load once, outside any test's loop
        from PySide6.QtWidgets import QLabel, QTableView

        for widget in (QLabel("warm up"), QTableView()):
            widget.grab()
        _warm = True
    return app


def _qasync_loop() -> Any:
    import qasync

    loop = qasync.QEventLoop(_application())
    # asyncio.to_thread on the loop's own pool, named as the leak check expects of it
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio_"))
    return loop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], Any]]:
    return {"qasync": _qasync_loop}
