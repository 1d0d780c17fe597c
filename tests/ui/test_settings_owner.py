"""One owner for this machine's settings: the running Shoal holds those in force and those
for the next start, and writes config.toml through one writer; the app's pages render
what it holds and send it changes (issue 21, item 12)."""

from __future__ import annotations

import asyncio
import os
import tomllib
from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtTest import QTest

from app.main import Shell
from app.pages.settings import SettingsPage
from engine import events as ev
from tests.ui.conftest import choose, read_menu
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


async def stored(home: Path) -> dict:
    try:
        return tomllib.loads(await asyncio.to_thread((home / "config.toml").read_text))
    except FileNotFoundError:
        return {}


async def holds(home: Path, table: str, key: str, value: object) -> bool:
    return (await stored(home)).get(table, {}).get(key) == value


def settings_page(shell: Shell) -> SettingsPage:
    shell.open_window("settings")
    assert shell.window is not None
    page = shell.window.page("settings")  # type: ignore[attr-defined]
    assert isinstance(page, SettingsPage)
    return page


def tick(box) -> None:  # type: ignore[no-untyped-def]
    QTest.mouseClick(box, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier,
                     QPoint(8, box.height() // 2))  # on its box


async def test_start_at_login_from_the_tray_stays_on_after_a_tick_in_settings(
        shell: Shell, ui_home: Path):
    entry = Path(os.environ["XDG_CONFIG_HOME"]) / "autostart" / "shoal.desktop"
    page = settings_page(shell)  # open before the tray's change: it must not keep a copy
    await choose(shell.tray.menu, "login")
    await until(entry.exists, "the autostart entry")
    await until(lambda: holds(ui_home, "app", "start_at_login", True), "the choice kept")
    assert page.notify.isChecked()
    tick(page.notify)
    await until(lambda: holds(ui_home, "app", "notify", False), "notifications off kept")
    assert (await stored(ui_home))["app"]["start_at_login"] is True
    assert (await read_menu(shell.tray.menu))["login"][2] is True
    assert entry.exists() and shell.prefs.start_at_login and not shell.prefs.notify


async def test_a_pause_after_a_port_change_for_the_next_start_keeps_the_new_port(
        shell: Shell, ui_home: Path):
    page = settings_page(shell)
    page.http_port.setValue(18453)
    page.save.click()
    await until(lambda: page.saved.isVisible(), "the port saved")
    assert "next starts" in page.saved.text()
    assert ":18453" not in shell.shoal.api_url  # type: ignore[operator]  # until then
    await choose(shell.tray.menu, "pause")
    await until(lambda: holds(ui_home, "node", "paused", True), "the pause kept")
    assert (await stored(ui_home))["head"]["http"] == "127.0.0.1:18453"
    assert page.http_port.value() == 18453  # the page shows what waits for the next start
    assert shell.shoal.pending.head.http == "127.0.0.1:18453"  # type: ignore[union-attr]


async def test_concurrent_changes_all_land_in_the_one_file(shell: Shell, ui_home: Path):
    shoal = shell.shoal
    events = shoal.events()
    try:
        await asyncio.gather(
            shoal.update_settings(http_port=18460), shoal.update_settings(discovery="lan"),
            shoal.update_settings(queue_timeout_s=45),
            shoal.update_settings(app={"notify": False}),
            shoal.update_settings(app={"start_at_login": True}),
            shoal.pause_serving(True), shoal.set_head(False))
        await shoal.set_head(True)
        changed = [e for e in iter(events.get_nowait, None)
                   if isinstance(e, ev.SettingsChanged)]
        assert len(changed) == 5 and all(e.restart_needed for e in changed[:3])
    finally:
        events.close()
    await until(lambda: holds(ui_home, "head", "enabled", True), "the API back on kept")
    on_disk = await stored(ui_home)
    assert on_disk["head"]["http"] == "127.0.0.1:18460"
    assert on_disk["head"]["queue_timeout_s"] == 45.0
    assert on_disk["discovery"]["mode"] == "lan" and on_disk["node"]["paused"] is True
    assert on_disk["app"] == {**on_disk["app"], "notify": False, "start_at_login": True}
    assert on_disk["app"]["welcomed"] is True  # what was there stays
