"""The app's life: a first run opens the welcome and later runs open nothing; a restart
comes back in its fleet and, after Leave, out of it; a start that fails says why in one
line; where there is no system tray the window carries the menu; `main` runs and quits."""

from __future__ import annotations

import asyncio
import socket
import tomllib
from pathlib import Path

import pytest
from PySide6.QtWidgets import QDialog, QMessageBox

from app.main import Shell, main
from app.prefs import Prefs, load
from engine.config import save_machine_settings
from engine.service import Pairing, Shoal, configuration
from tests.ui.conftest import choose, read_menu, settings_for, started, visible_windows
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def messages() -> list[QMessageBox]:
    return [w for w in visible_windows() if isinstance(w, QMessageBox)]


async def config(home: Path) -> dict:
    return tomllib.loads(await asyncio.to_thread((home / "config.toml").read_text))


async def fleet_saved(home: Path, **want: object) -> bool:
    try:
        table = (await config(home)).get("fleet", {})
    except FileNotFoundError:
        return False
    return all(table.get(k) == v for k, v in want.items())


async def restart(home: Path) -> Shell:
    """The app as it starts from what it saved (config.toml and the token)."""
    settings, prefs = await load(home)
    return await started(settings, prefs)


async def test_a_restart_comes_back_in_its_fleet_and_not_after_leave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    a_home, b_home = tmp_path / "a", tmp_path / "b"
    for home in (a_home, b_home):
        save_machine_settings(settings_for(home), {"welcomed": True})

    # A starts a fleet, quits, and its head takes joins again after the restart
    a = await restart(a_home)
    await a.shoal.create_fleet("desk")
    await until(lambda: fleet_saved(a_home, listen="127.0.0.1:0"), "A's fleet saved")
    await a.stop(drain=1)
    a = await restart(a_home)
    b: Shell | None = None
    try:
        snap = a.bridge.refresh()
        assert snap.roles.fleet_listen is not None and snap.fleet_name == "desk"
        _host, port = a.shoal.fleet_address  # type: ignore[misc]
        code = (await a.shoal.pairing(head=f"127.0.0.1:{port}")).url

        # B joins (as the join dialog does), quits, and comes back linked
        b = await restart(b_home)
        await b.shoal.join(code)
        await until(lambda: fleet_saved(b_home, member=True, head=f"127.0.0.1:{port}"),
                    "B's membership saved")
        assert "code" not in (await config(b_home))["fleet"]  # the token never goes there
        await b.stop(drain=1)
        b = await restart(b_home)
        await until(lambda: b.bridge.refresh().roles.member, "B back in the fleet")
        await until(lambda: any(n.link == "joined" and n.state == "ready"
                                for n in a.bridge.refresh().nodes), "A to see B's node")
        assert (await read_menu(b.tray.menu))["status"][0].startswith("desk · ")

        # B leaves from the tray: the next start is out of the fleet
        await choose(b.tray.menu, "leave")
        await until(lambda: fleet_saved(b_home, member=False), "B's leave saved")
        await b.stop(drain=1)
        b = await restart(b_home)
        roles = b.bridge.refresh().roles
        assert not roles.member and not roles.rejoining
        assert (await read_menu(b.tray.menu))["status"][0].startswith("Not in a fleet")

        # A leaves: its head no longer takes joins after a restart
        await choose(a.tray.menu, "leave")
        await until(lambda: _left(a_home), "A's leave saved")
        await a.stop(drain=1)
        a = await restart(a_home)
        assert a.bridge.refresh().roles.fleet_listen is None
    finally:
        await a.stop(drain=1)
        if b is not None:
            await b.stop(drain=1)


async def _left(home: Path) -> bool:
    table = (await config(home)).get("fleet", {})
    return table.get("member") is False and "listen" not in table


async def test_a_fleet_whose_head_is_away_shows_the_error_and_stays_remembered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")
    head = await Shoal.start(settings_for(tmp_path / "head", fleet_listen="127.0.0.1:0"))
    await head.create_fleet("desk")
    port = head.fleet_address[1]  # type: ignore[index]
    home = tmp_path / "b"
    save_machine_settings(settings_for(home), {"welcomed": True})
    b = await restart(home)
    try:
        await b.shoal.join((await head.pairing(head=f"127.0.0.1:{port}")).url)
        await until(lambda: fleet_saved(home, member=True), "the membership saved")
        await b.stop(drain=1)
        await head.stop(drain=1)  # the fleet's head goes away meanwhile
        b = await restart(home)
        # the engine tries again (every 30 s) and says why it could not
        await until(lambda: b.bridge.refresh().roles.rejoin_error,
                    "the line saying B is not linked")
        roles = b.bridge.last.roles
        assert roles.rejoining and not roles.member
        assert roles.rejoin_error.startswith(  # type: ignore[union-attr]
            f"nothing listens at 127.0.0.1:{port}")
        menu = await read_menu(b.tray.menu)
        assert menu["problem"][0].startswith("Not linked with the fleet: nothing listens")
        assert menu["leave"][1] is True and b.tray.look == "error"
        # another change is saved meanwhile: the fleet stays remembered
        await choose(b.tray.menu, "pause")
        await until(lambda: _paused_saved(home), "the pause saved")
        assert await fleet_saved(home, member=True, head=f"127.0.0.1:{port}")
        # Leave forgets it, and clears the error
        await choose(b.tray.menu, "leave")
        await until(lambda: fleet_saved(home, member=False), "the leave saved")
        roles = b.bridge.refresh().roles
        assert roles.rejoin_error is None and not roles.rejoining
        assert b.problem is None and b.tray.look == "paused"
    finally:
        await b.stop(drain=1)
        await head.stop(drain=1)


async def _paused_saved(home: Path) -> bool:
    return (await config(home)).get("node", {}).get("paused") is True


async def test_a_port_in_use_is_one_line_in_a_dialog_and_the_error_icon(ui_home: Path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        shell = await started(settings_for(ui_home, http=f"127.0.0.1:{port}"))
        try:
            assert shell.phase == "failed" and shell.tray.look == "error"
            [box] = messages()
            assert box.windowTitle() == "Shoal could not start"
            line = box.text()
            assert str(port) in line and "in use" in line and "\n" not in line
            assert "Traceback" not in line
            menu = await read_menu(shell.tray.menu)
            assert menu["status"][0] == "Shoal is not running"
            assert menu["problem"][0] == (line if len(line) <= 90
                                          else line[:89].rstrip() + "…")
            assert menu["quit"][1] and not menu["pause"][1] and not menu["api"][1]
            assert box.informativeText().startswith("Settings has the ports")
            box.close()
            # the window says it too, at the top and where the API and the node would be
            window = shell.window_()
            banner = window.banner  # type: ignore[attr-defined]
            assert not banner.isHidden() and banner.label.text() == (
                f"Shoal is not running: {line}; Settings has the ports; then choose Start "
                "again in Shoal's menu")
            fleet = window.page("fleet")  # type: ignore[attr-defined]
            assert fleet.api_off.text().startswith("Shoal is not running")
            assert fleet.serving.text() == "Not serving: Shoal is not running"
            assert not fleet.api_on.isVisibleTo(window)
        finally:
            await shell.stop(drain=1)
    finally:
        taken.close()


async def test_a_missing_model_offline_is_one_line_too(ui_home: Path):
    from dataclasses import replace

    settings = replace(settings_for(ui_home), offline=True,
                       node=None, head=replace(settings_for(ui_home).head,  # type: ignore[arg-type]
                                               model="org/missing-model:Q4_K_M"))
    shell = await started(settings)
    try:
        assert shell.phase == "failed"
        [box] = messages()
        assert "org/missing-model" in box.text() and "\n" not in box.text()
        # not a port: nothing sends the user to Settings for it
        assert "Settings" not in box.informativeText()
        banner = shell.window_().banner  # type: ignore[attr-defined]
        assert not banner.isHidden() and "Settings" not in banner.label.text()
        box.close()
    finally:
        await shell.stop(drain=1)


async def test_the_first_run_opens_the_welcome_and_later_runs_open_nothing(ui_home: Path):
    shell = await started(settings_for(ui_home), Prefs(welcomed=False))
    try:
        [welcome] = [w for w in visible_windows() if isinstance(w, QDialog)]
        assert welcome is shell.welcome
        welcome.accept()  # the welcome's last step
        await until(lambda: _welcomed(ui_home), "the welcome remembered")
        # something opens after Finish: the window, on the Fleet page (nothing did, and a
        # new user could think the app had quit)
        window = shell.window
        assert window is not None and window.isVisible()
        assert window.current_page == "fleet"  # type: ignore[attr-defined]
    finally:
        await shell.stop(drain=1)
    settings, prefs = await load(ui_home)
    assert prefs.welcomed
    shell = await started(settings, prefs)
    try:
        assert visible_windows() == [] and shell.window is None and shell.welcome is None
    finally:
        await shell.stop(drain=1)


async def _welcomed(home: Path) -> bool:
    try:
        return (await config(home)).get("app", {}).get("welcomed") is True
    except FileNotFoundError:
        return False


async def test_without_a_system_tray_the_window_carries_the_menu(ui_home: Path):
    shell = await started(settings_for(ui_home), system_tray=False)
    try:
        window = shell.window
        assert window is not None and window.isVisible() and shell.tray.icon is None
        [box] = messages()
        assert box.text().startswith("There is no system tray here, so Shoal runs as this "
                                     "window") and "\n" not in box.text()
        box.close()
        [menu] = [a.menu() for a in window.menuBar().actions() if a.menu() is not None
                  and a.text() == "&Shoal"]
        assert menu is shell.tray.menu
        shown = await read_menu(menu)
        assert shown["status"][0] == "Not in a fleet · 1 node ready · 0/2 lanes busy"
        assert shown["api"][2] is True
        await choose(menu, "pause")
        await until(lambda: shell.bridge.refresh().roles.node.state == "paused",  # type: ignore[union-attr]
                    "the node paused from the window's menu")
        await until(lambda: _told(ui_home), "the notice remembered")
        window.close()  # closing the window quits: there is no tray to come back to
        assert shell.quitting.is_set()
    finally:
        await shell.stop(drain=1)
    settings, prefs = await load(ui_home)
    shell = await started(settings, prefs, system_tray=False)
    try:
        assert shell.window is not None and shell.window.isVisible()
        assert messages() == []  # said once
    finally:
        await shell.stop(drain=1)


async def _told(home: Path) -> bool:
    return (await config(home)).get("app", {}).get("told_no_tray") is True


async def test_main_runs_until_quit(ui_home: Path, monkeypatch: pytest.MonkeyPatch):
    save_machine_settings(settings_for(ui_home), {"welcomed": True})
    shells: list[Shell] = []
    real = Shell.start
    monkeypatch.setattr(Shell, "start", lambda self: (shells.append(self), real(self))[1])
    run = asyncio.create_task(main(ui_home, system_tray=True))
    await until(lambda: shells and shells[0].phase == "running", "the app to run")
    await choose(shells[0].tray.menu, "quit")
    assert await asyncio.wait_for(run, 30) == 0
    assert shells[0].tray.icon is None


async def test_main_says_what_is_wrong_with_the_config_and_exits(ui_home: Path):
    (ui_home / "config.toml").write_text('[node]\nlanes = "eight"\n')
    run = asyncio.create_task(main(ui_home, system_tray=True))
    box = await until(lambda: next(iter(messages()), None), "the dialog")
    assert "node.lanes has the wrong type" in box.text() and "\n" not in box.text()
    assert not run.done()  # it waits for the user to read it
    box.accept()
    assert await asyncio.wait_for(run, 10) == 1


async def test_the_welcome_works_while_shoal_is_still_starting(
        ui_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    hold = asyncio.Event()
    real_open = Shoal.open

    order: list[str] = []  # what happened, in order: the command must come after the open
    real_create, real_set_head = Shoal.create_fleet, Shoal.set_head

    async def slow_open(self: Shoal) -> None:  # the model still loading
        await hold.wait()
        await real_open(self)
        order.append("opened")

    async def create_fleet(self: Shoal, name: str | None = None) -> Pairing:
        order.append("create_fleet")
        return await real_create(self, name)

    async def set_head(self: Shoal, on: bool) -> None:  # the command's first step while
        order.append("set_head")                          # the API is not up yet
        await real_set_head(self, on)

    monkeypatch.setattr(Shoal, "open", slow_open)
    monkeypatch.setattr(Shoal, "create_fleet", create_fleet)
    monkeypatch.setattr(Shoal, "set_head", set_head)
    shell = Shell(settings_for(ui_home), Prefs(welcomed=False), system_tray=True)
    shell.start()
    try:
        welcome = await until(lambda: shell.welcome, "the welcome")
        welcome.start_choice.click()
        welcome.fleet_name.setText("desk")
        welcome.start_button.click()
        await until(lambda: shell.bridge._tasks, "the command asked for")
        assert not shell.bridge.refresh().has_token and shell.phase == "starting"
        hold.set()
        await until(lambda: welcome.pairing_view.pairing is not None, "the fleet's code")
        # the command waited for the start instead of racing it: it ran once, after it
        assert order == ["opened", "create_fleet"]
        assert shell.phase == "running" and shell.bridge.refresh().fleet_name == "desk"
        assert not welcome.start_error.isVisible()
        welcome.close()
    finally:
        hold.set()
        await shell.stop(drain=1)
