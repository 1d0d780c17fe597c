"""`$SHOAL_HOME/config.toml`: settings a user keeps, that flags override.

The CLI only reads it. A Shoal started with ``keep`` (the app) owns it while it runs:
`ConfigFile` is its one writer, and `NextStart` what waits for the next start over the
settings in force.

```toml
[discovery]
mode = "both"            # lan | tailnet | both | none
seeds = ["10.0.0.5:8454"]
tailscale_socket = "/var/run/tailscale/tailscaled.sock"
[node]                   # how this machine's node holds its model (flags override)
memory_budget = "12GiB"  # or "50%" of this machine's RAM, or bytes; absent: the default share
kv_type = "f16"          # f16 | q8_0
gpu = "auto"             # auto | off (CPU only) | a device name: "Vulkan0" (llama.cpp)
idle_unload = 15         # minutes idle before the model unloads; 0 or "never": it stays
fleet_may_choose_model = true  # a head of the fleet may have it pull and serve another model
fleet_models_quota = "50%"     # the disk the models heads chose may take: "20GiB", or a share
                               # of the models folder's disk; the least used go first
serve_kept = false       # serve every model kept here too, each loaded on its first request
lend = false             # lend this machine's memory for the layers of the fleet's split models
lend_on_battery = false  # lend it on battery too (else only on mains power)
```
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from engine import nesting
from engine.models.pulls.quota import QUOTA_FORMS, parse_quota, quota_value
from engine.settings import (
    GPU_DEFAULT,
    DiscoveryMode,
    DiscoverySettings,
    HeadSettings,
    JoinSettings,
    NodeSettings,
    Settings,
    check_gpu,
    split_hostport,
)
from engine.sizes import (
    BUDGET_FORMS,
    IDLE_FORMS,
    KV_TYPES,
    Budget,
    KvType,
    budget_value,
    check_bytes,
    idle_unload_minutes,
    idle_unload_s,
    parse_budget,
    parse_idle_unload,
)
from engine.tasks import TaskSet

MODES = ("lan", "tailnet", "both", "none")


class ConfigError(Exception):
    """The config file is unusable; the message names the file, the cause and the fix."""


@dataclass(frozen=True)
class Config:
    discovery: DiscoveryMode = "both"
    seeds: list[str] = field(default_factory=list)
    tailscale_socket: str | None = None
    # [node]'s memory_budget, kv_type, gpu, idle_unload, fleet_may_choose_model and
    # fleet_models_quota as NodeSettings fields, those given
    node_memory: dict[str, Any] = field(default_factory=dict)


def config_path(home: Path) -> Path:
    return home / "config.toml"


def parse_config(text: str, *, source: str) -> Config:
    try:
        data = nesting.toml_loads(text)
    except ValueError as exc:  # tomllib's TOMLDecodeError, or nesting.TooDeep
        raise ConfigError(f"{source} is not valid TOML ({exc}); fix it or remove it") from None
    section = data.get("discovery", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: [discovery] must be a table")
    mode = section.get("mode", "both")
    if mode not in MODES:
        raise ConfigError(f"{source}: discovery.mode is {mode!r}; use one of {', '.join(MODES)}")
    seeds = section.get("seeds", [])
    if not isinstance(seeds, list) or not all(isinstance(x, str) for x in seeds):
        raise ConfigError(f"{source}: discovery.seeds must be a list of \"HOST:PORT\" strings")
    sock = section.get("tailscale_socket")
    if sock is not None and not isinstance(sock, str):
        raise ConfigError(f"{source}: discovery.tailscale_socket must be a path string")
    return Config(discovery=cast(DiscoveryMode, mode), seeds=seeds, tailscale_socket=sock,
                  node_memory=node_memory(_table(data, "node", source), source))


def node_memory(section: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``[node]``'s memory_budget, kv_type, gpu, idle_unload, fleet_may_choose_model and
    fleet_models_quota, as the NodeSettings fields memory_budget, kv_type, gpu,
    idle_unload_s, fleet_may_choose_model and fleet_models_quota; only those present.
    ConfigError (one line)."""
    out: dict[str, Any] = {}
    if "memory_budget" in section:
        value = section["memory_budget"]
        try:
            if isinstance(value, str):
                out["memory_budget"] = parse_budget(value)
            elif isinstance(value, int) and not isinstance(value, bool):  # bytes
                out["memory_budget"] = check_bytes(value)
            else:
                raise ValueError(f"give {BUDGET_FORMS}, as a string")
        except ValueError as exc:
            raise ConfigError(f"{source}: node.memory_budget: {exc}") from None
    if "kv_type" in section:
        kv = section["kv_type"]
        if kv not in KV_TYPES:
            raise ConfigError(f"{source}: node.kv_type is {kv!r}; use {' or '.join(KV_TYPES)}")
        out["kv_type"] = kv
    if "gpu" in section:
        try:
            out["gpu"] = check_gpu(section["gpu"])
        except ValueError as exc:
            raise ConfigError(f"{source}: node.gpu is {section['gpu']!r}; {exc}") from None
    if "idle_unload" in section:
        value = section["idle_unload"]
        try:
            if isinstance(value, str):
                out["idle_unload_s"] = parse_idle_unload(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out["idle_unload_s"] = idle_unload_s(float(value))
            else:
                raise ValueError(f"give {IDLE_FORMS}")
        except ValueError as exc:
            raise ConfigError(f"{source}: node.idle_unload: {exc}") from None
    for flag in ("serve_kept", "lend", "lend_on_battery"):
        if flag in section:
            if not isinstance(section[flag], bool):
                raise ConfigError(f"{source}: node.{flag} is true or false")
            out[flag] = section[flag]
    if "fleet_may_choose_model" in section:
        if not isinstance(section["fleet_may_choose_model"], bool):
            raise ConfigError(f"{source}: node.fleet_may_choose_model is true or false")
        out["fleet_may_choose_model"] = section["fleet_may_choose_model"]
    if "fleet_models_quota" in section:
        value = section["fleet_models_quota"]
        try:
            if isinstance(value, str):
                out["fleet_models_quota"] = parse_quota(value)
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out["fleet_models_quota"] = value  # bytes (0: the fleet pulls nothing here)
            else:
                raise ValueError(f"give {QUOTA_FORMS}, as a string")
        except ValueError as exc:
            raise ConfigError(f"{source}: node.fleet_models_quota: {exc}") from None
    return out


def load_config(home: Path) -> Config:
    path = config_path(home)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    return parse_config(text, source=str(path))


# -- the settings of this machine, as the desktop app keeps them --------------------------
#
# ```toml
# [fleet]                      # this machine's place in a fleet, kept across restarts
# name = "desk"
# member = true                # its node joins the fleet's heads at start
# head = "10.0.0.5:8454"       # the head it joined (absent: found on the network)
# listen = "0.0.0.0:8454"      # its head takes other machines' nodes here, announced
# [head]                       # the API on this machine
# enabled = true
# http = "127.0.0.1:8453"
# queue_timeout_s = 20.0
# keys = "auto"
# cors_allow = []
# allow_hosts = []
# also_models = ["org/repo:Q4_K_M"]  # other models it serves (fleet nodes serve them)
# [node]                       # the model this machine serves
# enabled = true
# model = "org/repo:Q4_K_M"    # absent: the embedded default
# runtime = "llamacpp"
# lanes = 8
# max_context = 4096
# paused = false
# memory_budget = "12GiB"      # absent: the default share of this machine's RAM
# kv_type = "f16"
# gpu = "auto"                 # "off" (CPU only) or a device name: "Vulkan0"
# idle_unload = 15             # minutes, or "never"
# fleet_may_choose_model = true  # a head of the fleet may change the model it serves
# fleet_models_quota = "50%"   # the disk the models heads chose may take here
# serve_kept = false           # serve every model kept here, each loaded on demand
# lend = false                 # lend memory for the layers of the fleet's split models
# lend_on_battery = false      # and on battery too
# [discovery]
# mode = "both"
# [app]                        # the app's own choices, kept as they are
# start_at_login = false
# ```

_Kinds = dict[str, type | tuple[type, ...]]
HEAD_KEYS: _Kinds = {"http": str, "fleet_listen": str, "queue_timeout_s": (int, float),
                     "keys": str, "cors_allow": list, "allow_hosts": list, "policy": str,
                     "also_models": list}
NODE_KEYS: _Kinds = {"model": str, "runtime": str, "lanes": int, "max_context": int,
                     "paused": bool, "identity": str, "upstream": str}
FLEET_KEYS: _Kinds = {"name": str, "member": bool, "head": str, "listen": str}


def _table(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    return section


def _typed(section: dict[str, Any], kinds: _Kinds, name: str, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kind in kinds.items():
        if key not in section:
            continue
        value = section[key]
        # TOML booleans are not numbers here, though Python's bool is an int
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"{source}: {name}.{key} has the wrong type; fix or remove it")
        out[key] = tuple(str(v) for v in value) if isinstance(value, list) else value
    return out


def machine_settings(home: Path, base: Settings | None = None
                     ) -> tuple[Settings, dict[str, Any]]:
    """This machine's settings from ``config.toml`` over ``base`` (the app's defaults: the
    head and the node on), and the file's ``[app]`` table as it is. Reads a file: call it
    off the event loop."""
    path = config_path(home)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    source = str(path)
    cfg = parse_config(text, source=source)
    data: dict[str, Any] = nesting.toml_loads(text) if text else {}
    head_t, node_t = _table(data, "head", source), _table(data, "node", source)
    base = base or Settings(home=home, head=HeadSettings(), node=NodeSettings())
    head = base.head
    if head_t.get("enabled") is False:
        head = None
    elif head is not None or head_t.get("enabled") is True:
        head = replace(head or HeadSettings(), **_typed(head_t, HEAD_KEYS, "head", source))
    node = base.node
    if node_t.get("enabled") is False:
        node = None
    elif node is not None or node_t.get("enabled") is True:
        node = replace(node or NodeSettings(), **_typed(node_t, NODE_KEYS, "node", source),
                       **cfg.node_memory)
    fleet = _typed(_table(data, "fleet", source), FLEET_KEYS, "fleet", source)
    if head is not None and "listen" in fleet:
        head = replace(head, fleet_listen=fleet["listen"])
    join = base.join
    if fleet.get("member") is True:  # rejoin the fleet's heads with the token kept here
        join = JoinSettings(head=fleet.get("head"))
    elif fleet.get("member") is False:
        join = None
    settings = replace(base, head=head, node=node, join=join,
                       discovery=DiscoverySettings(mode=cfg.discovery, seeds=tuple(cfg.seeds),
                                                   tailscale_socket=cfg.tailscale_socket),
                       fleet_name=fleet.get("name", base.fleet_name))
    return settings, dict(_table(data, "app", source))


def save_machine_settings(settings: Settings, app: dict[str, Any]) -> None:
    """Write ``settings`` (the parts a person changes in the app) and the app's table to
    ``config.toml``, atomically. Writes a file: call it off the event loop."""
    import tomli_w

    from engine.files import write_private

    doc: dict[str, Any] = {}
    head = settings.head
    # the join code holds the token: only where the head is, never the code itself
    fleet_t: dict[str, Any] = {"member": settings.join is not None}
    # (the fleet's name is kept beside its token, in $SHOAL_HOME/fleet/name, only)
    if settings.join is not None and settings.join.head:
        fleet_t["head"] = settings.join.head
    if head is not None and head.fleet_listen:
        fleet_t["listen"] = head.fleet_listen
    doc["fleet"] = fleet_t
    head_t: dict[str, Any] = {"enabled": head is not None}
    if head is not None:
        head_t.update(http=head.http, queue_timeout_s=head.queue_timeout_s, keys=head.keys,
                      policy=head.policy, cors_allow=list(head.cors_allow),
                      allow_hosts=list(head.allow_hosts), also_models=list(head.also_models))
    doc["head"] = head_t
    node = settings.node
    node_t: dict[str, Any] = {"enabled": node is not None}
    if node is not None:
        values = {"runtime": node.runtime, "model": node.model, "lanes": node.lanes,
                  "max_context": node.max_context, "paused": node.paused,
                  "identity": node.identity, "upstream": node.upstream}
        node_t.update({k: v for k, v in values.items() if v is not None})
        if node.memory_budget is not None:
            node_t["memory_budget"] = budget_value(node.memory_budget)
        node_t.update(kv_type=node.kv_type, gpu=node.gpu,
                      idle_unload=idle_unload_minutes(node.idle_unload_s),
                      fleet_may_choose_model=node.fleet_may_choose_model,
                      fleet_models_quota=quota_value(node.fleet_models_quota),
                      serve_kept=node.serve_kept, lend=node.lend,
                      lend_on_battery=node.lend_on_battery)
    doc["node"] = node_t
    d = settings.discovery
    discovery: dict[str, Any] = {"mode": d.mode, "seeds": list(d.seeds)}
    if d.tailscale_socket:
        discovery["tailscale_socket"] = d.tailscale_socket
    doc["discovery"] = discovery
    if app:
        doc["app"] = app
    write_private(config_path(settings.home), tomli_w.dumps(doc).encode("utf-8"))


# -- the one owner of config.toml while Shoal runs ------------------------------------------

MAX_APP_KEYS = 64  # the [app] table: a handful of the app's own choices
MAX_APP_KEY_CHARS = 64
AppValue = bool | int | float | str


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """How this machine's node holds its model: what a person chose for the node's next
    start (NodeSettings' fields of the same names)."""

    memory_budget: Budget
    kv_type: KvType
    idle_unload_s: float | None
    gpu: str = GPU_DEFAULT
    serve_kept: bool = False

    @classmethod
    def of(cls, node: NodeSettings) -> NodeMemory:
        return cls(node.memory_budget, node.kv_type, node.idle_unload_s, node.gpu,
                   node.serve_kept)

    def over(self, node: NodeSettings) -> NodeSettings:
        return replace(node, memory_budget=self.memory_budget, kv_type=self.kv_type,
                       idle_unload_s=self.idle_unload_s, gpu=self.gpu,
                       serve_kept=self.serve_kept)


@dataclass(frozen=True, slots=True)
class NextStart:
    """What waits for the next start, over the settings in force: the changes a person
    made for it (each None: as in force), and a fleet this machine is in but has not
    joined again yet (its heads were away)."""

    http: str | None = None
    fleet_listen: str | None = None
    discovery: DiscoverySettings | None = None
    queue_timeout_s: float | None = None
    join: JoinSettings | None = None
    node_memory: NodeMemory | None = None  # for the node's next start (a model loaded)

    def over(self, s: Settings) -> Settings:
        """``s`` (in force) as the next start will have it. A fleet port applies only
        where the head takes joins (outside a fleet it keeps taking none)."""
        head = s.head
        if head is not None:
            head = replace(
                head, http=self.http or head.http,
                fleet_listen=(self.fleet_listen or head.fleet_listen
                              if head.fleet_listen is not None else None),
                queue_timeout_s=(self.queue_timeout_s if self.queue_timeout_s is not None
                                 else head.queue_timeout_s))
        node = s.node
        if node is not None and self.node_memory is not None:
            node = self.node_memory.over(node)
        return replace(s, head=head, node=node, discovery=self.discovery or s.discovery,
                       join=s.join if s.join is not None else self.join)


def check_app_table(app: Mapping[str, Any]) -> dict[str, AppValue]:
    """The app's choices, bounded and typed as TOML keeps them; ValueError with the fix."""
    if len(app) > MAX_APP_KEYS:
        raise ValueError(f"the app keeps at most {MAX_APP_KEYS} choices")
    out: dict[str, AppValue] = {}
    for key, value in app.items():
        if not isinstance(key, str) or not key or len(key) > MAX_APP_KEY_CHARS:
            raise ValueError(f"an app choice is named by 1-{MAX_APP_KEY_CHARS} characters")
        if not isinstance(value, bool | int | float | str):
            raise ValueError(f"the app choice {key} must be true/false, a number or text")
        out[key] = value
    return out


class ConfigFile:
    """The one writer of ``config.toml`` while Shoal runs: each write off the loop, one
    at a time, of the state as it is when its turn comes (so no change is lost, and
    a later write never puts back an older state); a write that would change nothing
    is skipped."""

    def __init__(self, state: Callable[[], tuple[Settings, Mapping[str, Any]]]) -> None:
        self._state = state
        self._lock = asyncio.Lock()
        self._written: tuple[Settings, dict[str, Any]] | None = None
        self._soon = TaskSet("the settings' writer")
        self.failures: list[str] = []  # the lines of background writes that failed

    async def write(self) -> None:
        """Write the state as it is now; ConfigError (one line) when the file cannot be."""
        async with self._lock:
            settings, app = self._state()
            state = (settings, dict(app))
            if state == self._written:
                return
            try:
                await asyncio.to_thread(save_machine_settings, settings, dict(app))
            except OSError as exc:
                path = config_path(settings.home)
                raise ConfigError(f"cannot save the settings to {path} "
                                  f"({exc.strerror or exc}); check that the folder is "
                                  "writable") from None
            self._written = state

    def write_soon(self, failed: Callable[[str], None]) -> None:
        """Write in the background (a role changed); ``failed`` gets the line if it fails."""
        async def go() -> None:
            try:
                await self.write()
            except ConfigError as exc:
                failed(str(exc))

        self._soon.spawn(go(), name="shoal-save-config")

    async def flush(self) -> None:
        """Wait for the writes asked for so far."""
        if self._soon:
            await asyncio.wait(list(self._soon))  # finished, not cancelled: each is a save


def with_port(address: str | None, port: int, default: str) -> str:
    """``address`` (else ``default``) with its port replaced by ``port``."""
    host = split_hostport(address or default, port)[0]
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}"
