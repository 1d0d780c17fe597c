import asyncio
from PySide6.QtWidgets import QLabel
import threading

async def test_proto(qtbot):
    l = QLabel("hi"); qtbot.addWidget(l); l.show()
    await asyncio.to_thread(lambda: threading.current_thread())
    await asyncio.sleep(0.05)
    print(threading.enumerate())
    assert l.isVisible()
