"""A head that joins another fleet with a code leaves the old fleet whole: its links with
the old fleet's heads, the nodes that joined it from there, and its announcement and
finders go, and it meets the new fleet's head with the new token. Mock runtime, real
sockets on 127.0.0.1 (issue 21, item 6)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from pathlib import Path

import pytest

from engine.credentials import tokens
from engine.discovery.fleet_id import fleet_id
from engine.service import Shoal
from engine.settings import DiscoverySettings, NodeSettings, Settings
from tests.integration.test_service import QUIET, both, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def linked(shoal: Shoal, head_id: str) -> bool:
    """Whether ``shoal``'s head has a live link with the head ``head_id`` now."""
    return any(h.head_id == head_id and h.linked and not h.this_machine
               for h in shoal.snapshot().heads)


def own_id(shoal: Shoal) -> str:
    [me] = [h for h in shoal.snapshot().heads if h.this_machine]
    return me.head_id


async def give_token(home: Path, token: bytes) -> None:
    await asyncio.to_thread(tokens.write_token, tokens.token_path(home), token)


async def test_a_head_that_joins_another_fleet_leaves_the_old_one(tmp_path: Path):
    token_a, token_b = secrets.token_bytes(32), secrets.token_bytes(32)
    for home, token in (("a", token_a), ("x", token_a), ("b", token_b)):
        await give_token(tmp_path / home, token)
    async with contextlib.AsyncExitStack() as stack:
        # x: a head of fleet A, taking nodes that join
        x = await stack.enter_async_context(
            running(both(tmp_path / "x", fleet_listen="127.0.0.1:0"), drain=0.5))
        x_host, x_port = x.fleet_address  # type: ignore[misc]
        # a: another head of fleet A, that syncs aliases with x
        a_settings = both(tmp_path / "a", fleet_listen="127.0.0.1:0")
        a = await stack.enter_async_context(running(Settings(
            home=a_settings.home, head=a_settings.head, node=a_settings.node,
            discovery=DiscoverySettings(mode="none", seeds=(f"{x_host}:{x_port}",))),
            drain=0.5))
        await until(lambda: linked(a, own_id(x)) and linked(x, own_id(a)),
                    "the heads of fleet A to link")
        # n: a node of fleet A that joined x
        n = await stack.enter_async_context(running(Settings(
            home=tmp_path / "n", discovery=QUIET,
            node=NodeSettings(model="mock-m", runtime="mock", lanes=1, identity="n-node")),
            drain=0.5))
        await n.join((await x.pairing(head=f"{x_host}:{x_port}")).url)
        await until(lambda: any(nd.identity == "n-node" and nd.state == "ready"
                                for nd in x.snapshot().nodes), "n's node in x's fleet")
        # b: the head of fleet B, whose code x joins
        b = await stack.enter_async_context(
            running(both(tmp_path / "b", fleet_listen="127.0.0.1:0"), drain=0.5))
        b_host, b_port = b.fleet_address  # type: ignore[misc]
        code = (await b.pairing(head=f"{b_host}:{b_port}")).url

        joined = await x.join(code)

        assert joined.heads == (f"{b_host}:{b_port}",)
        assert x.snapshot().fleet_id == fleet_id(token_b)
        # the nodes of fleet A that joined x are forgotten, not redialed with B's token
        assert all(nd.identity != "n-node" for nd in x.snapshot().nodes)
        # x's link with fleet A's head is closed, and not made again (A's token is refused)
        await until(lambda: not linked(a, own_id(x)) and not linked(x, own_id(a)),
                    "x's link with fleet A's head to close")
        # x meets fleet B's head with B's token: aliases sync between them
        await until(lambda: linked(x, own_id(b)) and linked(b, own_id(x)),
                    "x to link with fleet B's head")
        change = await x.aliases.set("coder", "mock-m")
        assert change.line == "coder -> mock-m (ver 1): 2/2 heads"
        await until(lambda: any(r.name == "coder" for r in b.snapshot().aliases),
                    "the alias set at x to reach B's head")
        assert all(r.name != "coder" for r in a.snapshot().aliases)
        # fleet B's head takes x's node
        await until(lambda: any(nd.identity.startswith(socket.gethostname())
                                and nd.link == "joined"
                                and nd.state == "ready" for nd in b.snapshot().nodes),
                    "x's node in fleet B")
