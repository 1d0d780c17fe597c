"""The Models page's "On this machine" card: the models kept on this machine's disk (name,
size, who serves each, when it was last used), the disk they take in all, and Remove,
which the engine refuses while a node here serves the model (its line shown under the
table)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from PySide6.QtWidgets import QHeaderView, QPushButton, QWidget

from app.bridge import ShoalBridge
from app.widgets import (
    Card,
    Cell,
    RowsModel,
    ago,
    fit_rows,
    inline_error,
    note,
    ok_line,
    run,
    say,
    table,
)
from engine.sizes import amount

if TYPE_CHECKING:
    from engine.models.store import StoredModel

KEPT_COLUMNS = ("Model", "Size", "Served by", "Last used")
SOURCE = {"embedded": "the embedded default", "test": "a test model",
          "imported": "a GGUF file imported by name (shoal models import)",
          "partial": "a download not finished"}


def kept_row(m: StoredModel, now: float) -> tuple[Cell, ...]:
    served = ", ".join(m.served_by)
    used = "never" if m.last_used is None else ago(now - m.last_used)
    return (Cell(m.name, tip=SOURCE.get(m.source, m.spec)), Cell(amount(m.size), right=True),
            Cell(served or "—", tone="" if served else "muted"), Cell(used))


def total_line(kept: list[StoredModel]) -> str:
    if not kept:
        return "No models are kept on this machine yet."
    models = "1 model" if len(kept) == 1 else f"{len(kept)} models"
    return f"{models}, {amount(sum(m.size for m in kept))} on disk in all."


class KeptCard(Card):
    """Renders ``shoal.models.kept()``; ``changed`` is called after a removal."""

    def __init__(self, bridge: ShoalBridge, changed: Callable[[], None],
                 parent: QWidget | None = None) -> None:
        super().__init__("On this machine", parent)
        self._bridge = bridge
        self._changed = changed
        self.kept: list[StoredModel] = []
        self.rows = RowsModel(KEPT_COLUMNS, self)
        self.view = table(self.rows, stretch=0)
        self.view.setObjectName("keptModels")
        self.add(self.view)
        self.total = note("")
        self.total.setObjectName("keptTotal")
        self.remove_button = QPushButton("Remove")
        self.remove_button.setObjectName("removeModel")
        self.remove_button.setToolTip("Delete the chosen model's files from this machine")
        self.remove_button.clicked.connect(self.remove_selected)
        line = self.row()
        line.addWidget(self.total, 1)
        line.addWidget(self.remove_button)
        self.error = inline_error()
        self.ok = ok_line()
        self.add(self.error)
        self.add(self.ok)

    def show_kept(self, kept: list[StoredModel]) -> None:
        self.kept = kept
        now = time.time()
        before = list(self.rows.keys)
        self.rows.set_rows([(m.name, kept_row(m, now)) for m in kept])
        fit_rows(self.view, len(kept), least=1, most=6)
        if self.rows.keys != before:  # Qt sizes these columns again only when told so
            header = self.view.horizontalHeader()
            for column in range(1, len(KEPT_COLUMNS)):
                header.setSectionResizeMode(column, QHeaderView.ResizeMode.Interactive)
                header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        self.total.setText(total_line(kept))
        self.remove_button.setEnabled(bool(kept))

    def select(self, name: str) -> None:
        self.view.selectRow(self.rows.keys.index(name))

    def remove_selected(self) -> None:
        rows = self.view.selectionModel().selectedRows()
        if not rows:
            say(self.ok, "")
            say(self.error, "Choose a model in the table first.")
            return
        name = self.rows.key_at(rows[0].row())
        models = self._bridge.shoal.models

        def removed(gone: StoredModel) -> None:
            say(self.error, "")
            say(self.ok, f"Removed {gone.name}: {amount(gone.size)} freed.")
            self._changed()

        def refused(line: str) -> None:
            say(self.ok, "")
            say(self.error, line)

        run(self, self._bridge, models.remove(name), done=removed, failed=refused)
