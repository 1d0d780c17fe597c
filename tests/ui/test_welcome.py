"""The first-run welcome, clicked through as a new user does: start a fleet here (its QR
code, then the model, then the editor settings), or join a fleet by pasting its code; the
way back, and finishing, which remembers that the welcome was done."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.welcome import Welcome
from engine import service
from tests.ui.running import both, bridged, node_only, ready, running, visible
from tests.waiting import until

pytestmark = [pytest.mark.ui, pytest.mark.timeout(90)]


def click(qtbot, widget) -> None:  # type: ignore[no-untyped-def]
    qtbot.mouseClick(widget, Qt.MouseButton.LeftButton)


async def test_start_a_fleet_here_then_the_model_then_the_editor(
        tmp_path: Path, qtbot, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(service, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        welcome = Welcome(ui.bridge)
        welcome.show()
        assert welcome.step == "choose" and not welcome.next.isVisible()
        assert welcome.where.text() == "Step 1 of 4"

        click(qtbot, welcome.start_choice)
        assert welcome.step == "start" and not welcome.next.isEnabled()  # no code yet
        welcome.fleet_name.setText("desk")
        click(qtbot, welcome.start_button)
        await until(lambda: welcome.pairing_view.pairing is not None, "the fleet's code")
        assert visible(welcome.pairing_view) and welcome.next.isEnabled()
        assert welcome.pairing_view.pairing.fleet == "desk"
        assert shoal.snapshot().fleet_name == "desk" and shoal.snapshot().has_token

        click(qtbot, welcome.next)
        assert welcome.step == "model" and welcome.where.text() == "Step 3 of 4"
        assert welcome.current.text() == "Now serving mock-m (serving)."
        click(qtbot, welcome.back)  # back to the code, and on again
        assert welcome.step == "start"
        click(qtbot, welcome.next)
        click(qtbot, welcome.next)
        assert welcome.step == "editor" and welcome.next.text() == "Finish"
        await until(lambda: welcome.editors.base.text() == shoal.api_url, "the base URL")

        assert "welcomed" not in shoal.app_settings
        click(qtbot, welcome.next)
        assert not welcome.isVisible()
        await until(lambda: shoal.app_settings.get("welcomed") is True, "the welcome kept")


async def test_join_a_fleet_by_pasting_its_code(tmp_path: Path, qtbot):
    async with running(both(tmp_path / "a", fleet_listen="127.0.0.1:0")) as head, \
            running(node_only(tmp_path / "b", "laptop")) as joiner, \
            bridged(joiner) as ui:
        await head.create_fleet("desk")
        host, port = head.fleet_address  # type: ignore[misc]
        code = (await head.pairing(head=f"{host}:{port}")).url
        await ready(head)
        welcome = Welcome(ui.bridge)
        welcome.show()
        click(qtbot, welcome.join_choice)
        assert welcome.step == "join"
        assert not welcome.next.isEnabled() and welcome.next.text() == "Next (join first)"
        assert not visible(welcome.found_card)  # no token here yet: joining is by code

        panel = welcome.join_panel
        panel.code.setText("shoal://join?head=127.0.0.1:1&token=00&fleet=x")
        click(qtbot, panel.join_button)
        await until(lambda: panel.error.isVisible(), "the bad code refused")
        assert panel.error.text()[:1].isupper() and "\n" not in panel.error.text()
        assert not welcome.next.isEnabled()

        panel.code.setText(code)
        click(qtbot, panel.join_button)
        await until(lambda: panel.ok.isVisible(), "the join")
        assert panel.ok.text().startswith("Joined “desk”")
        await until(welcome.next.isEnabled, "Next once joined")
        assert welcome.next.text() == "Next"
        click(qtbot, welcome.next)
        assert welcome.step == "model"
        assert welcome.current.text() == "Now serving mock-m (serving)."
        click(qtbot, welcome.next)
        click(qtbot, welcome.next)  # Finish
        assert not welcome.isVisible()
        await until(lambda: joiner.app_settings.get("welcomed") is True, "the welcome kept")
        await until(lambda: head.snapshot().ready_nodes == 2, "the head to see the laptop")
