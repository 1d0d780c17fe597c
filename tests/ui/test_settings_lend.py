"""Lending this machine's memory to models split across the fleet, on the Settings page
(issue 33): the box shows what Shoal holds, a click is in force at once on the running
node (a peer's RpcOpen is answered with what it lends, then refused again once the box is
cleared) and lands in config.toml through its one writer. Its companion, lending on battery
power too, is offered only while the machine lends and is in force at once as well."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.main import Shell
from app.pages.settings import LEND, LEND_ON_BATTERY
from engine.node.lending import NotLending, Tunnel
from tests.ui.test_settings_owner import holds, settings_page, tick
from tests.waiting import until

pytestmark = [pytest.mark.timeout(90), pytest.mark.e2e]


refusals: list[str] = []


async def lends(shell: Shell) -> int | None:
    """What this machine's node says it lends to a peer that asks (None: it lends none)."""
    address = shell.shoal.node_address
    assert address is not None
    tunnel = Tunnel(f"{address[0]}:{address[1]}", None, "a peer")  # loopback: no token
    try:
        await tunnel.open()
    except NotLending as exc:
        refusals.append(str(exc))
        return None
    finally:
        await tunnel.close()
    return tunnel.lend_bytes


async def test_the_box_lends_this_machines_memory_at_once(shell: Shell, ui_home: Path):
    page = settings_page(shell)
    box = page.lend
    assert box.text() == LEND and box.isEnabled() and not box.isChecked()
    assert await lends(shell) is None
    tick(box)
    await until(lambda: holds(ui_home, "node", "lend", True), "on kept")
    node = shell.shoal.settings.node
    assert node is not None and node.lend  # in force, not pending
    assert page.node_saved.text() == "Saved."
    lent = await lends(shell)
    assert lent is not None and lent > 0
    tick(box)
    await until(lambda: holds(ui_home, "node", "lend", False), "off kept")
    assert await lends(shell) is None


async def test_on_battery_the_machine_lends_only_once_its_owner_ticks_the_battery_box(
        shell: Shell, ui_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from tests.unit.test_power import supply

    power = tmp_path / "power_supply"  # this machine is a laptop off its charger
    supply(power, "AC", type="Mains", online="0")
    supply(power, "BAT0", type="Battery", present="1")
    monkeypatch.setenv("SHOAL_POWER_SUPPLY", str(power))
    page = settings_page(shell)
    battery = page.lend_on_battery
    assert battery.text() == LEND_ON_BATTERY and not battery.isChecked()
    assert not battery.isEnabled()  # nothing to qualify while the machine lends nothing
    tick(page.lend)
    await until(lambda: battery.isEnabled(), "the battery box offered once it lends")
    refusals.clear()
    assert await lends(shell) is None
    assert refusals and "runs on its battery" in refusals[0]
    tick(battery)
    await until(lambda: holds(ui_home, "node", "lend_on_battery", True), "on battery kept")
    node = shell.shoal.settings.node
    assert node is not None and node.lend_on_battery  # in force, not pending
    lent = await lends(shell)
    assert lent is not None and lent > 0
    tick(page.lend)
    await until(lambda: not battery.isEnabled(), "the battery box withdrawn with lending")
    assert battery.isChecked()  # kept for the next time it lends
