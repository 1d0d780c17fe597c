"""The Models page's "On this machine" card: the models kept on this machine's disk (name,
size, who serves each, whether this machine's node holds it in memory now and how much,
when it was last used), the disk they take in all; Load and Unload, which load a model the
node serves into memory or free it (it loads again on the next request); "Once idle", how
long the chosen model stays loaded after its last request (its own default, kept across
restarts, for requests that name no keep_alive); and Remove,
which the engine refuses while a node here serves the model (its line shown under the
table)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from PySide6.QtWidgets import QComboBox, QHeaderView, QLabel, QPushButton, QWidget

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
from engine.sizes import amount, span

if TYPE_CHECKING:
    from engine.models.store import StoredModel
    from engine.snapshot import LocalNodeSnapshot

KEPT_COLUMNS = ("Model", "Size", "Served by", "In memory", "Once idle", "Last used")
# the idle times the card offers (seconds; inf: never unload; None: the node's own)
IDLE_CHOICES: tuple[tuple[str, float | None], ...] = (
    ("the node's idle time", None), ("unload after 5 min", 300.0),
    ("unload after 30 min", 1800.0), ("unload after 2 h", 7200.0),
    ("keep loaded", math.inf), ("unload after each request", 0.0))
SOURCE = {"embedded": "the embedded default", "test": "a test model",
          "imported": "a GGUF file imported by name (shoal models import)",
          "partial": "a download not finished"}


def memory_state(m: StoredModel, node: LocalNodeSnapshot | None) -> tuple[str, str] | None:
    """What this machine's node holds of ``m``: (the model's name on the node, the cell's
    text), or None when the node does not serve it."""
    if node is None:
        return None
    if str(m.path) == node.path:
        held = "on disk (loads on the next request)" if node.sleep == "asleep" else \
            "loading…" if node.sleep == "waking" else f"loaded, {amount(node.model_memory)}"
        return node.model, held
    kept = next((k for k in node.kept if k.name == m.name), None)
    if kept is None:
        return None
    held = {"loaded": f"loaded, {amount(kept.memory)}", "loading": "loading…",
            "unloaded": "on disk (loads on the next request)"}[kept.state]
    return kept.name, held


def idle_text(seconds: float | None) -> str:
    """The "Once idle" cell: what happens to a model once its last request ended."""
    if seconds is None:
        return "node's"
    if math.isinf(seconds):
        return "stays loaded"
    if seconds <= 0:
        return "unloads at once"
    return f"unloads after {span(seconds)}"


def kept_row(m: StoredModel, now: float,
             node: LocalNodeSnapshot | None = None) -> tuple[Cell, ...]:
    served = ", ".join(m.served_by)
    used = "never" if m.last_used is None else ago(now - m.last_used)
    state = memory_state(m, node)
    held = Cell(state[1], tone="" if state[1].startswith("loaded") else "muted") \
        if state is not None else Cell("—", tone="muted")
    return (Cell(m.name, tip=SOURCE.get(m.source, m.spec)), Cell(amount(m.size), right=True),
            Cell(served or "—", tone="" if served else "muted"), held,
            Cell(idle_text(m.keep_alive_s), tone="muted" if m.keep_alive_s is None else ""),
            Cell(used))


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
        self.node: LocalNodeSnapshot | None = None
        self._held: tuple[object, ...] = ()
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
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("loadModel")
        self.load_button.setToolTip("Load the chosen model into this machine's memory now, "
                                    "as its first request would")
        self.load_button.clicked.connect(lambda: self.load_selected(load=True))
        self.unload_button = QPushButton("Unload")
        self.unload_button.setObjectName("unloadModel")
        self.unload_button.setToolTip("Free the memory the chosen model holds; it loads "
                                      "again on the next request for it")
        self.unload_button.clicked.connect(lambda: self.load_selected(load=False))
        self.idle = QComboBox()
        self.idle.setObjectName("keepAlive")
        self.idle.setToolTip("How long the chosen model stays loaded after its last request "
                             "(a request's own keep_alive still wins for it)")
        for text, _seconds in IDLE_CHOICES:
            self.idle.addItem(text[:1].upper() + text[1:])
        self.idle.activated.connect(self.set_idle)  # a person's choice only
        self.view.selectionModel().selectionChanged.connect(self._show_idle)
        line = self.row()
        line.addWidget(self.total, 1)
        line.addWidget(QLabel("Once idle:"))
        line.addWidget(self.idle)
        line.addWidget(self.load_button)
        line.addWidget(self.unload_button)
        line.addWidget(self.remove_button)
        self.error = inline_error()
        self.ok = ok_line()
        self.add(self.error)
        self.add(self.ok)

    def show_node(self, node: LocalNodeSnapshot | None) -> None:
        """This machine's node as the last snapshot has it: which models it holds."""
        held = (None,) if node is None else (node.path, node.sleep, node.model_memory,
                                              node.kept)
        self.node = node
        if held != self._held:  # the table is built again only when that changed
            self._held = held
            self.show_kept(self.kept)

    def show_kept(self, kept: list[StoredModel]) -> None:
        self.kept = kept
        now = time.time()
        before = list(self.rows.keys)
        self.rows.set_rows([(m.name, kept_row(m, now, self.node)) for m in kept])
        fit_rows(self.view, len(kept), least=1, most=6)
        if self.rows.keys != before:  # Qt sizes these columns again only when told so
            header = self.view.horizontalHeader()
            for column in range(1, len(KEPT_COLUMNS)):
                header.setSectionResizeMode(column, QHeaderView.ResizeMode.Interactive)
                header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        self.total.setText(total_line(kept))
        self.remove_button.setEnabled(bool(kept))
        served = any(memory_state(m, self.node) is not None for m in kept)
        self.load_button.setEnabled(served)
        self.unload_button.setEnabled(served)
        self.idle.setEnabled(bool(kept))
        self._show_idle()

    def select(self, name: str) -> None:
        self.view.selectRow(self.rows.keys.index(name))

    def _chosen(self) -> StoredModel | None:
        rows = self.view.selectionModel().selectedRows()
        return self.kept[rows[0].row()] if rows and rows[0].row() < len(self.kept) else None

    def _show_idle(self) -> None:
        """The combo shows the chosen model's idle time (the node's where none is chosen)."""
        chosen = self._chosen()
        seconds = chosen.keep_alive_s if chosen is not None else None
        index = next((i for i, (_t, s) in enumerate(IDLE_CHOICES) if s == seconds), -1)
        if index < 0:  # one set elsewhere (`shoal models keep-alive NAME 45m`)
            self.idle.setCurrentIndex(-1)
            self.idle.setPlaceholderText(idle_text(seconds))
        else:
            self.idle.setCurrentIndex(index)

    def set_idle(self, index: int) -> None:
        """The chosen model's idle time from now on (the combo's ``index``)."""
        chosen = self._chosen()
        if chosen is None:
            say(self.ok, "")
            say(self.error, "Choose a model in the table first.")
            self._show_idle()
            return
        seconds = IDLE_CHOICES[index][1]

        def done(line: str) -> None:
            say(self.error, "")
            say(self.ok, line[:1].upper() + line[1:] + ".")
            self._changed()

        def refused(line: str) -> None:
            say(self.ok, "")
            say(self.error, line)

        run(self, self._bridge, self._bridge.shoal.set_keep_alive(chosen.name, seconds),
            done=done, failed=refused)

    def load_selected(self, *, load: bool) -> None:
        """Load (or unload) the chosen model on this machine's node."""
        chosen = self._chosen()
        state = memory_state(chosen, self.node) if chosen is not None else None
        if chosen is None or state is None:
            say(self.ok, "")
            say(self.error, "Choose a model this machine serves in the table first." if
                chosen is None else f"This machine's node does not serve {chosen.name}; "
                "serve every kept model with Serve kept models in Settings, or "
                "`shoal serve --serve-kept`.")
            return
        shoal = self._bridge.shoal
        name = state[0]
        say(self.error, "")
        say(self.ok, f"Loading {name}…" if load else "")

        def done(line: str) -> None:
            say(self.error, "")
            say(self.ok, line[:1].upper() + line[1:] + ".")

        def refused(line: str) -> None:
            say(self.ok, "")
            say(self.error, line)

        work = shoal.load_model(name) if load else shoal.unload_model(name)
        run(self, self._bridge, work, done=done, failed=refused)

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
