"""The listener of a node that heads dial (`LocalNode.bind_listener`): a node whose model
changed listens again at the port it had, where its settings leave the port to the system
(its heads dial it there); a port its settings name stays theirs."""

from __future__ import annotations

import socket

from engine.roles.local_node import LocalNode
from engine.settings import NodeSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bound_port(settings: NodeSettings, again: int = 0) -> int:
    sock = LocalNode.bind_listener(settings, None, again=again)
    assert sock is not None
    with sock:
        return int(sock.getsockname()[1])


def test_a_node_on_any_port_listens_again_where_it_listened() -> None:
    before = free_port()
    assert bound_port(NodeSettings(listen="127.0.0.1:0"), again=before) == before
    assert bound_port(NodeSettings(listen="127.0.0.1:0")) != 0  # the system's choice


def test_a_port_the_settings_name_is_kept() -> None:
    named, before = free_port(), free_port()
    assert bound_port(NodeSettings(listen=f"127.0.0.1:{named}"), again=before) == named
    assert LocalNode.bind_listener(NodeSettings(listen=None), None, again=before) is None
