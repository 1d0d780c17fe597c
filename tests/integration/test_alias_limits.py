"""An alias table too large for a link record (two tables that grew apart, merged) does
not break the head: its sync is skipped with one line in the log, the link to the other
head stays, and an alias change that would grow the table is refused with 413 and the
fix, not a 500. Two heads in this loop, linked over a real fleet link on 127.0.0.1, and
the alias routes over HTTP."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from engine.api.app import build_app
from engine.head.access.admin_secret import HEADER
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.link.messages import MAX_RECORD
from tests.integration.fleet_heads import listening, make_head
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
ADMIN = "ad" * 32
WIDE = "\U0001d538"  # 4 bytes in UTF-8


def widest(tag: str) -> str:
    return tag + WIDE * (al.MAX_NAME_LEN - len(tag))


@pytest.fixture(scope="module")
def oversized() -> al.AliasTable:
    """A table past what one link record carries, as merges of tables that grew apart
    can make it (made before the test's loop runs: it takes a while)."""
    entries = [al.AliasEntry(widest(f"a{i}-"), widest(f"t{i}-"),
                             tuple(widest(f"f{i}-{j}-") for j in range(al.MAX_FALLBACKS)),
                             1, 1.0, "h" * al.MAX_NAME_LEN) for i in range(620)]
    assert len(json.dumps([e.to_dict() for e in entries], ensure_ascii=False).encode()) \
        > MAX_RECORD
    return al.AliasTable(entries)


@asynccontextmanager
async def serving(head: Head) -> AsyncIterator[str]:
    """The head's HTTP API on 127.0.0.1: its URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    runner = web.AppRunner(build_app(head), access_log=None)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
        sock.close()


async def test_a_table_too_large_to_send_keeps_the_link_and_refuses_growth(
        oversized: al.AliasTable, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shoal.head")
    big = make_head(oversized, "h-big")
    big.admin_secret = ADMIN
    other = make_head(al.AliasTable(), "h-other")
    assert big.peers is not None and other.peers is not None
    try:
        async with listening(other) as port, serving(big) as url, \
                aiohttp.ClientSession(headers={HEADER: ADMIN}) as http:
            big.peers.dial("127.0.0.1", port)
            await until(lambda: any(p.link is not None for p in big.peers.peers.values()),
                        "the two heads linked")
            async with http.put(f"{url}/v1/aliases/coder", json={"target": "mock-m"}) as r:
                status, body = r.status, await r.text()
            assert status == 413, body
            error = json.loads(body)["error"]
            assert error["code"] == "alias_table_full" and "shoal alias rm" in error["message"]
            assert big.aliases.get("coder") is None
            await until(lambda: "too large to send" in caplog.text,
                        "the skipped sync said in the log")
            # a push finds the table as large: not sent, not said again, the link kept
            assert await big.peers.spread([]) == (1, 2)
            assert caplog.text.count("too large to send") == 1
            assert all(p.link is not None and not p.link.closed
                       for p in big.peers.peers.values())
            assert other.aliases.snapshot() == []
    finally:
        await big.close()
        await other.close()
