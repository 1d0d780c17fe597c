"""The `Shoal` object with the real SmolLM2 model on llama.cpp, in process: two machines'
worth of Shoal pair, join, answer, pause, move the API and leave; nothing is left behind
(the loop-lag probe and the leak check of tests/conftest.py watch every step)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from engine import events as ev
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
QUIET = DiscoverySettings(mode="none")
NAME = "SmolLM2-135M-Instruct.Q4_1"  # a model given by path goes by its file name


async def chat(shoal: Shoal, query: str = "", **kw: object) -> tuple[int, dict]:
    assert shoal.api_url is not None
    body = {"model": NAME, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}], **kw}
    async with aiohttp.ClientSession() as http, \
            http.post(shoal.api_url + "/chat/completions" + query, json=body) as r:
        return r.status, await r.json()


async def test_two_machines_pair_join_answer_pause_and_leave(tmp_path: Path,
                                                             smollm2_gguf: Path):
    model = str(smollm2_gguf)
    a = await Shoal.start(Settings(
        home=tmp_path / "a", discovery=QUIET,
        head=HeadSettings(model=model, http="127.0.0.1:0", fleet_listen="127.0.0.1:0",
                          queue_timeout_s=1.0),
        node=NodeSettings(model=model, lanes=2, max_context=1024, identity="a-node")))
    b = await Shoal.start(Settings(home=tmp_path / "b", discovery=QUIET,
                                   node=NodeSettings(model=model, lanes=2, max_context=1024,
                                                     identity="b-node")))
    try:
        events = a.events()
        await until(lambda: a.snapshot().ready_nodes == 1, "a's own node")
        snap = a.snapshot()
        assert snap.model == NAME and snap.roles.node is not None
        assert snap.roles.node.runtime == "llamacpp" and snap.context_window() == 1024
        status, first = await chat(a)
        assert status == 200 and len(first["choices"][0]["message"]["content"].split()) >= 2

        host, port = a.fleet_address  # type: ignore[misc]
        await a.create_fleet("desk")
        pairing = await a.pairing(head=f"{host}:{port}")
        joined = await b.join(pairing.url)
        assert joined.model == NAME and joined.fleet == "desk"
        await until(lambda: a.snapshot().ready_nodes == 2, "b's node in a's fleet")
        # the same greedy answer from the other machine's node
        status, there = await chat(a, "?host=b-node")
        assert status == 200
        assert there["choices"][0]["message"]["content"] == \
            first["choices"][0]["message"]["content"]

        # pausing a's node sends work to b; pausing both answers at once with why
        await a.pause_serving(True)
        await until(lambda: next(n for n in a.snapshot().nodes if n.key == "local")
                    .state == "paused", "a's node to show as paused")
        status, body = await chat(a)
        assert status == 200
        await b.pause_serving(True)
        await until(lambda: all(n.state == "paused" for n in a.snapshot().nodes),
                    "every node paused")
        status, body = await chat(a)
        assert status == 503 and body["error"]["code"] == "fleet_paused"
        await a.pause_serving(False)
        await b.pause_serving(False)

        # the API moves off and back on; the node keeps serving the fleet meanwhile
        await a.set_head(False)
        assert a.api_url is None
        await a.set_head(True)
        await until(lambda: a.snapshot().ready_nodes >= 1, "a's node linked again")
        assert (await chat(a, "?host=a-node"))[0] == 200

        done = await b.leave()
        assert any("closed the links" in line for line in done)
        assert not b.snapshot().roles.member
        seen = []
        while (e := events.get_nowait()) is not None:
            seen.append(e)
        kinds = {type(e) for e in seen}
        assert {ev.NodeLinked, ev.SessionPlaced, ev.SessionFinished, ev.RolesChanged} <= kinds
        assert any(isinstance(e, ev.SessionFinished) and e.node == "b-node" for e in seen)
        events.close()
    finally:
        await asyncio.gather(a.stop(drain=2), b.stop(drain=2))
