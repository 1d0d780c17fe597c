"""Everything a running Shoal is started from: one frozen, typed `Settings`.

The CLI builds it from its flags over ``$SHOAL_HOME/config.toml``; the app from the
same file and its own choices; tests directly. A role left as None is not started
(a head with no local node, a node with no head). Changing a role at run time goes
through `Shoal`'s commands, which keep their own copy of the settings up to date.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from engine.models.pulls.quota import DEFAULT_QUOTA, Quota
from engine.sizes import IDLE_UNLOAD_DEFAULT_S, Budget, KvType

Policy = Literal["load-aware", "least-loaded", "round-robin"]
DiscoveryMode = Literal["lan", "tailnet", "both", "none"]
KeysMode = Literal["auto", "on", "off"]

HTTP_PORT = 8453  # the HTTP API
HTTP_DEFAULT = f"127.0.0.1:{HTTP_PORT}"
FLEET_PORT = 8454  # where heads take nodes that join
NODE_PORT = 8455  # where listening nodes take heads that dial
LANES_DEFAULT = 8
# runtimes that front a serving engine the user runs, reached at NodeSettings.upstream
UPSTREAM_RUNTIMES = ("llama-server", "vllm")
GPU_DEFAULT = "auto"  # the GPU with the most free memory, if llama.cpp finds one
GPU_MAX_CHARS = 64
GPU_FORMS = (f"auto, off (CPU only) or a device name such as Vulkan0 (1-{GPU_MAX_CHARS} "
             "printable characters)")


def check_gpu(value: object) -> str:
    """``value`` as a node's GPU choice: auto, off, or a device's name or part of its
    description (the engine matches it against the devices it finds, at load).
    ValueError naming the forms."""
    if (not isinstance(value, str) or not value.strip() or len(value) > GPU_MAX_CHARS
            or not value.isprintable()):
        raise ValueError(f"give {GPU_FORMS}")
    return value.strip()


def standard_home() -> Path:
    """``~/.shoal``: where Shoal keeps its files when ``$SHOAL_HOME`` does not say."""
    return Path.home() / ".shoal"


def default_home() -> Path:
    """``$SHOAL_HOME`` (``~`` expanded), else ``~/.shoal``: the one place that says where
    Shoal keeps its files."""
    env = os.environ.get("SHOAL_HOME")
    return Path(env).expanduser() if env else standard_home()


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """This machine's node: which model it serves and how."""

    model: str | None = None  # a GGUF path, org/repo[:QUANT], an MLX folder; None: embedded
    runtime: str | None = None  # llamacpp | mlx | mock | llama-server | vllm; None: by format
    model_name: str | None = None  # the name heads match on; None: the model's own
    max_context: int | None = None  # tokens one session holds; None: the model's own window
    lanes: int = LANES_DEFAULT  # 0 with an upstream: as many as it says it runs
    upstream: str | None = None  # http://HOST:PORT of the engine llama-server / vllm front
    identity: str | None = None  # the name in heads' logs; None: the host name
    listen: str | None = None  # HOST:PORT where heads dial it; None: no listener
    insecure_no_auth: bool = False  # listen off loopback without a token
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 120.0
    mock_speed: float = 0.0  # the mock runtime's tokens/s per lane (0: unlimited)
    paused: bool = False  # start without taking sessions
    # the memory the model and the KV pool all lanes share may take: bytes, a share of RAM
    # (engine.sizes.Share), or None: the runtime's default share of this machine's RAM
    memory_budget: Budget = None
    kv_type: KvType = "f16"  # q8_0: half the KV memory, so about twice the context
    gpu: str = GPU_DEFAULT  # auto | off (CPU only) | a device: "Vulkan0" (llama.cpp only)
    idle_unload_s: float | None = IDLE_UNLOAD_DEFAULT_S  # unload the idle model; None: never
    # a head of the fleet may ask it to serve another model (pulled and swapped in here):
    # whoever holds the fleet token runs sessions on it already
    fleet_may_choose_model: bool = True
    # the disk the models a head chose may take here (bytes, or a share of the disk that
    # holds the models folder); beyond it the least used of them go, or the next is refused
    fleet_models_quota: Quota = DEFAULT_QUOTA
    # serve every model kept here (pulled or imported) besides ``model``: each loads on
    # the first request that names it and unloads when idle or when another needs room
    serve_kept: bool = False
    # lend this machine's memory to the fleet for the layers of a split model (llama.cpp's
    # RPC server on loopback, reached through the fleet's link): its owner's choice
    lend: bool = False
    lend_on_battery: bool = False  # lend on battery too (else only on mains power)
    # split its model with the machines at these HOST:PORTs (their nodes' listeners), which
    # lend memory: its last layers run there
    split_with: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HeadSettings:
    """This machine's head: the API on localhost and how it places sessions."""

    model: str | None = None  # the tokenizer and template; None: the local node's model
    runtime: str | None = None  # how to read that model; None: by its format
    http: str = HTTP_DEFAULT
    fleet: tuple[str, ...] = ()  # HOST:PORT of nodes it dials
    fleet_listen: str | None = None  # ADDR:PORT where nodes join; None: none join
    also_models: tuple[str, ...] = ()
    policy: Policy = "load-aware"
    pool_high: float = 90.0
    conns_per_node: int = 0  # 0: as many as the node has lanes
    queue_timeout_s: float = 20.0
    keepalive_s: float = 5.0
    tool_call_parser: str | None = None
    chat_template: Path | None = None
    api_key: str | None = field(default=None, repr=False)  # the operator's static key
    insecure_no_auth: bool = False  # serve the HTTP API off loopback with no key
    keys: KeysMode = "auto"  # keys from `shoal keys issue`: on once one was issued
    key_policy: Path | None = None
    cors_allow: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()
    node_port: int = NODE_PORT  # where it looks for listening nodes on tailnet peers


@dataclass(frozen=True, slots=True)
class JoinSettings:
    """This machine's node joins a fleet's heads (and every head of it found later)."""

    head: str | None = None  # HOST:PORT; None: found on the network
    code: str | None = field(default=None, repr=False)  # a join URL (holds the token)
    head_port: int = FLEET_PORT  # where discovery looks for heads


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    mode: DiscoveryMode = "both"
    seeds: tuple[str, ...] = ()
    tailscale_socket: str | None = None


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path = field(default_factory=default_home)
    head: HeadSettings | None = None
    node: NodeSettings | None = None
    join: JoinSettings | None = None
    discovery: DiscoverySettings = DiscoverySettings()
    auth_file: Path | None = None  # the token from this file (not the keychain)
    offline: bool = False  # pull nothing
    # the name people see in pairing codes, until $SHOAL_HOME/fleet/name keeps one (the one
    # keeper; an older config.toml's [fleet] name is read here)
    fleet_name: str | None = None

    def with_head(self, head: HeadSettings | None) -> Settings:
        return replace(self, head=head)

    def with_node(self, node: NodeSettings | None) -> Settings:
        return replace(self, node=node)

    def with_join(self, join: JoinSettings | None) -> Settings:
        return replace(self, join=join)

    @property
    def models_dir(self) -> Path:
        return self.home / "models"


def split_hostport(text: str, default_port: int) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT``, ``[V6]:PORT`` or ``HOST``; ValueError with the fix."""
    host, sep, port = text.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address
            return text, default_port
        if not sep:
            return text, default_port
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        value = int(port)
    except ValueError:
        raise ValueError(f"'{text}' is not HOST:PORT; write it like "
                         f"127.0.0.1:{NODE_PORT}") from None
    if not 0 <= value < 65536:
        raise ValueError(f"port {value} in '{text}' is out of range 0-65535")
    return host or "0.0.0.0", value  # noqa: S104 - an empty host means every interface
