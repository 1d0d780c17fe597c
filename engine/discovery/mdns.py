"""mDNS (DNS-SD) on the LAN: heads and nodes announce ``_shoal-fleet._tcp.local.``.

A thin adapter over python-zeroconf's asyncio API. The TXT records carry the
protocol version (``v``), the role (``head`` or ``node``), the model name and
the fleet id (one-way from the token, see :mod:`engine.discovery.fleet_id`),
never the token. The browser keeps the live set of services, resolved from
zeroconf's own cache (asking the network only for what is missing), and drops
a service when its goodbye arrives or its records expire.

Only IPv4 is announced and browsed: every LAN a fleet lives on has it, and an
IPv6 link-local address would need a scope to be dialed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger("shoal.discovery.mdns")

SERVICE_TYPE = "_shoal-fleet._tcp.local."
PROTOCOL_VERSION = 1
RECORD_TTL_S = 120
"""TTL of every record we announce: a head that vanished without a goodbye
drops out of browsers within two minutes (zeroconf refreshes live ones)."""

MAX_SERVICES = 256
"""Services a browser keeps at once: announcements cost nothing to send, so a LAN
flooded with them must not grow the set (and the dials it starts) without end."""

RESOLVE_TIMEOUT_S = 3.0
RESOLVE_ATTEMPTS = 3
CLOSE_TIMEOUT_S = 3.0
_TXT_VALUE_MAX = 200  # bytes; a TXT string holds at most 255 with its key

Role = Literal["head", "node"]
Source = Literal["lan", "tailnet", "seed"]
Interfaces = Sequence[str] | None
"""``None``: every interface; else the IPv4 addresses of the interfaces to use."""

# Interfaces that are not the LAN: container bridges, VPN and tailnet tunnels.
_NOT_LAN_PREFIXES = ("docker", "br-", "veth", "virbr", "vboxnet", "vmnet", "cni", "flannel",
                     "podman", "lxcbr", "lxdbr", "tailscale", "utun", "zt", "wg")
_CGNAT = ipaddress.ip_network("100.64.0.0/10")  # also the tailnet's range


@dataclass(frozen=True)
class Found:
    """One live service: a head or a node of some fleet, and where to dial it."""

    name: str  # the instance name, unique on the link
    host: str  # the address to dial (best of ``addresses`` for this machine)
    port: int
    role: Literal["head", "node"]
    model: str
    fleet: str
    protocol: int
    source: Literal["lan", "tailnet", "seed"]
    addresses: tuple[str, ...] = field(default=(), compare=False)


# --- addresses ---------------------------------------------------------------

def _is_lan_candidate(ip: ipaddress.IPv4Address) -> bool:
    return not (ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified)


def local_addresses() -> list[str]:
    """IPv4 addresses of this machine's real interfaces, the likely LAN first.

    Loopback, link-local, container bridges and tunnels are left out; private
    (RFC 1918) addresses come before others, the CGNAT/tailnet range last.
    """
    found: list[tuple[int, str]] = []
    for adapter in ifaddr.get_adapters():
        name = str(adapter.nice_name or adapter.name)
        if name.startswith(_NOT_LAN_PREFIXES):
            continue
        for entry in adapter.ips:
            if not isinstance(entry.ip, str):
                continue  # IPv6
            try:
                ip = ipaddress.IPv4Address(entry.ip)
            except ValueError:
                continue
            if not _is_lan_candidate(ip):
                continue
            rank = 2 if ip in _CGNAT else (0 if ip.is_private else 1)
            if entry.ip not in (a for _, a in found):
                found.append((rank, entry.ip))
    found.sort(key=lambda item: item[0])
    return [a for _, a in found]


def _local_networks() -> list[ipaddress.IPv4Network]:
    nets: list[ipaddress.IPv4Network] = []
    for adapter in ifaddr.get_adapters():
        for entry in adapter.ips:
            if isinstance(entry.ip, str):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.IPv4Network(f"{entry.ip}/{entry.network_prefix}",
                                                      strict=False))
    return nets


def pick_host(addresses: Sequence[str], local_nets: Sequence[ipaddress.IPv4Network]) -> str:
    """The address to dial: one on a network this machine is on, else "" (not dialed).

    An announcement chooses its addresses freely; dialing only those on this machine's
    own networks keeps a stranger on the LAN from sending heads and nodes to dial
    anywhere else (the tailnet is found through tailscaled, not here). A loopback
    address counts only when nothing else does (a service on this very machine)."""
    usable: list[ipaddress.IPv4Address] = []
    for text in addresses:
        with contextlib.suppress(ValueError):
            ip = ipaddress.IPv4Address(text)
            if not (ip.is_link_local or ip.is_multicast or ip.is_unspecified) and \
                    any(ip in net for net in local_nets if net.prefixlen < 32):
                usable.append(ip)
    usable.sort(key=lambda ip: ip.is_loopback)
    return str(usable[0]) if usable else ""


def _zc_interfaces(interfaces: Interfaces) -> InterfaceChoice | list[str]:
    if interfaces is None:
        return InterfaceChoice.All
    for addr in interfaces:
        ipaddress.IPv4Address(addr)  # raises ValueError with the bad address
    return list(interfaces)


# --- names and TXT -----------------------------------------------------------

_LABEL_BAD = re.compile(r"[\x00-\x1f\x7f.\\]+")


def _label(text: str, limit: int = 63) -> str:
    """A DNS label: no dots or control characters, at most ``limit`` UTF-8 bytes."""
    clean = _LABEL_BAD.sub("-", text).strip("- ") or "shoal"
    data = clean.encode()[:limit]
    return data.decode(errors="ignore").rstrip("- ") or "shoal"


def _txt_value(text: str) -> str:
    return text.encode()[:_TXT_VALUE_MAX].decode(errors="ignore")


def _txt_text(props: dict[bytes, bytes | None], key: bytes) -> str:
    value = props.get(key)
    return value.decode(errors="replace") if value is not None else ""


def parse_record(instance: str, properties: dict[bytes, bytes | None],
                 addresses: Sequence[str], port: int | None,
                 local_nets: Sequence[ipaddress.IPv4Network]) -> Found | None:
    """A :class:`Found` from a resolved service, or None when it is not one of ours."""
    role = _txt_text(properties, b"role")
    if role not in ("head", "node") or not port:
        return None
    try:
        protocol = int(_txt_text(properties, b"v"))
    except ValueError:
        return None
    host = pick_host(addresses, local_nets)
    if not host:
        return None
    return Found(name=instance, host=host, port=port,
                 role="head" if role == "head" else "node",
                 model=_txt_text(properties, b"model"), fleet=_txt_text(properties, b"fleet"),
                 protocol=protocol, source="lan", addresses=tuple(addresses))


# --- announcer ---------------------------------------------------------------

class Announcer:
    """Announces one service (a head or a node) until closed."""

    def __init__(self, *, zc: AsyncZeroconf | None = None) -> None:
        self._shared = zc
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None
        self._props: dict[str, str] = {}
        self.name: str | None = None  # the instance name announced (may gain a suffix)
        self.addresses: list[str] = []

    async def start(self, *, instance: str, port: int, role: Role, model: str, fleet: str,
                    addresses: list[str] | None = None, interfaces: Interfaces = None) -> None:
        """Register the service; returns once probing and the first announcement are done.

        ``addresses`` defaults to the real interfaces' addresses (see
        :func:`local_addresses`); with ``interfaces`` given and no addresses,
        those interfaces' addresses are announced (loopback included, since it
        was asked for). Raises OSError when no socket can be opened or there is
        no address to announce (a machine with loopback only).
        """
        if self._info is not None:
            raise RuntimeError("this announcer is already started")
        if role not in ("head", "node"):
            raise ValueError(f"role must be head or node, not {role!r}")
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range")
        if addresses is None:
            addresses = list(interfaces) if interfaces is not None else \
                await asyncio.to_thread(local_addresses)
        if not addresses:
            raise OSError("no network interface with an IPv4 address to announce")
        packed = [socket.inet_aton(str(ipaddress.IPv4Address(a))) for a in addresses]
        label = _label(instance)
        self._props = {"v": str(PROTOCOL_VERSION), "role": role, "model": _txt_value(model),
                       "fleet": _txt_value(fleet)}
        info = AsyncServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port,
                                properties=dict(self._props),
                                server=f"{_label(label, 50)}-shoal.local.",
                                addresses=packed, host_ttl=RECORD_TTL_S,
                                other_ttl=RECORD_TTL_S)
        zc = self._shared or AsyncZeroconf(interfaces=_zc_interfaces(interfaces),
                                           ip_version=IPVersion.V4Only)
        try:
            pending = await zc.async_register_service(info, allow_name_change=True)
            await pending
        except BaseException:
            if self._shared is None:
                with contextlib.suppress(Exception):
                    await zc.async_close()
            raise
        self._zc = zc
        self._info = info
        self.addresses = list(addresses)
        self.name = info.name[: -len(SERVICE_TYPE) - 1]
        log.debug("announcing %s (%s) on %s:%d", self.name, role, ",".join(addresses), port)

    async def update(self, *, model: str) -> None:
        """Announce a new model name (the TXT record changes; browsers see an update)."""
        if self._info is None or self._zc is None:
            raise RuntimeError("this announcer is not started")
        self._props["model"] = _txt_value(model)
        old = self._info
        info = AsyncServiceInfo(SERVICE_TYPE, old.name, port=old.port,
                                properties=dict(self._props), server=old.server,
                                addresses=old.addresses, host_ttl=RECORD_TTL_S,
                                other_ttl=RECORD_TTL_S)
        pending = await self._zc.async_update_service(info)
        await pending
        self._info = info

    async def close(self) -> None:
        """Unregister (browsers get a goodbye) and release the sockets; idempotent."""
        info, zc = self._info, self._zc
        self._info = self._zc = None
        if info is None or zc is None:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                pending = await zc.async_unregister_service(info)
                await pending
        except (TimeoutError, OSError) as exc:
            log.debug("unregistering %s: %s", info.name, exc)
        finally:
            if self._shared is None:
                with contextlib.suppress(Exception):
                    await zc.async_close()


# --- browser -----------------------------------------------------------------

class Browser:
    """The live set of ``_shoal-fleet._tcp`` services on the LAN."""

    def __init__(self, *, interfaces: Interfaces = None, zc: AsyncZeroconf | None = None,
                 resolve_timeout: float = RESOLVE_TIMEOUT_S) -> None:
        self._interfaces = interfaces
        self._shared = zc
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._resolve_timeout = resolve_timeout
        self._found: dict[str, Found] = {}
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._local_nets: list[ipaddress.IPv4Network] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._changes = 0
        self._full_warned = False

    async def start(self) -> None:
        """Start browsing; raises OSError when no socket can be opened."""
        if self._browser is not None:
            raise RuntimeError("this browser is already started")
        self._loop = asyncio.get_running_loop()
        self._local_nets = await asyncio.to_thread(_local_networks)
        zc = self._shared or AsyncZeroconf(interfaces=_zc_interfaces(self._interfaces),
                                           ip_version=IPVersion.V4Only)
        self._zc = zc
        self._browser = AsyncServiceBrowser(zc.zeroconf, SERVICE_TYPE,
                                            handlers=[self._on_state_change])

    @property
    def changes(self) -> int:
        """How many times the live set changed; pass it to :meth:`wait_change`."""
        return self._changes

    def found(self, now_fleet: str | None, role: str | None) -> list[Found]:
        """Live services of fleet ``now_fleet`` with ``role`` (None: any), by name."""
        return sorted((f for f in self._found.values()
                       if (now_fleet is None or f.fleet == now_fleet)
                       and (role is None or f.role == role)),
                      key=lambda f: f.name)

    def all_found(self) -> list[Found]:
        return self.found(None, None)

    async def wait_change(self, timeout: float,  # noqa: ASYNC109 (the caller's poll period)
                          *, since: int | None = None) -> bool:
        """Wait up to ``timeout`` s for the live set to change; True when it did.

        With ``since`` (a value of :attr:`changes`), a change that happened
        after it counts at once, so none is missed between a look and a wait.
        """
        if since is not None and since != self._changes:
            return True
        event = self._changed
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()
        except TimeoutError:
            return False
        return True

    async def refresh(self) -> None:
        """Resolve every known service again (addresses may have moved)."""
        for name in list(self._found):
            self._schedule_resolve(self._service_name(name))

    async def close(self) -> None:
        """Stop browsing, cancel pending resolutions, release the sockets; idempotent."""
        browser, zc = self._browser, self._zc
        self._browser = self._zc = None
        tasks = list(self._resolving.values())
        self._resolving.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if browser is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await browser.async_cancel()
        if zc is not None and self._shared is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await zc.async_close()
        self._found.clear()

    # -- internals --

    @staticmethod
    def _instance(name: str) -> str:
        suffix = "." + SERVICE_TYPE
        return name[: -len(suffix)] if name.endswith(suffix) else name

    @staticmethod
    def _service_name(instance: str) -> str:
        return f"{instance}.{SERVICE_TYPE}"

    def _on_state_change(self, **kwargs: Any) -> None:
        # zeroconf calls this with zeroconf=, service_type=, name=, state_change=.
        name = str(kwargs.get("name", ""))
        change = kwargs.get("state_change")
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._handle, name, change)

    def _handle(self, name: str, change: object) -> None:
        if self._browser is None or not name.endswith(SERVICE_TYPE):
            return
        if change is ServiceStateChange.Removed:
            task = self._resolving.pop(name, None)
            if task is not None:
                task.cancel()
            if self._found.pop(self._instance(name), None) is not None:
                self._signal()
        elif self._instance(name) in self._found or name in self._resolving or \
                len(self._found) + len(self._resolving) < MAX_SERVICES:
            self._schedule_resolve(name)
        elif not self._full_warned:
            self._full_warned = True
            log.warning("more than %d Shoal services announced on the LAN; ignoring the "
                        "rest (a misbehaving or hostile host may be flooding mDNS)",
                        MAX_SERVICES)

    def _schedule_resolve(self, name: str) -> None:
        old = self._resolving.pop(name, None)
        if old is not None:
            old.cancel()
        task = asyncio.get_running_loop().create_task(self._resolve(name),
                                                      name=f"mdns-resolve {name}")
        self._resolving[name] = task
        task.add_done_callback(functools.partial(self._resolved, name))

    def _resolved(self, name: str, task: asyncio.Task[None]) -> None:
        if self._resolving.get(name) is task:
            del self._resolving[name]
        if not task.cancelled() and task.exception() is not None:
            log.debug("resolving %s failed: %s", name, task.exception())

    async def _resolve(self, name: str) -> None:
        zc = self._zc
        if zc is None:
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        ok = False
        for attempt in range(RESOLVE_ATTEMPTS):
            # async_request answers from zeroconf's cache when it can.
            ok = await info.async_request(zc.zeroconf, self._resolve_timeout * 1000)
            if ok:
                break
            await asyncio.sleep(0.2 * (attempt + 1))
        if not ok:
            log.debug("could not resolve %s", name)
            return
        found = parse_record(self._instance(name), dict(info.properties or {}),
                             info.parsed_addresses(IPVersion.V4Only), info.port,
                             self._local_nets)
        instance = self._instance(name)
        if found is None:
            if self._found.pop(instance, None) is not None:
                self._signal()
            return
        if instance not in self._found and len(self._found) >= MAX_SERVICES:
            return
        if self._found.get(instance) != found or \
                self._found[instance].addresses != found.addresses:
            self._found[instance] = found
            self._signal()

    def _signal(self) -> None:
        self._changes += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()
