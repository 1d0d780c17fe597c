"""Python's cyclic garbage collector, run on the Qt thread only.

Left to itself the collector runs in whichever thread happens to allocate when a
threshold is crossed: llama.cpp's decode thread or a worker of ``asyncio.to_thread``. A Qt
object freed there (a widget or timer in a reference cycle with its slots) is destroyed
off its own thread, its timers stay registered, and the next tick of one crashes the
app. So automatic collection is off, and a timer on the Qt thread collects instead,
generation by generation as CPython's own thresholds would.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

EVERY_MS = 500  # cheap when there is nothing to collect


class MainThreadCollector(QObject):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thresholds = gc.get_threshold()
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.check)

    def start(self) -> None:
        gc.disable()
        self._timer.start(EVERY_MS)

    def stop(self) -> None:
        self._timer.stop()
        gc.enable()

    def check(self) -> None:
        counts = gc.get_count()
        if counts[0] <= self._thresholds[0]:
            return
        generation = 0
        if counts[1] > self._thresholds[1]:
            generation = 2 if counts[2] > self._thresholds[2] else 1
        gc.collect(generation)
