"""The Join dialog: joining another machine's fleet by pasting its URL or opening a picture
of its QR code, the engine's one line for a wrong or stale code, and no camera here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog

from app import join as join_module
from app.join import NO_MULTIMEDIA, JoinDialog, camera_state, open_join_dialog
from engine.service import Pairing, Shoal
from tests.ui.running import both, bridged, node_only, ready, running
from tests.waiting import until

pytestmark = [pytest.mark.ui, pytest.mark.timeout(90)]


@dataclass
class TwoMachines:
    head: Shoal  # the fleet's first machine
    joiner: Shoal  # this machine: a node that joins
    pairing: Pairing


@contextlib.asynccontextmanager
async def two_machines(tmp_path: Path) -> AsyncIterator[TwoMachines]:
    async with running(both(tmp_path / "a", fleet_listen="127.0.0.1:0")) as head, \
            running(node_only(tmp_path / "b", "laptop")) as joiner:
        await head.create_fleet("desk")
        host, port = head.fleet_address  # type: ignore[misc]
        yield TwoMachines(head, joiner, await head.pairing(head=f"{host}:{port}"))


def the_dialog() -> JoinDialog:
    [dialog] = [d for d in join_module._open if isinstance(d, JoinDialog)]
    return dialog


async def test_join_by_pasting_the_url(tmp_path: Path, qtbot):
    async with two_machines(tmp_path) as m, bridged(m.joiner) as ui:
        await ready(m.head)
        open_join_dialog(ui.bridge, None)
        dialog = the_dialog()
        assert dialog.isVisible() and dialog.windowTitle() == "Join a fleet"
        panel = dialog.panel
        qtbot.mouseClick(panel.join_button, Qt.MouseButton.LeftButton)
        assert panel.error.text().startswith("Paste the join URL first")
        panel.code.setText(m.pairing.url)
        qtbot.mouseClick(panel.join_button, Qt.MouseButton.LeftButton)
        assert panel.busy and not panel.join_button.isEnabled()
        await until(lambda: panel.ok.isVisible() or panel.error.isVisible(), "the join")
        assert panel.ok.text().startswith("Joined “desk”: linked with 1 head;"), \
            panel.error.text()
        assert m.joiner.snapshot().roles.member
        await until(lambda: m.head.snapshot().ready_nodes == 2, "the head to see the node")
        assert dialog.close_button.text() == "Done" and panel.code.text() == ""
        qtbot.mouseClick(dialog.close_button, Qt.MouseButton.LeftButton)
        assert not dialog.isVisible() and not join_module._open


async def test_join_by_opening_a_picture_of_the_qr_code(tmp_path: Path, qtbot):
    async with two_machines(tmp_path) as m, bridged(m.joiner) as ui:
        picture = tmp_path / "code.png"
        await asyncio.to_thread(picture.write_bytes, m.pairing.png)
        dialog = JoinDialog(ui.bridge)
        dialog.show()
        panel = dialog.panel
        qtbot.mouseClick(panel.image_button, Qt.MouseButton.LeftButton)
        chooser = panel.findChild(QFileDialog, "chooseFile")
        assert chooser is not None and chooser.isVisible()
        chooser.selectFile(str(picture))
        chooser.accept()
        await until(lambda: panel.ok.isVisible() or panel.error.isVisible(), "the join")
        assert panel.ok.text().startswith("Joined “desk”"), panel.error.text()
        await until(lambda: m.head.snapshot().ready_nodes == 2, "the head to see the node")
        dialog.close()


async def test_a_wrong_or_stale_code_shows_the_engines_one_line(tmp_path: Path, qtbot):
    async with two_machines(tmp_path) as m, bridged(m.joiner) as ui:
        dialog = JoinDialog(ui.bridge)
        dialog.show()
        panel = dialog.panel
        for wrong in ("shoal://join?head=127.0.0.1:1", "not a code at all"):
            panel.code.setText(wrong)
            qtbot.mouseClick(panel.join_button, Qt.MouseButton.LeftButton)
            await until(lambda: not panel.busy, "the refusal")
            line = panel.error.text()
            assert panel.error.isVisible() and line and "\n" not in line
            assert "Traceback" not in line and not panel.ok.isVisible()
        # a code made before the token was rotated is refused by the head
        old = (await m.head.fleet_token()).hex()
        fresh = await m.head.rotate_token()
        host, port = m.head.fleet_address  # type: ignore[misc]
        fresh = await m.head.pairing(head=f"{host}:{port}")
        new = (await m.head.fleet_token()).hex()
        panel.code.setText(fresh.url.replace(new, old))
        qtbot.mouseClick(panel.join_button, Qt.MouseButton.LeftButton)
        await until(lambda: not panel.busy, "the refusal of the stale code", timeout=30)
        assert panel.error.isVisible() and "token" in panel.error.text()
        # the fix is the app's own, not a terminal command
        assert panel.error.text().endswith("pair again: open Shoal's Pairing page on that "
                                           "machine and use its code here"), panel.error.text()
        assert "`shoal" not in panel.error.text()
        assert not m.joiner.snapshot().roles.member
        dialog.close()


async def test_without_qt_multimedia_the_camera_says_so(tmp_path: Path):
    async with running(node_only(tmp_path, "laptop")) as shoal, bridged(shoal) as ui:
        dialog = JoinDialog(ui.bridge)
        dialog.show()
        panel = dialog.panel
        assert camera_state() == (False, NO_MULTIMEDIA)  # PySide6-Essentials
        assert not panel.camera_button.isEnabled()
        assert panel.camera_note.isVisible() and panel.camera_note.text() == NO_MULTIMEDIA
        panel.scan()  # asked anyway: the same line, no scanner
        assert panel.scanner is None and panel.camera_note.text() == NO_MULTIMEDIA
        dialog.close()
