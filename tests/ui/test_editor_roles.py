"""Every role an editor has, from one machine, driven as a person would: the Models page
says which served model makes embeddings; in Connect your editor the embedding model is
no chat model, and the Continue snippet a person copies has a chat, an autocomplete and an
embed model with no warning, until the fill-in-the-middle model goes away.

Shoal runs in process on the mock runtime (one machine, its own node); the models its node
would keep beside the mock one are added to the snapshots it publishes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app.editors import NO_FIM
from app.pages.models import MODEL_COLUMNS
from app.window import MainWindow
from engine.snapshot import FleetSnapshot, ModelSnapshot
from tests.ui.running import MODEL, both, bridged, ready, running, visible
from tests.waiting import until

pytestmark = [pytest.mark.ui, pytest.mark.timeout(60)]
CODER = ModelSnapshot("qwen2.5-coder-1.5b", True, 32768, tools=False, fill_in_middle=True)
VECTORS = ModelSnapshot("all-minilm-l6-v2", True, 512, tools=False, fill_in_middle=False,
                        embeddings=True)


def cell(rows, key: str, column: str) -> str:  # type: ignore[no-untyped-def]
    return rows.rows[rows.keys.index(key)][MODEL_COLUMNS.index(column)].text


async def test_continue_gets_chat_autocomplete_and_embed_from_one_machine(
        tmp_path: Path, qtbot, monkeypatch):  # type: ignore[no-untyped-def]
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        extra = [CODER, VECTORS]
        published = shoal.snapshot

        def snapshot() -> FleetSnapshot:
            snap = published()
            return replace(snap, models=(*snap.models, *extra))

        monkeypatch.setattr(shoal, "snapshot", snapshot)
        assert len(ui.bridge.refresh().nodes) == 1  # one machine
        window = MainWindow(ui.bridge)
        window.show()

        # the Models page: which served model makes embeddings
        window.show_page("models")
        rows = window.models.models
        await until(lambda: VECTORS.name in rows.keys, "the embedding model listed")
        assert cell(rows, VECTORS.name, "Embeddings") == "yes"
        assert cell(rows, CODER.name, "Embeddings") == "no"
        assert cell(rows, CODER.name, "Fill-in-the-middle") == "yes"
        assert cell(rows, MODEL, "Embeddings") == "no"

        # Connect your editor: the embedding model is offered to no chat
        window.show_page("editors")
        panel = window.editors
        offered = [panel.chat.itemData(i) for i in range(panel.chat.count())]
        assert offered == [MODEL, CODER.name]
        panel.chat.setCurrentIndex(panel.chat.findData(CODER.name))
        bar = panel.tabs.tabBar()
        tab = list(panel.views).index("Continue")
        qtbot.mouseClick(bar, Qt.MouseButton.LeftButton, pos=bar.tabRect(tab).center())
        assert panel.tabs.currentIndex() == tab
        view = panel.views["Continue"]
        qtbot.mouseClick(view.copy, Qt.MouseButton.LeftButton)
        config = yaml.safe_load(QGuiApplication.clipboard().text())
        roles = {role: [m["model"] for m in config["models"] if role in m["roles"]]
                 for role in ("chat", "autocomplete", "embed")}
        assert roles == {"chat": [CODER.name, MODEL], "autocomplete": [CODER.name],
                         "embed": [VECTORS.name]}
        assert all(m["apiBase"] == shoal.api_url for m in config["models"])
        assert not visible(view.warning)

        # the FIM model goes away: no autocomplete, and the warning says so
        extra.remove(CODER)
        ui.bridge.refresh()
        await until(lambda: visible(view.warning), "the no-FIM warning")
        assert view.warning.text() == NO_FIM
        config = yaml.safe_load(panel.snippet_text("Continue"))
        assert [m["roles"] for m in config["models"]] == [["chat", "edit", "apply"],
                                                          ["embed"]]
