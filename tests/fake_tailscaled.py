"""A fake tailscaled LocalAPI on a unix socket, answering the real status JSON shape.

``GET /localapi/v0/status`` returns an ``ipnstate.Status`` as tailscaled 1.x
writes it (field names from tailscale.com/ipn/ipnstate): Version, TUN,
BackendState, HaveNodeKey, AuthURL, TailscaleIPs, Self, Health,
MagicDNSSuffix, CurrentTailnet, CertDomains, Peer (a map keyed by
``nodekey:<hex>`` of PeerStatus objects), User and ClientVersion. Like the real
daemon it refuses a Host other than ``local-tailscaled.sock`` and any request
with a Referer or Origin (HTTP 403 "invalid localapi request").

Each dict in ``peers`` is merged over a complete PeerStatus, so a test gives
only what matters (``HostName``, ``TailscaleIPs``, ``Online``...). The list is
kept by reference: change it (or ``runner.app[STATE]``) and the next status
answer shows the change.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

ZERO_TIME = "0001-01-01T00:00:00Z"
SUFFIX = "tail1a2b3c.ts.net"


@dataclass
class FakeState:
    peers: list[dict[str, Any]]
    backend_state: str = "Running"
    requests: list[dict[str, str]] = field(default_factory=list)


STATE = web.AppKey("fake_tailscaled_state", FakeState)


def _key(name: str, kind: str = "nodekey") -> str:
    return f"{kind}:" + hashlib.sha256(f"{kind}/{name}".encode()).hexdigest()


def peer_status(overrides: dict[str, Any], *, index: int) -> dict[str, Any]:
    """A complete PeerStatus with ``overrides`` applied."""
    host = str(overrides.get("HostName") or f"peer{index}")
    ips = overrides.get("TailscaleIPs") or [f"100.64.0.{index + 10}",
                                            f"fd7a:115c:a1e0::{index + 10:x}"]
    online = bool(overrides.get("Online", True))
    base: dict[str, Any] = {
        "ID": f"n{hashlib.sha256(host.encode()).hexdigest()[:12]}CNTRL",
        "PublicKey": _key(host),
        "HostName": host,
        "DNSName": f"{host.lower()}.{SUFFIX}.",
        "OS": "linux",
        "UserID": 4242,
        "TailscaleIPs": ips,
        "AllowedIPs": [f"{ip}/32" if ":" not in ip else f"{ip}/128" for ip in ips],
        "Addrs": ["192.0.2.10:41641"] if online else None,
        "CurAddr": "",
        "Relay": "fra",
        "RxBytes": 0,
        "TxBytes": 0,
        "Created": "2024-05-01T10:00:00Z",
        "LastWrite": ZERO_TIME,
        "LastSeen": ZERO_TIME if online else "2024-05-20T08:30:00Z",
        "LastHandshake": ZERO_TIME,
        "Online": online,
        "ExitNode": False,
        "ExitNodeOption": False,
        "Active": False,
        "PeerAPIURL": [f"http://{ips[0]}:41112"],
        "Capabilities": ["https://tailscale.com/cap/file-sharing"],
        "CapMap": {"https://tailscale.com/cap/file-sharing": None},
        "InNetworkMap": True,
        "InMagicSock": online,
        "InEngine": False,
        "KeyExpiry": "2025-11-01T10:00:00Z",
    }
    base.update(overrides)
    return base


def status_json(state: FakeState) -> dict[str, Any]:
    running = state.backend_state in ("Running", "Starting")
    self_ips = ["100.64.0.1", "fd7a:115c:a1e0::1"]
    self_peer = peer_status({"HostName": "this-machine", "TailscaleIPs": self_ips,
                             "Online": running}, index=0)
    if not running:
        self_peer.update({"TailscaleIPs": None, "DNSName": "", "PeerAPIURL": None,
                          "InNetworkMap": False})
    peers = {}
    if running:
        for i, p in enumerate(state.peers, start=1):
            ps = peer_status(p, index=i)
            peers[ps["PublicKey"]] = ps
    return {
        "Version": "1.76.1-t2e4b3a0a3-g3f1b2c4d5",
        "TUN": True,
        "BackendState": state.backend_state,
        "HaveNodeKey": True,
        "AuthURL": "" if running else "https://login.tailscale.com/a/0123456789abc",
        "TailscaleIPs": self_ips if running else None,
        "Self": self_peer,
        "Health": [] if running else ["You are logged out."],
        "MagicDNSSuffix": SUFFIX,
        "CurrentTailnet": {"Name": "someone@example.com", "MagicDNSSuffix": SUFFIX,
                           "MagicDNSEnabled": True} if running else None,
        "CertDomains": [f"this-machine.{SUFFIX}"] if running else None,
        "Peer": peers or None,
        "User": {"4242": {"ID": 4242, "LoginName": "someone@example.com",
                          "DisplayName": "Someone", "ProfilePicURL": "", "Roles": []}},
        "ClientVersion": None,
    }


async def _status(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.requests.append({"host": request.host, "path": request.path,
                           "method": request.method})
    if request.headers.get("Referer") or request.headers.get("Origin") or \
            request.host not in ("", "local-tailscaled.sock"):
        return web.Response(status=403, text="invalid localapi request\n")
    if request.method != "GET":
        return web.Response(status=405, text="want GET\n")
    return web.json_response(status_json(state), headers={
        "Tailscale-Version": "1.76.1-t2e4b3a0a3-g3f1b2c4d5", "Tailscale-Cap": "106"})


async def serve_fake_tailscaled(path: Path, peers: list[dict[str, Any]],
                                backend_state: str = "Running") -> web.AppRunner:
    """Serve the fake LocalAPI on the unix socket ``path``; ``await runner.cleanup()`` ends it."""
    app = web.Application()
    app[STATE] = FakeState(peers=peers, backend_state=backend_state)
    app.router.add_route("*", "/localapi/v0/status", _status)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.UnixSite(runner, str(path))
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
