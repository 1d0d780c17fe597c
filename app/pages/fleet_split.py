"""The Models page's "Suggested for your fleet" card: which model each machine of the fleet
should serve (the engine's split, ``FleetFits.split``), each with its fit and speed
estimate there, and under it the models suggested beside it (``FleetFits.beside``: an
editor's autocomplete and embeddings models, fitting together with it in the machine's
budget). "Use this split" asks each machine to serve its main model (``shoal.serve_on``),
each pulling its own, and this machine to serve the models beside its own too
(``shoal.serve_too``: each loads on its first request); beside another machine's they are
suggestions. Then each machine's line
says how its pull goes (this machine from its pulls, the others from their nodes' stats)
until it serves its model. Under it, one line offers the largest catalog model no machine
holds alone split across the machines that lend memory (``FleetFits.offers``), with its
speed estimate; the catalog card serves it.

Hidden when the fleet is this machine alone and it already serves what it is offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from PySide6.QtWidgets import QPushButton, QWidget

from app.bridge import ShoalBridge
from app.pages.catalog import same_model as same
from app.widgets import Card, Cell, RowsModel, fit_rows, inline_error, note, run, say, table
from engine.models.pulls.text import progress
from engine.models.speed import AUTOCOMPLETE_TPS, CHAT_TPS
from engine.snapshot import FleetSnapshot

if TYPE_CHECKING:
    from engine.models.choice import SplitOffer
    from engine.models.commands import FleetFits
    from engine.models.fit import Suggestion

SPLIT_COLUMNS = ("Machine", "Model", "For", "Fit", "Now")
ROLE = {"agents": "agents and chat", "autocomplete": "editor autocomplete", "chat": "chat",
        "embeddings": "embeddings (codebase search)"}
BESIDE_TIP = ("Use this split serves each machine's main model, and on this machine the "
              "models beside it too (each loads on its first request); beside another "
              "machine's, a model is a suggestion that fits together with it there")


def role_text(s: Suggestion) -> str:
    """What a suggested model is for: ``agents and chat``, ``agents and chat, editor
    autocomplete`` (a main model that does fill-in-the-middle serves autocomplete too)."""
    return ", ".join(ROLE.get(r, r) for r in (s.role, *s.also))


def largest_offer(fits: FleetFits) -> SplitOffer | None:
    """The largest catalog model no machine holds alone that the machines lending memory
    hold together (None: no such model)."""
    params = {e.id: e.params_b for e in fits.catalog.entries}
    return max(fits.offers, key=lambda o: params.get(o.entry_id, 0.0), default=None)


def offer_text(fits: FleetFits, then: str = "; choose it above to serve it so") -> str:
    """The largest catalog model no machine holds alone, split across machines that lend
    memory: ``Larger than any one machine: Qwen2.5 Coder 32B Q4_K_M, split across This
    machine + desk (30 + 34 of 64 layers), about 2 tokens/s`` and ``then``, what to do
    about it ("" when none is offered)."""
    offer = largest_offer(fits)
    if offer is None:
        return ""
    name = next((e.name for e in fits.catalog.entries if e.id == offer.entry_id),
                offer.entry_id)
    return (f"Larger than any one machine: {name} {offer.quant}, "
            f"{offer.proposal.line_for(fits.label_of())}{then}")


@dataclass(frozen=True, slots=True)
class Asked:
    """What a machine answered when asked to serve its model."""

    spec: str
    line: str
    refused: bool


def now_cell(s: Suggestion, snap: FleetSnapshot, asked: Asked | None, here: str) -> Cell:
    """What the machine of ``s`` does now: pulling (how far), serving its model, or not
    (``here``: the key of this machine)."""
    spec = s.candidate.spec
    if s.machine == here:
        pull = next((p for p in snap.pulls if same(p.model, spec) and p.state == "running"),
                    None)
        node = snap.roles.node
        if pull is not None:
            return Cell("downloading: " + progress(pull.done_bytes, pull.total_bytes,
                                                   pull.rate_bps, pull.eta_s), tone="warn")
        model, state = (node.model, node.state) if node is not None else ("", "off")
        serving = state == "serving"
    else:
        n = next((n for n in snap.nodes if n.key == s.machine), None)
        if n is None:  # gone, or linking again with its new model
            switching = asked is not None and not asked.refused and same(asked.spec, spec)
            return Cell("switching to it…", tone="warn") if switching else \
                Cell("not in the fleet now", tone="bad")
        if n.pull_model:
            return Cell(f"downloading {n.pull_model}: " + progress(n.pull_done, n.pull_total),
                        tone="warn")
        if asked is not None and same(asked.spec, spec) and n.serve_failed \
                and spec in n.serve_failed:  # the machine's own word of how it went
            return Cell(n.serve_failed, tone="bad")
        model, serving = n.model, n.state == "ready"
    if same(model, spec):
        return Cell("serves it" if serving else "loading it", tone="good" if serving else "warn")
    if asked is not None and same(asked.spec, spec):
        return Cell(asked.line, tone="bad" if asked.refused else "warn")
    return Cell(f"serves {model}" if model else "serves nothing", tone="muted")


def slow(s: Suggestion) -> bool:
    """It fits, but its estimate is below what its role wants (the line says so)."""
    wants = AUTOCOMPLETE_TPS if "autocomplete" in (s.role, *s.also) else CHAT_TPS
    return s.fit.fits and not s.fit.usable(wants)


def beside_now_cell(s: Suggestion, snap: FleetSnapshot, here: str) -> Cell:
    """What the fleet does with a model suggested beside a machine's main one: served by a
    node of the fleet, being pulled here, or not served (the split serves main models)."""
    spec = s.candidate.spec
    if any(m.served and same(m.name, spec) for m in snap.models):
        return Cell("served in the fleet", tone="good")
    pull = next((p for p in snap.pulls if same(p.model, spec) and p.state == "running"),
                None) if s.machine == here else None
    if pull is not None:
        return Cell("downloading: " + progress(pull.done_bytes, pull.total_bytes,
                                               pull.rate_bps, pull.eta_s), tone="warn")
    return Cell("not served", tip=BESIDE_TIP, tone="muted")


class SplitCard(Card):
    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__("Suggested for your fleet", parent)
        self._bridge = bridge
        self.split: tuple[Suggestion, ...] = ()
        self.beside: tuple[Suggestion, ...] = ()  # the models beside each main one
        self._here = ""  # this machine's key among the fits' machines
        self._labels: dict[str, str] = {}
        self._names: dict[str, str] = {}  # catalog entry id -> its name
        self._asked: dict[str, Asked] = {}  # machine key -> its answer
        # the split the user accepted: shown until every machine serves its model, while
        # the fleet's machines come and go as they switch (each a new split meanwhile)
        self._accepted: tuple[Suggestion, ...] | None = None
        self._accepted_beside: tuple[Suggestion, ...] = ()  # and the models beside them
        self.add(note("Which model each machine should serve: the largest with tool calling "
                      "for agents that fits and answers at a usable speed (chat wants 10 "
                      "tokens/s, autocomplete 20; the speeds are estimates), a small code "
                      "model for autocomplete on the smallest machine, and beside each "
                      "machine's model the autocomplete and embeddings models an editor "
                      "needs that fit with it. Each machine pulls and serves its main model; "
                      "this machine serves the models beside its own too."))
        self.rows = RowsModel(SPLIT_COLUMNS, self)
        self.view = table(self.rows, stretch=4)
        self.view.setObjectName("split")
        self.add(self.view)
        self.use = QPushButton("Use this split")
        self.use.setObjectName("useSplit")
        self.use.clicked.connect(self.use_split)
        self.done_line = note("")
        self.row(self.use, self.done_line, None)
        self.error = inline_error()
        self.add(self.error)
        self.offer_line = note("")
        self.offer_line.setObjectName("splitOffer")
        self.add(self.offer_line)
        self.hide()

    def show_split(self, fits: FleetFits) -> None:
        self._here = next(m.key for m in fits.machines if m.local)
        self._labels.update({m.key: m.label for m in fits.machines})
        self.split = fits.split if self._accepted is None else self._accepted
        self.beside = fits.beside if self._accepted is None else self._accepted_beside
        self._names = {e.id: e.name for e in fits.catalog.entries}
        self.offer_line.setText(offer_text(fits))
        self.render(self._bridge.last)

    def _machine_label(self, key: str) -> str:
        return self._labels.get(key, key)

    def render(self, snap: FleetSnapshot) -> None:
        split = self.split
        alone = all(s.machine == self._here for s in split) and not any(
            n.key != "local" for n in snap.nodes)
        node = snap.roles.node
        served_here = node.model if node is not None else ""
        offered_served = all(same(s.candidate.spec, served_here) for s in split)
        # a model suggested beside this machine's own that it does not serve yet
        beside_waiting = any(b.machine == self._here and
                             beside_now_cell(b, snap, self._here).text == "not served"
                             for b in self.beside)
        offered = bool(self.offer_line.text())  # a model no machine holds alone
        self.setVisible(offered or (bool(split) and not (alone and offered_served
                                                         and not beside_waiting)))
        if not split:
            return
        rows = []
        all_serving, failed = True, False
        for s in split:
            now = now_cell(s, snap, self._asked.get(s.machine), self._here)
            all_serving &= now.text == "serves it"
            failed |= now.tone == "bad"
            rows.append((s.machine, self._cells(s, now)))
            for b in self.beside:  # the models beside it, under it
                if b.machine == s.machine:
                    rows.append((f"{b.machine}/{b.role}",
                                 self._cells(b, beside_now_cell(b, snap, self._here))))
        self.rows.set_rows(rows)
        fit_rows(self.view, len(rows), least=1, most=9)
        if all_serving and not beside_waiting:
            self._accepted = None
        # a machine that failed (or refused) lets the user ask again
        self.use.setEnabled(bool(split) and (not all_serving or beside_waiting)
                            and (self._accepted is None or failed))
        self.done_line.setText("Every machine serves its suggested model." if split
                               and all_serving and not beside_waiting else "")

    def _cells(self, s: Suggestion, now: Cell) -> tuple[Cell, ...]:
        c = s.candidate
        fit = Cell(s.fit_line, tip=s.line, tone="warn" if slow(s) else "")
        return (Cell(self._machine_label(s.machine)),
                Cell(f"{self._names.get(c.entry_id, c.entry_id)} {c.quant}", tip=c.spec),
                Cell(role_text(s)), fit, now)

    def use_split(self) -> None:
        """Ask every machine to serve its model, at once; each answers on its line."""
        say(self.error, "")
        shoal = self._bridge.shoal
        self._accepted, self._accepted_beside = self.split, self.beside
        for b in self.beside:  # this machine serves the models beside its own too
            if b.machine == self._here:
                run(self, self._bridge, shoal.serve_too(b.candidate.spec),
                    done=lambda _line: self.render(self._bridge.last),
                    failed=lambda line: say(self.error, line))
        snap = self._bridge.last
        for s in self.split:
            if now_cell(s, snap, None, self._here).text == "serves it":
                continue  # asked again for the models beside it only
            key, spec = s.machine, s.candidate.spec
            self._asked[key] = Asked(spec, "asked to serve it…", refused=False)

            def answered(line: str, key: str = key, spec: str = spec) -> None:
                self._asked[key] = Asked(spec, line or "asked to serve it", refused=False)
                self.render(self._bridge.last)

            def refused(line: str, key: str = key, spec: str = spec) -> None:
                self._asked[key] = Asked(spec, line, refused=True)
                self.render(self._bridge.last)

            run(self, self._bridge, shoal.serve_on(key, spec), done=answered, failed=refused)
        self.render(self._bridge.last)
