"""Lending this machine's memory to models split across the fleet, on the Settings page
(issue 33): the box shows what Shoal holds, a click is in force at once on the running
node (a peer's RpcOpen is answered with what it lends, then refused again once the box is
cleared) and lands in config.toml through its one writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.main import Shell
from app.pages.settings import LEND
from engine.node.lending import NotLending, Tunnel
from tests.ui.test_settings_owner import holds, settings_page, tick
from tests.waiting import until

pytestmark = [pytest.mark.timeout(90), pytest.mark.e2e]


async def lends(shell: Shell) -> int | None:
    """What this machine's node says it lends to a peer that asks (None: it lends none)."""
    address = shell.shoal.node_address
    assert address is not None
    tunnel = Tunnel(f"{address[0]}:{address[1]}", None, "a peer")  # loopback: no token
    try:
        await tunnel.open()
    except NotLending:
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
