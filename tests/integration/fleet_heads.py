"""Heads of a fleet in the test's own loop, as the tests of their links build them: a mock
model, a fleet token, a link to other heads, and a fleet listener on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.head.fleet.joins import JoinListener
from engine.head.fleet.links import Fleet
from engine.head.fleet.peers import HeadPeers
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.prompt.model import load_head_model

TOKEN = bytes(range(32, 64))


def make_head(table: al.AliasTable, head_id: str, name: str = "") -> Head:
    model = load_head_model("mock", "mock-m", name="mock-m")
    fleet = Fleet(model=model.name, head_id=head_id, psk=TOKEN, name=name)
    head = Head([model], fleet, SessionRunner(fleet), aliases=table)
    head.peers = HeadPeers(head_id=head_id, name=name, model=model.name, psk=TOKEN,
                           listen_port=0, table=lambda: head.aliases,
                           on_merged=head.aliases_merged)
    return head


@asynccontextmanager
async def listening(head: Head) -> AsyncIterator[int]:
    """The head's fleet listener, where another head dials it: its port."""
    listener = JoinListener(head.fleet, peers=head.peers)
    sock = socket.create_server(("127.0.0.1", 0))
    try:
        await listener.listen_on(sock)
        yield listener.listen_port
    finally:
        await listener.close()
        sock.close()
