"""`$SHOAL_HOME/config.toml`: settings a user keeps, that flags override.

```toml
[discovery]
mode = "both"            # lan | tailnet | both | none
seeds = ["10.0.0.5:8454"]
tailscale_socket = "/var/run/tailscale/tailscaled.sock"
```
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from engine import nesting
from engine.settings import (
    DiscoveryMode,
    DiscoverySettings,
    HeadSettings,
    JoinSettings,
    NodeSettings,
    Settings,
)

MODES = ("lan", "tailnet", "both", "none")


class ConfigError(Exception):
    """The config file is unusable; the message names the file, the cause and the fix."""


@dataclass(frozen=True)
class Config:
    discovery: DiscoveryMode = "both"
    seeds: list[str] = field(default_factory=list)
    tailscale_socket: str | None = None


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
    return Config(discovery=cast(DiscoveryMode, mode), seeds=seeds, tailscale_socket=sock)


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
# [node]                       # the model this machine serves
# enabled = true
# model = "org/repo:Q4_K_M"    # absent: the embedded default
# runtime = "llamacpp"
# lanes = 8
# max_context = 4096
# paused = false
# [discovery]
# mode = "both"
# [app]                        # the app's own choices, kept as they are
# start_at_login = false
# ```

_Kinds = dict[str, type | tuple[type, ...]]
HEAD_KEYS: _Kinds = {"http": str, "fleet_listen": str, "queue_timeout_s": (int, float),
                     "keys": str, "cors_allow": list, "allow_hosts": list, "policy": str}
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
        node = replace(node or NodeSettings(), **_typed(node_t, NODE_KEYS, "node", source))
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
    if settings.fleet_name:
        fleet_t["name"] = settings.fleet_name
    if settings.join is not None and settings.join.head:
        fleet_t["head"] = settings.join.head
    if head is not None and head.fleet_listen:
        fleet_t["listen"] = head.fleet_listen
    doc["fleet"] = fleet_t
    head_t: dict[str, Any] = {"enabled": head is not None}
    if head is not None:
        head_t.update(http=head.http, queue_timeout_s=head.queue_timeout_s, keys=head.keys,
                      policy=head.policy, cors_allow=list(head.cors_allow),
                      allow_hosts=list(head.allow_hosts))
    doc["head"] = head_t
    node = settings.node
    node_t: dict[str, Any] = {"enabled": node is not None}
    if node is not None:
        values = {"runtime": node.runtime, "model": node.model, "lanes": node.lanes,
                  "max_context": node.max_context, "paused": node.paused,
                  "identity": node.identity}
        node_t.update({k: v for k, v in values.items() if v is not None})
    doc["node"] = node_t
    d = settings.discovery
    discovery: dict[str, Any] = {"mode": d.mode, "seeds": list(d.seeds)}
    if d.tailscale_socket:
        discovery["tailscale_socket"] = d.tailscale_socket
    doc["discovery"] = discovery
    if app:
        doc["app"] = app
    write_private(config_path(settings.home), tomli_w.dumps(doc).encode("utf-8"))
