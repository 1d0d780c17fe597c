"""`$SHOAL_HOME/config.toml`: settings a user keeps, that flags override.

```toml
[discovery]
mode = "both"            # lan | tailnet | both | none
seeds = ["10.0.0.5:8454"]
tailscale_socket = "/var/run/tailscale/tailscaled.sock"
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from engine import nesting
from engine.settings import DiscoveryMode

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
