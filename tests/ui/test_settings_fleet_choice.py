"""Whether the fleet may choose this machine's model, on the Settings page (issue 25): the box
shows what Shoal holds, a click goes to the engine (`Shoal.update_settings`), is in force at
once (not at the next start: tests/integration/test_fleet_chooses_model.py has a head refused
then), and lands in config.toml through its one writer; so does the disk the models the
fleet chose may take (issue 30, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest

from app.main import Shell
from app.pages.settings import FLEET_CHOOSES, FLEET_QUOTA
from engine.sizes import GiB
from tests.ui.test_settings_owner import holds, settings_page, tick
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


async def test_the_box_lets_the_fleet_choose_or_not_at_once(shell: Shell, ui_home: Path):
    page = settings_page(shell)
    box = page.fleet_chooses
    assert box.text() == FLEET_CHOOSES and box.isEnabled() and box.isChecked()
    tick(box)
    await until(lambda: holds(ui_home, "node", "fleet_may_choose_model", False), "off kept")
    node = shell.shoal.settings.node
    assert node is not None and not node.fleet_may_choose_model  # in force, not pending
    assert page.node_saved.text() == "Saved."
    tick(box)
    await until(lambda: holds(ui_home, "node", "fleet_may_choose_model", True), "on kept")
    assert box.isChecked()


async def test_the_fleet_models_quota_is_shown_and_typed_in_at_once(shell: Shell,
                                                                     ui_home: Path):
    page = settings_page(shell)
    field = page.fleet_quota
    assert field.isEnabled() and field.text() == "50%"  # the default: half the disk
    assert FLEET_QUOTA == "Fleet models may use"  # the row a node's refusal names
    field.setFocus()
    field.selectAll()
    QTest.keyClicks(field, "20G")
    QTest.keyClick(field, Qt.Key.Key_Return)
    await until(lambda: holds(ui_home, "node", "fleet_models_quota", "20GiB"), "20G kept")
    node = shell.shoal.settings.node
    assert node is not None and node.fleet_models_quota == 20 * GiB  # in force at once
    assert page.node_saved.text() == "Saved."
    field.selectAll()
    QTest.keyClicks(field, "lots")
    QTest.keyClick(field, Qt.Key.Key_Return)
    assert page.node_error.text().startswith("'lots' is not a limit for the fleet's models")
    await until(lambda: field.text() == "20GiB", "the field shows what Shoal holds")
