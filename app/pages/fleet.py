"""Fleet: this machine's roles at the top, then every node of the fleet as it is now (a row
per node, updated in place once a second: its memory against its budget, and whether its
model sleeps), then the heads."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.bridge import ShoalBridge
from app.widgets import (
    BarDelegate,
    Card,
    Cell,
    CopyField,
    PageHeader,
    Row,
    RowsModel,
    ago,
    fit_rows,
    heading,
    millis,
    muted,
    note,
    page_layout,
    run,
    table,
    tokens,
)
from engine.sizes import amount
from engine.snapshot import LENT, FleetSnapshot, HeadSnapshot, NodeSnapshot, offload_text

NODE_COLUMNS = ("Node", "Address", "Link", "State", "Model", "Runtime", "Device", "Context",
                "Lanes", "KV cache", "Memory", "Tokens/s", "TTFT", "Last seen")
HEAD_COLUMNS = ("Head", "Address", "Link")
LINKS = {"local": "this machine", "joined": "joined", "dialed": "dialed"}
STATE_TONE = {"ready": "good", "paused": "muted", "failing": "bad", "connecting": "warn",
              "unreachable": "bad", "left": "muted"}
# a ready node whose model sleeps: unloaded while idle, or loading again for a request
SLEEP = {"asleep": ("asleep", "muted", "The model is unloaded while the node is idle; the "
                    "next request loads it again."),
         "waking": ("waking", "warn", "The model is loading again for a request.")}
SERVING = {"off": "Not serving", "loading": "Loading the model…", "serving": "Serving",
           "paused": "Paused", "failed": "Failed"}


KEPT_STATE = {"loaded": "loaded", "loading": "loading…", "unloaded": "on disk"}


def model_cell(n: NodeSnapshot) -> Cell:
    """Its first model, and how many it serves besides (each one's state in the tip)."""
    if not n.kept:
        return Cell(n.model)
    lines = [f"{k.name}: {KEPT_STATE[k.state]}"
             + (f", {amount(k.memory)}" if k.state == "loaded" and k.memory else "")
             for k in n.kept]
    loaded = sum(1 for k in n.kept if k.state == "loaded")
    return Cell(f"{n.model} +{len(n.kept)}", tip=f"Also serves, loaded on demand "
                f"({loaded} loaded now):\n" + "\n".join(lines))


def state_cell(n: NodeSnapshot) -> Cell:
    """Its link's state, or, linked, whether its model sleeps or another model loads."""
    loading = [k.name for k in n.kept if k.state == "loading"]
    if n.state == "ready" and loading:
        return Cell(f"loading {', '.join(loading)}", tone="warn",
                    tip="A model it keeps is loading for a request.")
    if n.state == "ready" and n.sleep in SLEEP:
        text, tone, tip = SLEEP[n.sleep]
        return Cell(text, tone=tone, tip=tip)
    if n.state == "failing":  # with the cause the node gave
        return Cell(f"failing: {n.error or '?'}", tone="bad", tip=n.error or "")
    return Cell(n.state, tone=STATE_TONE.get(n.state, ""), tip=n.error or "")


def memory_cell(n: NodeSnapshot) -> Cell:
    """``412 MiB of 12 GiB``: what the node uses of its budget (a node that says neither: —)."""
    if n.mem_budget <= 0:
        return Cell(amount(n.mem_used) if n.mem_used > 0 else "—", right=True)
    return Cell(f"{amount(n.mem_used)} of {amount(n.mem_budget)}", right=True,
                tip=f"{100 * n.mem_used / n.mem_budget:.0f}% of the memory budget in use")


def device_cell(n: NodeSnapshot) -> Cell:
    """Where its model runs: ``CPU``, or the GPU and how much of the model is on it."""
    if not n.device:
        return Cell("CPU", tip="The model runs on the CPU.")
    tip = n.device
    if n.model_layers > 0:
        where = "there (memory another machine lends)" if LENT in n.device else "on the GPU"
        tip += f"\n{min(n.gpu_layers, n.model_layers)} of {n.model_layers} layers {where}"
    return Cell(offload_text(n.device, n.gpu_layers, n.model_layers), tip=tip)


def kv_tip(n: NodeSnapshot) -> str:
    tip = f"{n.kv_used:,} of {n.kv_total:,} cells"
    if n.kv_parked:
        tip += f", {n.kv_parked:,} of them kept for conversations that may come back"
    if n.max_prompt:
        tip += f"; takes a prompt of up to {n.max_prompt:,} tokens now"
    return tip


def node_row(n: NodeSnapshot, now: float) -> Row:
    seen = "never" if n.last_seen <= 0 else ago(now - n.last_seen)
    if n.link == "local" and n.state == "ready":
        seen = "now"
    return (Cell(n.identity or "(connecting)", tip=n.error or ""),
            Cell(n.address),
            Cell(LINKS.get(n.link, n.link)),
            state_cell(n),
            model_cell(n),
            Cell(n.runtime),
            device_cell(n),
            Cell(tokens(n.context_window) if n.context_window else "—", right=True),
            Cell(f"{min(n.lanes_busy, n.lanes)}/{n.lanes}", right=True),
            Cell("", bar=n.kv_percent, tip=kv_tip(n)),
            memory_cell(n),
            Cell(f"{n.decode_tps:.0f}" if n.decode_tps > 0 else "—", right=True,
                 tip=f"prefill {n.prefill_tps:.0f} tokens/s" if n.prefill_tps > 0 else ""),
            Cell(millis(n.ttft_ms), right=True),
            Cell(seen))


def head_row(h: HeadSnapshot) -> Row:
    shown = h.name or "(connecting)"
    name = f"{shown} (this machine)" if h.this_machine else shown
    link = "this machine" if h.this_machine else "linked" if h.linked else "not linked"
    return (Cell(name, tip=f"head id {h.head_id}" if h.head_id else ""), Cell(h.address or "—"),
            Cell(link, tone="" if h.linked or h.this_machine else "warn"))


class Stat(QWidget):
    """A number and what it counts (the summary line above the table)."""

    def __init__(self, label: str) -> None:
        super().__init__()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 24, 0)
        layout.setSpacing(0)
        self.value = heading("—", 1.6)
        self.value.setObjectName("stat")
        self.label = muted(QLabel(label))
        layout.addWidget(self.value)
        layout.addWidget(self.label)


class FleetPage(QWidget):
    navigate = Signal(str)  # a page to show
    join = Signal()  # the user asked to join a fleet

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bridge = bridge
        layout = page_layout(self)
        layout.addWidget(PageHeader("Fleet", "Every machine serving in your fleet, live."))

        roles = Card("This machine")
        self.api = CopyField()
        self.api.setObjectName("apiUrl")
        self.api_off = QLabel("The API is off on this machine.")
        self.api_on = QPushButton("Run the API here")
        self.api_on.clicked.connect(lambda: run(self, bridge, bridge.shoal.set_head(True)))
        roles.row(self._label("API"), self.api, self.api_off, self.api_on, None)
        self.serving = QLabel()
        self.serving.setObjectName("serving")
        self.pause = QPushButton()
        self.pause.setObjectName("pause")
        self.pause.clicked.connect(self._toggle_pause)
        roles.row(self._label("Node"), self.serving, None, self.pause)
        self.fleet = QLabel()
        self.fleet.setObjectName("fleetName")
        self.start = QPushButton("Start a fleet…")
        self.start.clicked.connect(lambda: self.navigate.emit("pairing"))
        self.join_button = QPushButton("Join a fleet…")
        self.join_button.clicked.connect(self.join.emit)
        roles.row(self._label("Fleet"), self.fleet, None, self.start, self.join_button)
        layout.addWidget(roles)

        stats = QWidget()
        line = QHBoxLayout(stats)
        line.setContentsMargins(4, 0, 0, 0)
        self.stat_nodes, self.stat_lanes = Stat("nodes ready"), Stat("lanes busy")
        self.stat_queued, self.stat_moves = Stat("queued"), Stat("moved mid-answer")
        for s in (self.stat_nodes, self.stat_lanes, self.stat_queued, self.stat_moves):
            line.addWidget(s)
        line.addStretch(1)
        layout.addWidget(stats)

        self.nodes = RowsModel(NODE_COLUMNS, self)
        self.node_view = table(self.nodes, stretch=NODE_COLUMNS.index("Model"))
        self.node_view.setObjectName("nodes")
        self.node_view.setItemDelegateForColumn(NODE_COLUMNS.index("KV cache"),
                                                BarDelegate(self.node_view))
        layout.addWidget(self.node_view, 3)
        self.empty = note("No node is linked yet: this machine's own node appears here once "
                          "its model has loaded; other machines appear when they join.")
        layout.addWidget(self.empty)

        layout.addWidget(heading("Heads", 1.1))
        self.heads = RowsModel(HEAD_COLUMNS, self)
        self.head_view = table(self.heads, stretch=0)
        self.head_view.setObjectName("heads")
        layout.addWidget(self.head_view)
        bridge.snapshot.connect(self.render)
        self.render(bridge.last)

    @staticmethod
    def _label(text: str) -> QLabel:
        label = muted(QLabel(text))
        label.setFixedWidth(64)
        return label

    def _toggle_pause(self) -> None:
        node = self._bridge.last.roles.node
        if node is not None:
            run(self, self._bridge, self._bridge.shoal.pause_serving(node.state != "paused"))

    def render(self, snap: FleetSnapshot) -> None:
        roles = snap.roles
        down = self._bridge.start_error is not None  # a failed start: the banner says why
        self.api.setVisible(roles.api_url is not None)
        self.api_off.setVisible(roles.api_url is None)
        self.api_off.setText("Shoal is not running (the line above says why)." if down
                             else "The API is off on this machine.")
        self.api_on.setVisible(roles.api_url is None and not down)
        if roles.api_url is not None:
            self.api.set_text(roles.api_url)
        node = roles.node
        if node is None:
            self.serving.setText("Not serving: Shoal is not running" if down
                                 else "No model on this machine")
            self.pause.hide()
        else:
            state = SERVING.get(node.state, node.state)
            detail = f" {node.model} · {node.lanes} lanes" if node.state != "off" else ""
            mine = next((n for n in snap.nodes if n.link == "local"), None)
            if mine is not None and mine.sleep in SLEEP and node.state == "serving":
                detail += f" · {SLEEP[mine.sleep][0]}"
            if node.error:
                detail += f" — {node.error}"
            self.serving.setText(state + detail)
            self.pause.setVisible(node.state in ("serving", "paused"))
            self.pause.setText("Resume serving" if node.state == "paused" else "Pause serving")
        if snap.fleet_name:
            member = " (joined)" if roles.member else ""
            self.fleet.setText(f"{snap.fleet_name}{member}")
        else:
            self.fleet.setText("Not in a fleet")
        self.start.setVisible(not snap.has_token)
        self.join_button.setVisible(not roles.member)

        self.stat_nodes.value.setText(f"{snap.ready_nodes}/{len(snap.nodes)}")
        self.stat_lanes.value.setText(f"{snap.lanes_busy}/{snap.lanes}")
        self.stat_queued.value.setText(str(snap.queued))
        self.stat_moves.value.setText(str(snap.moves))
        # this machine first, then by key: a row never moves while the fleet changes
        order = sorted(snap.nodes, key=lambda n: (n.link != "local", n.key))
        self.nodes.set_rows([(n.key, node_row(n, snap.at)) for n in order])
        self.empty.setVisible(not snap.nodes)
        heads = sorted(snap.heads, key=lambda h: (not h.this_machine, h.name, h.address))
        self.heads.set_rows([(h.head_id or h.address, head_row(h)) for h in heads])
        fit_rows(self.head_view, len(heads), least=1, most=4)
