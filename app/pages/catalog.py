"""The Models page's "Choose a model" card: the catalog as a table, with one column per
machine of the fleet saying whether the quantisation shown fits there and how fast it
would answer (the fit's estimate, "slow" where too slow for chat), a chooser of that
quantisation, "Serve on this machine", and "Other model…" for a file or a hub id. A model
no machine holds alone says how it would run split across the machines that lend memory
(``FleetFits.offers``), and "Serve it split" asks for that (``shoal.serve_split``).

The fits come from the engine (``shoal.models.fits()``); this card only renders them and
starts the pull through `ServeModel`, whose progress row it shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from PySide6.QtCore import QItemSelection, Qt, Signal
from PySide6.QtWidgets import QComboBox, QLabel, QPushButton, QToolButton, QWidget

from app.bridge import ShoalBridge
from app.pages.serve_model import ServeModel
from app.widgets import Card, Cell, RowsModel, fit_rows, inline_error, note, run, say, table
from engine.models.fit import Fit, tokens_text
from engine.models.speed import speed_text
from engine.sizes import amount

if TYPE_CHECKING:  # the catalog and its fits are read when the page asks for them
    from engine.models.choice import EntryFit, QuantFit, SplitOffer
    from engine.models.commands import FleetFits, MachineFits

BASE_COLUMNS = ("Model", "Good for", "Size", "Window")
USES = {"small": "small machines"}  # the catalog's uses, as a line reads them
FIT_TONE = {"full": "good", "reduced": "warn", "none": "bad"}


def fit_cell(fit: Fit) -> Cell:
    """A machine's column: "fits", "8K window" (a smaller one than the model's) or "no",
    with the speed estimate where there is one: "fits · ~35 tok/s", and for a model that
    fits but would answer too slowly for chat, "fits · slow: ~2.1 tok/s" (in the warning
    tone; the tooltip has the fit's whole line)."""
    if fit.verdict == "none":
        return Cell("no", tip=fit.line, tone="bad")
    if fit.disk_short:
        return Cell("no disk room", tip=fit.line, tone="bad")
    text = "fits" if fit.verdict == "full" else f"{tokens_text(fit.window)} window"
    if fit.tps is not None:
        text += f" · {'slow: ' if fit.slow else ''}{speed_text(fit.tps)}"
    return Cell(text, tip=fit.line, tone="warn" if fit.slow else FIT_TONE[fit.verdict])


def good_for(fitted: EntryFit) -> str:
    """What an entry is for, and what it can do: ``code, chat · tools, fill-in-the-middle``."""
    e = fitted.entry
    uses = ", ".join(USES.get(u, u) for u in e.uses)
    caps = ", ".join(name for name, on in (("tools", e.tools), ("fill-in-the-middle", e.fim),
                                           ("thinking", e.thinking)) if on)
    return " · ".join(part for part in (uses, caps) if part)


def same_model(a: str, b: str) -> bool:
    """Two model names or ids naming the same model (the hub's ids ignore case)."""
    return a.strip().lower() == b.strip().lower()


def quant_fit(fitted: EntryFit, quant: str) -> QuantFit:
    return next((q for q in fitted.quants if q.quant.name == quant), fitted.best)


def size_text(q: QuantFit) -> str:
    return f"{amount(q.quant.size)}, downloaded" if q.kept else amount(q.quant.size)


def split_text(offer: SplitOffer, fits: FleetFits | None) -> str:
    """``No machine holds it alone; Q4_K_M split across This machine + laptop (12 + 16 of
    28 layers), about 3 tokens/s``."""
    line = offer.proposal.line_for(fits.label_of() if fits is not None else None)
    return f"No machine holds it alone; {offer.quant} {line}"


class SplitAsk(QPushButton):
    """"Serve it split": asks the machines of the offer shown to serve its model split as
    offered (``shoal.serve_split``), one ask at a time; ``answered`` says the serving
    machine's line, ``refused`` why not. Hidden while no offer is shown."""

    answered = Signal(str)
    refused = Signal(str)

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__("Serve it split", parent)
        self.setObjectName("serveSplit")
        self.setToolTip("Serve this model on the first machine named, its last layers on "
                        "the memory the others lend")
        self._bridge = bridge
        self.offer: SplitOffer | None = None
        self.asking = False  # asked, not answered yet
        self.clicked.connect(self.ask)
        self.show_offer(None)

    def show_offer(self, offer: SplitOffer | None) -> None:
        self.offer = offer
        self.setVisible(offer is not None)
        self.setEnabled(offer is not None and not self.asking)

    def ask(self) -> None:
        offer = self.offer
        if offer is None or self.asking:
            return
        self.asking = True
        self.setEnabled(False)
        run(self, self._bridge, self._bridge.shoal.serve_split(
            offer.spec, offer.proposal.machines), done=self._answered, failed=self._refused)

    def _answered(self, line: str) -> None:
        self.asking = False
        self.show_offer(self.offer)
        self.answered.emit(line)

    def _refused(self, line: str) -> None:
        self.asking = False
        self.show_offer(self.offer)
        self.refused.emit(line)


@dataclass(frozen=True, slots=True)
class Shown:
    """One row: the entry with its fit on every machine, at the quantisation shown."""

    fitted: EntryFit  # on this machine
    quant: QuantFit
    elsewhere: tuple[QuantFit | None, ...]  # the same quant on each other machine


class CatalogCard(Card):
    """Renders a `FleetFits`; "Serve on this machine" calls ``serve.serve_spec``, "Serve it
    split" ``shoal.serve_split``."""

    def __init__(self, serve: ServeModel, bridge: ShoalBridge,
                 parent: QWidget | None = None) -> None:
        super().__init__("Choose a model", parent)
        self.serve = serve
        self._bridge = bridge
        self._fits: FleetFits | None = None
        self._quant: dict[str, str] = {}  # entry id -> the quantisation the user picked
        self._rows: list[Shown] = []
        self.facts = note("Looking at this machine and the catalog…")
        self.facts.setObjectName("machineFacts")
        self.add(self.facts)
        self.catalog = RowsModel(BASE_COLUMNS, self)
        self.view = table(self.catalog, stretch=1)
        self.view.setObjectName("catalog")
        self.view.selectionModel().selectionChanged.connect(self._picked)
        self.add(self.view)

        self.quant = QComboBox()
        self.quant.setObjectName("quant")
        self.quant.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.quant.setToolTip("The quantisation: smaller files answer faster and fit more "
                              "machines; larger ones answer better")
        self.quant.activated.connect(self._quant_chosen)
        self.fit_line = note("")
        self.fit_line.setObjectName("fitLine")
        self.serve_here = QPushButton("Serve on this machine")
        self.serve_here.setObjectName("serveHere")
        self.serve_here.clicked.connect(self.serve_selected)
        line = self.row(QLabel("Quantisation"), self.quant)
        line.addWidget(self.fit_line, 1)
        line.addWidget(self.serve_here)
        # a model no machine holds alone: how it would run split, and the button for it
        self.split_line = note("")
        self.split_line.setObjectName("splitLine")
        self.serve_split = SplitAsk(bridge)
        self.serve_split.clicked.connect(self._split_asked)
        self.row(self.split_line, self.serve_split).setStretch(0, 1)
        self.split_line.hide()
        self.split_done = note("")
        self.split_done.setObjectName("splitDone")
        self.add(self.split_done)
        self.serve_split.answered.connect(self.split_done.setText)
        self.catalog_note = note("")
        self.catalog_note.hide()
        self.add(self.catalog_note)
        self.error = inline_error()
        self.add(self.error)
        self.serve_split.refused.connect(lambda line: say(self.error, line))

        self.other = QToolButton()
        self.other.setObjectName("otherModel")
        self.other.setText("Other model… (a GGUF file, or a Hugging Face id)")
        self.other.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.other.setCheckable(True)
        self.other.setAutoRaise(True)
        self.other.setArrowType(Qt.ArrowType.RightArrow)
        self.other.toggled.connect(self._other_toggled)
        self.add(self.other)
        self.add(serve)
        serve.choices.hide()
        serve.started.connect(lambda: self.serve_here.setEnabled(False))
        serve.served.connect(lambda _name: self._update_buttons())
        serve.failed.connect(lambda _line: self._update_buttons())
        self._update_buttons()

    # -- rendering -------------------------------------------------------------------

    def show_failure(self, line: str) -> None:
        """The catalog or the fits could not be read: the engine's line."""
        say(self.error, line)
        self.facts.setText("The catalog could not be read.")

    def show_fits(self, fits: FleetFits) -> None:
        say(self.error, "")
        self._fits = fits
        others = fits.machines[1:]
        self.facts.setText(f"This machine: {fits.facts}.")
        say(self.catalog_note, fits.note)
        headers = [*BASE_COLUMNS, *(m.label for m in fits.machines)]
        if self.catalog.headers != headers:  # the fleet changed: a model with its columns
            selected = self.selected_id()
            self.catalog = RowsModel(headers, self)
            self.view.setModel(self.catalog)
            self.view.selectionModel().selectionChanged.connect(self._picked)
            self._render(fits.machines[0], others)
            if selected is not None:
                self.select(selected)
        else:
            self._render(fits.machines[0], others)
        if self.selected_id() is None and self._rows:
            self.select(self._first_choice(fits))
        self._update_selection()

    def _first_choice(self, fits: FleetFits) -> str:
        """The row chosen when none is: the model suggested for this machine, else the
        first that fits it."""
        here = fits.machines[0].key
        mine = next((s for s in fits.split if s.machine == here), None)
        if mine is not None:
            self._quant.setdefault(mine.candidate.entry_id, mine.candidate.quant)
            self._render(fits.machines[0], fits.machines[1:])
            return mine.candidate.entry_id
        return next((r.fitted.entry.id for r in self._rows if r.quant.fit.fits),
                    self._rows[0].fitted.entry.id)

    def _render(self, here: MachineFits, others: tuple[MachineFits, ...]) -> None:
        by_id = [{f.entry.id: f for f in m.fits} for m in others]
        rows: list[Shown] = []
        for fitted in here.fits:
            chosen = quant_fit(fitted, self._quant.get(fitted.entry.id, fitted.best.quant.name))
            elsewhere = tuple(
                quant_fit(ids[fitted.entry.id], chosen.quant.name) if fitted.entry.id in ids
                else None for ids in by_id)
            rows.append(Shown(fitted, chosen, elsewhere))
        self._rows = rows
        self.catalog.set_rows([(r.fitted.entry.id, self._row(r)) for r in rows])
        fit_rows(self.view, len(rows), least=3, most=10)

    @staticmethod
    def _row(r: Shown) -> tuple[Cell, ...]:
        e = r.fitted.entry
        name = f"{e.name} {r.quant.quant.name}"
        tip = f"{r.quant.spec} · {e.license}" + (f" · {e.note}" if e.note else "")
        return (Cell(name, tip=tip), Cell(good_for(r.fitted)),
                Cell(size_text(r.quant), right=True,
                     tip="an estimate" if "size" in e.estimated else ""),
                Cell(tokens_text(e.context), right=True), fit_cell(r.quant.fit),
                *(fit_cell(q.fit) if q is not None else Cell("—", tone="muted")
                  for q in r.elsewhere))

    # -- choosing --------------------------------------------------------------------

    def selected_id(self) -> str | None:
        rows = self.view.selectionModel().selectedRows()
        return self.catalog.key_at(rows[0].row()) if rows else None

    def select(self, entry_id: str) -> None:
        if entry_id in self.catalog.keys:
            self.view.selectRow(self.catalog.keys.index(entry_id))

    def selected(self) -> Shown | None:
        key = self.selected_id()
        return next((r for r in self._rows if r.fitted.entry.id == key), None)

    def _picked(self, _selected: QItemSelection, _deselected: QItemSelection) -> None:
        self._update_selection()

    def _update_selection(self) -> None:
        shown = self.selected()
        self.quant.clear()
        offer = self.offer()
        self.split_line.setText(split_text(offer, self._fits) if offer is not None else "")
        self.split_line.setVisible(offer is not None)
        self.serve_split.show_offer(offer)
        if shown is not None:
            for q in shown.fitted.quants:
                verdict = fit_cell(q.fit).text
                self.quant.addItem(f"{q.quant.name} · {size_text(q)} · {verdict}", q.quant.name)
            self.quant.setCurrentIndex(self.quant.findData(shown.quant.quant.name))
            self.fit_line.setText(shown.quant.fit.line[:1].upper() + shown.quant.fit.line[1:])
        else:
            self.fit_line.setText("")
        self._update_buttons()

    def _quant_chosen(self, index: int) -> None:
        shown = self.selected()
        if shown is None or self._fits is None:
            return
        self._quant[shown.fitted.entry.id] = str(self.quant.itemData(index))
        self._render(self._fits.machines[0], self._fits.machines[1:])
        self._update_selection()

    def _update_buttons(self) -> None:
        shown = self.selected()
        usable = shown is not None and shown.quant.fit.fits and not shown.quant.fit.disk_short
        self.serve_here.setEnabled(usable and not self.serve.busy)
        self.quant.setEnabled(shown is not None)

    def serve_selected(self) -> None:
        shown = self.selected()
        if shown is None:
            return
        self.serve.serve_spec(shown.quant.spec)

    def offer(self) -> SplitOffer | None:
        """The split offered for the model chosen: it fits no machine alone."""
        key = self.selected_id()
        return self._fits.offer_for(key) if key is not None and self._fits else None

    def _split_asked(self) -> None:
        """The machines of the offer are asked (`SplitAsk`): their answer goes here."""
        say(self.error, "")
        self.split_done.setText("")

    def _other_toggled(self, on: bool) -> None:
        self.other.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.serve.choices.setVisible(on)
