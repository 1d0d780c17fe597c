"""A running Shoal's state at one moment, as frozen dataclasses.

`Shoal.snapshot()` builds one; `GET /v1/fleet` and the app's window render the same
thing. Nothing here refers back into the engine: a snapshot can be kept, compared and
handed to another thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

NodeState = Literal["connecting", "ready", "paused", "failing", "unreachable", "left"]
LinkKind = Literal["dialed", "joined", "local"]
ServingState = Literal["off", "loading", "serving", "paused", "failed"]
AliasState = Literal["ok", "fallback", "unavailable", "shadowed"]
SleepState = Literal["", "asleep", "waking"]  # awake; model unloaded while idle; loading


@dataclass(frozen=True, slots=True)
class KeptModelSnapshot:
    """A model this machine's node serves besides its first, loaded on demand."""

    name: str
    state: Literal["loaded", "loading", "unloaded"]
    memory: int = 0  # bytes it holds while loaded
    size: int = 0  # its file's bytes
    embeddings: bool = False
    context_window: int = 0  # 0: not known before its first load


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    key: str  # "host:port" (dialed), "joined:<identity>" (joined) or "local"
    identity: str
    address: str
    link: LinkKind
    state: NodeState
    model: str
    runtime: str
    context_window: int
    lanes: int
    lanes_busy: int  # all heads together: the higher of the node's report and ours
    own_sessions: int  # this head's sessions there now
    kv_used: int
    kv_total: int
    prefill_tps: float
    decode_tps: float  # per lane
    ttft_ms: float
    last_seen: float  # wall-clock seconds of the last record from it; 0.0 never
    sessions_total: int  # sessions this head placed there
    peak_busy: int
    connections: int
    error: str | None
    # the KV pool its lanes share: cells parked prefixes hold (reclaimable, within
    # kv_used), and the longest prompt a new session can bring now (0: not said)
    kv_parked: int = 0
    max_prompt: int = 0
    mem_used: int = 0  # bytes the node holds now (0: not said)
    mem_budget: int = 0  # bytes it keeps within (0: no budget said)
    sleep: SleepState = ""
    # prompt tokens it has served so far: reused from a lane, restored from its host
    # memory cache, prefilled
    prompt_from_lanes: int = 0
    prompt_from_host: int = 0
    prompt_prefilled: int = 0
    # the device its model runs on ("Vulkan0 (NVIDIA GeForce RTX 4070)"; "" the CPU), and
    # how many of the model's layers (its output layer counted) are there
    device: str = ""
    gpu_layers: int = 0
    model_layers: int = 0
    # what a fit estimate of another model there needs (0 / "": the node did not say):
    # bytes of RAM; the GPU llama.cpp chose ("gpu", "igpu"; "" none) with its memory, free
    # as it was before the node's model loaded; the disk free where it keeps models
    ram_total: int = 0
    device_kind: str = ""
    device_total: int = 0
    device_free: int = 0
    disk_free: int = 0
    # a pull under way there ("" none): the model, and bytes done of the total
    pull_model: str = ""
    pull_done: int = 0
    pull_total: int = 0
    serve_failed: str = ""  # why the model a head chose for it could not be served
    # what sets its decode speed (bytes/s; 0: not said): its RAM's, its GPU's
    mem_bandwidth: int = 0
    gpu_bandwidth: int = 0

    @property
    def kv_percent(self) -> float:
        return 100.0 * self.kv_used / self.kv_total if self.kv_total else 0.0
    # the models it keeps besides ``model``, loaded on demand, and which are loaded now
    kept: tuple[KeptModelSnapshot, ...] = ()
    # the memory its owner lends to the fleet's split models now (0: it lends none)
    lend_bytes: int = 0
    # a node that joined: where other machines take links to it (HOST:PORT; "": nowhere)
    reach: str = ""


@dataclass(frozen=True, slots=True)
class HeadSnapshot:
    """A head of the fleet: this machine's, or another one met over the fleet link."""

    head_id: str
    address: str
    linked: bool
    this_machine: bool = False
    # its machine's host name, told apart from namesakes (observe.unique_names); a head
    # too old to say it goes by its id
    name: str = ""


@dataclass(frozen=True, slots=True)
class AliasSnapshot:
    name: str
    target: str | None
    fallbacks: tuple[str, ...]
    version: int
    updated_at: float
    resolves_to: str | None
    state: AliasState


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """A model this head has a tokenizer for, and whether a node serves it now."""

    name: str
    served: bool
    context_window: int
    tools: bool
    fill_in_middle: bool
    embeddings: bool = False  # an embedding model: it makes vectors, no text


@dataclass(frozen=True, slots=True)
class PullSnapshot:
    model: str
    done_bytes: int
    total_bytes: int
    state: Literal["running", "done", "failed", "cancelled"]
    message: str = ""
    rate_bps: float = 0.0  # bytes a second lately; 0.0 while not known
    eta_s: float | None = None  # seconds left at that rate; None while not known


@dataclass(frozen=True, slots=True)
class LocalNodeSnapshot:
    """This machine's own node."""

    state: ServingState
    identity: str
    model: str
    runtime: str
    path: str
    context_window: int
    window_pinned: bool  # --max-context (else the model's own, within the budget)
    lanes: int
    lanes_busy: int
    address: str  # HOST:PORT where it takes links (loopback: this machine's head only)
    listening: bool  # heads of other machines may dial it (--listen)
    encrypted: bool  # it holds a fleet token
    heads: tuple[str, ...]  # heads of the fleet it links with ("HOST:PORT")
    linked: tuple[str, ...]  # of those, the ones it has a live link to now
    error: str | None = None
    kv_cells: int = 0  # the KV pool all its lanes share (0: not said)
    memory_used: int = 0  # bytes its process holds now (0: not measured)
    memory_budget: int = 0  # bytes it keeps within (0: no budget)
    host_cache_limit: int = 0  # what its host-memory prompt cache may hold
    sleep: str = ""  # "" | "asleep" | "waking" (idle unload)
    device: str = ""  # as NodeSnapshot's: "" the CPU
    gpu_layers: int = 0
    model_layers: int = 0
    device_note: str = ""  # the device it chose, or why it runs on the CPU (one line)
    embeddings: bool = False  # its model makes embeddings, not text
    # as NodeSnapshot's: what a fit estimate here needs (its pulls are FleetSnapshot.pulls)
    ram_total: int = 0
    device_kind: str = ""
    device_total: int = 0
    device_free: int = 0
    disk_free: int = 0
    kept: tuple[KeptModelSnapshot, ...] = ()  # the models it serves besides ``model``
    # what its first model holds of the budget (its file until an unload measured it)
    model_memory: int = 0


@dataclass(frozen=True, slots=True)
class Roles:
    head: bool  # the API runs on this machine
    api_url: str | None  # http://127.0.0.1:8453/v1 when the head runs
    fleet_listen: str | None  # where this head takes nodes that join
    node: LocalNodeSnapshot | None
    member: bool  # this machine's node has joined a fleet's heads
    # in a fleet whose heads have not taken this machine back yet since it started, and
    # why the last try failed (None: no try has failed yet); tried again every 30 s
    rejoining: bool = False
    rejoin_error: str | None = None


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    at: float  # wall-clock seconds
    fleet_name: str | None  # the name people see ("alice's desk"); None outside a fleet
    fleet_id: str  # one-way from the token; "open" without one
    has_token: bool
    roles: Roles
    model: str | None  # the head's main model (announced to joining nodes)
    models: tuple[ModelSnapshot, ...]
    nodes: tuple[NodeSnapshot, ...]
    heads: tuple[HeadSnapshot, ...]
    aliases: tuple[AliasSnapshot, ...]
    queued: int
    moves: int
    pulls: tuple[PullSnapshot, ...]

    @property
    def lanes(self) -> int:
        return sum(n.lanes for n in self.nodes if n.state == "ready")

    @property
    def lanes_busy(self) -> int:
        return sum(min(n.lanes_busy, n.lanes) for n in self.nodes if n.state == "ready")

    @property
    def ready_nodes(self) -> int:
        return sum(1 for n in self.nodes if n.state == "ready")

    def context_window(self, model: str | None = None) -> int:
        want = model or self.model
        return max((n.context_window for n in self.nodes
                    if n.model == want and n.state == "ready"), default=0)


def to_json(snapshot: FleetSnapshot) -> dict[str, Any]:
    """The snapshot as ``GET /v1/fleet`` answers it (plain JSON types)."""
    out = dataclasses.asdict(snapshot)
    out["context_window"] = snapshot.context_window()
    out["lanes"] = snapshot.lanes
    out["lanes_busy"] = snapshot.lanes_busy
    out["models"] = [m["name"] for m in out["models"]]
    out["model_details"] = [dataclasses.asdict(m) for m in snapshot.models]
    for node, raw in zip(out["nodes"], snapshot.nodes, strict=True):
        node["sessions"] = node["lanes_busy"]
        node["kv_percent"] = round(raw.kv_percent, 1)
        node["device"] = raw.device or None  # None: the CPU
    return out


# how a split node's device ends: the memory another machine lends (engine.runtimes.llamacpp)
LENT = "lent over the fleet's link"


def offload_text(device: str, gpu_layers: int, model_layers: int) -> str:
    """Where a node's model runs, as people read it: ``CPU``, ``Vulkan0 (…): all 31
    layers`` or ``Vulkan0 (…): 20 of 31 layers`` (just the device when it gave no count)."""
    if not device:
        return "CPU"
    if model_layers <= 0:
        return device
    if gpu_layers >= model_layers:
        return f"{device}: all {model_layers} layers"
    return f"{device}: {gpu_layers} of {model_layers} layers"
