"""Qt widget tests: offscreen, each async test on a qasync loop (Qt and asyncio on one
thread, as the app runs them)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402


def _qasync_loop() -> Any:
    import qasync
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    return qasync.QEventLoop(app)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], Any]]:
    return {"qasync": _qasync_loop}
