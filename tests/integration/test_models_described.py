"""Models that describe themselves, through the clients that read them: `/v1/models` (the
`openai` SDK) with context window and capabilities for models and aliases, Ollama's
`/api/show` and `/api/ps` (the `ollama` client), and the fleet snapshot, all from one
function."""

from __future__ import annotations

import aiohttp
import ollama
import pytest

from engine.head.access.admin_secret import HEADER
from engine.head.observe import models_snapshot
from tests.integration.agents import (
    MODEL,
    agent_head,
    call,
    engines,
    ollama_client,
    openai_client,
)
from tests.integration.test_api_surface import Live
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
ADMIN = "ab" * 32  # this machine's admin secret, as `shoal alias` sends it


async def test_models_describe_themselves():
    async with agent_head(nodes=2, lanes=3, admin_secret=ADMIN) as live, \
            aiohttp.ClientSession() as http, openai_client(live.url("")) as client:
        for name, target in (("coder", MODEL), ("gone", "no-such-model")):
            async with http.put(live.url(f"/v1/aliases/{name}"), json={"target": target},
                                headers={HEADER: ADMIN}) as r:
                assert r.status == 200, await r.text()
        models = {m.id: m.model_dump() for m in (await call(client.models.list)).data}
        assert set(models) == {MODEL, "coder", "gone"}
        flags = {"chat": True, "completion": True, "tools": True, "fill_in_middle": False,
                 "thinking": False, "embeddings": False}
        real = models[MODEL]
        assert real["context_window"] == real["context_length"] == 4096
        assert real["capabilities"] == flags and real["available"] is True
        alias = models["coder"]
        assert alias["resolves_to"] == MODEL and alias["available"] is True
        assert alias["capabilities"] == flags and alias["context_window"] == 4096
        gone = models["gone"]
        assert gone["available"] is False and gone["resolves_to"] is None
        assert gone["capabilities"] is None and gone["context_window"] == 0
        one = await call(client.models.retrieve, "coder")
        assert one.model_dump()["capabilities"] == flags
        # the same function speaks for the fleet snapshot
        (snap,) = models_snapshot(live.head)
        assert snap.tools is True and snap.fill_in_middle is False
        # Ollama's view, through its own client
        async with ollama_client(live.url("")) as oll:
            await ollama_view(live, http, oll)


async def ollama_view(live: Live, http: aiohttp.ClientSession, oll: ollama.Client) -> None:
    """/api/show and /api/ps as Ollama's client reads them."""
    shown = await call(oll.show, MODEL)
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo["general.architecture"] == "mock"
    assert shown.modelinfo["mock.context_length"] == 4096
    ps = await call(oll.ps)
    assert [m.model for m in ps.models] == [MODEL, MODEL]
    assert all(m.context_length == 4096 for m in ps.models)
    async with http.get(live.url("/api/ps")) as r:
        raw = (await r.json())["models"]
    assert sorted(m["shoal"]["node"] for m in raw) == ["n0", "n1"]
    assert all(m["shoal"]["lanes"] == 3 and m["shoal"]["kv_total"] == 3 * 4096
               for m in raw)
    # a node that leaves leaves the list
    await live.agents[1].close()
    await until(lambda: sum(p.state == "ready" for p in live.head.fleet.pools.values())
                == 1, "the head to see the node go")
    assert len((await call(oll.ps)).models) == 1
    assert engines(live)[0].prompts == []  # describing needs no generation
