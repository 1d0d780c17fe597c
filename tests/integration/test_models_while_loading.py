"""`GET /v1/models` as `shoal serve` (and the app) open their port: the head answers before
its local node has loaded and linked, and an editor that lists models then must see the
model, marked loading, not an empty list.

The local node's engine is the mock, its load held on an event (its `start` waits for
the test), so the moment between the port opening and the node linking lasts as long
as the test needs. Real sockets on 127.0.0.1, in process, under the loop and leak watch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.runtimes.mock import MockEngine
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.waiting import until, until_result

pytestmark = pytest.mark.timeout(60)
MODEL = "mock-m"
QUIET = DiscoverySettings(mode="none")


def _settings(home: Path, *, node: bool) -> Settings:
    return Settings(home=home, discovery=QUIET,
                    head=HeadSettings(model=MODEL, runtime="mock", http="127.0.0.1:0"),
                    node=NodeSettings(model=MODEL, runtime="mock", lanes=2) if node else None)


async def _get(http: aiohttp.ClientSession, shoal: Shoal, path: str) -> tuple[int, Any]:
    assert shoal.api_url is not None
    async with http.get(shoal.api_url.removesuffix("/v1") + path) as r:
        return r.status, await r.json()


async def test_the_local_model_is_listed_loading_then_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    began, release = asyncio.Event(), asyncio.Event()

    async def held_start(self: MockEngine) -> None:
        began.set()
        await release.wait()

    monkeypatch.setattr(MockEngine, "start", held_start)
    shoal = Shoal(_settings(tmp_path, node=True))
    opening = asyncio.create_task(shoal.open(), name="test-open")
    try:
        await until(began.is_set, "the local node's engine to begin its load")
        assert shoal.api_url is not None  # the head runs: its port is open
        async with aiohttp.ClientSession() as http:
            status, health = await _get(http, shoal, "/health")
            assert status == 200 and health["nodes_ready"] == 0
            status, listed = await _get(http, shoal, "/v1/models")
            assert status == 200 and listed["object"] == "list"
            [loading] = listed["data"]
            assert (loading["id"], loading["object"], loading["owned_by"]) == (
                MODEL, "model", "shoal")
            assert loading["status"] == "loading" and loading["available"] is False
            assert loading["context_window"] == 0  # no node has said its window yet
            status, one = await _get(http, shoal, f"/v1/models/{MODEL}")
            assert status == 200 and one["status"] == "loading"

            release.set()
            async with asyncio.timeout(30):
                await opening
            listed = await until_result(
                lambda: _get(http, shoal, "/v1/models"),
                lambda got: [m["status"] for m in got[1]["data"]] == ["ready"],
                what="the model listed ready once the local node linked")
            [ready] = listed[1]["data"]
            assert ready["id"] == MODEL and ready["available"] is True
            assert ready["context_window"] == 4096
    finally:
        release.set()
        if not opening.done():
            opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await shoal.stop(drain=0)


async def test_a_head_with_no_local_node_lists_nothing_it_waits_for(tmp_path: Path):
    """No node of this machine is coming (`shoal serve --fleet ...`): nothing is listed
    as loading, only what nodes serve (none yet)."""
    shoal = await Shoal.start(_settings(tmp_path, node=False))
    try:
        async with aiohttp.ClientSession() as http:
            status, listed = await _get(http, shoal, "/v1/models")
        assert status == 200 and listed["data"] == []
    finally:
        await shoal.stop(drain=0)
