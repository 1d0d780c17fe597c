"""Back into the fleet after a restart (`engine/service/rejoin.py`): while the fleet's head
is away the snapshot says this machine waits and why, the engine tries again, links as
soon as the head is back, and a leave settles it (no more tries, no error left)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from engine.credentials import tokens
from engine.credentials.keeper import new_token
from engine.service import Shoal, rejoin
from engine.settings import JoinSettings, NodeSettings, Settings
from tests.integration.test_service import QUIET, both, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(home: Path, port: int) -> Shoal:
    return Shoal(Settings(home=home, discovery=QUIET,
                          node=NodeSettings(model="mock-m", runtime="mock", lanes=2,
                                            identity="b-node")),
                 rejoin=JoinSettings(head=f"127.0.0.1:{port}"))


async def test_the_fleet_is_joined_again_once_its_head_is_back(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rejoin, "REJOIN_EVERY_S", 0.2)
    token = new_token()
    for home in ("a", "b"):
        tokens.store_fleet_token(tmp_path / home, token, "file")
    port = _free_port()
    b = _member(tmp_path / "b", port)
    await b.open()
    try:
        await until(lambda: b.snapshot().roles.rejoin_error, "b to say why it is not linked")
        roles = b.snapshot().roles
        assert roles.rejoining and not roles.member
        assert roles.rejoin_error.startswith(f"nothing listens at 127.0.0.1:{port}")  # type: ignore[union-attr]
        async with running(both(tmp_path / "a", fleet_listen=f"127.0.0.1:{port}")) as a:
            await until(lambda: b.snapshot().roles.member, "b linked with the head, back")
            roles = b.snapshot().roles
            assert not roles.rejoining and roles.rejoin_error is None
            await until(lambda: any(n.identity == "b-node" and n.state == "ready"
                                    for n in a.snapshot().nodes), "b's node in a's fleet")
    finally:
        await b.stop(drain=1)


async def test_a_leave_settles_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rejoin, "REJOIN_EVERY_S", 0.2)
    tokens.store_fleet_token(tmp_path / "b", new_token(), "file")
    b = _member(tmp_path / "b", _free_port())
    await b.open()
    try:
        await until(lambda: b.snapshot().roles.rejoin_error, "b to say why it is not linked")
        await b.leave()
        roles = b.snapshot().roles
        assert not roles.rejoining and roles.rejoin_error is None and not roles.member
    finally:
        await b.stop(drain=1)
