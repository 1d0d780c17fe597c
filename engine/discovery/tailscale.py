"""Tailscale: which machines of the tailnet are online, from tailscaled's LocalAPI.

``GET /localapi/v0/status`` answers an ``ipnstate.Status``: ``BackendState``
(``NoState``, ``NeedsLogin``, ``NeedsMachineAuth``, ``Stopped``, ``Starting``,
``Running``), ``Self`` and a ``Peer`` map (keyed by node key) of
``PeerStatus`` objects with ``HostName``, ``DNSName``, ``OS``,
``TailscaleIPs`` and ``Online``. Only online peers are ever dialed.

Where the LocalAPI lives:

- Linux and the BSDs: a unix socket, ``/var/run/tailscale/tailscaled.sock``
  (``/run/...`` on systems without ``/var/run``; Synology has its own path).
- macOS with the open-source ``tailscaled``: ``/var/run/tailscaled.socket``.
- macOS "standalone" app (macsys): no socket; a localhost TCP port named by the
  symlink ``/Library/Tailscale/ipnport``, with a password in
  ``/Library/Tailscale/sameuserproof-PORT`` sent as HTTP basic auth.
- macOS App Store app: the port and password are in the name of a file
  ``sameuserproof-PORT-TOKEN`` in the app's group container under
  ``~/Library/Group Containers/``; when that cannot be read we refuse with a
  line naming ``--tailscale-socket`` and the open-source tailscaled.

The requests carry ``Host: local-tailscaled.sock`` as Tailscale's own clients
send (tailscaled refuses other hosts on its socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from engine import nesting
from engine.sizes import MiB, amount

LOCALAPI_HOST = "local-tailscaled.sock"
STATUS_PATH = "/localapi/v0/status"
MAX_STATUS_BYTES = 4 * MiB
RUNNING_STATES = ("Running", "Starting")

LINUX_SOCKETS = (
    "/var/run/tailscale/tailscaled.sock",
    "/run/tailscale/tailscaled.sock",
    "/var/packages/Tailscale/var/tailscaled.sock",  # Synology DSM 7
    "/var/packages/Tailscale/etc/tailscaled.sock",  # Synology DSM 6
)
MACOS_SOCKET = "/var/run/tailscaled.socket"
MACSYS_DIR = Path("/Library/Tailscale")
APPSTORE_CONTAINERS = Path("~/Library/Group Containers").expanduser()

MACOS_REFUSAL = ("Tailscale's macOS app here exposes no LocalAPI socket Shoal can use; "
                 "set --tailscale-socket PATH, or run the open-source tailscaled "
                 "(socket /var/run/tailscaled.socket)")


class TailscaleError(Exception):
    """Tailscale cannot be asked; the message is one line naming the cause and the fix."""


@dataclass(frozen=True)
class TailnetPeer:
    host_name: str
    dns_name: str
    ips: tuple[str, ...]
    online: bool
    os: str = ""


@dataclass(frozen=True)
class TailnetStatus:
    backend_state: str
    self_peer: TailnetPeer
    peers: list[TailnetPeer] = field(default_factory=list)


@dataclass(frozen=True)
class LocalAPI:
    """Where tailscaled's LocalAPI answers: a unix socket, or a localhost TCP port."""

    socket_path: str | None = None
    tcp_port: int | None = None
    password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        if self.socket_path is not None:
            return self.socket_path
        return f"127.0.0.1:{self.tcp_port} (the macOS app)"


# --- where ---------------------------------------------------------------------

def _platform() -> str:
    return sys.platform


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _isdir(path: str) -> bool:
    return os.path.isdir(path)


def default_socket_path() -> str | None:
    """The platform's tailscaled socket, or None where there is none to use.

    On Linux (and other unixes) the first existing candidate, else the standard
    path (so a missing daemon is reported at the path people know). On macOS the
    open-source daemon's socket when it exists; None for the GUI app variants
    (see :func:`default_endpoint`) and on Windows.
    """
    platform = _platform()
    if platform == "win32":
        return None
    if platform == "darwin":
        return MACOS_SOCKET if _exists(MACOS_SOCKET) else None
    for path in LINUX_SOCKETS:
        if _exists(path):
            return path
    return LINUX_SOCKETS[0] if _isdir("/var/run") else LINUX_SOCKETS[1]


def _macsys_endpoint(directory: Path | None = None) -> LocalAPI | None:
    directory = directory or MACSYS_DIR
    try:
        port_text = os.readlink(directory / "ipnport")
        password = (directory / f"sameuserproof-{port_text}").read_text().strip()
        port = int(port_text)
    except (OSError, ValueError):
        return None
    if not password or not 0 < port < 65536:
        return None
    return LocalAPI(tcp_port=port, password=password)


def _appstore_endpoint(containers: Path | None = None) -> LocalAPI | None:
    containers = containers or APPSTORE_CONTAINERS
    try:
        groups = [p for p in containers.iterdir() if p.name.endswith(".io.tailscale.ipn.macos")]
    except OSError:
        return None
    for group in groups:
        try:
            names = [p.name for p in group.iterdir()]
        except OSError:
            continue
        for name in names:
            parts = name.split("-", 2)
            if len(parts) == 3 and parts[0] == "sameuserproof" and parts[1].isdigit() \
                    and parts[2]:
                return LocalAPI(tcp_port=int(parts[1]), password=parts[2])
    return None


def default_endpoint(socket_path: str | None = None) -> LocalAPI:
    """The LocalAPI to ask: ``socket_path`` when given, else the platform's.

    Raises TailscaleError (one line) when this platform offers none we can use.
    """
    if socket_path:
        return LocalAPI(socket_path=socket_path)
    path = default_socket_path()
    if path is not None:
        return LocalAPI(socket_path=path)
    if _platform() == "darwin":
        endpoint = _macsys_endpoint() or _appstore_endpoint()
        if endpoint is not None:
            return endpoint
        raise TailscaleError(MACOS_REFUSAL)
    raise TailscaleError("Tailscale's LocalAPI has no unix socket on this platform; "
                         "set --tailscale-socket PATH or choose --discovery lan")


# --- parsing (no I/O) ----------------------------------------------------------

def _str(obj: dict[str, object], key: str) -> str:
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TailscaleError(f"tailscaled's status has a malformed {key}; "
                             "check `tailscale version` (Shoal reads the 1.x status JSON)")
    return value


def _ips(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise TailscaleError("tailscaled's status has malformed TailscaleIPs; "
                             "check `tailscale version` (Shoal reads the 1.x status JSON)")
    ips: list[str] = []
    for item in value:
        if isinstance(item, str):
            with contextlib.suppress(ValueError):
                ips.append(str(ipaddress.ip_address(item)))
    return tuple(ips)


def _peer(obj: object) -> TailnetPeer:
    if obj is None:
        return TailnetPeer("", "", (), False)
    if not isinstance(obj, dict):
        raise TailscaleError("tailscaled's status has a malformed peer; "
                             "check `tailscale version` (Shoal reads the 1.x status JSON)")
    return TailnetPeer(host_name=_str(obj, "HostName"), dns_name=_str(obj, "DNSName"),
                       ips=_ips(obj.get("TailscaleIPs")), online=obj.get("Online") is True,
                       os=_str(obj, "OS"))


def parse_status(data: bytes | str | object) -> TailnetStatus:
    """A TailnetStatus from the status JSON (bytes or text) or its decoded object."""
    if isinstance(data, bytes | str):
        try:
            data = nesting.json_loads(data)
        except (ValueError, UnicodeDecodeError):
            raise TailscaleError("tailscaled answered the status request with malformed "
                                 "JSON; check `tailscale status` works") from None
    if not isinstance(data, dict):
        raise TailscaleError("tailscaled answered the status request with something other "
                             "than a status object; check `tailscale status` works")
    state = _str(data, "BackendState")
    if not state:
        raise TailscaleError("tailscaled's status has no BackendState; "
                             "check `tailscale version` (Shoal reads the 1.x status JSON)")
    peer_map = data.get("Peer")
    if peer_map is None:
        peer_map = {}
    if not isinstance(peer_map, dict):
        raise TailscaleError("tailscaled's status has a malformed Peer map; "
                             "check `tailscale version` (Shoal reads the 1.x status JSON)")
    peers = sorted((_peer(p) for p in peer_map.values()),
                   key=lambda p: (p.host_name, p.dns_name, p.ips))
    return TailnetStatus(backend_state=state, self_peer=_peer(data.get("Self")), peers=peers)


def check_running(st: TailnetStatus) -> None:
    """Raise TailscaleError unless tailscaled is up and logged in."""
    state = st.backend_state
    if state in RUNNING_STATES:
        return
    if state in ("NeedsLogin", "NoState"):
        raise TailscaleError("Tailscale is not logged in; run `tailscale up`")
    if state == "Stopped":
        raise TailscaleError("Tailscale is stopped (not logged in to the tailnet); "
                             "run `tailscale up`")
    if state == "NeedsMachineAuth":
        raise TailscaleError("this machine awaits approval in the Tailscale admin console; "
                             "approve it there, then retry")
    raise TailscaleError(f"Tailscale is in state {state[:40]!r}, not Running; "
                         "check `tailscale status`")


def online_peer_addresses(st: TailnetStatus) -> list[tuple[str, str]]:
    """(host name, address) of every online peer: its first IPv4, else its first IP.

    Offline peers are left out: they are never dialed.
    """
    out: list[tuple[str, str]] = []
    for peer in st.peers:
        if not peer.online or not peer.ips:
            continue
        v4 = [ip for ip in peer.ips if ipaddress.ip_address(ip).version == 4]
        out.append((peer.host_name or peer.dns_name.split(".")[0], (v4 or list(peer.ips))[0]))
    return out


# --- the request -----------------------------------------------------------------

async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    too_large = TailscaleError(f"tailscaled's status is larger than {amount(limit)}; Shoal "
                               "will not read it (is that really tailscaled?)")
    if resp.content_length is not None and resp.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _connect_error(where: LocalAPI, exc: aiohttp.ClientConnectorError) -> TailscaleError:
    path = where.describe()
    errno = exc.os_error.errno
    if where.socket_path is not None and errno in (2, 20):  # ENOENT, ENOTDIR
        return TailscaleError(f"Tailscale is not running here (no socket at {path}); "
                              "start it or choose --discovery lan")
    if errno in (1, 13):  # EPERM, EACCES
        return TailscaleError(f"cannot open Tailscale's socket at {path} (permission denied); "
                              "run Shoal as a user allowed to, or choose --discovery lan")
    return TailscaleError(f"Tailscale is not running here (nothing answers at {path}); "
                          "start it or choose --discovery lan")


async def status(socket_path: str | LocalAPI, timeout: float = 3.0) -> TailnetStatus:  # noqa: ASYNC109
    """Ask tailscaled for its status; raise TailscaleError unless it is up and logged in."""
    where = socket_path if isinstance(socket_path, LocalAPI) else LocalAPI(socket_path=socket_path)
    if where.socket_path is not None:
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=where.socket_path)
        url = f"http://{LOCALAPI_HOST}{STATUS_PATH}"
    elif where.tcp_port is not None:
        connector = aiohttp.TCPConnector()
        url = f"http://127.0.0.1:{where.tcp_port}{STATUS_PATH}"
    else:
        raise TailscaleError("no Tailscale LocalAPI to ask; set --tailscale-socket PATH")
    headers = {"Host": LOCALAPI_HOST}
    auth = aiohttp.BasicAuth("", where.password) if where.password else None
    try:
        async with asyncio.timeout(timeout):
            async with aiohttp.ClientSession(connector=connector) as session, \
                    session.get(url, headers=headers, auth=auth,
                                allow_redirects=False) as resp:
                if resp.status in (401, 403):
                    raise TailscaleError(
                        f"tailscaled at {where.describe()} refused the status request "
                        f"(HTTP {resp.status}); check that this user may use Tailscale, "
                        "or set --tailscale-socket")
                if resp.status != 200:
                    raise TailscaleError(
                        f"tailscaled at {where.describe()} answered the status request with "
                        f"HTTP {resp.status}; check `tailscale status` works")
                body = await _read_bounded(resp, MAX_STATUS_BYTES)
    except TimeoutError:
        raise TailscaleError(f"Tailscale did not answer within {timeout:g} s at "
                             f"{where.describe()}; check `tailscale status`") from None
    except aiohttp.ClientConnectorError as exc:
        raise _connect_error(where, exc) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise TailscaleError(f"the request to tailscaled at {where.describe()} failed "
                             f"({type(exc).__name__}); check `tailscale status`") from None
    st = parse_status(body)
    check_running(st)
    return st
