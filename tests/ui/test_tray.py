"""Every tray menu item, clicked as a user clicks it, against the app with an in-process
Shoal on the mock runtime: what the menu and the icon show, and what each item does."""

from __future__ import annotations

import asyncio
import os
import re
import tomllib
from pathlib import Path

import aiohttp
import pytest
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QDialog, QMessageBox

from app.icons import tray_icon
from app.main import Shell
from app.tray import Tray
from engine.service import Shoal
from engine.settings import NodeSettings, Settings
from tests.ui.conftest import (
    MODEL,
    QUIET,
    choose,
    qapp_instance,
    read_menu,
    settings_for,
    started,
    visible_windows,
)
from tests.ui.test_tray_view import local, node, snap, view
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


async def get_status(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return r.status


async def saved(home: Path) -> dict:
    return tomllib.loads(await asyncio.to_thread((home / "config.toml").read_text))


def shows(shell: Shell, look: str) -> bool:
    """The tray's icon is the one for ``look`` (what the panel draws)."""
    assert shell.tray.icon is not None
    return shell.tray.icon.icon().cacheKey() == tray_icon(look).cacheKey()  # type: ignore[arg-type]


async def test_the_menu_shows_the_fleet_as_the_snapshot_has_it(shell: Shell):
    menu = await read_menu(shell.tray.menu)
    snap = shell.bridge.last
    port = snap.roles.api_url.split(":")[-1].removesuffix("/v1")  # type: ignore[union-attr]
    assert menu["status"] == ("Not in a fleet · 1 node ready · 0/2 lanes busy", False, False)
    assert menu["copy_api_url"][:2] == (f"Copy API URL (127.0.0.1:{port})", True)
    assert menu["api"][1:] == (True, True)  # on by default
    assert menu["pause"][1:] == (True, False)
    assert menu["login"][1:] == (True, False)
    assert menu["leave"][1] is False  # not in a fleet: nothing to leave
    assert [menu[k][0] for k in ("open", "join", "pair", "leave", "quit")] == [
        "Open Shoal", "Join a fleet…", "Pair a new machine…", "Leave fleet", "Quit Shoal"]
    assert shows(shell, "lonely") and "Not in a fleet" in shell.tray.icon.toolTip()  # type: ignore[union-attr]


async def test_copy_api_url_puts_the_real_url_on_the_clipboard(shell: Shell):
    QGuiApplication.clipboard().setText("something else")
    await choose(shell.tray.menu, "copy_api_url")
    url = QGuiApplication.clipboard().text()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url)
    assert url == shell.bridge.last.roles.api_url
    async with aiohttp.ClientSession() as http, http.get(url + "/models") as r:
        assert r.status == 200 and MODEL in {m["id"] for m in (await r.json())["data"]}


async def test_the_api_switched_off_and_on_from_the_menu(shell: Shell, ui_home: Path):
    old_url = shell.bridge.last.roles.api_url
    assert old_url and await get_status(old_url + "/models") == 200
    await choose(shell.tray.menu, "api")
    await until(lambda: not shell.bridge.refresh().roles.head, "the API to stop")
    menu = await read_menu(shell.tray.menu)
    assert menu["api"][2] is False
    assert menu["copy_api_url"][:2] == ("Copy API URL (the API is off here)", False)
    assert menu["status"][0] == "Not in a fleet · API off here · 0/2 lanes busy"
    with pytest.raises(aiohttp.ClientConnectionError):
        await get_status(old_url + "/models")
    await until(lambda: saved(ui_home), "the config to be written")
    await until(lambda: _head_enabled(ui_home, False), "the API's state to be saved off")

    await choose(shell.tray.menu, "api")
    await until(lambda: shell.bridge.refresh().roles.head, "the API to run again")
    new_url = shell.bridge.last.roles.api_url
    assert new_url and await get_status(new_url + "/models") == 200
    assert (await read_menu(shell.tray.menu))["api"][2] is True
    await until(lambda: _head_enabled(ui_home, True), "the API's state to be saved on")


async def _head_enabled(home: Path, on: bool) -> bool:
    try:
        return (await saved(home))["head"]["enabled"] is on
    except (FileNotFoundError, KeyError):
        return False


async def test_pause_serving_shows_in_the_icon_and_the_menu(shell: Shell):
    await choose(shell.tray.menu, "pause")
    await until(lambda: shows(shell, "paused"), "the paused icon")
    node = shell.bridge.refresh().roles.node
    assert node is not None and node.state == "paused"
    menu = await read_menu(shell.tray.menu)
    assert menu["pause"][2] is True and menu["status"][0].endswith(" · paused")
    await choose(shell.tray.menu, "pause")
    await until(lambda: shows(shell, "lonely"), "the icon to leave paused")
    assert (await read_menu(shell.tray.menu))["pause"][2] is False


async def test_the_menu_opens_on_the_fleet_as_it_is_this_moment(shell: Shell):
    # changed elsewhere (the window, the CLI) just now: no snapshot or event has come yet
    await shell.shoal.pause_serving(True)
    assert shell.bridge.last.roles.node.state != "paused"  # type: ignore[union-attr]
    menu = await read_menu(shell.tray.menu)
    assert menu["pause"][2] is True and menu["status"][0].endswith(" · paused")
    await shell.shoal.set_head(False)
    menu = await read_menu(shell.tray.menu)
    assert menu["api"][2] is False
    assert menu["copy_api_url"] == ("Copy API URL (the API is off here)", False, False)


async def test_busy_lanes_show_in_the_icon_and_the_status_line(ui_home: Path):
    shell = await started(settings_for(ui_home, mock_speed=50.0))
    try:
        url = shell.bridge.last.roles.api_url
        # an answer of a minute at 50 tokens/s holds the lane however slowly the tray's
        # refresh comes (60 tokens once finished before a loaded machine's icon changed);
        # the client then hangs up, which ends it
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3000, "stream": True}
        async with aiohttp.ClientSession() as http, \
                http.post(f"{url}/chat/completions", json=body) as r:
            await r.content.readline()  # the first token is out: a lane is busy
            await until(lambda: shows(shell, "busy"), "the busy icon")
            assert (await read_menu(shell.tray.menu))["status"][0].endswith("1/2 lanes busy")
        await until(lambda: shows(shell, "lonely"), "the icon to settle")
    finally:
        await shell.stop(drain=1)


async def test_start_at_login_writes_and_removes_the_autostart_entry(shell: Shell,
                                                                      ui_home: Path):
    entry = Path(os.environ["XDG_CONFIG_HOME"]) / "autostart" / "shoal.desktop"
    await choose(shell.tray.menu, "login")
    await until(entry.exists, "the autostart entry")
    text = entry.read_text()
    assert "-m app.launch app" in text and f"SHOAL_HOME={ui_home}" in text
    assert (await read_menu(shell.tray.menu))["login"][2] is True
    await until(lambda: _app_pref(ui_home, "start_at_login", True), "the choice saved")
    await choose(shell.tray.menu, "login")
    await until(lambda: not entry.exists(), "the entry removed")
    assert (await read_menu(shell.tray.menu))["login"][2] is False
    await until(lambda: _app_pref(ui_home, "start_at_login", False), "the choice saved")


async def _app_pref(home: Path, name: str, value: bool) -> bool:
    try:
        return (await saved(home))["app"][name] is value
    except (FileNotFoundError, KeyError):
        return False


async def test_open_pair_and_join_open_the_window_the_page_and_the_dialog(
        shell: Shell, monkeypatch: pytest.MonkeyPatch):
    assert shell.window is None  # nothing opens by itself after the first run
    await choose(shell.tray.menu, "open")
    window = shell.window
    await until(lambda: window is not None and window.isVisible(), "the window")
    assert window is not None
    pages: list[str] = []
    show_page = window.show_page  # type: ignore[attr-defined]
    monkeypatch.setattr(window, "show_page", lambda page: (pages.append(page), show_page(page)))
    window.close()
    await choose(shell.tray.menu, "pair")
    await until(window.isVisible, "the window again")
    assert pages == ["pairing"]
    await choose(shell.tray.menu, "join")
    dialog = await until(lambda: next((w for w in visible_windows() if isinstance(w, QDialog)
                                       and not isinstance(w, QMessageBox)), None),
                         "the join dialog")
    dialog.close()
    window.close()


async def test_leave_fleet_unlinks_and_the_menu_follows(shell: Shell, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    from engine.service import configuration

    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    head = await Shoal.start(settings_for(tmp_path / "head", fleet_listen="127.0.0.1:0"))
    try:
        await head.create_fleet("desk")
        _host, port = head.fleet_address  # type: ignore[misc]
        code = (await head.pairing(head=f"127.0.0.1:{port}")).url
        await shell.shoal.join(code)  # what the join dialog does
        await until(lambda: shows(shell, "serving"), "the in-a-fleet icon")
        menu = await read_menu(shell.tray.menu)
        assert menu["status"][0] == "desk · 1 node ready · 0/2 lanes busy"
        assert menu["leave"][1] is True
        await choose(shell.tray.menu, "leave")
        await until(lambda: not shell.bridge.refresh().roles.member, "the node to leave")
        await until(lambda: shows(shell, "lonely"), "the not-in-a-fleet icon")
        menu = await read_menu(shell.tray.menu)
        assert menu["leave"][1] is False and menu["status"][0].startswith("Not in a fleet")
        await until(lambda: all(n.link != "joined" or n.state == "left"
                                for n in head.snapshot().nodes), "the head to see it leave")
    finally:
        await head.stop(drain=1)


async def test_a_node_joining_and_leaving_is_a_notification(shell: Shell, tmp_path: Path):
    await shell.shoal.create_fleet("desk")
    _host, port = shell.shoal.fleet_address  # type: ignore[misc]
    code = (await shell.shoal.pairing(head=f"127.0.0.1:{port}")).url
    other = await Shoal.start(Settings(home=tmp_path / "b", discovery=QUIET, node=NodeSettings(
        model=MODEL, runtime="mock", lanes=1, identity="b-node")))
    try:
        await other.join(code)
        await until(lambda: any("b-node joined" in s for s in shell.tray.sent),
                    "a notification of the join")
        assert list(shell.tray.sent) == ["b-node joined: mock-m, 1 lane"]
        await other.leave()
        await until(lambda: any(n.identity == "b-node" and n.state == "left"
                                for n in shell.bridge.refresh().nodes), "b to leave")
        # within the quiet gap: held back, shown with the next one
        assert len(shell.tray.sent) == 1
    finally:
        await other.stop(drain=1)


async def test_notifications_off_in_prefs_means_none(ui_home: Path, tmp_path: Path):
    from app.prefs import Prefs
    from engine.events import NodeLinked

    shell = await started(settings_for(ui_home), Prefs(welcomed=True, notify=False))
    seen: list[object] = []
    shell.bridge.event.connect(seen.append)  # after the shell's own handler
    try:
        await shell.shoal.create_fleet("desk")
        _host, port = shell.shoal.fleet_address  # type: ignore[misc]
        code = (await shell.shoal.pairing(head=f"127.0.0.1:{port}")).url
        other = await Shoal.start(Settings(home=tmp_path / "b", discovery=QUIET,
                                           node=NodeSettings(model=MODEL, runtime="mock",
                                                             lanes=1, identity="b-node")))
        try:
            await other.join(code)
            await until(lambda: any(isinstance(e, NodeLinked) and e.identity == "b-node"
                                    for e in seen), "the shell to get b's join")
            assert list(shell.tray.sent) == []
        finally:
            await other.stop(drain=1)
    finally:
        await shell.stop(drain=1)


async def test_quit_finishes_the_request_under_way_and_leaves_nothing(ui_home: Path):
    shell = await started(settings_for(ui_home, mock_speed=100.0))
    url = shell.bridge.last.roles.api_url
    # seeded: the mock then gives all 40 tokens (unseeded, it may end an answer early)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "seed": 7}

    async def ask() -> dict:
        async with aiohttp.ClientSession() as http, \
                http.post(f"{url}/chat/completions", json=body) as r:
            assert r.status == 200
            return await r.json()

    request = asyncio.create_task(ask())
    await until(lambda: shell.bridge.refresh().lanes_busy == 1, "the request to run")
    await choose(shell.tray.menu, "quit")
    assert shell.quitting.is_set()
    await shell.stop(drain=10)
    answer = await request
    assert answer["usage"]["completion_tokens"] == 40
    assert shell.tray.icon is None and shell.window is None


async def test_a_held_back_notification_is_shown_when_the_gap_has_passed():
    from app.notify import Notifier

    sent: list[str] = []
    notifier = Notifier(sent.append, gap_s=0.2)
    for line in ("a joined", "b joined", "c left"):
        notifier.offer(line)
    assert sent == ["a joined"]
    await until(lambda: len(sent) == 2, "the held-back lines")
    assert sent[1] == "c left (and 1 more: Open Shoal to see them)"
    notifier.close()


def test_the_menu_changes_its_items_in_place_and_adds_only_the_new_ones():
    """Under a StatusNotifierItem host each added or removed item is a layout change with
    new ids (tests/ui/test_tray_sni.py): the same items stay the same QActions."""
    qapp_instance()
    running = view(snap(node()))
    tray = Tray(running, system_tray=False)
    try:
        items = tray.menu.actions()
        changed: list[str] = []
        for action in items:
            action.changed.connect(lambda a=action: changed.append(a.objectName()))
        tray.render(running)
        tray.menu.aboutToShow.emit()  # opening, with no fresh view to ask for
        assert kept(tray, items) and changed == []
        tray.render(view(snap(node(), mine=local("paused"))))
        assert kept(tray, items)
        assert sorted(set(changed)) == ["pause", "status"]
        assert tray.action("pause").isChecked() and tray.action("status").text().endswith(
            "paused")
        # a failed start adds its line and Start again where they belong, keeping the rest
        tray.render(view(snap(node()), phase="failed", problem="port 8453 is in use"))
        shown = [a.objectName() for a in tray.menu.actions() if not a.isSeparator()]
        assert shown[:4] == ["status", "problem", "retry", "open"]
        assert tray.action("problem").text() == "port 8453 is in use"
        assert all(a in tray.menu.actions() for a in items)
        assert len(tray.menu.actions()) == len(items) + 2
        tray.render(running)
        assert kept(tray, items)
    finally:
        tray.close()


def kept(tray: Tray, items: list) -> bool:
    """The menu holds the same QActions as before (not new ones with the same text)."""
    now = tray.menu.actions()
    return len(now) == len(items) and all(a is b for a, b in zip(now, items, strict=True))
