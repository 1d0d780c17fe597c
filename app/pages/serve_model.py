"""Which model this machine serves: the embedded default (ready with no network), a GGUF
file on disk, or a model id pulled from Hugging Face with a progress bar and a Cancel
button. Used by the Models page and by the first-run welcome."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QGridLayout,
    QHBoxLayout,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.join import in_the_app
from app.widgets import choose_file, inline_error, note, ok_line, run, say
from engine.events import PullProgress, ShoalEvent
from engine.models.pulls.text import pace
from engine.sizes import amount

EMBEDDED, FILE, HUB = 0, 1, 2


class ServeModel(QWidget):
    served = Signal(str)  # the name of the model now served here
    started = Signal()  # a model is being got ready
    failed = Signal(str)  # it could not be: the line shown

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        self._busy = False
        self._pull: str | None = None  # the pull under way, as the engine names it
        self._spec: str | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(8)
        # the ways to name a model, and their button; a page that names the model itself
        # (the catalog) may hide them and call serve_spec
        self.choices = QWidget()
        choices = QVBoxLayout(self.choices)
        choices.setContentsMargins(0, 0, 0, 0)
        choices.setSpacing(8)
        grid = QGridLayout()
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(6)
        self.choice = QButtonGroup(self)
        self.embedded = QRadioButton("The embedded default: SmolLM2 135M, small and ready "
                                     "with no network")
        self.file = QRadioButton("A GGUF file on this machine")
        self.hub = QRadioButton("A model from Hugging Face")
        for i, button in enumerate((self.embedded, self.file, self.hub)):
            self.choice.addButton(button, i)
        self.embedded.setChecked(True)
        self.path = QLineEdit()
        self.path.setObjectName("ggufPath")
        self.path.setPlaceholderText("/path/to/model.gguf")
        self.browse = QPushButton("Choose…")
        self.browse.clicked.connect(self._browse)
        self.model_id = QLineEdit()
        self.model_id.setObjectName("modelId")
        self.model_id.setPlaceholderText("org/repo:Q4_K_M")
        self.path.textEdited.connect(lambda _t: self.file.setChecked(True))
        self.model_id.textEdited.connect(lambda _t: self.hub.setChecked(True))
        grid.addWidget(self.embedded, 0, 0, 1, 3)
        grid.addWidget(self.file, 1, 0)
        grid.addWidget(self.path, 1, 1)
        grid.addWidget(self.browse, 1, 2)
        grid.addWidget(self.hub, 2, 0)
        grid.addWidget(self.model_id, 2, 1, 1, 2)
        grid.setColumnStretch(1, 1)
        choices.addLayout(grid)

        actions = QHBoxLayout()
        self.serve = QPushButton("Serve this model")
        self.serve.setObjectName("serve")
        self.serve.clicked.connect(self.start)
        actions.addWidget(self.serve)
        actions.addStretch(1)
        choices.addLayout(actions)
        layout.addWidget(self.choices)

        self.progress_row = QWidget()
        row = QHBoxLayout(self.progress_row)
        row.setContentsMargins(0, 0, 0, 0)
        self.progress = QProgressBar()
        self.progress.setObjectName("pullProgress")
        self.progress.setTextVisible(False)
        self.progress_text = note("")
        self.progress_text.setObjectName("pullText")
        self.cancel = QPushButton("Cancel")
        self.cancel.setObjectName("cancelPull")
        self.cancel.clicked.connect(self.cancel_pull)
        row.addWidget(self.progress, 1)
        row.addWidget(self.cancel)
        layout.addWidget(self.progress_row)
        layout.addWidget(self.progress_text)
        self.progress_row.hide()
        self.progress_text.hide()
        self.error = inline_error()
        layout.addWidget(self.error)
        self.ok = ok_line()
        layout.addWidget(self.ok)
        bridge.event.connect(self._event)

    @property
    def busy(self) -> bool:
        return self._busy

    def _browse(self) -> None:
        choose_file(self, "Choose a GGUF model", "GGUF models (*.gguf);;All files (*)",
                    self._chosen)

    def _chosen(self, path: str) -> None:
        self.path.setText(path)
        self.file.setChecked(True)

    def spec(self) -> tuple[str | None, str]:
        """(the spec for set_model, an error line; empty when the choice is complete)."""
        which = self.choice.checkedId()
        if which == FILE:
            path = self.path.text().strip()
            return (path, "") if path else (None, "Choose a .gguf file first.")
        if which == HUB:
            mid = self.model_id.text().strip()
            if "/" not in mid:
                return None, "Write a model id as org/repo, or org/repo:QUANT (like " \
                             "bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M)."
            return mid, ""
        return None, ""

    def start(self) -> None:
        """Serve the model the choices name."""
        if self._busy:
            return
        spec, problem = self.spec()
        say(self.ok, "")
        say(self.error, problem)
        if problem:
            return
        self.serve_spec(spec)

    def serve_spec(self, spec: str | None) -> None:
        """Serve ``spec`` here (None: the embedded default), pulling it with progress."""
        if self._busy:
            return
        say(self.ok, "")
        say(self.error, "")
        self._busy, self._spec, self._pull = True, spec, None
        self.started.emit()
        self.serve.setEnabled(False)
        self.progress.setRange(0, 0)  # busy until the size is known
        self.progress_row.show()
        self.cancel.setEnabled(True)
        say(self.progress_text, f"Getting {spec or 'the embedded model'} ready…")
        run(self, self._bridge, self._bridge.shoal.set_model(spec), done=self._done,
            failed=self._failed)

    def cancel_pull(self) -> None:
        if not self._busy:
            return
        self._bridge.shoal.cancel_pull(self._pull or self._spec or "")
        self.cancel.setEnabled(False)
        say(self.progress_text, "Cancelling… what was downloaded is removed.")

    def _event(self, event: ShoalEvent) -> None:
        if not self._busy or not isinstance(event, PullProgress):
            return
        if event.state != "running":
            return
        self._pull = event.model
        if event.total_bytes > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * event.done_bytes / event.total_bytes))
            text = f"{amount(event.done_bytes)} of {amount(event.total_bytes)}"
        else:
            text = f"{amount(event.done_bytes)}" if event.done_bytes else "Starting…"
        text += "".join(f", {part}" for part in pace(event.rate_bps, event.eta_s))
        say(self.progress_text, f"Downloading {event.model}: {text}"
            + (f" — {event.message}" if event.message else ""))

    def _finish(self) -> None:
        self._busy = False
        self.serve.setEnabled(True)
        self.progress_row.hide()
        say(self.progress_text, "")

    def _done(self, name: str) -> None:
        self._finish()
        say(self.ok, f"Now serving {name}.")
        self.served.emit(name)  # Shoal keeps it for the next start too

    def _failed(self, line: str) -> None:
        line = in_the_app(line)
        self._finish()
        say(self.error, line)
        self.failed.emit(line)
