"""Models and aliases: the model this machine serves, chosen from the catalog with its fit on
each machine of the fleet (app/pages/catalog.py), the split suggested for the fleet
(app/pages/fleet_split.py), the models kept on this machine (app/pages/kept_models.py),
what the fleet serves, and the fleet-wide alias table (set, remove, revert, history, with
fallbacks).

The catalog's fits and the kept models are asked of the engine when the page opens, when
the fleet's machines or their models change, and after a pull or a removal; never on the
once-a-second snapshot alone."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from PySide6.QtCore import QItemSelection, Qt
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.pages.catalog import CatalogCard
from app.pages.fleet_split import SplitCard
from app.pages.kept_models import KeptCard
from app.pages.serve_model import ServeModel
from app.widgets import (
    Card,
    Cell,
    PageHeader,
    RowsModel,
    fit_rows,
    inline_error,
    note,
    ok_line,
    page_layout,
    run,
    say,
    table,
    tokens,
)
from engine.events import PullProgress, ShoalEvent
from engine.snapshot import AliasSnapshot, FleetSnapshot, ModelSnapshot

if TYPE_CHECKING:
    from engine.models.commands import FleetFits
    from engine.models.store import StoredModel

T = TypeVar("T")
MODEL_COLUMNS = ("Model", "Serving", "Context", "Tools", "Fill-in-the-middle", "Embeddings")
ALIAS_COLUMNS = ("Alias", "Target", "Fallbacks", "Answers with", "State", "Version")
HISTORY_COLUMNS = ("Version", "Target", "Fallbacks", "When", "Made at head")
STATE_TONE = {"ok": "good", "fallback": "warn", "unavailable": "bad", "shadowed": "warn"}
NO_HEAD = ("The API is off on this machine; aliases live on heads, so turn it on to see or "
           "change them here.")


def yes(flag: bool) -> Cell:
    return Cell("yes" if flag else "no", tone="" if flag else "muted")


def model_row(m: ModelSnapshot) -> tuple[Cell, ...]:
    return (Cell(m.name), Cell("yes" if m.served else "no node", tone="" if m.served else "warn"),
            Cell(tokens(m.context_window) if m.context_window else "—", right=True),
            yes(m.tools), yes(m.fill_in_middle), yes(m.embeddings))


def alias_row(a: AliasSnapshot) -> tuple[Cell, ...]:
    return (Cell(a.name), Cell(a.target or "—"), Cell(", ".join(a.fallbacks) or "—"),
            Cell(a.resolves_to or "nothing now", tone="" if a.resolves_to else "bad"),
            Cell(a.state, tone=STATE_TONE.get(a.state, "")),
            Cell(str(a.version), right=True))


def fallbacks_of(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.replace(";", ",").split(",") if part.strip())


class HistoryDialog(QDialog):
    """Every version of one alias, newest first."""

    def __init__(self, name: str, entries: list[Any], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("aliasHistory")
        self.setWindowTitle(f"History of {name}")
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        layout = QVBoxLayout(self)
        self.rows = RowsModel(HISTORY_COLUMNS, self)
        rows = []
        for e in sorted(entries, key=lambda e: e.version, reverse=True):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.updated_at))
            rows.append((str(e.version), (
                Cell(str(e.version), right=True), Cell(e.target or "removed",
                                                       tone="" if e.target else "muted"),
                Cell(", ".join(e.fallbacks) or "—"), Cell(when), Cell(e.origin))))
        self.rows.set_rows(rows)
        view = table(self.rows, stretch=1)
        layout.addWidget(view)
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignRight)
        self.resize(620, 320)


class Reload:
    """One engine query at a time for a page: asked again while one runs, it runs once more
    when that one ends (the latest answer wins)."""

    def __init__(self, owner: QWidget, bridge: ShoalBridge, ask: Callable[[], Awaitable[T]],
                 done: Callable[[T], None], failed: Callable[[str], None]) -> None:
        self._owner, self._bridge, self._ask = owner, bridge, ask
        self._done, self._failed = done, failed
        self._running = self._pending = False

    def again(self) -> None:
        if self._running:
            self._pending = True
            return
        self._running, self._pending = True, False
        run(self._owner, self._bridge, self._ask(), done=self._ended(self._done),
            failed=self._ended(self._failed))

    def _ended(self, then: Callable[[Any], None]) -> Callable[[Any], None]:
        def ended(value: Any) -> None:
            self._running = False
            then(value)
            if self._pending:
                self.again()
        return ended


class ModelsPage(QWidget):
    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        layout = page_layout(self)
        layout.addWidget(PageHeader("Models and aliases",
                                    "The model each machine serves, the models kept here, "
                                    "and the names your editors use."))

        self.serve = ServeModel(bridge)
        self.catalog = CatalogCard(self.serve, bridge)
        self.current = QLabel()
        self.current.setObjectName("currentModel")
        self.catalog.body.insertWidget(1, self.current)
        layout.addWidget(self.catalog)
        self.split = SplitCard(bridge)
        layout.addWidget(self.split)
        self.kept = KeptCard(bridge, changed=self.reload)
        layout.addWidget(self.kept)
        self._fits = Reload(self, bridge, lambda: bridge.shoal.models.fits(), self._fitted,
                            self.catalog.show_failure)
        self._kept = Reload(self, bridge, lambda: bridge.shoal.models.kept(), self._listed,
                            lambda line: say(self.kept.error, line))
        self._seen: tuple[object, ...] | None = None
        self.serve.served.connect(lambda _name: self.reload())
        bridge.event.connect(self._event)

        served = Card("Served models")
        self.models = RowsModel(MODEL_COLUMNS, self)
        self.model_view = table(self.models, stretch=0)
        self.model_view.setObjectName("models")
        served.add(self.model_view)
        layout.addWidget(served)

        aliases = Card("Aliases")
        aliases.add(note("An alias is a name for a model, shared by every head of the fleet; "
                         "fallbacks answer when no node serves the target."))
        self.no_head = note(NO_HEAD)
        aliases.add(self.no_head)
        self.aliases = RowsModel(ALIAS_COLUMNS, self)
        self.alias_view = table(self.aliases, stretch=1)
        self.alias_view.setObjectName("aliases")
        self.alias_view.selectionModel().selectionChanged.connect(self._picked)
        aliases.add(self.alias_view)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.name = QLineEdit()
        self.name.setObjectName("aliasName")
        self.name.setPlaceholderText("coder")
        self.target = QComboBox()
        self.target.setObjectName("aliasTarget")
        self.target.setEditable(True)
        self.fallbacks = QLineEdit()
        self.fallbacks.setObjectName("aliasFallbacks")
        self.fallbacks.setPlaceholderText("other models, in order, separated by commas")
        form.addRow("Name", self.name)
        form.addRow("Target", self.target)
        form.addRow("Fallbacks", self.fallbacks)
        aliases.body.addLayout(form)
        self.set_button = QPushButton("Set alias")
        self.set_button.setObjectName("setAlias")
        self.set_button.clicked.connect(self.set_alias)
        self.remove_button = QPushButton("Remove")
        self.remove_button.clicked.connect(lambda: self._change("remove"))
        self.revert_button = QPushButton("Revert")
        self.revert_button.setToolTip("Back to the version before the last change")
        self.revert_button.clicked.connect(lambda: self._change("revert"))
        self.history_button = QPushButton("History…")
        self.history_button.clicked.connect(self.show_history)
        aliases.row(self.set_button, self.remove_button, self.revert_button,
                    self.history_button, None)
        self.alias_error = inline_error()
        self.alias_ok = ok_line()
        aliases.add(self.alias_error)
        aliases.add(self.alias_ok)
        self.alias_card = aliases
        layout.addWidget(aliases)

        layout.addStretch(1)
        self.history: HistoryDialog | None = None
        bridge.snapshot.connect(self.render)
        self.render(bridge.last)

    def reload(self) -> None:
        """Ask the engine again for the catalog's fits and the models kept here."""
        self._fits.again()
        self._kept.again()

    def _fitted(self, fits: FleetFits) -> None:
        self.catalog.show_fits(fits)
        self.split.show_split(fits)

    def _listed(self, kept: list[StoredModel]) -> None:
        self.kept.show_kept(kept)

    def _event(self, event: ShoalEvent) -> None:
        if isinstance(event, PullProgress) and event.state != "running":
            self._kept.again()  # a download ended: a model kept, or its part gone

    def render(self, snap: FleetSnapshot) -> None:
        # the machines of the fleet and what they serve: a change asks for the fits again
        node = snap.roles.node
        seen = (node.model if node else None, node.state if node else None,
                tuple((n.key, n.model, n.state, n.ram_total) for n in snap.nodes))
        if seen != self._seen:
            self._seen = seen
            self.reload()
        self.split.render(snap)
        self.kept.show_node(node)
        self.models.set_rows([(m.name, model_row(m)) for m in snap.models])
        fit_rows(self.model_view, len(snap.models), least=1, most=6)
        head = snap.roles.head
        self.no_head.setVisible(not head)
        for w in (self.alias_view, self.name, self.target, self.fallbacks, self.set_button,
                  self.remove_button, self.revert_button, self.history_button):
            w.setEnabled(head)
        self.aliases.set_rows([(a.name, alias_row(a)) for a in snap.aliases])
        fit_rows(self.alias_view, len(snap.aliases), least=2, most=8)
        names = [m.name for m in snap.models]
        if [self.target.itemText(i) for i in range(self.target.count())] != names:
            text = self.target.currentText()
            self.target.clear()
            self.target.addItems(names)
            self.target.setEditText(text)
        node = snap.roles.node
        if node is None:
            self.current.setText("This machine serves no model.")
        else:
            window = f", {tokens(node.context_window)} tokens per lane" \
                if node.context_window else ""
            self.current.setText(f"{node.model} ({node.runtime}{window}) — {node.state}")

    def _picked(self, selected: QItemSelection, _deselected: QItemSelection) -> None:
        rows = selected.indexes()
        if not rows:
            return
        alias = self._bridge.last.aliases
        key = self.aliases.key_at(rows[0].row())
        for a in alias:
            if a.name == key:
                self.name.setText(a.name)
                self.target.setEditText(a.target or "")
                self.fallbacks.setText(", ".join(a.fallbacks))

    def _said(self, line: str) -> None:
        say(self.alias_error, "")
        say(self.alias_ok, line)

    def _failed(self, line: str) -> None:
        say(self.alias_ok, "")
        say(self.alias_error, line)

    def set_alias(self) -> None:
        name, target = self.name.text().strip(), self.target.currentText().strip()
        if not name or not target:
            self._failed("Give the alias a name and a target model.")
            return
        fallbacks = fallbacks_of(self.fallbacks.text())
        shoal = self._bridge.shoal

        async def go() -> str:
            return (await shoal.aliases.set(name, target, fallbacks)).line

        run(self, self._bridge, go(), done=self._said, failed=self._failed)

    def _change(self, what: str) -> None:
        name = self.name.text().strip()
        if not name:
            self._failed("Pick an alias in the table (or type its name) first.")
            return
        shoal = self._bridge.shoal

        async def go() -> str:
            commands = shoal.aliases
            change = await (commands.remove(name) if what == "remove" else commands.revert(name))
            return change.line

        run(self, self._bridge, go(), done=self._said, failed=self._failed)

    def show_history(self) -> None:
        name = self.name.text().strip()
        if not name:
            self._failed("Pick an alias in the table (or type its name) first.")
            return
        shoal = self._bridge.shoal

        async def go() -> list[Any]:
            return shoal.aliases.history(name)

        def show(entries: list[Any]) -> None:
            self.history = HistoryDialog(name, entries, self)
            self.history.show()

        run(self, self._bridge, go(), done=show, failed=self._failed)
