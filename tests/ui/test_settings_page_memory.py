"""How this machine's node holds its model, chosen on the Settings page: the memory Shoal may
use, the KV cache's type, the GPU and when an idle model unloads. Each choice goes to the engine
(`Shoal.update_settings`), lands in config.toml through its one writer, and waits for the
node's next start, as the page says (issue 23)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QComboBox

from app.main import Shell
from app.pages.settings import NODE_NOTE
from engine.runtimes.mock import MockEngine
from engine.settings import Settings
from engine.sizes import GiB, Share, amount
from tests.ui.conftest import MODEL, started
from tests.ui.test_settings_owner import holds, settings_page, stored
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def pick(box: QComboBox, text: str) -> None:
    """Choose the item ``text`` with the keyboard, as a person does on a closed box."""
    want = box.findText(text)
    assert want >= 0, f"no {text!r} in {[box.itemText(i) for i in range(box.count())]}"
    assert box.isEnabled()
    box.setFocus()
    key = Qt.Key.Key_Down if want > box.currentIndex() else Qt.Key.Key_Up
    while box.currentIndex() != want:
        QTest.keyClick(box, key)


async def test_each_choice_lands_in_config_toml_for_the_nodes_next_start(
        shell: Shell, ui_home: Path):
    page = settings_page(shell)
    shoal = shell.shoal
    mem = shoal.memory
    assert mem.total > mem.default_budget > 0
    assert page.budget.currentText() == (f"Default: {amount(mem.default_budget)} of "
                                         f"{amount(mem.total)}")
    assert page.kv.currentText() == "f16 (full quality)"
    assert page.idle.currentText() == "after 15 minutes"

    pick(page.budget, "1 GiB")
    await until(lambda: holds(ui_home, "node", "memory_budget", "1GiB"), "the budget kept")
    await until(lambda: page.node_saved.text() == NODE_NOTE, "the note")
    assert shoal.pending.node is not None and shoal.pending.node.memory_budget == GiB
    assert shoal.settings.node is not None and shoal.settings.node.memory_budget is None

    pick(page.kv, "q8_0 (half the memory, more context)")
    await until(lambda: holds(ui_home, "node", "kv_type", "q8_0"), "the KV type kept")
    pick(page.idle, "never")
    await until(lambda: holds(ui_home, "node", "idle_unload", "never"), "never unload kept")
    pick(page.idle, "after 5 minutes")
    await until(lambda: holds(ui_home, "node", "idle_unload", 5), "five minutes kept")
    assert page.budget.currentText() == "1 GiB"  # shown again as Shoal holds it
    assert page.kv.currentText().startswith("q8_0")

    pick(page.budget, page.budget.itemText(0))  # the default share again: nothing to keep
    await until(lambda: stored(ui_home), "the file")
    await until(lambda: _absent(ui_home, "memory_budget"), "the budget gone from the file")
    node = shoal.pending.node
    assert node is not None
    assert (node.memory_budget, node.kv_type, node.idle_unload_s) == (None, "q8_0", 300.0)


async def _absent(home: Path, key: str) -> bool:
    node = (await stored(home)).get("node", {})
    return "kv_type" in node and key not in node


async def test_the_node_takes_them_when_it_serves_another_model(shell: Shell, ui_home: Path):
    page = settings_page(shell)
    pick(page.kv, "q8_0 (half the memory, more context)")
    await until(lambda: page.node_saved.text() == NODE_NOTE, "saved for the next start")
    await shell.shoal.set_model(MODEL, runtime="mock")
    node = shell.shoal.settings.node
    assert node is not None and node.kv_type == "q8_0"  # in force now
    pick(page.idle, "after 60 minutes")
    await until(lambda: holds(ui_home, "node", "idle_unload", 60), "an hour kept")
    assert page.node_saved.text() == NODE_NOTE


async def test_a_budget_from_the_file_shows_as_it_was_written(mock_settings: Settings,
                                                             ui_home: Path):
    assert mock_settings.node is not None
    node = replace(mock_settings.node, memory_budget=Share(50.0), idle_unload_s=2700.0)
    app = await started(replace(mock_settings, node=node))
    try:
        page = settings_page(app)
        total = app.shoal.memory.total
        assert page.budget.currentText() == \
            f"50% of this machine's RAM ({amount(total // 2)})"
        assert page.idle.currentText() == "after 45 minutes"
        pick(page.idle, "after 30 minutes")
        await until(lambda: holds(ui_home, "node", "idle_unload", 30), "half an hour kept")
        assert (await stored(ui_home))["node"]["memory_budget"] == "50%"
    finally:
        await app.stop(drain=1)


async def test_the_gpu_is_chosen_or_typed_for_the_nodes_next_start(
        shell: Shell, ui_home: Path, monkeypatch: pytest.MonkeyPatch):
    page = settings_page(shell)
    shoal = shell.shoal
    box = page.gpu
    assert box.isEditable() and box.currentText() == "Automatic"
    assert "next start" in box.toolTip()
    assert [box.itemText(i) for i in range(box.count())] == ["Automatic", "CPU only"]

    pick(box, "CPU only")
    await until(lambda: holds(ui_home, "node", "gpu", "off"), "CPU only kept")
    await until(lambda: page.node_saved.text() == NODE_NOTE, "the note")
    assert shoal.pending.node is not None and shoal.pending.node.gpu == "off"
    assert shoal.settings.node is not None and shoal.settings.node.gpu == "auto"

    # the node's engine says the device its model runs on: its name is offered
    stats = MockEngine.stats
    monkeypatch.setattr(MockEngine, "stats", lambda engine: replace(
        stats(engine), device="Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))", gpu_layers=31,
        model_layers=31))
    await until(lambda: box.findText("Vulkan0") >= 0, "the device offered")
    assert box.currentText() == "CPU only"  # still as chosen
    pick(box, "Vulkan0")
    await until(lambda: holds(ui_home, "node", "gpu", "Vulkan0"), "the device kept")

    line = box.lineEdit()
    assert line is not None
    box.setFocus()
    line.selectAll()
    QTest.keyClicks(line, "RTX 4070")  # part of a device's description, as --gpu takes it
    QTest.keyClick(line, Qt.Key.Key_Return)
    await until(lambda: holds(ui_home, "node", "gpu", "RTX 4070"), "the typed name kept")
    await until(lambda: box.findText("RTX 4070") >= 0, "the typed name offered")
    assert shoal.pending.node is not None and shoal.pending.node.gpu == "RTX 4070"

    line.selectAll()
    QTest.keyClick(line, Qt.Key.Key_Backspace)
    QTest.keyClick(line, Qt.Key.Key_Return)  # nothing typed: nothing changes
    assert box.currentText() == "RTX 4070"
    assert shoal.pending.node.gpu == "RTX 4070"
