"""A start that fails leaves the app recoverable: with the API's port held by another
program the app says so, a command asked for meanwhile says why it cannot run (and the
button it disabled comes back), and once the user picks another port in Settings, Start
again in the tray menu starts Shoal there (issue 21, item 11)."""

from __future__ import annotations

import asyncio
import gc
import socket
from pathlib import Path

import aiohttp
import pytest
from PySide6.QtWidgets import QMessageBox

from app.pages.settings import SettingsPage
from app.prefs import load
from engine.config import save_machine_settings
from engine.service import configuration
from tests.ui.conftest import choose, read_menu, settings_for, started, visible_windows
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    """A port nothing listens on now (the app binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_port_in_use_then_another_port_and_start_again(
        ui_home: Path, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    await asyncio.to_thread(save_machine_settings,
                            settings_for(ui_home, http=f"127.0.0.1:{port}"), {})
    settings, prefs = await load(ui_home)
    shell = await started(settings, prefs)
    try:
        assert shell.phase == "failed"
        [box] = [w for w in visible_windows() if isinstance(w, QMessageBox)]
        assert str(port) in box.text() and "in use" in box.text()
        assert "Start again" in box.informativeText()
        box.close()
        shown = await read_menu(shell.tray.menu)
        assert shown["retry"] == ("Start again", True, False)

        # the welcome (a first run) asks for a fleet now: it says why it cannot, and its
        # button comes back
        welcome = shell.welcome
        assert welcome is not None and welcome.isVisible()
        welcome.start_choice.click()
        welcome.fleet_name.setText("desk")
        welcome.start_button.click()
        await until(lambda: "Shoal is not running" in welcome.start_error.text(),
                    "the welcome to say why the command did not run")
        assert "Start again" in welcome.start_error.text()
        assert welcome.start_button.isEnabled()
        gc.collect()
        assert not [w for w in recwarn if "never awaited" in str(w.message)]

        # another port, chosen in Settings, then Start again from the tray
        shell.open_window("settings")
        window = shell.window
        assert window is not None
        page = window.page("settings")
        assert isinstance(page, SettingsPage)
        await until(lambda: page.http_port.value() == port and not shell.bridge._tasks,
                    "the stored port shown")
        other = free_port()
        page.http_port.setValue(other)
        page.save.click()
        await until(lambda: page.saved.isVisible(), "the port saved")
        await choose(shell.tray.menu, "retry")
        await until(lambda: shell.phase == "running", "Shoal to start again", timeout=30)
        assert shell.shoal.api_url == f"http://127.0.0.1:{other}/v1"
        assert "retry" not in await read_menu(shell.tray.menu)
        await until(lambda: shell.bridge.refresh().ready_nodes == 1, "the node ready")
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{other}/v1/models") as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == ["mock-m"]
        # the commands run again
        welcome.start_button.click()
        await until(lambda: welcome.pairing_view.pairing is not None, "the fleet's code")
        assert shell.bridge.refresh().fleet_name == "desk"
    finally:
        await shell.stop(drain=1)
        taken.close()
