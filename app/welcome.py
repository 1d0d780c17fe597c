"""The first run: start a fleet here or join one, choose the model this machine serves, and
end on connecting an editor. Finishing sets ``prefs.welcomed`` and saves it.

Steps: choose → (start: name the fleet, show its code | join: a head found, or the code)
→ model → editor.

The model step offers the catalog's models that fit this machine, each with its speed
estimate here, the one suggested for it chosen already (app/pages/model_options.py), and
names the models suggested beside it for an editor (autocomplete, embeddings): the step's
button pulls and serves the choice, with its progress and a Cancel, then goes on; the
embedded default starts with no download. Where the fleet's machines together hold a
catalog model that none holds alone, it offers the largest split across them, and "Serve
it split" asks them for it as the Models page does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import (
    QAbstractButton,
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.editors import EditorsPanel
from app.join import JoinPanel, in_the_app, joined_line
from app.pages.catalog import SplitAsk
from app.pages.fleet_split import largest_offer
from app.pages.model_options import (
    ModelOption,
    ModelOptions,
    beside_line,
    not_offered,
    split_line,
    welcome_options,
)
from app.pages.pairing import PairingView
from app.pages.serve_model import ServeModel
from app.widgets import Card, PageHeader, heading, inline_error, note, run, say
from engine.service import JoinResult, Pairing
from engine.sizes import amount
from engine.snapshot import FleetSnapshot

if TYPE_CHECKING:
    from engine.models.commands import FleetFits
    from engine.models.store import StoredModel

STEPS = ("choose", "start", "join", "model", "editor")
SIZE = (860, 680)


class Choice(QAbstractButton):
    """A large button with a title and a line under it, drawn as a rounded panel."""

    def __init__(self, title: str, line: str) -> None:
        super().__init__()
        self.setObjectName("choice")
        self.setText(title)
        self.setMinimumHeight(96)
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setAttribute(Qt.WidgetAttribute.WA_Hover)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(18, 12, 18, 12)
        top = heading(title, 1.25)
        sub = note(line)
        for label in (top, sub):
            label.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents)
            layout.addWidget(label)

    def sizeHint(self) -> QSize:
        return self.layout().sizeHint()

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        edge = pal.color(QPalette.ColorRole.Highlight) if self.underMouse() or self.isDown() \
            else pal.color(QPalette.ColorRole.Mid)
        painter.setPen(edge)
        painter.setBrush(pal.color(QPalette.ColorRole.Base))
        painter.drawRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 10, 10)


class Welcome(QDialog):
    def __init__(self, bridge: ShoalBridge) -> None:
        super().__init__()
        self._bridge = bridge
        self._path: list[str] = ["choose"]
        self._fits: FleetFits | None = None
        self._kept: list[StoredModel] = []
        self._picked: str | None = None  # the option the user chose (None: the suggestion)
        self._serving = ""  # what this machine's node serves, as the options last saw it
        self.setObjectName("welcome")
        self.setWindowTitle("Welcome to Shoal")
        self.resize(*SIZE)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.stack = QStackedWidget()
        layout.addWidget(self.stack, 1)
        self.pages: dict[str, QWidget] = {}
        for name, page in (("choose", self._choose_page()), ("start", self._start_page()),
                           ("join", self._join_page()), ("model", self._model_page()),
                           ("editor", self._editor_page())):
            self.pages[name] = page
            self.stack.addWidget(page)

        bar = QWidget()
        bar.setObjectName("welcomeBar")
        row = QHBoxLayout(bar)
        row.setContentsMargins(24, 10, 24, 16)
        self.back = QPushButton("Back")
        self.back.setObjectName("back")
        self.back.clicked.connect(self.go_back)
        self.where = note("", wrap=False)
        self.next = QPushButton("Next")
        self.next.setObjectName("next")
        self.next.setDefault(True)
        self.next.clicked.connect(self.go_next)
        row.addWidget(self.back)
        row.addStretch(1)
        row.addWidget(self.where)
        row.addSpacing(12)
        row.addWidget(self.next)
        layout.addWidget(bar)
        bridge.snapshot.connect(self._snapshot)
        self._snapshot(bridge.last)
        self._show_options()
        self._load_models()  # ready by the model step: the user reads the first steps
        self._show("choose")

    # -- pages -----------------------------------------------------------------------

    def _page(self, title: str, line: str) -> tuple[QWidget, QVBoxLayout]:
        page = QWidget()
        layout = QVBoxLayout(page)
        layout.setContentsMargins(28, 26, 28, 8)
        layout.setSpacing(14)
        layout.addWidget(PageHeader(title, line))
        return page, layout

    def _choose_page(self) -> QWidget:
        page, layout = self._page("Welcome to Shoal", "Shoal pools your computers into one "
                                  "private AI endpoint for your editor. No accounts, no cloud.")
        self.start_choice = Choice("Start a fleet here", "This is your first machine: it keeps "
                                   "the fleet's key, runs the API, and shows a code for the "
                                   "next machine to scan.")
        self.join_choice = Choice("Join a fleet", "Another machine already runs Shoal: scan, "
                                  "open or paste its join code, and serve the fleet from here.")
        self.start_choice.clicked.connect(lambda: self._forward("start"))
        self.join_choice.clicked.connect(lambda: self._forward("join"))
        layout.addWidget(self.start_choice)
        layout.addWidget(self.join_choice)
        layout.addWidget(note("You can change either later, from the tray menu or the window."))
        layout.addStretch(1)
        return page

    def _start_page(self) -> QWidget:
        page, layout = self._page("Start a fleet here", "Name the fleet; Shoal makes its key "
                                  "and shows the code your other machines scan.")
        card = Card()
        self.fleet_name = QLineEdit()
        self.fleet_name.setObjectName("welcomeFleetName")
        self.fleet_name.setPlaceholderText("desk")
        self.start_button = QPushButton("Start the fleet")
        self.start_button.setObjectName("startFleet")
        self.start_button.clicked.connect(self.start_fleet)
        card.row(QLabel("Fleet name"), self.fleet_name, self.start_button)
        self.start_error = inline_error()
        card.add(self.start_error)
        layout.addWidget(card)
        self.pairing_view = PairingView()
        self.pairing_view.hide()
        layout.addWidget(self.pairing_view)
        layout.addStretch(1)
        return page

    def _join_page(self) -> QWidget:
        page, layout = self._page("Join a fleet", "Link this machine with the fleet's heads.")
        self.found_card = Card("Heads found")
        self.found = QListWidget()
        self.found.setObjectName("foundHeads")
        self.found.setMaximumHeight(110)
        self.found_card.add(self.found)
        self.join_found = QPushButton("Join this head")
        self.join_found.setObjectName("joinFound")
        self.join_found.clicked.connect(self.join_selected)
        self.found_card.row(self.join_found, None)
        layout.addWidget(self.found_card)
        card = Card("Join with a code")
        self.join_panel = JoinPanel(self._bridge)
        self.join_panel.joined.connect(self._joined)
        card.add(self.join_panel)
        layout.addWidget(card)
        layout.addStretch(1)
        return page

    def _model_page(self) -> QWidget:
        page, layout = self._page("Which model does this machine serve?",
                                  "Every machine serves a model to the fleet. These fit this "
                                  "machine; you can change it any time on the Models page.")
        card = Card()
        self.current = note("")
        self.current.setObjectName("welcomeCurrent")
        card.add(self.current)
        self.model_facts = note("Looking at this machine and the catalog…")
        self.model_facts.setObjectName("welcomeFacts")
        card.add(self.model_facts)
        self.options = ModelOptions()
        self.options.changed.connect(self._option_changed)
        card.add(self.options, 1)
        self.beside = note("")
        self.beside.setObjectName("welcomeBeside")
        self.beside.hide()
        card.add(self.beside)
        self.left_out = note("")
        self.left_out.setObjectName("welcomeLeftOut")
        card.add(self.left_out)
        # the largest model no machine holds alone, which the fleet's machines hold split
        self.split_offer = note("")
        self.split_offer.setObjectName("welcomeSplitOffer")
        self.serve_split = SplitAsk(self._bridge)
        self.serve_split.clicked.connect(lambda: say(self.split_done, ""))
        card.row(self.split_offer, self.serve_split).setStretch(0, 1)
        self.split_offer.hide()
        self.split_done = note("")  # the serving machine's answer
        self.split_done.setObjectName("welcomeSplitDone")
        self.split_done.hide()
        self.serve_split.answered.connect(lambda line: say(self.split_done, line))
        card.add(self.split_done)
        self.serve = ServeModel(self._bridge)
        # the options name the model; "Other model…" shows the file and id fields, and
        # the step's own button serves the choice
        self.serve.choices.hide()
        self.serve.embedded.hide()
        self.serve.serve.hide()
        self.serve.file.setChecked(True)
        self.serve.started.connect(self._update_next)
        self.serve.failed.connect(lambda _line: self._update_next())
        self.serve.served.connect(self._model_served)
        card.add(self.serve)
        self.model_error = inline_error()
        card.add(self.model_error)
        self.serve_split.refused.connect(lambda line: say(self.model_error, line))
        layout.addWidget(card, 1)
        return page

    def _editor_page(self) -> QWidget:
        page, layout = self._page("Connect your editor", "Paste these settings into your "
                                  "editor; it answers from the fleet through this machine.")
        layout.setContentsMargins(8, 26, 8, 0)
        layout.itemAt(0).widget().setContentsMargins(20, 0, 20, 0)  # the header
        self.editors = EditorsPanel(self._bridge, header=False)
        layout.addWidget(self.editors, 1)
        return page

    # -- moving between pages --------------------------------------------------------

    @property
    def step(self) -> str:
        return self._path[-1]

    def _show(self, name: str) -> None:
        self.stack.setCurrentWidget(self.pages[name])
        if name == "model":
            self._load_models()  # the fleet may have changed since (a join)
        self.back.setVisible(len(self._path) > 1)
        self.next.setVisible(name != "choose")
        self.next.setText("Finish" if name == "editor" else "Next")
        total = 4
        number = {"choose": 1, "start": 2, "join": 2, "model": 3, "editor": 4}[name]
        self.where.setText(f"Step {number} of {total}")
        self._update_next()

    def _forward(self, name: str) -> None:
        self._path.append(name)
        self._show(name)

    def go_back(self) -> None:
        if len(self._path) > 1:
            self._path.pop()
            self._show(self.step)

    def go_next(self) -> None:
        step = self.step
        if step in ("start", "join"):
            self._forward("model")
        elif step == "model":
            self.serve_choice()
        elif step == "editor":
            self.finish()

    def _update_next(self) -> None:
        snap = self._bridge.last
        if self.step == "start":
            self.next.setEnabled(self.pairing_view.pairing is not None)
        elif self.step == "join":
            self.next.setEnabled(snap.roles.member)
            self.next.setText("Next" if snap.roles.member else "Next (join first)")
        elif self.step == "model":
            busy = self.serve.busy
            self.next.setText("Getting it ready…" if busy
                              else self._serve_label(self.options.chosen()))
            self.next.setEnabled(not busy)
        else:
            self.next.setEnabled(True)

    def finish(self) -> None:
        run(self, self._bridge, self._bridge.shoal.update_settings(app={"welcomed": True}),
            anytime=True)
        self.accept()

    # -- the model ------------------------------------------------------------------

    def _load_models(self) -> None:
        """Ask the engine for the catalog's fits here and the models kept here."""
        models = self._bridge.shoal.models

        async def load() -> tuple[FleetFits, list[StoredModel]]:
            return await models.fits(), await models.kept()

        def loaded(got: tuple[FleetFits, list[StoredModel]]) -> None:
            self._fits, self._kept = got
            self.model_facts.setText(f"This machine: {self._fits.facts}.")
            say(self.model_error, "")
            self._show_options()

        def failed(line: str) -> None:
            self.model_facts.setText("")
            say(self.model_error, line)
            self._show_options()

        run(self, self._bridge, load(), done=loaded, failed=failed)

    def _show_options(self) -> None:
        node = self._bridge.last.roles.node
        self._serving = node.model if node is not None else ""
        options = welcome_options(self._fits, self._kept, self._serving)
        self.options.set_options(options, self._picked)
        say(self.beside, beside_line(self._fits))
        more = not_offered(self._fits, options)
        say(self.left_out, f"{more} more in the catalog need more memory than this machine "
                           "gives a model; the Models page lists them all." if more else "")
        say(self.split_offer, split_line(self._fits))
        self.serve_split.show_offer(largest_offer(self._fits) if self._fits else None)
        self._option_shown()

    def _option_changed(self) -> None:
        """The user chose an option: it stays chosen when the options are shown again."""
        chosen = self.options.chosen()
        self._picked = chosen.key if chosen is not None else None
        if not self.serve.busy:  # the last model's error is not this one's
            say(self.serve.error, "")
        self._option_shown()

    def _option_shown(self) -> None:
        chosen = self.options.chosen()
        self.serve.choices.setVisible(chosen is not None and chosen.kind == "other")
        self._update_next()

    @staticmethod
    def _serve_label(option: ModelOption | None) -> str:
        if option is None or option.serving:
            return "Next"
        if option.kind == "other":
            return "Serve this model"
        if option.download:
            return f"Download and serve ({amount(option.download)})"
        return "Serve it"

    def serve_choice(self) -> None:
        """The step's button: serve the model chosen (pulling it), then go on."""
        option = self.options.chosen()
        if self.serve.busy:
            return
        if option is None or option.serving:
            self._forward("editor")
        elif option.kind == "other":
            self.serve.start()
        else:
            self.serve.serve_spec(option.spec)
        self._update_next()

    def _model_served(self, _name: str) -> None:
        self._picked = None
        self._bridge.refresh()
        self._show_options()
        if self.step == "model":
            self._forward("editor")

    # -- actions ---------------------------------------------------------------------

    def start_fleet(self) -> None:
        name = self.fleet_name.text().strip() or None
        shoal = self._bridge.shoal
        self.start_button.setEnabled(False)
        say(self.start_error, "")

        async def start() -> Pairing:
            if shoal.api_url is None:  # the first machine runs the API
                await shoal.set_head(True)
            return await shoal.create_fleet(name)

        def started(pairing: Pairing) -> None:
            self.start_button.setEnabled(True)
            self.pairing_view.show_pairing(pairing)
            self.pairing_view.show()
            self._update_next()

        def failed(line: str) -> None:
            self.start_button.setEnabled(True)
            say(self.start_error, line)

        run(self, self._bridge, start(), done=started, failed=failed)

    def join_selected(self) -> None:
        item = self.found.currentItem() or self.found.item(0)
        if item is None:
            return
        address = item.data(Qt.ItemDataRole.UserRole)
        panel = self.join_panel
        say(panel.error, "")
        run(self, self._bridge, self._bridge.shoal.join(None, head=address), done=self._joined,
            failed=lambda line: say(panel.error, in_the_app(line)))

    def _joined(self, result: JoinResult) -> None:
        say(self.join_panel.ok, joined_line(result))
        self._bridge.refresh()
        self._update_next()

    def _snapshot(self, snap: FleetSnapshot) -> None:
        others = [h for h in snap.heads if not h.this_machine]
        have = [self.found.item(i).data(Qt.ItemDataRole.UserRole)
                for i in range(self.found.count())]
        if have != [h.address for h in others]:
            self.found.clear()
            for h in others:
                item = QListWidgetItem(f"{h.name or h.head_id} at {h.address}")
                item.setData(Qt.ItemDataRole.UserRole, h.address)
                self.found.addItem(item)
        # the engine reports heads it has met; with none, joining is by code
        self.found_card.setVisible(bool(others) and snap.has_token)
        node = snap.roles.node
        self.current.setText(f"Now serving {node.model} ({node.state})." if node else
                             "This machine serves no model yet.")
        if (node.model if node is not None else "") != self._serving and not self.serve.busy:
            self._show_options()  # what is "serving now" changed
        if self.stack.currentWidget() is self.pages.get(self.step):
            self._update_next()
