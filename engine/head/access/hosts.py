"""Which ``Host`` names the head serves: loopback, this machine's names and addresses,
and what the user allows (``--allow-host``). A page whose DNS name was rebound to
127.0.0.1 reaches the head as same-origin with its own name in ``Host``; refusing
names that are not this machine's closes that door (as Ollama does).

`host_allowed` is pure; `machine_names` reads this machine's names and interfaces.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Collection, Iterable

log = logging.getLogger("shoal.api")



class HostError(ValueError):
    """An unusable --allow-host entry; one line, cause and fix."""


def _port_ok(text: str) -> bool:
    return text == "" or (text.isascii() and text.isdigit() and len(text) <= 5)


def host_of(header: str) -> str | None:
    """The host of a ``Host`` value, lower case, without port, brackets or a trailing
    dot; None when it is malformed."""
    h = header.strip().lower()
    if h.startswith("["):
        inner, sep, rest = h[1:].partition("]")
        if not sep or not inner or (rest and not (rest[0] == ":" and _port_ok(rest[1:]))):
            return None
        return _canonical(inner)
    if h.count(":") > 1:  # a bare IPv6 address: not valid in Host, but unambiguous
        return _canonical(h)
    name, _, port = h.partition(":")
    if not name or not _port_ok(port):
        return None
    return _canonical(name.rstrip("."))


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])  # no zone id
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _canonical(name: str) -> str:
    ip = _ip(name)
    return str(ip) if ip is not None else name


def _names_this_machine(host: str) -> bool:
    """Loopback (127.0.0.0/8, ::1, localhost, *.localhost) or the unspecified address,
    which also reaches this machine."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    ip = _ip(host)
    return ip is not None and (ip.is_loopback or ip.is_unspecified)


def _matches(host: str, pattern: str) -> bool:
    if pattern == "*" or pattern == host:
        return True
    return pattern.startswith("*.") and host.endswith(pattern[1:])


def host_allowed(host_header: str | None, allowed: Iterable[str],
                 own_names: Collection[str]) -> bool:
    """Whether a request that names ``host_header`` is served.

    A missing or empty ``Host`` (HTTP/1.0, an authority-less request) is; so is
    one naming loopback, one of ``own_names`` (this machine's names and
    addresses), or one ``allowed`` (``*``, ``*.example.com``, or an exact name
    or address), with or without a port. Anything else may be a web page whose
    name now resolves here (DNS rebinding), reading the API with the user's
    browser.
    """
    if host_header is None or not host_header.strip():
        return True
    host = host_of(host_header)
    if host is None:
        return False
    if _names_this_machine(host):
        return True
    if any(host == _canonical(n.lower().rstrip(".")) for n in own_names):
        return True
    return any(_matches(host, p) for p in allowed)


def parse_allowed_hosts(specs: Iterable[str]) -> tuple[str, ...]:
    """``--allow-host`` values (each may be a comma list) as patterns for host_allowed."""
    out: list[str] = []
    for spec in specs:
        for raw in spec.split(","):
            entry = raw.strip()
            if not entry:
                continue
            if entry == "*":
                out.append("*")
                continue
            wild = entry.startswith("*.")
            host = host_of(entry[2:] if wild else entry)
            if host is None or "*" in host or "/" in host:
                raise HostError(f"--allow-host {entry[:100]!r} is not a host name or address; "
                                "write it like shoal.example.com, *.example.com, "
                                "192.168.1.5 or *")
            out.append(f"*.{host}" if wild else host)
    return tuple(dict.fromkeys(out))


def machine_names(*, fqdn: bool = False) -> frozenset[str]:
    """This machine's host names and interface addresses, as a Host may name them.

    ``fqdn`` adds the fully qualified name, which can mean a DNS query: ask for it
    at start, not on the request path.
    """
    names: set[str] = set()
    host = socket.gethostname().lower().rstrip(".")
    if host:
        short = host.split(".", 1)[0]
        names |= {host, short, f"{short}.local"}  # .local: the mDNS name on a LAN
    if fqdn:
        names.add(socket.getfqdn().lower().rstrip("."))
    try:
        import ifaddr

        for adapter in ifaddr.get_adapters():
            for ip in adapter.ips:
                names.add(_canonical(ip.ip if isinstance(ip.ip, str) else ip.ip[0]))
    except (ImportError, OSError) as exc:
        log.debug("no interface addresses: %s", type(exc).__name__)
    names.discard("")
    return frozenset(names)
