"""The first-run welcome's "which model" choices: the catalog's models that fit this machine
(each at its best quantisation, the one suggested for it first; never an embeddings model,
which makes vectors and cannot chat), the embedded default that starts with no download,
and "Other model…" for a file or a hub id; the line naming the models suggested
beside the suggested one (an editor's autocomplete and embeddings models); and the line
offering the largest model no machine holds alone split across the fleet's machines.

`welcome_options` is pure (the engine's fits, the models kept here and what the node serves
in; the options out); `ModelOptions` shows them as radio rows, one chosen: the catalog's in
a list that scrolls, the others always in view under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import (
    QAbstractButton,
    QButtonGroup,
    QFrame,
    QHBoxLayout,
    QLabel,
    QRadioButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.pages.catalog import good_for
from app.pages.catalog import same_model as same
from app.pages.fleet_split import ROLE, offer_text
from app.widgets import OK_TEXT, note, tone
from engine.sizes import amount

if TYPE_CHECKING:
    from engine.models.commands import FleetFits
    from engine.models.store import StoredModel

Kind = Literal["catalog", "embedded", "current", "other"]
SHOWN_ROWS = 3  # catalog rows seen at least; the list takes what room the step has


@dataclass(frozen=True, slots=True)
class ModelOption:
    key: str
    kind: Kind
    title: str
    line: str
    spec: str | None = None  # what set_model takes (None: the embedded default)
    download: int = 0  # bytes to pull (0: nothing to download)
    serving: bool = False  # this machine serves it now
    suggested: bool = False
    entry: str = ""  # the catalog entry it is ("": none)


def welcome_options(fits: FleetFits | None, kept: list[StoredModel],
                    serving: str) -> list[ModelOption]:
    """The choices, the suggested one first: every catalog model that fits this machine
    (an embeddings model is no model to serve alone: none is offered), at its best
    quantisation (the suggested one at the suggestion's), then the embedded
    default, what is served now when it is neither, and "Other model…". A catalog model
    whose file is the embedded default's is that option (it needs no download)."""
    out: list[ModelOption] = []
    embedded = next((m for m in kept if m.source == "embedded"), None)
    embedded_file = embedded.path.name.lower() if embedded is not None else None
    embedded_suggested = False
    embedded_entry = ""  # the catalog entry whose file the embedded default is
    if fits is not None:
        here = next(m for m in fits.machines if m.local)
        mine = next((s for s in fits.split if s.machine == here.key), None)
        for fitted in here.fits:
            e = fitted.entry
            if e.embeddings:
                continue
            pick = fitted.best
            suggested = mine is not None and mine.candidate.entry_id == e.id
            if suggested and mine is not None:
                pick = next((q for q in fitted.quants if q.quant.name == mine.candidate.quant),
                            pick)
            if pick.quant.files and pick.quant.files[0].lower() == embedded_file:
                embedded_suggested |= suggested
                embedded_entry = e.id
                continue
            if not pick.fit.fits or pick.fit.disk_short:
                continue
            now = same(serving, pick.spec)
            state = ("serving now" if now else "downloaded" if pick.kept
                     else f"{amount(pick.quant.size)} download")
            # the fit with its speed estimate (judged for autocomplete where the
            # suggestion has it serve autocomplete too)
            line = mine.fit_line if suggested and mine is not None else pick.fit.line
            option = ModelOption(
                key=pick.spec, kind="catalog", title=f"{e.name} · {pick.quant.name}",
                line=f"{state} · {line} · for {good_for(fitted)}", spec=pick.spec,
                download=0 if (pick.kept or now) else pick.quant.size, serving=now,
                suggested=suggested, entry=e.id)
            if suggested:
                out.insert(0, option)
            else:
                out.append(option)
    on_embedded = embedded is not None and same(serving, embedded.name)
    start_now = ModelOption(
        key="embedded", kind="embedded",
        title="Start now with SmolLM2 135M, the embedded model",
        line=("serving now · " if on_embedded else "") + "no download: small and quick, to "
             "try Shoal out; a larger model answers far better", spec=None,
        serving=on_embedded, suggested=embedded_suggested, entry=embedded_entry)
    if embedded_suggested:
        out.insert(0, start_now)
    else:
        out.append(start_now)
    if serving and not on_embedded and not any(o.serving for o in out):
        out.append(ModelOption(key="current", kind="current", title=f"Keep serving {serving}",
                               line="what this machine serves now", spec=serving,
                               serving=True))
    out.append(ModelOption(key="other", kind="other", title="Other model…",
                           line="a GGUF file on this machine, or a model from Hugging Face "
                                "by its id"))
    return out


def not_offered(fits: FleetFits | None, options: list[ModelOption]) -> int:
    """How many catalog models the options leave out (they do not fit this machine; the
    embeddings models, never offered, are not counted)."""
    if fits is None:
        return 0
    chat = [e for e in fits.catalog.entries if not e.embeddings]
    return len(chat) - len({o.entry for o in options if o.entry})


def beside_line(fits: FleetFits | None) -> str:
    """The models suggested beside this machine's suggested one, each with what it is for
    and its fit line: ``Beside the suggested model, for your editor: Qwen2.5 Coder 0.5B
    Q8_0 for editor autocomplete (fits with …; ~80 tok/s); …``; "" with none."""
    if fits is None:
        return ""
    here = next((m.key for m in fits.machines if m.local), None)
    names = {e.id: e.name for e in fits.catalog.entries}
    parts = [f"{names.get(s.candidate.entry_id, s.candidate.entry_id)} {s.candidate.quant} "
             f"for {ROLE.get(s.role, s.role)} ({s.fit_line})"
             for s in fits.beside if s.machine == here]
    return (f"Beside the suggested model, for your editor: {'; '.join(parts)}." if parts
            else "")


def split_line(fits: FleetFits | None) -> str:
    """The largest catalog model no machine holds alone that the fleet's machines hold
    together, split across those that lend memory (``FleetFits.offers``): ``Larger than
    any one machine: Qwen2.5 Coder 32B Q4_K_M, split across laptop + This machine (30 + 34
    of 64 layers), about 2 tokens/s.``; "" with none."""
    return offer_text(fits, ".") if fits is not None else ""


def default_choice(options: list[ModelOption]) -> int:
    """The suggested model, else what is served now, else the first."""
    suggested = [i for i, o in enumerate(options) if o.suggested]
    serving = [i for i, o in enumerate(options) if o.serving]
    return (suggested or serving or [0])[0]


class OptionRow(QFrame):
    """One choice: a radio button with its title, and a line under it; a click anywhere
    on the row chooses it."""

    def __init__(self, option: ModelOption, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.option = option
        self.setObjectName("modelOption")
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(0)
        top = QHBoxLayout()
        self.radio = QRadioButton(option.title)
        top.addWidget(self.radio)
        if option.suggested:
            badge = QLabel("Suggested for this machine")
            badge.setObjectName("suggested")
            tone(badge, OK_TEXT)
            top.addWidget(badge)
        top.addStretch(1)
        layout.addLayout(top)
        self.line = note(option.line)
        self.line.setContentsMargins(24, 0, 0, 0)
        self.line.setTextInteractionFlags(Qt.TextInteractionFlag.NoTextInteraction)
        layout.addWidget(self.line)

    def mousePressEvent(self, event: QMouseEvent) -> None:
        self.radio.setChecked(True)
        super().mousePressEvent(event)


class ModelOptions(QWidget):
    """The options as radio rows; ``changed`` when the user chooses another."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelOptions")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.list_area = QScrollArea()
        self.list_area.setWidgetResizable(True)
        self.list_area.setFrameShape(QFrame.Shape.NoFrame)
        self.list_area.viewport().setAutoFillBackground(False)
        layout.addWidget(self.list_area, 1)
        self.fixed = QVBoxLayout()
        self.fixed.setSpacing(4)
        layout.addLayout(self.fixed)
        self.rows: list[OptionRow] = []
        self.group = QButtonGroup(self)
        self.group.buttonToggled.connect(self._toggled)
        self._set_body()

    def _toggled(self, _button: QAbstractButton, on: bool) -> None:
        if on:  # the one chosen now (the one left is toggled off first)
            self.changed.emit()

    def _set_body(self) -> None:
        body = QWidget()
        self._list = QVBoxLayout(body)
        self._list.setContentsMargins(0, 0, 0, 0)
        self._list.setSpacing(4)
        self._list.addStretch(1)
        self.list_area.setWidget(body)
        body.setAutoFillBackground(False)  # the card's own background shows through

    def set_options(self, options: list[ModelOption], chosen: str | None) -> None:
        """Show ``options`` with the one keyed ``chosen`` (else the suggested one, else
        the one served now, else the first) chosen."""
        for row in self.rows:
            self.group.removeButton(row.radio)
            if row.option.kind != "catalog":
                self.fixed.removeWidget(row)
                row.deleteLater()
        self.rows = []
        self._set_body()
        self.group.blockSignals(True)
        for option in options:
            row = OptionRow(option)
            self.group.addButton(row.radio)
            if option.kind == "catalog":
                self._list.insertWidget(self._list.count() - 1, row)
            else:
                self.fixed.addWidget(row)
            self.rows.append(row)
        keys = [o.key for o in options]
        pick = keys.index(chosen) if chosen in keys else default_choice(options)
        if self.rows:
            self.rows[pick].radio.setChecked(True)
        self.group.blockSignals(False)
        listed = [r for r in self.rows if r.option.kind == "catalog"][:SHOWN_ROWS]
        self.list_area.setVisible(bool(listed))
        self.list_area.setMinimumHeight(sum(r.sizeHint().height() + 4 for r in listed))

    def chosen(self) -> ModelOption | None:
        return next((r.option for r in self.rows if r.radio.isChecked()), None)

    def choose(self, key: str) -> None:
        for row in self.rows:
            if row.option.key == key:
                row.radio.setChecked(True)

    def keys(self) -> list[str]:
        return [r.option.key for r in self.rows]
