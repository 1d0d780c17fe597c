"""Settings: the ports, discovery and queue limit this machine starts with, how its node holds
the model (memory, KV cache, GPU, unloading when idle) and whether the fleet may choose it,
API keys, where models live, and the app's own choices. The page shows what Shoal holds for
the next start (``Shoal.pending``, ``Shoal.app_settings``), again whenever it changes, and
sends each change to Shoal (``update_settings``), which writes ``config.toml``; ports apply
at the next start, the node's choices when its model next loads (whether the fleet chooses
it: at once), keys at once (the running head watches their files)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, cast

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from app.bridge import ShoalBridge
from app.prefs import Prefs
from app.widgets import (
    Card,
    CopyField,
    PageHeader,
    inline_error,
    note,
    ok_line,
    page_layout,
    run,
    say,
)
from engine.config import NodeMemory
from engine.events import RolesChanged, SettingsChanged, ShoalEvent
from engine.models.pulls.quota import SETTING, parse_quota, quota_value
from engine.settings import (
    FLEET_PORT,
    GPU_DEFAULT,
    GPU_MAX_CHARS,
    HTTP_PORT,
    DiscoveryMode,
    HeadSettings,
    NodeSettings,
    Settings,
    split_hostport,
)
from engine.sizes import Budget, GiB, KvType, Share, amount
from engine.snapshot import FleetSnapshot

if TYPE_CHECKING:
    from engine.service import SettingsChange

DISCOVERY = (("both", "LAN and tailnet"), ("lan", "LAN only (mDNS)"),
             ("tailnet", "Tailnet only (Tailscale)"), ("none", "Off: join by code or address"))
RESTART_NOTE = "Saved. Ports, discovery and the queue limit apply when Shoal next starts."
NODE_NOTE = ("Saved. It applies when the model next loads here: when Shoal next starts, or "
             "when you serve another model.")
NO_NODE = "This machine serves no model: choose one to serve first (Models)."
BUDGET_GIB = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
KV_TYPES = (("f16", "f16 (full quality)"), ("q8_0", "q8_0 (half the memory, more context)"))
GPUS = (("auto", "Automatic"), ("off", "CPU only"))
GPU_TIP = ("Automatic: the GPU with the most free memory, if llama.cpp finds one; CPU only; "
           "or type a device's name from the node's start-up line (Vulkan0). It takes effect "
           "at the node's next start.")
IDLE_MINUTES = (5, 15, 30, 60)
FLEET_CHOOSES = "Let the fleet choose this machine's model"
FLEET_CHOOSES_TIP = ("A head of your fleet may have this machine download and serve another "
                     "model (the split the Models page suggests). Off: only you choose it "
                     "here. It takes effect at once.")
LEND = "Lend this machine's memory to models split across the fleet"
LEND_TIP = ("Another machine of your fleet may run the last layers of a model too large for "
            "it here, within this machine's memory budget (llama.cpp's RPC server, reached "
            "only through the fleet's encrypted link). It takes effect at once.")
LEND_ON_BATTERY = "Lend it on battery power too"
LEND_ON_BATTERY_TIP = ("A split keeps this machine's processor busy for another machine's "
                       "requests, so on its battery it lends nothing unless this is ticked. "
                       "It takes effect at the next split that asks.")
SERVE_KEPT = "Serve every model kept on this machine"
SERVE_KEPT_TIP = ("Besides the model it starts with, this machine serves every model on the "
                  "Models page's list: each loads on the first request that names it, and "
                  "the least recently used unloads when the memory above needs room. It "
                  "takes effect when the model is next loaded.")
FLEET_QUOTA = SETTING  # the row a node's refusal names
FLEET_QUOTA_TIP = ("The disk the models your fleet's heads choose may take here: a size "
                   "(20G) or a share of the disk that holds the models (50%). Past it, the "
                   "least used of them are removed; one that still does not fit is refused. "
                   "Models you chose yourself never count and are never removed. Press Enter "
                   "to save; it takes effect at once.")
KEY_NOTE = ("Shown once: copy it now. Once a key exists, every client must send one "
            "(Authorization: Bearer KEY); revoke a key to shut its holder out.")


def budget_choices(now: Budget, total: int, default: int) -> list[tuple[Budget, str]]:
    """The memory budgets offered: the default share, whole sizes up to this machine's RAM,
    and the one chosen now (from config.toml or the command line) where it is none of
    those."""
    choices: list[tuple[Budget, str]] = [(None, f"Default: {amount(default)} of "
                                                f"{amount(total)}")]
    choices += [(g * GiB, amount(g * GiB)) for g in BUDGET_GIB if g * GiB <= total]
    if isinstance(now, Share):
        choices.append((now, f"{now} of this machine's RAM "
                             f"({amount(int(total * now.percent / 100))})"))
    elif now is not None and now not in (b for b, _ in choices):
        choices.append((now, amount(now)))
        choices[1:] = sorted(choices[1:], key=lambda c: c[0] if isinstance(c[0], int) else 0)
    return choices


def idle_choices(now: float | None) -> list[tuple[float | None, str]]:
    """When the idle model unloads: the usual waits, never, and the one chosen now."""
    choices: list[tuple[float | None, str]] = [(m * 60.0, f"after {m} minutes")
                                               for m in IDLE_MINUTES]
    if now is not None and now not in (s for s, _ in choices):
        choices.append((now, f"after {now / 60:g} minutes"))
        choices.sort(key=lambda c: c[0] or 0.0)
    return [*choices, (None, "never")]


def gpu_choices(now: str, device: str) -> list[tuple[str, str]]:
    """The GPUs offered (value, label): automatic, CPU only, the device the node runs
    on now (its name, "Vulkan0" of "Vulkan0 (NVIDIA ...)"), and the one chosen now where
    it is none of those."""
    choices = list(GPUS)
    for name in (device.split(" ", 1)[0], now):
        if name and name not in (value for value, _ in choices):
            choices.append((name, name))
    return choices


def port_of(address: str | None, default: int) -> int:
    if not address:
        return default
    try:
        return split_hostport(address, default)[1]
    except ValueError:
        return default


def form_layout() -> QFormLayout:
    form = QFormLayout()
    form.setHorizontalSpacing(16)
    form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
    return form


def combo(name: str, items: tuple[tuple[str, str], ...] = ()) -> QComboBox:
    """A choice named ``name`` of ``items`` (value, label)."""
    box = QComboBox()
    box.setObjectName(name)
    for value, label in items:
        box.addItem(label, value)
    return box


def fill(box: QComboBox, labels: list[str], current: int) -> None:
    """``box`` holding ``labels`` with ``current`` chosen (shown, not chosen by the user:
    `activated` fires only for a person's choice)."""
    if [box.itemText(i) for i in range(box.count())] != labels:
        box.clear()
        box.addItems(labels)
    box.setCurrentIndex(current)


class SettingsPage(QWidget):
    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        layout = page_layout(self)
        layout.addWidget(PageHeader("Settings", "How this machine runs Shoal."))

        machine = Card("This machine")
        form = form_layout()
        self.http_port = QSpinBox()
        self.http_port.setObjectName("httpPort")
        self.http_port.setRange(1, 65535)
        self.fleet_port = QSpinBox()
        self.fleet_port.setObjectName("fleetPort")
        self.fleet_port.setRange(1, 65535)
        self.discovery = combo("discovery", DISCOVERY)
        self.queue = QDoubleSpinBox()
        self.queue.setObjectName("queueTimeout")
        self.queue.setRange(1, 600)
        self.queue.setDecimals(0)
        self.queue.setSuffix(" s")
        for w in (self.http_port, self.fleet_port, self.queue):
            w.setMinimumWidth(120)
        form.addRow("API port (on 127.0.0.1)", self.http_port)
        form.addRow("Fleet port (machines join here)", self.fleet_port)
        form.addRow("Find other machines on", self.discovery)
        form.addRow("Wait for a free lane up to", self.queue)
        machine.body.addLayout(form)
        self.save = QPushButton("Save")
        self.save.setObjectName("saveSettings")
        self.save.clicked.connect(self.save_machine)
        self.saved = ok_line()
        machine.row(self.save, self.saved, None)
        self.error = inline_error()
        machine.add(self.error)
        layout.addWidget(machine)

        serving = Card("The model on this machine")
        form = form_layout()
        self.budget = combo("memoryBudget")
        self.kv = combo("kvType", KV_TYPES)
        # editable: a device's name can be typed, as --gpu takes it
        self.gpu = combo("gpu")
        self.gpu.setEditable(True)
        self.gpu.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.gpu.setMinimumWidth(160)
        gpu_line = self.gpu.lineEdit()
        assert gpu_line is not None  # editable
        gpu_line.setMaxLength(GPU_MAX_CHARS)
        self.idle = combo("idleUnload")
        form.addRow("Memory Shoal may use on this machine", self.budget)
        form.addRow("KV cache", self.kv)
        form.addRow("GPU", self.gpu)
        form.addRow("Unload the model when idle", self.idle)
        serving.body.addLayout(form)
        serving.add(note("The model and the cache of every conversation share that memory. "
                         "An unloaded model loads again on the next request."))
        self.serve_kept = QCheckBox(SERVE_KEPT)
        self.serve_kept.setObjectName("serveKept")
        self.serve_kept.setToolTip(SERVE_KEPT_TIP)
        self.serve_kept.toggled.connect(lambda on: self._node_change(serve_kept=on))
        serving.add(self.serve_kept)
        self.fleet_chooses = QCheckBox(FLEET_CHOOSES)
        self.fleet_chooses.setObjectName("fleetChoosesModel")
        self.fleet_chooses.toggled.connect(self._fleet_chooses_changed)
        serving.add(self.fleet_chooses)
        self.lend = QCheckBox(LEND)
        self.lend.setObjectName("lendMemory")
        self.lend.toggled.connect(self._lend_changed)
        serving.add(self.lend)
        self.lend_on_battery = QCheckBox(LEND_ON_BATTERY)
        self.lend_on_battery.setObjectName("lendOnBattery")
        self.lend_on_battery.toggled.connect(self._lend_on_battery_changed)
        serving.add(self.lend_on_battery)
        self.fleet_quota = QLineEdit()
        self.fleet_quota.setObjectName("fleetModelsQuota")
        self.fleet_quota.setMaximumWidth(160)
        self.fleet_quota.editingFinished.connect(self._quota_entered)
        quota_form = form_layout()
        quota_form.addRow(FLEET_QUOTA, self.fleet_quota)
        serving.body.addLayout(quota_form)
        self._budgets: list[Budget] = []
        self._idles: list[float | None] = []
        self._gpu_now = GPU_DEFAULT  # as the node's next start has it
        self._device = ""  # the device the node runs on now ("" the CPU, or none runs)
        self.budget.activated.connect(
            lambda i: self._node_change(memory_budget=self._budgets[i] or 0))
        self.kv.activated.connect(lambda i: self._node_change(kv_type=self.kv.itemData(i)))
        self.gpu.activated.connect(lambda _i: self._gpu_entered())
        gpu_line.editingFinished.connect(self._gpu_entered)
        self.idle.activated.connect(
            lambda i: self._node_change(idle_unload_s=self._idles[i] or 0.0))
        self.node_saved = ok_line()
        serving.add(self.node_saved)
        self.node_error = inline_error()
        serving.add(self.node_error)
        layout.addWidget(serving)

        keys = Card("API keys")
        keys.add(note("Without keys, only programs on this machine reach the API (it listens "
                      "on 127.0.0.1). Issue a key per person or program to control access."))
        self.key_name = QLineEdit()
        self.key_name.setObjectName("keyName")
        self.key_name.setPlaceholderText("a name: alice, ci, laptop")
        self.issue = QPushButton("Issue key")
        self.issue.setObjectName("issueKey")
        self.issue.clicked.connect(self.issue_key)
        self.revoke = QPushButton("Revoke")
        self.revoke.setObjectName("revokeKey")
        self.revoke.clicked.connect(self.revoke_key)
        keys.row(self.key_name, self.issue, self.revoke)
        self.key = CopyField()
        self.key.setObjectName("issuedKey")
        self.key.hide()
        keys.add(self.key)
        self.key_note = note(KEY_NOTE)
        self.key_note.hide()
        keys.add(self.key_note)
        self.key_done = ok_line()
        keys.add(self.key_done)
        self.key_error = inline_error()
        keys.add(self.key_error)
        layout.addWidget(keys)

        models = Card("Models")
        self.models_dir = str(bridge.shoal.settings.models_dir)
        where = QLabel(f"Downloaded models live in {self.models_dir}")
        where.setObjectName("modelsDir")
        where.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        open_dir = QPushButton("Open folder")
        open_dir.clicked.connect(self.open_models_dir)
        models.row(where, None, open_dir)
        layout.addWidget(models)

        app = Card("App")
        self.notify = QCheckBox("Notify me when a machine joins or leaves, or a request fails")
        self.notify.setObjectName("notify")
        self.notify.toggled.connect(self.notify_changed)
        app.add(self.notify)
        layout.addWidget(app)
        layout.addStretch(1)

        self.show_settings(bridge.shoal.pending)
        self.show_prefs()
        self._snapshot(bridge.last)
        bridge.event.connect(self._event)
        bridge.snapshot.connect(self._snapshot)

    def _event(self, event: ShoalEvent) -> None:
        if isinstance(event, SettingsChanged):
            self.show_settings(self._bridge.shoal.pending)
            self.show_prefs()
        elif isinstance(event, RolesChanged):
            self._fleet_port_state(self._bridge.shoal.pending)

    def _snapshot(self, snap: FleetSnapshot) -> None:
        node = snap.roles.node
        device = node.device if node is not None else ""
        if device != self._device:
            self._device = device
            self._show_gpu()

    def show_prefs(self) -> None:
        prefs = Prefs.from_table(self._bridge.shoal.app_settings)
        if self.notify.isChecked() != prefs.notify:
            self.notify.blockSignals(True)  # shown, not chosen
            self.notify.setChecked(prefs.notify)
            self.notify.blockSignals(False)

    def _fleet_port_state(self, s: Settings) -> None:
        head = s.head or HeadSettings()
        # the head takes joins once this machine starts or joins a fleet (on the default
        # port); a stored port would open it to joins at the next start, so only then
        self.fleet_port.setEnabled(head.fleet_listen is not None)
        self.fleet_port.setToolTip("" if head.fleet_listen is not None else
                                   "Start or join a fleet first: its port can change then.")

    def show_settings(self, s: Settings) -> None:
        head = s.head or HeadSettings()
        self.http_port.setValue(port_of(head.http, HTTP_PORT))
        self.fleet_port.setValue(port_of(head.fleet_listen, FLEET_PORT))
        self._fleet_port_state(s)
        index = self.discovery.findData(s.discovery.mode)
        self.discovery.setCurrentIndex(max(index, 0))
        self.queue.setValue(head.queue_timeout_s)
        self._show_node(s.node)

    def _show_node(self, node: NodeSettings | None) -> None:
        """How the node will hold its model (as the next start of the node has it)."""
        for box in (self.budget, self.kv, self.gpu, self.idle, self.serve_kept,
                    self.fleet_chooses, self.fleet_quota, self.lend):
            box.setEnabled(node is not None)
            box.setToolTip("" if node is not None else NO_NODE)
        if node is not None:
            self.gpu.setToolTip(GPU_TIP)
            self.fleet_chooses.setToolTip(FLEET_CHOOSES_TIP)
            self.fleet_quota.setToolTip(FLEET_QUOTA_TIP)
            self.serve_kept.setToolTip(SERVE_KEPT_TIP)
            self.lend.setToolTip(LEND_TIP)
        node = node or NodeSettings()
        if self.lend.isChecked() != node.lend:
            self.lend.blockSignals(True)  # shown, not chosen
            self.lend.setChecked(node.lend)
            self.lend.blockSignals(False)
        if self.lend_on_battery.isChecked() != node.lend_on_battery:
            self.lend_on_battery.blockSignals(True)
            self.lend_on_battery.setChecked(node.lend_on_battery)
            self.lend_on_battery.blockSignals(False)
        self.lend_on_battery.setEnabled(node.lend and self.lend.isEnabled())
        self.lend_on_battery.setToolTip(LEND_ON_BATTERY_TIP if self.lend.isEnabled()
                                        else NO_NODE)
        if not self.fleet_quota.isModified():  # left as it is while a person types
            self.fleet_quota.setText(str(quota_value(node.fleet_models_quota)))
        if self.serve_kept.isChecked() != node.serve_kept:
            self.serve_kept.blockSignals(True)  # shown, not chosen
            self.serve_kept.setChecked(node.serve_kept)
            self.serve_kept.blockSignals(False)
        if self.fleet_chooses.isChecked() != node.fleet_may_choose_model:
            self.fleet_chooses.blockSignals(True)  # shown, not chosen
            self.fleet_chooses.setChecked(node.fleet_may_choose_model)
            self.fleet_chooses.blockSignals(False)
        mem = self._bridge.shoal.memory
        budgets = budget_choices(node.memory_budget, mem.total, mem.default_budget)
        idles = idle_choices(node.idle_unload_s)
        fill(self.budget, [label for _, label in budgets],
             [b for b, _ in budgets].index(node.memory_budget))
        fill(self.idle, [label for _, label in idles], [i for i, _ in idles].index(
            node.idle_unload_s))
        self._budgets, self._idles = [b for b, _ in budgets], [i for i, _ in idles]
        self.kv.setCurrentIndex(max(self.kv.findData(node.kv_type), 0))
        self._gpu_now = node.gpu
        self._show_gpu()

    def _show_gpu(self) -> None:
        """The GPU chosen for the node's next start, among those offered (left as it is
        while a person types a name)."""
        line = self.gpu.lineEdit()
        if line is not None and line.isModified():
            return
        choices = gpu_choices(self._gpu_now, self._device)
        fill(self.gpu, [label for _, label in choices],
             [value for value, _ in choices].index(self._gpu_now))

    def _gpu_entered(self) -> None:
        """A GPU chosen from the list, or a name typed (Enter, or leaving the box)."""
        text = self.gpu.currentText().strip()
        value = {label: value for value, label in GPUS}.get(text, text)
        line = self.gpu.lineEdit()
        if line is not None:
            line.setModified(False)
        if value == self._gpu_now or not value:
            self._show_gpu()  # nothing changed: shown as Shoal holds it
            return
        self._node_change(gpu=value)

    def _node_change(self, *, memory_budget: int | Share | None = None,
                     kv_type: KvType | None = None, gpu: str | None = None,
                     idle_unload_s: float | None = None,
                     serve_kept: bool | None = None) -> None:
        """How the node holds its model, changed (memory_budget 0: the default share;
        idle_unload_s 0: never; serve_kept: every model kept here too)."""
        say(self.node_saved, "")
        say(self.node_error, "")
        shoal = self._bridge.shoal

        def saved(_change: SettingsChange) -> None:
            now, later = shoal.settings.node, shoal.pending.node
            waits = (now is not None and later is not None
                     and NodeMemory.of(now) != NodeMemory.of(later))
            say(self.node_saved, NODE_NOTE if waits else "Saved.")

        def failed(line: str) -> None:
            say(self.node_error, line)
            self._show_gpu()  # a name refused: shown again as Shoal holds it

        run(self, self._bridge, shoal.update_settings(
            memory_budget=memory_budget, kv_type=kv_type, gpu=gpu, idle_unload_s=idle_unload_s,
            serve_kept=serve_kept),
            done=saved, failed=failed, anytime=True)

    def _lend_changed(self, on: bool) -> None:
        self._at_once(self._bridge.shoal.update_settings(lend=on))

    def _lend_on_battery_changed(self, on: bool) -> None:
        self._at_once(self._bridge.shoal.update_settings(lend_on_battery=on))

    def _at_once(self, change: Awaitable[SettingsChange]) -> None:
        """A choice in force at once on the running node (lend, and lend on battery too)."""
        say(self.node_saved, "")
        say(self.node_error, "")
        shoal = self._bridge.shoal

        def saved(_change: SettingsChange) -> None:
            say(self.node_saved, "Saved.")
            self._show_node(shoal.settings.node)  # the battery box follows the lend box

        def failed(line: str) -> None:
            say(self.node_error, line)
            self._show_node(shoal.pending.node)  # shown as Shoal holds it

        run(self, self._bridge, change, done=saved, failed=failed, anytime=True)

    def _fleet_chooses_changed(self, on: bool) -> None:
        say(self.node_saved, "")
        say(self.node_error, "")

        def failed(line: str) -> None:
            say(self.node_error, line)
            self._show_node(self._bridge.shoal.pending.node)  # shown as Shoal holds it

        run(self, self._bridge, self._bridge.shoal.update_settings(fleet_may_choose_model=on),
            done=lambda _change: say(self.node_saved, "Saved."), failed=failed, anytime=True)

    def _quota_entered(self) -> None:
        """The fleet models' quota typed (Enter, or leaving the box): in force at once."""
        if not self.fleet_quota.isModified():
            return
        self.fleet_quota.setModified(False)
        say(self.node_saved, "")
        say(self.node_error, "")
        shoal = self._bridge.shoal

        def failed(line: str) -> None:
            say(self.node_error, line)
            self._show_node(shoal.pending.node)  # shown as Shoal holds it

        try:
            quota = parse_quota(self.fleet_quota.text())
        except ValueError as exc:
            failed(str(exc))
            return
        run(self, self._bridge, shoal.update_settings(fleet_models_quota=quota),
            done=lambda _change: say(self.node_saved, "Saved."), failed=failed, anytime=True)

    def save_machine(self) -> None:
        say(self.saved, "")
        say(self.error, "")

        def saved(change: SettingsChange) -> None:
            say(self.saved, RESTART_NOTE if change.restart_needed else "Saved.")

        shoal = self._bridge.shoal
        run(self, self._bridge, shoal.update_settings(
            http_port=self.http_port.value(),
            fleet_port=self.fleet_port.value() if self.fleet_port.isEnabled() else None,
            discovery=cast(DiscoveryMode, self.discovery.currentData()),
            queue_timeout_s=float(self.queue.value())),
            done=saved, failed=lambda line: say(self.error, line), anytime=True)

    def issue_key(self) -> None:
        name = self.key_name.text().strip()
        say(self.key_done, "")
        say(self.key_error, "")
        if not name:
            say(self.key_error, "Give the key a name first (who or what will use it).")
            return

        def issued(key: str) -> None:
            self.key.set_text(key)
            self.key.show()
            self.key_note.show()

        run(self, self._bridge, self._bridge.shoal.keys.issue(name), done=issued,
            failed=lambda line: say(self.key_error, line))

    def revoke_key(self) -> None:
        name = self.key_name.text().strip()
        say(self.key_done, "")
        say(self.key_error, "")
        if not name:
            say(self.key_error, "Write the name of the key to revoke.")
            return

        def revoked(now: bool) -> None:
            self.key.hide()
            self.key_note.hide()
            say(self.key_done, f"{name}'s key is revoked." if now else
                f"{name}'s key was already revoked.")

        run(self, self._bridge, self._bridge.shoal.keys.revoke(name), done=revoked,
            failed=lambda line: say(self.key_error, line))

    def open_models_dir(self) -> None:
        QDesktopServices.openUrl(QUrl.fromLocalFile(self.models_dir))

    def notify_changed(self, on: bool) -> None:
        run(self, self._bridge, self._bridge.shoal.update_settings(app={"notify": on}),
            failed=lambda line: say(self.error, line), anytime=True)
