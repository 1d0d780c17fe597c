"""Tailscale status parsing, state checks and LocalAPI locations (no sockets)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.discovery import tailscale
from engine.discovery.tailscale import (
    LocalAPI,
    TailnetPeer,
    TailnetStatus,
    TailscaleError,
    check_running,
    online_peer_addresses,
    parse_status,
)
from tests.fake_tailscaled import FakeState, status_json

PEERS = [
    {"HostName": "desk", "TailscaleIPs": ["fd7a:115c:a1e0::5", "100.101.1.5"], "Online": True,
     "OS": "macOS"},
    {"HostName": "laptop", "TailscaleIPs": ["100.101.1.6"], "Online": False},
    {"HostName": "v6only", "TailscaleIPs": ["fd7a:115c:a1e0::7"], "Online": True},
]


def real_shape(state: str = "Running") -> bytes:
    return json.dumps(status_json(FakeState(peers=[dict(p) for p in PEERS],
                                            backend_state=state))).encode()


def test_parse_real_shape() -> None:
    st = parse_status(real_shape())
    assert st.backend_state == "Running"
    assert st.self_peer.host_name == "this-machine"
    assert st.self_peer.ips == ("100.64.0.1", "fd7a:115c:a1e0::1")
    assert st.self_peer.dns_name.endswith(".ts.net.")
    assert [p.host_name for p in st.peers] == ["desk", "laptop", "v6only"]
    desk = st.peers[0]
    assert desk == TailnetPeer("desk", "desk.tail1a2b3c.ts.net.",
                               ("fd7a:115c:a1e0::5", "100.101.1.5"), True, "macOS")


def test_only_online_peers_first_ipv4() -> None:
    st = parse_status(real_shape())
    assert online_peer_addresses(st) == [("desk", "100.101.1.5"), ("v6only", "fd7a:115c:a1e0::7")]


def test_peer_without_hostname_uses_dns_label() -> None:
    st = TailnetStatus("Running", TailnetPeer("", "", (), True),
                       [TailnetPeer("", "box.tail.ts.net.", ("100.64.0.9",), True)])
    assert online_peer_addresses(st) == [("box", "100.64.0.9")]


def test_logged_out_status_has_no_peers_and_is_refused() -> None:
    st = parse_status(real_shape("NeedsLogin"))
    assert st.peers == [] and st.self_peer.ips == ()
    with pytest.raises(TailscaleError) as err:
        check_running(st)
    assert str(err.value) == "Tailscale is not logged in; run `tailscale up`"


@pytest.mark.parametrize(("state", "words"), [
    ("Stopped", "run `tailscale up`"),
    ("NoState", "run `tailscale up`"),
    ("NeedsMachineAuth", "admin console"),
    ("Weird", "check `tailscale status`"),
])
def test_states_refused_with_fix(state: str, words: str) -> None:
    with pytest.raises(TailscaleError) as err:
        check_running(TailnetStatus(state, TailnetPeer("", "", (), False), []))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_running_and_starting_accepted() -> None:
    for state in ("Running", "Starting"):
        check_running(TailnetStatus(state, TailnetPeer("", "", (), True), []))


@pytest.mark.parametrize("body", [b"{", b"[]", b"\xff\xfe", b'{"Peer": {}}',
                                  b'{"BackendState": "Running", "Peer": []}',
                                  b'{"BackendState": "Running", "Peer": {"k": 3}}',
                                  b'{"BackendState": "Running", "Self": {"HostName": 5}}',
                                  b'{"BackendState": 1}'])
def test_bad_json_is_one_clear_line(body: bytes) -> None:
    with pytest.raises(TailscaleError) as err:
        parse_status(body)
    assert "tailscale" in str(err.value) and "\n" not in str(err.value)


def test_bad_ips_are_skipped() -> None:
    st = parse_status({"BackendState": "Running", "Peer": {"nodekey:1": {
        "HostName": "a", "TailscaleIPs": ["nope", 7, "100.64.0.2"], "Online": True}}})
    assert st.peers[0].ips == ("100.64.0.2",)


def test_linux_default_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tailscale, "_platform", lambda: "linux")
    monkeypatch.setattr(tailscale, "_exists", lambda p: p == "/run/tailscale/tailscaled.sock")
    assert tailscale.default_socket_path() == "/run/tailscale/tailscaled.sock"
    monkeypatch.setattr(tailscale, "_exists", lambda p: False)
    monkeypatch.setattr(tailscale, "_isdir", lambda p: True)
    assert tailscale.default_socket_path() == "/var/run/tailscale/tailscaled.sock"


def test_macos_default_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tailscale, "_platform", lambda: "darwin")
    monkeypatch.setattr(tailscale, "_exists", lambda p: p == "/var/run/tailscaled.socket")
    assert tailscale.default_socket_path() == "/var/run/tailscaled.socket"
    monkeypatch.setattr(tailscale, "_exists", lambda p: False)
    assert tailscale.default_socket_path() is None


def test_given_socket_wins() -> None:
    assert tailscale.default_endpoint("/tmp/x.sock") == LocalAPI(socket_path="/tmp/x.sock")


def test_macos_app_variants(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tailscale, "_platform", lambda: "darwin")
    monkeypatch.setattr(tailscale, "_exists", lambda p: False)
    macsys = tmp_path / "Library-Tailscale"
    containers = tmp_path / "Group Containers"
    macsys.mkdir()
    containers.mkdir()
    monkeypatch.setattr(tailscale, "MACSYS_DIR", macsys)
    monkeypatch.setattr(tailscale, "APPSTORE_CONTAINERS", containers)

    # Nothing found: one line naming the flag and the open-source daemon.
    with pytest.raises(TailscaleError) as err:
        tailscale.default_endpoint()
    assert "--tailscale-socket" in str(err.value) and "open-source tailscaled" in str(err.value)

    # App Store variant: port and password in the file name inside the group container.
    group = containers / "W5364U7YZB.io.tailscale.ipn.macos"
    group.mkdir()
    (group / "sameuserproof-61577-2ae2ec9e0aa2005784f1").write_text("")
    ep = tailscale.default_endpoint()
    assert (ep.tcp_port, ep.password) == (61577, "2ae2ec9e0aa2005784f1")
    assert "2ae2ec9e" not in repr(ep)

    # Standalone (macsys) variant: ipnport symlink and sameuserproof-PORT file.
    os.symlink("52001", macsys / "ipnport")
    (macsys / "sameuserproof-52001").write_text("s3cret\n")
    ep = tailscale.default_endpoint()
    assert (ep.tcp_port, ep.password) == (52001, "s3cret")
